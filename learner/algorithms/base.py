"""What an algorithm is to the learner (``learner/trainer.py``): typed inputs, one method per
mini-batch and one per micro-batch, and whether it is on-policy (the one place the algorithms
differ in how they are fed: ``on_policy``, never a test of the name)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from torch import Tensor

from buffer.records import Trajectory
from learner.losses import LossOutput
from learner.sequence import Batch, SequenceStats

Reduce = Callable[[float, str], float]
"""``reduce(x, "sum" | "max")`` over the learner's ranks."""


@dataclass
class MiniBatch:
    """One update's trajectories (this rank's share), before its micro-batches run."""

    trajectories: Sequence[Trajectory]
    batches: Sequence[Batch]
    """Its micro-batches (on the CPU), in the order they run."""
    weights: Tensor | None
    """[B] prioritized replay's importance weights (None: uniform)."""
    keep: Tensor | None
    """[B] 1 where a trajectory is in the loss, 0 where it is left out (``algo.mask_truncated``:
    cut at the token limit); None: all are in."""
    reduce: Reduce | None
    """Over the ranks (several ranks), None in one process."""


@dataclass
class LossInputs:
    """One micro-batch of the mini-batch, its policy statistics computed (with grad)."""

    stats: SequenceStats
    """The policy's ``logp`` [B, T], ``slp`` [B], ``v1`` [B] (``learner.sequence.policy_stats``)."""
    batch: Batch
    """The micro-batch on the device: ``reward`` [B], ``mask`` [B, T], ``rollout_logp`` [B, T]."""
    trajectories: Sequence[Trajectory]
    rows: Tensor
    """[b] its rows in the mini-batch (what ``MiniBatch``'s [B] tensors are indexed by)."""
    old_logp: Callable[[], Tensor]
    """[B, T] the log-probs the policy had before the round's first update where the learner
    remembered them (``Learner.remember_old_logp``), these otherwise (detached)."""


class Algorithm(Protocol):
    """A loss of the table (``learner.algorithms.ALGORITHMS``), built from the run's ``algo``
    section. ``begin`` once per update, then ``loss`` per micro-batch: the micro-batch losses
    of an update sum to the mini-batch's loss (each divides by the mini-batch's denominator),
    so their accumulated gradients are the mini-batch's."""

    on_policy: bool
    """True: each trajectory trains once, in whole groups of its prompt, newest first, with no
    reference and no importance weights (GRPO); False: replayed K times against a frozen
    reference (the value losses). The config reads it too (``AlgoConfig.on_policy``)."""

    def begin(self, mb: MiniBatch) -> None:
        """What the micro-batches need of the whole mini-batch (advantages, a denominator)."""
        ...

    def loss(self, x: LossInputs) -> LossOutput:
        """One micro-batch's share of the mini-batch's loss."""
        ...
