"""The replay-buffer conformance suite: every backend passes it (memory now; Redis joins)."""

from __future__ import annotations

import threading
from collections import Counter

import pytest

from buffer.base import ReplayBuffer
from buffer.records import RecordError
from buffer.ring import MemoryRing
from tests.conftest import make_traj

BACKENDS = {"memory": lambda capacity, seed=0: MemoryRing(capacity, seed=seed)}


@pytest.fixture(params=sorted(BACKENDS))
def make_buffer(request):
    return BACKENDS[request.param]


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


def test_sample_without_replacement_counts_uses(make_buffer):
    buf = make_buffer(10)
    buf.insert([make_traj(i) for i in range(10)])
    batch = buf.sample(10)
    assert sorted(t.traj_id for t in batch) == sorted(f"t{i}" for i in range(10))
    assert all(t.use_count == 1 for t in buf.items())
    buf.sample(4)
    assert sum(t.use_count for t in buf.items()) == 14
    assert buf.stats().sampled == 14


def test_sample_errors(make_buffer):
    buf = make_buffer(4)
    buf.insert([make_traj(0)])
    with pytest.raises(ValueError, match="cannot sample 2"):
        buf.sample(2)
    with pytest.raises(ValueError):
        buf.sample(0)


def test_sampling_is_uniform(make_buffer):
    """Chi-square test over 20 slots (after wrap-around), fixed seed."""
    buf = make_buffer(20, seed=1)
    buf.insert([make_traj(i) for i in range(33)])  # wraps: t13..t32 are held
    counts: Counter[str] = Counter()
    for _ in range(2000):
        counts.update(t.traj_id for t in buf.sample(5))
    held = {t.traj_id for t in buf.items()}
    assert set(counts) == held
    expected = 2000 * 5 / 20
    chi2 = sum((c - expected) ** 2 / expected for c in counts.values())
    # 19 degrees of freedom: P(chi2 > 43.8) = 0.001
    assert chi2 < 43.8, chi2


def test_write_back_updates_only_held(make_buffer):
    buf = make_buffer(2)
    a, b, c = make_traj(0), make_traj(1), make_traj(2)
    buf.insert([a, b])
    a2 = make_traj(0)
    a2.ref_version, a2.ref_value = 3, 1.5
    assert buf.write_back([a2]) == 1
    held = {t.traj_id: t for t in buf.items()}
    assert held["t0"].ref_version == 3 and held["t0"].ref_value == 1.5
    buf.insert([c])  # evicts t0
    assert buf.write_back([a2]) == 0


def test_bad_records_are_rejected_and_nothing_is_half_written(make_buffer):
    buf = make_buffer(8)
    bad = make_traj(1)
    bad.reward = float("nan")
    with pytest.raises(RecordError, match="reward"):
        buf.insert([make_traj(0), bad])
    assert len(buf) == 0


def test_concurrent_producers_and_consumer(make_buffer):
    buf = make_buffer(10_000)
    errors: list[Exception] = []

    def produce(k: int) -> None:
        try:
            for j in range(100):
                buf.insert([make_traj(k * 1000 + j)])
        except Exception as err:  # pragma: no cover - reported below
            errors.append(err)

    def consume() -> None:
        try:
            for _ in range(200):
                if len(buf) >= 4:
                    assert len({t.traj_id for t in buf.sample(4)}) == 4
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
