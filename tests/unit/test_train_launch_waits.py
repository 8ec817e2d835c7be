"""`reval launch` says what it waits for (issue 38: two silent minutes before its first line):
Ray's waits name what they wait for every WAIT_LOG_S, and the driver's loop says, until the
learner's first update, what the run waits for, then that it is under way."""

from __future__ import annotations

import logging
import time
from types import SimpleNamespace

import pytest

from reval.control import RunStatus
from services import launch
from services.launch import Launch, wait_logged


class SlowRay:
    """``ray.wait``/``ray.get`` over refs that are ready after ``ready_after`` waits."""

    def __init__(self, ready_after: int) -> None:
        self.ready_after = ready_after
        self.waits = 0

    def wait(self, refs, num_returns, timeout):
        self.waits += 1
        time.sleep(timeout)
        return ([], refs) if self.waits <= self.ready_after else (refs, [])

    def get(self, refs):
        return [f"value of {r}" for r in refs]


def test_ray_waits_say_what_they_wait_for(monkeypatch, caplog):
    monkeypatch.setattr(launch, "WAIT_LOG_S", 0.01)
    with caplog.at_level(logging.INFO, logger="reval.launch"):
        got = wait_logged(SlowRay(ready_after=3), ["a", "b"], "the ranks to start", 10)
    assert got == ["value of a", "value of b"]
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3 and all(m.startswith("waiting for the ranks to start (") for m in lines)
    with pytest.raises(TimeoutError, match="Ray to place the learner: not ready after"):
        wait_logged(SlowRay(ready_after=10**6), ["a"], "Ray to place the learner", 0.05)


def test_the_driver_says_what_the_run_waits_for_until_its_first_update(monkeypatch, caplog):
    monkeypatch.setattr(launch, "WAIT_LOG_S", 0.0)
    status = RunStatus(phase="starting")
    control = SimpleNamespace(read_status=lambda: status,
                              read=lambda: SimpleNamespace(workers=2))  # fmt: skip
    driver = Launch.__new__(Launch)  # (the loop's state only: no Ray)
    driver.control, driver.workers, driver.started = control, {}, time.time()
    driver.under_way, driver.step_before, driver.next_report = False, 7, 0.0
    with caplog.at_level(logging.INFO, logger="reval.launch"):
        driver.report_start()
        status = RunStatus(phase="running", step=7)  # (a resumed run's old step: not yet)
        driver.report_start()
        status = RunStatus(phase="running", step=8)
        driver.report_start()
        driver.report_start()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3, lines
    assert lines[0].startswith("waiting for the learner's first update (learner: starting; 0 of "
                               "2 worker(s) up")  # fmt: skip
    assert "learner: running" in lines[1]
    assert lines[2].startswith("under way: the learner is at step 8")


def test_ray_waits_beat_the_drivers_heartbeat_while_they_wait(monkeypatch, caplog):
    """A learner's restart waits on its set-up (tens of seconds on a busy machine): the wait
    writes the driver's heartbeat every BEAT_S, or ``reval launch --status`` reads no driver
    after DRIVER_TIMEOUT_S (it did, in CI, after a rank was killed)."""
    from reval.control import DRIVER_TIMEOUT_S

    assert 2 * launch.BEAT_S < DRIVER_TIMEOUT_S  # (a late beat or two still in time)
    monkeypatch.setattr(launch, "WAIT_LOG_S", 100.0)
    monkeypatch.setattr(launch, "BEAT_S", 0.01)
    beats = []
    with caplog.at_level(logging.INFO, logger="reval.launch"):
        got = wait_logged(SlowRay(ready_after=5), ["a"], "the learner's set-up", 10,
                          beat=lambda: beats.append(time.monotonic()))  # fmt: skip
    assert got == ["value of a"]
    assert len(beats) == 6  # before each of the 6 waits
    assert not caplog.records  # (its lines stay every WAIT_LOG_S)


def test_a_learner_restart_beats_while_its_set_up_runs(monkeypatch):
    """The driver's ``start_learner`` (a start, or a restart) hands its heartbeat to both waits;
    each beat writes the driver's status."""
    waits = []

    def fake_wait(ray, refs, what, timeout_s, beat=None):
        waits.append((what, beat))
        assert beat is not None
        beat()
        return [("a", 1, 11)] if "rank actor" in what else [("{}", None)]

    monkeypatch.setattr(launch, "wait_logged", fake_wait)
    written = []
    driver = Launch.__new__(Launch)  # (start_learner's state only: no Ray)
    remote = SimpleNamespace(remote=lambda *a: "ref")
    rank = SimpleNamespace(endpoint=remote, prepare=remote, run=remote, pid=remote)
    driver.cfg = SimpleNamespace(name="r")
    driver.cfg_json, driver.world, driver.ranks = "{}", 1, [rank]
    driver.rank_pids, driver.learner_state, driver.workers, driver.dead_workers = [], None, {}, 0
    driver.restarts, driver.state, driver.stop_requested = 1, "running", False
    status = SimpleNamespace(checkpoints=[])
    driver.control = SimpleNamespace(beat_driver=written.append, read_status=lambda: status)
    driver._rank_actors = lambda: ("a", 1)
    driver.ray = SimpleNamespace()
    driver.start_learner(None)
    assert [w for w, _ in waits] == ["the learner's set-up (the tiny model's pretraining)"]
    assert written and written[-1]["learner"]["restarts"] == 1
