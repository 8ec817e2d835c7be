"""The replay-buffer protocol that every backend implements (and one conformance suite tests).

Both backends keep the same model of a run's ring: positions ``0, 1, 2, ...`` are given to
trajectories in insertion order; position ``p`` lives in slot ``p mod M``; the held window is
``[tail, head)`` with ``head - tail <= M``. Insert writes slot ``head mod M`` (evicting position
``head - M`` when it is still held) and advances ``head``. With ``max_staleness`` set, sampling
first advances ``tail`` past the oldest trajectories that are too stale (dropped, counted) and
skips stale ones further in. Uniform sampling draws B distinct positions of the window by a
partial Fisher-Yates shuffle (O(B), not O(M)); prioritized sampling walks a sum tree.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from buffer.records import RecordLimits, Trajectory


@dataclass
class Sampling:
    """How a consumer hands trajectories out: the rate limiter, the window, staleness and
    priorities (``BufferConfig``'s fields of the same names, declared once here and handed down
    whole to both backends' consumers). Not frozen: the learner changes ``samples_per_insert``
    and ``max_staleness`` live (``learner/step.py``)."""

    samples_per_insert: float | None = None
    """K of the rate limiter: at most K x inserted sampled, plus ``rate_slack`` (None: off)."""
    rate_slack: int = 0
    """Samples allowed beyond K x inserted."""
    min_size_to_sample: int = 0
    """Trajectories held before the first batch (0: the batch size)."""
    max_staleness: int | None = None
    """Oldest policy lag handed out (None: any)."""
    prioritized: bool = False
    """Sample by priority (a sum tree) instead of uniformly."""
    priority_alpha: float = 0.6
    """Priority exponent: P(i) ~ p_i ** alpha."""
    priority_beta: float = 0.4
    """Importance-weight exponent of prioritized sampling."""
    priority_eps: float = 1e-3
    """Added to every priority (none is ever 0)."""

    def floor(self, version: int) -> int | None:
        """The oldest policy version handed out while the learner is at ``version`` (None:
        any)."""
        return None if self.max_staleness is None else version - self.max_staleness

    @classmethod
    def of(cls, cfg: Any, samples_per_insert: float | None = None) -> Sampling:
        """A ``BufferConfig``'s settings; ``samples_per_insert``: the run's K
        (``RunConfig.samples_per_insert``) when the section leaves it unset."""
        spi = cfg.samples_per_insert if cfg.samples_per_insert is not None else samples_per_insert
        return cls(
            samples_per_insert=spi, rate_slack=cfg.rate_slack,
            min_size_to_sample=cfg.min_size_to_sample, max_staleness=cfg.max_staleness,
            prioritized=cfg.prioritized, priority_alpha=cfg.priority_alpha,
            priority_beta=cfg.priority_beta, priority_eps=cfg.priority_eps,
        )  # fmt: skip


class SampleTimeout(TimeoutError):
    """The buffer could not hand out a batch within the timeout (too few held, the rate limiter,
    or the backend unreachable); the message says which."""


class BufferUnavailable(ConnectionError):
    """The backend could not be reached within the retry budget."""


@dataclass(frozen=True)
class BufferStats:
    size: int
    """Trajectories held now."""
    capacity: int
    """M."""
    inserted: int
    """Trajectories inserted since the run's buffer was created."""
    evicted: int
    """Trajectories evicted (the oldest, when full)."""
    sampled: int
    """Trajectories handed out by ``sample`` and ``take``."""
    rejected: int = 0
    """Malformed records refused (on insert or found on read)."""
    dropped_stale: int = 0
    """Trajectories dropped because they exceeded ``max_staleness``."""
    policy_version: int = 0
    """The learner's policy version, as last published with ``set_policy_version``."""
    evicted_unused: int = 0
    """Of ``evicted``, those never handed out: generation the learner never trained on."""
    taken: int = 0
    """Of ``sampled``, those handed out by ``take`` (each trajectory at most once)."""

    @property
    def reuse(self) -> float:
        """Realised samples per insert (``sampled / inserted``): K as the run delivers it."""
        return self.sampled / self.inserted if self.inserted else 0.0

    @property
    def unused_share(self) -> float:
        """Share of the evicted trajectories that were evicted unused."""
        return self.evicted_unused / self.evicted if self.evicted else 0.0


@dataclass
class SampledBatch:
    """What ``sample`` hands out; iterates and indexes like the list of trajectories."""

    trajectories: list[Trajectory]
    weights: npt.NDArray[np.float32]
    """[B] importance weights (all 1 for uniform sampling; max-normalized for prioritized)."""
    staleness: npt.NDArray[np.int64]
    """[B] policy-version lag of each trajectory at sampling time."""
    skipped_stale: int = 0
    """Stale trajectories passed over (or dropped) to fill this batch."""
    wait_s: float = 0.0
    """Seconds spent waiting for the rate limiter or for enough trajectories."""
    fresh: bool = False
    """Handed out by ``take`` (the fresh schedule) rather than by a uniform ``sample``."""

    def __len__(self) -> int:
        return len(self.trajectories)

    def __iter__(self) -> Iterator[Trajectory]:
        return iter(self.trajectories)

    def __getitem__(self, i: int) -> Trajectory:
        return self.trajectories[i]

    @property
    def traj_ids(self) -> list[str]:
        return [t.traj_id for t in self.trajectories]


@runtime_checkable
class ReplayProducer(Protocol):
    """The half of a ring a rollout worker needs: it inserts records and reads the counters
    (to pace itself)."""

    def insert(self, trajectories: Sequence[Trajectory]) -> int:
        """Append in order, evicting the oldest beyond capacity; returns how many were evicted.
        Validates every record first: one bad record raises RecordError and nothing is written.
        Never waits for the learner."""
        ...

    def stats(self) -> BufferStats: ...


@runtime_checkable
class ReplayConsumer(Protocol):
    """The half of a ring the learner needs: a FIFO ring of capacity M it samples (without
    replacement within a batch) and takes fresh batches from, writes back to, and tunes."""

    sampling: Sampling
    """Its rate limiter, window, staleness and priorities; the learner changes
    ``samples_per_insert`` and ``max_staleness`` live."""
    limits: RecordLimits
    """What the consumer does with a record: one beyond them is never handed out (the learner
    narrows them to its model, e.g. the context length, before it samples)."""

    @property
    def capacity(self) -> int: ...

    def __len__(self) -> int: ...

    def sample(self, batch_size: int, timeout: float = 0.0) -> SampledBatch:
        """``batch_size`` distinct trajectories (use counts up by one). Waits up to ``timeout``
        seconds for the rate limiter and for enough trajectories, then raises SampleTimeout."""
        ...

    def take(
        self,
        batch_size: int,
        timeout: float = 0.0,
        whole_groups: bool = False,
        oldest_first: bool = False,
    ) -> SampledBatch:
        """``batch_size`` trajectories no ``take`` handed out before (a uniform ``sample`` may
        have): a fresh batch, newest first, or in insert order with ``oldest_first`` (each
        trajectory is then taken before any newer one, so none is passed over until evicted).
        ``whole_groups``: only whole groups (the answers to one prompt, contiguous within one
        insert) and never part of one, so a group of a producer is handed out complete and once
        (GRPO's on-policy consumption). Use counts go up by one and the batch counts as
        sampled, but the rate limiter does not hold it back: each trajectory goes out this way
        at most once. Respects ``max_staleness``. Waits up to ``timeout`` seconds for enough
        fresh trajectories, then raises SampleTimeout."""
        ...

    def update_priorities(self, traj_ids: Sequence[str], deltas: Sequence[float]) -> int:
        """Set the priorities of held trajectories from their Bellman residuals; returns how
        many were still held. A no-op (returning 0) unless prioritized."""
        ...

    def set_policy_version(self, version: int) -> None:
        """Publish the learner's current policy version (staleness is measured against it)."""
        ...

    def write_back(self, trajectories: Sequence[Trajectory]) -> int:
        """Store updated bookkeeping (cached reference quantities) of trajectories still held;
        returns how many were found."""
        ...

    def quarantine(self, traj_ids: Sequence[str], reason: str) -> int:
        """Empty held records by id (a batch the learner could not update on, whatever the
        checks let through): never handed out again, counted in ``rejected``; returns how many
        were found."""
        ...

    def items(self) -> list[Trajectory]:
        """Every held trajectory, oldest first."""
        ...

    def stats(self) -> BufferStats: ...

    def reset(self) -> None:
        """Empty the run's buffer and zero its counters (a fresh run under the same id)."""
        ...


@runtime_checkable
class ReplayBuffer(ReplayProducer, ReplayConsumer, Protocol):
    """Both halves in one object: a process that fills and drains its own ring (``reval
    train``, the conformance suite)."""


@dataclass(frozen=True)
class FreshRun:
    """Candidates of ``take`` in one insert's range of positions (oldest first)."""

    positions: Sequence[int]
    group_ids: Sequence[str]
    usable: Sequence[bool]
    """Never taken and not too stale."""
    truncated: bool = False
    """The insert's oldest positions were evicted: its first group may be incomplete."""


def pick_fresh(
    runs: Iterable[FreshRun], batch_size: int, whole_groups: bool, oldest_first: bool = False
) -> list[int] | None:
    """The positions ``take`` hands out: ``runs`` in the order ``take`` reads them (newest
    insert first, or oldest first with ``oldest_first``); within an insert the newest first (or
    the oldest). Without ``whole_groups`` the first ``batch_size`` usable positions in that
    order; with it, whole groups (contiguous equal group ids within one insert, every member
    usable, not the possibly incomplete first group of a truncated insert), passing over a group
    that does not fit: ``batch_size`` of them, or fewer when uneven groups leave a gap smaller
    than the largest group picked (no group of that size could fill it). None: not enough."""
    picked: list[int] = []
    largest = 0
    for run in runs:
        if not whole_groups:
            n = len(run.positions)
            for k in range(n) if oldest_first else range(n - 1, -1, -1):
                if run.usable[k]:
                    picked.append(run.positions[k])
                    if len(picked) == batch_size:
                        return picked
            continue
        bounds = [0]
        for k in range(1, len(run.group_ids)):
            if run.group_ids[k] != run.group_ids[k - 1]:
                bounds.append(k)
        bounds.append(len(run.group_ids))
        spans = list(itertools.pairwise(bounds))
        if run.truncated and spans:
            spans = spans[1:]
        for lo, hi in spans if oldest_first else reversed(spans):
            if hi - lo + len(picked) > batch_size or not all(run.usable[lo:hi]):
                continue
            ks = range(lo, hi) if oldest_first else range(hi - 1, lo - 1, -1)
            picked += [run.positions[k] for k in ks]
            largest = max(largest, hi - lo)
            if len(picked) == batch_size:
                return picked
    if whole_groups and picked and batch_size - len(picked) < largest:
        return picked
    return None


def priority_of(delta: float, alpha: float, eps: float) -> float:
    """``(|delta| + eps) ** alpha``; a non-finite delta gets the priority of ``eps``."""
    d = abs(float(delta))
    if not np.isfinite(d):
        d = 0.0
    return float((d + eps) ** alpha)


def importance_weights(
    probs: npt.NDArray[np.float64], size: int, beta: float
) -> npt.NDArray[np.float32]:
    """Schaul et al.'s ``(N * P(i)) ** -beta`` normalized by its maximum over the batch."""
    w = np.power(np.maximum(probs * size, 1e-12), -beta)
    out: npt.NDArray[np.float32] = (w / w.max()).astype(np.float32)
    return out
