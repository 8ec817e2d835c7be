"""Weights from the learner to an elastic fleet over torch.distributed, in packed buckets
(``buckets.py``): gloo groups on CPU, NCCL groups on GPU, one code path (``backend``).

A fixed world cannot take newcomers, so membership is managed outside it: the learner hosts a
``TCPStore`` (``wait_for_workers=False``); a worker connects as a client at any time and takes a
ticket. When the set of members changes, the learner proposes a
new generation ``g`` (the tickets it wants), waits up to two timeouts for each to acknowledge,
commits the members that did, and everyone builds a small process group over a ``PrefixStore``
for that generation (learner rank 0, members 1..n). A sync writes the version and the bucket
headers into the store and broadcasts each bucket's bytes: one collective per bucket, never one
per tensor. A member that dies or stalls makes a collective time out after ``timeout``; the
learner then drops the generation, and the next sync proposes a new one without the members that
do not acknowledge. The learner never waits longer than ``timeout`` for anyone.

Who can join: the hub listens only on the address it is given (its ``TCPStore`` through a socket
bound there, ``master_listen_fd``; its gloo pairs through a device on that address), never on
every interface, and every key of its store lives under a per-run secret (``PrefixStore``): a
client that does not know the secret (announced only in Redis, in the hub's address
``backend://host:port/secret``) reads nothing, and nothing it writes is read by the hub or the
workers.

Workers receive on a background thread (``BroadcastReceiver``) into CPU memory while they
generate; their main loop takes the newest complete version between batches, as the buckets it
arrived in (``take_buckets``) or unpacked into views (``take``). A newcomer gets the weights of
the next sync after it joined (and the announced file meanwhile). Nothing else uses these classes
directly: the learner's ``sender.WeightSender`` drives the hub (``start``, ``send`` per bucket,
``finish``) and ``receiver.LocalReceiver`` holds a receiver next to each model.

NCCL (``backend="nccl"``): the groups are ``ProcessGroupNCCL(PrefixStore, rank, size, options)``
with ``options._timeout``, as ``torch.distributed.new_group`` builds them
(``distributed_c10d._new_process_group_helper``); the sender packs the buckets on the learner's
device and they are broadcast from there; receivers receive into device memory, so a GPU engine
loads the weights without a host copy. A failed generation's group is aborted (``abort()``)
before the next forms. Unverified here (no GPU): two processes on two GPUs are needed (NCCL
cannot join two processes on one device). A timed-out NCCL collective raises rather than ending
the process (``reval/nccl.py`` ``NCCL_ENV``). The hub's groups are its own (its ``TCPStore``),
never the learner's FSDP group: a dead worker can stall a sync, never the learner ranks'
collectives.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import secrets
import socket
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.distributed import PrefixStore, TCPStore
from torch.distributed.distributed_c10d import ProcessGroupGloo

from reval.nccl import apply_nccl_env
from reval.weights.buckets import Bucket, BufferPool, PlannedBucket, plan_buckets, unpack_bucket

IN_FLIGHT = 3

log = logging.getLogger("reval.broadcast")


def _td(seconds: float) -> dt.timedelta:
    return dt.timedelta(seconds=seconds)


def make_group(
    backend: str, store: Any, rank: int, size: int, timeout_s: float, bind: str | None = None
) -> Any:
    """A process group outside the default world (gloo or NCCL) over ``store``; ``bind``: the
    address gloo listens on (default: the host name's, as torch.distributed's default)."""
    if backend == "gloo":
        if bind is None:
            return ProcessGroupGloo(store, rank, size, _td(timeout_s))
        opts = ProcessGroupGloo._Options()
        opts._devices = [ProcessGroupGloo.create_device(hostname=bind)]
        opts._timeout = _td(timeout_s)
        return ProcessGroupGloo(store, rank, size, opts)
    if backend == "nccl":
        from torch.distributed import ProcessGroupNCCL

        apply_nccl_env()

        opts = ProcessGroupNCCL.Options()
        opts.is_high_priority_stream = False
        opts._timeout = _td(timeout_s)
        return ProcessGroupNCCL(store, rank, size, opts)
    raise ValueError(f"unknown broadcast backend {backend!r} (gloo, nccl)")


def _abort(pg: Any) -> None:
    """Release a broken group (NCCL communicators otherwise stay stuck in the failed call)."""
    abort = getattr(pg, "abort", None)
    if abort is not None:
        try:
            abort()
        except Exception as err:  # best effort: the group is dropped either way
            log.debug("abort of a failed group: %s", err)


def parse_address(announced: str) -> tuple[str, str, int, str]:
    """``backend://host:port/secret`` (or ``host:port/secret``: gloo) -> (backend, host, port,
    secret)."""
    backend, _, rest = announced.rpartition("://")
    rest, _, secret = rest.partition("/")
    host, _, port = rest.rpartition(":")
    if not host or not port.isdigit() or not secret:
        raise ValueError(f"bad broadcast address {announced!r} (want backend://host:port/secret)")
    return backend or "gloo", host, int(port), secret


def _scoped(store: Any, secret: str) -> PrefixStore:
    """The hub's store as seen by those who know the run's secret."""
    return PrefixStore(f"{secret}/", store)


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def _sync_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class _Sending:
    """A sync under way: its buckets in flight (pool buffer, collective work)."""

    version: int
    seq: int
    in_flight: list[tuple[Tensor | None, Any, Tensor]] = field(default_factory=list)
    """(the pool buffer or None, the collective's work, the bytes sent: kept alive until sent)."""
    failed: BaseException | None = None


class BroadcastHub:
    """The learner's side (rank 0 only)."""

    def __init__(
        self,
        port: int,
        host: str = "127.0.0.1",
        timeout_s: float = 60.0,
        bucket_bytes: int = 64 << 20,
        backend: str = "gloo",
        device: torch.device | str = "cpu",
        secret: str | None = None,
    ) -> None:
        """Listens on ``host`` only (loopback unless given); ``secret``: what a worker must know
        to join (a fresh random one unless given)."""
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"unknown broadcast backend {backend!r} (gloo, nccl)")
        self.host = host
        self.secret = secret or secrets.token_hex(16)
        self.timeout_s = timeout_s
        self.bucket_bytes = bucket_bytes
        self.backend = backend
        self.device = torch.device(device)
        if backend == "nccl" and self.device.type != "cuda":
            raise ValueError("an NCCL hub needs a CUDA device")
        # torch's TCPStore listens on every interface: it gets a socket bound to ``host``.
        self._listener = socket.create_server((host, port), family=_family(host), backlog=512)
        self._tcp = TCPStore(
            host,
            self._listener.getsockname()[1],
            is_master=True,
            wait_for_workers=False,
            timeout=_td(timeout_s),
            master_listen_fd=self._listener.fileno(),
        )
        self.port = self._tcp.port
        self.store = _scoped(self._tcp, self.secret)
        self.generation = 0
        self.members: list[int] = []  # tickets, in rank order (rank = index + 1)
        self.dropped: set[int] = set()
        self.pg: Any = None
        self.pool = BufferPool(keep=IN_FLIGHT + 2)
        self.seq = 0
        self.syncs = 0
        self.failures = 0
        self._sending: _Sending | None = None

    def _tickets(self) -> list[int]:
        n = int(self.store.add("tickets", 0))
        return [t for t in range(1, n + 1) if t not in self.dropped]

    def _form(self, wanted: list[int]) -> None:
        """Propose generation g to ``wanted``; commit those who acknowledge in time."""
        self.generation += 1
        g = self.generation
        if self.pg is not None:
            _abort(self.pg)
        self.pg = None
        self.store.set(f"propose/{g}", json.dumps(wanted))
        self.store.set("generation", str(g))
        # Two timeouts: a live member may still be stuck for one timeout in the collective that
        # just failed (on a dead peer) before it can see this proposal.
        deadline = time.monotonic() + 2 * self.timeout_s
        acked: list[int] = []
        pending = set(wanted)
        while pending and time.monotonic() < deadline:
            for t in list(pending):
                if self.store.check([f"ack/{g}/{t}"]):
                    pending.discard(t)
                    acked.append(t)
            if pending:
                time.sleep(0.01)
        self.dropped |= pending
        if pending:
            log.warning("generation %d: dropped members %s (no acknowledgement)", g, pending)
        members = sorted(acked)
        self.seq = 0  # syncs within this generation
        self.store.set(f"commit/{g}", json.dumps(members))
        self.members = members
        if members:
            try:
                self.pg = make_group(
                    self.backend,
                    PrefixStore(f"gen{g}", self.store),
                    0,
                    len(members) + 1,
                    self.timeout_s,
                    bind=self.host,
                )
            except RuntimeError as err:  # a member acknowledged, then vanished
                log.warning("generation %d: the group did not form (%s)", g, err)
                self.pg, self.members = None, []

    def sync(self, named_tensors: Iterable[tuple[str, Tensor]], version: int) -> int:
        """Send ``version`` to every member; returns how many received it (0 if none or on a
        failure, after at most ``timeout`` of waiting). The learner's ``WeightSender`` runs the
        same three steps (``start``, ``send`` per bucket, ``finish``) with buckets it gathers."""
        plan = plan_buckets(named_tensors, self.bucket_bytes, version)
        if not self.start(version, plan):
            return 0
        for planned in plan:
            buf = self.pool.get(planned.nbytes, self.device)
            self.send(planned.pack(out=buf).data, buf)
        return self.finish()

    def start(self, version: int, plan: list[PlannedBucket]) -> bool:
        """Begin a sync of ``version`` laid out as ``plan`` (its headers go ahead through the
        store): re-forms the group when the members changed. False: nobody to send to."""
        self._sending = None
        wanted = self._tickets()
        if wanted != self.members or self.pg is None:
            if not wanted:
                self.members, self.pg = [], None
                return False
            self._form(wanted)
            if self.pg is None:
                return False
        g, seq = self.generation, self.seq + 1
        headers = [b.header() for b in plan]
        self.store.set(f"sync/{g}/{seq}", json.dumps([version, [h.hex() for h in headers]]))
        self._sending = _Sending(version, seq)
        return True

    def send(self, data: Tensor, buf: Tensor | None = None) -> None:
        """Broadcast the next bucket's bytes (asynchronously: at most ``IN_FLIGHT`` buckets
        in flight; ``buf``, the pool buffer holding ``data``, goes back to ``pool`` once sent;
        without one, ``data`` is a tensor's own memory, left untouched until sent).
        After a failure the rest of the sync is skipped (``finish`` reports it)."""
        s = self._sending
        if s is None or s.failed is not None:
            if buf is not None:
                self.pool.put(buf)
            return
        try:
            if data.device != self.device:  # (a GPU learner's gloo hub) staged in a reused
                staged = self.pool.get(int(data.numel()), self.device)  # buffer, not in fresh
                staged[: data.numel()].copy_(data)  # memory (a page fault per page); the copy
                if buf is not None:  # is synchronous: the device buffer is free again
                    self.pool.put(buf)
                buf, data = staged, staged[: data.numel()]
            s.in_flight.append((buf, self.pg.broadcast(data, 0), data))
            while len(s.in_flight) > IN_FLIGHT:
                self._retire(s)
        except RuntimeError as err:  # a member died or stalled: the collective timed out
            s.failed = err

    def _retire(self, s: _Sending) -> None:
        done, work, _ = s.in_flight.pop(0)
        try:
            work.wait()
        finally:
            if done is not None:
                self.pool.put(done)

    def finish(self) -> int:
        """Wait for the sync's last buckets; how many members received it (0 on a failure)."""
        s, self._sending = self._sending, None
        if s is None:
            return 0
        try:
            while s.in_flight:
                self._retire(s)
            _sync_device(self.device)  # NCCL's wait() orders streams; this waits for the bytes
        except RuntimeError as err:
            s.failed = s.failed or err
        if s.failed is not None:
            for done, _, _ in s.in_flight:
                if done is not None:
                    self.pool.put(done)
            self.failures += 1
            log.warning("sync of v%d failed (%s); the next sync re-forms the group",
                        s.version, s.failed)  # fmt: skip
            _abort(self.pg)
            self.pg = None
            self.members = []
            return 0
        self.seq = s.seq
        self.syncs += 1
        self.store.set(f"done/{self.generation}", str(s.seq))
        return len(self.members)

    def close(self) -> None:
        self.pg = None


class BroadcastReceiver:
    """A worker's side: joins the learner's hub and receives versions on a thread."""

    def __init__(
        self,
        host: str,
        port: int,
        worker_id: str,
        secret: str,
        timeout_s: float = 60.0,
        backend: str = "gloo",
        device: torch.device | str = "cpu",
    ) -> None:
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"unknown broadcast backend {backend!r} (gloo, nccl)")
        self.backend, self.device = backend, torch.device(device)
        if backend == "nccl" and self.device.type != "cuda":
            raise ValueError("an NCCL receiver needs a CUDA device")
        self.host, self.port, self.worker_id = host, port, worker_id
        self.secret = secret
        self.timeout_s = timeout_s
        self._latest: tuple[int, list[Bucket], list[Tensor]] | None = None
        self._lent: list[Tensor] = []
        self.pool = BufferPool(keep=1 << 12)  # (one released version's buckets)
        self._lock = threading.Lock()
        self.stop = threading.Event()
        self.received = 0
        self.ticket: int | None = None
        self._thread = threading.Thread(target=self._run, name="weights-receiver", daemon=True)
        self._thread.start()

    @property
    def latest_version(self) -> int | None:
        """The version ``take_buckets`` would hand out now (None: nothing new), without taking
        it."""
        with self._lock:
            return self._latest[0] if self._latest is not None else None

    def take_buckets(self, only: int | None = None) -> tuple[int, list[Bucket]] | None:
        """The newest complete version received since the last take (or None), as the buckets
        it arrived in (the learner's packing, unchanged: an engine that loads packed buckets
        gets them without a second packing). Their data are the receiver's buffers: call
        ``release()`` once they are loaded (copied) so the next version reuses the memory;
        without it the next version gets new buffers. ``only``: take it only if it is that
        version (else leave it and return None; tensor-parallel ranks agree on one version)."""
        with self._lock:
            if only is not None and (self._latest is None or self._latest[0] != only):
                return None
            out, self._latest = self._latest, None
            if out is None:
                return None
            self._lent = out[2]
        return out[0], out[1]

    def take(self) -> tuple[int, list[tuple[str, Tensor]]] | None:
        """``take_buckets``, unpacked: the tensors are views of the receiver's buffers (no
        copy); the same ``release()`` rule applies."""
        got = self.take_buckets()
        if got is None:
            return None
        return got[0], [nt for bucket in got[1] for nt in unpack_bucket(bucket)]

    def release(self) -> None:
        """The tensors of the last ``take()`` are no longer used: their buffers are reused."""
        with self._lock:
            for buf in self._lent:
                self.pool.put(buf)
            self._lent = []

    def close(self) -> None:
        self.stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                self._session()
            except Exception as err:  # the learner went away or the group broke: rejoin
                if self.stop.is_set():
                    return
                log.info("weights receiver: %s; rejoining", err)
                self.stop.wait(0.5)

    def _session(self) -> None:
        # Connecting gives up soon (a learner that is gone); operations use the full timeout.
        tcp = TCPStore(self.host, self.port, is_master=False, timeout=_td(2.0))
        tcp.set_timeout(_td(self.timeout_s))
        store = _scoped(tcp, self.secret)
        self.ticket = ticket = int(store.add("tickets", 1))
        store.set(f"ticket/{ticket}", self.worker_id)
        seen = 0
        while not self.stop.is_set():
            g = int(store.get("generation")) if store.check(["generation"]) else 0
            if g <= seen:
                time.sleep(0.02)
                continue
            seen = g
            wanted = json.loads(store.get(f"propose/{g}"))
            if ticket not in wanted:
                continue  # dropped: a stalled member gets a new ticket by rejoining
            store.set(f"ack/{g}/{ticket}", "1")
            # The learner waits up to two timeouts for the others' acknowledgements.
            members = json.loads(_wait_get(store, f"commit/{g}", 3 * self.timeout_s, self.stop))
            if ticket not in members:
                raise RuntimeError(f"not committed to generation {g}")
            rank = members.index(ticket) + 1
            pg = make_group(
                self.backend, PrefixStore(f"gen{g}", store), rank, len(members) + 1,
                self.timeout_s,
            )  # fmt: skip
            try:
                self._receive(store, pg, g)
            finally:
                if self.backend == "nccl":
                    _abort(pg)

    def _receive(self, store: TCPStore, pg: Any, g: int) -> None:
        """Receive syncs of generation g until a newer generation is proposed."""
        seq = int(store.get(f"done/{g}")) + 1 if store.check([f"done/{g}"]) else 1
        while not self.stop.is_set():
            key = f"sync/{g}/{seq}"
            if not store.check([key]):
                if int(store.get("generation")) != g:
                    return  # membership changed: join the new generation
                time.sleep(0.005)
                continue
            version, hex_headers = json.loads(store.get(key))
            bufs: list[Tensor] = []
            buckets: list[Bucket] = []
            try:
                works = []
                for h in hex_headers:  # post every receive, then wait: no idle link between
                    v, nbytes, metas = Bucket.metas_from_header(bytes.fromhex(h))
                    bufs.append(self.pool.get(nbytes, self.device))
                    bucket = Bucket(metas, bufs[-1][:nbytes], v)  # a buffer owned here
                    buckets.append(bucket)
                    works.append(pg.broadcast(bucket.data, 0))
                for work in works:
                    work.wait()
                _sync_device(self.device)
            except RuntimeError as err:  # another member died mid-sync: wait for a new group
                log.info("weights receiver: sync of v%s failed (%s)", version, err)
                return
            with self._lock:
                if self._latest is not None:  # superseded before anyone took it
                    for buf in self._latest[2]:
                        self.pool.put(buf)
                self._latest = (int(version), buckets, bufs)
            self.received += 1
            seq += 1


def _wait_get(store: TCPStore, key: str, timeout_s: float, stop: threading.Event) -> bytes:
    deadline = time.monotonic() + timeout_s
    while not store.check([key]):
        if stop.is_set() or time.monotonic() > deadline:
            raise TimeoutError(f"no {key} within {timeout_s}s")
        time.sleep(0.01)
    out: bytes = store.get(key)
    return out
