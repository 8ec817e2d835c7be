"""``reval launch``'s driver loop, fixes from the review of issue 38's work (no Ray: the loop's
state over a fake): a worker that finished by itself leaves its own slot empty, not every later
replacement; a corrupt ring that stopped a learner rank ends the launch with its one line and
no restart; a Redis outage is the one outage line, not a line every tick."""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import pytest
import redis

from buffer.redis_layout import RingCorrupt
from reval import retry
from reval.ratelog import RateLog
from services import launch as launch_mod
from services.launch import Launch, _Worker
from services.launch_actors import RING_CORRUPT


class FakeRay:
    """Every ref ready; ``answers`` maps a ref to what ``get`` returns or raises."""

    def __init__(self, answers: dict[str, Any]) -> None:
        self.answers = answers
        self.killed: list[Any] = []

    def wait(self, refs, num_returns, timeout):
        ready = [r for r in refs if r in self.answers]
        return ready, [r for r in refs if r not in ready]

    def get(self, ref):
        got = self.answers[ref]
        if isinstance(got, BaseException):
            raise got
        return got

    def kill(self, actor, no_restart=True):
        self.killed.append(actor)


def _driver(ray: FakeRay, workers: int = 0) -> tuple[Launch, list[int]]:
    driver = Launch.__new__(Launch)  # (the loop's state only: no Ray)
    driver.ray = ray
    driver.workers = {f"w{k}": _Worker(f"w{k}", actor=f"a{k}", ref=f"r{k}") for k in range(workers)}
    driver.control = SimpleNamespace(
        read=lambda: SimpleNamespace(phase="running", workers=workers), set_workers=lambda n: None
    )
    driver.stop_requested = False
    driver.replace_after = 0.0
    driver.ended_workers = 0
    driver.deaths = []
    driver.dead_workers = 0
    driver.restarts = 0
    driver.metrics = SimpleNamespace(dead=SimpleNamespace(inc=lambda: None))
    lc = SimpleNamespace(replace_dead_workers=True, max_learner_restarts=3)
    driver.cfg = SimpleNamespace(name="g", launch=lc)
    added: list[int] = []
    driver.add_workers = lambda n: added.append(n) or []  # type: ignore[method-assign]
    return driver, added


def test_a_worker_that_finished_by_itself_does_not_stop_the_replacement_of_others() -> None:
    """One worker finished by itself (its run ended for it), another died: the dead one is
    replaced, the finished one is not (before: no worker was replaced for the rest of the
    launch once any one finished by itself)."""
    driver, added = _driver(FakeRay({"r0": {"worker": "w0"}}), workers=2)
    driver._check_workers()  # w0 finished by itself
    driver.ray.answers["r1"] = RuntimeError("the actor died")
    driver._check_workers()  # w1 died
    driver.replace_after = 0.0  # (the back-off over)
    driver._follow_control()
    assert added == [1]


def _learner(driver: Launch, answers: dict[str, Any]) -> list[str]:
    driver.ranks = ["rank0", "rank1"]
    driver.rank_refs = ["l0", "l1"]
    driver.ray.answers.update(answers)
    started: list[str] = []
    driver.start_learner = lambda resume: started.append(f"again:{resume}")  # type: ignore[method-assign]
    driver.stop_requested = False
    return started


@pytest.mark.parametrize("how", ["answered", "raised"])
def test_a_corrupt_ring_ends_the_launch_with_no_restart(how: str) -> None:
    """Rank 0 stopped by a corrupt ring (its answer, or Ray's task error of it): RingCorrupt
    with the learner's message, every rank killed, nothing restarted (before: the learner was
    restarted ``max_learner_restarts`` times into the same ring, then a RuntimeError)."""
    msg = "run 'g': the ring's bookkeeping in Redis is corrupt (meta head): repair it"
    driver, _ = _driver(FakeRay({}))
    err = RuntimeError("ray task error")
    err.cause = RingCorrupt(msg)  # type: ignore[attr-defined]  (what Ray's error carries)
    answer: Any = {RING_CORRUPT: msg} if how == "answered" else err
    started = _learner(driver, {"l0": answer})
    with pytest.raises(RingCorrupt) as got:
        driver._check_learner()
    assert str(got.value) == msg
    assert started == [] and driver.restarts == 0
    assert driver.ray.killed == ["rank0", "rank1"]


def test_another_rank_failure_is_still_restarted() -> None:
    driver, _ = _driver(FakeRay({}))
    driver.metrics.restarts = SimpleNamespace(inc=lambda: None)
    started = _learner(driver, {"l0": RuntimeError("rank 0 died")})
    assert driver._check_learner() == "restarted"
    assert started == ["again:None"]  # (resumed if the learner's host has a checkpoint)


def test_a_redis_outage_is_one_line_not_one_a_tick(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Twenty ticks with Redis away: the outage's one line (``reval.retry``), not "run control
    unavailable" twenty times (a line every 0.5 s before)."""
    monkeypatch.setattr(retry, "outage_log", RateLog(logging.getLogger("reval.redis"), 60.0))
    monkeypatch.setattr(launch_mod, "control_log", RateLog(launch_mod.log, 60.0))

    def away(*_a: object) -> Any:
        raise redis.ConnectionError("Error 111 connecting to 127.0.0.1:6379. Connection refused.")

    driver, _ = _driver(FakeRay({}))
    driver.control = SimpleNamespace(read=away, read_status=away, set_phase=away)
    driver.stop_signalled = True
    driver.under_way = False
    with caplog.at_level(logging.INFO):
        for _ in range(20):
            driver._tick_control()
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(lines) == 1, lines
    assert "Redis is away" in lines[0]

    def wrong(*_a: object) -> Any:
        raise redis.ResponseError("WRONGTYPE Operation against a key holding the wrong kind")

    caplog.clear()
    driver.control = SimpleNamespace(read=wrong, read_status=wrong, set_phase=wrong)
    with caplog.at_level(logging.INFO):
        for _ in range(20):
            driver._tick_control()
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(lines) == 1 and "run control unavailable: WRONGTYPE" in lines[0], lines
