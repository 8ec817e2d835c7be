"""What both halves of the Redis ring share: one run's keys, its Lua scripts, the client with its
retries, and the reads of the ring's bookkeeping (every field read goes through the
``RingCorrupt`` check).

The producer half (``buffer.redis_producer``: insert, spool, flush, what a rollout worker uses)
and the consumer half (``buffer.redis_consumer``: sample, take, quarantine, write-back, what the
learner uses) each hold a ``RingLayout``; ``buffer.redis_ring.RedisRing`` is both over one.
"""

from __future__ import annotations

import itertools
import logging
import re
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import redis
from redis.exceptions import ResponseError

from buffer import resp
from buffer.base import BufferStats, BufferUnavailable
from buffer.metrics import BufferMetrics
from buffer.records import RecordError
from buffer.redis_lua import INSERT, OPEN, PRIORITIES, QUARANTINE, SAMPLE, WRITE_BACK
from reval.redis import RingKeys, connect, ring_keys
from reval.retry import retry_redis, wait_fault

log = logging.getLogger("reval.buffer")
T = TypeVar("T")


TAKEN = 1 << 31
"""The top bit of a slot's use count (``use``): a ``take`` has handed the record out. Counts
read back mask it off; a record with it is used, so the eviction count of unused ones holds."""

STATS_FIELDS = ("capacity", "head", "tail", "evicted", "evicted_unused", "sampled", "taken",
                "rejected", "dropped", "version")  # fmt: skip
"""The ``meta`` fields ``stats`` reads."""


class RingCorrupt(RuntimeError):
    """The ring's bookkeeping in Redis (its ``meta`` hash or ``chunks`` set) is damaged: written
    by hand or by another program. The message names what is wrong and how to repair it."""


def ring_corrupt(run: str, keys: RingKeys, what: str) -> RingCorrupt:
    """The RingCorrupt of run ``run``'s ring for damage ``what``, with the repair."""
    return RingCorrupt(
        f"run {run!r}: the ring's bookkeeping in Redis is corrupt ({what}): stop the "
        "run's learner and workers, then delete the ring's keys, and only those (the run's "
        f"control, status, events and weights stay): {keys.repair()} (the trajectories "
        "it held are lost; checkpoints are not, and the workers refill it)"
    )


def meta_int(name: str, raw: Any, corrupt: Callable[[str], RingCorrupt]) -> int:
    """A field of the ring's bookkeeping as read back (bytes; None: never set, 0), as an int;
    ``corrupt(what)`` raised, naming the field, unless it is one. Every integer a client reads
    from ``meta`` goes through here (the scripts check theirs in ``ensure``)."""
    if raw is None:
        return 0
    if isinstance(raw, int) and not isinstance(raw, bool):
        return raw
    try:
        return int(raw)
    except (TypeError, ValueError):
        text = raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)
        raise corrupt(f"meta {name}={text} (need an integer)") from None


def stats_of(
    vals: Sequence[Any], capacity: int, corrupt: Callable[[str], RingCorrupt]
) -> BufferStats:
    """``BufferStats`` from the ``STATS_FIELDS`` of ``meta`` as read back (``capacity``: the
    configured one, where ``meta`` has none yet)."""
    v = {k: meta_int(k, x, corrupt) for k, x in zip(STATS_FIELDS, vals, strict=True)}
    return BufferStats(
        size=v["head"] - v["tail"],
        capacity=v["capacity"] or capacity,
        inserted=v["head"],
        evicted=v["evicted"],
        evicted_unused=v["evicted_unused"],
        sampled=v["sampled"],
        taken=v["taken"],
        rejected=v["rejected"],
        dropped_stale=v["dropped"],
        policy_version=v["version"],
    )


def peek_stats(client: redis.Redis, prefix: str, run: str) -> BufferStats | None:
    """A run's ring counters read once, creating nothing and loading no script (the REST API
    reads every run's, started or not): None before the ring exists; RingCorrupt for a field
    that is not an integer or a window that does not hold."""
    keys = ring_keys(prefix, run)
    vals = client.hmget(keys.meta, STATS_FIELDS)
    if vals[0] is None:
        return None

    def corrupt(what: str) -> RingCorrupt:
        return ring_corrupt(run, keys, what)

    stats = stats_of(vals, 0, corrupt)
    head, tail = stats.inserted, stats.inserted - stats.size
    if not 0 <= tail <= head <= tail + stats.capacity:  # (as ``RingLayout.window``)
        raise corrupt(f"meta head={head} tail={tail}")
    return stats


def _glob_escape(text: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


class RingLayout:
    """One run's ring in Redis as both halves see it: its keys (``reval.redis.ring_keys``), the
    scripts registered on one client, the retry loop, and checked reads of ``meta``. Also the
    client's memory of where the trajectories it inserted, sampled or listed are (their
    positions), which write-back, priorities and quarantine look up. Thread-safe."""

    def __init__(
        self,
        run: str,
        capacity: int,
        *,
        url: str = "redis://127.0.0.1:6379/0",
        key_prefix: str = "reval:",
        client: redis.Redis | None = None,
        retry_s: float = 30.0,
        metrics: BufferMetrics | None = None,
        reset: bool = False,
        open_retry_s: float = 5.0,
    ) -> None:
        """``run``'s ring of ``capacity`` records at ``url`` (or through ``client``, which then
        stays open on ``close``); ``retry_s``: how long a call retries an unreachable Redis;
        ``reset``: start the run empty (whatever an earlier run of the same id left);
        ``open_retry_s``: how long to wait for Redis here (a producer may start before it)."""
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.run = run
        self.capacity = capacity
        self.keys: RingKeys = ring_keys(key_prefix, run)
        self.own_client = client is None
        self.client = client or connect(url)
        self.retry_s = retry_s
        self.metrics = metrics
        self._opened = False
        """A call went through: a CAPACITY answer now means a damaged ``meta`` capacity,
        unless the ring was reset meanwhile (its head went back below ``_seen_head``)."""
        self._seen_head = 0
        """One past the newest position this client inserted, sampled or listed."""
        # Trajectory id -> position, for write_back, update_priorities and quarantine (the
        # learner passes back trajectories it sampled); filled by insert, sample and items.
        self._where: dict[str, int] = {}
        self._where_max = max(4 * capacity, 1 << 16)
        self._where_lock = threading.Lock()
        self.scripts = {
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
                self.retry(self._delete, open_retry_s)
            self.open(open_retry_s)
        except BufferUnavailable as err:
            if reset:
                raise
            # A producer may start before Redis: every script creates the run when missing.
            log.warning("run %s: Redis not reachable yet (%s); inserts will spool", run, err)

    # -- calls ----------------------------------------------------------------------------------

    def open(self, retry_s: float) -> None:
        """Create the run's ring when missing (and check its capacity)."""
        self.script("open", [], retry_s=retry_s)

    def script(self, name: str, args: Sequence[Any], retry_s: float | None = None) -> Any:
        """Run Lua script ``name`` on the run's keys with the capacity, then ``args``."""
        return self.retry(
            lambda: self.scripts[name](keys=self.keys, args=[self.capacity, *args]),
            self.retry_s if retry_s is None else retry_s,
        )

    def retry(self, fn: Callable[[], T], budget_s: float, what: str = "") -> T:
        """``fn()``, retried with backoff while Redis is away or refuses writes (the one policy,
        ``reval.retry``: the outage is logged once when it starts and once when it ends), for up
        to ``budget_s`` seconds (then BufferUnavailable). A script's CORRUPT answer, a value of
        the bookkeeping the client could not parse, or a capacity that changed under a ring
        this client had opened raises RingCorrupt; a CAPACITY answer at the first call raises
        ValueError (the run was made with another capacity). ``what``: the call, in the outage
        lines (a read and a write wait apart while Redis refuses writes only)."""
        try:
            out = retry_redis(
                lambda: self._checked(fn), budget_s,
                f"run {self.run}'s replay ring{': ' + what if what else ''}", self.note_down,
            )  # fmt: skip
        except Exception as err:
            if not wait_fault(err):
                raise
            raise BufferUnavailable(
                f"run {self.run!r}: Redis away or refusing writes for {budget_s:.0f} s "
                f"(redis.outage_s): {type(err).__name__}: {err}"
            ) from err
        self._opened = True
        return out

    def _checked(self, fn: Callable[[], T]) -> T:
        """``fn()`` with the ring's answers made errors of their own (``retry``)."""
        try:
            return fn()
        except ResponseError as err:
            text = str(err)
            if text.startswith("CAPACITY"):
                if self._opened and not self._was_reset():  # the field was damaged since
                    held = re.search(r"capacity (\S+) but", text)
                    raise self.corrupt(
                        f"meta capacity={held.group(1) if held else '?'}, while this "
                        f"{self.capacity}-record ring was in use"
                    ) from None
                raise ValueError(
                    f"run {self.run!r}: {text[len('CAPACITY ') :]}; if no run was made with "
                    f"that capacity, the ring is corrupt (meta capacity): {self.keys.repair()}"
                ) from None
            if text.startswith("CORRUPT"):
                raise self.corrupt(text[len("CORRUPT ") :]) from None
            raise
        except ValueError as err:  # the client's parsing of the bookkeeping it read
            if isinstance(err, RecordError):
                raise
            raise self.corrupt(str(err)) from None

    def _was_reset(self) -> bool:
        """Whether the ring's head went back below what this client saw (another client reset
        the run, which may then have another capacity); an unreadable head counts as not."""
        try:
            head = self.client.hget(self.keys.meta, "head")
            return int(head or 0) < self._seen_head
        except (redis.RedisError, ValueError):
            return False

    def note_down(self, err: BaseException) -> None:
        """Count a failed call (a wait fault: ``reval_buffer_backend_errors_total``)."""
        if self.metrics is not None:
            self.metrics.backend_errors.inc()

    def transact(self, commands: Sequence[bytes]) -> list[Any]:
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

    # -- the bookkeeping, checked ---------------------------------------------------------------

    def window(self, head_b: Any, tail_b: Any) -> tuple[int, int]:
        """(head, tail) as read from ``meta``; RingCorrupt unless they make a window:
        integers, 0 <= tail <= head <= tail + capacity (what the scripts check too)."""
        head, tail = self.meta_int("head", head_b), self.meta_int("tail", tail_b)
        if not 0 <= tail <= head <= tail + self.capacity:
            raise self.corrupt(f"meta head={head} tail={tail}")
        return head, tail

    def meta_int(self, name: str, raw: Any) -> int:
        """``meta_int`` of this ring."""
        return meta_int(name, raw, self.corrupt)

    def corrupt(self, what: str) -> RingCorrupt:
        """The RingCorrupt for damage ``what``, with the repair."""
        return ring_corrupt(self.run, self.keys, what)

    def size(self) -> int:
        """Trajectories held now."""
        head_b, tail_b = self.retry(
            lambda: self.client.hmget(self.keys.meta, "head", "tail"), self.retry_s, "read"
        )
        head, tail = self.window(head_b, tail_b)
        return head - tail

    def stats(self) -> BufferStats:
        """The ring's counters, read from ``meta`` in one call."""
        vals = self.retry(
            lambda: self.client.hmget(self.keys.meta, STATS_FIELDS), self.retry_s, "read"
        )
        self.window(vals[1], vals[2])  # (a window that does not hold is as corrupt)
        return stats_of(vals, self.capacity, self.corrupt)

    # -- where the trajectories are -------------------------------------------------------------

    def remember(self, ids: Sequence[str], positions: Sequence[int]) -> None:
        """Note the positions of trajectories (bounded: the oldest notes go first)."""
        where = self._where
        with self._where_lock:  # a Prefetcher samples from several threads
            where.update(zip(ids, positions, strict=True))
            if positions:
                self._seen_head = max(self._seen_head, max(positions) + 1)
            excess = len(where) - self._where_max
            if excess > 0:
                for tid in list(itertools.islice(where, excess)):
                    del where[tid]

    def position(self, traj_id: str) -> int | None:
        """Where a trajectory this client inserted, sampled or listed is (None: not known)."""
        return self._where.get(traj_id)

    def forget(self) -> None:
        """Forget every position (the run started over)."""
        with self._where_lock:
            self._where.clear()
            self._seen_head = 0

    # -- the run's keys -------------------------------------------------------------------------

    def delete(self) -> None:
        """Remove the run's keys (its buffer, its records and its counters)."""
        self.retry(self._delete, self.retry_s)

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

    def close(self) -> None:
        """Close the connections (unless the client was passed in)."""
        if self.own_client:
            self.client.close()


class OnLayout:
    """What each half of the ring shows of the layout it holds (``self.layout``)."""

    layout: RingLayout

    @property
    def run(self) -> str:
        return self.layout.run

    @property
    def keys(self) -> RingKeys:
        return self.layout.keys

    @property
    def client(self) -> redis.Redis:
        return self.layout.client

    @property
    def capacity(self) -> int:
        return self.layout.capacity

    @property
    def metrics(self) -> BufferMetrics | None:
        return self.layout.metrics

    @property
    def retry_s(self) -> float:
        """Seconds a call retries an unreachable Redis."""
        return self.layout.retry_s

    def __len__(self) -> int:
        return self.layout.size()

    def stats(self) -> BufferStats:
        return self.layout.stats()
