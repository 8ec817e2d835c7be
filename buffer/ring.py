"""The embedded in-memory FIFO ring: one-process runs with no Redis (a product feature).

Same model and semantics as the Redis ring (see ``buffer.base``); thread-safe; sampling waits on
a condition variable that inserts notify.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

import numpy as np
import numpy.typing as npt

from buffer.base import (
    BufferStats,
    FreshRun,
    SampledBatch,
    SampleTimeout,
    Sampling,
    importance_weights,
    pick_fresh,
    priority_of,
)
from buffer.metrics import BufferMetrics
from buffer.record_codec import validate_many
from buffer.records import NO_LIMITS, RecordError, RecordLimits, Trajectory
from buffer.sumtree import SumTree

T = TypeVar("T")
log = logging.getLogger("reval.buffer")


class MemoryRing:
    """Ring of M slots: slot = position mod M, so insert and eviction are O(1) and a uniform
    sample of B is O(B)."""

    def __init__(
        self,
        capacity: int,
        seed: int = 0,
        *,
        sampling: Sampling | None = None,
        metrics: BufferMetrics | None = None,
        limits: RecordLimits = NO_LIMITS,
    ) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self._capacity = capacity
        self._slots: list[Trajectory | None] = [None] * capacity
        self._taken = [False] * capacity
        """Per slot: a ``take`` has handed its trajectory out (the fresh schedule's mark)."""
        self._index: dict[str, int] = {}  # traj_id -> position
        self._head = 0  # total inserted; next slot is head % capacity
        self._tail = 0  # oldest held position
        self._evicted = 0
        self._evicted_unused = 0
        self._sampled = 0
        self._taken_count = 0
        self._rejected = 0
        self._dropped = 0
        self._version = 0
        self._rng = random.Random(seed)
        self._cond = threading.Condition()
        self.sampling = Sampling() if sampling is None else sampling
        """The rate limiter, window, staleness and priorities (``buffer.base.Sampling``)."""
        self._tree = SumTree(capacity) if self.sampling.prioritized else None
        self._max_priority = 1.0
        self._inserts: deque[tuple[int, int]] = deque()  # [start, end) of each insert call
        self.metrics = metrics
        self.limits = limits
        """What the consumer does with a record (``RecordLimits``), checked on insert."""
        if metrics is not None:
            metrics.capacity.set(capacity)

    @property
    def capacity(self) -> int:
        return self._capacity

    def __len__(self) -> int:
        return self._head - self._tail

    # -- producers ------------------------------------------------------------------------------

    def insert(self, trajectories: Sequence[Trajectory]) -> int:
        try:
            validate_many(trajectories, self.limits)
        except RecordError as err:
            with self._cond:
                self._rejected += 1
            if self.metrics is not None:
                self.metrics.rejected.inc()
            raise RecordError(f"{err}; batch not written") from None
        evicted = unused = 0
        with self._cond:
            first = self._head
            for t in trajectories:
                if t.traj_id in self._index:
                    continue  # a producer's retry of a batch that already landed
                slot = self._head % self._capacity
                if self._head - self._capacity >= self._tail:
                    old = self._slots[slot]  # (None: quarantined)
                    if old is not None:
                        self._index.pop(old.traj_id, None)
                        unused += old.use_count == 0
                    self._tail += 1
                    evicted += 1
                self._slots[slot] = t
                self._taken[slot] = False
                self._index[t.traj_id] = self._head
                if self._tree is not None:
                    self._tree.set(slot, self._max_priority)
                self._head += 1
            if self._head > first:
                self._inserts.append((first, self._head))
            while self._inserts and self._inserts[0][1] <= self._tail:
                self._inserts.popleft()
            self._evicted += evicted
            self._evicted_unused += unused
            self._cond.notify_all()
            size = len(self)
        if self.metrics is not None:
            self.metrics.inserts.inc(len(trajectories))
            self.metrics.evictions.inc(evicted)
            self.metrics.evicted_unused.inc(unused)
            self.metrics.size.set(size)
        return evicted

    # -- the learner ----------------------------------------------------------------------------

    def set_policy_version(self, version: int) -> None:
        with self._cond:
            self._version = int(version)

    def _drop_stale_prefix(self) -> int:
        if self.sampling.max_staleness is None:
            return 0
        floor = self._version - self.sampling.max_staleness
        dropped = 0
        while self._tail < self._head:
            slot = self._tail % self._capacity
            t = self._slots[slot]
            if t is not None and t.policy_version >= floor:
                break
            if t is not None:  # (a quarantined slot goes with them, not counted)
                self._index.pop(t.traj_id, None)
                dropped += 1
            self._slots[slot] = None
            if self._tree is not None:
                self._tree.set(slot, 0.0)
            self._tail += 1
        self._dropped += dropped
        return dropped

    def _blocked(self, batch_size: int) -> str | None:
        """Why a batch cannot be handed out now (None: it can)."""
        need = max(batch_size, self.sampling.min_size_to_sample)
        if len(self) < need:
            return f"cannot sample {batch_size} from a buffer holding {len(self)} (need {need})"
        k, slack = self.sampling.samples_per_insert, self.sampling.rate_slack
        if k is not None and self._sampled + batch_size > k * self._head + slack:
            return (f"rate limited: {self._sampled} sampled + {batch_size} > {k} x {self._head} "
                    f"inserted + {slack}")  # fmt: skip
        return None

    def _draw(self, batch_size: int) -> tuple[list[int], list[float], int] | None:
        """Positions of a batch (and their first-draw probabilities), skipping stale ones;
        None when too few fresh ones are held. Caller holds the lock."""
        floor = self.sampling.floor(self._version)
        n = len(self)
        chosen: list[int] = []
        probs: list[float] = []
        skipped = 0
        if self._tree is None:
            swaps: dict[int, int] = {}
            for i in range(n):
                if len(chosen) == batch_size:
                    break
                j = i + int(self._rng.random() * (n - i))
                vi, vj = swaps.get(i, i), swaps.get(j, j)
                swaps[j] = vi
                pos = self._tail + vj
                t = self._slots[pos % self._capacity]
                if t is None:  # quarantined: passed over
                    continue
                if floor is not None and t.policy_version < floor:
                    skipped += 1
                    continue
                chosen.append(pos)
                probs.append(1.0 / n)
        else:
            tree = self._tree
            total = tree.total
            zeroed: list[tuple[int, float]] = []
            while len(chosen) < batch_size and tree.total > 0:
                slot = tree.find(self._rng.random() * tree.total)
                p = tree.get(slot)
                if p <= 0:  # float round-off at an edge: never hand out a zero leaf
                    break
                zeroed.append((slot, p))
                tree.set(slot, 0.0)
                t = self._slots[slot]
                assert t is not None
                if floor is not None and t.policy_version < floor:
                    skipped += 1
                    continue
                chosen.append(self._index[t.traj_id])
                probs.append(p / total)
            for slot, p in zeroed:
                tree.set(slot, p)
        self._dropped += skipped
        if len(chosen) < batch_size:
            return None
        return chosen, probs, skipped

    def sample(self, batch_size: int, timeout: float = 0.0) -> SampledBatch:
        if batch_size > self._capacity:
            raise ValueError(
                f"cannot sample {batch_size} from a buffer of capacity {self._capacity}"
            )

        def attempt() -> tuple[tuple[list[int], list[float], int] | None, str]:
            reason = self._blocked(batch_size)
            drawn = None if reason else self._draw(batch_size)
            return drawn, reason or f"fewer than {batch_size} trajectories within max_staleness"

        start = time.perf_counter()
        with self._cond:
            (positions, probs, skipped), waited, dropped = self._until(
                attempt, batch_size, start + timeout
            )
            out, version, size = self._hand_out(positions)
        if self._tree is not None:
            weights = importance_weights(np.asarray(probs), size, self.sampling.priority_beta)
        else:
            weights = np.ones(batch_size, dtype=np.float32)
        return self._batch(out, weights, version, size, skipped + dropped, waited, start)

    def take(
        self,
        batch_size: int,
        timeout: float = 0.0,
        whole_groups: bool = False,
        oldest_first: bool = False,
    ) -> SampledBatch:
        def attempt() -> tuple[list[int] | None, str]:
            what = "in whole groups " if whole_groups else ""
            why = f"fewer than {batch_size} fresh trajectories {what}in {len(self)} held"
            runs = self._fresh_runs(oldest_first)
            return pick_fresh(runs, batch_size, whole_groups, oldest_first), why

        start = time.perf_counter()
        with self._cond:
            picked, waited, dropped = self._until(attempt, batch_size, start + timeout)
            for pos in picked:
                self._taken[pos % self._capacity] = True
            self._taken_count += len(picked)
            out, version, size = self._hand_out(picked)
        weights = np.ones(len(out), dtype=np.float32)
        batch = self._batch(out, weights, version, size, dropped, waited, start)
        batch.fresh = True
        return batch

    def _until(
        self, attempt: Callable[[], tuple[T | None, str]], batch_size: int, deadline: float
    ) -> tuple[T, float, int]:
        """``attempt()`` -> (a draw or None, why not) until it draws or the deadline passes
        (SampleTimeout), waiting on inserts; returns (the draw, seconds waited, stale ones
        dropped). Caller holds the lock."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        waited = 0.0
        dropped = self._drop_stale_prefix()
        while True:
            got, reason = attempt()
            if got is not None:
                return got, waited, dropped
            left = deadline - time.perf_counter()
            if left <= 0:
                raise SampleTimeout(reason)
            t0 = time.perf_counter()
            self._cond.wait(min(left, 0.05))
            waited += time.perf_counter() - t0
            dropped += self._drop_stale_prefix()

    def _hand_out(self, positions: Sequence[int]) -> tuple[list[Trajectory], int, int]:
        """The trajectories at ``positions`` with their uses counted, the policy version and the
        size. Caller holds the lock."""
        out = []
        for pos in positions:
            t = self._slots[pos % self._capacity]
            assert t is not None
            t.use_count += 1
            out.append(t)
        self._sampled += len(out)
        return out, self._version, len(self)

    def _batch(
        self,
        out: list[Trajectory],
        weights: npt.NDArray[np.float32],
        version: int,
        size: int,
        skipped: int,
        waited: float,
        start: float,
    ) -> SampledBatch:
        staleness = np.array([version - t.policy_version for t in out], dtype=np.int64)
        if self.metrics is not None:
            self.metrics.observe_sample(
                time.perf_counter() - start, waited, staleness.tolist(), [t.use_count for t in out]
            )
            self.metrics.dropped_stale.inc(skipped)
            self.metrics.size.set(size)
        return SampledBatch(out, weights, staleness, skipped, waited)

    def _fresh_runs(self, oldest_first: bool = False) -> Iterator[FreshRun]:
        """``take``'s candidates, newest insert first (or oldest), made as ``pick_fresh`` reads
        them (it stops at a full batch); an insert taken whole is passed over (it has nothing to
        give: the demo's take read four such of its five before the fresh one). Caller holds
        the lock."""
        floor = self.sampling.floor(self._version)
        cap = self._capacity
        for first, end in self._inserts if oldest_first else reversed(self._inserts):
            lo = max(first, self._tail)
            if lo >= end:
                continue
            a, b = lo % cap, (end - 1) % cap + 1  # its slots: [a, b), or [a, cap) + [0, b)
            taken = self._taken[a:b] if a < b else self._taken[a:] + self._taken[:b]
            if False not in taken:
                continue
            held = [self._slots[p % cap] for p in range(lo, end)]
            usable = [
                t is not None
                and not self._taken[p % cap]
                and (floor is None or t.policy_version >= floor)
                for p, t in zip(range(lo, end), held, strict=True)
            ]
            gids = [t.group_id if t is not None else "" for t in held]
            yield FreshRun(range(lo, end), gids, usable, truncated=first < self._tail)

    def update_priorities(self, traj_ids: Sequence[str], deltas: Sequence[float]) -> int:
        if len(traj_ids) != len(deltas):
            raise ValueError(f"{len(traj_ids)} ids but {len(deltas)} deltas")
        if self._tree is None:
            return 0
        found = 0
        s = self.sampling
        with self._cond:
            for tid, d in zip(traj_ids, deltas, strict=True):
                pos = self._index.get(tid)
                if pos is None:
                    continue
                p = priority_of(d, s.priority_alpha, s.priority_eps)
                self._tree.set(pos % self._capacity, p)
                self._max_priority = max(self._max_priority, p)
                found += 1
        return found

    def write_back(self, trajectories: Sequence[Trajectory]) -> int:
        found = 0
        with self._cond:
            for t in trajectories:
                pos = self._index.get(t.traj_id)
                held = None if pos is None else self._slots[pos % self._capacity]
                if pos is not None and held is not None:
                    t.use_count = held.use_count
                    self._slots[pos % self._capacity] = t
                    found += 1
        return found

    def items(self) -> list[Trajectory]:
        with self._cond:
            out = []
            for pos in range(self._tail, self._head):
                t = self._slots[pos % self._capacity]
                if t is not None:  # (None: quarantined)
                    out.append(t)
            return out

    def quarantine(self, traj_ids: Sequence[str], reason: str) -> int:
        """Empty held records by id: their slots hold nothing until evicted (passed over by
        ``sample`` and ``take``, absent from ``items``), counted in ``rejected``."""
        found = 0
        with self._cond:
            for tid in traj_ids:
                pos = self._index.pop(tid, None)
                if pos is None:
                    continue
                slot = pos % self._capacity
                self._slots[slot] = None
                if self._tree is not None:
                    self._tree.set(slot, 0.0)
                found += 1
            self._rejected += found
        log.error("quarantined a batch of %d records: %s", found, reason)
        if self.metrics is not None:
            self.metrics.rejected.inc(found)
        return found

    def reset(self) -> None:
        with self._cond:
            self._slots = [None] * self._capacity
            self._taken = [False] * self._capacity
            self._index.clear()
            self._head = self._tail = self._evicted = self._evicted_unused = self._sampled = 0
            self._taken_count = 0
            self._rejected = self._dropped = self._version = 0
            self._tree = SumTree(self._capacity) if self.sampling.prioritized else None
            self._max_priority = 1.0
            self._inserts.clear()

    def stats(self) -> BufferStats:
        with self._cond:
            return BufferStats(
                size=len(self),
                capacity=self._capacity,
                inserted=self._head,
                evicted=self._evicted,
                evicted_unused=self._evicted_unused,
                sampled=self._sampled,
                taken=self._taken_count,
                rejected=self._rejected,
                dropped_stale=self._dropped,
                policy_version=self._version,
            )
