"""Weights from the learner to the generators: one publisher, one subscriber.

``WeightPublisher`` (the learner's rank 0, built by ``build_publisher``) publishes a version:

- **files**: version ``v`` as ``{dir}/v{v:08d}.safetensors`` (written to a temporary name, then
  renamed: a reader never sees half a file), announced in the run's Redis hash
  ``{prefix}{run}:weights`` (``version``, ``path``, ``time``, and ``broadcast``, the hub's
  address, when it broadcasts). The last ``keep`` versions stay on disk so a slow reader never
  loses the file under it. Every deployment has this transport (one node, or a shared
  filesystem), and it is what a newcomer reads first (``WeightStore``).
- **broadcast** (``sync.broadcast``): the same version, packed once into buckets, over
  torch.distributed to the workers that joined the learner's hub (gloo on CPU, NCCL on GPU;
  ``reval/broadcast.py``'s ``BroadcastHub``).

``WeightSubscriber`` (one per rollout worker, built by ``build_subscriber``) brings the newest
announced weights into a generation engine with ``update(engine)``: it takes a version the
broadcast delivered, else loads the announced file; it joins the hub named by the announcement
(a new one when a resumed learner announces a new address), keeps to the files when it cannot
(an NCCL hub and an engine off CUDA), and loads a *different* announced version, not only a newer
one (a learner resumed from an earlier checkpoint announces a lower version, and trains on it).
An engine with a ``load_buckets(buckets, version)`` method (the vLLM engine) gets a broadcast's
buckets as they arrived: the learner's packing is the only one on the way.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import redis
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor

from reval.broadcast import BroadcastHub, BroadcastReceiver, parse_address
from reval.config import RunConfig
from reval.paths import free_space, last_line
from reval.retry import retry_redis
from reval.weights import unpack_bucket

log = logging.getLogger("reval.weights")

UNREADABLE: tuple[type[BaseException], ...] = (OSError, SafetensorError)
"""What reading an announced weights file raises when the file is gone or damaged: safetensors
0.8 raises FileNotFoundError (an OSError) for a missing file, OSError for other I/O faults
(a stale handle on a shared volume), and SafetensorError (not an OSError, not a RuntimeError)
for a file cut short; none of these may end a worker."""


class WeightWriteError(OSError):
    """A version's file could not be written (disk full, read-only, gone); nothing of it is
    left, and it was not announced."""


@dataclass(frozen=True)
class Announcement:
    version: int
    path: Path
    time: float
    broadcast: str | None = None
    """``backend://host:port`` of the learner's broadcast hub when it broadcasts
    (``reval/broadcast.py``)."""


def weights_key(prefix: str, run: str) -> str:
    return f"{prefix}{{{run}}}:weights"


class WeightStore:
    """The file half: versions in a shared directory, announced in Redis (the publisher and the
    subscriber are built on it; ``services/evaluate.py`` reads it directly)."""

    def __init__(
        self,
        client: redis.Redis,
        key_prefix: str,
        run: str,
        directory: str | Path,
        keep: int = 3,
        retry_s: float = 30.0,
    ) -> None:
        self.client = client
        self.key = weights_key(key_prefix, run)
        self.dir = Path(directory)
        self.keep = max(1, keep)
        self.retry_s = retry_s

    def _retry(self, fn: Any) -> Any:
        return retry_redis(fn, self.retry_s, "weights announcement", log)

    def publish(
        self,
        named_tensors: Iterable[tuple[str, Tensor]],
        version: int,
        broadcast: str | None = None,
    ) -> Path:
        """Write and announce ``version`` (the learner's side); ``broadcast``: where workers
        join the learner's broadcast hub."""
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / f"v{version:08d}.safetensors"
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tensors: dict[str, Tensor] = {}
        seen: set[int] = set()
        for name, t in named_tensors:
            t = t.detach().to("cpu").contiguous()
            # Tied weights (lm_head = embed_tokens, as one unsharded rank's state dict holds
            # them) share storage, which safetensors refuses: the alias gets its own copy.
            ptr = t.untyped_storage().data_ptr()
            tensors[name] = t.clone() if ptr in seen else t
            seen.add(ptr)
        try:
            save_file(tensors, str(tmp), metadata={"version": str(version)})
            now = time.time_ns()  # (the file system's own clock may tick only every few ms)
            os.utime(tmp, ns=(now, now))
            os.replace(tmp, path)
        except (OSError, SafetensorError) as err:  # a full disk, a read-only or vanished volume
            tmp.unlink(missing_ok=True)
            raise WeightWriteError(
                f"could not write weights {path} ({free_space(self.dir)}): {last_line(err)}"
            ) from None
        mapping: dict[str, Any] = {"version": version, "path": str(path), "time": time.time()}
        if broadcast:
            mapping["broadcast"] = broadcast

        def announce() -> None:
            pipe = self.client.pipeline(transaction=True)
            if not broadcast:  # (a learner restarted without a hub: no stale address)
                pipe.hdel(self.key, "broadcast")
            pipe.hset(self.key, mapping=mapping)
            pipe.execute()

        self._retry(announce)
        self._prune(path)
        return path

    def _prune(self, newest: Path) -> None:
        """Keep the ``keep`` versions written last (by time, not by number: a learner resumed
        from an earlier checkpoint writes lower versions, which must not go first)."""

        def written(p: Path) -> int:
            try:
                return p.stat().st_mtime_ns
            except FileNotFoundError:
                return -1

        files = [p for p in self.dir.glob("v*.safetensors") if p != newest]
        files.sort(key=lambda p: (written(p), p.name))
        for old in files[: max(0, len(files) - (self.keep - 1))]:
            old.unlink(missing_ok=True)

    def latest(self) -> Announcement | None:
        """The newest announced version, or None before the learner published one."""
        raw = self._retry(lambda: self.client.hgetall(self.key))
        if not raw or b"version" not in raw:
            return None
        return Announcement(
            version=int(raw[b"version"]),
            path=Path(raw[b"path"].decode()),
            time=float(raw.get(b"time", 0.0)),
            broadcast=raw[b"broadcast"].decode() if b"broadcast" in raw else None,
        )

    @staticmethod
    def load(announcement: Announcement) -> list[tuple[str, Tensor]]:
        """The tensors of an announced version (raises one of ``UNREADABLE`` if it was pruned
        or is damaged)."""
        return list(load_file(str(announcement.path)).items())


def _store(cfg: RunConfig, client: redis.Redis) -> WeightStore:
    weights_dir = cfg.sync.weights_dir or str(cfg.run_dir / "weights")
    return WeightStore(client, cfg.buffer.key_prefix, cfg.name, weights_dir)


# -- the learner's side ----------------------------------------------------------------------------


@dataclass(frozen=True)
class PublishResult:
    version: int
    path: Path | None
    """The version's file (None: it could not be written, and the version was not published)."""
    nbytes: int
    """Bytes of the tensors published (one copy of the weights)."""
    receivers: int
    """Workers the broadcast reached (0 without a hub, with no members, or after a failed sync)."""


class WeightPublisher:
    """The learner's one way to publish weights: the file and its announcement, then the
    broadcast through ``hub`` when there is one. ``host`` is the hub's address as announced (the
    hub listens on its own bind address: ``sync.broadcast_bind``)."""

    def __init__(
        self, store: WeightStore, hub: BroadcastHub | None = None, host: str = "127.0.0.1"
    ) -> None:
        self.store = store
        self.hub = hub
        self.host = host

    @property
    def address(self) -> str | None:
        """``backend://host:port/secret`` of the hub, as announced in Redis (None without a
        hub): the secret is what a worker needs to join."""
        if self.hub is None:
            return None
        return f"{self.hub.backend}://{self.host}:{self.hub.port}/{self.hub.secret}"

    def publish(self, named_tensors: Iterable[tuple[str, Tensor]], version: int) -> PublishResult:
        """Write and announce ``version``, then broadcast it to the hub's members (waiting at
        most the hub's timeout for a dead one)."""
        tensors = list(named_tensors)  # (read twice: the file, the broadcast)
        nbytes = sum(t.numel() * t.element_size() for _, t in tensors)
        try:
            path = self.store.publish(tensors, version, broadcast=self.address)
        except WeightWriteError as err:
            # Training goes on; every worker keeps the last published version (the broadcast
            # is skipped too: its members would otherwise be ahead of the announcement, which
            # they follow back). The next version tries again.
            log.error("%s; version %d not published, the workers keep the last one", err, version)
            return PublishResult(version, None, 0, 0)
        receivers = self.hub.sync(tensors, version) if self.hub is not None else 0
        return PublishResult(version, path, nbytes, receivers)

    def close(self) -> None:
        if self.hub is not None:
            self.hub.close()


def build_publisher(
    cfg: RunConfig, client: redis.Redis, device: torch.device | str
) -> WeightPublisher:
    """The run's publisher (the learner's rank 0 only; ``device`` is the learner's): files in
    ``sync.weights_dir`` announced in Redis, and with ``sync.broadcast`` a hub on
    ``sync.broadcast_port`` announced at ``sync.broadcast_host``. One code path: the hub speaks
    NCCL from a CUDA device and gloo otherwise, unless ``sync.backend`` says which."""
    device = torch.device(device)
    hub = None
    backend = "nccl" if device.type == "cuda" else "gloo"
    if cfg.sync.backend != "auto":
        backend = cfg.sync.backend
    host = cfg.sync.broadcast_host
    announced = discover_host() if host == "auto" else host
    if cfg.sync.broadcast:
        bind = cfg.sync.broadcast_bind or bind_address(announced)
        hub = BroadcastHub(
            cfg.sync.broadcast_port,
            host=bind,
            timeout_s=cfg.sync.timeout_s,
            bucket_bytes=int(cfg.sync.bucket_mb * (1 << 20)),
            backend=backend,
            device=device if backend == "nccl" else "cpu",
        )
        log.info("broadcast hub (%s) listening on %s port %d", backend, bind, hub.port)
    return WeightPublisher(_store(cfg, client), hub, announced)


def bind_address(announced: str) -> str:
    """Where the hub listens when ``sync.broadcast_bind`` is unset: the address it is announced
    at (an IP address as is, a name resolved), so it is reachable where the workers look for it
    and nowhere else; every interface only for a name that does not resolve (logged)."""
    try:
        return socket.getaddrinfo(announced, None)[0][4][0]
    except OSError:
        log.warning("broadcast host %r does not resolve: the hub listens on every interface",
                    announced)  # fmt: skip
        return "0.0.0.0"


def discover_host() -> str:
    """This process's address as other hosts reach it (``sync.broadcast_host = "auto"``): the
    Ray node's IP inside a Ray worker (``reval launch``), else the fully qualified host name
    resolved to an address, as torch.distributed's elastic agent names its hosts (a container's
    or a pod's name resolves to its own address); the name itself if it does not resolve."""
    try:
        import ray

        if ray.is_initialized():
            return str(ray.util.get_node_ip_address())
    except ImportError:
        pass
    name = socket.getfqdn()
    try:
        return socket.gethostbyname(name)
    except OSError:
        return name


# -- a worker's side -----------------------------------------------------------------------------


class WeightSink(Protocol):
    """What a subscriber loads weights into: the weight half of ``rollout.engines``'
    ``GenerationEngine``. An engine may also offer:

    - ``load_buckets(buckets, version)`` (packed ``reval.weights.Bucket``s): a broadcast's
      buckets reach it as received, never unpacked and packed again;
    - ``load_weights_file(path, version)``: it reads an announced file itself (FileNotFoundError
      if it was pruned), so the tensors never pass through the subscriber's process;
    - ``join_broadcast(address, worker_id, timeout_s) -> bool``, ``take_broadcast(newer_than)
      -> version | None``, ``broadcast_state() -> (ready version | None, received)`` and
      ``leave_broadcast()``: it joins the hub and receives in processes of its own (the vLLM
      engine: a receiver inside each vLLM worker, next to the model). The subscriber then holds
      no receiver, and no copy of the weights.
    """

    def load_weights(self, named_tensors: Iterable[tuple[str, Tensor]], version: int) -> None: ...


class WeightSubscriber:
    """A worker's one source of weights (see the module docstring). Not thread-safe: one
    caller, between generation batches."""

    def __init__(self, store: WeightStore, worker_id: str, timeout_s: float = 60.0) -> None:
        self.store = store
        self.worker_id = worker_id
        self.timeout_s = timeout_s
        """Timeout of the broadcast's collectives (``sync.timeout_s``)."""
        self.version: int | None = None
        """The version loaded last (None before the first)."""
        self.source: str | None = None
        """Where it came from: ``"file"`` or ``"broadcast"``."""
        self.hub: str | None = None
        """The hub address last announced (joined, or not joinable from here)."""
        self.joined_broadcast = False
        """True once it has joined a hub: a receiver thread may outlive ``close()`` (stuck in a
        gloo or TCPStore call when the learner is gone)."""
        self._receiver: BroadcastReceiver | None = None
        self._engine_receiver: Any = None
        """The engine that joined the hub itself (``join_broadcast``), if any."""

    @property
    def backend(self) -> str | None:
        """The backend it receives broadcasts with now (None: files only)."""
        if self._engine_receiver is not None:
            return str(self._engine_receiver.broadcast_backend)
        return self._receiver.backend if self._receiver is not None else None

    @property
    def received(self) -> int:
        """Versions the current hub's broadcast has delivered (taken or not)."""
        if self._engine_receiver is not None:
            return int(self._engine_receiver.broadcast_state()[1])
        return self._receiver.received if self._receiver is not None else 0

    def update(self, engine: WeightSink, force: bool = False) -> int | None:
        """Load the newest announced weights into ``engine`` if they are not the ones it has;
        the version loaded, or None. ``force``: read the announced file even when that version
        is loaded, and do not look at the broadcast first."""
        if not force:
            version = self._from_broadcast(engine)
            if version is not None:
                return version
        try:
            ann = self.store.latest()
        except (redis.ConnectionError, redis.TimeoutError):
            return None  # Redis away: keep the weights in hand
        if ann is None:
            return None
        if ann.broadcast != self.hub:
            self._join(ann.broadcast, engine)  # a (new) learner's hub, or none any more
        # A different version, not only a newer one: a learner resumed from an earlier
        # checkpoint announces a lower version, and the weights it trains on are those.
        if not force and ann.version == self.version:
            return None  # loaded already (from the broadcast, or this file)
        load_file = getattr(engine, "load_weights_file", None)
        try:
            if load_file is not None:  # the engine reads the file in its own processes
                load_file(ann.path, ann.version)
            else:
                engine.load_weights(self.store.load(ann), ann.version)
        except UNREADABLE as err:
            # Pruned by the learner, or cut short on a shared volume: the next announcement
            # has a newer file; the weights in hand stay in use meanwhile.
            log.warning("weights v%d could not be read (pruned?): %s", ann.version, err)
            return None
        self._loaded(ann.version, "file")
        return ann.version

    def _from_broadcast(self, engine: WeightSink) -> int | None:
        """Load the newest version the receiver holds if it is newer than the loaded one (an
        older one is stale; a resumed learner's lower versions come through the announcement,
        which the caller reads next)."""
        if self._engine_receiver is not None:
            version = self._engine_receiver.take_broadcast(self.version)
            if version is not None:
                self._loaded(version, "broadcast")
            return version  # type: ignore[no-any-return]
        if self._receiver is None:
            return None
        got = self._receiver.take_buckets()
        if got is None:
            return None
        version, buckets = got
        try:
            if self.version is not None and version <= self.version:
                return None
            load_buckets = getattr(engine, "load_buckets", None)
            if load_buckets is not None:
                load_buckets(buckets, version)
            else:  # views of the receiver's buffers; the engine copies them
                engine.load_weights((nt for b in buckets for nt in unpack_bucket(b)), version)
        finally:
            del buckets
            self._receiver.release()  # the next version reuses the buffers
        self._loaded(version, "broadcast")
        return version

    def _loaded(self, version: int, source: str) -> None:
        self.version, self.source = version, source
        log.info("worker %s: loaded weights v%d (%s)", self.worker_id, version, source)

    def _join(self, address: str | None, engine: WeightSink) -> None:
        """Join the hub at ``address`` (leaving the previous one; None: leave only); a worker
        that cannot (an NCCL hub, an engine off CUDA) keeps reading the files."""
        self.hub = address
        self._leave()
        if address is None:
            return
        try:
            backend, host, port, secret = parse_address(address)
        except ValueError as err:
            log.warning("worker %s: %s; weights from files", self.worker_id, err)
            return
        join = getattr(engine, "join_broadcast", None)
        if join is not None:  # the engine receives in its own processes
            if join(address, self.worker_id, self.timeout_s):
                self._engine_receiver = engine
                self.joined_broadcast = True
            else:
                log.warning(
                    "worker %s: the engine cannot receive %s broadcasts: weights from files",
                    self.worker_id, backend,
                )  # fmt: skip
            return
        device = torch.device(str(getattr(engine, "device", "cuda")))
        if backend == "nccl" and device.type != "cuda":
            log.warning(
                "worker %s: the learner broadcasts over NCCL and this engine is on %s: "
                "weights from files", self.worker_id, device,
            )  # fmt: skip
            return
        self._receiver = BroadcastReceiver(
            host,
            port,
            self.worker_id,
            secret,
            timeout_s=self.timeout_s,
            backend=backend,
            device=device if backend == "nccl" else "cpu",
        )
        self.joined_broadcast = True

    def _leave(self) -> None:
        if self._receiver is not None:
            self._receiver.close()
            self._receiver = None
        if self._engine_receiver is not None:
            engine, self._engine_receiver = self._engine_receiver, None
            engine.leave_broadcast()

    def close(self) -> None:
        self._leave()


def build_subscriber(cfg: RunConfig, client: redis.Redis, worker_id: str) -> WeightSubscriber:
    """A worker's subscriber to the run's weights (``sync.weights_dir``, ``sync.timeout_s``)."""
    return WeightSubscriber(_store(cfg, client), worker_id, timeout_s=cfg.sync.timeout_s)
