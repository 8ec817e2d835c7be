"""A worker whose run ended leaves with exit status 0 even when a supervisor's SIGTERM arrives
while it exits (tests/e2e/test_service_cpu_math.py saw a worker end -15: it had logged "the run
is done ... exiting" and the test, its learner done, sent SIGTERM into the interpreter's
teardown, which puts SIGTERM's default back for a Python handler)."""

from __future__ import annotations

import signal
from types import SimpleNamespace

import pytest

from reval.config import RunConfig
from rollout import worker as worker_module


class _Worker:
    """What ``main`` uses of a worker whose run ended."""

    def __init__(self, cfg: RunConfig, worker_id: str | None, metrics: object) -> None:
        self.worker_id = worker_id or "w"
        self.stop = SimpleNamespace(set=lambda: None)
        self.weights = SimpleNamespace(joined_broadcast=False)

    def run(self, max_batches: int | None) -> worker_module.WorkerStats:
        return worker_module.WorkerStats(batches=1, trajectories=4)


def test_after_its_run_a_worker_ignores_sigterm_while_it_exits(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    monkeypatch.setattr(worker_module, "RolloutWorker", _Worker)
    try:
        assert worker_module.main(RunConfig(), "w", None, None) == 0
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    finally:
        for s, h in before.items():
            signal.signal(s, h)
    assert '"trajectories": 4' in capsys.readouterr().out
