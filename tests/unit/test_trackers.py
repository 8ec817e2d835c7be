"""metrics.trackers (reval/trackers.py, issue 42): a ``reval train`` run with TensorBoard on
writes the rows of ``metrics.jsonl`` as scalars (tensorboard's own reader: the same names,
steps and values) and its config; a tracker that raises on every call leaves the run as it was
and logs one line; a tracker unknown or not installed is refused at config load."""

from __future__ import annotations

import importlib.util
import json
import logging
import math

import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from reval import trackers
from reval.config import ConfigError, load_config
from reval.metrics import read_jsonl
from services.train import train

TINY = [
    "task.kind=oneshot",
    "task.oneshot_base_success=0.4",
    "model.pretrain_steps=10",
    "rollout.prompts_per_round=4",
    "rollout.n=8",
    "rollout.max_new_tokens=3",
    "buffer.capacity=256",
    "learner.batch_size=32",
    "learner.updates_per_round=2",
    "learner.rounds=3",
    "learner.lr=3e-3",
    "eval.every=2",
    "eval.samples_per_prompt=4",
    "metrics.plot=false",
    "metrics.progress=false",
    "name=t",
]


def _run(tmp_path, name, *overrides):
    cfg = load_config(overrides=[*TINY, f"output_dir={tmp_path / name}", *overrides], environ={})
    train(cfg)
    return cfg


@pytest.fixture(scope="module")
def tensorboard_run(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("tb"), "tb", 'metrics.trackers=["tensorboard"]',
                "metrics.plot=true")  # fmt: skip


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("plain"), "plain")


def _timeless(rows):
    """The rows without their wall-clock fields (which differ between two runs)."""
    return [{k: v for k, v in r.items() if not k.endswith("_s")} for r in rows]


def expected_series(rows: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """What every tracker should hold of ``metrics.jsonl``'s rows: each numeric field (as the
    fan-out picks them, ``trackers.numeric``) as (policy version, value) in row order."""
    want: dict[str, list[tuple[int, float]]] = {}
    for row in rows:
        for key, value in trackers.numeric(row).items():
            want.setdefault(key, []).append((row["policy_version"], value))
    return want


def test_tensorboard_has_the_rows_of_metrics_jsonl(tensorboard_run, plain_run):
    cfg = tensorboard_run
    rows = read_jsonl(cfg.paths.metrics)
    assert _timeless(rows) == _timeless(read_jsonl(plain_run.paths.metrics))
    assert [r["round"] for r in rows] == [0, 1, 2, 3]
    acc = EventAccumulator(str(cfg.run_dir / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    want = expected_series(rows)
    assert {"loss", "reward_mean", "eval_success", "policy_version"} <= set(want)
    assert sorted(acc.Tags()["scalars"]) == sorted(want)
    for key, series in want.items():
        got = [(e.step, e.value) for e in acc.Scalars(key)]
        assert [s for s, _ in got] == [s for s, _ in series], key
        # (TensorBoard's scalars are float32)
        assert [v for _, v in got] == [float(np.float32(v)) for _, v in series], key
    assert [s for s, _ in want["policy_version"]] == [0, 2, 4, 6]
    # The resolved config, as text.
    (text,) = acc.Tensors("config/text_summary")
    shown = text.tensor_proto.string_val[0].decode()
    config = json.loads("\n".join(line[4:] for line in shown.splitlines()))
    assert config["metrics"]["trackers"] == ["tensorboard"]
    assert config["learner"]["rounds"] == 3


def _text(event) -> str:
    return event.tensor_proto.string_val[0].decode()


def test_tensorboard_has_the_evaluations_answers_the_curve_and_the_summary(tensorboard_run):
    cfg = tensorboard_run
    rows = read_jsonl(cfg.paths.metrics)
    acc = EventAccumulator(str(cfg.run_dir / "tensorboard"), size_guidance={"tensors": 0})
    acc.Reload()
    # A table of answers at every evaluation's step (each prompt's first answer, graded).
    tables = acc.Tensors(f"{trackers.EVAL_TABLE}/text_summary")
    assert [t.step for t in tables] == [r["policy_version"] for r in rows if "eval_success" in r]
    for table in tables:
        lines = _text(table).splitlines()
        assert lines[0] == "| prompt | answer | score |" and lines[1] == "|---|---|---|"
        assert 1 <= len(lines[2:]) <= cfg.metrics.tracker_answers
        assert all(float(line.rsplit("|", 2)[1]) in (0.0, 1.0) for line in lines[2:])
    # The curve as drawn (the PNG's bytes), and the summary as written.
    (curve,) = acc.Images(trackers.CURVE)
    png = cfg.paths.curve.read_bytes()
    assert curve.encoded_image_string == png
    assert (curve.width, curve.height) == trackers.png_size(png)
    (summary,) = acc.Tensors("summary/text_summary")
    assert json.loads(_text(summary)) == json.loads(cfg.paths.summary.read_text())


def test_a_table_cell_is_shown_not_rendered():
    """A cell is model output: its HTML escaped, its ``|`` and line breaks kept in the cell."""
    table = trackers.Table(("prompt", "answer", "score"),
                           (("2+2", "<img src=x onerror=alert(1)>|4\nok", 1.0),))  # fmt: skip
    *_, row = table.markdown().splitlines()
    assert row == "| 2\\+2 | &lt;img src=x onerror=alert\\(1\\)&gt;\\|4<br>ok | 1.0 |"
    # (Markdown is shown too: an image link to fetch is text, a lone \r is no new row)
    (cells,) = (
        trackers.Table(("a",), (("![x](http://h/i.png)\rmore",),)).markdown().splitlines()[2:]
    )
    assert cells == "| \\!\\[x\\]\\(http://h/i.png\\)<br>more |"
    assert table.records() == [{"prompt": "2+2", "answer": "<img src=x onerror=alert(1)>|4\nok",
                                "score": 1.0}]  # fmt: skip


class Raising:
    name = "tensorboard"

    def log_config(self, config):
        raise OSError("No space left on device")

    def log_row(self, step, row):
        raise OSError("No space left on device")

    def log_table(self, name, step, table):
        raise OSError("No space left on device")

    def log_image(self, name, path):
        raise OSError("No space left on device")

    def log_summary(self, summary):
        raise OSError("No space left on device")

    def close(self):
        raise OSError("No space left on device")


def test_a_failing_tracker_changes_nothing_and_logs_one_line(
    plain_run, tmp_path, monkeypatch, caplog
):
    monkeypatch.setitem(trackers.FACTORIES, "tensorboard", lambda cfg, run_dir, ids: Raising())
    with caplog.at_level(logging.WARNING, logger="reval.trackers"):
        cfg = _run(tmp_path, "raising", 'metrics.trackers=["tensorboard"]')
    lines = [r.getMessage() for r in caplog.records if r.name == "reval.trackers"]
    assert len(lines) == 1, lines
    assert "tracker tensorboard failed" in lines[0] and "No space left" in lines[0]
    # The same run as without trackers (same seed): the same rows, the same result.
    got, want = read_jsonl(cfg.paths.metrics), read_jsonl(plain_run.paths.metrics)
    assert _timeless(got) == _timeless(want)
    summary = json.loads(cfg.paths.summary.read_text())
    assert summary == json.loads(plain_run.paths.summary.read_text())
    assert not (plain_run.run_dir / "tensorboard").exists()


def test_an_unknown_tracker_is_refused_at_config_load():
    with pytest.raises(ConfigError) as err:
        load_config(overrides=['metrics.trackers=["swanlab"]'], environ={})
    assert str(err.value).startswith(
        "metrics.trackers: unknown tracker 'swanlab'; known: tensorboard, wandb, mlflow, trackio"
    )
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("name", ["tensorboard", "wandb", "mlflow", "trackio"])
def test_a_tracker_not_installed_is_refused_with_its_install_line(monkeypatch, name):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda module, *a: None if module == name else real(module, *a),
    )
    with pytest.raises(ConfigError, match=rf"pip install 'reval\[{name}\]'"):
        load_config(overrides=[f'metrics.trackers=["{name}"]'], environ={})


def test_the_fan_out_logs_only_finite_numbers_and_rate_limits_its_lines(caplog):
    seen = []

    class Keeps:
        name = "keeps"

        def log_config(self, config): ...

        def log_row(self, step, row):
            seen.append((step, dict(row)))

        def close(self): ...

    both = trackers.Trackers([Raising(), Keeps()])
    with caplog.at_level(logging.WARNING, logger="reval.trackers"):
        for step in range(3):
            both.log_row(step, {"a": 1, "b": math.nan, "ok": True, "s": "x", "c": 2.5})
        both.close()
    assert seen == [(s, {"a": 1.0, "c": 2.5}) for s in range(3)]
    assert len([r for r in caplog.records if r.name == "reval.trackers"]) == 1


def test_a_resumed_run_hides_what_tensorboard_got_past_the_checkpoint(tmp_path):
    """A run killed at step 5 after its checkpoint at step 3 resumes from 3: TensorBoard shows
    steps 0-3 of the first process and 4-5 as the resumed one logged them; a fresh start in
    the same run directory starts an empty one."""
    cfg = load_config(overrides=['metrics.trackers=["tensorboard"]', *TINY[-1:]], environ={})
    run_dir = tmp_path / "run"

    def log(resume: bool, steps: range, value: float) -> None:
        made = trackers.build_trackers(cfg, run_dir, resume)
        for step in steps:
            made.log_row(step, {"loss": value + step})
        made.close()

    def series() -> list[tuple[int, float]]:
        acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
        acc.Reload()
        return [(e.step, e.value) for e in acc.Scalars("loss")]

    log(False, range(6), 0.0)
    (run_dir / "checkpoints" / "step-00000003").mkdir(parents=True)
    (run_dir / "checkpoints" / "latest").write_text("step-00000003")
    log(True, range(4, 6), 100.0)
    assert series() == [(0, 0.0), (1, 1.0), (2, 2.0), (3, 3.0), (4, 104.0), (5, 105.0)]
    log(False, range(2), 50.0)
    assert series() == [(0, 50.0), (1, 51.0)]


def test_the_evaluators_trackers_are_runs_of_their_own_beside_the_learners(tmp_path, monkeypatch):
    """``reval eval --follow`` (``eval_trackers``): W&B, MLflow and Trackio runs named
    ``NAME-eval`` (or the configured run name's), TensorBoard's ``tensorboard/eval``, ids in
    ``trackers-eval.json`` and continued when the evaluator starts again."""
    made = []

    class Keeps:
        def __init__(self, name, cfg, run_dir, ids):
            self.name = name
            ids.keep(name, f"{name}-id")
            made.append((name, cfg.metrics, run_dir, ids))

        def log_config(self, config): ...

        def close(self): ...

    for name in trackers.FACTORIES:
        monkeypatch.setitem(trackers.FACTORIES, name,
                            lambda cfg, d, ids, n=name: Keeps(n, cfg, d, ids))  # fmt: skip
    monkeypatch.setattr(trackers, "require_installed", lambda names: None)
    cfg = load_config(overrides=[f"output_dir={tmp_path}", "name=r", "metrics.wandb.run_name=w",
                                 'metrics.trackers=["tensorboard", "wandb", "mlflow"]'],
                      environ={})  # fmt: skip
    # (trackio is not in this lane's venv: named after the config's check, as the others)
    cfg.metrics.trackers.append("trackio")
    trackers.eval_trackers(cfg).close()
    by = {name: (m, run_dir, ids) for name, m, run_dir, ids in made}
    assert by["wandb"][0].wandb.run_name == "w-eval"
    assert by["mlflow"][0].mlflow.run_name == by["trackio"][0].trackio.run_name == "r-eval"
    assert by["tensorboard"][0].tensorboard_dir == str(tmp_path / "r" / "tensorboard" / "eval")
    assert {run_dir for _, run_dir, _ in by.values()} == {cfg.run_dir}  # (the learner's store)
    ids = json.loads((cfg.run_dir / "trackers-eval.json").read_text())
    assert ids == {n: f"{n}-id" for n in trackers.FACTORIES}
    assert not (cfg.run_dir / "trackers.json").exists()  # (the learner's ids untouched)
    made.clear()
    trackers.eval_trackers(cfg).close()
    assert all(ids.resume and ids.get(name) == f"{name}-id" for name, _, _, ids in made)
