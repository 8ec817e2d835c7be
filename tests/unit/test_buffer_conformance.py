"""The replay-buffer conformance suite: the embedded ring and the Redis ring pass the same tests
(Redis: the real server on 127.0.0.1:6379 under a key prefix of this test's own)."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import Counter

import numpy as np
import pytest

from buffer.base import ReplayBuffer, SampleTimeout, Sampling, importance_weights, priority_of
from buffer.metrics import BufferMetrics
from buffer.records import RecordError
from buffer.ring import MemoryRing
from tests.conftest import make_traj


def _sampling(kw: dict) -> dict:
    """The ring's keyword arguments with the sampler's settings as one ``Sampling``."""
    fields = {f.name for f in dataclasses.fields(Sampling)}
    mine = {k: kw.pop(k) for k in list(kw) if k in fields}
    return {**kw, "sampling": Sampling(**mine)}


@pytest.fixture(params=["memory", "redis"])
def make_buffer(request):
    if request.param == "memory":
        return lambda capacity, seed=0, **kw: MemoryRing(capacity, seed=seed, **_sampling(kw))
    from buffer.redis_ring import RedisRing

    url = request.getfixturevalue("redis_url")
    prefix = request.getfixturevalue("redis_prefix")
    made = [0]

    def make(capacity, seed=0, **kw):
        made[0] += 1
        return RedisRing(f"run{made[0]}", capacity, url=url, key_prefix=prefix, seed=seed,
                         **_sampling(kw))  # fmt: skip

    return make


def test_implements_protocol(make_buffer):
    assert isinstance(make_buffer(4), ReplayBuffer)


def test_fifo_order_and_eviction_at_capacity(make_buffer):
    buf = make_buffer(5)
    assert buf.insert([make_traj(i) for i in range(3)]) == 0
    assert [t.traj_id for t in buf.items()] == ["t0", "t1", "t2"]
    assert buf.insert([make_traj(i) for i in range(3, 8)]) == 3
    assert len(buf) == 5
    assert [t.traj_id for t in buf.items()] == ["t3", "t4", "t5", "t6", "t7"]
    s = buf.stats()
    assert (s.size, s.capacity, s.inserted, s.evicted) == (5, 5, 8, 3)
    # a batch larger than the ring keeps its newest M
    assert buf.insert([make_traj(i) for i in range(8, 20)]) == 12
    assert [t.traj_id for t in buf.items()] == [f"t{i}" for i in range(15, 20)]


def test_records_round_trip_exactly(make_buffer):
    buf = make_buffer(4)
    src = make_traj(3, version=7, rlen=9)
    src.ref_version, src.ref_logprob_sum, src.ref_value = 2, -3.25, 0.5
    buf.insert([src])
    (got,) = buf.items()
    for name in ("prompt_ids", "response_ids", "logprobs"):
        np.testing.assert_array_equal(getattr(got, name), getattr(src, name))
    assert (got.policy_version, got.ref_version, got.ref_logprob_sum, got.ref_value) == (
        7,
        2,
        -3.25,
        0.5,
    )


def test_retried_batch_is_not_stored_twice(make_buffer):
    buf = make_buffer(10)
    batch = [make_traj(i) for i in range(4)]
    buf.insert(batch)
    buf.insert(batch)  # a producer's retry after a dropped reply
    assert [t.traj_id for t in buf.items()] == ["t0", "t1", "t2", "t3"]
    assert buf.stats().inserted == 4


def test_sample_without_replacement_counts_uses(make_buffer):
    buf = make_buffer(10)
    buf.insert([make_traj(i) for i in range(10)])
    batch = buf.sample(10)
    assert sorted(batch.traj_ids) == sorted(f"t{i}" for i in range(10))
    assert all(t.use_count == 1 for t in batch)
    assert all(t.use_count == 1 for t in buf.items())
    np.testing.assert_array_equal(batch.weights, np.ones(10, dtype=np.float32))
    buf.sample(4)
    assert sum(t.use_count for t in buf.items()) == 14
    assert buf.stats().sampled == 14


def test_sample_errors(make_buffer):
    buf = make_buffer(4)
    buf.insert([make_traj(0)])
    with pytest.raises(SampleTimeout, match="cannot sample 2 from a buffer holding 1"):
        buf.sample(2)
    with pytest.raises(ValueError):
        buf.sample(0)
    with pytest.raises(ValueError, match="capacity 4"):
        buf.sample(5)


def test_sampling_is_uniform(make_buffer):
    """Chi-square test over 20 slots (after wrap-around), fixed seed."""
    buf = make_buffer(20, seed=1)
    buf.insert([make_traj(i) for i in range(33)])  # wraps: t13..t32 are held
    counts: Counter[str] = Counter()
    for _ in range(1000):
        counts.update(buf.sample(5).traj_ids)
    held = {t.traj_id for t in buf.items()}
    assert set(counts) == held
    expected = 1000 * 5 / 20
    chi2 = sum((c - expected) ** 2 / expected for c in counts.values())
    # 19 degrees of freedom: P(chi2 > 43.8) = 0.001
    assert chi2 < 43.8, chi2


def test_write_back_updates_only_held_and_keeps_use_counts(make_buffer):
    buf = make_buffer(2)
    a, b, c = make_traj(0), make_traj(1), make_traj(2)
    buf.insert([a, b])
    buf.sample(2)
    a2 = make_traj(0)
    a2.ref_version, a2.ref_value = 3, 1.5
    assert buf.write_back([a2]) == 1
    held = {t.traj_id: t for t in buf.items()}
    assert held["t0"].ref_version == 3 and held["t0"].ref_value == 1.5
    assert held["t0"].use_count == 1
    buf.insert([c])  # evicts t0
    assert buf.write_back([a2]) == 0


def test_bad_records_are_rejected_and_nothing_is_half_written(make_buffer):
    buf = make_buffer(8)
    bad = make_traj(1)
    bad.reward = float("nan")
    with pytest.raises(RecordError, match=r"record 1 \('t1'\).*reward"):
        buf.insert([make_traj(0), bad])
    assert len(buf) == 0
    assert buf.stats().rejected == 1


def test_concurrent_producers_and_consumer(make_buffer):
    buf = make_buffer(10_000)
    errors: list[Exception] = []

    def produce(k: int) -> None:
        try:
            for j in range(0, 100, 5):
                buf.insert([make_traj(k * 1000 + j + i) for i in range(5)])
        except Exception as err:  # pragma: no cover - reported below
            errors.append(err)

    def consume() -> None:
        try:
            for _ in range(100):
                if len(buf) >= 4:
                    assert len(set(buf.sample(4).traj_ids)) == 4
        except Exception as err:  # pragma: no cover
            errors.append(err)

    threads = [threading.Thread(target=produce, args=(k,)) for k in range(4)]
    threads.append(threading.Thread(target=consume))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    ids = [t.traj_id for t in buf.items()]
    assert len(ids) == len(set(ids)) == 400
    for k in range(4):  # each producer's records stay in its own order
        mine = [int(i[1:]) for i in ids if int(i[1:]) // 1000 == k]
        assert mine == sorted(mine)


# -- the rate limiter ---------------------------------------------------------------------------


def test_rate_limiter_caps_samples_per_insert(make_buffer):
    buf = make_buffer(100, samples_per_insert=2.0)
    buf.insert([make_traj(i) for i in range(4)])
    for _ in range(4):
        buf.sample(2)  # 8 = 2 x 4 handed out
    t0 = time.perf_counter()
    with pytest.raises(SampleTimeout, match="rate limited"):
        buf.sample(2, timeout=0.2)
    assert time.perf_counter() - t0 >= 0.18  # it waited for the timeout
    # producers are never blocked by the limiter
    t0 = time.perf_counter()
    buf.insert([make_traj(4)])
    assert time.perf_counter() - t0 < 0.5
    buf.sample(2)  # 10 <= 2 x 5
    assert buf.stats().sampled == 10


def test_rate_limited_sample_waits_for_inserts(make_buffer):
    buf = make_buffer(100, samples_per_insert=1.0, rate_slack=0)
    buf.insert([make_traj(i) for i in range(4)])
    buf.sample(4)
    timer = threading.Timer(0.3, lambda: buf.insert([make_traj(i) for i in range(4, 8)]))
    timer.start()
    batch = buf.sample(4, timeout=10.0)
    timer.join()
    assert len(batch) == 4
    assert batch.wait_s >= 0.2


def test_min_size_to_sample(make_buffer):
    buf = make_buffer(100, min_size_to_sample=6)
    buf.insert([make_traj(i) for i in range(5)])
    with pytest.raises(SampleTimeout, match="need 6"):
        buf.sample(2)
    buf.insert([make_traj(5)])
    assert len(buf.sample(2)) == 2


def test_reuse_is_about_k_under_the_limiter(make_buffer):
    """Steady state: a producer inserting B per round and a learner sampling as fast as the
    limiter lets it (K = 3) -> the mean use count of evicted-or-held trajectories is ~K."""
    buf = make_buffer(64, seed=3, samples_per_insert=3.0)
    total_uses = 0
    for r in range(30):
        buf.insert([make_traj(1000 * r + i) for i in range(16)])
        while True:
            try:
                batch = buf.sample(16)
            except SampleTimeout:
                break
            total_uses += len(batch)
    assert total_uses == 3 * 30 * 16


# -- staleness ------------------------------------------------------------------------------------


def test_staleness_is_reported(make_buffer):
    buf = make_buffer(10)
    buf.insert([make_traj(i, version=i) for i in range(5)])
    buf.set_policy_version(6)
    batch = buf.sample(5)
    lag = {t.traj_id: int(s) for t, s in zip(batch, batch.staleness, strict=True)}
    assert lag == {f"t{i}": 6 - i for i in range(5)}
    assert buf.stats().policy_version == 6


def test_max_staleness_drops_the_oldest_and_skips_stale_ones_inside(make_buffer):
    buf = make_buffer(20, max_staleness=2)
    versions = [0, 1, 2, 5, 1, 5, 6, 6]  # t4 (version 1) sits among fresh ones
    buf.insert([make_traj(i, version=v) for i, v in enumerate(versions)])
    buf.set_policy_version(6)
    seen: set[str] = set()
    for _ in range(20):
        batch = buf.sample(3)
        assert (batch.staleness <= 2).all()
        seen.update(batch.traj_ids)
    assert seen == {"t3", "t5", "t6", "t7"}
    held = [t.traj_id for t in buf.items()]
    assert held[0] == "t3"  # t0..t2 were dropped from the front
    s = buf.stats()
    assert s.size == 5 and s.dropped_stale >= 3
    with pytest.raises(SampleTimeout, match="max_staleness"):
        buf.sample(5)


# -- prioritized replay ---------------------------------------------------------------------------


def test_priorities_shape_sampling_and_weights(make_buffer):
    buf = make_buffer(8, seed=5, prioritized=True, priority_alpha=1.0, priority_beta=1.0)
    buf.insert([make_traj(i) for i in range(8)])
    deltas = [0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 2.0, 4.0]
    assert buf.update_priorities([f"t{i}" for i in range(8)], deltas) == 8
    p = np.array([priority_of(d, 1.0, 1e-3) for d in deltas])
    probs = p / p.sum()
    counts: Counter[str] = Counter()
    n = 3000
    for _ in range(n):
        counts.update(buf.sample(1).traj_ids)
    observed = np.array([counts[f"t{i}"] for i in range(4, 8)])
    expected = probs[4:] * n
    chi2 = float(((observed - expected) ** 2 / expected).sum())
    assert chi2 < 16.3, (observed, expected)  # 3 dof, P = 0.001
    assert sum(counts[f"t{i}"] for i in range(4)) < 10  # near-zero priority
    batch = buf.sample(2)
    got = {t.traj_id: w for t, w in zip(batch, batch.weights, strict=True)}
    want = importance_weights(np.array([probs[int(t[1:])] for t in got]), 8, 1.0)
    np.testing.assert_allclose(list(got.values()), want, rtol=1e-5)
    assert max(batch.weights) == pytest.approx(1.0)


def test_new_trajectories_get_the_max_priority_and_evicted_ones_are_ignored(make_buffer):
    buf = make_buffer(4, seed=2, prioritized=True, priority_alpha=1.0)
    buf.insert([make_traj(i) for i in range(4)])
    buf.update_priorities(["t0", "t1", "t2", "t3"], [0.0, 0.0, 0.0, 9.0])
    buf.insert([make_traj(4)])  # evicts t0, enters at the max priority seen (9)
    assert buf.update_priorities(["t0"], [5.0]) == 0
    counts: Counter[str] = Counter()
    for _ in range(400):
        counts.update(buf.sample(1).traj_ids)
    assert counts["t4"] > 120 and counts["t3"] > 120
    assert counts["t1"] + counts["t2"] < 10


def test_priorities_are_a_no_op_when_uniform(make_buffer):
    buf = make_buffer(4)
    buf.insert([make_traj(0)])
    assert buf.update_priorities(["t0"], [1.0]) == 0
    with pytest.raises(ValueError, match="1 ids but 2 deltas"):
        buf.update_priorities(["t0"], [1.0, 2.0])


# -- metrics --------------------------------------------------------------------------------------


def test_metrics_are_recorded(make_buffer):
    m = BufferMetrics()
    buf = make_buffer(3, metrics=m)
    buf.insert([make_traj(i, version=i) for i in range(5)])
    buf.set_policy_version(4)
    buf.sample(2)
    bad = make_traj(9)
    bad.logprobs[0] = 1.0
    with pytest.raises(RecordError):
        buf.insert([bad])
    r = m.registry

    def val(name, **labels):
        return r.get_sample_value(name, labels)

    assert val("reval_buffer_capacity") == 3
    assert val("reval_buffer_size") == 3
    assert val("reval_buffer_inserts_total") == 5
    assert val("reval_buffer_evictions_total") == 2
    assert val("reval_buffer_samples_total") == 2
    assert val("reval_buffer_rejected_total") == 1
    assert val("reval_buffer_sample_latency_seconds_count") == 1
    assert val("reval_buffer_staleness_count") == 2
    assert val("reval_buffer_staleness_bucket", le="2.0") == 2  # lags are 0..2
    assert val("reval_buffer_reuse_count_bucket", le="1.0") == 2


def test_reset_empties_the_run(make_buffer):
    buf = make_buffer(4, prioritized=True)
    buf.insert([make_traj(i) for i in range(6)])
    buf.sample(2)
    buf.reset()
    assert len(buf) == 0 and buf.items() == []
    assert buf.stats() == type(buf.stats())(size=0, capacity=4, inserted=0, evicted=0, sampled=0)
    buf.insert([make_traj(7)])
    assert buf.sample(1).traj_ids == ["t7"]


def test_prefetcher_hands_out_batches_drawn_ahead(make_buffer):
    from buffer.prefetch import Prefetcher

    buf = make_buffer(64, samples_per_insert=1.0)
    buf.insert([make_traj(i) for i in range(16)])
    with Prefetcher(buf, 8, depth=2, workers=2, poll_s=0.05) as pf:
        got = [pf.get(timeout=10) for _ in range(2)]  # the limiter allows 16 = 2 batches
        assert all(len(set(b.traj_ids)) == 8 for b in got)
        with pytest.raises(SampleTimeout, match="prefetching"):
            pf.get(timeout=0.3)  # rate limited: nothing more until producers insert
        buf.insert([make_traj(i) for i in range(16, 24)])
        assert len(pf.get(timeout=10)) == 8
    assert buf.stats().sampled == 24


def test_prefetcher_reports_a_broken_buffer():
    from buffer.prefetch import Prefetcher

    class Broken(MemoryRing):
        def sample(self, batch_size, timeout=0.0):
            raise RuntimeError("disk on fire")

    with Prefetcher(Broken(4), 2, workers=1) as pf, pytest.raises(RuntimeError, match="fire"):
        pf.get(timeout=5)


# -- take: fresh batches and whole groups (GRPO's on-policy consumption) -------------------------


def _grouped(first: int, sizes: list[int], version: int = 0) -> list:
    """Trajectories t{first}... in groups of the given sizes (group ids g{first}-{k})."""
    out, i = [], first
    for k, size in enumerate(sizes):
        for _ in range(size):
            t = make_traj(i, version=version)
            t.group_id = f"g{first}-{k}"
            out.append(t)
            i += 1
    return out


def test_take_hands_out_the_newest_unused_once(make_buffer):
    buf = make_buffer(32)
    buf.insert(_grouped(0, [4, 4]))
    buf.insert(_grouped(8, [4, 4]))
    got = buf.take(6)
    assert [t.traj_id for t in got] == ["t15", "t14", "t13", "t12", "t11", "t10"]
    assert all(t.use_count == 1 for t in got)
    nxt = buf.take(6)
    assert [t.traj_id for t in nxt] == ["t9", "t8", "t7", "t6", "t5", "t4"]
    with pytest.raises(SampleTimeout, match="fresh"):
        buf.take(6)
    assert buf.stats().sampled == 12
    assert sorted(t.use_count for t in buf.items()) == [0] * 4 + [1] * 12


def test_take_whole_groups_never_splits_one(make_buffer):
    buf = make_buffer(64)
    buf.insert(_grouped(0, [4, 3, 4]))  # an uneven group among them
    buf.insert(_grouped(11, [4, 4]))
    sizes = Counter(t.group_id for t in buf.items())
    batches = [buf.take(8, whole_groups=True) for _ in range(2)]
    for batch in batches:
        in_batch = Counter(t.group_id for t in batch)
        assert all(in_batch[g] == sizes[g] for g in in_batch), in_batch
    # Newest groups first; the 4 + 3 of the first insert make 7: the gap of 1 is smaller than
    # any group, so the batch goes out short rather than waiting.
    assert batches[0].traj_ids == [f"t{i}" for i in range(18, 10, -1)]
    assert batches[1].traj_ids == [f"t{i}" for i in range(10, 3, -1)]
    with pytest.raises(SampleTimeout):
        buf.take(8, whole_groups=True)  # 4 left: a gap of 4 could hold a group, so it waits
    assert buf.take(4, whole_groups=True).traj_ids == ["t3", "t2", "t1", "t0"]
    assert buf.stats().sampled == 19 and {t.use_count for t in buf.items()} == {1}


def test_take_skips_a_group_cut_by_eviction_and_used_records(make_buffer):
    buf = make_buffer(10)
    buf.insert(_grouped(0, [4, 4, 4]))  # capacity 10: t0, t1 evicted, g0-0 is incomplete
    with pytest.raises(SampleTimeout):
        buf.take(12, whole_groups=True)
    assert buf.take(8, whole_groups=True).traj_ids == [f"t{i}" for i in range(11, 3, -1)]
    with pytest.raises(SampleTimeout):
        buf.take(2, whole_groups=True)  # only the cut group's t2, t3 are left
    assert buf.take(2).traj_ids == ["t3", "t2"]  # (not whole groups: any fresh record)


def test_take_hands_out_what_no_take_did_sampled_or_not(make_buffer):
    """A uniform sample does not use up the fresh schedule: ``take`` hands out every record no
    ``take`` handed out before (so a round's records all go into its fresh updates), counting
    the use on top of the sample's."""
    buf = make_buffer(16, seed=3)
    buf.insert(_grouped(0, [4, 4]))
    sampled = {t.traj_id for t in buf.sample(3)}
    fresh = buf.take(8)
    assert sorted(fresh.traj_ids) == sorted(f"t{i}" for i in range(8))
    assert {t.traj_id: t.use_count for t in fresh} == {
        f"t{i}": 2 if f"t{i}" in sampled else 1 for i in range(8)
    }
    with pytest.raises(SampleTimeout, match="fresh"):
        buf.take(1)
    uses = sorted(t.use_count for t in buf.items())
    assert uses == [1] * 5 + [2] * 3
    assert (buf.stats().sampled, buf.stats().taken) == (11, 8)
    buf.sample(8)  # taken records are still sampled uniformly
    assert (buf.stats().sampled, buf.stats().taken) == (19, 8)


def test_take_oldest_first_goes_in_insert_order(make_buffer):
    buf = make_buffer(32)
    buf.insert(_grouped(0, [4, 4]))
    buf.insert(_grouped(8, [4, 4]))
    assert buf.take(6, oldest_first=True).traj_ids == [f"t{i}" for i in range(6)]
    assert buf.take(6, oldest_first=True).traj_ids == [f"t{i}" for i in range(6, 12)]
    got = buf.take(4, whole_groups=True, oldest_first=True)
    assert got.traj_ids == [f"t{i}" for i in range(12, 16)]  # a whole group, in order


def test_take_waits_for_an_insert(make_buffer):
    buf = make_buffer(16)
    buf.insert(_grouped(0, [4]))
    producer = make_buffer  # (the same run for the Redis ring: a second client)
    del producer
    threading.Timer(0.3, lambda: buf.insert(_grouped(4, [4]))).start()
    t0 = time.monotonic()
    got = buf.take(8, timeout=5.0, whole_groups=True)
    assert len(got) == 8 and time.monotonic() - t0 >= 0.2


def test_take_respects_max_staleness(make_buffer):
    buf = make_buffer(16, max_staleness=1)
    buf.insert(_grouped(0, [4], version=0))
    buf.insert(_grouped(4, [4], version=3))
    buf.set_policy_version(3)
    assert buf.take(4, whole_groups=True).traj_ids == ["t7", "t6", "t5", "t4"]
    with pytest.raises(SampleTimeout):
        buf.take(4, whole_groups=True)


def test_evictions_of_never_used_trajectories_are_counted(make_buffer):
    """``evicted_unused`` counts the evicted trajectories no sample or take handed out (the
    ring wrapping included), and a batch longer than M counts its own records it evicts."""
    metrics = BufferMetrics()
    buf = make_buffer(6, metrics=metrics)
    buf.insert([make_traj(i) for i in range(6)])
    used = {t.traj_id for t in buf.take(2)} | {t.traj_id for t in buf.sample(3)}
    buf.insert([make_traj(i) for i in range(6, 10)])  # evicts t0..t3
    unused = sum(f"t{i}" not in used for i in range(4))
    s = buf.stats()
    assert (s.evicted, s.evicted_unused) == (4, unused)
    assert metrics.evicted_unused._value.get() == unused
    used |= {t.traj_id for t in buf.sample(6)}  # every held one, across the wrap
    buf.insert([make_traj(i) for i in range(10, 16)])  # evicts t4..t9: all used
    assert buf.stats().evicted_unused == unused
    buf.insert([make_traj(i) for i in range(16, 26)])  # t10..t15 unused, t16..t19 its own
    s = buf.stats()
    assert (s.evicted, s.evicted_unused) == (20, unused + 10)
    assert s.unused_share == pytest.approx((unused + 10) / 20)
    assert s.reuse == pytest.approx(s.sampled / 26)


def test_quarantine_empties_records_by_id_for_good(make_buffer):
    buf = make_buffer(8, seed=5)
    buf.insert([make_traj(i) for i in range(8)])
    bad = buf.sample(3).traj_ids
    assert buf.quarantine([*bad, "never-held"], "the update raised") == 3
    assert buf.stats().rejected == 3
    held = [t.traj_id for t in buf.items()]
    assert sorted(held) == sorted(f"t{i}" for i in range(8) if f"t{i}" not in bad)
    seen = {tid for _ in range(20) for tid in buf.sample(5).traj_ids}
    assert seen == set(held)  # every usable record still comes out, the quarantined never
    assert not set(buf.take(5, oldest_first=True).traj_ids) & set(bad)
    with pytest.raises(SampleTimeout):
        buf.sample(6)  # 5 usable of the 8 held
