"""The reference policy: a frozen copy of the policy, reset to it every ``ref_reset_steps``.

Between resets it does not change, so ``log pi_ref(tau)`` and ``V_ref(s1)`` are computed once per
trajectory and reference version and cached on the record (``ref_version``). A reset bumps the
version, so every cached value becomes stale and is recomputed on next use; never reused stale.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence

import torch
from torch import nn

from buffer.records import Trajectory
from learner.batches import layout
from learner.sequence import make_batch, policy_stats, use_varlen_attention


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
        ``batches.layout``); ``share``: each distinct prompt of a micro-batch computed once
        (``sequence.share_prompts``, the learner's ``share_prompts``)."""
        self.sync_chunks = sync_chunks
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
        if packed:
            use_varlen_attention(self.model)
        self.version = 0
        self.computed = 0  # trajectories whose reference quantities were (re)computed

    @torch.no_grad()
    def reset(self, policy: nn.Module) -> None:
        """Copy the policy's current weights into the reference; invalidates every cache.
        (Shard to shard under FSDP: both are sharded the same way.)"""
        for m in (self.model, policy):
            # An FSDP2 root keeps its parameters gathered after a forward that no backward
            # followed (the reference's case): put them back into shards first.
            reshard = getattr(m, "reshard", None)
            if callable(reshard):
                reshard()
        for dst, src in zip(self.model.parameters(), policy.parameters(), strict=True):
            dst.copy_(src)
        for dst, src in zip(self.model.buffers(), policy.buffers(), strict=True):
            dst.copy_(src)
        self.version += 1

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
        if self.sync_chunks is not None and trajectories:
            extra = self.sync_chunks(len(parts)) - len(parts)
            if extra > 0:  # keep the FSDP collectives in step with the other ranks
                batch = make_batch(trajectories[:1], self.pad_id, self.eos_id, packed, self.share)
                batch = batch.to(device)
                for _ in range(extra):
                    policy_stats(self.model, batch, self.dtype)
        for part in parts:
            chunk = [stale[i] for i in part]
            batch = make_batch(chunk, self.pad_id, self.eos_id, packed, self.share).to(device)
            stats = policy_stats(self.model, batch, self.dtype)
            for t, slp, v1 in zip(chunk, stats.slp.tolist(), stats.v1.tolist(), strict=True):
                t.ref_logprob_sum = slp
                t.ref_value = v1
                t.ref_version = self.version
        self.computed += len(stale)
        return len(stale)
