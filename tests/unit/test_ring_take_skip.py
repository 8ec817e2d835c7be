"""``take`` passes over inserts already taken whole (``MemoryRing._fresh_runs``), across the
ring's wrap: it hands out what reading every insert would."""

from __future__ import annotations

from buffer.ring import MemoryRing
from tests.conftest import make_traj


def _ids(batch):
    return [t.prompt_id for t in batch]


def test_take_over_taken_inserts_and_the_wrap():
    ring = MemoryRing(10)
    ring.insert([make_traj(i) for i in range(4)])  # positions 0-3
    assert _ids(ring.take(4, oldest_first=True)) == ["p0", "p1", "p2", "p3"]
    ring.insert([make_traj(i) for i in range(4, 8)])  # 4-7
    ring.insert([make_traj(i) for i in range(8, 12)])  # 8-11: slots 8, 9, 0, 1 (0, 1 evicted)
    assert _ids(ring.take(2, oldest_first=True)) == ["p4", "p5"]
    assert _ids(ring.take(6, oldest_first=True)) == ["p6", "p7", "p8", "p9", "p10", "p11"]
    ring.insert([make_traj(i) for i in range(12, 16)])  # 12-15: slots 2-5, every insert taken
    assert _ids(ring.take(3)) == ["p15", "p14", "p13"]  # newest first
    assert _ids(ring.take(1, oldest_first=True)) == ["p12"]


def test_a_whole_taken_wrapped_insert_gives_nothing_and_the_next_one_is_read():
    ring = MemoryRing(6)
    ring.insert([make_traj(i) for i in range(4)])  # 0-3
    ring.take(4, oldest_first=True)
    ring.insert([make_traj(i) for i in range(4, 8)])  # 4-7: slots 4, 5, 0, 1
    ring.take(4, oldest_first=True)
    ring.insert([make_traj(i) for i in range(8, 10)])  # 8-9: slots 2, 3
    assert _ids(ring.take(2, oldest_first=True)) == ["p8", "p9"]
    assert ring.stats().size == 6
