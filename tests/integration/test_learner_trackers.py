"""The learner's rank 0 (``reval learner``, the service loop) logs its rows to the configured
trackers, and a learner resumed from its checkpoint continues the same tracker run (issue 42):
two learner processes, the second ``--resume-if-any``, one MLflow run holding both's rows at
their policy versions, read back through ``MlflowClient``, and the learner's final state;
TensorBoard's events (read by its reader; what a crash left past the checkpoint hidden) and
one W&B run (its offline files) with both's rows."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

from tests.integration.test_learner_resume import Feeder, killpg, learner, rows, wait_for

STRAY = 12345.0
"""The loss of the rows a stopped learner logged past its checkpoint (``stray_events``)."""


def stray_events(run_dir: Path) -> list[int]:
    """Rows past the run's latest checkpoint in an event file of their own, as a learner killed
    after its writer flushed them leaves (a SIGTERM's learner checkpoints its last update: none
    of its own are): the resumed learner's TensorBoard writer must hide them (``purge_step``).
    Their steps."""
    from torch.utils.tensorboard import SummaryWriter

    from reval.run_dir import checkpoint_step, latest_in

    latest = latest_in(run_dir / "checkpoints")
    assert latest is not None
    steps = [checkpoint_step(latest.name) + k for k in (1, 2, 5)]
    time.sleep(1.1)  # (event files are read in name order, and their names hold the second)
    writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))
    for step in steps:
        writer.add_scalar("loss", STRAY, step)
    writer.close()
    return steps


def test_a_resumed_learner_continues_its_mlflow_run(tmp_path, redis_url, redis_prefix,
                                                    monkeypatch):  # fmt: skip
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    feeder = Feeder(redis_url, redis_prefix, "trk")
    procs = []
    last: list[int] = []
    hidden: list[int] = []
    try:
        for _ in range(2):
            before = len(rows(tmp_path, "trk"))
            proc = learner(tmp_path, redis_url, redis_prefix, "trk", "--resume-if-any", "--set",
                           'metrics.trackers=["mlflow", "tensorboard", "wandb"]')  # fmt: skip
            procs.append(proc)
            wait_for(lambda b=before: len(rows(tmp_path, "trk")) > b + 3, 180, proc, "updates")
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(60) == 143
            last.append(rows(tmp_path, "trk")[-1]["policy_version"])
            if not hidden:  # (before the second learner: what a crash past a checkpoint leaves)
                hidden = stray_events(tmp_path / "trk")
    finally:
        feeder.close()
        for proc in procs:
            killpg(proc)
    run_dir = tmp_path / "trk"
    run_id = json.loads((run_dir / "trackers.json").read_text())["mlflow"]
    client = MlflowClient(tracking_uri=(run_dir / "mlruns").resolve().as_uri())
    runs = [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])]
    assert [r.info.run_id for r in runs] == [run_id]  # one run across the resume
    logged = rows(tmp_path, "trk")
    versions = {r["policy_version"] for r in logged if "loss" in r}
    steps = [m.step for m in client.get_metric_history(run_id, "loss")]
    assert steps and set(steps) <= versions
    assert min(steps) <= last[0] < max(steps)  # rows of both learners, in one run

    # The learner's final state, as MLflow's summary.json (each stop: the second's last).
    out = Path(client.download_artifacts(run_id, "summary.json", str(tmp_path / "got")))
    summary = json.loads(out.read_text())
    assert summary["stopped_by"] == signal.SIGTERM and summary["step"] == last[1]
    # TensorBoard: both learners' rows, the first's past its checkpoint hidden (no step twice).
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    tb = [(e.step, e.value) for e in acc.Scalars("loss")]
    assert [s for s, _ in tb] == sorted({s for s, _ in tb}) and {s for s, _ in tb} <= versions
    assert min(tb)[0] <= last[0] < max(tb)[0] and STRAY not in {v for _, v in tb}
    assert hidden and all(s > last[0] for s in hidden)
    # W&B: one run (an offline directory per learner process), both learners' rows.
    from tests.unit.test_tracker_wandb import read_run

    files = sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(files) == 2, files
    parts = [read_run(f) for f in files]
    wandb_id = json.loads((run_dir / "trackers.json").read_text())["wandb"]
    assert [p[0] for p in parts] == [wandb_id, wandb_id]
    wb = [s for p in parts for s, _ in p[2]["loss"]]
    assert set(wb) <= versions and min(wb) <= last[0] < max(wb)
