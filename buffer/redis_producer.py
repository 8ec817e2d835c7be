"""The producer half of the Redis ring: what a rollout worker uses (insert, the local spool, flush).

Faults: a producer that cannot reach Redis, or that Redis refuses to write for now (MISCONF,
OOM, READONLY: ``reval.retry.wait_fault``), keeps its encoded batches in a bounded local spool
and flushes them, in order, once Redis answers again (a retried batch that had in fact landed is
not stored twice: inserts skip trajectory ids already held). What is still spooled when it
closes (Redis away past the close's wait, or a corrupt ring: ``RingCorrupt``) goes to files in
its ``spool_dir``, one per chunk (``<time>-<n>.spool``); a producer started later on the same
directory takes them back and sends them first. A producer claims a file by renaming it to
``<time>-<n>.sending-<pid>-<host>-<token>``; one that died holding claims (a kill) leaves them to
the next producer on that host; a file that cannot be read or is not a spool chunk is set aside
as ``bad-<time>-<n>`` with one line, never tried again.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
import os
import socket
import threading
import time
import uuid
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
from redis.exceptions import ExecAbortError, NoScriptError

from buffer import resp
from buffer.base import BufferUnavailable
from buffer.record_codec import decode_many, encode_many
from buffer.records import NO_LIMITS, RecordError, RecordLimits, Trajectory
from buffer.redis_chunks import bad_record_key, bad_records
from buffer.redis_layout import OnLayout, RingCorrupt, RingLayout
from buffer.redis_lua import INSERT
from reval.procs import pid_alive
from reval.retry import wait_fault

log = logging.getLogger("reval.buffer")

_TOKEN = uuid.uuid4().hex[:8]
"""This process's mark in its claims' names: a claim with this process's pid but another token
was made by an earlier process that had the same pid (a restarted container)."""


def _claim_name() -> str:
    """The suffix of the spool files this process claims: ``.sending-<pid>-<host>-<token>``."""
    return f".sending-{os.getpid()}-{socket.gethostname()}-{_TOKEN}"


def _claim_dead(path: Path) -> bool:
    """Whether the producer that claimed ``path`` (a ``*.sending-<pid>-<host>-<token>`` file)
    is gone: on this host, its pid is no live process, or is this process's while the token
    is not. A claim from another host is never taken (it cannot be told from a live one)."""
    mark = path.name.rpartition(".sending-")[2]
    pid, _, rest = mark.partition("-")
    host, _, token = rest.rpartition("-")
    if host != socket.gethostname() or not pid.isdigit():
        return False
    if int(pid) == os.getpid():
        return token != _TOKEN
    return not pid_alive(int(pid))


def _chunk_of(body: Any, file: Path) -> _Chunk:
    """The chunk a spool file's ``body`` holds; ValueError when it is no spool chunk."""
    try:
        blobs = [bytes(b) for b in body["blobs"]]
        ids = [str(i) for i in body["ids"]]
        versions = [int(v) for v in body["versions"]]
        stage = body["stage"]
    except (TypeError, KeyError, ValueError) as err:
        raise ValueError(f"not a spool chunk ({type(err).__name__}: {err})") from None
    if not (len(blobs) == len(ids) == len(versions)) or not isinstance(stage, str):
        raise ValueError("not a spool chunk (its lists differ in length, or no stage)")
    return _Chunk(blobs, ids, versions, sum(map(len, blobs)), stage=stage, file=file)


def _renamed(path: Path, name: str) -> bool:
    """Rename ``path`` to ``name`` in its directory; False when it cannot be."""
    try:
        os.replace(path, path.with_name(name))
    except OSError:
        return False
    return True


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
    """Names the stage hash: fixed per chunk, so a resend rewrites the same one (also after the
    chunk went through a spool file)."""
    file: Path | None = None
    """The spool file this chunk was taken back from (deleted once the chunk is sent)."""

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
        spool_dir: str | Path | None = None,
    ) -> None:
        """A producer of ``layout``'s ring. ``prioritized``: new records get the maximum
        priority (the run's setting); ``spool_max_bytes``: the spool's bound (the oldest chunks
        are dropped beyond it); ``max_record_bytes``, ``limits``: what ``insert_encoded``
        accepts; ``background``: a sender thread sends while the caller encodes the next
        batch; ``spool_dir``: where ``close`` keeps what it could not send, and where the
        chunks an earlier producer kept there are taken back from (None: nowhere)."""
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
        self.spool_dir = None if spool_dir is None else Path(spool_dir)
        if self.spool_dir is not None:
            self._take_back(self.spool_dir)
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
        for i, err in bad:  # (a line per reason, then one a minute with the count)
            what = bad_record_key("rejected", err)
            bad_records.warning(what, "rejected malformed record %d (run %s): %s", i, self.run, err)
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
        except Exception as err:
            if not wait_fault(err):
                raise
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
                bad_records.error(  # (an outage's drops: a line a minute with the count)
                    "spool full", "spool full (%d bytes): dropped %d oldest records",
                    self.spool_max_bytes, old.count,
                )  # fmt: skip
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
                        "insert",
                    )
                except BufferUnavailable:
                    break
                finally:
                    with self._spool_lock:
                        self._inflight = None
                with self._spool_lock:
                    self._spool.popleft()  # still the head: pushes append, drops spare it
                    self._spool_bytes -= chunk.nbytes
                if chunk.file is not None:  # (taken back from the spool directory: sent now)
                    chunk.file.unlink(missing_ok=True)
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
        close the connections (unless the client was passed in). What could not be sent (Redis
        away, or the ring corrupt) goes to the spool directory (``keep``), or is lost with a
        line saying so when there is none."""
        if self._sender is not None:
            self._stop.set()
            self._wake.set()
            self._sender.join(timeout=flush_s + 5)
        why = "Redis did not take them"
        try:
            self.flush(retry_s=flush_s)
        except RingCorrupt:  # (the caller has said so, or will: its insert raised it)
            why = "the ring is damaged: they are sent after its repair"
        if self._spool:
            if self.spool_dir is not None:
                self.keep(self.spool_dir, why)
            else:
                log.error("closing with %d records still spooled (%s): lost", self.spooled, why)
        self.layout.close()

    def keep(self, directory: Path, why: str) -> int:
        """Write the spooled chunks to ``directory`` (one ``<time>-<n>.spool`` file each, in
        order by name, written whole, then renamed), empty the spool, and log one line; returns
        the records kept. A write that fails (a full disk, no permission) is one line with the
        count of records lost and why: a chunk taken back from a file goes back to its file
        (nothing is written for it), the others are lost."""
        with self._spool_lock:
            chunks = list(self._spool)
            self._spool.clear()
            self._spool_bytes = 0
        self._set_spool_gauge()
        now = time.time_ns()
        for k, chunk in enumerate(chunks):
            path = directory / f"{now:020d}-{k:06d}.spool"  # (in order by name)
            tmp = path.with_suffix(f".tmp-{os.getpid()}")
            try:
                directory.mkdir(parents=True, exist_ok=True)
                if chunk.file is not None:  # (its bytes are there already)
                    os.replace(chunk.file, path)
                    continue
                body = {"run": self.run, "stage": chunk.stage, "ids": chunk.ids,
                        "versions": chunk.versions, "blobs": chunk.blobs}  # fmt: skip
                tmp.write_bytes(msgpack.packb(body, use_bin_type=True))
                os.replace(tmp, path)
            except OSError as err:
                tmp.unlink(missing_ok=True)
                return self._kept_but(chunks, k, directory, why, err)
        n = sum(c.count for c in chunks)
        log.warning("kept %d unsent records in %s (%s): a producer of run %s started on that "
                    "directory sends them first", n, directory, why, self.run)  # fmt: skip
        return n

    def _kept_but(
        self, chunks: list[_Chunk], failed: int, directory: Path, why: str, err: OSError
    ) -> int:
        """``keep`` could not write chunk ``failed``: the ones before it are kept; of the rest,
        those taken back from a file go back to it (``.spool`` again), the others are lost, in
        one line. Returns the records kept."""
        kept = sum(c.count for c in chunks[:failed])
        lost = 0
        for chunk in chunks[failed:]:
            if chunk.file is not None and _renamed(chunk.file, chunk.file.name.partition(".")[0]
                                                   + ".spool"):  # fmt: skip
                kept += chunk.count
            else:
                lost += chunk.count
        log.error("closing with %d unsent records that could not be kept in %s (%s: %s): lost; "
                  "%d kept there (%s)", lost, directory, type(err).__name__, err, kept,
                  why)  # fmt: skip
        return kept

    def _take_back(self, directory: Path) -> None:
        """Spool the chunks an earlier producer of this run kept in ``directory``, in the order
        they were kept (each file is claimed by a rename, so two producers on one directory
        never both take it; the claims of a producer that died are taken again, ``_claim_dead``);
        they are sent first, and each file is deleted once its chunk is sent. A file that cannot
        be read or holds no spool chunk is one line and set aside (``bad-<name>``)."""
        if not directory.is_dir():
            return
        taken = 0
        files = [*directory.glob("*.spool"), *filter(_claim_dead, directory.glob("*.sending-*"))]
        for path in sorted(files, key=lambda f: f.name):
            mine = directory / (path.name.partition(".")[0] + _claim_name())
            try:
                os.replace(path, mine)
            except FileNotFoundError:
                continue  # (another producer took it)
            try:
                body = msgpack.unpackb(mine.read_bytes(), raw=False)
                chunk = _chunk_of(body, mine)  # (a dict once this passed)
            except (OSError, ValueError, TypeError) as err:
                bad = f"bad-{path.name.partition('.')[0]}"
                _renamed(mine, bad)
                log.error("spool file %s cannot be taken back (%s): set aside as %s, not sent",
                          path, err, bad)  # fmt: skip
                continue
            if body.get("run") != self.run:
                _renamed(mine, path.name.partition(".")[0] + ".spool")
                continue  # another run's: not ours to send
            with self._spool_lock:
                self._spool.append(chunk)
                self._spool_bytes += chunk.nbytes
            taken += chunk.count
        if taken:
            self._set_spool_gauge()
            log.info("took back %d records kept in %s by an earlier producer of run %s; "
                     "they are sent first", taken, directory, self.run)  # fmt: skip
