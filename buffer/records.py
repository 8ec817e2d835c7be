"""The trajectory record: what generators produce, the buffer keeps and the learner consumes.

Torch-free. Token ids and log-probs are numpy arrays (packed bytes on the wire). The wire form is
a msgpack array ``[schema version, field, field, ...]`` in the order of ``WIRE_FIELDS`` (an array,
not a map: unpacking is twice as fast, and the record is the hot path of the replay service);
``decode`` validates everything and raises ``RecordError``.

The fields are declared once, in ``Trajectory``: each one's ``metadata`` names its ``WireKind``
(how it travels and which checks it gets). Everything else is derived from that declaration at
import: ``WIRE_FIELDS`` (the wire order is the declaration order), the accepted wire types, the
per-kind checks, and the codec itself. The codec's per-record functions (the wire row of
``encode``, the record of ``decode``, the batch loop of ``decode_many``, the scalar checks of
``encode_many``) are generated as straight-line Python source from the declaration and compiled
once (``_generate``), so they run as fast as hand-written code: no per-field loop per record.
Their source is kept in ``GENERATED_SOURCE`` (and shows in tracebacks). Adding, removing or
reordering a field changes the wire format: bump ``SCHEMA_VERSION`` with it.

Schema history: 1 was a msgpack map (never persisted by a release); 2 is the array form; 3 adds
``action_mask`` (multi-turn episodes); 4 adds ``version_spans`` (answers generated across an
in-flight weight update). Schema-2 and schema-3 records still decode: the fields they lack are
absent (empty: every response token is the model's own, from ``policy_version``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import itertools
import linecache
import math
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType, NoneType
from typing import Any, Literal, NoReturn

import msgpack
import numpy as np
import numpy.typing as npt

SCHEMA_VERSION = 4
OLD_SCHEMA_VERSION = 2
"""The schema before ``action_mask``: read, with the mask absent, never written."""
SPANLESS_SCHEMA_VERSION = 3
"""The schema before ``version_spans``: read, with the spans absent, never written."""
MAX_TOKENS = 1 << 20  # a record longer than 1M tokens is certainly corrupt
FinishReason = Literal["stop", "length"]
_FINISH_REASONS = ("stop", "length")

IntArray = npt.NDArray[np.int32]
FloatArray = npt.NDArray[np.float32]
MaskArray = npt.NDArray[np.uint8]


class RecordError(ValueError):
    """A record that is malformed; nothing of it is stored."""


@dataclass(frozen=True, slots=True)
class RecordLimits:
    """What the consumer will do with a record, beyond what the wire format checks: a record
    that decodes but would crash or derail the learner (a token id past its embedding, a reward
    of 1e30) fails these and is quarantined like any damaged record."""

    vocab_size: int | None = None
    """Token ids must be below this: the rows of the learner's embedding (None: unchecked)."""
    reward_bound: float | None = None
    """``|reward|`` and ``|reward_raw|`` may not exceed this (None: unchecked)."""
    max_tokens: int | None = None
    """Prompt + response tokens may not exceed this: the model's context length (its
    ``max_position_embeddings``; a longer record crashed the update on allocation, None:
    unchecked)."""

    def check(self, t: Trajectory) -> None:
        """Raise RecordError naming the first limit the (otherwise valid) record breaks."""
        most = self.max_tokens
        if most is not None:
            n = int(t.prompt_ids.size) + int(t.response_ids.size)
            if n > most:
                raise RecordError(
                    f"trajectory of {n} tokens ({t.prompt_ids.size} prompt + "
                    f"{t.response_ids.size} response) > the model's context length {most}"
                )
        vocab = self.vocab_size
        if vocab is not None:
            top = max(int(t.prompt_ids.max()), int(t.response_ids.max()))
            if top >= vocab:
                raise RecordError(f"token id {top} >= the vocabulary size {vocab}")
        bound = self.reward_bound
        if bound is not None:
            for name in ("reward", "reward_raw"):
                if abs(getattr(t, name)) > bound:
                    raise RecordError(f"{name} {getattr(t, name)!r} outside [-{bound}, {bound}]")

    def batch_ok(
        self,
        prompt_ids: IntArray,
        response_ids: IntArray,
        rewards: Sequence[Sequence[float]],
        lengths: npt.NDArray[np.int64] | None = None,
    ) -> bool:
        """Whether a whole batch (its joined token arrays, its reward columns, its records'
        prompt + response lengths) is within."""
        most = self.max_tokens
        if most is not None and lengths is not None and lengths.size and lengths.max() > most:
            return False
        vocab = self.vocab_size
        if vocab is not None and (
            (prompt_ids.size and int(prompt_ids.max()) >= vocab)
            or (response_ids.size and int(response_ids.max()) >= vocab)
        ):
            return False
        bound = self.reward_bound
        return bound is None or all(
            not col or float(np.abs(np.asarray(col, dtype=np.float64)).max()) <= bound
            for col in rewards
        )


NO_LIMITS = RecordLimits()


# -- wire kinds ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class WireKind:
    """How one kind of field travels and what is checked of it."""

    types: tuple[type, ...]
    """Exact Python types a decoded value may have (a bool is not an int here)."""
    written: tuple[type, ...]
    """Types ``encode`` writes; a decoded record of only these skips the per-field type check."""
    pack: str = "{}"
    """Python expression of the wire value; ``{}`` stands for the attribute."""
    dtype: np.dtype[Any] | None = None
    """Arrays: item type of the packed bytes."""
    finite: bool = False
    """Must be a finite number."""
    non_negative: bool = False
    """Must be >= 0."""
    choices: tuple[str, ...] = ()
    """If set, the value must be one of these."""

    @property
    def is_float(self) -> bool:
        """Decoded as a float even when the wire holds an int (another producer's 1.0)."""
        return float in self.types


_WIRE = "wire"


def _kind(**spec: Any) -> Mapping[str, WireKind]:
    """Field metadata declaring a wire kind: ``field(metadata=FINITE_FLOAT)``."""
    return MappingProxyType({_WIRE: WireKind(**spec)})


INT32_ARRAY = _kind(types=(bytes,), written=(bytes,), pack="{}.tobytes()", dtype=np.dtype(np.int32))
FLOAT32_ARRAY = _kind(
    types=(bytes,), written=(bytes,), pack="{}.tobytes()", dtype=np.dtype(np.float32)
)
UINT8_ARRAY = _kind(types=(bytes,), written=(bytes,), pack="{}.tobytes()", dtype=np.dtype(np.uint8))
FINITE_FLOAT = _kind(types=(float, int), written=(float,), pack="float({})", finite=True)
FLOAT = _kind(types=(float, int), written=(float,), pack="float({})")
COUNT = _kind(types=(int,), written=(int,), pack="int({})", non_negative=True)
OPTIONAL_INT = _kind(types=(int, NoneType), written=(int, NoneType))
TEXT = _kind(types=(str,), written=(str,))
FINISH = _kind(types=(str,), written=(str,), choices=_FINISH_REASONS)
_NO_MASK: MaskArray = np.zeros(0, dtype=np.uint8)
_NO_MASK.flags.writeable = False  # (the one shared default: never written in place)
_NO_SPANS: IntArray = np.zeros(0, dtype=np.int32)
_NO_SPANS.flags.writeable = False


# -- the record: its one declaration ------------------------------------------------------------


@dataclass(slots=True)
class Trajectory:
    """One (prompt, response) pair with its reward and bookkeeping. The response of a multi-turn
    episode holds the model's turns and the environment's observations between them, told apart
    by ``action_mask``.

    This declaration is the wire schema: every field travels, in this order, as its ``metadata``
    kind says (see the module docstring)."""

    prompt_ids: IntArray = field(metadata=INT32_ARRAY)
    """[P] prompt token ids (no padding)."""
    response_ids: IntArray = field(metadata=INT32_ARRAY)
    """[T] response token ids, ending with EOS when ``finish_reason == "stop"``."""
    logprobs: FloatArray = field(metadata=FLOAT32_ARRAY)
    """[T] behaviour log-probs of the generator (temperature applied) for each response token;
    0 on an environment's token (``action_mask`` 0: it was not sampled)."""
    reward_raw: float = field(metadata=FINITE_FLOAT)
    """Verifier score (0/1)."""
    reward: float = field(metadata=FINITE_FLOAT)
    """Reward after the run's transform (what the loss uses)."""
    prompt_id: str = field(default="", metadata=TEXT)
    """Id of the prompt in its task/dataset."""
    group_id: str = field(default="", metadata=TEXT)
    """Id shared by the N answers to one prompt in one generation batch."""
    finish_reason: FinishReason = field(default="stop", metadata=FINISH)
    """``stop``: ended with EOS; ``length``: truncated at max tokens (terminal, V = 0)."""
    policy_version: int = field(default=0, metadata=COUNT)
    """Version of the weights that generated it."""
    worker_id: str = field(default="", metadata=TEXT)
    """Generator that produced it."""
    run_id: str = field(default="", metadata=TEXT)
    """Run it belongs to."""
    traj_id: str = field(default_factory=lambda: uuid.uuid4().hex, metadata=TEXT)
    """Unique id."""
    created_at: float = field(default_factory=time.time, metadata=FLOAT)
    """Unix time of creation."""
    ref_version: int | None = field(default=None, metadata=OPTIONAL_INT)
    """Reference version the cached ``ref_logprob_sum`` and ``ref_value`` belong to."""
    ref_logprob_sum: float = field(default=0.0, metadata=FINITE_FLOAT)
    """Cached ``log pi_ref(y | x)`` (valid only for ``ref_version``)."""
    ref_value: float = field(default=0.0, metadata=FINITE_FLOAT)
    """Cached ``V_ref(s1)`` (valid only for ``ref_version``)."""
    action_mask: MaskArray = field(default_factory=lambda: _NO_MASK, metadata=UINT8_ARRAY)
    """[T] 1 on a token the model sampled (an action), 0 on an environment's token (an
    observation of a multi-turn episode: context for what follows, not in the loss); or empty
    (absent, a single-turn record): every token is an action. When present the first token is
    an action (an episode starts with the model's turn)."""
    version_spans: IntArray = field(default_factory=lambda: _NO_SPANS, metadata=INT32_ARRAY)
    """Which weight versions sampled the response: ``[start0, version0, start1, version1, ...]``,
    token ``j`` from the version of the last span starting at or before ``j`` (the first starts
    at 0; ``policy_version`` is the first span's version, the oldest). Empty (absent): every
    token from ``policy_version``. Written by the streaming vLLM worker when an answer spanned an
    in-flight weight update (``rollout/streaming.py``); ``token_versions`` expands it."""
    use_count: int = field(default=0, metadata=COUNT)
    """Times the learner has sampled it."""

    def __post_init__(self) -> None:
        _coerce_arrays(self)  # contiguous arrays of each array field's dtype

    def validate(self, limits: RecordLimits = NO_LIMITS) -> None:
        """Raise RecordError if the record cannot be used (``limits``: also by this consumer)."""
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
        _check_mask(self.action_mask, self.response_ids.size)
        _check_spans(self.version_spans, self.response_ids.size)
        if not _scalars_ok(self):
            _raise_scalar_error(self)
        if limits is not NO_LIMITS:
            limits.check(self)

    def token_versions(self) -> npt.NDArray[np.int64]:
        """[T] the weight version that sampled each response token (``version_spans``)."""
        n, spans = self.response_ids.size, self.version_spans
        if not spans.size:
            return np.full(n, self.policy_version, dtype=np.int64)
        starts = np.append(spans[0::2].astype(np.int64), n)
        return np.repeat(spans[1::2].astype(np.int64), np.diff(starts))

    # -- wire form ---------------------------------------------------------------------------

    def to_wire(self) -> dict[str, Any]:
        """The wire fields by name (``pack_wire`` turns this into the record's bytes)."""
        return dict(zip(WIRE_FIELDS, _wire_row(self), strict=True))


_FIELDS: tuple[tuple[str, WireKind], ...] = tuple(
    (f.name, f.metadata[_WIRE]) for f in dataclasses.fields(Trajectory) if _WIRE in f.metadata
)
if len(_FIELDS) != len(dataclasses.fields(Trajectory)):
    raise TypeError("every Trajectory field travels: give each one a wire kind in its metadata")
WIRE_KINDS: Mapping[str, WireKind] = MappingProxyType(dict(_FIELDS))
"""The declared fields with their wire kinds, in wire order."""
WIRE_FIELDS: tuple[str, ...] = ("v", *WIRE_KINDS)
"""Position of each field in the wire array."""
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
_COLUMN = {name: i for i, name in enumerate(WIRE_FIELDS)}
_JUST_FLOAT = {float}


# -- the generated codec ------------------------------------------------------------------------

GENERATED_SOURCE: dict[str, str] = {}
"""Source of each function generated from the declaration, by name (for reading and debugging)."""


def _generate(name: str, lines: list[str], **env: Any) -> Callable[..., Any]:
    """Compile one function from its source lines, with ``env`` as its globals. The source is
    registered with ``linecache`` so tracebacks and debuggers show it."""
    source = "\n".join(lines) + "\n"
    filename = f"<buffer.records generated {name}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    namespace: dict[str, Any] = dict(env)
    exec(compile(source, filename, "exec"), namespace)  # source built only from the declaration
    GENERATED_SOURCE[name] = source
    fn: Callable[..., Any] = namespace[name]
    return fn


def _batch_rows_lines(arrays: list[str], scalars: list[str]) -> list[str]:
    """``_batch_rows``'s source: records from checked columns; each array field is a slice of its
    column's joined array, from ``offsets`` (one list per array field)."""
    lines = [
        "def _batch_rows(cols, joined, offsets):",
        f"    {''.join(f'a_{n}, ' for n in arrays)}= joined",
        f"    {''.join(f'o_{n}, ' for n in arrays)}= offsets",
        "    new, cls = _new, _Trajectory",
        "    out = []",
        "    append = out.append",
        "    for ("
        + "".join(f"s_{n}, e_{n}, " for n in arrays)
        + "".join(f"v_{n}, " for n in scalars)
        + ") in _zip(",
        *(f"        o_{n}, o_{n}[1:]," for n in arrays),
        *(f"        cols[{_COLUMN[n]}]," for n in scalars),
        "    ):",
        "        t = new(cls)",
    ]
    for name, kind in _FIELDS:
        value = f"a_{name}[s_{name}:e_{name}]" if kind.dtype is not None else f"v_{name}"
        lines.append(f"        t.{name} = {value}")
    return [*lines, "        append(t)", "    return out"]


def _generate_codec() -> dict[str, Callable[..., Any]]:
    """The per-record functions, as straight-line code over the declared fields."""
    env: dict[str, Any] = {
        "_new": Trajectory.__new__,
        "_Trajectory": Trajectory,
        "_frombuffer": np.frombuffer,
        "_contiguous": np.ascontiguousarray,
        "_isfinite": math.isfinite,
        "_zip": zip,
    }
    for name, kind in _FIELDS:
        if kind.dtype is not None:
            env[f"_dtype_{name}"] = kind.dtype
        if kind.choices:
            env[f"_choices_{name}"] = kind.choices
    names = [name for name, _ in _FIELDS]
    arrays = [name for name, kind in _FIELDS if kind.dtype is not None]
    scalars = [name for name, kind in _FIELDS if kind.dtype is None]
    out: dict[str, Callable[..., Any]] = {}

    # encode: the wire array of a record.
    row = ", ".join([repr(SCHEMA_VERSION), *(k.pack.format(f"t.{n}") for n, k in _FIELDS)])
    out["_wire_row"] = _generate("_wire_row", ["def _wire_row(t):", f"    return [{row}]"], **env)

    # decode: a record from a checked wire tuple; arrays are read-only views of its bytes, and
    # __post_init__'s copies are skipped (the fields are checked).
    lines = ["def _from_wire(obj):", f"    _, {', '.join(f'v_{n}' for n in names)} = obj"]
    lines.append("    t = _new(_Trajectory)")
    for name, kind in _FIELDS:
        value = f"v_{name}"
        if kind.dtype is not None:
            value = f"_frombuffer({value}, _dtype_{name})"
        elif kind.is_float:
            value = f"float({value})"
        lines.append(f"    t.{name} = {value}")
    lines.append("    return t")
    out["_from_wire"] = _generate("_from_wire", lines, **env)

    # decode_many: records from checked columns (float columns already floats).
    lines = _batch_rows_lines(arrays, scalars)
    out["_batch_rows"] = _generate("_batch_rows", lines, **env)

    # The per-kind scalar checks of one record, as one expression (validate, encode_many).
    checks = []
    for name, kind in _FIELDS:
        if kind.finite:
            checks.append(f"_isfinite(t.{name})")
        if kind.non_negative:
            checks.append(f"t.{name} >= 0")
        if kind.choices:
            checks.append(f"t.{name} in _choices_{name}")
    test = " and ".join(checks) or "True"
    out["_scalars_ok"] = _generate(
        "_scalars_ok", ["def _scalars_ok(t):", f"    return {test}"], **env
    )

    # __post_init__: each array field as a contiguous array of its dtype.
    lines = ["def _coerce_arrays(t):"]
    lines += [f"    t.{n} = _contiguous(t.{n}, dtype=_dtype_{n})" for n in arrays] or ["    pass"]
    out["_coerce_arrays"] = _generate("_coerce_arrays", lines, **env)
    return out


_CODEC = _generate_codec()
_wire_row: Callable[[Trajectory], list[Any]] = _CODEC["_wire_row"]
_from_wire: Callable[[tuple[Any, ...]], Trajectory] = _CODEC["_from_wire"]
_batch_rows: Callable[..., list[Trajectory]] = _CODEC["_batch_rows"]
_scalars_ok: Callable[[Trajectory], bool] = _CODEC["_scalars_ok"]
_coerce_arrays: Callable[[Trajectory], None] = _CODEC["_coerce_arrays"]


def _check_mask(mask: MaskArray, n_response: int) -> None:
    """RecordError unless ``mask`` is absent (empty) or a 0/1 array over the ``n_response``
    response tokens whose first is 1."""
    if mask.ndim != 1:
        raise RecordError("action_mask must be one-dimensional")
    if not mask.size:
        return
    if mask.size != n_response:
        raise RecordError(f"action_mask: {mask.size} entries for {n_response} response tokens")
    if mask.max() > 1:
        raise RecordError("action_mask: values must be 0 or 1")
    if mask[0] != 1:
        raise RecordError("action_mask: the first response token must be the model's (1)")


def _check_spans(spans: IntArray, n_response: int) -> None:
    """RecordError unless ``spans`` is absent (empty) or (start, version) pairs whose starts
    rise from 0 and stay below ``n_response``, with versions >= 0."""
    if spans.ndim != 1:
        raise RecordError("version_spans must be one-dimensional")
    if not spans.size:
        return
    if spans.size % 2:
        raise RecordError("version_spans: an odd number of entries (pairs of start, version)")
    starts = spans[0::2]
    if starts[0] != 0 or (np.diff(starts) <= 0).any() or starts[-1] >= n_response:
        raise RecordError(
            f"version_spans: starts {starts.tolist()} must rise from 0 below {n_response}"
        )
    if (spans[1::2] < 0).any():
        raise RecordError("version_spans: versions must be >= 0")


def _raise_scalar_error(t: Trajectory) -> NoReturn:
    """Name the first scalar field that fails its kind's checks (the slow path of validate)."""
    for name, kind in _FIELDS:
        value = getattr(t, name)
        if kind.finite and not math.isfinite(value):
            raise RecordError(f"{name} is not finite")
        if kind.non_negative and value < 0:
            raise RecordError(f"{name} must be >= 0")
        if kind.choices and value not in kind.choices:
            raise RecordError(f"{name} must be one of {kind.choices}")
    raise AssertionError("_scalars_ok and _raise_scalar_error disagree")  # pragma: no cover


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


def validate_many(trajs: Sequence[Trajectory]) -> None:
    """``validate`` for a batch, with the array checks done once over the concatenated batch;
    raises RecordError("record i ('id'): ...") for the first bad one."""
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
