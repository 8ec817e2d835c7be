"""Records to bytes and back: ``encode`` and ``decode`` of one record, and their batch forms
(``encode_many``, ``validate_many``, ``decode_many``) for the hot path of the replay service.

The record, its wire schema and the per-record functions generated from it are in
``buffer/records.py``; this module derives its per-column checks from the same declaration
(``WIRE_KINDS``). ``decode`` validates everything and raises ``RecordError``; ``decode_many``
checks a whole batch column by column and pays for per-record checks only when a record in it
is bad. Schema-2 and schema-3 records still decode (``_upgrade``).
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import threading
from collections.abc import Sequence
from typing import Any

import msgpack
import numpy as np

from buffer.records import (
    _COLUMN,
    MAX_TOKENS,
    NO_LIMITS,
    OLD_SCHEMA_VERSION,
    SCHEMA_VERSION,
    SPANLESS_SCHEMA_VERSION,
    WIRE_FIELDS,
    WIRE_KINDS,
    RecordError,
    RecordLimits,
    Trajectory,
    _batch_rows,
    _check_mask,
    _check_spans,
    _from_wire,
    _scalars_ok,
    _wire_row,
)

# -- per-column checks, derived from the declaration -------------------------------------------

_FIELDS = tuple(WIRE_KINDS.items())
_TYPES: dict[str, tuple[type, ...]] = {name: kind.types for name, kind in _FIELDS}
# What ``pack_wire`` writes; a record that matches one of these skips the per-field type check.
_CANONICAL = frozenset(itertools.product((int,), *(kind.written for _, kind in _FIELDS)))
# Per wire column (0 is the version): the exact types it may hold, and which columns get which
# kind's checks in a batch.
_COLUMN_TYPES: tuple[frozenset[type], ...] = tuple(
    frozenset(t) for t in ((int,), *(kind.types for _, kind in _FIELDS))
)
_FLOAT_COLUMNS = frozenset(i for i, (_, k) in enumerate(_FIELDS, 1) if k.is_float)
_FINITE_COLUMNS = tuple(i for i, (_, k) in enumerate(_FIELDS, 1) if k.finite)
_COUNT_COLUMNS = tuple(i for i, (_, k) in enumerate(_FIELDS, 1) if k.non_negative)
_CHOICE_COLUMNS = tuple(
    (i, frozenset(k.choices)) for i, (_, k) in enumerate(_FIELDS, 1) if k.choices
)
_ARRAY_COLUMNS: tuple[tuple[int, str, np.dtype[Any]], ...] = tuple(
    (i, name, k.dtype) for i, (name, k) in enumerate(_FIELDS, 1) if k.dtype is not None
)
_ARRAY_NAMES = tuple(name for _, name, _ in _ARRAY_COLUMNS)
_ITEMSIZES = np.array([[dtype.itemsize] for _, _, dtype in _ARRAY_COLUMNS], dtype=np.int64)
_JUST_FLOAT = {float}


# -- encode and decode --------------------------------------------------------------------------

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


def encode(traj: Trajectory) -> bytes:
    """Validate and pack a record."""
    traj.validate()
    out: bytes = _packer().pack(_wire_row(traj))
    return out


def encode_many(trajs: Sequence[Trajectory]) -> list[bytes]:
    """Validate a batch (array checks vectorized over the batch) and pack each record; the first
    bad record raises RecordError naming its index and id."""
    validate_many(trajs)
    pack, row = _packer().pack, _wire_row
    return [pack(row(t)) for t in trajs]


def validate_many(trajs: Sequence[Trajectory], limits: RecordLimits = NO_LIMITS) -> None:
    """``validate`` (against ``limits`` too) for a batch, with the array checks done once over
    the concatenated batch; raises RecordError("record i ('id'): ...") for the first bad one."""
    if not trajs:
        return
    try:
        for t in trajs:
            _check_scalars(t)
            _check_mask(t.action_mask, t.response_ids.size)
            _check_spans(t.version_spans, t.response_ids.size)
        ids = np.concatenate([a for t in trajs for a in (t.prompt_ids, t.response_ids)])
        lps = np.concatenate([t.logprobs for t in trajs])
        ok = ids.min() >= 0 and bool(lps.min() > -np.inf) and bool(lps.max() <= 1e-4)
        if ok and limits is not NO_LIMITS:
            rewards = [[t.reward for t in trajs], [t.reward_raw for t in trajs]]
            lengths = np.fromiter((t.prompt_ids.size + t.response_ids.size for t in trajs),
                                  np.int64, len(trajs))  # fmt: skip
            ok = limits.batch_ok(ids, ids[:0], rewards, lengths)
    except (RecordError, ValueError, TypeError, AttributeError):
        ok = False
    if ok:
        return
    for i, t in enumerate(trajs):  # slow path: find the culprit
        try:
            t.validate(limits)
        except RecordError as err:
            raise RecordError(f"record {i} ({t.traj_id!r}): {err}") from None


def _check_scalars(t: Trajectory) -> None:
    """Everything ``validate`` checks except the array contents."""
    p, r, lp = t.prompt_ids, t.response_ids, t.logprobs
    if p.ndim != 1 or r.ndim != 1 or lp.ndim != 1:
        raise RecordError("token and log-prob arrays must be one-dimensional")
    if not p.size or not r.size or lp.size != r.size or p.size + r.size > MAX_TOKENS:
        raise RecordError("bad array sizes")
    if not _scalars_ok(t):
        raise RecordError("bad scalar field")


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
    if type(version) is int:
        lacks = {OLD_SCHEMA_VERSION: 2, SPANLESS_SCHEMA_VERSION: 1}.get(version)  # (its fields)
        if lacks is not None and len(obj) == len(WIRE_FIELDS) - lacks:
            return _check_obj(_upgrade(obj))
    if version != SCHEMA_VERSION or type(version) is not int:
        raise RecordError(f"unknown schema version {version!r} (this build reads {SCHEMA_VERSION})")
    if len(obj) != len(WIRE_FIELDS):
        raise RecordError(f"{len(obj)} fields, schema {SCHEMA_VERSION} has {len(WIRE_FIELDS)}")
    if tuple(map(type, obj)) not in _CANONICAL:
        for name, value in zip(WIRE_FIELDS[1:], obj[1:], strict=True):
            if type(value) not in _TYPES[name]:  # exact types: a bool is not an int here
                raise RecordError(f"{name}: wrong type {type(value).__name__}")
    for i, name, dtype in _ARRAY_COLUMNS:
        if len(obj[i]) % dtype.itemsize:
            raise RecordError(
                f"{name}: {len(obj[i])} bytes is not a whole number of {dtype.itemsize}-byte items"
            )
    return obj


_MASK_COLUMN = WIRE_FIELDS.index("action_mask")
_SPANS_COLUMN = WIRE_FIELDS.index("version_spans")


def _upgrade(obj: tuple[Any, ...]) -> tuple[Any, ...]:
    """A schema-2 or schema-3 wire tuple as the current schema: the fields it lacks (the
    action mask, the version spans) absent (empty)."""
    if obj[0] == OLD_SCHEMA_VERSION:
        obj = (SPANLESS_SCHEMA_VERSION, *obj[1:_MASK_COLUMN], b"", *obj[_MASK_COLUMN:])
    return (SCHEMA_VERSION, *obj[1:_SPANS_COLUMN], b"", *obj[_SPANS_COLUMN:])


def _build_checked(
    objs: Sequence[tuple[Any, ...]], limits: RecordLimits = NO_LIMITS
) -> list[Trajectory] | None:
    """Trajectories from wire tuples of the right length and version, validated as a batch,
    column by column: the exact types of every field, the array sizes, each kind's checks
    (finite values, counters, choices), then the token ids and log-probs of the whole batch at
    once, and the consumer's ``limits``. Each record's arrays are read-only views of the batch's
    joined arrays (one ``frombuffer`` per column instead of one per record and field). None if
    any record fails a check (the caller then finds which, one by one)."""
    if not objs:
        return []
    cols: list[Sequence[Any]] = list(zip(*objs, strict=True))
    for i, allowed in enumerate(_COLUMN_TYPES):
        kinds = set(map(type, cols[i]))
        if not kinds <= allowed:
            return None
        if i in _FLOAT_COLUMNS and kinds != _JUST_FLOAT:
            cols[i] = list(map(float, cols[i]))  # an int-valued float arrives as an int
    # The item counts of every array field, one row per field (one pass over the byte strings).
    n_bytes = np.fromiter(
        map(len, itertools.chain.from_iterable(cols[i] for i, _, _ in _ARRAY_COLUMNS)),
        np.int64,
        len(objs) * len(_ARRAY_COLUMNS),
    ).reshape(len(_ARRAY_COLUMNS), -1)
    if (n_bytes % _ITEMSIZES).any():
        return None
    sizes = dict(zip(_ARRAY_NAMES, n_bytes // _ITEMSIZES, strict=True))
    n_p, n_r = sizes["prompt_ids"], sizes["response_ids"]
    if (sizes["logprobs"] != n_r).any() or not (n_p.all() and n_r.all()):
        return None
    if (n_p + n_r > MAX_TOKENS).any():
        return None
    n_m = sizes["action_mask"]
    if ((n_m != 0) & (n_m != n_r)).any():
        return None
    if _FINITE_COLUMNS:
        floats = np.array([cols[i] for i in _FINITE_COLUMNS], dtype=np.float64)
        if not np.isfinite(floats).all():
            return None
    for i in _COUNT_COLUMNS:
        if min(cols[i]) < 0:
            return None
    for i, choices in _CHOICE_COLUMNS:
        if not set(cols[i]) <= choices:
            return None
    joined = {name: np.frombuffer(b"".join(cols[i]), dtype) for i, name, dtype in _ARRAY_COLUMNS}
    pa, ra, la = joined["prompt_ids"], joined["response_ids"], joined["logprobs"]
    if pa.min() < 0 or ra.min() < 0 or not (la.min() > -np.inf and la.max() <= 1e-4):
        return None  # (NaN fails both comparisons)
    ma = joined["action_mask"]
    if ma.size:
        firsts = np.cumsum(n_m)[n_m > 0] - n_m[n_m > 0]  # where each present mask starts
        if ma.max() > 1 or not ma[firsts].all():
            return None
    n_s = sizes["version_spans"]
    if n_s.any():  # (rare: answers that spanned an in-flight update; checked one by one)
        try:
            for obj, n in zip(objs, n_r.tolist(), strict=True):
                if obj[_SPANS_COLUMN]:
                    _check_spans(np.frombuffer(obj[_SPANS_COLUMN], np.int32), n)
        except RecordError:
            return None
    if limits is not NO_LIMITS and not limits.batch_ok(
        pa, ra, [cols[_COLUMN["reward"]], cols[_COLUMN["reward_raw"]]], n_p + n_r
    ):
        return None
    # One list of offsets per array field; the log-probs share the response's (equal sizes).
    r_at = [0, *np.cumsum(n_r).tolist()]
    at = {"response_ids": r_at, "logprobs": r_at}
    offsets = [at.get(name) or [0, *np.cumsum(sizes[name]).tolist()] for name in _ARRAY_NAMES]
    return _batch_rows(cols, [joined[name] for name in _ARRAY_NAMES], offsets)


def decode(data: bytes, max_bytes: int = 64 << 20, limits: RecordLimits = NO_LIMITS) -> Trajectory:
    """Unpack and validate a record (against ``limits`` too); any defect raises RecordError.
    Its arrays are read-only views of ``data``."""
    traj = _from_wire(_structure(data, max_bytes))
    traj.validate(limits)
    return traj


def decode_many(
    blobs: Sequence[Any], max_bytes: int = 64 << 20, limits: RecordLimits = NO_LIMITS
) -> tuple[list[Trajectory], list[tuple[int, RecordError]]]:
    """Decode a batch: (the good records in order, [(index, error)] of the bad ones). Types and
    array contents (and the consumer's ``limits``) are checked once per batch, column by
    column; only a batch with a defect pays for per-record checks, which name it."""
    with _gc_paused():
        return _decode_many(blobs, max_bytes, limits)


def _decode_many(
    blobs: Sequence[Any], max_bytes: int, limits: RecordLimits
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
    fast = _build_checked(objs, limits)
    if fast is not None:
        return fast, bad
    ok = []
    for i, obj in zip(where, objs, strict=True):
        try:
            t = _from_wire(_check_obj(obj))
            t.validate(limits)
            ok.append(t)
        except RecordError as err:
            bad.append((i, err))
    bad.sort(key=lambda x: x[0])
    return ok, bad
