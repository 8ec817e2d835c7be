"""The reference policy: a frozen copy of the policy, reset to it every ``ref_reset_steps``.

Between resets it does not change, so ``log pi_ref(tau)`` and ``V_ref(s1)`` are computed once per
trajectory and reference version and cached on the record (``ref_version``). A reset bumps the
version, so every cached value becomes stale and is recomputed on next use; never reused stale.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from torch import nn

from buffer.records import Trajectory
from learner.sequence import collate, policy_stats


class ReferencePolicy:
    def __init__(self, policy: nn.Module, pad_id: int, eos_id: int, micro_batch_size: int) -> None:
        self.model = copy.deepcopy(policy)
        self.model.eval()
        self.model.requires_grad_(False)
        self.pad_id = pad_id
        self.eos_id = eos_id
        self.micro_batch_size = micro_batch_size
        self.version = 0
        self.computed = 0  # trajectories whose reference quantities were (re)computed

    @torch.no_grad()
    def reset(self, policy: nn.Module) -> None:
        """Copy the policy's current weights into the reference; invalidates every cache."""
        src = policy.state_dict()
        for name, tensor in self.model.state_dict().items():
            tensor.copy_(src[name])
        self.version += 1

    @torch.no_grad()
    def fill(self, trajectories: Sequence[Trajectory], device: torch.device) -> int:
        """Compute and cache the reference quantities of every trajectory whose cache is missing
        or from another reference version; returns how many were computed."""
        stale = [t for t in trajectories if t.ref_version != self.version]
        for start in range(0, len(stale), self.micro_batch_size):
            chunk = stale[start : start + self.micro_batch_size]
            batch = collate(chunk, self.pad_id, self.eos_id).to(device)
            stats = policy_stats(self.model, batch)
            for t, slp, v1 in zip(chunk, stats.slp.tolist(), stats.v1.tolist(), strict=True):
                t.ref_logprob_sum = slp
                t.ref_value = v1
                t.ref_version = self.version
        self.computed += len(stale)
        return len(stale)
