"""The real model and data path end to end, through the commands a user runs: ``reval make-data``,
``reval make-model``, ``reval train --config configs/cpu_math.toml`` and ``reval eval`` on the
held-out files. The short test checks that the path runs; the ``slow`` one that held-out success
rises (docs/demo.md, "The real model and data path")."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([sys.executable, "-m", "services.cli", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return done


KINDS = "decimal,expression,fraction"
"""The kinds the preset's model learns at its size (configs/cpu_math.toml)."""


def make(tmp: Path, pretrain_steps: int, per_kind: int = 200) -> tuple[Path, Path]:
    data, model = tmp / "data", tmp / "model"
    cli("make-data", str(data), "--per-kind", str(per_kind), "--kinds", KINDS)
    cli("make-model", str(model), "--data", str(data / "train.jsonl"), "--template", "plain",
        "--pretrain-steps", str(pretrain_steps))  # fmt: skip
    return data, model


def preset(tmp: Path, data: Path, model: Path, *extra: str) -> list[str]:
    sets = [f"output_dir={tmp / 'runs'}", f"model.name_or_path={model}",
            f"task.dataset={data / 'train.jsonl'}", f"eval.dataset={data / 'test.jsonl'}",
            *extra]  # fmt: skip
    out = ["--config", str(ROOT / "configs" / "cpu_math.toml"), "--no-progress"]
    for s in sets:
        out += ["--set", s]
    return out


@pytest.mark.timeout(600)
def test_train_then_eval_on_the_held_out_files(tmp_path: Path) -> None:
    data, model = make(tmp_path, pretrain_steps=5, per_kind=20)
    cli("train", *preset(tmp_path, data, model, "learner.rounds=2", "eval.every=0",
                         "rollout.prompts_per_round=4", "rollout.n=4", "learner.batch_size=16",
                         "eval.samples_per_prompt=1"))  # fmt: skip
    run = tmp_path / "runs" / "cpu_math"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["rounds"] == 2 and summary["policy_version"] > 0
    final = run / "final"
    assert json.loads((final / "tokenizer_config.json").read_text())["tokenizer_class"] == (
        "Qwen2Tokenizer"
    )  # the export keeps the hub-style tokenizer
    out = tmp_path / "eval.json"
    cli("eval", "--checkpoint", str(final), "--benchmarks", "wordmath", "--data",
        str(data / "benchmarks"), "--out", str(out), "--no-progress",
        "--config", str(ROOT / "configs" / "cpu_math.toml"),
        "--set", "eval.samples_per_prompt=2", "--set", "rollout.verifier_workers=1")  # fmt: skip
    report = json.loads(out.read_text())
    word = report["benchmarks"]["wordmath"]
    held_out = [json.loads(line) for line in (data / "test.jsonl").read_text().splitlines()]
    assert word["problems"] == len(held_out) and word["k"] == 2
    assert word["skipped_too_long"] == 0
    assert 0.0 <= word["avg_at_k"] <= 1.0


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_cpu_math_preset_learns_held_out_problems(tmp_path: Path) -> None:
    """configs/cpu_math.toml as shipped (seed 0): held-out success rises clearly above its start."""
    data, model = make(tmp_path, pretrain_steps=300)
    cli("train", *preset(tmp_path, data, model), timeout=1700)
    summary = json.loads((tmp_path / "runs" / "cpu_math" / "summary.json").read_text())
    assert summary["success_before_rl"] < 0.2, summary  # about chance: the format, not the answers
    assert summary["final_success"] >= summary["success_before_rl"] + 0.5, summary
