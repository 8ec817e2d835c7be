"""The embedded in-memory FIFO ring: one-process runs with no Redis (a product feature)."""

from __future__ import annotations

import random
import threading
from collections.abc import Sequence

from buffer.base import BufferStats
from buffer.records import Trajectory


class MemoryRing:
    """Ring of M slots: slot = (insert counter) mod M, so insert and eviction are O(1) and a
    uniform sample of B is O(B). Thread-safe."""

    def __init__(self, capacity: int, seed: int = 0) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self._capacity = capacity
        self._slots: list[Trajectory | None] = [None] * capacity
        self._index: dict[str, int] = {}  # traj_id -> slot
        self._head = 0  # total inserted; next slot is head % capacity
        self._evicted = 0
        self._sampled = 0
        self._rng = random.Random(seed)
        self._lock = threading.Lock()

    @property
    def capacity(self) -> int:
        return self._capacity

    def __len__(self) -> int:
        return min(self._head, self._capacity)

    def insert(self, trajectories: Sequence[Trajectory]) -> int:
        for t in trajectories:
            t.validate()
        evicted = 0
        with self._lock:
            for t in trajectories:
                slot = self._head % self._capacity
                old = self._slots[slot]
                if old is not None:
                    self._index.pop(old.traj_id, None)
                    evicted += 1
                self._slots[slot] = t
                self._index[t.traj_id] = slot
                self._head += 1
            self._evicted += evicted
        return evicted

    def sample(self, batch_size: int) -> list[Trajectory]:
        with self._lock:
            size = len(self)
            if batch_size < 1:
                raise ValueError(f"batch_size must be >= 1, got {batch_size}")
            if batch_size > size:
                raise ValueError(f"cannot sample {batch_size} from a buffer holding {size}")
            # The held slots are 0..size-1 whether or not the ring has wrapped.
            chosen = self._rng.sample(range(size), batch_size)
            out = []
            for slot in chosen:
                t = self._slots[slot]
                assert t is not None
                t.use_count += 1
                out.append(t)
            self._sampled += batch_size
        return out

    def write_back(self, trajectories: Sequence[Trajectory]) -> int:
        found = 0
        with self._lock:
            for t in trajectories:
                slot = self._index.get(t.traj_id)
                if slot is not None:
                    self._slots[slot] = t
                    found += 1
        return found

    def items(self) -> list[Trajectory]:
        with self._lock:
            size = len(self)
            start = self._head - size
            out = []
            for i in range(start, self._head):
                t = self._slots[i % self._capacity]
                assert t is not None
                out.append(t)
            return out

    def stats(self) -> BufferStats:
        with self._lock:
            return BufferStats(
                size=len(self),
                capacity=self._capacity,
                inserted=self._head,
                evicted=self._evicted,
                sampled=self._sampled,
            )
