from __future__ import annotations

import contextlib

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from buffer.records import (
    SCHEMA_VERSION,
    WIRE_FIELDS,
    RecordError,
    Trajectory,
    decode,
    encode,
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
        ({"extra": 1}, "19 fields"),
    ],
)
def test_bad_records_are_rejected_with_a_clear_error(changes, message):
    with pytest.raises(RecordError, match=message):
        decode(_wire(**changes))


def test_missing_field_and_garbage():
    d = make_traj(1).to_wire()
    del d["reward"]
    with pytest.raises(RecordError, match="17 fields"):
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
    from buffer.records import decode_many, encode_many

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
    from buffer.records import decode_many

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
