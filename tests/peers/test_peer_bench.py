"""benchmarks/peer_bench.py's smoke run (``--quick``): TRL's GRPO and reval's GRPO for two rounds
each, in their own processes, write the table, the JSON and the figure; both start from the same
pretrained model (the same round-0 evaluation) and generate the same budget per round."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest

pytestmark = pytest.mark.peers  # tests/conftest.py collects tests/peers only where trl is


def test_quick_run_writes_table_and_figure(tmp_path: Path, peer_bench: ModuleType) -> None:
    out, runs_dir = tmp_path / "out", tmp_path / "runs"
    argv = ["--quick", "--variants", "TRL GRPO", "reval GRPO",
            "--out", str(out), "--runs-dir", str(runs_dir)]  # fmt: skip
    assert peer_bench.main(argv) == 0
    report = json.loads((out / "peers.json").read_text())
    assert (out / "peers.png").stat().st_size > 0
    table = (out / "peers.md").read_text()
    assert "| TRL GRPO |" in table and "| reval GRPO |" in table
    runs = {r["variant"]: r for r in report["runs"]}
    assert set(runs) == {"TRL GRPO", "reval GRPO"}
    for run in runs.values():
        assert [p["round"] for p in run["curve"]] == [0, 1, 2]
        assert [p["trajectories"] for p in run["curve"]] == [0, 512, 1024]
        assert all("eval_success" in p for p in run["curve"])
        assert run["learner_tokens"] > 1024 and run["learner_s"] > 0 and run["peak_rss_mb"] > 0
    # The same pretrained model and the same evaluation seeds: identical success before training.
    assert (
        runs["TRL GRPO"]["curve"][0]["eval_success"]
        == runs["reval GRPO"]["curve"][0]["eval_success"]
    )
