"""The value losses (docs/algorithm.md §2): ReVal, and its baselines TBRM and the regression
variant: the trajectory-level soft Bellman residual against the frozen reference, squared and
averaged over the trajectories (``learner.losses.value_loss``). Off-policy: replayed K times."""

from __future__ import annotations

import torch
from torch import Tensor

from learner.algorithms.base import LossInputs, MiniBatch
from learner.losses import LossOutput, ValueLoss, value_loss
from reval.config import AlgoConfig


class ValueAlgorithm:
    """``kind``: ``reval``, ``tbrm`` or ``regression`` (``learner.losses.bellman_residual``)."""

    on_policy = False

    def __init__(self, algo: AlgoConfig, kind: ValueLoss) -> None:
        self.algo = algo
        self.kind = kind
        self._weights: Tensor | None = None
        self._denom = 1.0

    def begin(self, mb: MiniBatch) -> None:
        """The mean over the mini-batch's B trajectories; a trajectory left out weighs 0."""
        w, keep = mb.weights, mb.keep
        self._weights = keep if w is None else (w if keep is None else w * keep)
        self._denom = float(len(mb.trajectories))

    def loss(self, x: LossInputs) -> LossOutput:
        device = x.stats.slp.device
        slp_ref = torch.tensor([t.ref_logprob_sum for t in x.trajectories], device=device)
        v1_ref = torch.tensor([t.ref_value for t in x.trajectories], device=device)
        weights = None if self._weights is None else self._weights[x.rows].to(device)
        return value_loss(self.kind, x.stats.slp, x.stats.v1, slp_ref, v1_ref, x.batch.reward,
                          self.algo.beta, self._denom, weights)  # fmt: skip
