"""The consumer's view of the ring's record chunks: which chunk holds a position, reading
records by position in one MULTI/EXEC, and the writes that follow a read (quarantine, giving
back use counts). Used by ``buffer.redis_consumer``.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import math
import re
import threading
from collections.abc import Sequence
from typing import Any

import msgpack
import numpy as np

from buffer import resp
from buffer.base import FreshRun, pick_fresh
from buffer.record_codec import decode_many
from buffer.records import RecordError, RecordLimits, Trajectory
from buffer.redis_layout import TAKEN, RingLayout
from reval.ratelog import RateLog

log = logging.getLogger("reval.buffer")

bad_records = RateLog(log, every_s=60.0)
"""The lines of damaged records (quarantined by a reader, rejected by a producer, not written
back): a flood of 10,000 bad records wrote a line each. Keyed by what is wrong
(``bad_record_key``): the first of a kind at once, then one a minute with the count held back."""

_NAMING = re.compile(r"'[^']*'|\"[^\"]*\"|\d+(?:\.\d*)?(?:e[+-]?\d+)?")
"""What names one record in a ``RecordError`` (its index, its id, sizes and values)."""


def bad_record_key(what: str, err: object) -> str:
    """The ``bad_records`` key of a damaged record: ``what`` befell it and why, without what
    names the record (``record 3 ('t3'): token id 50 >= ...`` and ``record 9 ('t9'): token id
    71 >= ...`` are one reason)."""
    return f"{what}: {_NAMING.sub('#', str(err))}"


class _ChunkIndex:
    """The client's copy of the run's chunk list (first position -> end), kept in step with
    the ``chunks`` sorted set: chunks never change once inserted, so each sample only asks for
    those newer than the newest it knows, and forgets those below the tail."""

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.ends: list[int] = []

    @property
    def newest(self) -> int:
        return self.starts[-1] if self.starts else -1

    def add(self, flat: Sequence[Any]) -> None:
        """``flat`` = [end, start, end, start, ...] as ZRANGEBYSCORE ... WITHSCORES gives.
        Raises ValueError on a member that is not a chunk's end after its start."""
        for k in range(0, len(flat), 2):
            try:
                start, end = float(flat[k + 1]), int(flat[k])
                ok = start.is_integer() and 0 <= start < end
            except ValueError:
                ok = False
            if not ok:
                raise ValueError(f"chunks member {flat[k]!r} with score {flat[k + 1]!r}")
            if start > self.newest:
                self.starts.append(int(start))
                self.ends.append(end)

    def forget_below(self, tail: int) -> None:
        drop = bisect.bisect_right(self.ends, tail)
        if drop:
            del self.starts[:drop], self.ends[:drop]

    def start_of(self, pos: int) -> int | None:
        i = bisect.bisect_right(self.starts, pos) - 1
        if i < 0 or pos >= self.ends[i]:
            return None
        return self.starts[i]

    def group(
        self, positions: Sequence[int]
    ) -> tuple[list[tuple[int, list[int]]], list[int], list[int]]:
        """Sort positions into the chunks that hold them: ([(chunk start, offsets)], the held
        positions in that order, the positions no known chunk holds)."""
        pos = np.sort(np.asarray(positions, dtype=np.int64))
        starts = np.asarray(self.starts, dtype=np.int64)
        ends = np.asarray(self.ends, dtype=np.int64)
        at = np.searchsorted(starts, pos, side="right") - 1
        ok = at >= 0
        ok[ok] = pos[ok] < ends[at[ok]]
        held, at = pos[ok], at[ok]
        first = starts[at]
        cuts = (np.flatnonzero(np.diff(at)) + 1).tolist()
        offsets = (held - first).tolist()
        bounds = [0, *cuts, len(offsets)]
        groups = [(int(first[a]), offsets[a:b]) for a, b in itertools.pairwise(bounds)]
        return (groups if offsets else []), held.tolist(), pos[~ok].tolist()


class Reads:
    """What ``read`` returns: per position read (in ``order``), its record bytes, its written-
    back reference quantities and its use count (None, None, 0 where no chunk holds it), and
    the tail as read in the same transaction."""

    __slots__ = ("blobs", "order", "refs", "tail", "uses")

    def __init__(
        self, order: list[int], tail: int, blobs: list[Any], refs: list[Any], uses: list[int]
    ) -> None:
        self.order, self.tail, self.blobs, self.refs, self.uses = order, tail, blobs, refs, uses


class ChunkReader:
    """The chunks a consumer knows (kept in step with ``chunks``) and the reads by position
    through them. Thread-safe."""

    def __init__(self, layout: RingLayout) -> None:
        self.layout = layout
        self._index = _ChunkIndex()
        self._lock = threading.Lock()

    @property
    def newest(self) -> int:
        """The first position of the newest chunk known (-1: none)."""
        return self._index.newest

    def behind(self, head: int) -> bool:
        """Forget every chunk if one known ends past ``head`` (the run was reset by another
        client: positions started over); True if so."""
        with self._lock:
            if self._index.ends and self._index.ends[-1] > head:
                self._index = _ChunkIndex()
                return True
            return False

    def add(self, flat: Sequence[Any], tail: int) -> list[tuple[int, int]]:
        """Learn the chunks in ``flat`` (ZRANGEBYSCORE ... WITHSCORES), forget those below
        ``tail``; returns every chunk held as (first, end). RingCorrupt on a malformed one."""
        with self._lock:
            try:
                self._index.add(flat)
            except ValueError as err:
                raise self.layout.corrupt(str(err)) from None
            self._index.forget_below(tail)
            return list(zip(self._index.starts, self._index.ends, strict=True))

    def clear(self) -> None:
        with self._lock:
            self._index = _ChunkIndex()

    def start_of(self, pos: int) -> int | None:
        """The first position of the chunk that holds ``pos`` (None: no known chunk)."""
        with self._lock:
            return self._index.start_of(pos)

    def read(self, positions: Sequence[int], count_use: bool) -> Reads:
        """One MULTI/EXEC: the tail, then per chunk an HMGET of the records and their reference
        quantities, then one BITFIELD over the use counts (INCRBY 1 when ``count_use``, else
        GET). A position outside the known chunks reads as missing."""
        layout = self.layout
        k, cap = layout.keys, layout.capacity
        cmds = [resp.pack("HGET", k.meta, "tail")]
        with self._lock:
            groups, order, missing = self._index.group(positions)
        for start, offsets in groups:
            cmds.append(resp.hmget_with_refs(k.chunk(start), offsets))
        if order:
            cmds.append(
                resp.bitfield_u32(k.use, [p % cap for p in order], 1 if count_use else None)
            )
        res = layout.transact(cmds)
        blobs: list[Any] = []
        refs: list[Any] = []
        for got in res[1 : len(res) - (1 if order else 0)]:
            blobs += got[0::2]
            refs += got[1::2]
        uses = [u & ~TAKEN for u in res[-1]] if order else []
        # Positions no chunk holds (never written, or evicted since): missing, no use counted.
        order += missing
        blobs += [None] * len(missing)
        refs += [None] * len(missing)
        uses += [0] * len(missing)
        return Reads(order, layout.meta_int("tail", res[0]), blobs, refs, uses)

    def quarantine(self, positions: Sequence[int]) -> None:
        """Empty the records at ``positions`` and count them in ``rejected`` (the script)."""
        args: list[Any] = []
        for p in positions:
            start = self.start_of(p)
            if start is not None:
                args += [p, start]
        if args:
            self.layout.script("quarantine", args)

    def give_back(self, positions: Sequence[int], unsampled: int, stale: int) -> None:
        """Undo the use counts of positions drawn but not handed out (saturating at 0: a slot
        reused since starts at 0), and their count in ``sampled``; count stale skips."""
        layout = self.layout
        cap, keys = layout.capacity, layout.keys
        positions = [p for p in positions if self.start_of(p) is not None]

        def send() -> None:
            pipe = layout.client.pipeline(transaction=False)
            if positions:
                bits: list[Any] = ["OVERFLOW", "SAT"]
                for p in positions:
                    bits += ("INCRBY", "u32", f"#{p % cap}", -1)
                pipe.execute_command("BITFIELD", keys.use, *bits)  # type: ignore[no-untyped-call]
            if unsampled:
                pipe.hincrby(keys.meta, "sampled", -unsampled)
            if stale:
                pipe.hincrby(keys.meta, "dropped", stale)
            pipe.execute()

        layout.retry(send, layout.retry_s)

    def fresh_runs(
        self, chunks: list[tuple[int, int]], tail: int, uses: Any, floor: int | None,
        max_record_bytes: int, limits: RecordLimits, pick: tuple[int, bool, bool],
    ) -> tuple[list[FreshRun], dict[int, Trajectory], list[int] | None] | str:  # fmt: skip
        """``take``'s candidates chunk by chunk (newest first, or oldest) until enough are
        found: (the runs read, the records by position, the positions picked or None), or why
        not (malformed records among them, or beyond ``max_record_bytes`` and ``limits``,
        were quarantined). ``uses``: the use counts by slot; ``floor``: the oldest policy
        version usable; ``pick``: ``take``'s (batch_size, whole_groups, oldest_first)."""
        batch_size, whole_groups, oldest_first = pick
        cap = self.layout.capacity
        metrics = self.layout.metrics
        runs: list[FreshRun] = []
        found: dict[int, Trajectory] = {}
        unused_total = 0
        for first, end in chunks if oldest_first else reversed(chunks):
            lo = max(first, tail)
            if lo >= end:
                continue
            slots = np.arange(lo, end) % cap
            unused = [
                int(p) for p, s in zip(range(lo, end), slots, strict=True)
                if s >= len(uses) or not uses[s] & TAKEN
            ]  # fmt: skip
            if not unused:
                continue
            reads = self.read(unused, False)
            order, blobs = reads.order, reads.blobs
            present = [k for k, b in enumerate(blobs) if b is not None]
            good, bad = decode_many([blobs[k] for k in present], max_record_bytes, limits)
            if bad:  # quarantined (emptied, counted); the next attempt reads the chunk without
                for i, problem in bad:
                    bad_records.error(bad_record_key("quarantined", problem),
                                      "quarantined a malformed record at position %d: %s",
                                      order[present[i]], problem)  # fmt: skip
                self.quarantine([order[present[i]] for i, _ in bad])
                if metrics is not None:
                    metrics.rejected.inc(len(bad))
                return f"quarantined {len(bad)} malformed records among the fresh ones"
            it = iter(good)
            for pos, b, ref in zip(order, blobs, reads.refs, strict=True):
                if b is not None:
                    found[pos] = t = next(it)
                    apply_ref(t, ref)
            positions = list(range(lo, end))
            held = [found.get(p) for p in positions]
            usable = [t is not None and (floor is None or t.policy_version >= floor) for t in held]
            gids = [t.group_id if t is not None else "" for t in held]
            runs.append(FreshRun(positions, gids, usable, truncated=first < tail))
            unused_total += sum(usable)
            if unused_total >= batch_size:
                picked = pick_fresh(runs, batch_size, whole_groups, oldest_first)
                if picked is not None:
                    return runs, found, picked
        return runs, found, None


def pack_ref(t: Trajectory) -> bytes:
    """The cached reference quantities of ``t`` as written back beside its record."""
    if not (math.isfinite(t.ref_logprob_sum) and math.isfinite(t.ref_value)):
        raise RecordError(f"{t.traj_id!r}: cached reference quantities are not finite")
    ref_version = None if t.ref_version is None else int(t.ref_version)
    packed: bytes = msgpack.packb([ref_version, float(t.ref_logprob_sum), float(t.ref_value)])
    return packed


def apply_ref(t: Trajectory, packed: bytes | None) -> None:
    """The cached reference quantities written back beside a record. A malformed or non-finite
    cache is ignored (logged): the record's own (checked) fields stay, and the learner computes
    the reference quantities afresh and writes them back over it."""
    if packed is None:
        return
    try:
        ref_version, slp, v1 = msgpack.unpackb(packed)
        ref_version = None if ref_version is None else int(ref_version)
        slp, v1 = float(slp), float(v1)
        if not (math.isfinite(slp) and math.isfinite(v1)):
            raise ValueError(f"not finite: {slp}, {v1}")
    except (ValueError, TypeError, msgpack.UnpackException) as err:
        what = bad_record_key("reference", err)
        bad_records.error(what, "ignored malformed reference quantities of %s: %s", t.traj_id, err)
        return
    t.ref_version, t.ref_logprob_sum, t.ref_value = ref_version, slp, v1
