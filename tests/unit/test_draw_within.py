"""The learner's wait for a batch (``learner/batches.py: draw_within``): a stop asked while the
buffer is empty ends the wait within a slice, not at the end of the learner's turn (5 s, which
with the process's teardown ran past 8 s after a SIGTERM on a busy machine); without one it
waits its whole turn, and a batch that comes meanwhile is handed out."""

from __future__ import annotations

import threading
import time

import pytest

from buffer.base import SampleTimeout
from buffer.prefetch import Prefetcher
from buffer.ring import MemoryRing
from learner.batches import STOP_CHECK_S, BatchSource, draw_within
from tests.conftest import make_traj


def source_of(ring: MemoryRing) -> BatchSource:
    return BatchSource(ring, batch_size=4, on_policy=False, updates_per_round=2)


@pytest.mark.parametrize("prefetched", [False, True])
def test_a_stop_ends_the_wait_on_an_empty_buffer_within_a_slice(prefetched):
    ring = MemoryRing(64)
    source = source_of(ring)
    prefetch = Prefetcher(ring, 4, depth=1, workers=1, draw=source.next) if prefetched else None
    stop = threading.Event()
    try:
        threading.Timer(0.3, stop.set).start()
        t0 = time.monotonic()
        with pytest.raises(SampleTimeout):
            draw_within(prefetch.get if prefetch else source.next, 60.0, stop)
        took = time.monotonic() - t0
    finally:
        if prefetch is not None:
            prefetch.close()
    assert 0.3 <= took < 0.3 + 10 * STOP_CHECK_S  # (a 60 s turn)


def test_without_a_stop_it_waits_its_turn_and_hands_out_a_batch_that_comes():
    ring = MemoryRing(64)
    source = source_of(ring)
    stop = threading.Event()
    t0 = time.monotonic()
    with pytest.raises(SampleTimeout):
        draw_within(source.next, 4 * STOP_CHECK_S, stop)
    assert time.monotonic() - t0 >= 4 * STOP_CHECK_S  # several slices, not one
    threading.Timer(3 * STOP_CHECK_S, ring.insert, [[make_traj(i) for i in range(8)]]).start()
    batch = draw_within(source.next, 60.0, stop)
    assert sorted(t.traj_id for t in batch.trajectories) == ["t0", "t1", "t2", "t3"]
    assert source.drawn == 1  # (the slices that timed out kept its place in the schedule)


def test_a_stop_does_not_hide_a_batch_at_hand():
    """The stop is looked at only after a slice drew nothing: the batch in hand is trained on
    (the learner stops after the update, as when the stop comes during one)."""
    ring = MemoryRing(64)
    ring.insert([make_traj(i) for i in range(8)])
    stop = threading.Event()
    stop.set()
    assert len(draw_within(source_of(ring).next, 60.0, stop).trajectories) == 4
