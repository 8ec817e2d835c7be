from __future__ import annotations

import json
from pathlib import Path

import pytest

from reval.config import (
    CONFIG_DIR,
    ConfigError,
    RunConfig,
    build_config,
    dump_config,
    env_overrides,
    load_config,
    parse_overrides,
)


def test_defaults_and_demo_preset_are_valid():
    cfg = load_config()
    assert cfg.name == "demo"
    assert cfg.task.kind == "addition"
    assert cfg.round_size == cfg.rollout.prompts_per_round * cfg.rollout.n
    assert cfg.batch_size == cfg.learner.batch_size
    assert load_config(overrides=["learner.batch_size=null"], environ={}).batch_size == (
        cfg.round_size
    )


@pytest.mark.parametrize(
    ("name", "beta"), [("r1_distill_qwen_1p5b.toml", 0.002), ("qwen25_math_7b.toml", 0.02)]
)
def test_paper_presets(name, beta):
    cfg = load_config(CONFIG_DIR / name, environ={})
    assert cfg.algo.beta == beta
    assert cfg.buffer.capacity == 5120
    assert cfg.batch_size == 1024 == cfg.rollout.prompts_per_round * cfg.rollout.n
    assert cfg.learner.updates_per_round == 2
    assert cfg.learner.lr == 1e-6
    assert cfg.learner.ref_reset_steps == 200
    assert cfg.rollout.max_new_tokens == 8192
    assert cfg.model.name_or_path


def test_cli_and_env_overrides_apply_in_order():
    cfg = load_config(
        overrides=["learner.lr=0.5", "algo.name=tbrm", "learner.adam_betas=[0.8, 0.9]"],
        environ={"REVAL__LEARNER__LR": "0.25", "REVAL__SEED": "17", "OTHER": "x"},
    )
    assert cfg.learner.lr == 0.5  # --set beats the environment
    assert cfg.seed == 17
    assert cfg.algo.name == "tbrm"
    assert cfg.learner.adam_betas == (0.8, 0.9)
    assert env_overrides({"REVAL__A__B_C": "1"}) == {"a": {"b_c": 1}}


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ("learner.lrr=1", "learner.lrr"),
        ("learner.lr=-1", "learner.lr"),
        ("algo.name=ppo", "algo.name"),
        ("rollout.n=zero", "rollout.n"),
        ("model.tiny.num_heads=3", "model.tiny"),
        ("nosuchsection.x=1", "nosuchsection"),
    ],
)
def test_invalid_values_name_the_field(override, field):
    with pytest.raises(ConfigError) as err:
        load_config(overrides=[override], environ={})
    assert field in str(err.value)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["model.tiny.head_dim=null", "model.tiny.hidden_size=60", "model.tiny.num_heads=8"],
         "divisible by num_heads"),
        (["model.tiny.head_dim=33"], "even"),
        (["model.tiny.num_heads=6", "model.tiny.num_kv_heads=4"], "num_kv_heads"),
    ],
)  # fmt: skip
def test_tiny_shape_rules(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(overrides=overrides, environ={})


def test_tiny_head_size_is_its_own_or_the_width_per_head():
    assert load_config(environ={}).model.tiny.head_size == 32  # heads of 32 at width 64
    free = load_config(
        overrides=["model.tiny.hidden_size=60", "model.tiny.num_heads=6"], environ={}
    )
    assert free.model.tiny.head_size == 32  # the width need not divide when head_dim is set
    derived = load_config(overrides=["model.tiny.head_dim=null"], environ={})
    assert derived.model.tiny.head_size == 16


def test_cross_field_rules():
    with pytest.raises(ConfigError, match="capacity"):
        build_config({"buffer": {"capacity": 10}})
    with pytest.raises(ConfigError, match="on-policy"):
        build_config({"algo": {"name": "grpo"}})  # K=2 by default
    ok = build_config(
        {"algo": {"name": "grpo"}, "learner": {"updates_per_round": 1, "first_update_fresh": True}}
    )
    assert ok.algo.name == "grpo"
    with pytest.raises(ConfigError, match="first_update_fresh"):
        build_config({"learner": {"batch_size": 1000}, "buffer": {"capacity": 2000}})


def test_malformed_overrides_and_files(tmp_path: Path):
    with pytest.raises(ConfigError, match=r"section\.field=value"):
        parse_overrides(["learner.lr"])
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[learner\nlr = 1")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad)


def test_resolved_dump_round_trips(tmp_path: Path):
    cfg = load_config(overrides=["learner.rounds=3", "algo.beta=0.5"], environ={})
    dump_config(cfg, tmp_path / "config.json")
    data = json.loads((tmp_path / "config.json").read_text())
    assert data["learner"]["rounds"] == 3
    assert "micro_batch_size" in data["learner"]  # defaults are written out too
    loaded = RunConfig.model_validate(data)
    assert loaded.model_dump(mode="json") == data  # the resolved config reloads as written
    assert loaded.samples_per_insert == cfg.samples_per_insert  # (derived values written out)
    assert loaded.model_copy(update={"buffer": cfg.buffer}) == cfg


def test_config_module_imports_without_torch():
    import subprocess
    import sys

    code = "import sys, reval.config, buffer.records, reval.rewards; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_samples_per_insert_follows_the_schedule_unless_set(tmp_path):
    import json

    from reval.config import dump_config

    sets = ["learner.updates_per_round=4", "learner.batch_size=64", "rollout.prompts_per_round=16",
            "rollout.n=8"]  # fmt: skip
    cfg = load_config(overrides=sets, environ={})
    assert cfg.buffer.samples_per_insert is None and cfg.samples_per_insert == 4 * 64 / 128
    # A study's copy with another K follows (nothing was baked in at validation).
    other = cfg.model_copy(deep=True)
    other.learner.updates_per_round = 8
    assert other.samples_per_insert == 4.0
    dump_config(other, tmp_path / "c.json")
    assert json.loads((tmp_path / "c.json").read_text())["buffer"]["samples_per_insert"] == 4.0
    grpo = load_config(overrides=["algo.name=grpo", "learner.updates_per_round=1"], environ={})
    assert grpo.samples_per_insert == 1.0
    fixed = load_config(overrides=["buffer.samples_per_insert=3"], environ={})
    assert fixed.samples_per_insert == 3.0


# -- issue 19: strict types and bounds ------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        ({"learner": {"lr": float("inf")}}, "learner.lr: Input should be a finite number"),
        ({"algo": {"beta": float("inf")}}, "algo.beta: Input should be a finite number"),
        ({"learner": {"grad_clip": float("inf")}}, "learner.grad_clip: Input should be a finite"),
        ({"algo": {"tis_cap": float("nan")}}, "algo.tis_cap: Input should be a finite number"),
        ({"buffer": {"capacity": 1e12}}, "buffer.capacity: Input should be less than or equal"),
        ({"learner": {"rounds": True}}, "learner.rounds: a boolean (True)"),
        ({"sync": {"broadcast_port": False}}, "sync.broadcast_port: a boolean"),
        ({"learner": {"adam_betas": [2, -1]}}, "learner.adam_betas.0: Input should be less than 1"),
        ({"learner": {"adam_betas": [0.9, -1]}}, "learner.adam_betas.1: Input should be greater"),
    ],
)
def test_non_finite_out_of_bounds_and_boolean_numbers_are_refused(data, needle):
    with pytest.raises(ConfigError) as err:
        build_config(data)
    assert needle in str(err.value)


def test_the_same_through_overrides_and_the_environment():
    with pytest.raises(ConfigError, match=r"learner\.lr: Input should be a finite number"):
        load_config(overrides=["learner.lr=Infinity"], environ={})
    with pytest.raises(ConfigError, match=r"learner\.rounds"):
        load_config(environ={"REVAL__LEARNER__ROUNDS": "true"})
    ok = build_config({"metrics": {"jsonl": False}, "buffer": {"max_staleness": None}})
    assert ok.metrics.jsonl is False  # (a bool where a bool belongs)


@pytest.mark.parametrize("nproc", ["0", "-1", "two"])
def test_nproc_must_be_a_positive_integer(nproc, capsys):
    from services.cli import main

    with pytest.raises(SystemExit) as err:
        main(["learner", "--nproc", nproc])
    assert err.value.code == 2
    assert "--nproc" in capsys.readouterr().err


@pytest.mark.parametrize("path", ["/no/such/model", "./missing", "~/missing-model", "a/b/c"])
def test_a_missing_local_model_path_is_named_not_a_hub_error(path):
    from reval.paths import ModelNotFound
    from reval.policy import model_source

    with pytest.raises(ModelNotFound, match=r"model\.name_or_path: the local .* does not exist"):
        model_source(path)
    assert model_source("Qwen/Qwen2.5-Math-7B") == "Qwen/Qwen2.5-Math-7B"  # a hub id


def test_the_configs_are_a_checkouts_else_an_installs(tmp_path: Path):
    """A checkout's ``configs/`` sits beside its ``pyproject.toml``; an install's configs are
    data files under a data root (the prefix, or ``pip install --user``'s base). A stray
    ``site-packages/configs`` (another package's) is not taken for a checkout."""
    from reval.config.run import _config_dir

    checkout = tmp_path / "checkout"
    (checkout / "configs").mkdir(parents=True)
    (checkout / "pyproject.toml").write_text("")
    module = checkout / "reval" / "config" / "run.py"
    assert _config_dir(module, roots=[]) == checkout / "configs"

    site = tmp_path / "lib" / "site-packages"
    (site / "configs").mkdir(parents=True)  # (a stray one, no pyproject.toml beside it)
    prefix, user = tmp_path / "prefix", tmp_path / "user"
    (user / "share" / "reval" / "configs").mkdir(parents=True)
    installed = site / "reval" / "config" / "run.py"
    assert _config_dir(installed, roots=[prefix, user]) == user / "share" / "reval" / "configs"
    (prefix / "share" / "reval" / "configs").mkdir(parents=True)
    assert _config_dir(installed, roots=[prefix, user]) == prefix / "share" / "reval" / "configs"


def test_a_service_learner_checkpoints_by_default():
    """Without a word from the operator the learner keeps checkpoints by updates and by time
    (issue 38: a learner killed at step 632 came back at step 0 when the default was none)."""
    for name in ("demo.toml", "qwen25_math_7b.toml"):
        learner = load_config(CONFIG_DIR / name, environ={}).learner
        assert learner.checkpoint_every > 0 and 0 < learner.checkpoint_every_s <= 3600, name
