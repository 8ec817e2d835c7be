"""Issue 25, the first hour as a user, on the CLI side: a run never overwrites another one (a
baseline gets its own name), errors are one line and fast, a normal `reval train` is quiet.
The REST side is in test_api.py and test_runs_cli.py, `reval eval`'s table in test_eval.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from reval.config import dump_config, load_config
from services.cli import another_run

ROOT = Path(__file__).resolve().parents[2]
# A run of a few seconds: the one-shot task on the tiny model, one batch per round.
TINY = [
    "task.kind=oneshot",
    "model.pretrain_steps=10",
    "rollout.prompts_per_round=4",
    "rollout.n=8",
    "rollout.max_new_tokens=3",
    "buffer.capacity=64",
    "learner.batch_size=32",
    "learner.rounds=2",
    "eval.every=1",
    "eval.samples_per_prompt=8",
]


def reval(*args: str, cwd: Path = ROOT, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """The CLI as a user runs it, in the user's environment less any reval settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("REVAL")}
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.run([sys.executable, "-m", "services.cli", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)  # fmt: skip


def sets(*overrides: str) -> list[str]:
    return [x for o in overrides for x in ("--set", o)]


def files(run: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}


def finished_demo(out: Path) -> Path:
    """``runs/demo`` as ``make demo`` leaves it: its config, summary and checkpoints."""
    demo = load_config(overrides=[f"output_dir={out}"], environ={})
    run = demo.run_dir
    (run / "checkpoints").mkdir(parents=True)
    dump_config(demo, run / "config.json")
    (run / "summary.json").write_text(json.dumps({"final_success": 0.9}))
    (run / "checkpoints" / "latest").write_text("step-00002400")
    return run


# -- runs never overwrite each other -------------------------------------------------------------


def test_train_refuses_another_runs_directory_before_importing_torch(tmp_path):
    """`reval train --set learner.rounds=30` after `make demo` replaced runs/demo's summary,
    config and latest checkpoint: now one line naming the ways out, nothing touched, refused
    before torch is even imported."""
    run = finished_demo(tmp_path)
    before = files(run)
    rounds = json.loads((run / "config.json").read_text())["learner"]["rounds"]
    probe = ("import sys; from services.cli import main; rc = main(sys.argv[1:]); "
             "print('torch' in sys.modules); raise SystemExit(rc)")  # fmt: skip
    for extra in ([], ["--algo", "grpo", "--set", "name=demo"]):  # (a named baseline too)
        done = subprocess.run(
            [sys.executable, "-c", probe, "train", *extra,
             *sets(f"output_dir={tmp_path}", "learner.rounds=30")],
            cwd=ROOT, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert done.returncode == 2, done.stderr
        assert done.stdout.strip() == "False"  # torch was never imported
        lines = done.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith("reval train: "), done.stderr
        assert f"learner.rounds {rounds} -> 30" in lines[0]
        assert "--set name=demo-2" in lines[0] and "--overwrite" in lines[0]
    assert files(run) == before


def test_the_service_refuses_a_one_process_runs_directory(tmp_path, redis_url, redis_prefix):
    """`reval learner` (and `reval launch`) after `make demo`, on the same name without
    `--resume`: it wrote its config over runs/demo's and moved `latest` to its own step 0; now
    one line naming the ways out, and nothing touched."""
    run = finished_demo(tmp_path)
    before = files(run)
    service = sets(
        f"output_dir={tmp_path}",
        "buffer.backend=redis",
        f"redis.url={redis_url}",
        f"redis.prefix={redis_prefix}",
    )
    for command in ("learner", "launch"):
        done = reval(command, *service, timeout=120)
        assert done.returncode == 2, done.stderr
        lines = done.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"reval {command}: {run} holds another run")
        assert "buffer.backend 'memory' -> 'redis'" in lines[0], lines[0]
        assert "--set name=demo-2" in lines[0] and "--resume" in lines[0]
    assert files(run) == before


def test_the_same_run_again_is_not_another_run(tmp_path, monkeypatch):
    """`make demo` twice reruns in place; where the run goes and how it is watched do not make
    it another run; checkpoints with no config are another run's."""
    monkeypatch.chdir(tmp_path)
    cfg = load_config(overrides=[f"output_dir={tmp_path}"], environ={})
    assert another_run(cfg) is None  # nothing there yet
    cfg.run_dir.mkdir()
    dump_config(cfg, cfg.run_dir / "config.json")
    assert another_run(cfg) is None
    watched = ["output_dir=.", "metrics.progress=false", "metrics.prometheus_port=9100"]
    assert another_run(load_config(overrides=watched, environ={})) is None
    other = another_run(load_config(overrides=[f"output_dir={tmp_path}", "seed=7"], environ={}))
    assert other is not None and f"seed {cfg.seed} -> 7" in other
    (cfg.run_dir / "config.json").unlink()
    (cfg.run_dir / "checkpoints").mkdir()
    (cfg.run_dir / "checkpoints" / "latest").write_text("step-00000004")
    assert another_run(cfg) is not None


@pytest.mark.timeout(600)
def test_a_baseline_trains_in_its_own_directory_quietly_and_overwrite_replaces(tmp_path):
    """`reval train --algo tbrm` after `make demo` is the run demo-tbrm: runs/demo is left as it
    was. The run prints no library warning (transformers' FutureWarning from generation and
    torch's UserWarning from the checkpoint were on every run). Run again with another config it
    is refused, and with --overwrite it replaces the old run wholly."""
    demo = finished_demo(tmp_path)
    before = files(demo)
    done = reval("train", "--algo", "tbrm", "--no-progress",
                 *sets(f"output_dir={tmp_path}", *TINY))  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert files(demo) == before
    run = tmp_path / "demo-tbrm"
    assert str(run) in done.stdout
    saved = json.loads((run / "config.json").read_text())
    assert saved["name"] == "demo-tbrm" and saved["algo"]["name"] == "tbrm"
    # Quiet: not one warning from transformers or torch in what the user sees.
    noise = [line for line in (done.stdout + done.stderr).splitlines() if "Warning" in line]
    assert noise == [] and "Traceback" not in done.stderr
    (run / "notes.txt").write_text("of the first run")

    again = reval("train", "--algo", "tbrm", "--no-progress",
                  *sets(f"output_dir={tmp_path}", *TINY, "learner.rounds=3"))  # fmt: skip
    assert again.returncode == 2 and len(again.stderr.splitlines()) == 1, again.stderr
    assert "learner.rounds 2 -> 3" in again.stderr
    replaced = reval("train", "--algo", "tbrm", "--no-progress", "--overwrite",
                     *sets(f"output_dir={tmp_path}", *TINY, "learner.rounds=3"))  # fmt: skip
    assert replaced.returncode == 0, replaced.stderr[-3000:]
    assert json.loads((run / "config.json").read_text())["learner"]["rounds"] == 3
    assert json.loads((run / "summary.json").read_text())["rounds"] == 3
    assert not (run / "notes.txt").exists()  # nothing of the replaced run stays
    assert files(demo) == before


# -- errors in one line, fast --------------------------------------------------------------------


@pytest.mark.parametrize(
    "args",
    [
        ["train"],
        ["eval", "--benchmarks", "math500", "--no-progress"],
        ["learner", "--set", "buffer.backend=redis"],
        ["rollout", "--set", "buffer.backend=redis"],
        ["launch", "--set", "buffer.backend=redis"],
    ],
)
def test_a_missing_model_path_is_one_line_at_once(tmp_path, args):
    """configs/cpu_math.toml before `reval make-model`: `runs/wordmath-model` with runs/ there
    was a minute of hub retries and a traceback. Now every command says it in one line, in
    under 5 s, and nothing is written."""
    (tmp_path / "runs").mkdir()
    t0 = time.monotonic()
    done = reval(*args, "--set", "model.name_or_path=runs/no-such-model", cwd=tmp_path,
                 timeout=120)  # fmt: skip
    seconds = time.monotonic() - t0
    lines = done.stderr.splitlines()
    assert done.returncode == 2, done.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith(f"reval {args[0]}: "), done.stderr[-3000:]
    assert "runs/no-such-model" in lines[0] and "Traceback" not in done.stderr
    assert seconds < 5, seconds
    assert [p.name for p in (tmp_path / "runs").iterdir()] == []


def test_reval_eval_names_its_checkpoint_in_one_line(tmp_path):
    (tmp_path / "runs").mkdir()
    done = reval("eval", "--checkpoint", "runs/no-such-model", "--no-progress", cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and "--checkpoint" in done.stderr, done.stderr


@pytest.mark.timeout(300)
def test_dataset_errors_are_one_line_and_the_run_writes_nothing(tmp_path):
    """A mistyped dataset (found before the heavy imports) and a dataset that exists but has no
    usable row (found while the run is built): one line each, exit status 2, no run directory."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.jsonl").write_text(json.dumps({"question": "1 + 1", "answer": "2"}) + "\n")
    (data / "empty.jsonl").write_text(json.dumps({"problem": "1 + 1"}) + "\n")
    math = ["task.kind=math", "model.pretrain_steps=0", f"output_dir={tmp_path / 'runs'}"]
    for dataset, needle in (("data/trian.jsonl", "task.dataset"), ("data/empty.jsonl", "rows")):
        done = reval("train", "--no-progress", *sets(*math, f"task.dataset={dataset}"),
                     cwd=tmp_path)  # fmt: skip
        assert done.returncode == 2, done.stderr[-3000:]
        lines = done.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith("reval train: "), done.stderr[-3000:]
        assert needle in lines[0]
    assert not (tmp_path / "runs").exists()


def test_a_bad_config_is_one_line(tmp_path):
    for args in (["train", "--set", "learner.learning_rate=1"],
                 ["rollout", "--set", "rollout.n=0"],
                 ["runs", "create", "--set", "learner.lr=-1"]):  # fmt: skip
        done = reval(*args, cwd=tmp_path)
        assert done.returncode == 2, done.stderr
        lines = done.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"reval {args[0]}: "), done.stderr
        assert args[-1].split("=")[0] in lines[0]
