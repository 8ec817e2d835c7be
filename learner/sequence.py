"""From trajectories and a causal LM to the loss inputs (docs/algorithm.md §1).

Padded layout (verl's, ``collate``): ``input_ids = cat(prompt [B,P] left-padded, response [B,T]
right-padded)``, ``z = logits[:, -T-1:-1]`` so ``z[:, t]`` predicts ``y[:, t]`` and ``z[:, 0]`` is
Q(s1, ·) at the last prompt token for every row.

Packed layout (``pack``): the B trajectories (prompt then response) concatenated into one row
with no padding, ``position_ids`` restarting at 0 for each and no attention mask, so transformers
keeps attention inside each sequence (``masking_utils.find_packed_sequence_indices``: sdpa, eager
and flex build a document mask from the positions; flash attention runs its varlen kernels). Only
the hidden states that predict a response token (and V(s1)'s) reach the LM head, and their
log-probs land in the same [B, T] layout as the padded path's, so the losses cannot tell them
apart. Everything after the model runs in fp32.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from buffer.records import Trajectory

log = logging.getLogger("reval.learner")


@dataclass
class Batch:
    """The tensors of B trajectories, padded (``collate``) or packed (``pack``). The [B, T]
    fields (responses, mask, behaviour log-probs) have the same layout either way."""

    input_ids: Tensor  # padded: [B, P+T] prompts left-, responses right-padded; packed: [1, L]
    attention_mask: Tensor | None  # padded: [B, P+T] 1 on real tokens; packed: None
    position_ids: Tensor  # padded: [B, P+T] 0 at the first real prompt token; packed: [1, L]
    responses: Tensor  # [B, T] response ids (pad after the end)
    mask: Tensor  # [B, T] 1 on the model's tokens: up to and including the first EOS (or an
    # episode's action mask), 0 after and on padding
    rollout_logp: Tensor  # [B, T] behaviour log-probs (0 on padding and environment tokens)
    reward: Tensor  # [B] transformed reward
    keep: Tensor | None = None
    """Packed: [N] the positions of the row whose hidden states reach the LM head (each
    sequence's last prompt token and all but its last response token)."""
    dest: Tensor | None = None
    """Packed: [N] where each kept position's log-prob lands in the [B, T] layout (b * T + t)."""
    bounds: tuple[int, ...] | None = None
    """Packed: where each sequence starts in the row, then the row's length (``cu_seqlens``)."""
    kv_index: Tensor | None = None
    """Shared prefixes (``share_prompts``): [L, K] the row positions each position attends to
    (its path in the prefix tree, root first, itself last), padded with 0."""
    kv_valid: Tensor | None = None
    """Shared prefixes: [L, K] which of ``kv_index`` are real (False on the padding)."""

    @property
    def response_len(self) -> int:
        return int(self.responses.shape[1])

    @property
    def packed(self) -> bool:
        return self.keep is not None

    def to(self, device: torch.device | str) -> Batch:
        moved: dict[str, Any] = {
            k: v.to(device) if isinstance(v, Tensor) else v for k, v in self.__dict__.items()
        }
        return Batch(**moved)


@dataclass
class SequenceStats:
    logp: Tensor  # [B, T] log pi(y_t | ...), fp32, 0 where mask is 0
    slp: Tensor  # [B] sum_t m_t logp_t
    v1: Tensor  # [B] logsumexp(z[:, 0]) = V(s1)


def eos_mask(responses: Tensor, eos_id: int) -> Tensor:
    """1 up to and including the first EOS, 0 after it (verl ``get_response_mask``)."""
    eos = responses.eq(eos_id).long()
    return (eos.cumsum(1) - eos).eq(0).to(torch.float32)


def _spans(lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(row, place in its row) of each element of rows of ``lengths`` laid end to end."""
    rows = np.repeat(np.arange(lengths.size), lengths)
    starts = np.cumsum(lengths) - lengths
    return rows, np.arange(rows.size) - starts[rows]


def collate(trajectories: Sequence[Trajectory], pad_id: int, eos_id: int) -> Batch:
    """Pad B trajectories into a Batch. The mask is each response's length intersected with,
    for a single-turn record, the EOS rule (padding and anything after the first EOS never
    count) or, for a multi-turn episode, its ``action_mask`` (each of the model's turns ends with
    its own EOS; the environment's tokens between them never count: they leave the log-prob
    sums, V(s1) aside, and so the value terms and GRPO's token mean)."""
    out = _response_fields(trajectories, pad_id, eos_id)
    bsz, tlen = len(trajectories), out.response_len
    plens = np.fromiter((t.prompt_ids.size for t in trajectories), np.int64, bsz)
    plen = int(plens.max())
    ids = np.full((bsz, plen + tlen), pad_id, dtype=np.int64)
    attn = np.zeros((bsz, plen + tlen), dtype=np.int64)
    # every prompt right-aligned to column plen (one scatter), the responses from it
    p_row, p_col = _spans(plens)
    p_col += plen - plens[p_row]
    ids[p_row, p_col] = np.concatenate([t.prompt_ids for t in trajectories])
    attn[p_row, p_col] = 1
    ids[:, plen:] = out.responses.numpy()
    attn[:, plen:] = out.lengths[:, None] > np.arange(tlen)[None, :]
    input_ids = torch.from_numpy(ids)
    attention_mask = torch.from_numpy(attn)
    return Batch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=(attention_mask.cumsum(-1) - 1).clamp(min=0),
        responses=input_ids[:, plen:],
        mask=out.mask,
        rollout_logp=out.rollout_logp,
        reward=out.reward,
    )


@dataclass
class _Responses:
    """The [B, T] fields of a Batch (``collate``'s; ``pack`` and ``share_prompts`` lay out the
    prompts their own way)."""

    responses: Tensor
    mask: Tensor
    rollout_logp: Tensor
    reward: Tensor
    lengths: np.ndarray  # [B] response lengths

    @property
    def response_len(self) -> int:
        return int(self.responses.shape[1])


def _response_fields(trajectories: Sequence[Trajectory], pad_id: int, eos_id: int) -> _Responses:
    """The responses padded to the longest, their mask (``collate``'s rule), behaviour log-probs
    and rewards."""
    if not trajectories:
        raise ValueError("cannot collate an empty batch")
    bsz = len(trajectories)
    lens = np.fromiter((t.response_ids.size for t in trajectories), np.int64, bsz)
    tlen = int(lens.max())
    logp_lens = np.fromiter((t.logprobs.size for t in trajectories), np.int64, bsz)
    if (logp_lens != lens).any():  # (one scatter for all rows would shift them between rows)
        i = int(np.flatnonzero(logp_lens != lens)[0])
        raise ValueError(f"trajectory {i}: {logp_lens[i]} log-probs for {lens[i]} response tokens")
    ids = np.full((bsz, tlen), pad_id, dtype=np.int64)
    rlogp = np.zeros((bsz, tlen), dtype=np.float32)
    actions = np.ones((bsz, tlen), dtype=np.float32)
    episode = np.zeros(bsz, dtype=bool)
    r_row, r_col = _spans(lens)  # every response from column 0 (one scatter)
    ids[r_row, r_col] = np.concatenate([t.response_ids for t in trajectories])
    rlogp[r_row, r_col] = np.concatenate([t.logprobs for t in trajectories])
    for i, t in enumerate(trajectories):
        if t.action_mask.size:
            actions[i, : t.response_ids.size] = t.action_mask
            episode[i] = True
    responses = torch.from_numpy(ids)
    in_len = (torch.arange(tlen)[None, :] < torch.from_numpy(lens)[:, None]).to(torch.float32)
    rule = eos_mask(responses, eos_id)
    if episode.any():
        rule[torch.from_numpy(episode)] = 1.0
    mask = rule * in_len * torch.from_numpy(actions)
    reward = torch.tensor([t.reward for t in trajectories], dtype=torch.float32)
    return _Responses(responses, mask, torch.from_numpy(rlogp) * mask, reward, lens)


def pack(trajectories: Sequence[Trajectory], pad_id: int, eos_id: int) -> Batch:
    """B trajectories as one packed row (prompt then response, each after the other, no
    padding), ``position_ids`` from 0 in each, no attention mask; the [B, T] fields are
    ``collate``'s. A sequence with an empty response still keeps its last prompt token (V(s1))."""
    padded = _response_fields(trajectories, pad_id, eos_id)
    tlen = padded.response_len
    ids, pos, keep, dest = [], [], [], []
    start = 0
    bounds = [0]
    for b, t in enumerate(trajectories):
        p, r = t.prompt_ids.size, t.response_ids.size
        if p < 1:
            raise ValueError("a trajectory needs at least one prompt token")
        ids += [t.prompt_ids, t.response_ids]
        pos.append(np.arange(p + r))
        k = max(r, 1) if tlen else 0
        keep.append(start + p - 1 + np.arange(k))
        dest.append(b * tlen + np.arange(k))
        start += p + r
        bounds.append(start)
    return Batch(
        input_ids=torch.from_numpy(np.concatenate(ids).astype(np.int64))[None],
        attention_mask=None,
        position_ids=torch.from_numpy(np.concatenate(pos).astype(np.int64))[None],
        responses=padded.responses,
        mask=padded.mask,
        rollout_logp=padded.rollout_logp,
        reward=padded.reward,
        keep=torch.from_numpy(np.concatenate(keep).astype(np.int64)),
        dest=torch.from_numpy(np.concatenate(dest).astype(np.int64)),
        bounds=tuple(bounds),
    )


SHARED_MAX_KEYS = 64
"""``share_prompts`` is used when no position attends to more than this many (its prefix:
prompt plus response so far): its attention gathers [heads, L, K, head_dim] keys and values,
which costs nothing beside the layers at the demo's K = 7, and a lot at RL lengths (K in the
thousands)."""


def shared_keys(trajectories: Sequence[Trajectory]) -> int:
    """K of ``share_prompts``: the most positions one position attends to."""
    return max((t.prompt_ids.size + max(t.response_ids.size - 1, 0) for t in trajectories),
               default=0)  # fmt: skip


def share_prompts(trajectories: Sequence[Trajectory], pad_id: int, eos_id: int) -> Batch:
    """B trajectories as one row in which each distinct prefix appears once: the sequences
    (prompt, then the response but its last token: the log-probs need the hidden states before
    each response token, never after the last) merged into a prefix tree, one position per node,
    ``position_ids`` its depth. A position's hidden states depend on its prefix alone, so the
    16 answers of one prompt compute the prompt once, and answers that start alike (the same
    sum, the same first digit) compute that start once; prompts share their common start (a
    chat template's) too. The attention (``_varlen_sdpa`` with ``kv_index``) takes a node's keys
    from its path: each sequence computes what it does alone. The [B, T] fields are
    ``collate``'s; ``keep`` and ``dest`` as ``pack``'s (V(s1) is the prompt's last node)."""
    padded = _response_fields(trajectories, pad_id, eos_id)
    tlen = padded.response_len
    bsz = len(trajectories)
    plens = np.fromiter((t.prompt_ids.size for t in trajectories), np.int64, bsz)
    rlens = padded.lengths
    if (plens < 1).any():
        raise ValueError("a trajectory needs at least one prompt token")
    m = np.maximum(rlens - 1, 0)
    lens = plens + m  # each sequence's positions
    depth = int(lens.max())
    tokens = np.zeros((bsz, depth), dtype=np.int64)
    row, col = _spans(lens)
    pieces = []
    for t, n in zip(trajectories, m.tolist(), strict=True):
        pieces += [t.prompt_ids, t.response_ids[:n]]
    tokens[row, col] = np.concatenate(pieces)
    if tokens.size and (tokens.min() < 0 or tokens.max() >= 1 << 32):
        raise ValueError("token ids must lie in [0, 2**32)")
    # The tree, a depth at a time: a node is a distinct (parent, token) among the sequences
    # still going at that depth. node[b, j]: the node of sequence b's first j + 1 tokens.
    node = np.zeros((bsz, depth), dtype=np.int64)
    reps = []  # per depth: a sequence through each new node, in node order
    count = 0
    for j in range(depth):
        going = np.flatnonzero(lens > j)
        parent = node[going, j - 1] if j else np.zeros(going.size, dtype=np.int64)
        key = (parent << 32) | tokens[going, j]
        uniq, first, inverse = np.unique(key, return_index=True, return_inverse=True)
        node[going, j] = count + inverse
        reps.append(going[first])
        count += uniq.size
    rep = np.concatenate(reps)  # [L] a sequence through each node
    levels = np.repeat(np.arange(depth), [r.size for r in reps])  # [L] each node's depth
    valid = np.arange(depth)[None, :] <= levels[:, None]
    index = np.where(valid, node[rep], 0)  # [L, K] each node's path, root first
    k = np.where(rlens > 0, rlens, 1) if tlen else np.zeros_like(rlens)
    seq = np.repeat(np.arange(bsz), k)  # [N] each kept position's sequence
    t_ = np.arange(seq.size) - np.concatenate([[0], np.cumsum(k)[:-1]])[seq]
    keep = node[seq, plens[seq] - 1 + t_]
    dest = seq * tlen + t_
    return Batch(
        input_ids=torch.from_numpy(tokens[rep, levels])[None],
        attention_mask=None,
        position_ids=torch.from_numpy(levels)[None],
        responses=padded.responses,
        mask=padded.mask,
        rollout_logp=padded.rollout_logp,
        reward=padded.reward,
        keep=torch.from_numpy(keep.astype(np.int64)),
        dest=torch.from_numpy(dest.astype(np.int64)),
        kv_index=torch.from_numpy(index),
        kv_valid=torch.from_numpy(valid),
    )


def make_batch(
    trajectories: Sequence[Trajectory], pad_id: int, eos_id: int, packed: bool, share: bool = False
) -> Batch:
    """``pack`` or ``collate``; ``share`` (a ``VARLEN_SDPA`` model): ``share_prompts`` instead,
    where no position attends to more than ``SHARED_MAX_KEYS``."""
    if share and shared_keys(trajectories) <= SHARED_MAX_KEYS:
        return share_prompts(trajectories, pad_id, eos_id)
    return (pack if packed else collate)(trajectories, pad_id, eos_id)


VARLEN_SDPA = "reval_varlen_sdpa"
"""The attention implementation ``use_varlen_attention`` gives an sdpa model: sdpa as before on
anything but a packed row, and on a packed row causal sdpa on each sequence by itself, so a
row costs the sum of its sequences' squared lengths, not the whole row's squared (sdpa with
transformers' document mask computes the whole [L, L] and masks it)."""

PACKED_ATTENTION = frozenset(
    {"sdpa", "eager", "flex_attention", "flash_attention_2", "flash_attention_3",
     "flash_attention_4", VARLEN_SDPA}
)  # fmt: skip
"""Attention implementations for which a packed row's sequences are kept apart from
``position_ids`` alone (transformers' ``masking_utils``: a document mask for sdpa, eager and
flex; the varlen kernels for flash attention) or from the row's bounds (``VARLEN_SDPA``). Any
other (a custom or paged kernel) would see one long sequence."""


def _varlen_sdpa(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """``VARLEN_SDPA``: with ``cu_seq_lens_q`` (a packed row's bounds, ``policy_stats``) causal
    sdpa over each sequence of the row [1, H, L, D] by itself (consecutive ones of one length
    batched); otherwise transformers' sdpa."""
    from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

    if kwargs.get("reval_kv_index") is not None:
        return _gathered_attention(
            query, key, value, kwargs["reval_kv_index"], kwargs["reval_kv_valid"], scaling
        ), None
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    groups = int(getattr(module, "num_key_value_groups", 1))
    if groups > 1:
        key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    if query.is_cuda and CUDA_VARLEN and query.dtype in (torch.bfloat16, torch.float16):
        out = _flash_varlen(query, key, value, cu, scaling)
        if out is not None:
            return out, None
    bounds = cu.tolist()
    outs = []
    i = 0
    while i < len(bounds) - 1:  # a run of equal lengths goes through sdpa as one batch
        a, n = bounds[i], bounds[i + 1] - bounds[i]
        j = i + 1
        while j < len(bounds) - 1 and bounds[j + 1] - bounds[j] == n:
            j += 1
        k = j - i

        def seqs(x: Tensor, a: int = a, n: int = n, k: int = k) -> Tensor:  # -> [k, H, n, D]
            return x[0, :, a : a + k * n].reshape(x.shape[1], k, n, x.shape[3]).transpose(0, 1)

        o = F.scaled_dot_product_attention(
            seqs(query), seqs(key), seqs(value), dropout_p=dropout, is_causal=True, scale=scaling
        )
        outs.append(o.transpose(0, 1).flatten(1, 2)[None])  # [1, H, k * n, D]
        i = j
    return torch.cat(outs, dim=2).transpose(1, 2).contiguous(), None


def _gathered_attention(
    query: Tensor, key: Tensor, value: Tensor, index: Tensor, valid: Tensor, scaling: float | None
) -> Tensor:
    """Attention of a ``share_prompts`` row [1, H, L, D] (key and value [1, Hkv, L, D]) ->
    [1, L, H, D]: position i attends to the positions ``index[i]`` where ``valid[i]``."""
    _, heads, length, dim = query.shape
    kv_heads, width = key.shape[1], index.shape[1]
    # Batched over [L, Hkv], the order the projections lay q, k and v out in memory
    # ([1, L, heads, D] transposed: every reshape below is a view, and the matmuls' batches
    # need no copy), with whole rows gathered by index_select (its backward adds contiguous
    # rows): key row l * Hkv + h is position l's key of head h. On the CPU at the demo's sizes
    # 0.8x the time of the same batched over [Hkv, L], which was 0.6-0.75x that of advanced
    # indexing and broadcast products.
    rows = (index[:, None, :] * kv_heads
            + torch.arange(kv_heads, device=index.device)[None, :, None]).reshape(-1)  # fmt: skip
    k = key[0].transpose(0, 1).reshape(-1, dim).index_select(0, rows)
    v = value[0].transpose(0, 1).reshape(-1, dim).index_select(0, rows)
    k, v = k.view(length, kv_heads, width, dim), v.view(length, kv_heads, width, dim)
    # head h reads kv head h // groups
    q = query[0].transpose(0, 1).reshape(length, kv_heads, heads // kv_heads, dim)
    scale = dim**-0.5 if scaling is None else scaling
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale  # [L, Hkv, groups, K]
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    weights = scores.float().softmax(-1).to(query.dtype)
    out = torch.matmul(weights, v)  # [L, Hkv, groups, D]
    return out.reshape(length, heads, dim)[None]


CUDA_VARLEN = True
"""On a CUDA device in bf16/fp16, ``VARLEN_SDPA`` runs a packed row through torch's flash-attention
varlen kernel (``torch.nn.attention.varlen.varlen_attn``: one launch per layer, whatever the
lengths) instead of one sdpa call per run of equal lengths. False: the per-sequence path
(``benchmarks/learner_gpu_bench.py --attention loop`` compares the two)."""
_VARLEN_FAILED: list[str] = []


def _flash_varlen(
    query: Tensor, key: Tensor, value: Tensor, cu: Tensor, scaling: float | None
) -> Tensor | None:
    """Causal varlen attention of a packed row [1, H, L, D] -> [1, L, H, D]; None (and one
    warning) where this torch has no varlen kernel or it refuses the inputs. Causal is
    ``window_size=(-1, 0)`` from torch 2.11, ``is_causal=True`` in 2.10."""
    if _VARLEN_FAILED:
        return None
    try:
        import inspect

        from torch.nn.attention.varlen import varlen_attn

        causal: dict[str, Any] = (
            {"window_size": (-1, 0)}
            if "window_size" in inspect.signature(varlen_attn).parameters
            else {"is_causal": True}
        )
        mx = int((cu[1:] - cu[:-1]).max())  # on the host: the row's bounds are built there
        cu = cu.to(query.device, torch.int32)
        q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # [L, H, D]
        out = varlen_attn(q, k, v, cu, cu, mx, mx, scale=scaling, **causal)
    except (ImportError, RuntimeError, TypeError, ValueError) as err:
        _VARLEN_FAILED.append(f"{type(err).__name__}: {err}")
        log.warning("flash varlen attention unavailable (%s): per-sequence sdpa", _VARLEN_FAILED[0])
        return None
    return out[None]


def _varlen_sdpa_mask(*args: Any, **kwargs: Any) -> Tensor | None:
    """sdpa's mask, except none for a row without a padding mask (a packed row's sequences are
    kept apart by ``_varlen_sdpa``; one unpadded sequence is plain causal): transformers would
    otherwise build the packed row's whole [L, L] document mask."""
    from transformers.masking_utils import sdpa_mask

    return None if kwargs.get("attention_mask") is None else sdpa_mask(*args, **kwargs)


def use_varlen_attention(model: nn.Module) -> None:
    """Give an sdpa model ``VARLEN_SDPA`` (registered with transformers on first use); any other
    implementation is left as it is (flash attention's varlen kernels already take a packed
    row by its ``position_ids``)."""
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) != "sdpa":
        return
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    ALL_ATTENTION_FUNCTIONS.register(VARLEN_SDPA, _varlen_sdpa)
    ALL_MASK_ATTENTION_FUNCTIONS.register(VARLEN_SDPA, _varlen_sdpa_mask)
    config._attn_implementation = VARLEN_SDPA  # type: ignore[union-attr]


SHARE_PROMPTS = True
"""Whether a CPU learner whose model runs ``VARLEN_SDPA`` computes each distinct prefix of a
micro-batch once (``share_prompts``: each prompt once, answers' common starts once). False:
``pack`` or ``collate`` as ``learner.packing`` says (docs/demo.md, "What a round costs": the
demo's rounds and its success on seeds 0-4 with it on and off)."""


def can_share_prompts(model: nn.Module, device: torch.device) -> bool:
    """``SHARE_PROMPTS`` for this model on this device: the CPU (on a GPU, flash attention's varlen
    kernels take packed rows) and the ``VARLEN_SDPA`` attention (``use_varlen_attention``)."""
    config = getattr(model, "config", None)
    impl = getattr(config, "_attn_implementation", None)
    dropout = float(getattr(config, "attention_dropout", 0.0) or 0.0)  # (not in the gathering)
    return SHARE_PROMPTS and device.type == "cpu" and impl == VARLEN_SDPA and dropout == 0.0


def resolve_packing(setting: bool | str, model: nn.Module) -> bool:
    """``learner.packing``: true or false as set; ``auto`` packs when the model's attention
    implementation (``config._attn_implementation``) is one of ``PACKED_ATTENTION``."""
    if isinstance(setting, bool):
        return setting
    if setting != "auto":
        raise ValueError(f"learner.packing must be auto, true or false, not {setting!r}")
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
    return impl in PACKED_ATTENTION


LOGPROB_CHUNK = 256
"""Response positions whose vocabulary logits exist at once (``policy_stats``): with Qwen's 152k
vocabulary and 8 sequences a chunk is 8 x 256 x 152k fp32 = 1.2 GB, whatever the length."""

PACKED_LOGPROB_CHUNK = 8 * LOGPROB_CHUNK
"""The same for a packed row (one row of positions): as many logits at once as a padded chunk of
8 sequences."""


def _logp_lse(z: Tensor, y: Tensor) -> Tensor:
    """[..., 2]: log pi(y) and logsumexp of the logits ``z`` [..., V], upcast to fp32 first
    (bf16 LSE is unstable)."""
    zf = z.float()
    lse = torch.logsumexp(zf, dim=-1)
    target = zf.gather(-1, y.long()[..., None])[..., 0]
    return torch.stack([target - lse, lse], dim=-1)


def _stats(logp_lse: Tensor, m: Tensor) -> SequenceStats:
    logp = logp_lse[..., 0] * m.to(torch.float32)
    return SequenceStats(logp=logp, slp=logp.sum(-1), v1=logp_lse[:, 0, 1])


def sequence_stats(z: Tensor, y: Tensor, m: Tensor) -> SequenceStats:
    """Per-token log-probs, their masked sum and V(s1) from response-aligned logits.

    Args:
        z: [B, T, V] logits; ``z[:, t]`` predicts ``y[:, t]`` (temperature 1: Q = raw logits).
        y: [B, T] response token ids.
        m: [B, T] response mask.
    """
    return _stats(_logp_lse(z, y), m)


def _head_chunk(h: Tensor, weight: Tensor, bias: Tensor | None, y: Tensor) -> Tensor:
    return _logp_lse(F.linear(h, weight, bias), y)


RECOMPUTE_LOGITS_ABOVE = 1 << 22
"""A chunk's logits are recomputed in the backward pass when they hold more than this many
values (16 MB in fp32: with Qwen's vocabulary, any chunk of 28 positions or more); smaller ones
(the tiny model's 99-word vocabulary) are kept, which costs less than recomputing them."""


def chunked_logp_lse(
    h: Tensor, weight: Tensor, bias: Tensor | None, y: Tensor, chunk: int = LOGPROB_CHUNK
) -> Tensor:
    """``_logp_lse(h @ weight.T + bias, y)`` [B, T, 2] over ``chunk`` positions at a time: the
    [B, T, V] logits are never whole, and with gradients each chunk's are recomputed in the
    backward pass (non-reentrant activation checkpointing) instead of kept, unless they are
    small (``RECOMPUTE_LOGITS_ABOVE``)."""
    parts = []
    for s in range(0, h.shape[1], chunk):
        args = (h[:, s : s + chunk], weight, bias, y[:, s : s + chunk])
        big = args[0].shape[0] * args[0].shape[1] * weight.shape[0] > RECOMPUTE_LOGITS_ABOVE
        if torch.is_grad_enabled() and big:
            parts.append(checkpoint(_head_chunk, *args, use_reentrant=False))
        else:
            parts.append(_head_chunk(*args))
    return torch.cat(parts, dim=1)


def compute_context(device: torch.device, dtype: torch.dtype) -> Any:
    """The one place the compute dtype applies (``model.dtype``): the parameters stay fp32
    masters and the matmuls run in ``dtype`` under autocast (FSDP2's ``MixedPrecisionPolicy``
    already hands bf16 parameters to a sharded model; the same autocast covers one process)."""
    return torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)


def policy_stats(
    model: nn.Module, batch: Batch, dtype: torch.dtype = torch.float32
) -> SequenceStats:
    """Run the model on a batch and return its SequenceStats (grad flows if enabled), in the
    compute ``dtype``. Only the last T+1 positions reach the LM head (``logits_to_keep``), and
    the head computes log-probs and V(s1) chunk by chunk (``chunked_logp_lse``) inside the
    model's forward (so FSDP's root holds the head's gathered weight), never [B, T, V] at once.

    A packed batch keeps only ``batch.keep``'s positions (``logits_to_keep`` as indices: the
    hidden states are gathered before the head) and scatters their log-probs into [B, T]."""
    t = batch.response_len
    head = model.get_output_embeddings()  # type: ignore[operator]
    varlen: dict[str, Any] = {}
    if batch.packed:
        assert batch.keep is not None and batch.dest is not None
        y = batch.responses.reshape(-1)[batch.dest][None]  # [1, N]

        def forward(hidden: Tensor) -> Tensor:  # [1, N, H] -> [1, N, 2]
            return chunked_logp_lse(hidden, head.weight, head.bias, y, PACKED_LOGPROB_CHUNK)

        keep: int | Tensor = batch.keep
        impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
        if batch.kv_index is not None:
            if impl != VARLEN_SDPA:
                raise ValueError(f"a shared-prompt batch needs {VARLEN_SDPA}, not {impl}")
            varlen = {"reval_kv_index": batch.kv_index, "reval_kv_valid": batch.kv_valid}
        elif impl == VARLEN_SDPA and batch.bounds is not None:
            cu = torch.tensor(batch.bounds, dtype=torch.int32)
            mx = int(cu.diff().max())
            varlen = {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": mx,
                      "max_length_k": mx}  # fmt: skip
    else:
        y = batch.responses

        def forward(hidden: Tensor) -> Tensor:  # [B, T+1, H] -> [B, T, 2]
            return chunked_logp_lse(hidden[:, :-1], head.weight, head.bias, y)

        keep = t + 1
    head.forward = forward  # (this call only: an instance attribute, removed below)
    try:
        with compute_context(batch.input_ids.device, dtype):
            out = model(
                input_ids=batch.input_ids,
                attention_mask=batch.attention_mask,
                position_ids=batch.position_ids,
                logits_to_keep=keep,
                use_cache=False,
                **varlen,
            )
    finally:
        del head.forward
    logp_lse = out.logits.float()
    if batch.packed:
        rows = batch.responses.shape[0]
        flat = logp_lse[0].new_zeros(rows * t, 2).index_copy(0, batch.dest, logp_lse[0])
        logp_lse = flat.view(rows, t, 2)
    return _stats(logp_lse, batch.mask)
