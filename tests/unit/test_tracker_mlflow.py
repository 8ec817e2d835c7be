"""The ``mlflow`` tracker (reval/tracker_mlflow.py, issue 42): a ``reval train`` run's MLflow
file store (in the run directory), read back through ``MlflowClient``, holds the rows of
``metrics.jsonl`` as metrics at their policy versions and the resolved config as parameters; a
resumed run continues the same MLflow run and its rows follow."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from reval.config import load_config
from reval.metrics import read_jsonl
from reval.tracker_common import RunIds, flat
from reval.tracker_mlflow import MlflowTracker
from reval.trackers import Trackers
from services.train import train
from tests.unit.test_trackers import TINY, expected_series


@pytest.fixture
def no_server(monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")


def test_a_resumed_run_continues_the_same_mlflow_run(tmp_path, no_server):
    overrides = [
        *TINY,
        f"output_dir={tmp_path}",
        'metrics.trackers=["mlflow"]',
        "metrics.mlflow.experiment=reval-test",
        'metrics.mlflow.tags={"team": "rl"}',
    ]
    first = load_config(overrides=[*overrides, "learner.rounds=2"], environ={})
    train(first)
    run_dir = first.run_dir
    run_id = json.loads((run_dir / "trackers.json").read_text())["mlflow"]
    (run_dir / "summary.json").unlink()  # (a stopped run: resumable)
    cfg = load_config(overrides=[*overrides, "learner.rounds=4"], environ={})
    train(cfg, resume=True)
    assert json.loads((run_dir / "trackers.json").read_text())["mlflow"] == run_id

    client = MlflowClient(tracking_uri=(run_dir / "mlruns").resolve().as_uri())
    exp = client.get_experiment_by_name("reval-test")
    assert exp is not None
    (run,) = client.search_runs([exp.experiment_id])  # (one run across the resume)
    assert run.info.run_id == run_id and run.info.status == "FINISHED"
    assert run.info.run_name == "t" and run.data.tags["team"] == "rl"

    rows = read_jsonl(cfg.paths.metrics)
    assert [r["round"] for r in rows] == [0, 1, 2, 3, 4]
    want = expected_series(rows)
    assert {"loss", "reward_mean", "eval_success", "policy_version"} <= set(want)
    assert set(run.data.metrics) == set(want)
    for key, series in want.items():
        got = sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))
        assert got == series, key
    assert [s for s, _ in want["policy_version"]] == [0, 2, 4, 6, 8]

    # The config: parameters as first logged (MLflow keeps a parameter's first value), the
    # latest resolved config as config.json.
    params = run.data.params
    assert params["learner.rounds"] == "2" and params["metrics.trackers"] == '["mlflow"]'
    dumped = first.model_dump(mode="json")
    assert params["learner.lr"] == str(dumped["learner"]["lr"])
    assert set(flat(dumped)) <= set(params) and "git_revision" in params
    shown = client.download_artifacts(run_id, "config.json", str(tmp_path))
    assert json.loads(Path(shown).read_text())["learner"]["rounds"] == 4


def test_a_fresh_start_begins_a_new_mlflow_run(tmp_path, no_server):
    overrides = [*TINY, f"output_dir={tmp_path}", 'metrics.trackers=["mlflow"]',
                 "learner.rounds=1"]  # fmt: skip
    cfg = load_config(overrides=overrides, environ={})
    train(cfg)
    before = json.loads((cfg.run_dir / "trackers.json").read_text())["mlflow"]
    train(cfg)  # (finished: a plain rerun starts over)
    after = json.loads((cfg.run_dir / "trackers.json").read_text())["mlflow"]
    assert before != after
    client = MlflowClient(tracking_uri=(cfg.run_dir / "mlruns").resolve().as_uri())
    exp = client.get_experiment_by_name("t")
    assert exp is not None
    assert len(client.search_runs([exp.experiment_id])) == 2


class SlowThenBroken:
    """An MLflow client whose server answers in 0.2 s, then not at all."""

    def __init__(self):
        self.sent, self.broken = [], False

    def log_batch(self, run_id, metrics=()):
        time.sleep(0.2)
        if self.broken:
            raise ConnectionError("MLflow server away")
        self.sent.append([(m.key, m.value, m.step) for m in metrics])

    def set_terminated(self, run_id):
        self.terminated = True


def test_rows_are_sent_off_the_update_s_path_and_failures_come_back_as_one_line(
    tmp_path, no_server, caplog
):
    cfg = load_config(overrides=[*TINY, f"output_dir={tmp_path}",
                                 'metrics.trackers=["mlflow"]'], environ={})  # fmt: skip
    tracker = MlflowTracker(cfg, tmp_path, RunIds(tmp_path, resume=False))
    deadline = time.monotonic() + 30
    while tracker.run_id is None:  # (the thread opens the run in the file store first)
        assert time.monotonic() < deadline
        time.sleep(0.02)
    tracker.client = client = SlowThenBroken()
    fan_out = Trackers([tracker])
    t0 = time.perf_counter()
    for step in range(5):
        fan_out.log_row(step, {"loss": 1.0 / (step + 1)})
    assert time.perf_counter() - t0 < 0.1  # (five rows queued; sending them takes 1 s)
    deadline = time.monotonic() + 10
    while len(client.sent) < 5 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert client.sent == [[("loss", 1.0 / (s + 1), s)] for s in range(5)]
    client.broken = True
    with caplog.at_level(logging.WARNING, logger="reval.trackers"):
        fan_out.log_row(5, {"loss": 0.1})
        time.sleep(0.5)  # (the thread meets the error)
        for step in range(6, 9):
            fan_out.log_row(step, {"loss": 0.1})  # (raises the error: logged once)
        fan_out.close()
    lines = [r.getMessage() for r in caplog.records if r.name == "reval.trackers"]
    assert len(lines) == 1 and "MLflow server away" in lines[0], lines
    assert client.terminated


def test_a_server_away_holds_nothing_up_and_names_mlflow_refuses_are_mended(
    tmp_path, no_server, monkeypatch
):
    """Every call to the server is the tracker's thread's: a start that takes seconds (MLflow
    retries for minutes) costs the run nothing; ``reward/acc@1`` (MLflow refuses ``@``, and
    with it the whole row) is logged as ``reward/acc_1``."""
    cfg = load_config(overrides=[*TINY, f"output_dir={tmp_path}",
                                 'metrics.trackers=["mlflow"]'], environ={})  # fmt: skip
    opened = MlflowTracker._open

    def slow_open(self):
        time.sleep(1.5)
        return opened(self)

    monkeypatch.setattr(MlflowTracker, "_open", slow_open)
    t0 = time.perf_counter()
    tracker = MlflowTracker(cfg, tmp_path, RunIds(tmp_path, resume=False))
    tracker.log_config({"task": {"reward_args": {"a@b": 1}}})
    tracker.log_row(3, {"reward/acc@1": 0.5, "loss": 2.0})
    assert time.perf_counter() - t0 < 0.5
    tracker.close()
    client = MlflowClient(tracking_uri=(tmp_path / "mlruns").resolve().as_uri())
    assert tracker.run_id is not None
    run = client.get_run(tracker.run_id)
    assert run.data.metrics == {"reward/acc_1": 0.5, "loss": 2.0}
    assert run.data.params["task.reward_args.a_b"] == "1"
    assert run.info.status == "FINISHED"


def test_tables_the_curve_and_the_summary_reach_the_mlflow_run(tmp_path, no_server):
    """``log_table`` (the artifact ``eval/answers/step-N.json``), ``log_image`` (the PNG under
    ``curve/``) and ``log_summary`` (``summary.json``), read back through ``MlflowClient``."""
    from reval.trackers import Table
    from tests.unit.test_tracker_wandb import _write_png

    cfg = load_config(overrides=[f"output_dir={tmp_path}", "name=media"], environ={})
    png = tmp_path / "curve.png"
    _write_png(png)
    ids = RunIds(cfg.run_dir, False)
    tracker = MlflowTracker(cfg, cfg.run_dir, ids)
    answers = Table(("prompt", "answer", "score"), (("2+2=", "4 <b>|", 1.0), ("3+4=", "8", 0.0)))
    tracker.log_table("eval/answers", 4, answers)
    tracker.log_image("curve", png)
    tracker.log_summary({"final_success": 0.75, "rounds": 3, "warnings": []})
    tracker.close()
    client = MlflowClient(tracking_uri=(cfg.run_dir / "mlruns").resolve().as_uri())
    run_id = ids.get("mlflow")
    out = Path(client.download_artifacts(run_id, "", str(tmp_path / "got")))
    assert json.loads((out / "eval/answers/step-00000004.json").read_text()) == answers.records()
    assert (out / "curve" / "curve.png").read_bytes() == png.read_bytes()
    assert json.loads((out / "summary.json").read_text()) == {
        "final_success": 0.75, "rounds": 3, "warnings": []}  # fmt: skip


def test_a_local_database_store_keeps_its_artifacts_beside_the_database(
    tmp_path, monkeypatch, no_server
):
    """A ``sqlite:///`` store (full MLflow) would put a new experiment's artifacts in the
    process's ``./mlruns``: outside the run's output_dir, where a REST run may not write. The
    experiment is made with its artifacts beside the database; a file store and a server keep
    MLflow's own locations."""
    from types import SimpleNamespace

    from reval.tracker_mlflow import artifact_location

    made: list[tuple[str, str | None]] = []

    class Client:  # (the sqlite store needs full MLflow: what _open asks of it is recorded)
        def __init__(self, tracking_uri):
            self.uri = tracking_uri

        def get_experiment_by_name(self, name):
            return None

        def create_experiment(self, name, artifact_location=None):
            made.append((name, artifact_location))
            return "1"

        def create_run(self, exp_id, run_name, tags):
            return SimpleNamespace(info=SimpleNamespace(run_id="r1"))

        def set_terminated(self, run_id):
            pass

    monkeypatch.setattr("mlflow.tracking.MlflowClient", Client)
    monkeypatch.chdir(tmp_path)
    db = tmp_path / "out" / "mlflow.db"
    cfg = load_config(
        overrides=[*TINY, f"output_dir={tmp_path / 'out'}", 'metrics.trackers=["mlflow"]',
                   f"metrics.mlflow.tracking_uri=sqlite:///{db}",
                   "metrics.mlflow.experiment=team/exp"],
        environ={},
    )  # fmt: skip
    run_dir = tmp_path / "out" / "t"
    MlflowTracker(cfg, run_dir, RunIds(run_dir, resume=False)).close()
    assert made == [("team/exp", (db.parent / "mlartifacts" / "team_exp").as_uri())]

    assert artifact_location("sqlite:///rel/x.db?mode=rwc", "e") == (
        (tmp_path / "rel" / "mlartifacts" / "e").as_uri()
    )
    assert artifact_location((tmp_path / "mlruns").as_uri(), "e") is None
    assert artifact_location("http://mlflow:5000", "e") is None
