"""The demo: `configs/demo.toml` as `make demo` runs it.

The default run shortens it to 200 of its 600 rounds (the curve's rise comes 50 rounds later on
some CPUs than on others: kernels round differently and the RL loop amplifies it, docs/demo.md).
The `slow` test runs the whole demo on its two slowest seeds and holds it to the bar of every
seed: >= 0.8 success at the last round."""

from __future__ import annotations

import pytest

from reval.config import load_config
from services.train import train


def test_shortened_demo_learns_addition(tmp_path):
    cfg = load_config(
        overrides=[
            "learner.rounds=200",
            "eval.every=50",
            f"output_dir={tmp_path}",
            "metrics.progress=false",
        ],
        environ={},
    )
    res = train(cfg)
    assert res.initial_success < 0.12  # near chance: 1/19 answers
    evals = [r["eval_success"] for r in res.history if r.get("eval_success") is not None]
    assert evals[-1] > res.initial_success + 0.1, evals
    first = sum(r["reward_mean"] for r in res.history[1:31]) / 30
    last = sum(r["reward_mean"] for r in res.history[-30:]) / 30
    assert last > first + 0.05, (first, last)


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 2])
def test_full_demo_learns_on_every_seed(tmp_path, seed):
    """`make demo` with a seed (about three minutes each here). Seeds 0 and 2 are the slow ones
    of the K = 5 schedule: 0.89 and 0.94 at round 600 (docs/demo.md, "The whole round fresh");
    with K = 4 and the round fresh, seed 1 stalled at 0.26, and with the earlier model and
    sampling at 1.0, seed 3 levelled off near 0.77."""
    cfg = load_config(
        overrides=[f"seed={seed}", f"output_dir={tmp_path}", "metrics.progress=false"],
        environ={},
    )
    res = train(cfg)
    assert res.initial_success < 0.12
    assert res.final_success >= 0.8, [r.get("eval_success") for r in res.history]
