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

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from buffer.records import Trajectory


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
    """Trajectories handed out by ``sample``."""
    rejected: int = 0
    """Malformed records refused (on insert or found on read)."""
    dropped_stale: int = 0
    """Trajectories dropped because they exceeded ``max_staleness``."""
    policy_version: int = 0
    """The learner's policy version, as last published with ``set_policy_version``."""


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
class ReplayBuffer(Protocol):
    """A FIFO ring of capacity M with sampling without replacement within a batch."""

    @property
    def capacity(self) -> int: ...

    def __len__(self) -> int: ...

    def insert(self, trajectories: Sequence[Trajectory]) -> int:
        """Append in order, evicting the oldest beyond capacity; returns how many were evicted.
        Validates every record first: one bad record raises RecordError and nothing is written.
        Never waits for the learner."""
        ...

    def sample(self, batch_size: int, timeout: float = 0.0) -> SampledBatch:
        """``batch_size`` distinct trajectories (use counts up by one). Waits up to ``timeout``
        seconds for the rate limiter and for enough trajectories, then raises SampleTimeout."""
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

    def items(self) -> list[Trajectory]:
        """Every held trajectory, oldest first."""
        ...

    def stats(self) -> BufferStats: ...

    def reset(self) -> None:
        """Empty the run's buffer and zero its counters (a fresh run under the same id)."""
        ...


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
