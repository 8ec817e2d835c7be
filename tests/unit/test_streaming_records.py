"""``Trajectory.version_spans`` (schema 4): which weight versions sampled an answer's tokens."""

from __future__ import annotations

import dataclasses

import msgpack
import numpy as np
import pytest

from buffer.record_codec import decode, decode_many, encode, encode_many
from buffer.records import SPANLESS_SCHEMA_VERSION, WIRE_FIELDS, RecordError, Trajectory


def record(spans: list[int] | None = None, version: int = 3) -> Trajectory:
    return Trajectory(
        prompt_ids=np.array([5, 6], np.int32),
        response_ids=np.array([7, 8, 9, 1], np.int32),
        logprobs=np.full(4, -0.5, np.float32),
        reward_raw=1.0,
        reward=1.0,
        policy_version=version,
        version_spans=np.array(spans or [], np.int32),
    )


def test_spans_travel_and_expand_per_token():
    t = record([0, 3, 2, 5])
    back = decode(encode(t))
    assert back.version_spans.tolist() == [0, 3, 2, 5]
    assert back.token_versions().tolist() == [3, 3, 5, 5]
    good, bad = decode_many(encode_many([t, record()]))
    assert not bad and good[0].token_versions().tolist() == [3, 3, 5, 5]
    assert good[1].token_versions().tolist() == [3, 3, 3, 3]  # absent: policy_version


def test_a_schema_3_record_decodes_with_the_spans_absent():
    row = msgpack.unpackb(encode(record()))
    at = WIRE_FIELDS.index("version_spans")
    old = msgpack.packb([SPANLESS_SCHEMA_VERSION, *row[1:at], *row[at + 1 :]], use_bin_type=True)
    back = decode(old)
    assert back.version_spans.size == 0 and back.token_versions().tolist() == [3] * 4
    good, bad = decode_many([old, encode(record([0, 3, 1, 4]))])
    assert not bad and [g.version_spans.size for g in good] == [0, 4]


@pytest.mark.parametrize(
    ("spans", "message"),
    [
        ([0, 3, 2], "odd number"),
        ([1, 3], "must rise from 0"),
        ([0, 3, 0, 4], "must rise from 0"),
        ([0, 3, 4, 4], "below 4"),
        ([0, -1], "versions must be >= 0"),
    ],
)
def test_bad_spans_are_refused_by_name(spans, message):
    t = record(spans)
    with pytest.raises(RecordError, match=message):
        t.validate()
    blob = msgpack.packb([*msgpack.unpackb(encode(record()))], use_bin_type=True)
    row = msgpack.unpackb(blob)
    row[WIRE_FIELDS.index("version_spans")] = np.array(spans, np.int32).tobytes()
    bad_blob = msgpack.packb(row, use_bin_type=True)
    good, bad = decode_many([encode(record()), bad_blob])
    assert len(good) == 1 and [i for i, _ in bad] == [1] and "version_spans" in str(bad[0][1])
    assert dataclasses.replace(t, version_spans=np.zeros(0, np.int32)).validate() is None


def test_the_learner_measures_staleness_per_token():
    from buffer.base import SampledBatch
    from learner.step import token_staleness_mean

    mixed, whole = record([0, 3, 2, 5]), record(version=5)
    batch = SampledBatch([mixed, whole], np.ones(2, np.float32), np.array([4, 2], np.int64))
    # The policy is at 7: tokens lag 4, 4, 2, 2 and 2, 2, 2, 2.
    assert token_staleness_mean(batch) == pytest.approx(20 / 8)
    assert float(batch.staleness.mean()) == 3.0  # per record: the first token's version
