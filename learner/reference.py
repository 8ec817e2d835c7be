"""The reference policy: a frozen copy of the policy, reset to it every ``ref_reset_steps``.

Under LoRA (``model.lora``) there is no second model: the reference is the policy itself with
the adapters' snapshot swapped in for the forward (``AdapterSnapshot``: the adapters' size,
kilobytes to megabytes, in place of a copy of the model). Until the first reset the snapshot is
of the initial adapters, whose ``B`` is zero: the base model exactly (``W x + 0``).

Between resets it does not change, so ``log pi_ref(tau)`` and ``V_ref(s1)`` are computed once per
trajectory and reference version and cached on the record (``ref_version``). A reset bumps the
version, so every cached value becomes stale and is recomputed on next use; never reused stale.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import nn

from buffer.records import Trajectory
from learner.batches import layout
from learner.sequence import make_batch, policy_stats, use_varlen_attention
from reval.lora import adapter_parameters, is_lora


class AdapterSnapshot(nn.Module):
    """The LoRA reference's state: a copy of the policy's adapter tensors (sharded as the
    policy's are under FSDP2: ``clone`` keeps a DTensor's placement). An ``nn.Module`` so that
    a checkpoint saves and loads it as it did the reference model."""

    def __init__(self, policy: nn.Module) -> None:
        super().__init__()
        params = [p for _, p in adapter_parameters(policy)]
        if not params:
            raise ValueError("AdapterSnapshot: the policy has no LoRA adapters")
        self.tensors = nn.ParameterList(
            nn.Parameter(p.detach().clone(), requires_grad=False) for p in params
        )

    @torch.no_grad()
    def take(self, policy: nn.Module) -> None:
        """Copy the policy's adapters in (shard to shard)."""
        for dst, (_, src) in zip(self.tensors, adapter_parameters(policy), strict=True):
            dst.copy_(src)

    @torch.no_grad()
    def swap(self, policy: nn.Module) -> None:
        """Exchange the policy's adapters with the snapshot's (twice: back as they were)."""
        for held, (_, live) in zip(self.tensors, adapter_parameters(policy), strict=True):
            kept = live.detach().clone()
            live.copy_(held)
            held.copy_(kept)


def _reshard(*models: nn.Module) -> None:
    """Put an FSDP2 root's parameters back into shards (it keeps them gathered after a forward
    that no backward followed, the reference's case) before copying shard to shard."""
    for m in models:
        reshard = getattr(m, "reshard", None)
        if callable(reshard):
            reshard()


class ReferencePolicy:
    def __init__(
        self,
        policy: nn.Module,
        pad_id: int,
        eos_id: int,
        micro_batch_size: int,
        model: nn.Module | None = None,
        sync_chunks: Callable[[int], int] | None = None,
        max_tokens: int | None = None,
        dtype: torch.dtype = torch.float32,
        packed: bool = False,
        auto_pack: float | None = None,
        share: bool = False,
    ) -> None:
        """``model``: a ready copy of the policy (the learner service passes an FSDP-sharded
        one); by default a deep copy. ``sync_chunks``: under FSDP every rank must run the same
        number of forward passes: it maps this rank's count of micro-batches to the largest over
        the ranks, and ranks with fewer run repeats whose results they drop. ``max_tokens`` and
        ``dtype``: the learner's token budget per micro-batch and compute dtype; ``packed``: the
        learner's micro-batch layout (``learner.packing``; ``auto_pack``: per share,
        ``batches.layout``); ``share``: each distinct prefix of a micro-batch computed once
        (``sequence.share_prompts``, the learner's ``share_prompts``)."""
        self.sync_chunks = sync_chunks
        self.policy = policy
        self.lora = is_lora(policy)
        self.model: nn.Module
        """What a checkpoint keeps of the reference: the frozen model, or under LoRA the
        ``AdapterSnapshot`` (the learner service passes its sharded one)."""
        if self.lora:
            self.model = model if model is not None else AdapterSnapshot(policy)
        else:
            self.model = model if model is not None else copy.deepcopy(policy)
            self.model.eval()
        self.model.requires_grad_(False)
        self.pad_id = pad_id
        self.eos_id = eos_id
        self.micro_batch_size = micro_batch_size
        self.max_tokens = max_tokens
        self.dtype = dtype
        self.packed = packed
        self.auto_pack = auto_pack
        self.share = share
        if packed and not self.lora:
            use_varlen_attention(self.model)
        self.version = 0
        self.computed = 0  # trajectories whose reference quantities were (re)computed

    @torch.no_grad()
    def reset(self, policy: nn.Module) -> None:
        """Copy the policy's current weights into the reference; invalidates every cache.
        (Shard to shard under FSDP: both are sharded the same way.) Under LoRA: the adapters'
        snapshot."""
        _reshard(self.model, policy)
        if isinstance(self.model, AdapterSnapshot):
            self.model.take(policy)
            self.version += 1
            return
        for dst, src in zip(self.model.parameters(), policy.parameters(), strict=True):
            dst.copy_(src)
        for dst, src in zip(self.model.buffers(), policy.buffers(), strict=True):
            dst.copy_(src)
        self.version += 1

    @contextlib.contextmanager
    def _forward_model(self) -> Iterator[nn.Module]:
        """The model whose forward is the reference's: the frozen copy; under LoRA the policy in
        eval mode with the snapshot's adapters swapped in (version 0: the initial adapters,
        whose ``B`` is zero, so exactly the base). Not peft's ``disable_adapter()``: it sets
        the adapters' ``requires_grad`` off while it lasts, and FSDP2, initialising on that
        first forward, would then reduce their gradients in the compute dtype."""
        if not self.lora:
            yield self.model
            return
        assert isinstance(self.model, AdapterSnapshot)
        policy, was = self.policy, self.policy.training
        policy.eval()
        _reshard(*policy.modules())
        self.model.swap(policy)
        try:
            yield policy
        finally:  # (every FSDP unit: a forward that failed midway leaves a layer gathered)
            _reshard(*policy.modules())
            self.model.swap(policy)
            policy.train(was)

    @torch.no_grad()
    def fill(self, trajectories: Sequence[Trajectory], device: torch.device) -> int:
        """Compute and cache the reference quantities of every trajectory whose cache is missing
        or from another reference version; returns how many were computed."""
        stale = [t for t in trajectories if t.ref_version != self.version]
        packed, parts = layout(
            [(t.prompt_ids.size, t.response_ids.size) for t in stale],
            self.micro_batch_size,
            self.max_tokens,
            self.packed,
            self.auto_pack,
        )
        extra = 0
        if self.sync_chunks is not None and trajectories:
            extra = self.sync_chunks(len(parts)) - len(parts)
        if not parts and extra <= 0:
            return 0
        with self._forward_model() as model:
            if extra > 0:  # keep the FSDP collectives in step with the other ranks
                batch = make_batch(trajectories[:1], self.pad_id, self.eos_id, packed, self.share)
                batch = batch.to(device)
                for _ in range(extra):
                    policy_stats(model, batch, self.dtype)
            for part in parts:
                chunk = [stale[i] for i in part]
                batch = make_batch(chunk, self.pad_id, self.eos_id, packed, self.share).to(device)
                stats = policy_stats(model, batch, self.dtype)
                for t, slp, v1 in zip(chunk, stats.slp.tolist(), stats.v1.tolist(), strict=True):
                    t.ref_logprob_sum = slp
                    t.ref_value = v1
                    t.ref_version = self.version
        self.computed += len(stale)
        return len(stale)
