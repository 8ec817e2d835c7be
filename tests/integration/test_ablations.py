"""`reval ablate`: each ablation's variants really differ in what they vary, run, and their
figures and tables are written (tiny settings: a few rounds, a short pretraining)."""

from __future__ import annotations

import json

import pytest

from services.ablations import ABLATIONS, main, run_ablation
from services.cli_args import build_parser

TINY = (
    "model.pretrain_steps=20",
    "eval.every=2",
    "rollout.prompts_per_round=8",
    "learner.batch_size=64",
    "learner.micro_batch_size=64",
)


def test_every_ablation_varies_a_real_config_field():
    from reval.config import load_config
    from services.ablations import ROOT

    for name, ab in ABLATIONS.items():
        cfgs = [
            load_config(str(ROOT / "configs" / "demo.toml"), [*ab.base, *variant])
            for _, variant in ab.variants
        ]
        dumps = {c.model_dump_json() for c in cfgs}
        assert len(dumps) == len(cfgs), name  # no two variants are the same run


def test_beta_ablation_writes_its_table_and_figure(tmp_path):
    report = run_ablation("beta", tmp_path, seeds=1, rounds=4, overrides=TINY,
                          runs_dir=tmp_path / "runs")  # fmt: skip
    assert [r["variant"] for r in report["rows"]] == ["beta 0.01", "beta 0.1", "beta 1"]
    for r in report["runs"]:
        rounds = [p["round"] for p in r["curve"]]
        assert rounds == list(range(0, 5))
        # The KL estimate is recorded for every round with an update (ReVal has a reference).
        assert all("log_ratio_mean" in p for p in r["curve"][1:])
    saved = json.loads((tmp_path / "beta.json").read_text())
    assert saved["rows"] == report["rows"]
    assert (tmp_path / "beta.png").stat().st_size > 10_000
    assert "| beta 0.1 |" in (tmp_path / "beta.md").read_text()


def test_rounds_ablation_counts_rounds_and_seconds_to_the_threshold(tmp_path):
    report = run_ablation("rounds", tmp_path, seeds=1, rounds=3, overrides=TINY,
                          runs_dir=tmp_path / "runs")  # fmt: skip
    for row, run in zip(report["rows"], report["runs"], strict=True):
        ev = [p for p in run["curve"] if "eval_success" in p]
        hit = [p for p in ev if p["eval_success"] >= report["threshold"]]
        want = hit[0]["round"] if hit else None
        assert row["rounds_to_threshold"] == want


def test_cli_refuses_bad_arguments(capsys):
    args = build_parser().parse_args(["ablate", "beta", "--seeds", "0"])
    assert main(args) == 2
    assert "--seeds" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        build_parser().parse_args(["ablate", "nope"])
