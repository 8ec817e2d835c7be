"""The trajectory record: what generators produce, the buffer keeps and the learner consumes.

Torch-free. Token ids and log-probs are numpy arrays (packed bytes on the wire). The wire form is
msgpack with a schema version; ``decode`` validates everything and raises ``RecordError``.
"""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

import msgpack
import numpy as np
import numpy.typing as npt

SCHEMA_VERSION = 1
MAX_TOKENS = 1 << 20  # a record longer than 1M tokens is certainly corrupt
FinishReason = Literal["stop", "length"]
_FINISH_REASONS = ("stop", "length")

IntArray = npt.NDArray[np.int32]
FloatArray = npt.NDArray[np.float32]


class RecordError(ValueError):
    """A record that is malformed; nothing of it is stored."""


@dataclass(slots=True)
class Trajectory:
    """One (prompt, response) pair with its reward and bookkeeping."""

    prompt_ids: IntArray
    """[P] prompt token ids (no padding)."""
    response_ids: IntArray
    """[T] response token ids, ending with EOS when ``finish_reason == "stop"``."""
    logprobs: FloatArray
    """[T] behaviour log-probs of the generator (temperature applied) for each response token."""
    reward_raw: float
    """Verifier score (0/1)."""
    reward: float
    """Reward after the run's transform (what the loss uses)."""
    prompt_id: str = ""
    """Id of the prompt in its task/dataset."""
    group_id: str = ""
    """Id shared by the N answers to one prompt in one generation batch."""
    finish_reason: FinishReason = "stop"
    """``stop``: ended with EOS; ``length``: truncated at max tokens (terminal, V = 0)."""
    policy_version: int = 0
    """Version of the weights that generated it."""
    worker_id: str = ""
    """Generator that produced it."""
    run_id: str = ""
    """Run it belongs to."""
    traj_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    """Unique id."""
    created_at: float = field(default_factory=time.time)
    """Unix time of creation."""
    ref_version: int | None = None
    """Reference version the cached ``ref_logprob_sum`` and ``ref_value`` belong to."""
    ref_logprob_sum: float = 0.0
    """Cached ``log pi_ref(y | x)`` (valid only for ``ref_version``)."""
    ref_value: float = 0.0
    """Cached ``V_ref(s1)`` (valid only for ``ref_version``)."""
    use_count: int = 0
    """Times the learner has sampled it."""

    def __post_init__(self) -> None:
        self.prompt_ids = np.ascontiguousarray(self.prompt_ids, dtype=np.int32)
        self.response_ids = np.ascontiguousarray(self.response_ids, dtype=np.int32)
        self.logprobs = np.ascontiguousarray(self.logprobs, dtype=np.float32)

    def validate(self) -> None:
        """Raise RecordError if the record cannot be used."""
        if self.prompt_ids.ndim != 1 or self.response_ids.ndim != 1 or self.logprobs.ndim != 1:
            raise RecordError("token and log-prob arrays must be one-dimensional")
        if self.prompt_ids.size == 0:
            raise RecordError("empty prompt")
        if self.response_ids.size == 0:
            raise RecordError("empty response")
        if self.prompt_ids.size + self.response_ids.size > MAX_TOKENS:
            raise RecordError(f"record longer than {MAX_TOKENS} tokens")
        if self.logprobs.size != self.response_ids.size:
            raise RecordError(
                f"{self.logprobs.size} log-probs for {self.response_ids.size} response tokens"
            )
        if (self.prompt_ids < 0).any() or (self.response_ids < 0).any():
            raise RecordError("negative token id")
        if not np.isfinite(self.logprobs).all() or (self.logprobs > 1e-4).any():
            raise RecordError("log-probs must be finite and <= 0")
        for name in ("reward_raw", "reward", "ref_logprob_sum", "ref_value"):
            if not math.isfinite(getattr(self, name)):
                raise RecordError(f"{name} is not finite")
        if self.finish_reason not in _FINISH_REASONS:
            raise RecordError(f"finish_reason must be one of {_FINISH_REASONS}")
        if self.policy_version < 0 or self.use_count < 0:
            raise RecordError("policy_version and use_count must be >= 0")

    # -- wire form ---------------------------------------------------------------------------

    def to_wire(self) -> dict[str, Any]:
        return {
            "v": SCHEMA_VERSION,
            "prompt_ids": self.prompt_ids.tobytes(),
            "response_ids": self.response_ids.tobytes(),
            "logprobs": self.logprobs.tobytes(),
            "reward_raw": float(self.reward_raw),
            "reward": float(self.reward),
            "prompt_id": self.prompt_id,
            "group_id": self.group_id,
            "finish_reason": self.finish_reason,
            "policy_version": int(self.policy_version),
            "worker_id": self.worker_id,
            "run_id": self.run_id,
            "traj_id": self.traj_id,
            "created_at": float(self.created_at),
            "ref_version": self.ref_version,
            "ref_logprob_sum": float(self.ref_logprob_sum),
            "ref_value": float(self.ref_value),
            "use_count": int(self.use_count),
        }


_TYPES: dict[str, tuple[type, ...]] = {
    "prompt_ids": (bytes,),
    "response_ids": (bytes,),
    "logprobs": (bytes,),
    "reward_raw": (float, int),
    "reward": (float, int),
    "prompt_id": (str,),
    "group_id": (str,),
    "finish_reason": (str,),
    "policy_version": (int,),
    "worker_id": (str,),
    "run_id": (str,),
    "traj_id": (str,),
    "created_at": (float, int),
    "ref_version": (int, type(None)),
    "ref_logprob_sum": (float, int),
    "ref_value": (float, int),
    "use_count": (int,),
}


def encode(traj: Trajectory) -> bytes:
    """Validate and pack a record."""
    traj.validate()
    packed: bytes = msgpack.packb(traj.to_wire(), use_bin_type=True)
    return packed


def _array(raw: bytes, dtype: type[np.generic], name: str) -> npt.NDArray[Any]:
    if len(raw) % np.dtype(dtype).itemsize:
        raise RecordError(f"{name}: {len(raw)} bytes is not a whole number of {dtype.__name__}")
    return np.frombuffer(raw, dtype=dtype).copy()


def decode(data: bytes, max_bytes: int = 64 << 20) -> Trajectory:
    """Unpack and validate a record; any defect raises RecordError."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise RecordError(f"expected bytes, got {type(data).__name__}")
    if len(data) > max_bytes:
        raise RecordError(f"record of {len(data)} bytes exceeds {max_bytes}")
    try:
        obj = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as err:  # msgpack raises several unrelated types on garbage
        raise RecordError(f"not msgpack: {err}") from None
    if not isinstance(obj, dict):
        raise RecordError("record is not a map")
    version = obj.get("v")
    if version != SCHEMA_VERSION:
        raise RecordError(f"unknown schema version {version!r} (this build reads {SCHEMA_VERSION})")
    missing = set(_TYPES) - set(obj)
    if missing:
        raise RecordError(f"missing fields: {sorted(missing)}")
    unknown = set(obj) - set(_TYPES) - {"v"}
    if unknown:
        raise RecordError(f"unknown fields: {sorted(unknown)}")
    for name, types in _TYPES.items():
        value = obj[name]
        if isinstance(value, bool) or not isinstance(value, types):
            raise RecordError(f"{name}: wrong type {type(value).__name__}")
    traj = Trajectory(
        prompt_ids=_array(obj["prompt_ids"], np.int32, "prompt_ids"),
        response_ids=_array(obj["response_ids"], np.int32, "response_ids"),
        logprobs=_array(obj["logprobs"], np.float32, "logprobs"),
        reward_raw=float(obj["reward_raw"]),
        reward=float(obj["reward"]),
        prompt_id=obj["prompt_id"],
        group_id=obj["group_id"],
        finish_reason=obj["finish_reason"],
        policy_version=obj["policy_version"],
        worker_id=obj["worker_id"],
        run_id=obj["run_id"],
        traj_id=obj["traj_id"],
        created_at=float(obj["created_at"]),
        ref_version=obj["ref_version"],
        ref_logprob_sum=float(obj["ref_logprob_sum"]),
        ref_value=float(obj["ref_value"]),
        use_count=obj["use_count"],
    )
    traj.validate()
    return traj
