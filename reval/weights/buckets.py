"""Weight transport, the part both halves share: named tensors packed into flat byte buckets.

A sender packs ``model.named_parameters()`` into buckets of about ``bucket_bytes`` (mixed dtypes
in one flat uint8 tensor, each tensor at an aligned offset) with a typed, versioned header; a
receiver unpacks each bucket into views and loads them in place. One collective per bucket, never
one round trip per tensor: the broadcast itself (gloo on CPU, NCCL on GPU) is the learner
service's, over exactly these buckets.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import msgpack
import numpy as np
import torch
from torch import Tensor

HEADER_VERSION = 1
ALIGN = 64  # bytes; keeps every view aligned for any dtype and for vectorized copies
RAMP = 8
ALONE = 4
"""A tensor of at least ``bucket_bytes / ALONE`` is a bucket of its own (``plan_buckets``)."""
"""The first bucket holds at most ``bucket_bytes / RAMP``, each next one up to twice the one
before, then ``bucket_bytes``: the first broadcast starts once a small bucket is packed, and
packing the rest overlaps it (a 53 MB model in one 64 MB bucket waited for all of it)."""

_DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.float64,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
    )
}


@dataclass(frozen=True)
class TensorMeta:
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    """Byte offset in the bucket."""
    nbytes: int


@dataclass
class Bucket:
    metas: list[TensorMeta]
    data: Tensor
    """Flat uint8 tensor holding every tensor's bytes."""
    version: int = 0
    """Policy version these weights belong to."""

    def header(self) -> bytes:
        """The typed metadata that precedes the data on the wire (msgpack)."""
        return self.header_for(int(self.data.numel()))

    def header_for(self, nbytes: int) -> bytes:
        return msgpack.packb(
            {
                "v": HEADER_VERSION,
                "version": self.version,
                "nbytes": nbytes,
                "tensors": [
                    [m.name, m.dtype, list(m.shape), m.offset, m.nbytes] for m in self.metas
                ],
            }
        )

    @staticmethod
    def metas_from_header(raw: bytes) -> tuple[int, int, list[TensorMeta]]:
        """(policy version, data bytes, tensor metas) from a header; ValueError if malformed."""
        try:
            obj = msgpack.unpackb(raw)
            if obj["v"] != HEADER_VERSION:
                raise ValueError(f"weight header version {obj['v']!r} != {HEADER_VERSION}")
            metas = [TensorMeta(n, d, tuple(s), o, b) for n, d, s, o, b in obj["tensors"]]
            version, nbytes = int(obj["version"]), int(obj["nbytes"])
        except (KeyError, TypeError, ValueError, msgpack.UnpackException) as err:
            raise ValueError(f"malformed weight header: {err}") from None
        for m in metas:
            if m.dtype not in _DTYPES or m.offset < 0 or m.offset + m.nbytes > nbytes:
                raise ValueError(f"malformed weight header entry for {m.name!r}")
        return version, nbytes, metas


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass
class PlannedBucket:
    """A bucket's layout before its bytes are copied (``pack`` copies them): its header can be
    sent ahead, and packing the next bucket can overlap sending this one."""

    metas: list[TensorMeta]
    tensors: list[Tensor]
    nbytes: int
    version: int = 0

    def header(self) -> bytes:
        return Bucket(self.metas, torch.empty(0, dtype=torch.uint8), self.version).header_for(
            self.nbytes
        )

    @property
    def device(self) -> torch.device:
        return self.tensors[0].device

    def pack(self, out: Tensor | None = None) -> Bucket:
        """Copy the tensors' bytes into ``out`` (a uint8 buffer of at least ``nbytes`` on their
        device, e.g. from a ``BufferPool``) or into new memory."""
        if out is None:
            data = torch.empty(self.nbytes, dtype=torch.uint8, device=self.device)
        else:
            if out.dtype != torch.uint8 or out.numel() < self.nbytes:
                raise ValueError(f"pack: need a uint8 buffer of {self.nbytes} bytes")
            data = out[: self.nbytes]
        for t, m in zip(self.tensors, self.metas, strict=True):
            copy_bytes(data[m.offset : m.offset + m.nbytes], t.detach().contiguous())
        return Bucket(self.metas, data, self.version)


def copy_bytes(dst: Tensor, src: Tensor) -> None:
    """``dst`` (uint8) = ``src``'s bytes. Between CPU tensors a plain single-threaded memcpy
    (numpy's, without the GIL), never torch's intra-op threads: the copy runs beside the
    broadcast's socket threads, and OpenMP threads that spin after each parallel copy took the
    cores they need (a 53 MB sync over gloo at 2 torch threads cost twice the CPU)."""
    raw = src.view(-1).view(torch.uint8)
    if dst.device.type == "cpu" and raw.device.type == "cpu":
        np.copyto(dst.numpy(), raw.numpy())
    else:
        dst.copy_(raw)


def _indexed(device: torch.device) -> torch.device:
    """``cuda`` as the ``cuda:N`` it means (tensors report ``cuda:N``; ``cuda != cuda:0``)."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


class BufferPool:
    """Reusable flat byte buffers for packing and receiving buckets. Fresh memory costs a page
    fault per page on first touch: on the development VM a copy into fresh memory ran at 1.2 GB/s
    and into reused memory at 12.6 GB/s, slower and faster than gloo over loopback (3.5 GB/s).
    Holds at most ``keep`` idle buffers (per pool); thread-safe."""

    def __init__(self, keep: int = 8) -> None:
        import threading

        self.keep = keep
        self._free: list[Tensor] = []
        self._lock = threading.Lock()
        self.allocated = 0
        """Buffers this pool had to allocate (a steady state allocates none)."""

    def get(self, nbytes: int, device: torch.device | str = "cpu") -> Tensor:
        """A uint8 buffer of at least ``nbytes`` on ``device`` (the smallest idle one that fits,
        else a new one); slice it to ``nbytes``, give the whole buffer back with ``put``."""
        device = _indexed(torch.device(device))
        with self._lock:
            fits = [
                (int(b.numel()), i)
                for i, b in enumerate(self._free)
                if b.numel() >= nbytes and _indexed(b.device) == device
            ]
            if fits:
                return self._free.pop(min(fits)[1])
            self.allocated += 1
        return torch.empty(nbytes, dtype=torch.uint8, device=device)

    def put(self, buf: Tensor) -> None:
        with self._lock:
            self._free.append(buf)
            if len(self._free) > self.keep:
                self._free.sort(key=lambda b: int(b.numel()))
                self._free.pop(0)  # keep the large ones: they fit any bucket

    def __len__(self) -> int:
        return len(self._free)


def plan_buckets(
    named_tensors: Iterable[tuple[str, Tensor]], bucket_bytes: int, version: int = 0
) -> list[PlannedBucket]:
    """Group tensors into buckets of at most ``bucket_bytes`` (the first ones smaller, ``RAMP``),
    without copying anything yet. A tensor of at least ``bucket_bytes / ALONE`` gets a bucket
    of its own: a sender can send it from its own memory, without packing it."""
    if bucket_bytes <= 0:
        raise ValueError("bucket_bytes must be > 0")
    out: list[PlannedBucket] = []
    pending: list[tuple[str, Tensor]] = []
    size = 0

    def flush() -> None:
        metas, offset = [], 0
        for name, t in pending:
            metas.append(
                TensorMeta(
                    name,
                    str(t.dtype).removeprefix("torch."),
                    tuple(t.shape),
                    offset,
                    t.numel() * t.element_size(),
                )
            )
            offset = _align(offset + metas[-1].nbytes)
        out.append(PlannedBucket(metas, [t for _, t in pending], offset, version))

    limit = max(ALIGN, bucket_bytes // RAMP)
    for name, tensor in named_tensors:
        if str(tensor.dtype).removeprefix("torch.") not in _DTYPES:
            raise TypeError(f"{name}: dtype {tensor.dtype} cannot be packed")
        nbytes = _align(tensor.numel() * tensor.element_size())
        alone = nbytes * ALONE >= bucket_bytes
        if pending and (alone or size + nbytes > limit):
            flush()
            pending, size = [], 0
            limit = min(2 * limit, bucket_bytes)
        pending.append((name, tensor))
        size += nbytes
        if alone:
            flush()
            pending, size = [], 0
            limit = min(2 * limit, bucket_bytes)
    if pending:
        flush()
    return out


def pack_buckets(
    named_tensors: Iterable[tuple[str, Tensor]], bucket_bytes: int, version: int = 0
) -> Iterator[Bucket]:
    """Group tensors into buckets of at most ``bucket_bytes`` (a larger tensor gets its own)."""
    for planned in plan_buckets(named_tensors, bucket_bytes, version):
        yield planned.pack()


def unpack_bucket(bucket: Bucket) -> list[tuple[str, Tensor]]:
    """Views into the bucket's data, one per tensor (no copy)."""
    out = []
    for m in bucket.metas:
        raw = bucket.data[m.offset : m.offset + m.nbytes]
        out.append((m.name, raw.view(_DTYPES[m.dtype]).view(m.shape)))
    return out
