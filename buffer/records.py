"""The trajectory record: what generators produce, the buffer keeps and the learner consumes.

Torch-free. Token ids and log-probs are numpy arrays (packed bytes on the wire). The wire form is
msgpack with a schema version; ``decode`` validates everything and raises ``RecordError``.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Sequence
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
_FIELDS = frozenset(_TYPES) | {"v"}


def encode(traj: Trajectory) -> bytes:
    """Validate and pack a record."""
    traj.validate()
    packed: bytes = msgpack.packb(traj.to_wire(), use_bin_type=True)
    return packed


def encode_many(trajs: Sequence[Trajectory]) -> list[bytes]:
    """Validate a batch (array checks vectorized over the batch) and pack each record; the first
    bad record raises RecordError naming its index and id."""
    validate_many(trajs)
    packb = msgpack.packb
    return [packb(t.to_wire(), use_bin_type=True) for t in trajs]


def validate_many(trajs: Sequence[Trajectory]) -> None:
    """``validate`` for a batch, with the array checks done once over the concatenated batch;
    raises RecordError("record i ('id'): ...") for the first bad one."""
    if not trajs:
        return
    try:
        for t in trajs:
            _check_scalars(t)
        ids = np.concatenate([a for t in trajs for a in (t.prompt_ids, t.response_ids)])
        lps = np.concatenate([t.logprobs for t in trajs])
        ok = ids.min() >= 0 and bool(lps.min() > -np.inf) and bool(lps.max() <= 1e-4)
    except (RecordError, ValueError, TypeError, AttributeError):
        ok = False
    if ok:
        return
    for i, t in enumerate(trajs):  # slow path: find the culprit
        try:
            t.validate()
        except RecordError as err:
            raise RecordError(f"record {i} ({t.traj_id!r}): {err}") from None


def _check_scalars(t: Trajectory) -> None:
    """Everything ``validate`` checks except the array contents."""
    p, r, lp = t.prompt_ids, t.response_ids, t.logprobs
    if p.ndim != 1 or r.ndim != 1 or lp.ndim != 1:
        raise RecordError("token and log-prob arrays must be one-dimensional")
    if not p.size or not r.size or lp.size != r.size or p.size + r.size > MAX_TOKENS:
        raise RecordError("bad array sizes")
    if not (
        math.isfinite(t.reward_raw)
        and math.isfinite(t.reward)
        and math.isfinite(t.ref_logprob_sum)
        and math.isfinite(t.ref_value)
    ):
        raise RecordError("non-finite value")
    if t.finish_reason not in _FINISH_REASONS or t.policy_version < 0 or t.use_count < 0:
        raise RecordError("bad finish_reason, policy_version or use_count")


def _array(raw: bytes, dtype: type[np.generic], name: str) -> npt.NDArray[Any]:
    if len(raw) % np.dtype(dtype).itemsize:
        raise RecordError(f"{name}: {len(raw)} bytes is not a whole number of {dtype.__name__}")
    return np.frombuffer(raw, dtype=dtype)  # read-only, zero-copy view of the record's bytes


def _unpack(data: Any, max_bytes: int) -> Trajectory:
    """Unpack and check structure and types; the array contents are not checked yet."""
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
    if version != SCHEMA_VERSION or type(version) is not int:
        raise RecordError(f"unknown schema version {version!r} (this build reads {SCHEMA_VERSION})")
    if len(obj) != len(_FIELDS) or not _FIELDS.issuperset(obj):
        missing = set(_TYPES) - set(obj)
        if missing:
            raise RecordError(f"missing fields: {sorted(missing)}")
        raise RecordError(f"unknown fields: {sorted(set(obj) - _FIELDS)}")
    for name, types in _TYPES.items():
        if type(obj[name]) not in types:  # exact types: a bool is not an int here
            raise RecordError(f"{name}: wrong type {type(obj[name]).__name__}")
    t = Trajectory.__new__(Trajectory)  # the fields are checked: skip __post_init__'s copies
    t.prompt_ids = _array(obj["prompt_ids"], np.int32, "prompt_ids")
    t.response_ids = _array(obj["response_ids"], np.int32, "response_ids")
    t.logprobs = _array(obj["logprobs"], np.float32, "logprobs")
    t.reward_raw = float(obj["reward_raw"])
    t.reward = float(obj["reward"])
    t.prompt_id = obj["prompt_id"]
    t.group_id = obj["group_id"]
    t.finish_reason = obj["finish_reason"]
    t.policy_version = obj["policy_version"]
    t.worker_id = obj["worker_id"]
    t.run_id = obj["run_id"]
    t.traj_id = obj["traj_id"]
    t.created_at = float(obj["created_at"])
    t.ref_version = obj["ref_version"]
    t.ref_logprob_sum = float(obj["ref_logprob_sum"])
    t.ref_value = float(obj["ref_value"])
    t.use_count = obj["use_count"]
    return t


def decode(data: bytes, max_bytes: int = 64 << 20) -> Trajectory:
    """Unpack and validate a record; any defect raises RecordError. Its arrays are read-only
    views of ``data``."""
    traj = _unpack(data, max_bytes)
    traj.validate()
    return traj


def decode_many(
    blobs: Sequence[Any], max_bytes: int = 64 << 20
) -> tuple[list[Trajectory], list[tuple[int, RecordError]]]:
    """Decode a batch: (the good records in order, [(index, error)] of the bad ones). The array
    checks run once over the batch; only a batch with a defect pays for per-record checks."""
    good: list[Trajectory] = []
    where: list[int] = []
    bad: list[tuple[int, RecordError]] = []
    for i, b in enumerate(blobs):
        try:
            good.append(_unpack(b, max_bytes))
            where.append(i)
        except RecordError as err:
            bad.append((i, err))
    try:
        validate_many(good)
        return good, bad
    except RecordError:
        pass
    ok = []
    for i, t in zip(where, good, strict=True):
        try:
            t.validate()
            ok.append(t)
        except RecordError as err:
            bad.append((i, err))
    bad.sort(key=lambda x: x[0])
    return ok, bad
