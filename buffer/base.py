"""The replay-buffer protocol that every backend implements (and one conformance suite tests)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from buffer.records import Trajectory


@dataclass(frozen=True)
class BufferStats:
    size: int
    """Trajectories held now."""
    capacity: int
    """M."""
    inserted: int
    """Trajectories inserted since creation."""
    evicted: int
    """Trajectories evicted (the oldest, when full)."""
    sampled: int
    """Trajectories handed out by ``sample``."""


@runtime_checkable
class ReplayBuffer(Protocol):
    """A FIFO ring of capacity M with uniform sampling without replacement within a batch."""

    @property
    def capacity(self) -> int: ...

    def __len__(self) -> int: ...

    def insert(self, trajectories: Sequence[Trajectory]) -> int:
        """Append in order, evicting the oldest beyond capacity; returns how many were evicted."""
        ...

    def sample(self, batch_size: int) -> list[Trajectory]:
        """``batch_size`` distinct trajectories drawn uniformly; their use counts go up by one."""
        ...

    def write_back(self, trajectories: Sequence[Trajectory]) -> int:
        """Store updated bookkeeping (use count, cached reference quantities) of trajectories
        still held; returns how many were found."""
        ...

    def items(self) -> list[Trajectory]:
        """Every held trajectory, oldest first."""
        ...

    def stats(self) -> BufferStats: ...
