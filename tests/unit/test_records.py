from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from buffer.record_codec import decode, decode_many, encode, encode_many
from buffer.records import (
    SCHEMA_VERSION,
    WIRE_FIELDS,
    WIRE_KINDS,
    RecordError,
    Trajectory,
    WireKind,
    pack_wire,
)
from reval.rewards import transform_rewards
from tests.conftest import make_traj


def test_round_trip_keeps_every_field():
    t = make_traj(3, version=7, reward=0.5)
    t.ref_version, t.ref_logprob_sum, t.ref_value, t.use_count = 2, -3.5, 1.25, 4
    back = decode(encode(t))
    for name in Trajectory.__slots__:
        a, b = getattr(t, name), getattr(back, name)
        if isinstance(a, np.ndarray):
            assert a.dtype == b.dtype and np.array_equal(a, b)
        else:
            assert a == b, name


def _wire(**changes):
    d = make_traj(1).to_wire()
    d.update(changes)
    extra = {k: v for k, v in changes.items() if k not in WIRE_FIELDS}
    return pack_wire(d) if not extra else msgpack.packb([*msgpack.unpackb(pack_wire(d)), 1])


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"v": SCHEMA_VERSION + 1}, "schema version"),
        ({"reward": float("inf")}, "reward"),
        ({"reward_raw": "1"}, "wrong type"),
        ({"policy_version": True}, "wrong type"),
        ({"logprobs": b"\x00" * 5}, "whole number"),
        ({"logprobs": np.zeros(2, np.float32).tobytes()}, "log-probs for"),
        ({"response_ids": b""}, "empty response"),
        ({"finish_reason": "abort"}, "finish_reason"),
        ({"use_count": -1}, "use_count must be >= 0"),
        ({"ref_value": float("nan")}, "ref_value is not finite"),
        ({"extra": 1}, f"{len(WIRE_FIELDS) + 1} fields"),
    ],
)
def test_bad_records_are_rejected_with_a_clear_error(changes, message):
    with pytest.raises(RecordError, match=message):
        decode(_wire(**changes))


def test_missing_field_and_garbage():
    d = make_traj(1).to_wire()
    del d["reward"]
    with pytest.raises(RecordError, match=f"{len(WIRE_FIELDS) - 1} fields"):
        decode(pack_wire(d))
    with pytest.raises(RecordError):
        decode(b"\xc1\xff\x00")
    with pytest.raises(RecordError, match="not an array"):
        decode(msgpack.packb({"v": SCHEMA_VERSION}))
    with pytest.raises(RecordError, match="schema version"):
        decode(msgpack.packb([1, 2]))
    with pytest.raises(RecordError, match="schema version 1"):  # schema 1 was a map
        decode(msgpack.packb({**make_traj(1).to_wire(), "v": 1}))
    with pytest.raises(RecordError, match="exceeds"):
        decode(encode(make_traj(1)), max_bytes=10)


@settings(max_examples=2000, deadline=None)
@given(st.binary(max_size=400))
def test_decoder_never_crashes_on_random_bytes(data):
    with contextlib.suppress(RecordError):
        decode(data)


@settings(max_examples=2000, deadline=None)
@given(
    st.dictionaries(
        st.sampled_from(sorted(make_traj(0).to_wire())),
        st.none()
        | st.integers(-(2**63), 2**64 - 1)
        | st.floats()
        | st.text(max_size=5)
        | st.binary(max_size=12),
        max_size=6,
    )
)
def test_decoder_rejects_random_field_values(changes):
    try:
        t = decode(_wire(**changes))
    except RecordError:
        return
    t.validate()  # whatever decodes is a valid record


def test_reward_transforms():
    r = [1.0, 0.0, 1.0, 1.0, 0.0]
    g = ["a", "a", "a", "a", "b"]
    assert transform_rewards(r, g, "binary") == r
    assert transform_rewards(r, g, "plus_minus") == [1.0, -1.0, 1.0, 1.0, -1.0]
    assert transform_rewards(r, g, "group_mean") == pytest.approx([0.25, -0.75, 0.25, 0.25, 0.0])
    # N = 1: the normalized reward is identically 0
    assert transform_rewards([1.0, 0.0], ["x", "y"], "group_mean") == [0.0, 0.0]
    with pytest.raises(ValueError, match="group ids"):
        transform_rewards([1.0], [], "binary")


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.sampled_from(["ok", "nan", "posinf", "neginf", "positive", "negid", "garbage"]),
        min_size=1,
        max_size=12,
    )
)
def test_batch_codec_finds_exactly_the_bad_records(kinds):
    """encode_many/decode_many check arrays once per batch; a defect anywhere is still found
    and pinned on the right record."""
    blobs, trajs = [], []
    for i, kind in enumerate(kinds):
        t = make_traj(i, rlen=5)
        if kind == "garbage":
            blobs.append(b"\x92\x02")
            continue
        wire = t.to_wire()
        lp = t.logprobs.copy()
        ids = t.response_ids.copy()
        if kind in ("nan", "posinf", "neginf", "positive"):
            lp[2] = {"nan": np.nan, "posinf": np.inf, "neginf": -np.inf, "positive": 0.5}[kind]
        if kind == "negid":
            ids[0] = -3
        wire["logprobs"], wire["response_ids"] = lp.tobytes(), ids.tobytes()
        blobs.append(pack_wire(wire))
        trajs.append(
            Trajectory(
                prompt_ids=t.prompt_ids,
                response_ids=ids,
                logprobs=lp,
                reward_raw=1.0,
                reward=1.0,
                traj_id=t.traj_id,
            )
        )
    good, bad = decode_many(blobs)
    assert [i for i, _ in bad] == [i for i, k in enumerate(kinds) if k != "ok"]
    assert [t.traj_id for t in good] == [f"t{i}" for i, k in enumerate(kinds) if k == "ok"]
    first_bad = next((i for i, t in enumerate(trajs) if kinds[int(t.traj_id[1:])] != "ok"), None)
    if first_bad is None:
        assert [decode(b).traj_id for b in encode_many(trajs)] == [t.traj_id for t in trajs]
    else:
        with pytest.raises(RecordError, match=rf"record {first_bad} "):
            encode_many(trajs)


def test_int_valued_float_fields_decode_as_floats_in_a_batch():
    """Another producer's msgpack may write 1.0 as the int 1: the batch decoder (and the single
    one) still hands out floats, and a batch that mixes both forms decodes the same."""
    floats = ("reward_raw", "reward", "created_at", "ref_logprob_sum", "ref_value")
    as_ints = _wire(**dict.fromkeys(floats, 1))
    as_floats = _wire(**dict.fromkeys(floats, 1.0))
    for blobs in ([as_ints] * 3, [as_floats, as_ints, as_floats]):
        good, bad = decode_many(blobs)
        assert not bad and len(good) == len(blobs)
        for t in good:
            for name in floats:
                value = getattr(t, name)
                assert type(value) is float and value == 1.0, (name, value)
    single = decode(as_ints)
    assert all(type(getattr(single, n)) is float for n in floats)


# -- the one declaration ------------------------------------------------------------------------

# Written by the codec before the fields were declared once (buffer/records.py at 90447cd, the
# hand-written encode): the wire format may not change without a schema bump.
_OLD_CODE_BYTES = {
    "ref_version=4": bytes.fromhex(
        "dc001202c40c0500000011000000ffffff7fc40c2a0000000700000001000000c40c000000bf0000a0bf"
        "00000000cb3ff0000000000000cb3fe8000000000000a3702d37a3672d33a66c656e6774680ca3772d32"
        "a572756e2d39a97472616a2d30303031cb41da49204020000004cbc00c000000000000cb3fc00000000000"
        "0002"
    ),
    "ref_version=None": bytes.fromhex(
        "dc001202c40c0500000011000000ffffff7fc40c2a0000000700000001000000c40c000000bf0000a0bf"
        "00000000cb3ff0000000000000cb3fe8000000000000a3702d37a3672d33a473746f700ca3772d32a572"
        "756e2d39a97472616a2d30303031cb41da492040200000c0cbc00c000000000000cb3fc0000000000000"
        "02"
    ),
}


def _fixture_record(ref_version: int | None) -> Trajectory:
    return Trajectory(
        prompt_ids=np.array([5, 17, 2**31 - 1]),
        response_ids=np.array([42, 7, 1]),
        logprobs=np.array([-0.5, -1.25, 0.0]),
        reward_raw=1.0,
        reward=0.75,
        prompt_id="p-7",
        group_id="g-3",
        finish_reason="length" if ref_version is not None else "stop",
        policy_version=12,
        worker_id="w-2",
        run_id="run-9",
        traj_id="traj-0001",
        created_at=1764000000.5,
        ref_version=ref_version,
        ref_logprob_sum=-3.5,
        ref_value=0.125,
        use_count=2,
    )


def _assert_same(a: Trajectory, b: Trajectory) -> None:
    """Every declared field equal, with the same type (and dtype for arrays)."""
    for f in dataclasses.fields(Trajectory):
        x, y = getattr(a, f.name), getattr(b, f.name)
        assert type(x) is type(y), (f.name, x, y)
        if isinstance(x, np.ndarray):
            assert x.dtype == y.dtype and np.array_equal(x, y), f.name
        else:
            assert x == y, (f.name, x, y)


@pytest.mark.parametrize("ref_version", [4, None])
def test_bytes_of_the_old_codec_are_unchanged(ref_version):
    """The derived codec writes what the hand-written one wrote (schema 2), with only the
    version bumped and the absent action mask (empty bytes) before ``use_count`` (schema 3);
    the schema-2 bytes still decode, with the mask absent (every token an action)."""
    old = _OLD_CODE_BYTES[f"ref_version={ref_version}"]
    t = _fixture_record(ref_version)
    old_row = msgpack.unpackb(old)
    assert old_row[0] == 2
    new = msgpack.packb([SCHEMA_VERSION, *old_row[1:-1], b"", b"", old_row[-1]], use_bin_type=True)
    assert encode(t) == new
    assert encode_many([t, t]) == [new, new]
    assert pack_wire(t.to_wire()) == new
    assert encode(dataclasses.replace(t, reward_raw=1)) == new  # an int still travels as a float
    for blob in (old, new):
        back = decode(blob)
        _assert_same(back, t)
        assert back.action_mask.size == 0
        good, bad = decode_many([blob, blob])
        assert not bad and len(good) == 2
        for b in good:
            _assert_same(b, t)
        assert encode(decode(blob)) == new
    good, bad = decode_many([old, new])  # a batch of both schemas
    assert not bad and len(good) == 2


_DEFAULTS = {
    f.name: f.default
    for f in dataclasses.fields(Trajectory)
    if f.default is not dataclasses.MISSING
}


def _distinct_value(name: str, kind: WireKind, seed: int) -> object:
    """A value for one declared field that differs from its default, from every other field's
    value and from the same field's value in another record (``seed``)."""
    k = 10 * seed + list(WIRE_KINDS).index(name)
    if kind.dtype is not None:
        if kind.dtype == np.uint8:  # the action mask: 0/1 over the 4 response tokens, first 1
            return np.array([1, seed % 2, 1 - seed % 2, 1], dtype=np.uint8)
        if name == "version_spans":  # (start, version) pairs over the 4 response tokens
            return np.array([0, 100 * k, 2 + seed % 2, 100 * k + 1], dtype=np.int32)
        if kind.dtype == np.int32:
            return np.arange(100 * k + 3, 100 * k + 7, dtype=np.int32)
        return -np.linspace(0.5, 2.0, 4, dtype=kind.dtype) - k
    if kind.choices:
        others = [c for c in kind.choices if c != _DEFAULTS.get(name)]
        return others[seed % len(others)]
    if kind.is_float:
        return k + 0.375
    if kind.types == (str,):
        return f"{name}-{seed}"
    if int in kind.types:
        return k + 1
    raise AssertionError(f"no test value for the kind of {name}: add one here")


def _every_field_set(seed: int) -> Trajectory:
    values = {n: _distinct_value(n, kind, seed) for n, kind in WIRE_KINDS.items()}
    t = Trajectory(**values)  # type: ignore[arg-type]
    for name, default in _DEFAULTS.items():
        assert values[name] != default, f"{name}: the test value is the default"
    return t


def test_every_declared_field_travels():
    """Each field of the declaration, set to a value no other field or record has, comes back
    from encode/decode and from encode_many/decode_many: a field declared but not carried (or
    carried into another's place) fails here."""
    assert ("v", *(f.name for f in dataclasses.fields(Trajectory))) == WIRE_FIELDS
    assert set(Trajectory.__slots__) == set(WIRE_KINDS)
    records = [_every_field_set(seed) for seed in range(3)]
    for t in records:
        _assert_same(decode(encode(t)), t)
        assert set(t.to_wire()) == set(WIRE_FIELDS)
    good, bad = decode_many(encode_many(records))
    assert not bad and len(good) == len(records)
    for back, t in zip(good, records, strict=True):
        _assert_same(back, t)
    # The slow path of a batch (one bad record in it) carries every field as well.
    good, bad = decode_many([*encode_many(records), b"\x92\x02"])
    assert [i for i, _ in bad] == [len(records)]
    for back, t in zip(good, records, strict=True):
        _assert_same(back, t)


def _records_module_with(extra: str) -> dict[str, object]:
    """buffer/records.py's namespace, compiled afresh with one more field declared last, with
    buffer/record_codec.py's compiled afresh over it (``encode``, ``decode``, ...)."""
    import sys
    import types

    import buffer.record_codec
    import buffer.records

    source = Path(buffer.records.__file__).read_text()
    anchor = "    use_count: int = field(default=0, metadata=COUNT)\n"
    assert anchor in source
    name = "records_with_extra"
    module = types.ModuleType(name)
    sys.modules[name] = module  # dataclasses look their module up; the codec imports it
    try:
        exec(compile(source.replace(anchor, anchor + extra), name, "exec"), module.__dict__)
        codec = Path(buffer.record_codec.__file__).read_text()
        assert "from buffer.records import" in codec
        codec = codec.replace("from buffer.records import", f"from {name} import")
        namespace = dict(module.__dict__)
        exec(compile(codec, f"{name}_codec", "exec"), namespace)
    finally:
        del sys.modules[name]
    return namespace


def test_a_field_added_to_the_declaration_travels_without_other_edits():
    ns = _records_module_with("    extra: int = field(default=0, metadata=COUNT)\n")
    cls = ns["Trajectory"]
    assert ns["WIRE_FIELDS"][-1] == "extra"
    t = cls(**{n: getattr(_every_field_set(0), n) for n in WIRE_KINDS}, extra=41)
    blob = ns["encode"](t)
    assert msgpack.unpackb(blob)[-1] == 41
    assert ns["decode"](blob).extra == 41
    good, bad = ns["decode_many"](ns["encode_many"]([t, t]))
    assert not bad and [x.extra for x in good] == [41, 41]
    with pytest.raises(ns["RecordError"], match="extra must be >= 0"):
        ns["encode"](cls(**{n: getattr(t, n) for n in WIRE_KINDS}, extra=-1))


def test_a_field_without_a_wire_kind_is_refused():
    """The declaration is the schema: a field that does not say how it travels is an error at
    import, not a field silently left off the wire."""
    with pytest.raises(TypeError, match="wire kind"):
        _records_module_with("    extra: int = 0\n")
