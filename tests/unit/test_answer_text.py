"""Answers graded as generated (issue 37): one stop set per tokenizer (EOS, the generation
config's list, the chat template's end of turn) that both engines stop on, and one answer text
(cut at the first stop token, special tokens kept) at every place that grades; what an answer cut
at the token limit earns (``algo.truncated_reward``, DAPO's soft overlong penalty) and that its
reward function is told (``finish_reason``)."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from reval.answers import answer_text, end_of_turn_id, generation_eos_ids, stop_token_ids
from reval.config import AlgoConfig, ModelConfig
from reval.policy import QWEN_CHAT_TEMPLATE, build_char_tokenizer, load_policy
from rollout.collect import Truncation, collect_round, score_all
from rollout.engines import HFEngine, Sample, SamplingParams
from rollout.grading.custom import RewardFunction, takes_finish_reason
from rollout.grading.math_grading import MathVerify
from rollout.streaming import Group, group_records
from rollout.task_types import Prompt
from rollout.vllm_engine import VLLMEngine, sampling_kwargs

TOK = build_char_tokenizer()
EOS = int(TOK.eos_token_id)  # type: ignore[arg-type]
UNK = int(TOK.unk_token_id)  # type: ignore[arg-type]


def ids(text: str) -> list[int]:
    return list(TOK(text, add_special_tokens=False).input_ids)


def two_ends() -> Any:
    """A Qwen-style tokenizer that declares two ends: EOS ``<|endoftext|>``, and a chat template
    that ends each turn with ``<|im_end|>`` (the project's char tokenizer plus Qwen's special
    tokens and Qwen2.5's template; no hub)."""
    tok = build_char_tokenizer()
    tok.add_special_tokens(
        {"additional_special_tokens": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]}
    )
    tok.eos_token = "<|endoftext|>"
    tok.chat_template = QWEN_CHAT_TEMPLATE
    return tok


class MathTask:
    """The math grader (math-verify), in this process."""

    name = "math"
    prompts: tuple[Prompt, ...] = ()

    class verifier:
        @staticmethod
        def score(prompt: Prompt, response: str) -> float:
            return MathVerify().grade(prompt.answer, response)


def _sample(tokens: list[int], reason: str = "stop") -> Sample:
    arr = np.asarray(tokens, np.int32)
    return Sample(arr, np.full(arr.size, -0.1, np.float32), reason)  # type: ignore[arg-type]


def test_an_unk_inside_the_box_is_graded_as_written_and_eos_ends_the_answer():
    hostile = [*ids("\\boxed{4"), UNK, *ids("7}"), EOS]
    clean = [*ids("\\boxed{47}"), EOS]
    stops = stop_token_ids(TOK)
    assert stops == (EOS,)
    assert answer_text(TOK, hostile, stops) == "\\boxed{4<unk>7}"
    assert answer_text(TOK, clean, stops) == "\\boxed{47}"
    assert answer_text(TOK, [*ids("12"), EOS, *ids("34")], stops) == "12"  # cut at the first
    # Through the streaming worker's grading (the decode site the issue found): 0, then 1.0.
    group = Group("g", Prompt("p", "q", "47"), [1], [_sample(hostile), _sample(clean)],
                  [np.array([0, 0], np.int32)] * 2, 0.0)  # fmt: skip
    _, raw = group_records(group, MathTask(), TOK, "binary", stop_ids=stops)
    assert raw == [0.0, 1.0]


def test_the_stop_set_has_eos_the_generation_configs_list_and_the_end_of_turn(tmp_path):
    tok = two_ends()
    endoftext, im_end = tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_end|>"])
    assert end_of_turn_id(tok) == im_end
    assert stop_token_ids(tok) == (endoftext, im_end)
    assert stop_token_ids(tok, [im_end, endoftext, 7]) == (endoftext, im_end, 7)
    assert stop_token_ids(tok, 5) == (endoftext, 5, im_end)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [3, 4]}))
    assert generation_eos_ids(tmp_path) == [3, 4]
    assert generation_eos_ids(tmp_path / "nowhere") == []
    # The tiny policy: the char tokenizer (no template) and its model's generation config.
    assert load_policy(ModelConfig(device="cpu")).stop_ids == (EOS,)


class Script(nn.Module):
    """A causal LM for ``HFEngine`` that writes ``script`` whatever the prompt."""

    def __init__(self, script: list[int], vocab: int) -> None:
        super().__init__()
        self.script, self.vocab = script, vocab

    def forward(self, input_ids, past_key_values=None, **_: Any):
        k = 0 if past_key_values is None else past_key_values + 1
        logits = torch.full((input_ids.shape[0], 1, self.vocab), -30.0)
        logits[:, 0, self.script[min(k, len(self.script) - 1)]] = 30.0
        return SimpleNamespace(logits=logits, past_key_values=k)


def test_both_engines_stop_at_the_end_of_turn_of_a_tokenizer_with_two_ends():
    tok = two_ends()
    stops = stop_token_ids(tok)
    endoftext, im_end = stops
    script = [*tok("7", add_special_tokens=False).input_ids, im_end, 9, 9, endoftext]
    model = Script(script, len(tok))
    params = SamplingParams(n=2, max_new_tokens=8)
    old = HFEngine(model, int(tok.pad_token_id), endoftext)  # EOS only: runs past the turn
    assert old.generate([[5]], params, seed=0)[0][0].token_ids.tolist() == script
    engine = HFEngine(model, int(tok.pad_token_id), endoftext, stop_ids=stops)
    for s in engine.generate([[5]], params, seed=0)[0]:
        assert s.token_ids.tolist() == script[:2] and s.finish_reason == "stop"
        assert answer_text(tok, s.token_ids, engine.stop_ids) == "7"
    # vLLM gets the same set: every request's SamplingParams(stop_token_ids=...).
    assert sampling_kwargs(params, None, stops)["stop_token_ids"] == [endoftext, im_end]
    vllm = VLLMEngine.__new__(VLLMEngine)  # (the adapter's own methods; vLLM not needed)
    vllm.stop_ids = stops
    vllm._vllm = SimpleNamespace(SamplingParams=lambda **kw: kw)
    assert vllm._sampling_params(params, None)["stop_token_ids"] == [endoftext, im_end]
    assert vllm._finish_reason("length", np.array([3, im_end])) == "stop"
    assert vllm._finish_reason("length", np.array([3, 4])) == "length"


def test_a_truncated_answer_earns_zero_by_default_and_dapos_penalty_is_eq_13():
    raw = [1.0, 1.0, 0.5]
    reasons = ["stop", "length", "length"]
    assert Truncation().apply(raw, reasons, None) == [1.0, 0.0, 0.0]
    assert Truncation("graded").apply(raw, reasons, None) == raw
    # L_max 100, L_cache 20: 0 up to 80 tokens, then linear down to -1 at 100.
    dapo = Truncation("graded", 20, 100)
    assert [dapo.penalty(n) for n in (10, 80, 90, 100)] == [0.0, 0.0, -0.5, -1.0]
    assert dapo.apply([1.0, 1.0], ["stop", "length"], [90, 100]) == [0.5, 0.0]
    algo = AlgoConfig()
    assert (algo.truncated_reward, algo.overlong_penalty_tokens, algo.mask_truncated) == (
        "zero", 0, False)  # fmt: skip
    assert Truncation.from_config(algo, 12) == Truncation("zero", 0, 12)


def test_a_cut_answer_is_not_counted_as_a_full_one_in_a_round():
    stop_after = [*ids("47"), EOS]
    engine = HFEngine(Script(stop_after, len(TOK)), int(TOK.pad_token_id), EOS)  # type: ignore[arg-type]

    class Exact:
        name, prompts = "exact", ()

        class verifier:
            @staticmethod
            def score(prompt: Prompt, response: str) -> float:
                return float(response.strip() == prompt.answer)

    prompt = Prompt("p", "q", "47")
    for max_new, reward in ((3, 1.0), (2, 0.0)):  # "47"+EOS, or "47" cut at the limit
        params = SamplingParams(n=2, max_new_tokens=max_new)
        res = collect_round(engine, TOK, Exact(), [prompt], params, seed=0,
                            reward_variant="binary", group_prefix="r")  # fmt: skip
        assert [t.finish_reason for t in res.trajectories] == ["stop" if reward else "length"] * 2
        assert [t.reward_raw for t in res.trajectories] == [reward] * 2


def finish_aware(prompt: str, completion: str, metadata: dict, finish_reason: str = "?") -> dict:
    return {"score": 1.0, "cut": float(finish_reason == "length")}


def plain(prompt: str, completion: str, metadata: dict) -> float:
    return 1.0


def test_a_reward_function_that_declares_finish_reason_receives_it(tmp_path):
    rewards = tmp_path / "rw.py"
    rewards.write_text(
        "def finish_aware(prompt, completion, metadata, finish_reason):\n"
        "    return {'score': 1.0, 'cut': float(finish_reason == 'length')}\n"
        "def batch(prompts, completions, metadatas, *, finish_reason):\n"
        "    return [float(f == 'length') for f in finish_reason]\n"
        "batch.batched = True\n"
        "def plain(prompt, completion, metadata):\n"
        "    return 1.0\n"
    )
    assert takes_finish_reason(finish_aware) and not takes_finish_reason(plain)
    p = Prompt("p", "q", "a")
    for name, want in (("finish_aware", [1.0, 1.0]), ("batch", [0.0, 1.0]), ("plain", [1.0] * 2)):
        grader = RewardFunction(f"{rewards}:{name}")
        work = [(grader.item(p, "x", why), None) for why in ("stop", "length")]
        graded = grader.grade_many(work)
        assert [g.score for g in graded] == want, name
        if name == "finish_aware":
            assert [g.components for g in graded] == [{"cut": 0.0}, {"cut": 1.0}]
    with pytest.raises(ValueError, match="finish reasons"):
        from rollout.grading.pool import PooledVerifier

        PooledVerifier(RewardFunction(f"{rewards}:plain")).score_many([(p, "x")], [])
    assert score_all(MathTask.verifier, [(Prompt("p", "q", "1"), "\\boxed{1}")], ["length"]) == [
        1.0
    ]


def test_masked_truncated_answers_leave_grpos_group_baseline():
    """GRPO with ``algo.mask_truncated``: a cut answer's advantage is 0 and it is not part of its
    group's mean and std (before: its reward moved the others' advantages)."""
    from buffer.records import Trajectory
    from learner.losses import grpo_advantages
    from learner.trainer import Learner
    from reval.config import LearnerConfig, TinyModelConfig
    from reval.policy import build_tiny_model

    def traj(reward: float, reason: str) -> Trajectory:
        resp = np.asarray([*ids("1"), EOS] if reason == "stop" else ids("12"), np.int32)
        return Trajectory(prompt_ids=np.asarray(ids("1+0="), np.int32), response_ids=resp,
                          logprobs=np.full(resp.size, -1.0, np.float32), reward_raw=reward,
                          reward=reward, prompt_id="p", group_id="g",
                          finish_reason=reason)  # type: ignore[arg-type]  # fmt: skip

    batch = [traj(1.0, "stop"), traj(0.0, "stop"), traj(1.0, "length")]
    model = build_tiny_model(TinyModelConfig(), len(TOK), int(TOK.pad_token_id), EOS, seed=1)  # type: ignore[arg-type]
    learner = Learner(model, LearnerConfig(micro_batch_size=8),
                      AlgoConfig(name="grpo", mask_truncated=True), int(TOK.pad_token_id),  # type: ignore[arg-type]
                      EOS, torch.device("cpu"))  # fmt: skip
    delta = learner.update(batch).delta
    want = grpo_advantages(torch.tensor([1.0, 0.0]), ["g", "g"])
    torch.testing.assert_close(delta[:2], want)
    assert float(delta[2]) == 0.0


def test_the_overlong_penalty_starts_before_the_token_limit():
    from reval.config import ConfigError, load_config

    cfg = load_config(overrides=["algo.overlong_penalty_tokens=2"], environ={})
    assert cfg.algo.overlong_penalty_tokens == 2 < cfg.rollout.max_new_tokens
    with pytest.raises(ConfigError, match="overlong_penalty_tokens"):
        load_config(overrides=["algo.overlong_penalty_tokens=8", "rollout.max_new_tokens=8"],
                    environ={})  # fmt: skip
