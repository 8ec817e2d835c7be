"""benchmarks/peer_bench.py's table (no TRL needed): medians count the seeds that never reached
the threshold, and the GRPO line compares reval's with TRL's over all seeds."""

from __future__ import annotations

import argparse
from types import ModuleType


def test_censored_median_counts_unreached_seeds_as_slowest(peer_bench: ModuleType) -> None:
    med = peer_bench.censored_median
    assert med([100.0, None, 300.0]) == 300.0  # not 200: the unreached seed is the slowest
    assert med([100.0, 200.0, 300.0]) == 200.0
    assert med([None, 100.0, None]) is None  # fewer than half reached
    assert med([100.0, None]) is None
    assert med([100.0, 300.0, None, None]) is None
    assert med([100.0, 300.0, 500.0, None]) == 400.0
    assert med([]) is None


def test_table_states_the_grpo_gap_over_all_seeds(peer_bench: ModuleType) -> None:
    bench = peer_bench

    def run(variant: str, seed: int, reached_at: int | None):
        curve = [{"round": float(r), "trajectories": float(512 * r), "train_s": float(r),
                  "eval_success": 0.5 if reached_at is not None and r >= reached_at else 0.0}
                 for r in range(0, 301, 10)]  # fmt: skip
        return bench.RunResult(variant, seed, curve=curve, learner_tokens=1.0, learner_s=1.0)

    runs = [run("TRL GRPO", 0, 100), run("TRL GRPO", 1, 200), run("TRL GRPO", 2, None)]
    runs += [run("reval GRPO", 0, 110), run("reval GRPO", 1, 220), run("reval GRPO", 2, 250)]
    args = argparse.Namespace(rounds=300, temperature=1.0, eval_every=10, threshold=0.2)
    out = bench.summarize(runs, args)
    assert out["grpo_gap"] == 220 / 200 - 1.0
    assert "112640 vs 102400 (+10%)" in out["table"]
    row = next(r for r in out["rows"] if r["variant"] == "TRL GRPO")
    assert row["reached"] == "2/3" and row["median_trajectories_all_seeds"] == 200 * 512
