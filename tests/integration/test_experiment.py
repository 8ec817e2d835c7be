"""`reval experiment oneshot`, shortened: the runs stop at the exact-success threshold, the
table, JSON and figure are written, a method that needs fewer rounds shows it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_oneshot_study_smoke(tmp_path):
    out = tmp_path / "oneshot"
    done = subprocess.run(
        [sys.executable, "-m", "services.cli", "experiment", "oneshot", "--seeds", "1",
         "--max-rounds", "25", "--difficulties", "medium", "--methods", "grpo,reval-8",
         "--out", str(out), "--set", "model.pretrain_steps=100"],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "| medium (0.40) |" in done.stdout
    report = json.loads((out / "oneshot.json").read_text())
    assert (out / "oneshot.png").stat().st_size > 1000
    cells = {c["method"]: c for c in report["cells"]}
    for c in cells.values():
        assert abs(c["curve"][0] - 0.40) < 0.05  # the calibrated start, computed exactly
        if c["rounds"] is not None:  # stopped where the exact success crossed 0.95
            assert c["curve"][-1] >= 0.95 and max(c["curve"][:-1]) < 0.95
            assert len(c["curve"]) == c["rounds"] + 1
    assert cells["reval-8"]["rounds"] is not None  # reuse reaches it within 25 rounds here
    cmd = [sys.executable, "-m", "services.cli", "experiment", "oneshot", "--methods", "ppo"]
    bad = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    assert bad.returncode == 2 and "unknown" in bad.stderr
