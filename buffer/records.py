"""The trajectory record: what generators produce, the buffer keeps and the learner consumes.

Torch-free. Token ids and log-probs are numpy arrays (packed bytes on the wire). The wire form is
a msgpack array ``[schema version, field, field, ...]`` in the order of ``WIRE_FIELDS`` (an array,
not a map: unpacking is twice as fast, and the record is the hot path of the replay service);
``encode``, ``decode`` and their batch forms are in ``buffer/record_codec.py``: ``decode``
validates everything and raises ``RecordError``.

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

import dataclasses
import linecache
import math
import os
import time
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
    traj_id: str = field(default_factory=lambda: os.urandom(16).hex(), metadata=TEXT)
    """Unique id: 128 random bits as 32 hex digits (``uuid4().hex``'s form; a quarter of its
    cost, which was half a record's construction)."""
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
_COLUMN = {name: i for i, name in enumerate(WIRE_FIELDS)}


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
