"""The learner's side of the weights: ``WeightSender.send(model, version)``, called by every
learner rank after an update (``sync.every``).

Every rank takes part in gathering each parameter's full tensor in the compute dtype on its
device (cast on the shard, then ``DTensor.full_tensor()``: half the bytes of the fp32 masters);
rank 0 packs them into reused device buckets (``BufferPool``) and, with ``sync.broadcast``,
sends each bucket over the hub's own group (``collective.BroadcastHub``, NCCL from a GPU, gloo
from the CPU) while the next bucket is gathered: at most ``IN_FLIGHT`` buckets in flight, no
full state dict anywhere, no host-side cast. The packed tensors are also copied into the file
writer's host mirror (asynchronously from a GPU), and the file is written in the background
(``files.FileWriter``): the learner never waits for the disk.

Order on rank 0: the version is announced (with the hub's address) before it is broadcast, so a
member is never ahead of the announcement; the file's own announcement follows when written.
"""

from __future__ import annotations

import logging
import secrets
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis
import torch
from torch import Tensor, nn

from reval import lora
from reval.config import RunConfig
from reval.retry import skip_when_stopping
from reval.weights.buckets import BufferPool, PlannedBucket, plan_buckets
from reval.weights.collective import IN_FLIGHT, BroadcastHub
from reval.weights.files import FileWriter, WeightStore, run_store
from reval.weights.http_files import FileServer

log = logging.getLogger("reval.weights")


@dataclass(frozen=True)
class SendResult:
    version: int
    nbytes: int
    """Bytes of one copy of the weights in the compute dtype."""
    receivers: int
    """Members the broadcast reached (0 without a hub, with none, or after a failed sync)."""
    file: bool
    """A file of this version is being written (False: the previous one still was)."""


def published_tensors(
    model: nn.Module, persistent: set[str] | None = None, lora_publish: str = "merged"
) -> list[tuple[str, Tensor]]:
    """What a version holds: the parameters (tied ones once, by their first name) and the
    persistent buffers (``persistent``: their names, if known), in a fixed order (every rank
    iterates them alike).

    A LoRA policy (``reval.lora``) publishes, with ``lora_publish = "merged"``, the base's
    names and tensors, the adapters left out (the sender folds each into its layer's weight:
    ``merged_layers``); with ``"adapter"``, only the adapters' tensors, by peft's names; with
    ``"base"``, the base's tensors unmerged (``adapter_base``)."""
    return [(name, t) for name, _, t in _published(model, persistent, lora_publish)]


def _published(
    model: nn.Module, persistent: set[str] | None, lora_publish: str
) -> list[tuple[str, str, Tensor]]:
    """``published_tensors`` with each tensor's own name in ``model``: (published name, the
    model's name, tensor)."""
    if persistent is None:
        persistent = set(model.state_dict().keys())
    out: list[tuple[str, Tensor]] = list(model.named_parameters())
    out += [(n, b) for n, b in model.named_buffers() if n in persistent]
    if not lora.is_lora(model):
        return [(n, n, t) for n, t in out]
    if lora_publish == "adapter":
        return [(n, n, t) for n, t in out if lora.is_adapter(n)]
    return [(lora.base_name(n), n, t) for n, t in out if not lora.is_adapter(n)]


class PublishedTensors:
    """``published_tensors`` of one model, its walk of the module tree done once: each call
    reads the tensors anew from the modules that own them (a parameter replaced since, as
    FSDP2 does around a forward, is read as it is now). The walk cost 5 ms a publish on a
    wrapped 500 MB model: a fifth of a LoRA adapters' publish (``benchmarks/sync_bench.py
    --lora``)."""

    def __init__(self, model: nn.Module, persistent: set[str] | None, lora_publish: str) -> None:
        self.model = model
        self.owners: list[tuple[str, nn.Module, str]] = []
        for published, name, _ in _published(model, persistent, lora_publish):
            path, _, attr = name.rpartition(".")
            self.owners.append((published, model.get_submodule(path), attr))

    def __call__(self) -> list[tuple[str, Tensor]]:
        out = []
        for published, module, attr in self.owners:
            t = module._parameters.get(attr)
            out.append((published, t if t is not None else module._buffers[attr]))
        return out  # type: ignore[return-value]


def adapter_base(model: nn.Module, persistent: set[str] | None = None) -> list[tuple[str, Tensor]]:
    """What the adapters of a LoRA policy published alone apply to: its frozen base, by the
    base's names (written once per lineage: ``WeightStore.write_base``)."""
    if persistent is None:
        persistent = set(model.state_dict().keys())
    return published_tensors(model, persistent, "base")


def merged_layers(model: nn.Module) -> dict[str, Any]:
    """A LoRA policy's layers by the published (base) name of their weight: the weights
    ``published_tensors`` gives unmerged, which the sender merges (``lora.merged_weight``)."""
    if not lora.is_lora(model):
        return {}
    found = ((n, lora.lora_layer(model, n)) for n, _ in model.named_parameters())
    return {lora.base_name(n): layer for n, layer in found if layer is not None}


def _full(t: Tensor, dtype: torch.dtype) -> Tensor:
    """The full tensor in ``dtype`` (floating point only), on this rank's device: cast on the
    shard, then gathered (a collective: every rank calls it, in the same order)."""
    from torch.distributed.tensor import DTensor

    t = t.detach()
    if t.is_floating_point() and t.dtype != dtype:
        t = t.to(dtype)
    if isinstance(t, DTensor):
        t = t.full_tensor()
    return t


class WeightSender:
    """One per learner rank; only rank 0 holds the store, the hub and the file writer."""

    def __init__(
        self,
        rank: int,
        dtype: torch.dtype,
        device: torch.device | str,
        bucket_bytes: int,
        store: WeightStore | None = None,
        hub: BroadcastHub | None = None,
        host: str = "127.0.0.1",
        lora_publish: str = "merged",
    ) -> None:
        self.rank, self.dtype, self.device = rank, dtype, torch.device(device)
        self.lora_publish = lora_publish
        """``model.lora.publish``: what a LoRA policy's version carries (``published_tensors``)."""
        self.bucket_bytes = bucket_bytes
        self.store, self.hub, self.host = store, hub, host
        self.lineage = secrets.token_hex(8)
        """This learner's id in the announcement (a resumed learner is a new lineage)."""
        broadcast = hub is not None
        self.files = FileWriter(store, self.lineage, broadcast) if store is not None else None
        self.pool = hub.pool if hub is not None else BufferPool(keep=IN_FLIGHT + 2)
        self.sent = 0
        self._plan: list[PlannedBucket] | None = None
        self._names: list[str] = []
        self._persistent: set[str] | None = None
        self._published: PublishedTensors | None = None
        self.base: Path | None = None
        """LoRA's adapters published alone: the base file, announced with every version (a
        hash recreated after a Redis restart still names it)."""
        self._merge: dict[str, Any] | None = None
        """A LoRA policy published merged: its layers by published weight name."""
        self._copying: dict[int, Any] = {}
        """Pool buffers (by address) still being copied into the file's mirror (CUDA events)."""
        self.server: FileServer | None = None
        """Rank 0's file server (``sync.serve_files``): the files for hosts without the disk."""

    @property
    def address(self) -> str | None:
        """``backend://host:port/secret`` of the hub, as announced (None without a hub)."""
        if self.hub is None:
            return None
        return f"{self.hub.backend}://{self.host}:{self.hub.port}/{self.hub.secret}"

    def _layout(self, tensors: list[tuple[str, Tensor]], version: int) -> list[PlannedBucket]:
        """The buckets' layout (computed once: names, shapes and dtypes do not change)."""
        names = [n for n, _ in tensors]
        if self._plan is None or names != self._names:

            def shaped() -> Iterator[tuple[str, Tensor]]:
                for n, t in tensors:
                    dtype = self.dtype if t.is_floating_point() else t.dtype
                    yield n, torch.empty(t.shape, dtype=dtype, device="meta")

            self._plan, self._names = plan_buckets(shaped(), self.bucket_bytes), names
        for planned in self._plan:
            planned.version = version
        return self._plan

    @torch.no_grad()
    def send(self, model: nn.Module, version: int) -> SendResult:
        """Publish the model's weights as ``version`` (every rank calls it; rank 0's result
        counts)."""
        if self._persistent is None:
            self._persistent = set(model.state_dict().keys())
        if self._merge is None:
            self._merge = merged_layers(model) if self.lora_publish == "merged" else {}
        if self._published is None or self._published.model is not model:
            self._published = PublishedTensors(model, self._persistent, self.lora_publish)
        tensors = self._published()
        plan = self._layout(tensors, version)
        nbytes = sum(m.nbytes for b in plan for m in b.metas)
        lead = self.rank == 0
        hub = file = False
        if self.sent == 0:
            self.base = self._base(model)
        if lead and self.store is not None:
            with skip_when_stopping():  # (a stop during an outage: the ranks go on to its end)
                self.store.announce(version, self.lineage, self.address, first=self.sent == 0,
                                    base=self.base, files_url=self.files_url)  # fmt: skip
        if lead and self.hub is not None:
            hub = self.hub.start(version, plan)
        if lead and self.files is not None:
            metas = [m for b in plan for m in b.metas]
            file = self.files.begin(version, metas, self.device)
        source = iter(tensors)
        try:
            for planned in plan:
                fulls = [self._gather(*next(source)) for _ in planned.metas]
                if not lead or not (hub or file):
                    continue
                buf = None
                data = self._whole(planned, fulls)
                if data is None:  # packed into a reused buffer
                    buf = self._buffer(planned.nbytes)
                    planned.tensors = fulls
                    data = planned.pack(out=buf).data
                    planned.tensors = []
                if file:
                    assert self.files is not None
                    for m in planned.metas:
                        copied = self.files.copy(data[m.offset : m.offset + m.nbytes])
                    if buf is not None and copied is not None:
                        self._copying[buf.data_ptr()] = copied
                if hub:
                    assert self.hub is not None
                    self.hub.send(data, buf)
                elif buf is not None:
                    self.pool.put(buf)
        except BaseException:
            if file and self.files is not None:
                self.files.abort()
            raise
        receivers = self.hub.finish() if hub and self.hub is not None else 0
        if file and self.files is not None:
            self.files.commit()
        self.sent += 1
        return SendResult(version, nbytes, receivers, file)

    def _base(self, model: nn.Module) -> Path | None:
        """A LoRA policy publishing its adapters alone: its base, gathered by every rank one
        tensor at a time (rank 0 keeps each on the host, the others drop it) and written by
        rank 0 before the lineage's first version is announced (once: the base is frozen).
        None otherwise."""
        if self.lora_publish != "adapter" or not lora.is_lora(model):
            return None
        kept: list[tuple[str, Tensor]] = []
        for name, t in adapter_base(model, self._persistent):
            full = _full(t, self.dtype)
            if self.rank == 0:
                kept.append((name, full.cpu()))
            del full
        if self.rank != 0 or self.store is None:
            return None
        path = self.store.write_base(kept, self.lineage)
        log.info("adapters published alone: the base weights (%.0f MB) in %s",
                 sum(t.numel() * t.element_size() for _, t in kept) / 1e6, path)  # fmt: skip
        return path

    def _gather(self, name: str, t: Tensor) -> Tensor:
        """The published tensor ``name`` whole in the compute dtype (a collective): a LoRA
        layer's weight merged with its adapter when publishing merged."""
        layer = self._merge.get(name) if self._merge else None
        if layer is None:
            return _full(t, self.dtype)
        return lora.merged_weight(layer, t, lambda x: _full(x, torch.float32), self.dtype)

    def _whole(self, planned: PlannedBucket, fulls: list[Tensor]) -> Tensor | None:
        """A bucket of one tensor filling it exactly (``plan_buckets`` gives a large tensor a
        bucket of its own): the tensor's own bytes, sent without a copy; None otherwise."""
        if len(fulls) != 1:
            return None
        t = fulls[0]
        if not t.is_contiguous() or t.device.type != self.device.type:
            return None
        if t.numel() * t.element_size() != planned.nbytes:
            return None
        return t.view(-1).view(torch.uint8)

    def _buffer(self, nbytes: int) -> Tensor:
        """A pool buffer for packing, once the file's copy out of it (a GPU's side stream) is
        done."""
        buf = self.pool.get(nbytes, self.device)
        copied = self._copying.pop(buf.data_ptr(), None)
        if copied is not None:
            torch.cuda.current_stream(buf.device).wait_event(copied)
        return buf

    @property
    def files_url(self) -> str | None:
        """The file server's URL, announced with every version (None without one)."""
        return self.server.url if self.server is not None else None

    def close(self) -> None:
        if self.files is not None:
            self.files.wait(timeout=60)
        if self.hub is not None:
            self.hub.close()
        if self.server is not None:
            self.server.close()


def build_sender(
    cfg: RunConfig,
    client: redis.Redis | None,
    rank: int,
    device: torch.device | str,
    dtype: torch.dtype,
) -> WeightSender:
    """A learner rank's sender (``client``: rank 0's Redis; other ranks only gather): files in
    ``sync.weights_dir`` announced in Redis, and with ``sync.broadcast`` a hub on
    ``sync.broadcast_port`` announced at ``sync.broadcast_host``. The hub speaks NCCL from a
    CUDA device and gloo otherwise, unless ``sync.backend`` says which. With
    ``sync.serve_files``, the files are also served over HTTP (``sync.files_port``) at that
    address, for workers on hosts that do not share the directory."""
    device = torch.device(device)
    bucket_bytes = int(cfg.sync.bucket_mb * (1 << 20))
    if rank != 0 or client is None:
        return WeightSender(rank, dtype, device, bucket_bytes,
                            lora_publish=cfg.model.lora.publish)  # fmt: skip
    backend = "nccl" if device.type == "cuda" else "gloo"
    if cfg.sync.backend != "auto":
        backend = cfg.sync.backend
    host = cfg.sync.broadcast_host
    announced = discover_host() if host == "auto" else host
    hub = None
    if cfg.sync.broadcast:
        bind = cfg.sync.broadcast_bind or bind_address(announced)
        hub = BroadcastHub(
            cfg.sync.broadcast_port,
            host=bind,
            timeout_s=cfg.sync.timeout_s,
            bucket_bytes=bucket_bytes,
            backend=backend,
            device=device if backend == "nccl" else "cpu",
        )
        log.info("broadcast hub (%s) listening on %s port %d", backend, bind, hub.port)
    sender = WeightSender(rank, dtype, device, bucket_bytes, run_store(cfg, client), hub,
                          announced, cfg.model.lora.publish)  # fmt: skip
    if cfg.sync.serve_files:
        bind = cfg.sync.broadcast_bind or bind_address(announced)
        assert sender.store is not None
        sender.store.dir.mkdir(parents=True, exist_ok=True)
        try:
            sender.server = FileServer(sender.store.dir, announced, bind, cfg.sync.files_port)
        except BaseException:  # (a taken sync.files_port: the hub goes too)
            sender.close()
            raise
        log.info("weight files served over HTTP on %s port %d", bind, sender.server.port)
    return sender


def bind_address(announced: str) -> str:
    """Where the hub listens when ``sync.broadcast_bind`` is unset: the address it is announced
    at (an IP address as is, a name resolved), so it is reachable where the workers look for it
    and nowhere else; every interface only for a name that does not resolve (logged)."""
    try:
        return str(socket.getaddrinfo(announced, None)[0][4][0])
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
