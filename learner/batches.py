"""What each update trains on, by the algorithm's rule, from any replay buffer (the embedded ring
of ``reval train`` or the Redis replay service of ``reval learner``), and how a batch is shared
among the learner ranks.

- ReVal, TBRM, regression (off-policy): out of every ``updates_per_round`` updates the first
  ``fresh_updates`` take never-taken trajectories in insert order (``learner.first_update_fresh``,
  the paper's appendix: as many updates as one round of trajectories fills, so every trajectory
  is trained on at least once before it is evicted, whether a uniform sample drew it first or
  not) and the others sample the FIFO window uniformly; the
  buffer's sample-to-insert limiter (``buffer.samples_per_insert``, which follows from K) and the
  workers' pacing (``buffer.generate_ahead``) keep the reuse at K in the service.
- GRPO (on-policy): every batch takes whole groups of never-used trajectories, newest first, so
  each trajectory is used once and a group is never split (its advantages need all of it).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from buffer.base import ReplayConsumer, SampledBatch, SampleTimeout
from buffer.records import RecordLimits, Trajectory
from reval.config import RunConfig


@dataclass
class BatchSource:
    """Draws the batches of a run's updates in the algorithm's order (one consumer)."""

    buffer: ReplayConsumer
    batch_size: int
    on_policy: bool
    """GRPO: whole groups, each trajectory once."""
    updates_per_round: int = 1
    fresh_updates: int = 1
    """Updates of each round that take never-used trajectories (``RunConfig.fresh_updates``)."""
    drawn: int = 0
    """Batches handed out so far (the position in the fresh/replay schedule)."""

    @classmethod
    def from_config(cls, buffer: ReplayConsumer, cfg: RunConfig) -> BatchSource:
        return cls(
            buffer,
            cfg.batch_size,
            on_policy=cfg.algo.on_policy,
            updates_per_round=cfg.learner.updates_per_round,
            fresh_updates=cfg.fresh_updates,
        )

    def state_dict(self) -> dict[str, int]:
        """Its place in the fresh/replay schedule, for a checkpoint."""
        return {"source_drawn": self.drawn}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """(A checkpoint from before the field: one batch drawn per update.)"""
        self.drawn = int(state.get("source_drawn", state["updates"]))

    @property
    def next_is_fresh(self) -> bool:
        """Whether the next batch takes never-used trajectories (rather than a uniform sample)."""
        return self.on_policy or self.drawn % self.updates_per_round < self.fresh_updates

    def next(self, timeout: float = 0.0) -> SampledBatch:
        """The next batch; raises SampleTimeout (and keeps its place in the schedule) when the
        buffer cannot hand it out within ``timeout`` seconds."""
        if self.next_is_fresh:
            # Off-policy: in insert order, so no trajectory is passed over by newer ones until
            # it is evicted; GRPO: newest first, the most on-policy groups.
            batch = self.buffer.take(self.batch_size, timeout, whole_groups=self.on_policy,
                                     oldest_first=not self.on_policy)  # fmt: skip
        else:
            batch = self.buffer.sample(self.batch_size, timeout)
        self.drawn += 1
        return batch


STOP_CHECK_S = 0.25
"""While it waits for a batch, the learner looks at its stop flag this often."""


def draw_within(
    draw: Callable[[float], SampledBatch], timeout: float, stop: threading.Event
) -> SampledBatch:
    """``draw(t)`` (a batch, or SampleTimeout after ``t`` seconds) until a batch comes, in slices
    of ``STOP_CHECK_S``: SampleTimeout after ``timeout`` seconds, or after the slice in which
    ``stop`` was set (a SIGTERM on an empty buffer waited out the whole turn before: 5 s, half a
    ``docker stop``'s grace)."""
    deadline = time.monotonic() + timeout
    while True:
        turn = max(0.0, min(STOP_CHECK_S, deadline - time.monotonic()))
        try:
            return draw(turn)
        except SampleTimeout:
            if stop.is_set() or time.monotonic() >= deadline:
                raise


def context_limits(limits: RecordLimits, model_config: Any) -> RecordLimits:
    """``limits`` with the model's context length (its config's ``max_position_embeddings``) as
    the most tokens a record may hold: a longer one (valid on the wire) crashed the update on
    allocation, on every restart; beyond it the buffer quarantines it on read, before any
    update. Unchanged for a config without one."""
    n = getattr(model_config, "max_position_embeddings", None)
    return limits if not isinstance(n, int) or n < 1 else dataclasses.replace(limits, max_tokens=n)


def split_shares(
    batch: Sequence[Trajectory], world: int, whole_groups: bool
) -> list[list[Trajectory]]:
    """Each rank's share of a batch. Value losses: equal contiguous shares (the per-share mean
    averaged over ranks is the batch mean). ``whole_groups`` (GRPO): every group on one rank,
    groups dealt largest first to the rank holding the fewest trajectories (shares may differ
    by less than a group; GRPO's token mean divides by the batch's tokens, so that is exact)."""
    if world == 1:
        return [list(batch)]
    if not whole_groups:
        if len(batch) % world:
            raise ValueError(f"a batch of {len(batch)} does not split into {world} equal shares")
        size = len(batch) // world
        return [list(batch[r * size : (r + 1) * size]) for r in range(world)]
    groups: dict[str, list[Trajectory]] = defaultdict(list)
    for t in batch:
        groups[t.group_id].append(t)
    if len(groups) < world:
        raise ValueError(
            f"{len(groups)} groups cannot give each of {world} ranks a share: raise "
            "learner.batch_size or lower learner.world_size"
        )
    shares: list[list[Trajectory]] = [[] for _ in range(world)]
    for members in sorted(groups.values(), key=len, reverse=True):
        min(shares, key=len).extend(members)
    return shares


def micro_batches(
    sizes: Sequence[tuple[int, int]],
    max_count: int,
    max_tokens: int | None = None,
    packed: bool = False,
) -> list[list[int]]:
    """Indices of the micro-batches of a share: ``sizes`` are each trajectory's (prompt,
    response) lengths; a micro-batch holds at most ``max_count`` trajectories and, with
    ``max_tokens`` (``learner.max_tokens_per_micro_batch``), at most that many tokens as computed.
    Every index is in exactly one micro-batch; a trajectory longer than the budget is an error.

    - Padded (``collate``): a micro-batch computes count x (longest prompt + longest response)
      tokens. With a budget the trajectories are bucketed by length, longest first, so similar
      lengths share the padding; without one they keep their order.
    - ``packed`` (``pack``): a micro-batch computes the sum of its lengths, nothing else.
      First-fit decreasing: longest first, each into the first micro-batch with room for it."""
    if max_tokens is not None:
        for p, r in sizes:
            if p + r > max_tokens:
                raise ValueError(
                    f"a trajectory of {p}+{r} tokens exceeds learner.max_tokens_per_micro_batch="
                    f"{max_tokens}: raise the budget to at least the longest prompt + response"
                )
    if max_tokens is None:
        return [
            list(range(i, min(i + max_count, len(sizes)))) for i in range(0, len(sizes), max_count)
        ]
    order = sorted(range(len(sizes)), key=lambda i: (sizes[i][0] + sizes[i][1], i), reverse=True)
    if packed:
        bins: list[list[int]] = []
        loads: list[int] = []
        for i in order:
            n = sizes[i][0] + sizes[i][1]
            for j, load in enumerate(loads):
                if len(bins[j]) < max_count and load + n <= max_tokens:
                    bins[j].append(i)
                    loads[j] += n
                    break
            else:
                bins.append([i])
                loads.append(n)
        return bins  # longest first within each: equal lengths adjacent (``_varlen_sdpa``)
    out: list[list[int]] = []
    cur: list[int] = []
    top_p = top_r = 0
    for i in order:
        p, r = sizes[i]
        tp, tr = max(top_p, p), max(top_r, r)
        if cur and (len(cur) >= max_count or (len(cur) + 1) * (tp + tr) > max_tokens):
            out.append(cur)
            cur, tp, tr = [], p, r
        cur.append(i)
        top_p, top_r = tp, tr
    if cur:
        out.append(cur)
    return out


AUTO_PACK_BELOW = {"cuda": 1.0, "cpu": 0.75}
"""``learner.packing = "auto"``, by the learner's device: a share is packed when its padded
micro-batches would compute less than this share of useful tokens. On GPUs any padding is worth
removing (flash attention's varlen kernels cost what one sequence does). On the CPU a packed row
runs attention sequence by sequence (``sequence.VARLEN_SDPA``), which costs calls: the tiny
model's demo (addition, padded at 0.85 useful) ran 1.5x slower packed; RL-like lengths (0.45
useful padded with the presets) ran 1.75x faster (docs/learner.md, "Packed sequences")."""


def layout(
    sizes: Sequence[tuple[int, int]],
    max_count: int,
    max_tokens: int | None,
    packing: bool,
    auto_below: float | None = None,
) -> tuple[bool, list[list[int]]]:
    """(packed, the micro-batches) of a share: ``packing`` whether the model can pack
    (``sequence.resolve_packing``); ``auto_below`` (``learner.packing = "auto"``,
    ``AUTO_PACK_BELOW`` of the device) packs only when the padded micro-batches would compute
    less than that share of useful tokens; None packs whenever it can."""
    if not packing:
        return False, micro_batches(sizes, max_count, max_tokens, False)
    if auto_below is None:
        return True, micro_batches(sizes, max_count, max_tokens, True)
    padded = micro_batches(sizes, max_count, max_tokens, False)
    useful = sum(p + r for p, r in sizes)
    computed = sum(
        len(part) * (max(sizes[i][0] for i in part) + max(sizes[i][1] for i in part))
        for part in padded
    )
    if computed == 0 or useful >= auto_below * computed:
        return False, padded
    return True, micro_batches(sizes, max_count, max_tokens, True)
