"""The generators' side of the weights: a receiver protocol every engine implements, the one
implementation that runs next to a model, and the worker's subscriber.

- ``WeightReceiver`` (protocol): what a generation engine offers as ``engine.receiver``: load a
  version's file, join the learner's hub, take the newest version the broadcast delivered, leave.
  ``HFEngine`` holds a ``LocalReceiver`` in its own process; ``VLLMEngine``'s receiver forwards
  each call (``collective_rpc``) to a ``LocalReceiver`` inside every vLLM worker process, next
  to the model (``rollout/vllm_engine.py``).
- ``LocalReceiver``: the one code that reads a file into a model and joins, receives and takes
  broadcasts (``collective.BroadcastReceiver`` on a thread, into device memory under NCCL); it
  hands each version to a ``load(named_tensors, version)`` function (the engine's in-place load)
  as views of the received buckets.
- ``WeightSubscriber``: a rollout worker's ``update(receiver)`` between generation batches: the
  broadcast's newest version if it is newer, else the announced file; it joins the hub the
  announcement names (a new one when a resumed learner announces a new address) and follows a
  new lineage (a resumed learner) even to lower versions.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Protocol

import redis
import torch
from torch import Tensor

from reval.config import RunConfig
from reval.ratelog import RateLog
from reval.retry import wait_fault
from reval.weights.buckets import unpack_bucket
from reval.weights.collective import BroadcastReceiver, parse_address
from reval.weights.files import UNREADABLE, WeightStore, run_store
from reval.weights.http_files import FileFetcher

log = logging.getLogger("reval.weights")

Load = Callable[[Iterable[tuple[str, Tensor]], int], None]
"""An engine's in-place load: ``(named tensors, version)``; the tensors may be views of buffers
reused afterwards (copy them, do not keep them)."""


class WeightReceiver(Protocol):
    """How weights reach a generation engine (``engine.receiver``)."""

    def load_file(self, path: Path, version: int) -> bool:
        """Load a version's safetensors file; False if it is gone or damaged (pruned, cut
        short): the weights in hand stay."""
        ...

    def join(self, address: str, worker_id: str, timeout_s: float) -> bool:
        """Join the hub at ``backend://host:port/secret`` (leaving any other); False if this
        engine cannot receive that backend (NCCL off CUDA): it reads files."""
        ...

    def take(self, newer_than: int | None) -> int | None:
        """Load the newest version the broadcast delivered if it is newer than ``newer_than``
        (an older one is dropped); the version loaded, or None."""
        ...

    def received(self) -> int:
        """Versions the current hub delivered (taken or not)."""
        ...

    def leave(self) -> None:
        """Leave the hub (nothing to leave: nothing happens)."""
        ...


class LocalReceiver:
    """A ``WeightReceiver`` in the model's own process (see the module docstring)."""

    def __init__(self, load: Load, device: torch.device | str) -> None:
        self.load = load
        self.device = torch.device(device)
        self.transport: BroadcastReceiver | None = None

    @property
    def backend(self) -> str | None:
        return self.transport.backend if self.transport is not None else None

    def load_file(self, path: Path, version: int) -> bool:
        from safetensors import safe_open

        try:  # (safe_open checks the header against the file's length: a file cut short
            f = safe_open(str(path), framework="pt", device="cpu")  # fails here, before a load)
        except UNREADABLE:
            return False
        with f:
            self.load(((name, f.get_tensor(name)) for name in f.keys()), version)  # noqa: SIM118
        return True

    def join(self, address: str, worker_id: str, timeout_s: float) -> bool:
        self.leave()
        backend, host, port, secret = parse_address(address)
        if backend == "nccl" and self.device.type != "cuda":
            return False
        self.transport = BroadcastReceiver(
            host, port, worker_id, secret, timeout_s=timeout_s, backend=backend,
            device=self.device if backend == "nccl" else "cpu",
        )  # fmt: skip
        return True

    def ready(self) -> int | None:
        """The newest complete version received and not taken (None: nothing new)."""
        return self.transport.latest_version if self.transport is not None else None

    def take(self, newer_than: int | None, only: int | None = None) -> int | None:
        """``WeightReceiver.take``; ``only``: take it only if it is that version (the vLLM
        workers of one engine agree on one first)."""
        r = self.transport
        got = r.take_buckets(only=only) if r is not None else None
        if r is None or got is None:
            return None
        version, buckets = got
        try:
            if newer_than is not None and version <= newer_than:
                return None
            self.load((nt for bucket in buckets for nt in unpack_bucket(bucket)), version)
        finally:
            del buckets, got
            r.release()  # the next version reuses the buffers
        return version

    def received(self) -> int:
        return self.transport.received if self.transport is not None else 0

    def leave(self) -> None:
        r, self.transport = self.transport, None
        if r is not None:
            r.close()


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
        self.lineage: str | None = None
        """The lineage (learner) it came from."""
        self.source: str | None = None
        """Where it came from: ``"file"`` or ``"broadcast"``."""
        self.hub: str | None = None
        self.loads = RateLog(log)
        """Weight loads (and failed reads) are logged through it: the first, then one a minute
        with the count, at once when the source or the lineage changes or after a failed read."""
        self._failures = 0
        """The hub address last announced (joined, or not joinable from here)."""
        self.joined_broadcast = False
        """True once it has joined a hub: a receiver thread may outlive ``close()`` (stuck in a
        gloo or TCPStore call when the learner is gone)."""
        self.base: Path | None = None
        """The base file loaded last (a LoRA learner publishing its adapters alone)."""
        self._hub_lineage: str | None = None
        self._receiver: WeightReceiver | None = None
        """The receiver that joined the hub (None: files only)."""
        self.fetcher = FileFetcher(timeout_s=max(timeout_s, 60.0))
        """Announced files this host does not see, fetched from the learner's file server
        (``files_url``, ``reval/weights/http_files.py``)."""

    @property
    def backend(self) -> str | None:
        """The backend it receives broadcasts with now (None: files only)."""
        if self._receiver is None or self.hub is None:
            return None
        return parse_address(self.hub)[0]

    @property
    def received(self) -> int:
        """Versions the current hub's broadcast has delivered (taken or not)."""
        return self._receiver.received() if self._receiver is not None else 0

    def update(self, receiver: WeightReceiver, force: bool = False) -> int | None:
        """Load the newest weights into ``receiver`` if they are not the ones it has; the
        version loaded, or None. ``force``: read the announced file even when that version is
        loaded, and do not look at the broadcast first."""
        if not force and self._receiver is not None:
            same = self.lineage == self._hub_lineage
            version = self._receiver.take(self.version if same else None)
            if version is not None:
                self._loaded(version, self._hub_lineage, "broadcast")
                return version
        try:
            ann = self.store.latest()
        except Exception as err:
            if not wait_fault(err):
                raise
            return None  # Redis away past redis.outage_s: keep the weights in hand
        if ann is None:
            return None
        if ann.base is not None and ann.base != self.base:
            if ann.path is None or ann.file_version is None:
                return None  # (the base and the lineage's first adapters load together)
            if not self._load_base(ann.base, ann.file_version, ann.lineage, receiver,
                                   ann.files_url):  # fmt: skip
                return None
        if ann.broadcast != self.hub:
            self._join(ann.broadcast, ann.lineage, receiver)  # a (new) learner's hub, or none
        if ann.path is None or ann.file_version is None:
            return None  # the lineage's first file is being written (or failed)
        # Within a lineage only a newer file; a new lineage (a resumed learner) from its first
        # file on, even a lower version: the weights it trains on are those.
        same = not force and ann.lineage == self.lineage
        if same and self.version is not None and ann.file_version <= self.version:
            return None
        local = self._local(ann.path, ann.files_url, ann.lineage)
        if not receiver.load_file(local, ann.file_version):
            # Pruned by the learner, or cut short on a shared volume: the next announcement
            # has a newer file; the weights in hand stay in use meanwhile.
            self.loads.warning("failed", "weights v%d could not be read (pruned?)",
                               ann.file_version)  # fmt: skip
            self._failures += 1  # (the next load is logged at once)
            return None
        self._loaded(ann.file_version, ann.lineage, "file")
        return ann.file_version

    def _local(self, path: Path, url: str | None, lineage: str | None = None) -> Path:
        """``path`` as this host can read it: itself, or fetched from the learner's file server
        (a fetch that fails gives back ``path``: its load then fails like a pruned file's)."""
        try:
            return self.fetcher.local(path, url, lineage)
        except OSError as err:
            self.loads.warning("fetch", "worker %s: %s", self.worker_id, err)
            return path

    def _load_base(
        self, path: Path, version: int, lineage: str, receiver: WeightReceiver,
        url: str | None = None,
    ) -> bool:  # fmt: skip
        """Load a lineage's base weights (its versions are adapters to apply to them) just
        before its file ``version``, which follows at once; the broadcast of an earlier lineage
        is left first."""
        self._join(None, lineage, receiver)
        if not receiver.load_file(self._local(path, url), version):
            self.loads.warning("failed", "base weights %s could not be read", path)
            self._failures += 1
            return False
        self.base, self.version, self.lineage = path, None, None
        log.info("worker %s: loaded the base weights of learner %s (adapters follow)",
                 self.worker_id, lineage)  # fmt: skip
        return True

    def _loaded(self, version: int, lineage: str | None, source: str) -> None:
        self.version, self.lineage, self.source = version, lineage, source
        self.loads.info("load", "worker %s: loaded weights v%d (%s)", self.worker_id, version,
                        source, state=f"{source}/{lineage}/{self._failures}")  # fmt: skip

    def _join(self, address: str | None, lineage: str, receiver: WeightReceiver) -> None:
        """Join the hub at ``address`` (leaving the previous one; None: leave only); a worker
        that cannot (an NCCL hub, an engine off CUDA) keeps reading the files."""
        self.hub, self._hub_lineage = address, lineage
        self._leave()
        if address is None:
            return
        try:
            backend = parse_address(address)[0]
        except ValueError as err:
            log.warning("worker %s: %s; weights from files", self.worker_id, err)
            return
        if receiver.join(address, self.worker_id, self.timeout_s):
            self._receiver = receiver
            self.joined_broadcast = True
        else:
            log.warning("worker %s: this engine cannot receive %s broadcasts: weights from files",
                        self.worker_id, backend)  # fmt: skip

    def _leave(self) -> None:
        r, self._receiver = self._receiver, None
        if r is not None:
            r.leave()

    def close(self) -> None:
        self._leave()
        self.fetcher.close()


def build_subscriber(cfg: RunConfig, client: redis.Redis, worker_id: str) -> WeightSubscriber:
    """A worker's subscriber to the run's weights (``sync.weights_dir``, ``sync.timeout_s``)."""
    return WeightSubscriber(run_store(cfg, client), worker_id, timeout_s=cfg.sync.timeout_s)
