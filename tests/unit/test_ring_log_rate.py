"""Damaged records are quarantined one by one but logged a few lines at a time (issue 38: 10,000
bad records wrote a line each): the first of a reason at once, then one a minute with the count
held back; a new reason at once. What is quarantined and counted stays as it was."""

from __future__ import annotations

import logging
import math

import msgpack
import pytest

from buffer.record_codec import encode
from buffer.records import RecordLimits
from buffer.redis_chunks import bad_record_key, bad_records
from buffer.redis_ring import RedisRing
from tests.conftest import make_traj

VOCAB = 50
LIMITS = RecordLimits(vocab_size=VOCAB, reward_bound=100.0)


def _bad_token(i: int):
    t = make_traj(i)
    t.response_ids = t.response_ids.copy()
    t.response_ids[0] = VOCAB + i  # one past the embedding (and each a different id)
    return t


@pytest.fixture
def now(monkeypatch, caplog):
    """The lines' clock (the one RateLog of the buffer's damaged records, fresh for the test)."""
    t = [1000.0]
    monkeypatch.setattr(bad_records, "clock", lambda: t[0])
    monkeypatch.setattr(bad_records, "_seen", {})
    caplog.set_level(logging.WARNING, logger="reval.buffer")
    return t


def _lines(caplog, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if text in r.getMessage()]


def _ring(redis_url: str, prefix: str, capacity: int = 256, **kw) -> RedisRing:
    return RedisRing("r", capacity, url=redis_url, key_prefix=prefix, seed=1, **kw)


def test_the_key_is_the_reason_without_what_names_the_record():
    a = bad_record_key("quarantined", "record 3 ('t3'): token id 53 >= the vocabulary size 50")
    b = bad_record_key("quarantined", "record 9 ('t9'): token id 71 >= the vocabulary size 50")
    assert a == b
    assert a != bad_record_key("quarantined", "record 3 ('t3'): reward 1e+30 outside [-100, 100]")
    assert a != bad_record_key("rejected", "record 3 ('t3'): token id 53 >= the vocabulary size 50")


def test_a_flood_of_rejected_records_is_a_line_and_a_count(redis_url, redis_prefix, now, caplog):
    ring = _ring(redis_url, redis_prefix, limits=LIMITS)
    got = ring.insert_encoded([encode(make_traj(0))] + [encode(_bad_token(i)) for i in range(200)])
    assert got == (1, 200)  # each one rejected and counted, as before
    lines = _lines(caplog, "rejected malformed record")
    assert len(lines) == 1 and "vocabulary size" in lines[0]
    # Another reason is logged at once.
    assert ring.insert_encoded([encode(make_traj(1, reward=1e30))]) == (0, 1)
    lines = _lines(caplog, "rejected malformed record")
    assert len(lines) == 2 and "reward" in lines[1]
    # A minute on, the next line of the first reason says how many were held back.
    now[0] += 61
    assert ring.insert_encoded([encode(_bad_token(300))]) == (0, 1)
    lines = _lines(caplog, "rejected malformed record")
    assert len(lines) == 3 and "(and 199 more like it since the last line)" in lines[2]
    assert ring.stats().rejected == 202
    ring.close()


def test_a_flood_of_quarantined_fresh_records_is_a_line(redis_url, redis_prefix, now, caplog):
    learner = _ring(redis_url, redis_prefix, limits=LIMITS)
    worker = _ring(redis_url, redis_prefix)  # (a worker does not know the learner's limits)
    worker.insert([make_traj(i) for i in range(3)] + [_bad_token(i) for i in range(100)])
    batch = learner.take(3, timeout=5)  # (the chunk reader's path: every bad one quarantined)
    assert sorted(batch.traj_ids) == ["t0", "t1", "t2"]
    assert learner.stats().rejected == 100
    assert len(_lines(caplog, "quarantined a malformed record")) == 1
    worker.close()
    learner.close()


def test_a_flood_of_quarantined_sampled_records_is_a_line(redis_url, redis_prefix, now, caplog):
    learner = _ring(redis_url, redis_prefix, capacity=64, limits=LIMITS)
    worker = _ring(redis_url, redis_prefix, capacity=64)
    worker.insert([make_traj(i) for i in range(4)] + [_bad_token(i) for i in range(60)])
    batch = learner.sample(4, timeout=5)
    assert all(t.response_ids.max() < VOCAB for t in batch)
    assert learner.stats().rejected >= 2  # (the draws met at least two bad ones)
    assert len(_lines(caplog, "quarantined a malformed record")) == 1
    worker.close()
    learner.close()


def test_write_backs_and_cached_fields_that_fail_are_a_line_each_kind(
    redis_url, redis_prefix, now, caplog
):
    ring = _ring(redis_url, redis_prefix)
    ring.insert([make_traj(i) for i in range(40)])
    for k in range(40):  # (the write-back fields of chunk r:0, written by hand with a NaN)
        ring.client.hset(ring.keys.rec + "0", f"f{k}", msgpack.packb([3, math.nan, 1.0]))
    batch = ring.sample(40, timeout=5)
    assert all(t.ref_version is None for t in batch)  # (not used: computed afresh)
    assert len(_lines(caplog, "ignored malformed reference quantities")) == 1
    for t in batch:
        t.ref_version, t.ref_logprob_sum = 4, math.inf
    assert ring.write_back(list(batch)) == 0
    assert len(_lines(caplog, "did not write back")) == 1
    ring.close()
