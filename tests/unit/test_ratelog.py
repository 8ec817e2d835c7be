"""reval/ratelog.py: repeated lines at most once per interval, with the count held back."""

from __future__ import annotations

import logging

import pytest

from reval.ratelog import RateLog


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_repeats_are_held_back_and_counted(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    rl = RateLog(logging.getLogger("t.ratelog"), every_s=60.0, clock=clock)
    with caplog.at_level(logging.INFO, "t.ratelog"):
        assert rl.info("load", "loaded v%d", 1)
        for v in range(2, 12):
            clock.t += 1.0
            assert not rl.info("load", "loaded v%d", v)
        clock.t = 61.0
        assert rl.info("load", "loaded v%d", 12)
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["loaded v1", "loaded v12 (and 10 more like it since the last line)"]


def test_a_change_of_state_is_logged_at_once(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    rl = RateLog(logging.getLogger("t.ratelog"), every_s=60.0, clock=clock)
    with caplog.at_level(logging.INFO, "t.ratelog"):
        assert rl.warning("disk", "full", state="full")
        assert not rl.warning("disk", "full", state="full")
        assert rl.warning("disk", "other", state="other")
        assert rl.info("other-key", "x")
    assert len(caplog.records) == 3


def test_recovered_once_and_then_the_next_fault_at_once(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    rl = RateLog(logging.getLogger("t.ratelog"), every_s=60.0, clock=clock)
    with caplog.at_level(logging.INFO, "t.ratelog"):
        assert not rl.recovered("redis", "back")  # nothing was wrong
        rl.warning("redis", "away")
        rl.warning("redis", "away")
        assert rl.active("redis")
        assert rl.recovered("redis", "back")
        assert not rl.active("redis")
        assert not rl.recovered("redis", "back")
        assert rl.warning("redis", "away again")
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["away", "back (2 lines of it in all)", "away again"]
