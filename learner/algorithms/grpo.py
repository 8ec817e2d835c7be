"""GRPO (verl v0.5.0's policy loss with token-mean aggregation, the truncated importance weight of
verl commit b8dc5377c; ``learner.losses.grpo_loss``): group-normalized advantages, the PPO ratio
clipped, on-policy (each trajectory once, in whole groups; no reference)."""

from __future__ import annotations

import torch
from torch import Tensor

from learner.algorithms.base import LossInputs, MiniBatch
from learner.losses import LossOutput, grpo_advantages, grpo_loss
from reval.config import AlgoConfig


class GRPO:
    on_policy = True

    def __init__(self, algo: AlgoConfig) -> None:
        self.algo = algo
        self._advantages = torch.zeros(0)
        self._denom = 1.0

    def begin(self, mb: MiniBatch) -> None:
        """Each trajectory's advantage within its group (a masked answer leaves its group's mean
        and std, and gets 0), and the token count over the ranks' mini-batches (a token mean)."""
        trajs = mb.trajectories
        raw = torch.tensor([t.reward_raw for t in trajs])
        groups = [t.group_id for t in trajs]
        if mb.keep is None:
            self._advantages = grpo_advantages(raw, groups)
        else:
            self._advantages = torch.zeros(len(trajs))
            kept = mb.keep.bool().nonzero()[:, 0]
            if kept.numel():
                rows = kept.tolist()
                self._advantages[kept] = grpo_advantages(raw[kept], [groups[i] for i in rows])
        denom = float(sum(float(b.mask.sum()) for b in mb.batches))  # token mean over all B
        if mb.reduce is not None:
            denom = mb.reduce(denom, "sum") / mb.reduce(1.0, "sum")
        self._denom = denom

    def loss(self, x: LossInputs) -> LossOutput:
        adv: Tensor = self._advantages[x.rows].to(x.stats.logp.device)
        a = self.algo
        return grpo_loss(x.stats.logp, x.old_logp(), adv, x.batch.mask, clip_low=a.clip_low,
                         clip_high=a.clip_high, clip_ratio_c=a.clip_ratio_c,
                         rollout_logp=x.batch.rollout_logp, tis_cap=a.tis_cap,
                         denom=self._denom)  # fmt: skip
