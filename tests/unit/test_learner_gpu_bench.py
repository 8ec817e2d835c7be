"""benchmarks/learner_gpu_bench.py's GPU mode, run on the CPU (the same code: one gloo rank,
FSDP2 shards, the project's Learner against a plain HF step), and the flash varlen attention's
fallback where the kernel is not there."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from learner import sequence

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # about a minute on two idle cores: eight cases, a warm-up each
def test_gpu_mode_runs_every_case_on_the_cpu(tmp_path):
    out, prof = tmp_path / "bench.json", tmp_path / "prof"
    args = ["--gpu", "--device", "cpu", "--shape", "tiny", "--scale", "128", "--reps", "1",
            "--out", str(out), "--profile", str(prof)]  # fmt: skip
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "learner_gpu_bench.py"), *args],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    facts = json.loads(out.read_text())
    got = {(r["lengths"], r["update"]) for r in facts["rows"]}
    updates = {"ReVal, reference computed", "ReVal, reference cached", "GRPO", "plain HF step"}
    assert got == {(k, u) for k in ("equal", "RL-like") for u in updates}
    for r in facts["rows"]:
        assert r["s"] > 0 and math.isfinite(r["tokens_per_s"]) and 0 < r["mfu"] < 1, r
    # computing the reference adds its forward's FLOPs to the same tokens
    by = {(r["lengths"], r["update"]): r for r in facts["rows"]}
    computed, cached = by[("equal", "ReVal, reference computed")], by[("equal", "GRPO")]
    assert computed["mfu"] * computed["s"] > cached["mfu"] * cached["s"]
    assert set(facts["ratio_vs_hf"]) == {"equal", "RL-like"}
    assert "activation checkpointing off" in run.stdout  # the plan, printed
    table = (prof / "tiny-RL-like.txt").read_text()  # one update profiled
    assert "Self CPU" in table and "aten::" in table


def test_flash_varlen_falls_back_once_where_the_kernel_refuses(monkeypatch, caplog):
    monkeypatch.setattr(sequence, "_VARLEN_FAILED", [])
    q = torch.randn(1, 2, 6, 4)  # CPU tensors: torch's varlen kernel is CUDA only
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    assert sequence._flash_varlen(q, q, q, cu, None) is None
    assert len(sequence._VARLEN_FAILED) == 1
    assert "per-sequence sdpa" in caplog.text
    assert sequence._flash_varlen(q, q, q, cu, None) is None  # not retried
    assert len(sequence._VARLEN_FAILED) == 1
