"""Records that decode but would break the learner, and a ring whose bookkeeping was damaged
by hand (issue 19): each is quarantined with its reason and counted, or fails with one named
error that says how to repair it; nothing bad reaches an update."""

from __future__ import annotations

import math

import msgpack
import numpy as np
import pytest

from buffer.base import SampleTimeout
from buffer.metrics import BufferMetrics
from buffer.record_codec import decode_many, encode
from buffer.records import RecordError, RecordLimits
from buffer.redis_ring import RedisRing, RingCorrupt
from buffer.ring import MemoryRing
from tests.conftest import make_traj

VOCAB = 50
LIMITS = RecordLimits(vocab_size=VOCAB, reward_bound=100.0)


def _ring(redis_url: str, prefix: str, name: str = "f", capacity: int = 8, **kw) -> RedisRing:
    return RedisRing(name, capacity, url=redis_url, key_prefix=prefix, seed=1, **kw)


def _bad_token(i: int):
    t = make_traj(i)
    t.response_ids = t.response_ids.copy()
    t.response_ids[0] = VOCAB  # one past the embedding: IndexError inside the update
    return t


def _huge_reward(i: int):
    return make_traj(i, reward=1e30)  # finite, passes the wire checks


def test_limits_name_what_is_wrong():
    good, bad = decode_many(
        [encode(make_traj(0)), encode(_bad_token(1)), encode(_huge_reward(2))], limits=LIMITS
    )
    assert [t.traj_id for t in good] == ["t0"]
    assert [i for i, _ in bad] == [1, 2]
    assert "token id 50 >= the vocabulary size 50" in str(bad[0][1])
    assert "reward" in str(bad[1][1]) and "1e+30" in str(bad[1][1])
    # Without limits the same bytes decode: the wire format alone cannot know the vocabulary.
    assert len(decode_many([encode(_bad_token(1))])[0]) == 1


@pytest.mark.parametrize("make_bad", [_bad_token, _huge_reward], ids=["token", "reward"])
def test_sample_quarantines_records_beyond_the_limits(redis_url, redis_prefix, make_bad):
    m = BufferMetrics()
    ring = _ring(redis_url, redis_prefix, metrics=m, limits=LIMITS)
    producer = _ring(redis_url, redis_prefix)  # a worker: it does not know the learner's limits
    producer.insert([make_traj(i) for i in range(6)] + [make_bad(6), make_bad(7)])
    batch = ring.sample(6, timeout=5)
    assert sorted(batch.traj_ids) == [f"t{i}" for i in range(6)]
    assert ring.stats().rejected == 2
    assert m.registry.get_sample_value("reval_buffer_rejected_total") == 2
    with pytest.raises(SampleTimeout):
        ring.sample(7)  # only the 6 good ones are held now
    producer.close()
    ring.close()


def test_take_quarantines_a_bad_fresh_record_and_hands_out_the_rest(redis_url, redis_prefix):
    ring = _ring(redis_url, redis_prefix, limits=LIMITS)
    ring.insert([make_traj(i) for i in range(3)])  # (the learner's ring writes without limits)
    _ring(redis_url, redis_prefix).insert([make_traj(3), _bad_token(4), make_traj(5)])
    batch = ring.take(5, timeout=5)  # before: "malformed records among the fresh ones", forever
    assert sorted(batch.traj_ids) == ["t0", "t1", "t2", "t3", "t5"]
    assert ring.stats().rejected == 1
    ring.close()


def test_memory_ring_refuses_records_beyond_the_limits():
    ring = MemoryRing(8, limits=LIMITS)
    with pytest.raises(RecordError, match="vocabulary size"):
        ring.insert([make_traj(0), _bad_token(1)])
    assert len(ring) == 0 and ring.stats().rejected == 1


def test_a_nan_in_the_cached_reference_field_is_ignored_and_rewritten(redis_url, redis_prefix):
    ring = _ring(redis_url, redis_prefix)
    ring.insert([make_traj(i) for i in range(4)])
    # The learner's write-back field of t1 (chunk r:0, offset 1), written by hand with a NaN.
    ring.client.hset(ring.keys.rec + "0", "f1", msgpack.packb([3, math.nan, 1.0]))
    batch = ring.sample(4, timeout=5)
    t1 = next(t for t in batch if t.traj_id == "t1")
    assert t1.ref_version is None  # the cache is not used: computed afresh by the learner
    assert math.isfinite(t1.ref_logprob_sum)
    # A non-finite value that reaches the write-back is skipped, not raised (was a RecordError).
    t1.ref_version, t1.ref_logprob_sum = 4, math.inf
    t0 = next(t for t in batch if t.traj_id == "t0")
    t0.ref_version, t0.ref_logprob_sum, t0.ref_value = 4, -3.0, 0.5
    assert ring.write_back([t0, t1]) == 1
    ring.close()


@pytest.mark.parametrize(
    ("field", "value", "what"),
    [("head", "abc", "head=abc"), ("tail", "99", "tail=99"), ("head", "3.5", "head=3.5")],
)
def test_corrupt_meta_is_one_named_error_that_says_how_to_repair(
    redis_url, redis_prefix, field, value, what
):
    ring = _ring(redis_url, redis_prefix)
    ring.insert([make_traj(i) for i in range(4)])
    ring.client.hset(ring.keys.meta, field, value)
    for call in (lambda: ring.sample(2, timeout=1), lambda: ring.insert([make_traj(9)])):
        with pytest.raises(RingCorrupt, match=what) as err:
            call()
        assert "redis-cli --scan --pattern" in str(err.value)
        assert f"'{redis_prefix}{{f}}:meta'" in str(err.value)  # the ring's keys, not the run's
    with pytest.raises(RingCorrupt):
        ring.take(2, timeout=1)  # (reads the window without a script)
    ring.client.hset(ring.keys.meta, field, "0")  # (lets the fixture's clean-up be plain)
    ring.close()


def test_a_garbage_chunks_member_is_the_same_named_error(redis_url, redis_prefix):
    ring = _ring(redis_url, redis_prefix)
    ring.insert([make_traj(i) for i in range(4)])
    ring.client.zadd(ring.keys.chunks, {"garbage": 6})
    other = _ring(redis_url, redis_prefix)  # a learner that reads the chunk list anew
    with pytest.raises(RingCorrupt, match="garbage"):
        other.sample(2, timeout=1)
    with pytest.raises(RingCorrupt, match="garbage"):
        _ring(redis_url, redis_prefix).take(2, timeout=1)
    ring.close()
    other.close()


def test_limits_batch_check_agrees_with_the_per_record_check():
    rng = np.random.default_rng(0)
    for _ in range(200):
        trajs = [make_traj(int(rng.integers(1000))) for _ in range(4)]
        k = int(rng.integers(4))
        if rng.random() < 0.5:
            trajs[k] = _bad_token(k)
        if rng.random() < 0.3:
            trajs[k].reward = float(rng.choice([100.0, 100.5, -101.0, 1e30]))
        good, _ = decode_many([encode(t) for t in trajs], limits=LIMITS)
        expect = []
        for t in trajs:
            try:
                LIMITS.check(t)
                expect.append(t.traj_id)
            except RecordError:
                pass
        assert [t.traj_id for t in good] == expect
