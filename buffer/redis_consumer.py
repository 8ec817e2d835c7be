"""The consumer half of the Redis ring: what the learner uses (sample, take, quarantine,
write-back, priorities, the policy version, stats).

The learner's ``sample`` keeps retrying an unreachable Redis until its timeout, then raises
SampleTimeout. Records that do not decode, or that break the consumer's ``limits``, are
quarantined on read (emptied and counted in ``rejected``), never handed out.
"""

from __future__ import annotations

import functools
import logging
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from buffer import resp
from buffer.base import (
    BufferUnavailable,
    SampledBatch,
    SampleTimeout,
    Sampling,
    importance_weights,
    pick_fresh,
    priority_of,
)
from buffer.record_codec import decode_many
from buffer.records import NO_LIMITS, RecordError, RecordLimits, Trajectory
from buffer.redis_chunks import ChunkReader, apply_ref, bad_record_key, bad_records, pack_ref
from buffer.redis_layout import TAKEN, OnLayout, RingLayout

log = logging.getLogger("reval.buffer")


@dataclass
class _Gathered:
    """A ``sample`` batch as it fills up, across draws."""

    trajs: list[Trajectory] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)
    version: int = 0
    """The policy version as the last draw read it."""
    size: int = 0
    skipped: int = 0
    dropped: int = 0
    waited: float = 0.0


class RedisConsumer(OnLayout):
    """Samples and takes batches from a run's Redis ring, and writes back what the learner
    learned about them. One instance per process (not shared across threads while sampling;
    the underlying connection pool is thread-safe)."""

    def __init__(
        self,
        layout: RingLayout,
        *,
        seed: int | None = None,
        sampling: Sampling | None = None,
        max_record_bytes: int = 64 << 20,
        limits: RecordLimits = NO_LIMITS,
    ) -> None:
        """A consumer of ``layout``'s ring; the settings are ``BufferConfig``'s (``seed``:
        of the positions drawn; ``max_record_bytes``, ``limits``: a record beyond them is
        quarantined on read)."""
        self.layout = layout
        self._chunks = ChunkReader(layout)
        self._rng = random.Random(seed)
        self._np_rng = np.random.default_rng(self._rng.randrange(2**63))  # draws positions
        self.sampling = Sampling() if sampling is None else sampling
        """The rate limiter, window, staleness and priorities (``buffer.base.Sampling``)."""
        self.max_record_bytes = max_record_bytes
        self.limits = limits
        """What the consumer does with a record (``RecordLimits``): a record that decodes but
        breaks them is quarantined on read like a damaged one."""

    def set_policy_version(self, version: int) -> None:
        meta = self.keys.meta
        self.layout.retry(lambda: self.client.hset(meta, "version", int(version)), self.retry_s)

    # -- sample ---------------------------------------------------------------------------------

    def sample(self, batch_size: int, timeout: float = 0.0) -> SampledBatch:
        """The SAMPLE script drops the too-stale oldest, checks the window and the rate limiter
        and counts the batch (O(1)); the client draws B distinct positions of the window (the
        script's sum-tree walk does when prioritized), then one MULTI/EXEC reads their records,
        reference quantities and the tail, and counts their uses. Positions that turn out
        unusable (evicted since the draw, emptied, stale within the window, corrupt) give their
        count back and are drawn again from the rest of the window."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if batch_size > self.capacity:
            raise ValueError(
                f"cannot sample {batch_size} from a buffer of capacity {self.capacity}"
            )
        start = time.perf_counter()
        deadline = time.monotonic() + timeout
        delay = 0.002
        acc = _Gathered()
        drawn: set[int] = set()
        while len(acc.trajs) < batch_size:
            positions, ps, reason = self._draw_batch(batch_size, acc, drawn, deadline)
            if positions is None:
                if reason is None:  # the run was reset by another client: draw anew
                    continue
                left = deadline - time.monotonic()
                if left <= 0:
                    raise SampleTimeout(reason)
                t0 = time.perf_counter()
                time.sleep(min(delay, left))
                acc.waited += time.perf_counter() - t0
                delay = min(delay * 2, 0.05)
                continue
            drawn.update(positions)
            self._gather(positions, ps, deadline, acc)
        trajs = acc.trajs
        self.layout.remember([t.traj_id for t in trajs], acc.positions)
        if self.sampling.prioritized:
            beta = self.sampling.priority_beta
            weights = importance_weights(np.asarray(acc.probs), int(acc.size), beta)
        else:
            weights = np.ones(batch_size, dtype=np.float32)
        staleness = int(acc.version) - np.asarray(acc.versions, dtype=np.int64)
        skipped = acc.skipped + acc.dropped
        batch = SampledBatch(trajs, weights, staleness, skipped, acc.waited)
        if self.metrics is not None:
            self.metrics.observe_sample(
                time.perf_counter() - start,
                acc.waited,
                staleness.tolist(),
                [t.use_count for t in trajs],
            )
            self.metrics.dropped_stale.inc(skipped)
            self.metrics.size.set(int(acc.size))
        return batch

    def _draw_batch(
        self, batch_size: int, acc: _Gathered, drawn: set[int], deadline: float
    ) -> tuple[list[int] | None, list[float], str | None]:
        """One SAMPLE script call and the positions drawn from its window: (positions, their
        probabilities when prioritized, None), or (None, [], why not), or (None, [], None)
        when the run was reset by another client (``drawn`` is cleared)."""
        need = batch_size - len(acc.trajs)
        args = [
            need,
            self._rng.randrange(1, 2**31 - 1),
            -1 if self.sampling.samples_per_insert is None else self.sampling.samples_per_insert,
            self.sampling.rate_slack,
            self.sampling.min_size_to_sample if not acc.trajs else 0,
            -1 if self.sampling.max_staleness is None else self.sampling.max_staleness,
            int(self.sampling.prioritized),
            self._chunks.newest,
            *(sorted(drawn) if self.sampling.prioritized else ()),
        ]
        try:
            out = self.layout.script("sample", args, retry_s=max(0.0, deadline - time.monotonic()))
        except BufferUnavailable as err:
            raise SampleTimeout(str(err)) from err
        if int(out[0]) == 0:
            acc.dropped += int(out[2])
            return None, [], out[1].decode() if isinstance(out[1], bytes) else str(out[1])
        version, head, tail = (int(x) for x in out[1:4])
        acc.version = version
        acc.dropped += int(out[4])
        acc.size = head - tail
        if self._chunks.behind(head):  # positions started over: what this client knew is void
            self.layout.forget()
            log.warning("run %s was reset by another client; sampling anew", self.run)
            self._chunks.give_back([], need, 0)
            drawn.clear()
            return None, [], None
        self._chunks.add(out[5], tail)
        if self.sampling.prioritized:
            return [int(p) for p in out[6]], [float(p) for p in out[7]], None
        positions = _draw(self._rng, self._np_rng, need, tail, head, drawn)
        if positions is None:
            self._chunks.give_back([], need, 0)
            within = (
                "within max_staleness"
                if self.sampling.max_staleness is not None
                else "usable (emptied ones are skipped)"
            )
            return None, [], f"fewer than {batch_size} trajectories {within} in {acc.size} held"
        return positions, [], None

    def _gather(
        self, positions: list[int], ps: list[float], deadline: float, acc: _Gathered
    ) -> None:
        """Read the records at ``positions`` (counting their uses) into ``acc``; those that
        turn out unusable (evicted, emptied, stale, malformed) give their count back, and the
        malformed are quarantined."""
        reads = self.layout.retry(
            functools.partial(self._chunks.read, positions, True),
            max(self.retry_s, deadline - time.monotonic()),
        )
        order, blobs, refs, uses, tail_now = (
            reads.order, reads.blobs, reads.refs, reads.uses, reads.tail
        )  # fmt: skip
        prob_of = dict(zip(positions, ps, strict=True)) if ps else {}
        if all(b is not None for b in blobs) and (not order or order[0] >= tail_now):
            present, unusable = list(range(len(order))), []  # the usual case: all there
        else:
            present = [k for k, b in enumerate(blobs) if b is not None and order[k] >= tail_now]
            unusable = [order[k] for k, b in enumerate(blobs) if b is None or order[k] < tail_now]
        good, bad = decode_many([blobs[k] for k in present], self.max_record_bytes, self.limits)
        bad_at = {present[i] for i, _ in bad}
        for i, problem in bad:  # (a line per reason, then one a minute with the count)
            bad_records.error(bad_record_key("quarantined", problem),
                              "quarantined a malformed record at position %d: %s",
                              order[present[i]], problem)  # fmt: skip
        floor = self.sampling.floor(acc.version)
        if not bad_at and floor is None and not prob_of and len(good) == len(order):
            # The usual case, without a per-record branch: every record drawn is handed out.
            for t, u, ref in zip(good, uses, refs, strict=True):
                t.use_count = u
                if ref is not None:
                    apply_ref(t, ref)
            acc.trajs += good
            acc.positions += order
            acc.versions += [t.policy_version for t in good]
            return
        stale = 0
        it = iter(good)
        for k in present:
            if k in bad_at:
                unusable.append(order[k])
                continue
            t = next(it)
            if floor is not None and t.policy_version < floor:
                stale += 1  # a slow worker's, further in: skipped, not dropped
                unusable.append(order[k])
                continue
            t.use_count = uses[k]
            if refs[k] is not None:
                apply_ref(t, refs[k])
            acc.trajs.append(t)
            acc.positions.append(order[k])
            acc.versions.append(t.policy_version)
            if prob_of:
                acc.probs.append(prob_of[order[k]])
        acc.skipped += stale
        if unusable:
            self._chunks.give_back(unusable, len(unusable), stale)
        if bad_at:
            self._chunks.quarantine(sorted(order[k] for k in bad_at))
            if self.metrics is not None:
                self.metrics.rejected.inc(len(bad_at))

    # -- take -----------------------------------------------------------------------------------

    def take(
        self,
        batch_size: int,
        timeout: float = 0.0,
        whole_groups: bool = False,
        oldest_first: bool = False,
    ) -> SampledBatch:
        """Reads the window and the use counts (one round trip), then the never-taken records
        of the newest chunks (or the oldest) until enough are found (a chunk is one insert's,
        cut only between groups), picks them (``buffer.base.pick_fresh``), and marks them taken,
        counts their uses and the batch in one MULTI/EXEC (the mark is the use count's top bit,
        ``TAKEN``). One consumer at a time (the learner's rank 0): a position evicted
        between the read and the count gives its count back and is picked anew."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        start = time.perf_counter()
        deadline = time.monotonic() + timeout
        waited = 0.0
        delay = 0.002
        while True:
            try:
                got = self.layout.retry(
                    functools.partial(self._take_once, batch_size, whole_groups, oldest_first),
                    max(0.0, deadline - time.monotonic()),
                )
            except BufferUnavailable as err:
                raise SampleTimeout(str(err)) from err
            if isinstance(got, SampledBatch):
                break
            left = deadline - time.monotonic()
            if left <= 0:
                raise SampleTimeout(got)
            t0 = time.perf_counter()
            time.sleep(min(delay, left))
            waited += time.perf_counter() - t0
            delay = min(delay * 2, 0.05)
        got.wait_s = waited
        if self.metrics is not None:
            self.metrics.observe_sample(
                time.perf_counter() - start, waited, got.staleness.tolist(), [1] * len(got)
            )
        return got

    def _take_once(
        self, batch_size: int, whole_groups: bool, oldest_first: bool
    ) -> SampledBatch | str:
        """One attempt of ``take``: the batch, or why there is none yet."""
        k, cap = self.keys, self.capacity
        pipe = self.client.pipeline(transaction=True)
        pipe.hmget(k.meta, "head", "tail", "version")
        pipe.zrangebyscore(k.chunks, f"({self._chunks.newest}", "+inf", withscores=True)
        pipe.get(k.use)
        (head_b, tail_b, ver_b), fresh, use_raw = pipe.execute()
        head, tail = self.layout.window(head_b, tail_b)
        version = self.layout.meta_int("version", ver_b)
        self._chunks.behind(head)  # (reset by another client: start the index over)
        chunks = self._chunks.add([x for end, first in fresh for x in (end, first)], tail)
        uses = np.frombuffer(use_raw or b"", dtype=">u4")
        floor = self.sampling.floor(version)
        got = self._chunks.fresh_runs(
            chunks, tail, uses, floor, self.max_record_bytes, self.limits,
            (batch_size, whole_groups, oldest_first),
        )  # fmt: skip
        if isinstance(got, str):
            return got
        runs, found, picked = got
        if picked is None and whole_groups:  # (short batches of uneven groups)
            picked = pick_fresh(runs, batch_size, whole_groups, oldest_first)
        if picked is None:
            what = "in whole groups " if whole_groups else ""
            return f"fewer than {batch_size} fresh trajectories {what}in {head - tail} held"
        res = self.layout.transact(
            [
                resp.pack("HGET", k.meta, "tail"),
                resp.bitfield_u32(k.use, [p % cap for p in picked], TAKEN + 1),
                resp.pack("HINCRBY", k.meta, "sampled", len(picked)),
                resp.pack("HINCRBY", k.meta, "taken", len(picked)),
            ]
        )
        tail_now = self.layout.meta_int("tail", res[0])
        gone = [p for p in picked if p < tail_now]
        if gone:  # evicted meanwhile: undo every count (also the newer records' in their slots)
            self.layout.transact(
                [
                    resp.bitfield_u32(k.use, [p % cap for p in picked], -(TAKEN + 1)),
                    resp.pack("HINCRBY", k.meta, "sampled", -len(picked)),
                    resp.pack("HINCRBY", k.meta, "taken", -len(picked)),
                ]
            )
            return f"{len(gone)} fresh trajectories were evicted while being taken"
        trajs = [found[p] for p in picked]
        for t, count in zip(trajs, res[1], strict=True):
            t.use_count = count & ~TAKEN  # (1, or more when a uniform sample drew it first)
        self.layout.remember([t.traj_id for t in trajs], picked)
        staleness = version - np.asarray([t.policy_version for t in trajs], dtype=np.int64)
        return SampledBatch(trajs, np.ones(len(trajs), dtype=np.float32), staleness, fresh=True)

    # -- what the learner writes back -----------------------------------------------------------

    def quarantine(self, traj_ids: Sequence[str], reason: str) -> int:
        """Quarantine held records by id (ones this client inserted, sampled or listed): a batch
        the learner could not update on, whatever the checks let through. Emptied and counted in
        ``rejected`` like a damaged record; returns how many were found."""
        positions = [p for p in map(self.layout.position, traj_ids) if p is not None]
        log.error("quarantined a batch of %d records: %s", len(positions), reason)
        self._chunks.quarantine(positions)
        if self.metrics is not None:
            self.metrics.rejected.inc(len(positions))
        return len(positions)

    def update_priorities(self, traj_ids: Sequence[str], deltas: Sequence[float]) -> int:
        """Priorities of trajectories this client inserted, sampled or listed (their positions
        are remembered); others count as not held."""
        if len(traj_ids) != len(deltas):
            raise ValueError(f"{len(traj_ids)} ids but {len(deltas)} deltas")
        if not self.sampling.prioritized or not traj_ids:
            return 0
        args: list[Any] = []
        s = self.sampling
        for tid, d in zip(traj_ids, deltas, strict=True):
            pos = self.layout.position(tid)
            if pos is not None:
                args += [pos, repr(priority_of(d, s.priority_alpha, s.priority_eps))]
        return int(self.layout.script("priorities", args)) if args else 0

    def write_back(self, trajectories: Sequence[Trajectory]) -> int:
        """Store the cached reference quantities of held trajectories that this client
        inserted, sampled or listed (a few bytes each, beside the record: the record's bytes are
        not rewritten)."""
        args: list[Any] = []
        for t in trajectories:
            pos = self.layout.position(t.traj_id)
            start = None if pos is None else self._chunks.start_of(pos)
            if pos is not None and start is not None:
                try:
                    args += [pos, start, pack_ref(t)]
                except RecordError as err:  # not cached: computed afresh when next sampled
                    bad_records.error(bad_record_key("write-back", err),
                                      "did not write back %s", err)  # fmt: skip
        return int(self.layout.script("write_back", args)) if args else 0

    # -- the whole ring -------------------------------------------------------------------------

    def items(self) -> list[Trajectory]:
        k = self.keys

        def window() -> tuple[int, int, list[Any]]:
            pipe = self.client.pipeline(transaction=True)
            pipe.hmget(k.meta, "head", "tail")
            pipe.zrangebyscore(k.chunks, f"({self._chunks.newest}", "+inf", withscores=True)
            (head, tail), fresh = pipe.execute()
            flat = [x for end, start in fresh for x in (end, start)]
            return *self.layout.window(head, tail), flat

        head, tail, flat = self.layout.retry(window, self.retry_s)
        self._chunks.add(flat, tail)
        out: list[Trajectory] = []
        where: list[int] = []
        for lo in range(tail, head, 512):
            reads = self.layout.retry(
                functools.partial(self._chunks.read, range(lo, min(lo + 512, head)), False),
                self.retry_s,
            )
            order, blobs = reads.order, reads.blobs
            keep = [i for i, b in enumerate(blobs) if b is not None and order[i] >= reads.tail]
            good, bad = decode_many([blobs[i] for i in keep], self.max_record_bytes, self.limits)
            bad_at = {keep[i] for i, _ in bad}  # evicted meanwhile are absent; corrupt skipped
            it = iter(good)
            for i in keep:
                if i in bad_at:
                    continue
                t = next(it)
                t.use_count = int(reads.uses[i])
                apply_ref(t, reads.refs[i])
                out.append(t)
                where.append(order[i])
        self.layout.remember([t.traj_id for t in out], where)
        return out

    def delete(self) -> None:
        """Remove the run's keys (its buffer, its records and its counters)."""
        self.layout.delete()

    def reset(self) -> None:
        self.layout.delete()
        self._chunks.clear()
        self.layout.forget()
        self.layout.open(self.retry_s)

    def close(self) -> None:
        """Close the connections (unless the client was passed in)."""
        self.layout.close()


def _draw(
    rng: random.Random, np_rng: np.random.Generator, k: int, tail: int, head: int, drawn: set[int]
) -> list[int] | None:
    """k distinct positions of [tail, head) not in ``drawn``, uniformly (None: too few)."""
    n = head - tail
    if not drawn:
        if n < k:
            return None
        picked: list[int] = (np_rng.choice(n, k, replace=False) + tail).tolist()
        return picked
    left = n - sum(1 for p in drawn if tail <= p < head)
    if left < k:
        return None
    if left < 4 * k:  # few left: draw from the list of them
        return rng.sample([p for p in range(tail, head) if p not in drawn], k)
    out: set[int] = set()
    while len(out) < k:
        for p in (np_rng.choice(n, k, replace=False) + tail).tolist():
            if p not in drawn and len(out) < k:
                out.add(p)
    return list(out)
