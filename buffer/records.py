"""The trajectory record: what generators produce, the buffer keeps and the learner consumes.

Torch-free. Token ids and log-probs are numpy arrays (packed bytes on the wire). The wire form is
a msgpack array ``[schema version, field, field, ...]`` in the order of ``WIRE_FIELDS`` (an array,
not a map: unpacking is twice as fast, and the record is the hot path of the replay service);
``decode`` validates everything and raises ``RecordError``.

Schema history: 1 was a msgpack map (never persisted by a release); 2 is the array form.
"""

from __future__ import annotations

import contextlib
import gc
import math
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import msgpack
import numpy as np
import numpy.typing as npt

SCHEMA_VERSION = 2
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
        """The wire fields by name (``pack_wire`` turns this into the record's bytes)."""
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
WIRE_FIELDS: tuple[str, ...] = ("v", *_TYPES)
"""Position of each field in the wire array."""
# What ``pack_wire`` writes; a record that matches one of these skips the per-field type check.
_CANONICAL = {
    tuple(t[0] for t in (((int,), *_TYPES.values()))),
    tuple(t[-1] if name == "ref_version" else t[0] for name, t in (("v", (int,)), *_TYPES.items())),
}


def pack_wire(wire: dict[str, Any]) -> bytes:
    """The record's bytes from its wire fields by name (missing ones are packed as absent)."""
    out: bytes = msgpack.packb([wire[k] for k in WIRE_FIELDS if k in wire], use_bin_type=True)
    return out


_LOCAL = threading.local()
_GC_LOCK = threading.Lock()
_GC_PAUSES = [0, False]  # [nested pauses, whether the collector was enabled before the first]


@contextlib.contextmanager
def _gc_paused() -> Any:
    """No cyclic garbage collection while a batch of records is built: a sampled batch makes
    thousands of acyclic objects, and in a process with a large heap (a learner) the collections
    they trigger cost 10-20% of decoding. Nested and thread-safe; restores what it found."""
    with _GC_LOCK:
        if _GC_PAUSES[0] == 0:
            _GC_PAUSES[1] = gc.isenabled()
            gc.disable()
        _GC_PAUSES[0] += 1
    try:
        yield
    finally:
        with _GC_LOCK:
            _GC_PAUSES[0] -= 1
            if _GC_PAUSES[0] == 0 and _GC_PAUSES[1]:
                gc.enable()


def _packer() -> msgpack.Packer:
    """A Packer per thread (``packb`` builds a new one per call, a third of a 2 KB record's
    packing time; one Packer must not be shared by threads)."""
    packer = getattr(_LOCAL, "packer", None)
    if packer is None:
        packer = _LOCAL.packer = msgpack.Packer(use_bin_type=True)
    return packer


def _packed(t: Trajectory) -> bytes:
    out: bytes = _packer().pack(_wire_row(t))
    return out


def encode(traj: Trajectory) -> bytes:
    """Validate and pack a record."""
    traj.validate()
    return _packed(traj)


def _wire_row(t: Trajectory) -> list[Any]:
    return [
        SCHEMA_VERSION,
        t.prompt_ids.tobytes(),
        t.response_ids.tobytes(),
        t.logprobs.tobytes(),
        float(t.reward_raw),
        float(t.reward),
        t.prompt_id,
        t.group_id,
        t.finish_reason,
        int(t.policy_version),
        t.worker_id,
        t.run_id,
        t.traj_id,
        float(t.created_at),
        t.ref_version,
        float(t.ref_logprob_sum),
        float(t.ref_value),
        int(t.use_count),
    ]


def encode_many(trajs: Sequence[Trajectory]) -> list[bytes]:
    """Validate a batch (array checks vectorized over the batch) and pack each record; the first
    bad record raises RecordError naming its index and id."""
    validate_many(trajs)
    return [_packed(t) for t in trajs]


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


_I32 = np.dtype(np.int32)
_F32 = np.dtype(np.float32)


def _structure(data: Any, max_bytes: int) -> tuple[Any, ...]:
    """Unpack and check structure and types; the array contents are not checked yet."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise RecordError(f"expected bytes, got {type(data).__name__}")
    if len(data) > max_bytes:
        raise RecordError(f"record of {len(data)} bytes exceeds {max_bytes}")
    try:
        obj = msgpack.unpackb(data, use_list=False, raw=False)
    except Exception as err:  # msgpack raises several unrelated types on garbage
        raise RecordError(f"not msgpack: {err}") from None
    return _check_obj(obj)


def _check_obj(obj: Any) -> tuple[Any, ...]:
    """Check an unpacked record's structure and field types; returns it as a wire tuple."""
    if type(obj) is not tuple:
        if type(obj) is dict and obj.get("v", SCHEMA_VERSION) != SCHEMA_VERSION:
            raise RecordError(
                f"unknown schema version {obj['v']!r} (a map; this build reads {SCHEMA_VERSION})"
            )
        raise RecordError(f"record is not an array (got {type(obj).__name__})")
    version = obj[0] if obj else None
    if version != SCHEMA_VERSION or type(version) is not int:
        raise RecordError(f"unknown schema version {version!r} (this build reads {SCHEMA_VERSION})")
    if len(obj) != len(WIRE_FIELDS):
        raise RecordError(f"{len(obj)} fields, schema {SCHEMA_VERSION} has {len(WIRE_FIELDS)}")
    if tuple(map(type, obj)) not in _CANONICAL:
        for name, value in zip(WIRE_FIELDS[1:], obj[1:], strict=True):
            if type(value) not in _TYPES[name]:  # exact types: a bool is not an int here
                raise RecordError(f"{name}: wrong type {type(value).__name__}")
    p, r, lp = obj[1], obj[2], obj[3]
    if len(p) % 4 or len(r) % 4 or len(lp) % 4:
        for name, raw in (("prompt_ids", p), ("response_ids", r), ("logprobs", lp)):
            if len(raw) % 4:
                raise RecordError(f"{name}: {len(raw)} bytes is not a whole number of 4-byte items")
    return obj


def _fill(t: Trajectory, obj: tuple[Any, ...]) -> Trajectory:
    """Set the scalar fields of ``t`` from a checked wire tuple."""
    (_, _, _, _, rr, rw, pid, gid, fr, pv, wid, rid, tid, ca, rv, rls, rval, uc) = obj
    t.reward_raw = float(rr)
    t.reward = float(rw)
    t.prompt_id = pid
    t.group_id = gid
    t.finish_reason = fr
    t.policy_version = pv
    t.worker_id = wid
    t.run_id = rid
    t.traj_id = tid
    t.created_at = float(ca)
    t.ref_version = rv
    t.ref_logprob_sum = float(rls)
    t.ref_value = float(rval)
    t.use_count = uc
    return t


def _unpack(data: Any, max_bytes: int) -> Trajectory:
    """Unpack and check structure and types; the array contents are not checked yet."""
    obj = _structure(data, max_bytes)
    t = Trajectory.__new__(Trajectory)  # the fields are checked: skip __post_init__'s copies
    # Read-only, zero-copy views of the record's bytes.
    t.prompt_ids = np.frombuffer(obj[1], _I32)
    t.response_ids = np.frombuffer(obj[2], _I32)
    t.logprobs = np.frombuffer(obj[3], _F32)
    return _fill(t, obj)


def _build_checked(objs: Sequence[tuple[Any, ...]]) -> list[Trajectory] | None:
    """Trajectories from wire tuples of the right length and version, validated as a batch,
    column by column: the exact types of every field, the array sizes, finite values, the
    finish reasons and counters, then the token ids and log-probs of the whole batch at once.
    Each record's arrays are read-only views of the batch's joined arrays (one ``frombuffer``
    per batch instead of three per record). None if any record fails a check (the caller then
    finds which, one by one)."""
    if not objs:
        return []
    cols: list[Sequence[Any]] = list(zip(*objs, strict=True))
    for i, allowed in enumerate(_COLUMN_TYPES):
        kinds = set(map(type, cols[i]))
        if not kinds <= allowed:
            return None
        if i in _FLOAT_COLUMNS and kinds != _JUST_FLOAT:
            cols[i] = list(map(float, cols[i]))  # an int-valued float arrives as an int
    n_p = np.fromiter(map(len, cols[1]), np.int64, len(objs))
    n_r = np.fromiter(map(len, cols[2]), np.int64, len(objs))
    n_l = np.fromiter(map(len, cols[3]), np.int64, len(objs))
    if ((n_p | n_r) & 3).any() or (n_l != n_r).any() or not (n_p.all() and n_r.all()):
        return None
    n_p >>= 2
    n_r >>= 2
    if (n_p + n_r > MAX_TOKENS).any():
        return None
    floats = np.array([cols[4], cols[5], cols[15], cols[16]], dtype=np.float64)
    if not np.isfinite(floats).all() or not set(cols[8]) <= _REASONS:
        return None
    if min(cols[9]) < 0 or min(cols[17]) < 0:
        return None
    pa = np.frombuffer(b"".join(cols[1]), _I32)
    ra = np.frombuffer(b"".join(cols[2]), _I32)
    la = np.frombuffer(b"".join(cols[3]), _F32)
    if pa.min() < 0 or ra.min() < 0 or not (la.min() > -np.inf and la.max() <= 1e-4):
        return None  # (NaN fails both comparisons)
    p_at = [0, *np.cumsum(n_p).tolist()]
    r_at = [0, *np.cumsum(n_r).tolist()]
    new = Trajectory.__new__
    out: list[Trajectory] = []
    append = out.append
    for k, (rr, rw, pid, gid, fr, pv, wid, rid, tid, ca, rv, rls, rval, uc) in enumerate(
        zip(*cols[4:], strict=True)
    ):
        t = new(Trajectory)
        t.prompt_ids = pa[p_at[k] : p_at[k + 1]]
        r0, r1 = r_at[k], r_at[k + 1]
        t.response_ids = ra[r0:r1]
        t.logprobs = la[r0:r1]
        t.reward_raw = rr
        t.reward = rw
        t.prompt_id = pid
        t.group_id = gid
        t.finish_reason = fr
        t.policy_version = pv
        t.worker_id = wid
        t.run_id = rid
        t.traj_id = tid
        t.created_at = ca
        t.ref_version = rv
        t.ref_logprob_sum = rls
        t.ref_value = rval
        t.use_count = uc
        append(t)
    return out


_REASONS = frozenset(_FINISH_REASONS)
# The wire columns that may hold an int or a float (rewards, created_at, reference quantities):
# their values become floats.
_FLOAT_COLUMNS = frozenset(i for i, name in enumerate(WIRE_FIELDS) if float in _TYPES.get(name, ()))
_JUST_FLOAT = {float}


def decode(data: bytes, max_bytes: int = 64 << 20) -> Trajectory:
    """Unpack and validate a record; any defect raises RecordError. Its arrays are read-only
    views of ``data``."""
    traj = _unpack(data, max_bytes)
    traj.validate()
    return traj


_COLUMN_TYPES: tuple[frozenset[type], ...] = tuple(frozenset(t) for t in ((int,), *_TYPES.values()))


def decode_many(
    blobs: Sequence[Any], max_bytes: int = 64 << 20
) -> tuple[list[Trajectory], list[tuple[int, RecordError]]]:
    """Decode a batch: (the good records in order, [(index, error)] of the bad ones). Types and
    array contents are checked once per batch, column by column; only a batch with a defect
    pays for per-record checks, which name it."""
    with _gc_paused():
        return _decode_many(blobs, max_bytes)


def _decode_many(
    blobs: Sequence[Any], max_bytes: int
) -> tuple[list[Trajectory], list[tuple[int, RecordError]]]:
    objs: list[tuple[Any, ...]] = []
    where: list[int] = []
    bad: list[tuple[int, RecordError]] = []
    unpackb, n_fields = msgpack.unpackb, len(WIRE_FIELDS)
    for i, b in enumerate(blobs):
        try:
            if type(b) is not bytes or len(b) > max_bytes:
                raise RecordError("slow path")
            obj = unpackb(b, use_list=False, raw=False)
            if type(obj) is not tuple or len(obj) != n_fields or obj[0] != SCHEMA_VERSION:
                raise RecordError("slow path")
            objs.append(obj)
            where.append(i)
        except Exception:  # malformed: the per-record path says exactly what is wrong
            try:
                objs.append(_structure(b, max_bytes))
                where.append(i)
            except RecordError as err:
                bad.append((i, err))
    fast = _build_checked(objs)
    if fast is not None:
        return fast, bad
    ok = []
    for i, obj in zip(where, objs, strict=True):
        try:
            obj = _check_obj(obj)
            t = Trajectory.__new__(Trajectory)
            t.prompt_ids = np.frombuffer(obj[1], _I32)
            t.response_ids = np.frombuffer(obj[2], _I32)
            t.logprobs = np.frombuffer(obj[3], _F32)
            _fill(t, obj)
            t.validate()
            ok.append(t)
        except RecordError as err:
            bad.append((i, err))
    bad.sort(key=lambda x: x[0])
    return ok, bad
