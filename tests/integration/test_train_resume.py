"""`reval train` as an operator meets it (issue 38): a first line at once, the pretraining's
progress, Ctrl-C and SIGTERM that keep a checkpoint (one line, exit 130/143, no traceback),
`--resume` that continues it, checkpoints by time, and a stopped run that a fresh start does
not silently replace. The run is the one-shot task's tiny one (tests/integration/test_train.py),
with rounds enough to be stopped by hand."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from reval.config import dump_config, load_config
from reval.metrics import read_jsonl
from services.cli import main
from services.train import train

ROOT = Path(__file__).resolve().parents[2]

TINY = [
    "task.kind=oneshot",
    "task.oneshot_base_success=0.4",
    "model.pretrain_steps=60",
    "rollout.prompts_per_round=4",
    "rollout.n=8",
    "rollout.max_new_tokens=3",
    "rollout.temperature=1.0",
    "buffer.capacity=256",
    "learner.batch_size=32",
    "learner.updates_per_round=2",
    "learner.lr=3e-3",
    "learner.ref_reset_steps=5",
    "algo.beta=0.2",
    "eval.every=5",
    "eval.samples_per_prompt=16",
    "metrics.plot=false",
]
ENDLESS = [*TINY, "model.pretrain_steps=20", "learner.rounds=100000",
           "learner.checkpoint_every=0", "learner.checkpoint_every_s=0"]  # fmt: skip
"""Rounds until stopped; no periodic checkpoint: the one there is the stop's."""


def sets(*overrides: str) -> list[str]:
    return [x for o in overrides for x in ("--set", o)]


class Train:
    """``reval train`` in a subprocess, its stdout and stderr read line by line as they come,
    each line with the seconds since the process was started."""

    def __init__(self, *args: str) -> None:
        self.lines: queue.Queue[tuple[float, str] | None] = queue.Queue()
        self.seen: list[tuple[float, str]] = []
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "services.cli", "train", *args],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(ROOT)},
        )  # fmt: skip
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put((time.monotonic() - self.t0, line.rstrip("\n")))
        self.lines.put(None)

    def wait_for(self, text: str, timeout: float = 120.0) -> tuple[float, str]:
        """The first line (from here on) that holds ``text``: its time and text."""
        deadline = time.monotonic() + timeout
        while True:
            item = self.lines.get(timeout=max(deadline - time.monotonic(), 0.01))
            assert item is not None, f"exited ({self.proc.wait()}) without {text!r}:\n{self.out}"
            self.seen.append(item)
            if text in item[1]:
                return item

    def finish(self, timeout: float = 120.0) -> int:
        rc = self.proc.wait(timeout=timeout)
        while (item := self.lines.get(timeout=10)) is not None:
            self.seen.append(item)
        return rc

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    @property
    def out(self) -> str:
        return "\n".join(line for _, line in self.seen)


def rounds_written(run: Path, at_least: int, timeout: float = 120.0) -> None:
    """Wait until ``metrics.jsonl`` holds round ``at_least``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        path = run / "metrics.jsonl"
        if path.is_file() and any(r["round"] >= at_least for r in read_jsonl(path)):
            return
        time.sleep(0.2)
    raise AssertionError(f"round {at_least} not written in {timeout} s")


def latest_state(run: Path) -> tuple[str, dict]:
    """The name of the run's latest checkpoint and its ``reval_state.json``."""
    name = (run / "checkpoints" / "latest").read_text().strip()
    return name, json.loads((run / "checkpoints" / name / "reval_state.json").read_text())


def test_first_line_at_once_then_the_pretrainings_progress(tmp_path):
    """The first line (what runs, where) comes within 5 s of the start, before torch is even
    imported; the pretraining then reports its progress before the first round starts."""
    run = Train("--no-progress", *sets(*ENDLESS, f"output_dir={tmp_path}", "name=t"))
    try:
        t_first, first = run.wait_for("", timeout=60)
        assert first.startswith("reval train: run t -> ") and str(tmp_path / "t") in first, first
        assert t_first < 5.0, (t_first, first)
        run.wait_for("round 1 of 100000")
    finally:
        run.kill()
    lines = [line for _, line in run.seen]
    progress = [i for i, line in enumerate(lines) if "pretraining: step" in line]
    assert progress, run.out
    assert "step 20/20 (100%)" in lines[progress[-1]] and "loss" in lines[progress[-1]]
    assert progress[-1] < len(lines) - 1  # (the round's line came after it)


def test_ctrl_c_keeps_a_checkpoint_and_resume_continues_it(tmp_path):
    """Ctrl-C mid-run: the round in hand ends, a checkpoint is written, one line says where and
    how to continue, exit status 130, no traceback. A plain rerun is refused (it would replace
    the stopped run); `--resume` continues from the checkpoint (the round after it, the step
    carried on, metrics.jsonl appended to, no second pretraining) and SIGTERM stops it the same
    way with 143."""
    args = ["--no-progress", *sets(*ENDLESS, f"output_dir={tmp_path}", "name=t")]
    run_dir = tmp_path / "t"
    first = Train(*args)
    try:
        first.wait_for("round 1 of")
        rounds_written(run_dir, 3)
        first.proc.send_signal(signal.SIGINT)
        rc = first.finish(timeout=60)
    finally:
        first.kill()
    assert rc == 130, first.out[-3000:]
    assert "Traceback" not in first.out and "KeyboardInterrupt" not in first.out, first.out
    last = first.out.splitlines()[-1]
    assert last.startswith("reval train: stopped by Ctrl-C after round "), last
    assert "--resume" in last and "continue with: reval train" in last, last
    latest, state = latest_state(run_dir)
    stopped_round, stopped_step = state["round"], state["step"]
    assert f"after round {stopped_round} (step {stopped_step})" in last, (last, state)
    assert stopped_round >= 3 and stopped_step == 2 * stopped_round
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["round"] for r in rows] == list(range(stopped_round + 1))
    assert not (run_dir / "summary.json").exists() and not (run_dir / "final").exists()

    again = subprocess.run([sys.executable, "-m", "services.cli", "train", *args], cwd=ROOT,
                           capture_output=True, text=True, timeout=60)  # fmt: skip
    assert again.returncode == 2 and len(again.stderr.splitlines()) == 1, again.stderr
    assert "holds a stopped run" in again.stderr and "--resume" in again.stderr
    assert (run_dir / "checkpoints" / latest).is_dir()  # (nothing touched)

    second = Train(*args, "--resume")
    try:
        _, said = second.wait_for("reval train: run t")
        assert "resuming from" in said and f"round {stopped_round}" in said, said
        second.wait_for(f"resumed from {run_dir / 'checkpoints' / latest}")
        rounds_written(run_dir, stopped_round + 3)
        second.proc.send_signal(signal.SIGTERM)
        rc = second.finish(timeout=60)
    finally:
        second.kill()
    assert rc == 143, second.out[-3000:]
    assert "Traceback" not in second.out and "pretraining: step" not in second.out, second.out
    assert second.out.splitlines()[-1].startswith("reval train: stopped by SIGTERM after round")
    rows = read_jsonl(run_dir / "metrics.jsonl")
    rounds = [r["round"] for r in rows]
    assert rounds == list(range(len(rows))), rounds  # appended: 0..stopped, then on
    assert rows[stopped_round + 1]["policy_version"] == stopped_step + 2  # the step carried on
    _, state = latest_state(run_dir)
    assert state["round"] == rounds[-1] and state["step"] == 2 * rounds[-1]


def test_resume_without_a_checkpoint_is_one_line(tmp_path, capsys):
    rc = main(["train", "--resume", *sets(*TINY, f"output_dir={tmp_path}", "name=t")])
    assert rc == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "--resume: no checkpoint under" in err[0], err


def test_a_stopped_run_is_not_replaced_by_a_fresh_start(tmp_path, capsys):
    """A directory with this run's config and a checkpoint but no summary (stopped, or killed
    after a periodic checkpoint): a plain `reval train` there names both ways on, one line."""
    cfg = load_config(overrides=[*TINY, f"output_dir={tmp_path}", "name=t"], environ={})
    step = cfg.paths.checkpoints / "step-00000008"
    step.mkdir(parents=True)
    (step / "reval_state.json").write_text(json.dumps({"round": 4, "step": 8}))
    (cfg.paths.checkpoints / "latest").write_text(step.name)
    dump_config(cfg, cfg.paths.config)
    rc = main(["train", "--no-progress", *sets(*TINY, f"output_dir={tmp_path}", "name=t")])
    assert rc == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "holds a stopped run (checkpoint at round 4, step 8)" in err[0], err
    assert "--resume" in err[0] and "--overwrite" in err[0]
    assert step.is_dir()


def test_checkpoints_by_time(tmp_path):
    """learner.checkpoint_every_s: a checkpoint when that long has passed since the last, with
    checkpoints by count off; the newest learner.keep_checkpoints (3) are kept."""
    cfg = load_config(
        overrides=[*TINY, "learner.rounds=4", "learner.checkpoint_every=0",
                   "learner.checkpoint_every_s=0.001", "metrics.progress=false",
                   f"output_dir={tmp_path}", "name=t"],
        environ={},
    )  # fmt: skip
    train(cfg)
    steps = sorted(p.name for p in cfg.paths.checkpoints.glob("step-*"))
    assert steps == ["step-00000004", "step-00000006", "step-00000008"], steps
    rounds = [
        json.loads((cfg.paths.checkpoints / s / "reval_state.json").read_text())["round"]
        for s in steps
    ]
    assert rounds == [2, 3, 4]


def test_a_finished_run_reruns_in_place_and_says_so(tmp_path, capsys):
    """The same config over a finished run (a summary): the first line says it starts over, and
    nothing of the old run's checkpoints is left beside the new run's."""
    overrides = [*TINY, "learner.rounds=1", f"output_dir={tmp_path}", "name=t"]
    cfg = load_config(overrides=overrides, environ={})
    old = cfg.paths.checkpoints / "step-00000999"
    old.mkdir(parents=True)
    (old / "reval_state.json").write_text(json.dumps({"round": 500, "step": 999}))
    (cfg.paths.checkpoints / "latest").write_text(old.name)
    dump_config(cfg, cfg.paths.config)
    cfg.paths.summary.write_text(json.dumps({"rounds": 500}))
    assert main(["train", "--no-progress", *sets(*overrides)]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert "starting over (the finished run there is replaced)" in first, first
    assert sorted(p.name for p in cfg.paths.checkpoints.glob("step-*")) == ["step-00000002"]
    assert json.loads(cfg.paths.summary.read_text())["rounds"] == 1


def test_resume_after_a_hard_kill_runs_the_rounds_past_the_checkpoint_again(tmp_path):
    """A run killed hard after its checkpoint at round 2 had logged round 3: `--resume` drops
    that row (round 3 runs again, from the checkpoint's step) and appends the rest."""
    overrides = [*TINY, "metrics.progress=false", f"output_dir={tmp_path}", "name=t"]
    first = train(load_config(overrides=[*overrides, "learner.rounds=2"], environ={}))
    run = first.run_dir
    with (run / "metrics.jsonl").open("a") as f:
        f.write(json.dumps({"round": 3, "policy_version": 6, "reward_mean": -1.0}) + "\n")
    (run / "summary.json").unlink()
    cfg = load_config(overrides=[*overrides, "learner.rounds=4"], environ={})
    res = train(cfg, resume=True)
    rows = read_jsonl(run / "metrics.jsonl")
    assert [r["round"] for r in rows] == [0, 1, 2, 3, 4]
    assert rows[3]["reward_mean"] >= 0 and rows[3]["policy_version"] == 6  # the real round 3
    assert res.step == 8 and res.round == 4 and res.initial_success == rows[0]["eval_success"]
    assert json.loads((run / "summary.json").read_text())["rounds"] == 4
