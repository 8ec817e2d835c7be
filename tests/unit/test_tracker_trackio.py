"""The ``trackio`` tracker (reval/tracker_trackio.py, issue 42): a ``reval train`` run's Trackio
project, read back from Trackio's local store (its own ``SQLiteStorage``), holds the rows of
``metrics.jsonl`` at their policy versions and the resolved config; a resumed run continues the
same Trackio run and its rows follow; a fresh start makes a new run."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pytest

from reval.config import load_config
from reval.metrics import read_jsonl
from services.train import train
from tests.unit.test_trackers import TINY, expected_series

pytestmark = pytest.mark.peers  # (trackio is in the peers venv: it conflicts with the floors')

# Trackio reads TRACKIO_DIR once, when it is first imported (nothing here imports it before):
# its store goes to a directory of its own, not the user's ~/.cache.
os.environ.setdefault("TRACKIO_DIR", tempfile.mkdtemp(prefix="reval-trackio-"))


def _store():
    from trackio.sqlite_storage import SQLiteStorage
    from trackio.utils import TRACKIO_DIR

    assert Path(TRACKIO_DIR) == Path(os.environ["TRACKIO_DIR"])
    return SQLiteStorage


def test_a_resumed_run_continues_the_same_trackio_run(tmp_path):
    project = f"reval-test-{tmp_path.name}"
    overrides = [*TINY, f"output_dir={tmp_path}", 'metrics.trackers=["trackio"]',
                 f"metrics.trackio.project={project}"]  # fmt: skip
    first = load_config(overrides=[*overrides, "learner.rounds=2"], environ={})
    train(first)
    run_dir = first.run_dir
    assert json.loads((run_dir / "trackers.json").read_text()) == {"trackio": "t"}
    (run_dir / "summary.json").unlink()  # (a stopped run: resumable)
    cfg = load_config(overrides=[*overrides, "learner.rounds=4"], environ={})
    train(cfg, resume=True)

    store = _store()
    assert store.get_runs(project) == ["t"]  # (one run across the resume)
    rows = read_jsonl(cfg.paths.metrics)
    assert [r["round"] for r in rows] == [0, 1, 2, 3, 4]
    want = expected_series(rows)
    assert {"loss", "reward_mean", "eval_success", "policy_version"} <= set(want)
    got: dict[str, list[tuple[int, float]]] = {}
    for log in store.get_logs(project, "t"):
        for key, value in log.items():
            if key not in ("step", "timestamp") and not isinstance(value, dict):  # (no tables)
                got.setdefault(key, []).append((log["step"], float(value)))
    assert got == want
    assert [s for s, _ in got["policy_version"]] == [0, 2, 4, 6, 8]
    config = store.get_run_config(project, "t")
    assert config is not None
    assert config["learner"]["rounds"] == 4 and config["metrics"]["trackers"] == ["trackio"]
    assert "git_revision" in config


def test_a_fresh_start_begins_a_new_trackio_run(tmp_path):
    project = f"reval-test-{tmp_path.name}"
    overrides = [*TINY, f"output_dir={tmp_path}", 'metrics.trackers=["trackio"]',
                 f"metrics.trackio.project={project}", "learner.rounds=1"]  # fmt: skip
    cfg = load_config(overrides=overrides, environ={})
    train(cfg)
    train(cfg)  # (finished: a plain rerun starts over)
    records = _store().get_run_records(project)
    assert [r["name"] for r in records] == ["t", "t"]
    assert records[0]["id"] != records[1]["id"]


def test_tables_the_curve_and_the_summary_reach_the_trackio_run(tmp_path):
    """``log_table`` (a Trackio table at its step), ``log_image`` (the PNG's bytes in Trackio's
    media) and ``log_summary`` (a table of its fields), read back from Trackio's store."""
    from reval.tracker_common import RunIds
    from reval.tracker_trackio import TrackioTracker
    from reval.trackers import Table
    from tests.unit.test_tracker_wandb import _write_png

    project = f"reval-test-{tmp_path.name}"
    cfg = load_config(overrides=[f"output_dir={tmp_path}", "name=media",
                                 f"metrics.trackio.project={project}"], environ={})  # fmt: skip
    png = tmp_path / "curve.png"
    _write_png(png)
    tracker = TrackioTracker(cfg, cfg.run_dir, RunIds(cfg.run_dir, False))
    answers = Table(("prompt", "answer", "score"), (("2+2=", "4 <b>|", 1.0), ("3+4=", "8", 0.0)))
    tracker.log_config({"name": "media"})
    tracker.log_table("eval/answers", 4, answers)
    tracker.log_image("curve", png)
    tracker.log_summary({"final_success": 0.75, "warnings": []})
    tracker.close()
    logs = {k: (log["step"], v) for log in _store().get_logs(project, "media")
            for k, v in log.items() if isinstance(v, dict)}  # fmt: skip
    step, table = logs["eval/answers"]
    assert step == 4 and table["_value"] == answers.records()
    _, image = logs["curve"]
    (stored,) = Path(os.environ["TRACKIO_DIR"]).rglob(Path(image["file_path"]).name)
    assert stored.read_bytes() == png.read_bytes()
    _, summary = logs["summary"]
    assert summary["_value"] == [{"field": "final_success", "value": 0.75},
                                 {"field": "warnings", "value": "[]"}]  # fmt: skip
