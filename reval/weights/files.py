"""The file transport and the announcement: versions as safetensors files in a shared directory,
announced in the run's Redis hash (``reval.redis.weights_key``).

The hash (``WeightStore``):

- ``version``, ``time``, ``lineage``: the newest version the learner published (a broadcast's
  members get it at once), its time, and the learner's id (``lineage``: a resumed learner starts
  a new one, and its versions may be lower than the last learner's);
- ``broadcast``: ``backend://host:port/secret`` of the learner's hub, when it broadcasts;
- ``files_url``: with ``sync.serve_files``, the learner's file server
  (``reval/weights/http_files.py``), where workers that do not share its disk fetch the files;
- ``base``: with ``model.lora.publish = "adapter"``, the lineage's base weights
  (``{dir}/base-{lineage}.safetensors``, written before its first version is announced): every
  version then holds only the adapters, applied to that base;
- ``path``, ``file_version``, ``file_time``: the newest version written to a file. The file is
  written in the background (``FileWriter``): it may lag ``version``, never by more than the
  versions published while the previous file was written (the learner skips a version's file
  rather than wait for the disk). A new lineage starts without a file: its first one follows.

Files are ``{dir}/v{version:08d}.safetensors``, written to a temporary name and renamed (a reader
never sees half a file); the last ``keep`` stay on disk so that a slow reader keeps its file.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import struct
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor

from reval.config import RunConfig
from reval.paths import free_space, last_line
from reval.ratelog import RateLog
from reval.redis import weights_key
from reval.retry import retry_redis
from reval.weights.buckets import TensorMeta, copy_bytes

log = logging.getLogger("reval.weights")

UNREADABLE: tuple[type[BaseException], ...] = (OSError, SafetensorError)
"""What reading an announced weights file raises when the file is gone or damaged: safetensors
0.8 raises FileNotFoundError (an OSError) for a missing file, OSError for other I/O faults
(a stale handle on a shared volume), and SafetensorError (not an OSError, not a RuntimeError)
for a file cut short; none of these may end a worker."""

_ST_DTYPES = {
    "float32": "F32", "float16": "F16", "bfloat16": "BF16", "float64": "F64", "int64": "I64",
    "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL",
}  # fmt: skip


class WeightWriteError(OSError):
    """A version's file could not be written (disk full, read-only, gone); nothing of it is
    left, and it was not announced as a file."""


@dataclass(frozen=True)
class Announcement:
    version: int
    """The newest version published."""
    path: Path | None
    """The newest version's file written so far (None: none yet in this lineage)."""
    file_version: int | None
    """The version of ``path``."""
    time: float
    broadcast: str | None = None
    """``backend://host:port/secret`` of the learner's hub when it broadcasts."""
    lineage: str = ""
    """The publishing learner's id (a resumed learner has a new one)."""
    base: Path | None = None
    """A LoRA learner publishing its adapters alone (``model.lora.publish = "adapter"``): the
    file of the base weights its versions apply to, written once per lineage (``write_base``)."""
    files_url: str | None = None
    """``http://host:port/secret/`` of the learner's file server (``sync.serve_files``,
    ``reval/weights/http_files.py``): where a worker that does not see ``path`` or ``base``
    on its own disk fetches them."""


_ANNOUNCE_FILE = """
if redis.call('HGET', KEYS[1], 'lineage') ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'path', ARGV[2], 'file_version', ARGV[3], 'file_time', ARGV[4])
return 1
"""


class WeightStore:
    """The announcement in Redis and the files on disk (the learner's sender writes it; the
    workers' subscribers and ``reval eval --follow`` read it)."""

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
        self._announce_file = client.register_script(_ANNOUNCE_FILE)

    def _retry(self, fn: Any) -> Any:
        return retry_redis(fn, self.retry_s, "weights announcement")

    def announce(
        self, version: int, lineage: str, broadcast: str | None, first: bool,
        base: Path | None = None, files_url: str | None = None,
    ) -> None:  # fmt: skip
        """Announce ``version`` of ``lineage`` (``first``: the lineage's first, which drops the
        previous lineage's file, base and hub from the hash; ``base``: its base file, named in
        every announce of the lineage; ``files_url``: its file server's, likewise)."""
        mapping: dict[str, Any] = {"version": version, "time": time.time(), "lineage": lineage}
        if broadcast:
            mapping["broadcast"] = broadcast
        if base is not None:
            mapping["base"] = str(base)
        if files_url:
            mapping["files_url"] = files_url

        def run() -> None:
            pipe = self.client.pipeline(transaction=True)
            gone = ["path", "file_version", "file_time", "base"] if first else []
            if not broadcast:  # (a learner restarted without a hub: no stale address)
                gone.append("broadcast")
            if not files_url:  # (nor of a file server)
                gone.append("files_url")
            if gone:
                pipe.hdel(self.key, *gone)
            pipe.hset(self.key, mapping=mapping)
            pipe.execute()

        self._retry(run)

    def announce_file(self, version: int, path: Path, lineage: str) -> bool:
        """Announce ``path`` as ``version``'s file, unless another lineage took over the hash."""
        args = [lineage, str(path), version, time.time()]
        return bool(self._retry(lambda: self._announce_file(keys=[self.key], args=args)))

    def path_of(self, version: int) -> Path:
        return self.dir / f"v{version:08d}.safetensors"

    def write(self, named_tensors: Iterable[tuple[str, Tensor]], version: int) -> Path:
        """Write ``version``'s file from tensors in hand (synchronously; not announced)."""
        path = self.path_of(version)
        self._atomic(path, lambda tmp: save_tensors(named_tensors, tmp, version))
        return path

    def write_base(self, named_tensors: Iterable[tuple[str, Tensor]], lineage: str) -> Path:
        """Write a lineage's base weights (LoRA's adapter publish; synchronously, once); the
        other lineages' base files go."""
        path = self.dir / f"base-{lineage}.safetensors"
        self._atomic(path, lambda tmp: save_tensors(named_tensors, tmp, -1))
        for old in self.dir.glob("base-*.safetensors"):
            if old != path:
                old.unlink(missing_ok=True)
        return path

    def _atomic(self, path: Path, write: Any) -> None:
        """``write(tmp)``, then rename to ``path``; a failure leaves nothing and raises
        ``WeightWriteError`` with one line (the file, the free space, the cause)."""
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            write(tmp)
            now = time.time_ns()  # (the file system's own clock may tick only every few ms)
            os.utime(tmp, ns=(now, now))
            os.replace(tmp, path)
        except (OSError, SafetensorError) as err:  # a full disk, a read-only or vanished volume
            with contextlib.suppress(OSError):  # (a vanished directory cannot be unlinked in)
                tmp.unlink(missing_ok=True)
            raise WeightWriteError(
                f"could not write weights {path} ({free_space(self.dir)}): {last_line(err)}"
            ) from None
        self._prune(path)

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
        """The newest announcement, or None before the learner published a version."""
        raw = self._retry(lambda: self.client.hgetall(self.key))
        if not raw or b"version" not in raw:
            return None
        has_file = b"path" in raw and b"file_version" in raw
        return Announcement(
            version=int(raw[b"version"]),
            path=Path(raw[b"path"].decode()) if has_file else None,
            file_version=int(raw[b"file_version"]) if has_file else None,
            time=float(raw.get(b"time", 0.0)),
            broadcast=raw[b"broadcast"].decode() if b"broadcast" in raw else None,
            lineage=raw.get(b"lineage", b"").decode(),
            base=Path(raw[b"base"].decode()) if b"base" in raw else None,
            files_url=raw[b"files_url"].decode() if b"files_url" in raw else None,
        )

    @staticmethod
    def load(path: Path) -> list[tuple[str, Tensor]]:
        """The tensors of a version's file (raises one of ``UNREADABLE`` if it was pruned or
        is damaged)."""
        return list(load_file(str(path)).items())


def run_store(cfg: RunConfig, client: redis.Redis) -> WeightStore:
    """The run's announcement and files (``sync.weights_dir``, default ``{run_dir}/weights``)."""
    weights_dir = cfg.sync.weights_dir or str(cfg.paths.weights)
    return WeightStore(client, cfg.redis.prefix, cfg.name, weights_dir,
                       retry_s=cfg.redis.outage_s)  # fmt: skip


def file_lineage(path: Path) -> str | None:
    """The lineage a version's file was written by (its metadata; None: not said, unreadable)."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
    except UNREADABLE:
        return None
    return meta.get("lineage") or None


def save_tensors(named_tensors: Iterable[tuple[str, Tensor]], path: Path, version: int) -> None:
    """A safetensors file of tensors in hand; tied weights (aliases of one storage, which
    safetensors refuses) get a copy each."""
    tensors: dict[str, Tensor] = {}
    seen: set[int] = set()
    for name, t in named_tensors:
        t = t.detach().to("cpu").contiguous()
        ptr = t.untyped_storage().data_ptr()
        tensors[name] = t.clone() if ptr in seen else t
        seen.add(ptr)
    save_file(tensors, str(path), metadata={"version": str(version)})


def safetensors_header(metas: list[TensorMeta], version: int, lineage: str = "") -> bytes:
    """The 8-byte length and JSON header of a safetensors file whose data are ``metas``' bytes
    back to back, in order (``offset`` is ignored: the file has no gaps); the metadata name the
    version and the lineage (``file_lineage``)."""
    obj: dict[str, Any] = {"__metadata__": {"version": str(version), "lineage": lineage}}
    at = 0
    for m in metas:
        obj[m.name] = {"dtype": _ST_DTYPES[m.dtype], "shape": list(m.shape),
                       "data_offsets": [at, at + m.nbytes]}  # fmt: skip
        at += m.nbytes
    raw = json.dumps(obj, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # (safetensors pads its header to 8 bytes)
    return struct.pack("<Q", len(raw)) + raw


DISK_KEY = "weights-file"
"""The ``RateLog`` key of failed weight-file writes."""
NO_BROADCAST = (
    "the broadcast is off (sync.broadcast): no worker gets a newer version until a file is written"
)
ANNOUNCE_KEY = "weights-announce"
"""The ``RateLog`` key of files written but not announced (Redis away)."""


class FileWriter:
    """Writes versions' files off the learner's critical path: the sender copies each packed
    tensor into a host mirror as it goes (``begin``/``copy``/``commit``; on a GPU an
    asynchronous copy into pinned memory), and a thread writes the mirror to disk and announces
    the file. The mirror (one copy of the weights in the compute dtype, the file's exact data)
    is allocated once and reused. While a file is being written the next version's is skipped
    (``skipped``): the learner never waits for the disk. A failed write (a full disk) is logged
    in one line (the file, the free space, what goes on: the broadcast, or nothing new for the
    workers when ``broadcast`` is off), then at most a line a minute with the count of those
    held back (``reval.ratelog.RateLog``), and one line when a file is written again; the run
    goes on."""

    def __init__(
        self,
        store: WeightStore,
        lineage: str,
        broadcast: bool = True,
        ratelog: RateLog | None = None,
    ) -> None:
        self.store = store
        self.lineage = lineage
        self.broadcast = broadcast
        """Whether the learner broadcasts its versions (a failed file costs the workers that
        read files only); without, no worker gets a newer version until a file is written."""
        self.ratelog = ratelog or RateLog(log)
        """The throttle of the failed-write lines (one a minute, with the count)."""
        self._mirror: Tensor | None = None
        self._busy = threading.Event()
        self._metas: list[TensorMeta] = []
        self._at = 0
        self._version = -1
        self._event: Any = None
        self._stream: Any = None
        """The CUDA stream of the device-to-host copies (created with the first)."""
        self.written = 0
        self.last_written: int | None = None
        """The version of the last file written."""
        self.skipped = 0
        self.errors = 0
        self.last_error: str | None = None
        self._thread: threading.Thread | None = None

    def begin(self, version: int, metas: list[TensorMeta], device: torch.device) -> bool:
        """Start ``version``'s file (False: the previous one is still being written, skip)."""
        if self._busy.is_set():
            self.skipped += 1
            log.debug("weights v%d: no file (v%d's still being written)", version, self._version)
            return False
        total = sum(m.nbytes for m in metas)
        if self._mirror is None or self._mirror.numel() != total:
            pin = device.type == "cuda"
            self._mirror = torch.empty(total, dtype=torch.uint8, pin_memory=pin)
        self._metas, self._at, self._version = metas, 0, version
        self._busy.set()
        return True

    def copy(self, data: Tensor) -> Any:
        """The next tensor's bytes (a uint8 view, in ``metas`` order) into the mirror. From a
        GPU asynchronously on a stream of its own, so the learner's next kernels never queue
        behind the copy: returns the CUDA event after which ``data``'s memory may be written
        again (None from the CPU: copied already)."""
        assert self._mirror is not None
        n = int(data.numel())
        dst = self._mirror[self._at : self._at + n]
        self._at += n
        if not data.is_cuda:
            copy_bytes(dst, data)
            return None
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=data.device)
        self._stream.wait_stream(torch.cuda.current_stream(data.device))  # (data is packed)
        with torch.cuda.stream(self._stream):
            dst.copy_(data, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self._stream)
        data.record_stream(self._stream)  # (a gathered tensor's memory outlives the copy)
        return done

    def commit(self) -> None:
        """Hand the mirror to the writing thread (once the device's copies are done)."""
        assert self._mirror is not None and self._at == self._mirror.numel()
        self._event = None
        if self._stream is not None:  # the device's copies end with this event
            self._event = torch.cuda.Event()
            self._event.record(self._stream)
        self._thread = threading.Thread(target=self._write, name="weights-file", daemon=True)
        self._thread.start()

    def abort(self) -> None:
        """Drop the version begun (its copies did not all happen)."""
        self._busy.clear()

    def _write(self) -> None:
        version, mirror = self._version, self._mirror
        assert mirror is not None
        try:
            if self._event is not None:
                self._event.synchronize()
            header = safetensors_header(self._metas, version, self.lineage)
            path = self.store.path_of(version)

            def write(tmp: Path) -> None:
                with open(tmp, "wb") as f:
                    f.write(header)
                    f.write(memoryview(mirror.numpy()))

            self.store._atomic(path, write)
            self.store.announce_file(version, path, self.lineage)
            self.written += 1
            self.last_written = version
            self.ratelog.recovered(DISK_KEY, "weights v%d: written to %s again", version,
                                   self.store.dir)  # fmt: skip
            self.ratelog.recovered(ANNOUNCE_KEY, "weights v%d: its file is announced again",
                                   version)  # fmt: skip
        except WeightWriteError as err:
            self.errors += 1
            self.last_error = str(err)
            then = "the broadcast goes on" if self.broadcast else NO_BROADCAST
            self.ratelog.error(DISK_KEY, "%s; the workers that read files keep v%s, %s",
                               err, self._announced(), then)  # fmt: skip
        except Exception as err:  # Redis away past its retries: the next file announces
            self.errors += 1
            self.last_error = last_line(err)
            self.ratelog.error(ANNOUNCE_KEY, "weights v%d: the file was not announced: %s",
                               version, last_line(err))  # fmt: skip
        finally:
            self._busy.clear()

    def _announced(self) -> str:
        try:
            ann = self.store.latest()
        except redis.RedisError:
            return "?"
        return "?" if ann is None or ann.file_version is None else str(ann.file_version)

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the file being written (tests, a learner that stops); True when idle."""
        t = self._thread
        if t is not None:
            t.join(timeout)
        return not self._busy.is_set()
