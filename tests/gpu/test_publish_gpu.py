"""The learner's weight publication on one CUDA device, at Qwen2.5-1.5B's shape: the time
``WeightSender.send(model, version)`` holds the learner (files on, a hub with no members, until
the device has done the work send queued) against the floor any send pays (each parameter's full
tensor in bf16, packed into pooled device buckets), measured in one run by
``benchmarks/sync_bench.py --gpu`` in a process of its own (a 1-rank NCCL group). Marked ``gpu``:
not in the default run; skipped where no CUDA device is visible."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

ROOT = Path(__file__).resolve().parents[2]
SLACK_S = 0.05
"""Fixed costs allowed on top of 1.5 x the floor (Python per bucket, the hub's store call)."""


@pytest.mark.timeout(900)
def test_send_at_the_1_5b_shape_costs_at_most_1_5x_the_floor(tmp_path):
    out = tmp_path / "sync_gpu.json"
    cmd = [
        sys.executable, str(ROOT / "benchmarks" / "sync_bench.py"), "--gpu",
        "--sizes", "qwen2.5-1.5b", "--reps", "3", "--warmup", "1",
        "--out", str(out), "--weights-dir", str(tmp_path),
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=840)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    print(proc.stdout)
    (r,) = json.loads(out.read_text())["results"]
    assert r["nbytes"] == 2 * r["params"]  # one copy in bf16 (tied embeddings sent once)
    send, floor = r["median_s"]["send"], r["median_s"]["floor"]
    assert send <= 1.5 * floor + SLACK_S, (
        f"send {send:.4f} s vs floor {floor:.4f} s (gathers only {r['median_s']['gather']:.4f} s,"
        f" send returned after {r['median_s']['send_returns']:.4f} s)"
    )
