"""`reval experiment oneshot`, shortened: the runs stop at the exact-success threshold, the
table, JSON and figure are written, a method that needs fewer rounds shows it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_oneshot_study_smoke(tmp_path):
    out = tmp_path / "oneshot"
    done = subprocess.run(
        [sys.executable, "-m", "services.cli", "experiment", "oneshot", "--seeds", "1",
         "--max-rounds", "25", "--difficulties", "medium", "--methods", "grpo,reval-8",
         "--beta-grid", "0.1,0.3", "--lr-grid", "1e-3,1e-2", "--select-seeds", "1",
         "--workers", "2", "--out", str(out), "--set", "model.pretrain_steps=100"],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "| medium (0.40) |" in done.stdout
    report = json.loads((out / "oneshot.json").read_text())
    assert (out / "oneshot.png").stat().st_size > 1000
    assert (out / "oneshot-tuned.png").stat().st_size > 1000
    cells = report["cells"]
    # Selection runs (beta, learning rates) never use the seeds whose results are reported.
    assert report["seeds"] == [0] and report["selection_seeds"] == [100]
    beta_runs = [c for c in cells if c["seed"] == 100 and c["lr"] == 1e-3 and c["method"] ==
                 "reval-8"]  # fmt: skip
    assert sorted(c["beta"] for c in beta_runs) == [0.1, 0.3]
    sel = report["beta_selection"]
    scores = {float(k): v for k, v in sel["scores"].items()}
    assert sel["chosen"] == min(scores, key=lambda b: (scores[b], b)) == report["beta"]
    assert {c["beta"] for c in cells if c["method"] != "grpo" and c["seed"] == 0} == {sel["chosen"]}
    # Each method's tuned lr is the best of its grid on the selection seeds, then used on seed 0.
    for method, lr in report["lr_selection"]["chosen"].items():
        lscores = {float(k): v for k, v in report["lr_selection"]["scores"][method].items()}
        assert set(lscores) == {1e-3, 1e-2}
        assert lr == min(lscores, key=lambda x: (lscores[x], x))
        assert any(c["method"] == method and c["seed"] == 0 and c["lr"] == lr for c in cells)
        assert report["tuned"]["lr"][method] == lr
    shared = [c for c in cells if c["seed"] == 0 and c["lr"] == 1e-3]
    for c in cells:
        assert abs(c["curve"][0] - 0.40) < 0.05  # the calibrated start, computed exactly
        if c["rounds"] is not None:  # stopped where the exact success crossed 0.95
            assert c["curve"][-1] >= 0.95 and max(c["curve"][:-1]) < 0.95
            assert len(c["curve"]) == c["rounds"] + 1
        else:
            assert len(c["curve"]) == 26 and max(c["curve"]) < 0.95
    by_method = {c["method"]: c for c in shared}
    assert by_method["reval-8"]["rounds"] is not None  # reuse reaches it within 25 rounds here
    med = report["shared"]["medians"]["medium"]
    assert med["reval-8"] == by_method["reval-8"]["rounds"]
    assert med["grpo"] == (by_method["grpo"]["rounds"] or 26)
    assert report["shared"]["median_updates"]["medium"]["reval-8"] == 8 * med["reval-8"]
    assert "## Each method at its own learning rate" in (out / "oneshot.md").read_text()


def test_oneshot_rejects_bad_arguments():
    cli = [sys.executable, "-m", "services.cli", "experiment", "oneshot"]
    for extra, msg in (
        (["--methods", "ppo"], "unknown"),
        (["--lr-grid", "1e-3,-1"], "positive"),
        (["--beta-grid", "x"], "--beta-grid"),
        (["--workers", "0"], "--workers"),
    ):
        bad = subprocess.run(cli + extra, cwd=ROOT, capture_output=True, text=True)
        assert bad.returncode == 2 and msg in bad.stderr, (extra, bad.stderr[-500:])


PARENT = """
import os, sys, time
from services.experiments import worker_pool
with worker_pool(2) as pool:
    pids = sorted({pool.submit(os.getpid).result() for _ in range(8)})
    print(" ".join(map(str, pids)), flush=True)
    for _ in pids:
        pool.submit(time.sleep, 300)
    time.sleep(300)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}").exists() and "Z" not in Path(f"/proc/{pid}/stat").read_text()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_killed_experiment_leaves_no_workers(tmp_path):
    """SIGKILL of `reval experiment` (its exit handlers never run): the pool's workers, busy
    with a run, end within seconds (they used to run on through the whole queue)."""
    parent = subprocess.Popen([sys.executable, "-c", PARENT], cwd=ROOT, stdout=subprocess.PIPE,
                              text=True)  # fmt: skip
    try:
        assert parent.stdout is not None
        workers = [int(p) for p in parent.stdout.readline().split()]
        assert workers and all(_alive(p) for p in workers)
        time.sleep(0.5)  # both busy sleeping
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(p) for p in workers), "orphaned experiment workers still run"
    finally:
        parent.kill()
