"""benchmarks/peer_bench.py's smoke run (``--quick``): TRL's GRPO and reval's GRPO for two rounds
each, in their own processes, write the table, the JSON and the figure; both start from the same
pretrained model (the same round-0 evaluation) and generate the same budget per round."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("trl")

pytestmark = pytest.mark.peers

ROOT = Path(__file__).resolve().parents[2]


def _bench():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location(
        "peer_bench", ROOT / "benchmarks" / "peer_bench.py"
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["peer_bench"] = mod  # (its dataclasses look their module up there)
    spec.loader.exec_module(mod)
    return mod


def test_quick_run_writes_table_and_figure(tmp_path: Path) -> None:
    out, runs_dir = tmp_path / "out", tmp_path / "runs"
    argv = ["--quick", "--variants", "TRL GRPO", "reval GRPO",
            "--out", str(out), "--runs-dir", str(runs_dir)]  # fmt: skip
    assert _bench().main(argv) == 0
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
