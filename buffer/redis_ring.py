"""The replay service's Redis backend: a per-run FIFO ring shared by every rollout worker and the
learner, kept across restarts of any of them (and of Redis, with AOF on: see docs/buffer.md).

Writes go through server-side Lua scripts (``buffer.redis_lua``), so concurrent producers and
consumers see atomic inserts and samples. Faults: every call is retried with exponential backoff
on a dropped connection or a restarting Redis; a producer that cannot reach Redis keeps its
encoded batches in a bounded local spool and flushes them, in order, once Redis answers again (a
retried batch that had in fact landed is not stored twice: inserts skip trajectory ids already
held). The learner's ``sample`` keeps retrying until its timeout, then raises SampleTimeout.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import hashlib
import itertools
import logging
import math
import random
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeVar

import msgpack
import numpy as np
import redis
from redis.exceptions import BusyLoadingError, ExecAbortError, NoScriptError, ResponseError

from buffer import resp
from buffer.base import (
    BufferStats,
    BufferUnavailable,
    FreshRun,
    SampledBatch,
    SampleTimeout,
    importance_weights,
    pick_fresh,
    priority_of,
)
from buffer.metrics import BufferMetrics
from buffer.records import (
    NO_LIMITS,
    RecordError,
    RecordLimits,
    Trajectory,
    decode_many,
    encode_many,
)
from buffer.redis_lua import INSERT, OPEN, PRIORITIES, QUARANTINE, SAMPLE, WRITE_BACK

log = logging.getLogger("reval.buffer")
T = TypeVar("T")

# Errors worth a retry: the connection went away, timed out, or Redis is loading its AOF.
RETRYABLE: tuple[type[BaseException], ...] = (
    redis.ConnectionError,
    redis.TimeoutError,
    BusyLoadingError,
    ConnectionError,
    OSError,
)


class RingCorrupt(RuntimeError):
    """The ring's bookkeeping in Redis (its ``meta`` hash or ``chunks`` set) is damaged: written
    by hand or by another program. The message names what is wrong and how to repair it."""


CHUNK_BYTES = 8 << 20  # one insert script call carries at most this much
CHUNK_RECORDS = 2048
TAKEN = 1 << 31
"""The top bit of a slot's use count (``use``): a ``take`` has handed the record out. Counts
read back mask it off; a record with it is used, so the eviction count of unused ones holds."""


class RunKeys(NamedTuple):
    """A run's keys, in the order the scripts take them (``rec`` is the chunks' key prefix)."""

    meta: str
    dig: str
    tree: str
    ver: str
    use: str
    chunks: str
    rec: str

    @property
    def stored(self) -> list[str]:
        """The keys other than the record chunks' (and the stages')."""
        return list(self[:6])

    @property
    def stage(self) -> str:
        """The prefix of the stage hashes that producers write chunks to."""
        return self.rec[: -len("r:")] + "stage:"


def run_keys(prefix: str, run: str) -> RunKeys:
    """The run's keys (one hash tag, so a Redis Cluster keeps them together)."""
    if not run or any(c in run for c in "{}: \n"):
        raise ValueError(f"run id must be non-empty without braces, colons or spaces: {run!r}")
    base = f"{prefix}{{{run}}}:"
    return RunKeys._make([*(base + k for k in RunKeys._fields[:6]), base + "r:"])


REPAIR = (
    "stop the run's learner and workers, then delete the ring's keys, and only those (the run's "
    "control, status, events and weights stay): redis-cli del "
    + " ".join(f"'{{prefix}}{{{{{{run}}}}}}:{k}'" for k in RunKeys._fields[:6])
    + '; for k in r stage; do redis-cli --scan --pattern "{prefix}{{{run}}}:$k:*" | xargs -r '
    "redis-cli del; done (the trajectories it held are lost; checkpoints are not, and the workers "
    "refill it)"
)


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


def _glob_escape(text: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


def _pack_ref(t: Trajectory) -> bytes:
    if not (math.isfinite(t.ref_logprob_sum) and math.isfinite(t.ref_value)):
        raise RecordError(f"{t.traj_id!r}: cached reference quantities are not finite")
    ref_version = None if t.ref_version is None else int(t.ref_version)
    packed: bytes = msgpack.packb([ref_version, float(t.ref_logprob_sum), float(t.ref_value)])
    return packed


def _apply_ref(t: Trajectory, packed: bytes | None) -> None:
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
        log.error("ignored malformed reference quantities of %s: %s", t.traj_id, err)
        return
    t.ref_version, t.ref_logprob_sum, t.ref_value = ref_version, slp, v1


@dataclass
class _Chunk:
    """One insert round trip: the records' bytes, ids and policy versions."""

    blobs: list[bytes]
    ids: list[str]
    versions: list[int]
    nbytes: int
    stage: str = dataclasses.field(default_factory=lambda: uuid.uuid4().hex)
    """Names the stage hash: fixed per chunk, so a resend rewrites the same one."""

    @property
    def count(self) -> int:
        return len(self.blobs)

    def script_args(self, prioritized: bool) -> list[Any]:
        """The INSERT script's arguments after the capacity."""
        digest = hashlib.blake2b("\0".join(self.ids).encode(), digest_size=16).hexdigest()
        vblob = (np.asarray(self.versions, dtype=np.int64) + 1).astype(">u4").tobytes()
        return [self.count, int(prioritized), digest, vblob]


class RedisRing:
    """A ReplayBuffer on Redis. One instance per process (not shared across threads while
    sampling; the underlying connection pool is thread-safe)."""

    def __init__(
        self,
        run: str,
        capacity: int,
        *,
        url: str = "redis://127.0.0.1:6379/0",
        key_prefix: str = "reval:",
        client: redis.Redis | None = None,
        seed: int | None = None,
        samples_per_insert: float | None = None,
        rate_slack: int = 0,
        min_size_to_sample: int = 0,
        max_staleness: int | None = None,
        prioritized: bool = False,
        priority_alpha: float = 0.6,
        priority_beta: float = 0.4,
        priority_eps: float = 1e-3,
        spool_max_bytes: int = 256 << 20,
        retry_s: float = 30.0,
        metrics: BufferMetrics | None = None,
        max_record_bytes: int = 64 << 20,
        reset: bool = False,
        open_retry_s: float = 5.0,
        background: bool = False,
        limits: RecordLimits = NO_LIMITS,
    ) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.run = run
        self._capacity = capacity
        self.keys = run_keys(key_prefix, run)
        self._own_client = client is None
        self.client = client or redis.Redis.from_url(
            url, socket_timeout=30, socket_connect_timeout=2, health_check_interval=15
        )
        self._rng = random.Random(seed)
        self._np_rng = np.random.default_rng(self._rng.randrange(2**63))  # draws positions
        self.samples_per_insert = samples_per_insert
        self.rate_slack = rate_slack
        self.min_size_to_sample = min_size_to_sample
        self.max_staleness = max_staleness
        self.prioritized = prioritized
        self.alpha, self.beta, self.eps = priority_alpha, priority_beta, priority_eps
        self.spool_max_bytes = spool_max_bytes
        self.retry_s = retry_s
        self.max_record_bytes = max_record_bytes
        self.limits = limits
        """What the consumer does with a record (``RecordLimits``): a record that decodes but
        breaks them is quarantined on read like a damaged one."""
        self.metrics = metrics
        self._spool: deque[_Chunk] = deque()
        self._spool_bytes = 0
        self._spool_lock = threading.RLock()  # guards the spool (a deque kept in insert order)
        self._send_lock = threading.Lock()  # one sender at a time: chunks land in order
        self._inflight: _Chunk | None = None
        self.background = background
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._sender: threading.Thread | None = None
        self.spool_dropped = 0
        self._down_since: float | None = None
        self._index = _ChunkIndex()
        self._index_lock = threading.Lock()
        # Trajectory id -> position, for write_back and update_priorities (the learner passes
        # back trajectories it sampled); filled by insert, sample and items, bounded.
        self._where: dict[str, int] = {}
        self._where_max = max(4 * capacity, 1 << 16)
        self._where_lock = threading.Lock()
        self._scripts = {
            name: self.client.register_script(src)
            for name, src in (
                ("open", OPEN),
                ("insert", INSERT),
                ("sample", SAMPLE),
                ("priorities", PRIORITIES),
                ("write_back", WRITE_BACK),
                ("quarantine", QUARANTINE),
            )
        }
        if metrics is not None:
            metrics.capacity.set(capacity)
        try:
            if reset:
                self._retry(self._delete, open_retry_s)
            self._open(open_retry_s)
        except BufferUnavailable as err:
            if reset:
                raise
            # A producer may start before Redis: every script creates the run when missing.
            log.warning("run %s: Redis not reachable yet (%s); inserts will spool", run, err)
        if background:
            self._sender = threading.Thread(
                target=self._send_loop, name=f"reval-buffer-sender-{run}", daemon=True
            )
            self._sender.start()

    # -- plumbing -------------------------------------------------------------------------------

    def _open(self, retry_s: float) -> None:
        self._script("open", [], retry_s=retry_s)

    def _remember(self, ids: Sequence[str], positions: Sequence[int]) -> None:
        where = self._where
        with self._where_lock:  # a Prefetcher samples from several threads
            where.update(zip(ids, positions, strict=True))
            excess = len(where) - self._where_max
            if excess > 0:
                for tid in list(itertools.islice(where, excess)):
                    del where[tid]

    def _script(self, name: str, args: Sequence[Any], retry_s: float | None = None) -> Any:
        return self._retry(
            lambda: self._scripts[name](keys=self.keys, args=[self._capacity, *args]),
            self.retry_s if retry_s is None else retry_s,
        )

    def _retry(self, fn: Callable[[], T], budget_s: float) -> T:
        deadline = time.monotonic() + budget_s
        delay = 0.05
        while True:
            try:
                out = fn()
            except ResponseError as err:
                if str(err).startswith("CAPACITY"):
                    raise ValueError(f"run {self.run!r}: {err}") from None
                if str(err).startswith("CORRUPT"):
                    raise self._corrupt(str(err)[len("CORRUPT ") :]) from None
                raise
            except ValueError as err:  # the client's parsing of the bookkeeping it read
                if isinstance(err, RecordError):
                    raise
                raise self._corrupt(str(err)) from None
            except RETRYABLE as err:
                self._note_down(err)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise BufferUnavailable(
                        f"Redis unreachable for {budget_s:.1f}s: {err}"
                    ) from err
                time.sleep(min(delay, left))
                delay = min(delay * 2, 2.0)
                continue
            if self._down_since is not None:
                log.warning(
                    "Redis answers again after %.1fs (run %s)",
                    time.monotonic() - self._down_since,
                    self.run,
                )
                self._down_since = None
            return out

    def _window(self, head_b: Any, tail_b: Any) -> tuple[int, int]:
        """(head, tail) as read from ``meta``; RingCorrupt unless they make a window:
        integers, 0 <= tail <= head <= tail + capacity (what the scripts check too)."""
        head, tail = self._meta_int("head", head_b), self._meta_int("tail", tail_b)
        if not 0 <= tail <= head <= tail + self._capacity:
            raise self._corrupt(f"meta head={head} tail={tail}")
        return head, tail

    def _meta_int(self, name: str, raw: Any) -> int:
        """A field of the ring's bookkeeping as read back (bytes; None: never set, 0), as an
        int; RingCorrupt naming the field unless it is one. Every integer the client reads from
        ``meta`` goes through here (the scripts check theirs in ``ensure``)."""
        if raw is None:
            return 0
        if isinstance(raw, int) and not isinstance(raw, bool):
            return raw
        try:
            return int(raw)
        except (TypeError, ValueError):
            text = raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)
            raise self._corrupt(f"meta {name}={text} (need an integer)") from None

    def _corrupt(self, what: str) -> RingCorrupt:
        return RingCorrupt(
            f"run {self.run!r}: the ring's bookkeeping in Redis is corrupt ({what}): "
            + REPAIR.format(prefix=self.keys.meta.rsplit("{", 1)[0], run=self.run)
        )

    def _note_down(self, err: BaseException) -> None:
        if self.metrics is not None:
            self.metrics.backend_errors.inc()
        if self._down_since is None:
            self._down_since = time.monotonic()
            log.warning("Redis call failed (run %s), retrying with backoff: %s", self.run, err)

    def _transact(self, commands: Sequence[bytes]) -> list[Any]:
        """Send packed commands as one MULTI/EXEC on a pooled connection and return EXEC's
        replies (an error among them is raised). The connection is dropped on any failure, so
        no half-read reply can reach its next user."""
        pool = self.client.connection_pool
        conn = pool.get_connection()
        try:
            conn.send_packed_command([b"".join([resp.MULTI, *commands, resp.EXEC])])  # type: ignore[no-untyped-call]
            for _ in range(len(commands) + 1):  # OK, then QUEUED per command
                conn.read_response()
            res = conn.read_response()
        except BaseException:
            conn.disconnect()  # type: ignore[no-untyped-call]
            raise
        finally:
            pool.release(conn)
        if not isinstance(res, list):
            raise redis.ResponseError(f"EXEC answered {res!r}")
        for r in res:
            if isinstance(r, Exception):
                raise r
        return res

    @property
    def capacity(self) -> int:
        return self._capacity

    def __len__(self) -> int:
        head_b, tail_b = self._retry(
            lambda: self.client.hmget(self.keys.meta, "head", "tail"), self.retry_s
        )
        head, tail = self._window(head_b, tail_b)
        return head - tail

    # -- producers ------------------------------------------------------------------------------

    def insert(self, trajectories: Sequence[Trajectory]) -> int:
        """Validate and encode all, then insert in order: per chunk of at most 8 MB, one
        MULTI/EXEC round trip (an HSET of the records to a stage hash, then the INSERT script,
        which gives them their positions). When Redis is unreachable the batch goes to the local
        spool and 0 is returned (``spooled`` says how many wait); spooled chunks are sent first
        on the next call, and by ``flush``/``close``. With ``background=True`` every batch goes
        through the spool and a sender thread, so encoding the next batch overlaps this one's
        round trip; insert then returns 0 (evictions are in ``stats`` and the metrics)."""
        try:
            blobs = encode_many(trajectories)
        except RecordError as err:
            self._count_rejected(1)
            raise RecordError(f"{err}; batch not written") from None
        with self._spool_lock:
            chunk = _Chunk([], [], [], 0)
            full = False
            for k, (t, b) in enumerate(zip(trajectories, blobs, strict=True)):
                # A chunk is cut only between groups (``take`` reads a group from one chunk).
                if full and t.group_id != trajectories[k - 1].group_id:
                    self._spool_push(chunk)
                    chunk = _Chunk([], [], [], 0)
                chunk.blobs.append(b)
                chunk.ids.append(t.traj_id)
                chunk.versions.append(t.policy_version)
                chunk.nbytes += len(b)
                full = chunk.nbytes >= CHUNK_BYTES or len(chunk.blobs) >= CHUNK_RECORDS
            if chunk.blobs:
                self._spool_push(chunk)
        if self.background:
            self._wake.set()
            return 0
        return self.flush(retry_s=0.0)

    def insert_encoded(self, blobs: Sequence[bytes]) -> tuple[int, int]:
        """Insert records that arrive already encoded (from another process or over HTTP):
        each is decoded and validated; bad ones are counted and skipped, good ones inserted.
        Returns (inserted or spooled, rejected)."""
        good, bad = decode_many(blobs, self.max_record_bytes, self.limits)
        for i, err in bad:
            log.warning("rejected malformed record %d (run %s): %s", i, self.run, err)
        rejected = len(bad)
        if rejected:
            self._count_rejected(rejected)
        if good:
            self.insert(good)
        return len(good), rejected

    def _count_rejected(self, n: int) -> None:
        if self.metrics is not None:
            self.metrics.rejected.inc(n)
        try:
            self.client.hincrby(self.keys.meta, "rejected", n)
        except RETRYABLE as err:
            self._note_down(err)

    def _spool_push(self, chunk: _Chunk) -> None:
        with self._spool_lock:
            self._spool.append(chunk)
            self._spool_bytes += chunk.nbytes
            while self._spool_bytes > self.spool_max_bytes and len(self._spool) > 1:
                # Never the chunk being sent: it may be landing right now.
                victim = 1 if self._spool[0] is self._inflight else 0
                if victim >= len(self._spool) - 1:
                    break  # only the in-flight chunk and the newest are left
                old = self._spool[victim]
                del self._spool[victim]
                self._spool_bytes -= old.nbytes
                self.spool_dropped += old.count
                log.error(
                    "spool full (%d bytes): dropped %d oldest records",
                    self.spool_max_bytes,
                    old.count,
                )
                if self.metrics is not None:
                    self.metrics.spool_dropped.inc(old.count)
            self._set_spool_gauge()

    def _set_spool_gauge(self) -> None:
        if self.metrics is not None:
            self.metrics.spool_records.set(self.spooled)

    @property
    def spooled(self) -> int:
        """Records waiting in the local spool."""
        return sum(c.count for c in self._spool)

    def flush(self, retry_s: float = 0.0) -> int:
        """Send spooled chunks in order; returns trajectories evicted. Keeps what could not be
        sent (Redis unreachable for ``retry_s``)."""
        evicted = 0
        deadline = time.monotonic() + retry_s
        with self._send_lock:
            while True:
                with self._spool_lock:
                    if not self._spool:
                        break
                    chunk = self._inflight = self._spool[0]
                try:
                    inserted, ev, _dup, size, first, unused = self._retry(
                        functools.partial(self._send, chunk),
                        max(0.0, deadline - time.monotonic()),
                    )
                except BufferUnavailable:
                    break
                finally:
                    with self._spool_lock:
                        self._inflight = None
                with self._spool_lock:
                    self._spool.popleft()  # still the head: pushes append, drops spare it
                    self._spool_bytes -= chunk.nbytes
                evicted += int(ev)
                self._remember(chunk.ids, range(int(first), int(first) + chunk.count))
                if self.metrics is not None:
                    self.metrics.inserts.inc(int(inserted))
                    self.metrics.evictions.inc(int(ev))
                    self.metrics.evicted_unused.inc(int(unused))
                    self.metrics.size.set(int(size))
        self._set_spool_gauge()
        return evicted

    def _send(self, chunk: _Chunk) -> list[Any]:
        # One MULTI/EXEC: a plain HSET writes the records to the chunk's stage hash (record bytes
        # never pass through Lua, which costs ~3.4 us per 2 KB record), then the INSERT script
        # gives the chunk its positions and renames the stage into the ring. A Redis that lost
        # its script cache (a restart) answers NOSCRIPT: load and send again (the same stage
        # key, rewritten whole).
        sha = self._scripts["insert"].sha
        stage = self.keys.stage + chunk.stage
        hset = resp.hset_indexed(stage, chunk.blobs)
        script = resp.pack(
            "EVALSHA", sha, len(self.keys) + 1, *self.keys, stage, self._capacity,
            *chunk.script_args(self.prioritized),
        )  # fmt: skip
        for attempt in range(2):
            try:
                return list(self._transact([hset, script])[-1])
            except (NoScriptError, ExecAbortError):
                if attempt:
                    raise
                self.client.script_load(INSERT)
        raise AssertionError("unreachable")

    def _send_loop(self) -> None:
        delay = 0.05
        while not self._stop.is_set():
            self._wake.wait(timeout=1.0)
            self._wake.clear()
            self.flush(retry_s=0.0)
            if self._spool:  # Redis unreachable: try again after a pause
                self._stop.wait(delay)
                delay = min(delay * 2, 2.0)
                self._wake.set()
            else:
                delay = 0.05

    def wait_sent(self, timeout: float) -> bool:
        """Background mode: wait until every inserted batch has been sent (True) or the
        timeout passes (False)."""
        deadline = time.monotonic() + timeout
        while self._spool or self._inflight is not None:
            if time.monotonic() > deadline:
                return False
            self._wake.set()
            time.sleep(0.001)
        return True

    # -- the learner ----------------------------------------------------------------------------

    def set_policy_version(self, version: int) -> None:
        self._retry(lambda: self.client.hset(self.keys.meta, "version", int(version)), self.retry_s)

    def sample(self, batch_size: int, timeout: float = 0.0) -> SampledBatch:
        """The SAMPLE script drops the too-stale oldest, checks the window and the rate limiter
        and counts the batch (O(1)); the client draws B distinct positions of the window (the
        script's sum-tree walk does when prioritized), then one MULTI/EXEC reads their records,
        reference quantities and the tail, and counts their uses. Positions that turn out
        unusable (evicted since the draw, emptied, stale within the window, corrupt) give their
        count back and are drawn again from the rest of the window."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if batch_size > self._capacity:
            raise ValueError(
                f"cannot sample {batch_size} from a buffer of capacity {self._capacity}"
            )
        start = time.perf_counter()
        deadline = time.monotonic() + timeout
        waited = 0.0
        dropped = 0
        delay = 0.002
        trajs: list[Trajectory] = []
        probs: list[float] = []
        versions: list[int] = []
        positions_out: list[int] = []
        drawn: set[int] = set()
        version = size = skipped = 0
        while len(trajs) < batch_size:
            need = batch_size - len(trajs)
            args = [
                need,
                self._rng.randrange(1, 2**31 - 1),
                -1 if self.samples_per_insert is None else self.samples_per_insert,
                self.rate_slack,
                self.min_size_to_sample if not trajs else 0,
                -1 if self.max_staleness is None else self.max_staleness,
                int(self.prioritized),
                self._index.newest,
                *(sorted(drawn) if self.prioritized else ()),
            ]
            try:
                out = self._script("sample", args, retry_s=max(0.0, deadline - time.monotonic()))
            except BufferUnavailable as err:
                raise SampleTimeout(str(err)) from err
            reason = None
            positions: list[int] | None = None
            if int(out[0]) == 0:
                dropped += int(out[2])
                reason = out[1].decode() if isinstance(out[1], bytes) else str(out[1])
            else:
                version, head, tail = (int(x) for x in out[1:4])
                dropped += int(out[4])
                size = head - tail
                with self._index_lock:
                    reset_elsewhere = bool(self._index.ends) and self._index.ends[-1] > head
                    if reset_elsewhere:  # positions started over: what this client knew is void
                        self._index = _ChunkIndex()
                        with self._where_lock:
                            self._where.clear()
                    else:
                        try:
                            self._index.add(out[5])
                        except ValueError as err:
                            raise self._corrupt(str(err)) from None
                        self._index.forget_below(tail)
                if reset_elsewhere:
                    log.warning("run %s was reset by another client; sampling anew", self.run)
                    self._give_back([], need, 0)
                    drawn.clear()
                    continue
                if self.prioritized:
                    positions, ps = [int(p) for p in out[6]], [float(p) for p in out[7]]
                else:
                    positions, ps = self._draw(need, tail, head, drawn), []
                    if positions is None:
                        self._give_back([], need, 0)
                        within = (
                            "within max_staleness"
                            if self.max_staleness is not None
                            else "usable (emptied ones are skipped)"
                        )
                        reason = f"fewer than {batch_size} trajectories {within} in {size} held"
            if positions is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise SampleTimeout(reason)
                t0 = time.perf_counter()
                time.sleep(min(delay, left))
                waited += time.perf_counter() - t0
                delay = min(delay * 2, 0.05)
                continue
            drawn.update(positions)
            order, tail_now, blobs, refs, uses = self._retry(
                functools.partial(self._read, positions, True),
                max(self.retry_s, deadline - time.monotonic()),
            )
            prob_of = dict(zip(positions, ps, strict=True)) if ps else {}
            if all(b is not None for b in blobs) and (not order or order[0] >= tail_now):
                present, unusable = list(range(len(order))), []  # the usual case: all there
            else:
                present = [k for k, b in enumerate(blobs) if b is not None and order[k] >= tail_now]
                unusable = [
                    order[k] for k, b in enumerate(blobs) if b is None or order[k] < tail_now
                ]
            good, bad = decode_many([blobs[k] for k in present], self.max_record_bytes, self.limits)
            bad_at = {present[i] for i, _ in bad}
            for i, problem in bad:
                log.error("quarantined a malformed record at position %d: %s",
                          order[present[i]], problem)  # fmt: skip
            stale = 0
            floor = None if self.max_staleness is None else version - self.max_staleness
            if not bad_at and floor is None and not prob_of and len(good) == len(order):
                # The usual case, without a per-record branch: every record drawn is handed out.
                for t, u, ref in zip(good, uses, refs, strict=True):
                    t.use_count = u
                    if ref is not None:
                        _apply_ref(t, ref)
                trajs += good
                positions_out += order
                versions += [t.policy_version for t in good]
                continue
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
                    _apply_ref(t, refs[k])
                trajs.append(t)
                positions_out.append(order[k])
                versions.append(t.policy_version)
                if prob_of:
                    probs.append(prob_of[order[k]])
            skipped += stale
            if unusable:
                self._give_back(unusable, len(unusable), stale)
            if bad_at:
                self._quarantine(sorted(order[k] for k in bad_at))
                if self.metrics is not None:
                    self.metrics.rejected.inc(len(bad_at))
        self._remember([t.traj_id for t in trajs], positions_out)
        if self.prioritized:
            weights = importance_weights(np.asarray(probs), int(size), self.beta)
        else:
            weights = np.ones(batch_size, dtype=np.float32)
        staleness = int(version) - np.asarray(versions, dtype=np.int64)
        batch = SampledBatch(trajs, weights, staleness, skipped + dropped, waited)
        if self.metrics is not None:
            self.metrics.observe_sample(
                time.perf_counter() - start,
                waited,
                staleness.tolist(),
                [t.use_count for t in trajs],
            )
            self.metrics.dropped_stale.inc(skipped + dropped)
            self.metrics.size.set(int(size))
        return batch

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
                got = self._retry(
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
        k, cap = self.keys, self._capacity
        pipe = self.client.pipeline(transaction=True)
        pipe.hmget(k.meta, "head", "tail", "version")
        pipe.zrangebyscore(k.chunks, f"({self._index.newest}", "+inf", withscores=True)
        pipe.get(k.use)
        (head_b, tail_b, ver_b), fresh, use_raw = pipe.execute()
        head, tail = self._window(head_b, tail_b)
        version = self._meta_int("version", ver_b)
        with self._index_lock:
            if self._index.ends and self._index.ends[-1] > head:  # reset by another client
                self._index = _ChunkIndex()
            self._index.add([x for end, first in fresh for x in (end, first)])
            self._index.forget_below(tail)
            chunks = list(zip(self._index.starts, self._index.ends, strict=True))
        uses = np.frombuffer(use_raw or b"", dtype=">u4")
        floor = None if self.max_staleness is None else version - self.max_staleness
        runs: list[FreshRun] = []
        found: dict[int, Trajectory] = {}
        unused_total = 0
        picked = None
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
            order, _, blobs, refs, _ = self._read(unused, False)
            present = [k for k, b in enumerate(blobs) if b is not None]
            good, bad = decode_many([blobs[k] for k in present], self.max_record_bytes, self.limits)
            if bad:  # quarantined (emptied, counted); the next attempt reads the chunk without
                for i, problem in bad:
                    log.error("quarantined a malformed record at position %d: %s",
                              order[present[i]], problem)  # fmt: skip
                self._quarantine([order[present[i]] for i, _ in bad])
                if self.metrics is not None:
                    self.metrics.rejected.inc(len(bad))
                return f"quarantined {len(bad)} malformed records among the fresh ones"
            it = iter(good)
            for pos, b, ref in zip(order, blobs, refs, strict=True):
                if b is not None:
                    found[pos] = t = next(it)
                    _apply_ref(t, ref)
            positions = list(range(lo, end))
            held = [found.get(p) for p in positions]
            usable = [t is not None and (floor is None or t.policy_version >= floor) for t in held]
            gids = [t.group_id if t is not None else "" for t in held]
            runs.append(FreshRun(positions, gids, usable, truncated=first < tail))
            unused_total += sum(usable)
            if unused_total >= batch_size:
                picked = pick_fresh(runs, batch_size, whole_groups, oldest_first)
                if picked is not None:
                    break
        if picked is None and whole_groups:  # (short batches of uneven groups)
            picked = pick_fresh(runs, batch_size, whole_groups, oldest_first)
        if picked is None:
            what = "in whole groups " if whole_groups else ""
            return f"fewer than {batch_size} fresh trajectories {what}in {head - tail} held"
        res = self._transact(
            [
                resp.pack("HGET", k.meta, "tail"),
                resp.bitfield_u32(k.use, [p % cap for p in picked], TAKEN + 1),
                resp.pack("HINCRBY", k.meta, "sampled", len(picked)),
                resp.pack("HINCRBY", k.meta, "taken", len(picked)),
            ]
        )
        tail_now = self._meta_int("tail", res[0])
        gone = [p for p in picked if p < tail_now]
        if gone:  # evicted meanwhile: undo every count (also the newer records' in their slots)
            self._transact(
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
        self._remember([t.traj_id for t in trajs], picked)
        staleness = version - np.asarray([t.policy_version for t in trajs], dtype=np.int64)
        return SampledBatch(trajs, np.ones(len(trajs), dtype=np.float32), staleness, fresh=True)

    def _draw(self, k: int, tail: int, head: int, drawn: set[int]) -> list[int] | None:
        """k distinct positions of [tail, head) not in ``drawn``, uniformly (None: too few)."""
        n = head - tail
        if not drawn:
            if n < k:
                return None
            picked: list[int] = (self._np_rng.choice(n, k, replace=False) + tail).tolist()
            return picked
        left = n - sum(1 for p in drawn if tail <= p < head)
        if left < k:
            return None
        if left < 4 * k:  # few left: draw from the list of them
            return self._rng.sample([p for p in range(tail, head) if p not in drawn], k)
        out: set[int] = set()
        while len(out) < k:
            for p in (self._np_rng.choice(n, k, replace=False) + tail).tolist():
                if p not in drawn and len(out) < k:
                    out.add(p)
        return list(out)

    def _chunk_of(self, pos: int) -> int | None:
        with self._index_lock:
            return self._index.start_of(pos)

    def _read(
        self, positions: Sequence[int], count_use: bool
    ) -> tuple[list[int], int, list[Any], list[Any], list[Any]]:
        """One MULTI/EXEC: the tail, then per chunk an HMGET of the records and their reference
        quantities, then one BITFIELD over the use counts (INCRBY 1 when ``count_use``, else
        GET). Returns (positions in the order read, tail, records, refs, use counts); a position
        outside the known chunks reads as missing."""
        k, cap = self.keys, self._capacity
        cmds = [resp.pack("HGET", k.meta, "tail")]
        with self._index_lock:
            groups, order, missing = self._index.group(positions)
        for start, offsets in groups:
            cmds.append(resp.hmget_with_refs(f"{k.rec}{start}", offsets))
        if order:
            cmds.append(
                resp.bitfield_u32(k.use, [p % cap for p in order], 1 if count_use else None)
            )
        res = self._transact(cmds)
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
        return order, self._meta_int("tail", res[0]), blobs, refs, uses

    def quarantine(self, traj_ids: Sequence[str], reason: str) -> int:
        """Quarantine held records by id (ones this client inserted, sampled or listed): a batch
        the learner could not update on, whatever the checks let through. Emptied and counted in
        ``rejected`` like a damaged record; returns how many were found."""
        positions = [p for p in map(self._where.get, traj_ids) if p is not None]
        log.error("quarantined a batch of %d records: %s", len(positions), reason)
        self._quarantine(positions)
        if self.metrics is not None:
            self.metrics.rejected.inc(len(positions))
        return len(positions)

    def _quarantine(self, positions: Sequence[int]) -> None:
        args: list[Any] = []
        for p in positions:
            start = self._chunk_of(p)
            if start is not None:
                args += [p, start]
        if args:
            self._script("quarantine", args)

    def _give_back(self, positions: Sequence[int], unsampled: int, stale: int) -> None:
        """Undo the use counts of positions drawn but not handed out (saturating at 0: a slot
        reused since starts at 0), and their count in ``sampled``; count stale skips."""
        cap = self._capacity
        positions = [p for p in positions if self._chunk_of(p) is not None]

        def send() -> None:
            pipe = self.client.pipeline(transaction=False)
            if positions:
                bits: list[Any] = ["OVERFLOW", "SAT"]
                for p in positions:
                    bits += ("INCRBY", "u32", f"#{p % cap}", -1)
                pipe.execute_command("BITFIELD", self.keys.use, *bits)  # type: ignore[no-untyped-call]
            if unsampled:
                pipe.hincrby(self.keys.meta, "sampled", -unsampled)
            if stale:
                pipe.hincrby(self.keys.meta, "dropped", stale)
            pipe.execute()

        self._retry(send, self.retry_s)

    def update_priorities(self, traj_ids: Sequence[str], deltas: Sequence[float]) -> int:
        """Priorities of trajectories this client inserted, sampled or listed (their positions
        are remembered); others count as not held."""
        if len(traj_ids) != len(deltas):
            raise ValueError(f"{len(traj_ids)} ids but {len(deltas)} deltas")
        if not self.prioritized or not traj_ids:
            return 0
        args: list[Any] = []
        for tid, d in zip(traj_ids, deltas, strict=True):
            pos = self._where.get(tid)
            if pos is not None:
                args += [pos, repr(priority_of(d, self.alpha, self.eps))]
        return int(self._script("priorities", args)) if args else 0

    def write_back(self, trajectories: Sequence[Trajectory]) -> int:
        """Store the cached reference quantities of held trajectories that this client
        inserted, sampled or listed (a few bytes each, beside the record: the record's bytes are
        not rewritten)."""
        args: list[Any] = []
        for t in trajectories:
            pos = self._where.get(t.traj_id)
            start = None if pos is None else self._chunk_of(pos)
            if pos is not None and start is not None:
                try:
                    args += [pos, start, _pack_ref(t)]
                except RecordError as err:  # not cached: computed afresh when next sampled
                    log.error("did not write back %s", err)
        return int(self._script("write_back", args)) if args else 0

    def items(self) -> list[Trajectory]:
        k = self.keys

        def window() -> tuple[int, int, list[Any]]:
            pipe = self.client.pipeline(transaction=True)
            pipe.hmget(k.meta, "head", "tail")
            pipe.zrangebyscore(k.chunks, f"({self._index.newest}", "+inf", withscores=True)
            (head, tail), fresh = pipe.execute()
            flat = [x for end, start in fresh for x in (end, start)]
            return *self._window(head, tail), flat

        head, tail, flat = self._retry(window, self.retry_s)
        with self._index_lock:
            self._index.add(flat)
            self._index.forget_below(tail)
        out: list[Trajectory] = []
        where: list[int] = []
        for lo in range(tail, head, 512):
            order, tail_now, blobs, refs, uses = self._retry(
                functools.partial(self._read, range(lo, min(lo + 512, head)), False),
                self.retry_s,
            )
            keep = [i for i, b in enumerate(blobs) if b is not None and order[i] >= tail_now]
            good, bad = decode_many([blobs[i] for i in keep], self.max_record_bytes, self.limits)
            bad_at = {keep[i] for i, _ in bad}  # evicted meanwhile are absent; corrupt skipped
            it = iter(good)
            for i in keep:
                if i in bad_at:
                    continue
                t = next(it)
                t.use_count = int(uses[i])
                _apply_ref(t, refs[i])
                out.append(t)
                where.append(order[i])
        self._remember([t.traj_id for t in out], where)
        return out

    def stats(self) -> BufferStats:
        fields = (
            "capacity",
            "head",
            "tail",
            "evicted",
            "evicted_unused",
            "sampled",
            "taken",
            "rejected",
            "dropped",
            "version",
        )
        vals = self._retry(lambda: self.client.hmget(self.keys.meta, fields), self.retry_s)
        v = {k: self._meta_int(k, x) for k, x in zip(fields, vals, strict=True)}
        self._window(vals[1], vals[2])  # (a window that does not hold is as corrupt)
        return BufferStats(
            size=v["head"] - v["tail"],
            capacity=v["capacity"] or self._capacity,
            inserted=v["head"],
            evicted=v["evicted"],
            evicted_unused=v["evicted_unused"],
            sampled=v["sampled"],
            taken=v["taken"],
            rejected=v["rejected"],
            dropped_stale=v["dropped"],
            policy_version=v["version"],
        )

    def delete(self) -> None:
        """Remove the run's keys (its buffer, its records and its counters)."""
        self._retry(self._delete, self.retry_s)

    def _delete(self) -> None:
        self.client.delete(*self.keys.stored)
        batch: list[Any] = []
        for key in itertools.chain(
            self.client.scan_iter(match=_glob_escape(self.keys.rec) + "*", count=1000),
            self.client.scan_iter(match=_glob_escape(self.keys.stage) + "*", count=1000),
        ):
            batch.append(key)
            if len(batch) >= 1000:
                self.client.delete(*batch)
                batch = []
        if batch:
            self.client.delete(*batch)

    def reset(self) -> None:
        self.delete()
        with self._index_lock:
            self._index = _ChunkIndex()
        self._where.clear()
        self._open(self.retry_s)

    def close(self, flush_s: float = 5.0) -> None:
        """Flush the spool (waiting up to ``flush_s`` for Redis), stop the sender thread, and
        close the connections (unless the client was passed in)."""
        if self._sender is not None:
            self._stop.set()
            self._wake.set()
            self._sender.join(timeout=flush_s + 5)
        self.flush(retry_s=flush_s)
        if self._spool:
            log.error("closing with %d records still spooled (Redis unreachable)", self.spooled)
        if self._own_client:
            self.client.close()
