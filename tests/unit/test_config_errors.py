"""Issue 25: a bad config key or value says, in one line, which key, where it came from (the file,
the environment variable, ``--set``) and, for an unknown key, the closest valid ones."""

from __future__ import annotations

from pathlib import Path

import pytest

from reval.config import ConfigError, build_config, did_you_mean, load_config


def _error(**kw) -> str:
    with pytest.raises(ConfigError) as err:
        load_config(**kw)
    return str(err.value)


def test_an_unknown_key_in_the_file_names_the_file_and_the_closest_key(tmp_path: Path):
    path = tmp_path / "run.toml"
    path.write_text("[learner]\nlearning_rate = 1e-3\n")
    message = _error(path=path, environ={})
    assert message == (
        f"learner.learning_rate: unknown key (from {path}); did you mean learner.lr?"
    )


def test_an_environment_typo_names_the_variable():
    message = _error(environ={"REVAL__LEARNER__ROUND": "5"})
    assert "learner.round: unknown key" in message
    assert "the environment variable REVAL__LEARNER__ROUND" in message
    assert "did you mean learner.rounds?" in message
    assert "\n" not in message


def test_a_set_typo_names_set():
    message = _error(overrides=["learner.round=5"], environ={})
    assert message == "learner.round: unknown key (from --set); did you mean learner.rounds?"


@pytest.mark.parametrize(
    ("unknown", "expected"),
    [
        ("learner.learning_rate", ["learner.lr"]),  # the initials of the words
        ("learner.round", ["learner.rounds"]),
        ("rollout.temprature", ["rollout.temperature"]),
        ("sync.weight_dir", ["sync.weights_dir"]),
        ("learner.beta", ["algo.beta"]),  # the field is in another section
        ("lerner", ["learner"]),
        ("nosuchsection", []),
    ],
)
def test_did_you_mean(unknown, expected):
    assert did_you_mean(unknown) == expected


def test_an_invalid_value_says_where_it_came_from(tmp_path: Path):
    path = tmp_path / "run.toml"
    path.write_text("[learner]\nlr = -1\n")
    assert _error(path=path, environ={}) == (
        f"learner.lr: Input should be greater than 0 (got -1 from {path})"
    )
    env = _error(path=path, environ={"REVAL__LEARNER__LR": "-2"})
    assert env == (
        "learner.lr: Input should be greater than 0 (got -2 from the environment variable "
        "REVAL__LEARNER__LR)"
    )
    cli = _error(path=path, overrides=["learner.lr=-3"], environ={"REVAL__LEARNER__LR": "-2"})
    assert cli == "learner.lr: Input should be greater than 0 (got -3 from --set)"


def test_one_self_contained_line_per_bad_field(tmp_path: Path):
    path = tmp_path / "run.toml"
    path.write_text("[lerner]\nrounds = 3\n")
    lines = _error(
        path=path, overrides=["learner.lr=-1", "model.tiny.num_heads=3"], environ={}
    ).splitlines()
    assert sorted(lines) == sorted([
        "model.tiny: model.tiny.num_heads must be divisible by num_kv_heads (from --set)",
        "learner.lr: Input should be greater than 0 (got -1 from --set)",
        f"lerner: unknown key (from {path}); did you mean learner?",
    ])  # fmt: skip


def test_without_origins_the_key_and_the_hint_remain():
    """``build_config`` of a mapping (the REST API's POSTed config) has no file or variable."""
    with pytest.raises(ConfigError) as err:
        build_config({"learner": {"learning_rate": 1e-3}})
    assert str(err.value) == "learner.learning_rate: unknown key; did you mean learner.lr?"


def test_a_mistyped_config_file_is_named_with_the_closest_one(tmp_path: Path):
    (tmp_path / "cpu_math.toml").write_text("")
    message = _error(path=tmp_path / "cpu-math.toml", environ={})
    assert message == (
        f"config file not found: {tmp_path / 'cpu-math.toml'} "
        f"(did you mean {str(tmp_path / 'cpu_math.toml')!r}?)"
    )


def test_a_secret_in_a_bad_value_is_not_shown():
    message = _error(environ={"REVAL__LEARNER__LR": "redis://:hunter2@host/0"})
    assert "hunter2" not in message and "REVAL__LEARNER__LR" in message
