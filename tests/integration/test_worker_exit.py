"""Workers that exit when their run is over (issue 38: hand-started workers waited for the learner
forever): the run's status ``done`` written by its learner after a worker started ends the
worker within a few seconds, exit status 0 and one line, in the lockstep loop, the
streaming loop and the wait for the first weights; a status that was already over when the worker
started (an earlier learner's) does not."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
import torch

from reval.control import RunControl
from reval.policy import build_char_tokenizer
from reval.weights.files import WeightStore
from rollout import worker as worker_module
from tests.conftest import announce_weights
from tests.integration.test_rollout_worker import cli_args, publish, ring_of, spawn, worker_cfg
from tests.unit.test_streaming_worker import Engine


def _done(redis_url: str, prefix: str, run: str, phase: str = "done") -> None:
    """The learner's last word on the run."""
    control = RunControl(redis.Redis.from_url(redis_url), prefix, run)
    control.publish_status({"phase": phase, "step": 5, "updates": 5})


@contextlib.contextmanager
def _running(worker: worker_module.RolloutWorker) -> Iterator[threading.Thread]:
    """``worker.run`` in a thread, stopped and joined afterwards."""
    runner = threading.Thread(target=worker.run)
    runner.start()
    try:
        yield runner
    finally:
        worker.stop.set()
        runner.join(30)


def _ends_soon(runner: threading.Thread, end: Callable[[], None]) -> None:
    """``end()`` (the run ends) stops the worker within ``RUN_END_CHECK_S`` and its batch in
    hand."""
    t0 = time.monotonic()
    end()
    runner.join(30)
    assert not runner.is_alive()
    assert time.monotonic() - t0 < RUN_END_CHECK_S + 5


def _wait(check, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_a_hand_started_worker_exits_0_when_its_run_is_done(
    tmp_path: Path, redis_url: str, redis_prefix: str
) -> None:
    cfg = worker_cfg(tmp_path, redis_url, redis_prefix)
    _done(redis_url, redis_prefix, "w")  # an earlier learner's run under the name
    publish(cfg, 0)
    p = spawn(cli_args(tmp_path, redis_url, redis_prefix), "--worker-id", "wx")
    try:
        ring = ring_of(cfg)
        _wait(lambda: len(ring) > 0 or p.poll() is not None, 120)
        assert p.poll() is None, p.communicate()[1]  # the old "done" did not end it
        time.sleep(RUN_END_CHECK_S + 0.5)
        assert p.poll() is None
        t0 = time.monotonic()
        _done(redis_url, redis_prefix, "w")  # this run's learner finishes
        out, err = p.communicate(timeout=60)
        took = time.monotonic() - t0
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    assert p.returncode == 0, err
    assert took < 15, took  # (RUN_END_CHECK_S and the batch in hand; a loaded machine)
    lines = [line for line in err.splitlines() if "the run is done" in line]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    assert '"batches"' in out  # the summary, as on a stop


RUN_END_CHECK_S = worker_module.RUN_END_CHECK_S


def test_a_worker_waiting_for_first_weights_exits_when_the_run_is_done(
    tmp_path: Path, redis_url: str, redis_prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    """No weights ever came: the learner finished. The wait says what it waits for at once."""
    cfg = worker_cfg(tmp_path, redis_url, redis_prefix)
    worker = worker_module.RolloutWorker(cfg, "wf")
    caplog.set_level(logging.INFO, logger="reval.rollout")
    with _running(worker) as runner:
        _wait(lambda: "waiting for the learner's first weights" in caplog.text, 30)
        _ends_soon(runner, lambda: _done(redis_url, redis_prefix, "w"))
    assert caplog.text.count("the run is done (its learner ended it): exiting") == 1
    assert worker.stats.batches == 0


def test_a_learner_stopped_by_a_signal_does_not_end_its_workers(
    tmp_path: Path, redis_url: str, redis_prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    """``docker stop`` / a compose restart of the learner writes the status ``stopped`` (the run's
    control still says running): the learner comes back and resumes, so its workers must stay
    (under compose's restart on-failure a worker that exited 0 never comes back); a stop the
    run's control asks for (``reval runs stop``: phase ``stopping``) ends them."""
    cfg = worker_cfg(tmp_path, redis_url, redis_prefix)
    worker = worker_module.RolloutWorker(cfg, "wk")
    caplog.set_level(logging.INFO, logger="reval.rollout")
    control = RunControl(redis.Redis.from_url(redis_url), redis_prefix, "w")
    with _running(worker) as runner:
        _wait(lambda: "waiting for the learner's first weights" in caplog.text, 30)
        _done(redis_url, redis_prefix, "w", phase="stopped")
        time.sleep(3 * RUN_END_CHECK_S)
        assert runner.is_alive()  # (the old code exited here)
        _ends_soon(runner, lambda: control.set_phase("stopping"))
    assert "its learner ended it" not in caplog.text


def test_a_streaming_worker_exits_when_its_run_is_done(
    tmp_path: Path, redis_url: str, redis_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = worker_cfg(tmp_path, redis_url, redis_prefix, "rollout.engine=vllm", "rollout.n=2",
                     "rollout.worker_prompts=4")  # fmt: skip
    assert cfg.rollout.streams()
    tok = build_char_tokenizer()
    engine = Engine(tok)
    monkeypatch.setattr(worker_module, "build_engine", lambda *a, **k: (engine, tok))
    store = WeightStore(redis.Redis.from_url(redis_url), redis_prefix, "w", tmp_path / "w")
    announce_weights(store, [("w", torch.zeros(2))], 1)
    worker = worker_module.RolloutWorker(cfg, "ws")
    ring = ring_of(cfg)
    with _running(worker) as runner:
        _wait(lambda: ring.stats().inserted >= 10, 30)
        _ends_soon(runner, lambda: _done(redis_url, redis_prefix, "w"))
    records = ring.items()
    assert len(records) == worker.stats.trajectories  # what it had in hand went in
