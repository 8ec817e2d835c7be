"""From trajectories and a causal LM to the loss inputs (ALGORITHM.md §1).

Layout (verl's): ``input_ids = cat(prompt [B,P] left-padded, response [B,T] right-padded)``,
``z = logits[:, -T-1:-1]`` so ``z[:, t]`` predicts ``y[:, t]`` and ``z[:, 0]`` is Q(s1, ·) at the
last prompt token for every row. Everything after the model runs in fp32.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor, nn

from buffer.records import Trajectory


@dataclass
class Batch:
    """Padded tensors of B trajectories."""

    input_ids: Tensor  # [B, P+T] left-padded prompts then right-padded responses
    attention_mask: Tensor  # [B, P+T] 1 on real tokens
    position_ids: Tensor  # [B, P+T] 0 at the first real prompt token
    responses: Tensor  # [B, T] response ids (pad after the end)
    mask: Tensor  # [B, T] 1 up to and including the first EOS, 0 after
    rollout_logp: Tensor  # [B, T] behaviour log-probs (0 on padding)
    reward: Tensor  # [B] transformed reward

    @property
    def response_len(self) -> int:
        return int(self.responses.shape[1])

    def to(self, device: torch.device | str) -> Batch:
        return Batch(*(t.to(device) for t in self.__dict__.values()))


@dataclass
class SequenceStats:
    logp: Tensor  # [B, T] log pi(y_t | ...), fp32, 0 where mask is 0
    slp: Tensor  # [B] sum_t m_t logp_t
    v1: Tensor  # [B] logsumexp(z[:, 0]) = V(s1)


def eos_mask(responses: Tensor, eos_id: int) -> Tensor:
    """1 up to and including the first EOS, 0 after it (verl ``get_response_mask``)."""
    eos = responses.eq(eos_id).long()
    return (eos.cumsum(1) - eos).eq(0).to(torch.float32)


def collate(trajectories: Sequence[Trajectory], pad_id: int, eos_id: int) -> Batch:
    """Pad B trajectories into a Batch. The mask is the EOS rule intersected with each
    response's length, so padding and anything after the first EOS never count."""
    if not trajectories:
        raise ValueError("cannot collate an empty batch")
    bsz = len(trajectories)
    plen = max(t.prompt_ids.size for t in trajectories)
    tlen = max(t.response_ids.size for t in trajectories)
    ids = np.full((bsz, plen + tlen), pad_id, dtype=np.int64)
    attn = np.zeros((bsz, plen + tlen), dtype=np.int64)
    lens = np.zeros(bsz, dtype=np.int64)
    rlogp = np.zeros((bsz, tlen), dtype=np.float32)
    for i, t in enumerate(trajectories):
        p, r = t.prompt_ids.size, t.response_ids.size
        ids[i, plen - p : plen] = t.prompt_ids
        attn[i, plen - p : plen] = 1
        ids[i, plen : plen + r] = t.response_ids
        attn[i, plen : plen + r] = 1
        rlogp[i, :r] = t.logprobs
        lens[i] = r
    input_ids = torch.from_numpy(ids)
    attention_mask = torch.from_numpy(attn)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    responses = input_ids[:, plen:]
    in_len = (torch.arange(tlen)[None, :] < torch.from_numpy(lens)[:, None]).to(torch.float32)
    mask = eos_mask(responses, eos_id) * in_len
    reward = torch.tensor([t.reward for t in trajectories], dtype=torch.float32)
    return Batch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        responses=responses,
        mask=mask,
        rollout_logp=torch.from_numpy(rlogp) * mask,
        reward=reward,
    )


def sequence_stats(z: Tensor, y: Tensor, m: Tensor) -> SequenceStats:
    """Per-token log-probs, their masked sum and V(s1) from response-aligned logits.

    Args:
        z: [B, T, V] logits; ``z[:, t]`` predicts ``y[:, t]`` (temperature 1: Q = raw logits).
        y: [B, T] response token ids.
        m: [B, T] response mask.
    """
    zf = z.float()  # upcast BEFORE log_softmax / logsumexp (bf16 LSE is unstable)
    logp = zf.log_softmax(-1).gather(-1, y.long()[..., None])[..., 0]
    mf = m.to(logp.dtype)
    logp = logp * mf
    slp = logp.sum(-1)
    v1 = torch.logsumexp(zf[:, 0], dim=-1)
    return SequenceStats(logp=logp, slp=slp, v1=v1)


def response_logits(model: nn.Module, batch: Batch) -> Tensor:
    """[B, T, V] logits that predict the response tokens (only the last T+1 positions are
    projected to the vocabulary: ``logits_to_keep``)."""
    t = batch.response_len
    out = model(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        position_ids=batch.position_ids,
        logits_to_keep=t + 1,
        use_cache=False,
    )
    logits: Tensor = out.logits
    return logits[:, -t - 1 : -1, :]


def policy_stats(model: nn.Module, batch: Batch) -> SequenceStats:
    """Run the model on a batch and return its SequenceStats (grad flows if enabled)."""
    return sequence_stats(response_logits(model, batch), batch.responses, batch.mask)
