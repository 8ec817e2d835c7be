"""A sum tree over M slots (the embedded backend's prioritized sampling; the Redis backend keeps
the same tree in a hash, written by its Lua scripts)."""

from __future__ import annotations

import numpy as np


class SumTree:
    """Leaves are slot priorities; node ``i`` holds the sum of its children ``2i`` and
    ``2i + 1``; the root is node 1. ``find`` walks down in O(log M)."""

    def __init__(self, capacity: int) -> None:
        self.leaves = 1
        while self.leaves < capacity:
            self.leaves *= 2
        self.tree = np.zeros(2 * self.leaves, dtype=np.float64)

    @property
    def total(self) -> float:
        return float(self.tree[1])

    def get(self, slot: int) -> float:
        return float(self.tree[self.leaves + slot])

    def set(self, slot: int, value: float) -> None:
        i = self.leaves + slot
        self.tree[i] = value
        i //= 2
        while i >= 1:
            self.tree[i] = self.tree[2 * i] + self.tree[2 * i + 1]
            i //= 2

    def find(self, mass: float) -> int:
        """The slot whose cumulative interval contains ``mass`` (0 <= mass < total)."""
        i = 1
        while i < self.leaves:
            left = self.tree[2 * i]
            if mass < left or self.tree[2 * i + 1] <= 0.0:
                i = 2 * i
            else:
                mass -= left
                i = 2 * i + 1
        return i - self.leaves
