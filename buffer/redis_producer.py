"""The producer half of the Redis ring: what a rollout worker uses (insert, the local spool, flush).

Faults: a producer that cannot reach Redis keeps its encoded batches in a bounded local spool and
flushes them, in order, once Redis answers again (a retried batch that had in fact landed is not
stored twice: inserts skip trajectory ids already held).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from redis.exceptions import ExecAbortError, NoScriptError

from buffer import resp
from buffer.base import BufferUnavailable
from buffer.records import (
    NO_LIMITS,
    RecordError,
    RecordLimits,
    Trajectory,
    decode_many,
    encode_many,
)
from buffer.redis_layout import RETRYABLE, OnLayout, RingLayout
from buffer.redis_lua import INSERT

log = logging.getLogger("reval.buffer")

CHUNK_BYTES = 8 << 20  # one insert script call carries at most this much
CHUNK_RECORDS = 2048


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


class RedisProducer(OnLayout):
    """Inserts into a run's Redis ring, spooling locally while Redis is unreachable. One
    instance per process; ``insert`` may be called from several threads."""

    def __init__(
        self,
        layout: RingLayout,
        *,
        prioritized: bool = False,
        spool_max_bytes: int = 256 << 20,
        max_record_bytes: int = 64 << 20,
        background: bool = False,
        limits: RecordLimits = NO_LIMITS,
    ) -> None:
        """A producer of ``layout``'s ring. ``prioritized``: new records get the maximum
        priority (the run's setting); ``spool_max_bytes``: the spool's bound (the oldest chunks
        are dropped beyond it); ``max_record_bytes``, ``limits``: what ``insert_encoded``
        accepts; ``background``: a sender thread sends while the caller encodes the next
        batch."""
        self.layout = layout
        self.prioritized = prioritized
        self.spool_max_bytes = spool_max_bytes
        self.max_record_bytes = max_record_bytes
        self.limits = limits
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
        """Records dropped from a full spool."""
        if background:
            self._sender = threading.Thread(
                target=self._send_loop, name=f"reval-buffer-sender-{layout.run}", daemon=True
            )
            self._sender.start()

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
            self.layout.note_down(err)

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
                    inserted, ev, _dup, size, first, unused = self.layout.retry(
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
                self.layout.remember(chunk.ids, range(int(first), int(first) + chunk.count))
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
        keys = self.keys
        sha = self.layout.scripts["insert"].sha
        stage = keys.stage + chunk.stage
        hset = resp.hset_indexed(stage, chunk.blobs)
        script = resp.pack(
            "EVALSHA", sha, len(keys) + 1, *keys, stage, self.capacity,
            *chunk.script_args(self.prioritized),
        )  # fmt: skip
        for attempt in range(2):
            try:
                return list(self.layout.transact([hset, script])[-1])
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
        self.layout.close()
