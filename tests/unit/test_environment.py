"""Multi-turn environments (issue 28): episodes through the HF engine with the calculator tool,
the action mask over exactly the environment's tokens, misbehaving environments counted and
skipped, a bad ``task.environment`` refused at load."""

from __future__ import annotations

import logging
from fractions import Fraction
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from learner.sequence import collate, pack
from reval.config import BUILTIN_ENVIRONMENTS, ConfigError, TaskConfig, load_config
from reval.paths import check_run_paths
from reval.policy import build_char_tokenizer
from rollout.calculator import CalculatorEnv, answer_matches, evaluate, show
from rollout.collect import collect_round
from rollout.collect import evaluate as evaluate_success
from rollout.engines import HFEngine, SamplingParams
from rollout.environment import (
    EpisodeLimits,
    EpisodeRunner,
    Step,
    as_step,
    builtin_environments,
    environment_factory,
)
from rollout.task_types import Prompt
from rollout.tasks import ExactMatch
from services.cli import main as cli_main

TOK = build_char_tokenizer()
EOS = TOK.eos_token_id
PAD = TOK.pad_token_id


class ScriptedLM(nn.Module):
    """A causal LM for the HF engine that writes ``turns[k]`` then EOS as its k-th turn (k = the
    EOS tokens in the context it is given): the engine, the episode loop and the environment
    run for real, the model's words are fixed."""

    def __init__(self, turns: list[str]) -> None:
        super().__init__()
        self.turns = [[*TOK(t, add_special_tokens=False).input_ids, EOS] for t in turns]
        self.vocab = len(TOK)

    def forward(self, input_ids, attention_mask=None, past_key_values=None, **_: Any):
        if past_key_values is None:  # prefill: which turn each row is in
            rows = [
                ids[m.bool()].tolist() for ids, m in zip(input_ids, attention_mask, strict=True)
            ]
            state = [[min(r.count(EOS), len(self.turns) - 1), 0] for r in rows]
        else:
            state = [[turn, k + 1] for turn, k in past_key_values]
        logits = torch.full((len(state), 1, self.vocab), -30.0)
        for i, (turn, k) in enumerate(state):
            script = self.turns[turn]
            logits[i, 0, script[min(k, len(script) - 1)]] = 30.0
        return SimpleNamespace(logits=logits, past_key_values=state)


def _engine(turns: list[str]) -> HFEngine:
    return HFEngine(ScriptedLM(turns), PAD, EOS)


PROMPT = Prompt(id="p0", text="Ana has 3 bags of 4 apples. How many?", answer="12")


class _Task:
    name = "word"
    prompts = (PROMPT,)
    verifier = ExactMatch()


RUNNER = EpisodeRunner(CalculatorEnv, EpisodeLimits(max_turns=4, max_tokens=96))


def _round(engine: HFEngine, runner: EpisodeRunner = RUNNER, n: int = 2, prompt=PROMPT):
    params = SamplingParams(n=n, temperature=1.0, max_new_tokens=24)
    return collect_round(engine, TOK, _Task(), [prompt], params, seed=3,
                         reward_variant="binary", group_prefix="r", episodes=runner)  # fmt: skip


def test_a_tool_episode_masks_exactly_the_environments_tokens():
    result = _round(_engine(["<calc>3*4</calc>", "\\boxed{12}"]))
    assert len(result.trajectories) == 2 and result.episodes_skipped == {}
    for t in result.trajectories:
        ids, mask = t.response_ids, t.action_mask
        obs = TOK("<result>12</result>", add_special_tokens=False).input_ids
        turn1 = [*TOK("<calc>3*4</calc>", add_special_tokens=False).input_ids, EOS]
        turn2 = [*TOK("\\boxed{12}", add_special_tokens=False).input_ids, EOS]
        assert ids.tolist() == turn1 + obs + turn2
        assert mask.tolist() == [1] * len(turn1) + [0] * len(obs) + [1] * len(turn2)
        assert (t.logprobs[mask == 0] == 0).all() and (t.logprobs[mask == 1] < 0.01).all()
        assert t.reward_raw == 1.0 and t.finish_reason == "stop"
    assert result.turns_mean == 2.0
    assert result.tokens == sum(int(t.action_mask.sum()) for t in result.trajectories)
    # The learner's mask is the action mask, padded or packed (the EOS ending turn 1 cuts
    # nothing).
    for batch in (collate(result.trajectories, PAD, EOS), pack(result.trajectories, PAD, EOS)):
        for row, t in zip(batch.mask, result.trajectories, strict=True):
            assert row[: t.response_ids.size].tolist() == t.action_mask.tolist()


def test_a_wrong_answer_and_the_turn_limit_score_zero():
    wrong = _round(_engine(["<calc>3*4</calc>", "\\boxed{13}"]))
    assert [t.reward_raw for t in wrong.trajectories] == [0.0, 0.0]
    runner = EpisodeRunner(CalculatorEnv, EpisodeLimits(max_turns=4, max_tokens=200))
    looping = _round(_engine(["<calc>1+1</calc>"] * 9), runner)  # never answers
    for t in looping.trajectories:
        assert t.reward_raw == 0.0 and t.finish_reason == "length"
        assert int(t.action_mask.sum()) == 4 * 17  # 4 turns of 16 chars + EOS
        assert t.response_ids[-1] == EOS  # the last turn is the model's (no observation after)


def test_the_token_limit_ends_an_episode_with_length():
    runner = EpisodeRunner(CalculatorEnv, EpisodeLimits(max_turns=4, max_tokens=30))
    result = _round(_engine(["<calc>3*4</calc>", "\\boxed{12}"]), runner)
    for t in result.trajectories:
        assert t.response_ids.size <= 30 and t.finish_reason == "length"
        assert t.reward_raw == 0.0


def test_no_environment_is_the_single_turn_path():
    params = SamplingParams(n=2, max_new_tokens=24)
    result = collect_round(_engine(["12"]), TOK, _Task(), [PROMPT], params, seed=3,
                           reward_variant="binary", group_prefix="r")  # fmt: skip
    assert all(t.action_mask.size == 0 and t.reward_raw == 1.0 for t in result.trajectories)


def test_evaluate_scores_episodes_by_their_reward():
    good = evaluate_success(_engine(["<calc>3*4</calc>", "\\boxed{12}"]), TOK, _Task(),
                            [PROMPT], 2, 1.0, 24, seed=0, episodes=RUNNER)  # fmt: skip
    bad = evaluate_success(_engine(["\\boxed{7}"]), TOK, _Task(), [PROMPT], 2, 1.0, 24,
                           seed=0, episodes=RUNNER)  # fmt: skip
    assert (good.success, bad.success) == (1.0, 0.0)
    # (each prompt's first episode, as the trackers' table shows it: prompt, text, reward)
    assert good.answers[0][0] == PROMPT.text and good.answers[0][2] == 1.0
    assert "boxed{7}" in bad.answers[0][1] and bad.answers[0][2] == 0.0


# -- environments that misbehave: counted, skipped, logged --------------------------------------


class _Raises:
    def start(self, prompt):
        pass

    def step(self, message):
        raise RuntimeError("tool crashed")


class _BadStart(_Raises):
    def start(self, prompt):
        raise KeyError("no such row")


class _WrongType(_Raises):
    def step(self, message):
        return {"observation": "x", "reward": 1, "done": True}


class _NanReward(_Raises):
    def step(self, message):
        return ("", float("nan"), True)


class _Flaky(_Raises):
    """Misbehaves on every other episode."""

    made = 0

    def __init__(self) -> None:
        type(self).made += 1
        self.bad = type(self).made % 2 == 0

    def step(self, message):
        if self.bad:
            return "done"
        return Step("", 1.0, True)


@pytest.mark.parametrize(
    ("env", "reason", "words"),
    [
        (_Raises, "step_failed", "RuntimeError: tool crashed"),
        (_BadStart, "start_failed", "KeyError"),
        (_WrongType, "bad_step", "step returned dict"),
        (_NanReward, "bad_step", "not finite"),
    ],
)
def test_a_misbehaving_environment_loses_its_episodes_only(env, reason, words, caplog):
    runner = EpisodeRunner(env, EpisodeLimits(max_turns=3, max_tokens=64))
    with caplog.at_level(logging.WARNING, logger="reval.environment"):
        result = _round(_engine(["\\boxed{12}"]), runner, n=3)
    assert result.trajectories == [] and result.episodes_skipped == {reason: 3}
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3 and all(f"episode skipped ({reason})" in x and words in x
                                   for x in lines)  # fmt: skip


def test_the_good_episodes_of_a_round_go_on():
    _Flaky.made = 0
    runner = EpisodeRunner(_Flaky, EpisodeLimits(max_turns=3, max_tokens=64))
    result = _round(_engine(["\\boxed{12}"]), runner, n=4)
    assert result.episodes_skipped == {"bad_step": 2}
    assert [t.reward_raw for t in result.trajectories] == [1.0, 1.0]


@pytest.mark.parametrize(
    ("value", "ok"),
    [(Step("a", 1.0, False), True), (("a", 1, True), True), (("a", True, True), False),
     (("a", 1.0, "yes"), False), ((b"a", 1.0, True), False), (("a", 1.0), False), (None, False)],
)  # fmt: skip
def test_as_step(value, ok):
    if ok:
        assert isinstance(as_step(value), Step)
    else:
        with pytest.raises(ValueError):
            as_step(value)


# -- the calculator ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("expr", "value"),
    [("3*4", 12), ("7 - 9", -2), ("(1+2)/4", Fraction(3, 4)), ("2.5+1", Fraction(7, 2)),
     ("-(3)", -3)],
)  # fmt: skip
def test_calculator_arithmetic(expr, value):
    assert evaluate(expr) == value


@pytest.mark.parametrize("expr", ["__import__('os')", "2**99999", "1/0", "x+1", "9" * 70, "1+"])
def test_calculator_refuses_anything_else(expr):
    with pytest.raises(ValueError):
        evaluate(expr)
    env = CalculatorEnv()
    env.start(PROMPT)
    assert env.step(f"<calc>{expr}</calc>") == Step("<result>error</result>", 0.0, False)


def test_calculator_answers():
    assert show(Fraction(7, 2)) == "3.5" and show(Fraction(1, 3)) == "1/3"
    assert answer_matches("so \\boxed{\\frac{1}{2}}", "0.5")
    assert answer_matches("\\boxed{x + 3}", "x+3") and not answer_matches("\\boxed{4}", "x+3")
    assert answer_matches(" -2 ", "-2")


# -- the config --------------------------------------------------------------------------------


def test_builtin_names_match_the_config():
    assert set(builtin_environments()) == set(BUILTIN_ENVIRONMENTS)
    assert environment_factory(TaskConfig(environment="calculator")) is CalculatorEnv
    assert environment_factory(TaskConfig()) is None


def test_an_environment_by_file_path_loads(tmp_path):
    path = tmp_path / "my_env.py"
    path.write_text(
        "from rollout.environment import Step\n"
        "class Echo:\n"
        "    def start(self, prompt): self.gold = prompt.answer\n"
        "    def step(self, message): return Step('', float(message == self.gold), True)\n"
    )
    cfg = TaskConfig(environment=f"{path}:Echo")
    result = _round(_engine(["12"]), EpisodeRunner.from_config(cfg))
    assert [t.reward_raw for t in result.trajectories] == [1.0, 1.0]


def test_a_malformed_environment_is_refused_when_the_config_loads():
    with pytest.raises(ConfigError) as err:
        load_config(overrides=["task.environment=calculatorr"], environ={})
    message = str(err.value)
    assert message.startswith("task.environment:") and "\n" not in message
    assert "is not 'package.module:name' or 'path/to/file.py:name'" in message


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        ("no_such_module_xyz:Env", "cannot import 'no_such_module_xyz'"),
        ("rollout.calculator:NoSuchEnv", "has no 'NoSuchEnv'"),
        ("rollout.calculator:MAX_EXPRESSION_CHARS", "is a int, not callable"),
        ("/nonexistent/env.py:Env", "no file"),
    ],
)
def test_a_bad_environment_is_refused_before_any_work(spec, words):
    """The config parses (nothing is imported then: the REST API confines a file first); every
    command's start (``check_run_paths``) imports it, one line naming the field."""
    cfg = load_config(overrides=[f"task.environment={spec}"], environ={})
    with pytest.raises(ValueError) as err:
        check_run_paths(cfg)
    message = str(err.value)
    assert message.startswith("task.environment:") and words in message and "\n" not in message
    with pytest.raises(ValueError, match=r"task\.environment"):
        EpisodeRunner.from_config(cfg.task)


def test_reval_train_with_an_environment_that_raises_on_import_stops_in_one_line(tmp_path, capsys):
    path = tmp_path / "broken.py"
    path.write_text("raise RuntimeError('missing API key')\n")
    code = cli_main(["train", "--set", f"task.environment={path}:Env",
                     "--set", f"output_dir={tmp_path}"])  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err
    assert "task.environment: cannot import" in err and "RuntimeError: missing API key" in err
    assert not (tmp_path / "demo").exists()  # nothing was started


def test_episode_arrays_are_typed():
    result = _round(_engine(["<calc>3*4</calc>", "\\boxed{12}"]), n=1)
    t = result.trajectories[0]
    assert t.response_ids.dtype == np.int32 and t.action_mask.dtype == np.uint8
