"""Weights from the learner to the generators through a shared directory, announced in Redis.

The learner writes version ``v`` as ``{dir}/v{v:08d}.safetensors`` (written to a temporary name,
then renamed: a reader never sees half a file) and then announces it in the run's Redis hash
``{prefix}{run}:weights`` (``version``, ``path``, ``time``). Rollout workers read the
announcement between generation batches and load a newer version in place. The last ``keep``
versions stay on disk so a slow reader never loses the file under it.

This is the transport every deployment has (one node, or a shared filesystem); the learner
service adds the broadcast over torch.distributed (gloo/NCCL) on top of the same announcement.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis
from safetensors.torch import load_file, save_file
from torch import Tensor

from reval.retry import retry_redis

log = logging.getLogger("reval.weights")


@dataclass(frozen=True)
class Announcement:
    version: int
    path: Path
    time: float
    broadcast: str | None = None
    """``host:port`` of the learner's broadcast hub when it broadcasts (``reval/broadcast.py``)."""


def weights_key(prefix: str, run: str) -> str:
    return f"{prefix}{{{run}}}:weights"


class WeightStore:
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
        save_file(tensors, str(tmp), metadata={"version": str(version)})
        os.replace(tmp, path)
        mapping: dict[str, Any] = {"version": version, "path": str(path), "time": time.time()}
        if broadcast:
            mapping["broadcast"] = broadcast
        self._retry(lambda: self.client.hset(self.key, mapping=mapping))
        for old in sorted(self.dir.glob("v*.safetensors"))[: -self.keep]:
            old.unlink(missing_ok=True)
        return path

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
        """The tensors of an announced version (raises FileNotFoundError if it was pruned)."""
        return list(load_file(str(announcement.path)).items())
