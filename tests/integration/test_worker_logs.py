"""Quiet workers (issue 38: a line per weight load, 625 lines in 8 min): weight loads are logged
the first time, then at most once a minute with the count of those held back, and at once when
the lineage changes (a new learner) or after a read that failed."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import redis
import torch

from reval.weights.files import WeightStore
from reval.weights.receiver import LocalReceiver, WeightSubscriber
from tests.conftest import announce_weights


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "loaded weights" in r.getMessage()]


def test_weight_loads_are_logged_once_a_minute_with_the_count(
    tmp_path: Path, redis_url: str, redis_prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="reval.weights")
    store = WeightStore(redis.Redis.from_url(redis_url), redis_prefix, "q", tmp_path / "w")
    loaded: list[int] = []
    receiver = LocalReceiver(lambda named, v: (list(named), loaded.append(v)), "cpu")
    sub = WeightSubscriber(store, "wq")
    clock = Clock()
    sub.loads.clock = clock
    tensors = [("a", torch.zeros(3))]
    for v in range(20):  # 20 loads within a minute
        announce_weights(store, tensors, v)
        assert sub.update(receiver) == v
        clock.now += 2.0
    assert loaded == list(range(20))
    assert _lines(caplog) == ["worker wq: loaded weights v0 (file)"]
    clock.now += 30.0  # a minute after the first line
    announce_weights(store, tensors, 20)
    assert sub.update(receiver) == 20
    assert _lines(caplog)[1:] == [
        "worker wq: loaded weights v20 (file) (and 19 more like it since the last line)"
    ]
    # A new learner (lineage): at once.
    announce_weights(store, tensors, 3, lineage="resumed")
    assert sub.update(receiver) == 3
    assert _lines(caplog)[2:] == ["worker wq: loaded weights v3 (file)"]


def test_long_waits_say_what_they_wait_for(
    tmp_path: Path,
    redis_url: str,
    redis_prefix: str,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The engine's start and the wait for the first weights: a line at once, one every
    ``PROGRESS_S`` while they last (30 s; 0.1 s here), one when they are over."""
    import threading
    import time

    from rollout import worker as worker_module
    from tests.integration.test_rollout_worker import publish, worker_cfg

    monkeypatch.setattr(worker_module, "PROGRESS_S", 0.1)
    build = worker_module.build_engine

    def slow_build(*args: object, **kwargs: object) -> object:
        time.sleep(0.45)
        return build(*args, **kwargs)

    monkeypatch.setattr(worker_module, "build_engine", slow_build)
    caplog.set_level(logging.INFO, logger="reval.rollout")
    cfg = worker_cfg(tmp_path, redis_url, redis_prefix, "rollout.worker_prompts=2")
    worker = worker_module.RolloutWorker(cfg, "wp")
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == "worker wp: starting the hf engine ..."
    assert sum("starting the hf engine: still at it after" in m for m in lines) >= 2
    assert lines[-1].startswith("worker wp: starting the hf engine: done in")
    caplog.clear()
    timer = threading.Timer(0.5, lambda: publish(cfg, 2))
    timer.start()
    try:
        assert worker.run(max_batches=1).versions == {2: 2}  # (one batch: two groups)
    finally:
        timer.join()
    waits = [r.getMessage() for r in caplog.records if "first weights" in r.getMessage()]
    assert waits[0].startswith("worker wp: waiting for the learner's first weights of run 'w' (0 s")
    assert len(waits) >= 3  # at once, then every PROGRESS_S
    assert waits[-1].startswith("worker wp: first weights loaded after")
