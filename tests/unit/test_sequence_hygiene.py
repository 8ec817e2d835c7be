"""Sequence hygiene that a real tokenizer exposes: left padding for generation, right padding
for the learner, EOS apart from pad, over-long prompts skipped and counted (never truncated),
responses cut at max_new_tokens recorded with their reward and finish reason."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from prometheus_client import CollectorRegistry

from buffer.records import Trajectory
from learner.sequence import collate
from learner.trainer import Learner
from reval.config import AlgoConfig, LearnerConfig, ModelConfig, TaskConfig, TinyModelConfig
from reval.policy import build_bpe_tokenizer, build_tiny_model, load_policy
from rollout.collect import collect_round
from rollout.engines import HFEngine, SamplingParams
from rollout.eval_sets import load_benchmark
from rollout.math_task import MathTask, format_prompt
from rollout.tasks import AdditionTask
from rollout.word_problems import corpus, generate, write_jsonl

GREEDY = 1e-4  # temperature: argmax sampling, so batch composition cannot change the draw


@pytest.fixture(scope="module")
def policy():
    return load_policy(ModelConfig(device="cpu"), seed=0)


def test_generation_left_pads_uneven_prompts(policy) -> None:
    """A short prompt generates the same tokens alone and beside a long one: the batch pads on
    the left with positions counted from each prompt's first real token."""
    engine = HFEngine(policy.model, policy.pad_id, policy.eos_id)
    tok = policy.tokenizer
    short = tok("3+4=", add_special_tokens=False).input_ids
    long = tok("a much longer prompt: 3+4=", add_special_tokens=False).input_ids
    params = SamplingParams(n=1, temperature=GREEDY, max_new_tokens=6)
    together = engine.generate([short, long], params, seed=0)
    alone = [engine.generate([p], params, seed=0)[0] for p in (short, long)]
    for a, b in zip(together, alone, strict=True):
        assert a[0].token_ids.tolist() == b[0].token_ids.tolist()
        np.testing.assert_allclose(a[0].logprobs, b[0].logprobs, atol=1e-4)
    assert tok.padding_side == "left"


def test_learner_pads_right_and_masks_by_length_when_pad_is_eos() -> None:
    """Hub checkpoints often have pad == EOS (Qwen2.5 base, R1-distill): the response mask comes
    from the lengths, so the EOS a response ends with counts and the padding after it does not."""
    eos = pad = 1
    ts = [
        Trajectory(prompt_ids=np.array([5, 6, 7]), response_ids=np.array([8, 9, eos]),
                   logprobs=-np.ones(3), reward_raw=1.0, reward=1.0, traj_id="a"),
        Trajectory(prompt_ids=np.array([5]), response_ids=np.array([8]),
                   logprobs=-np.ones(1), reward_raw=0.0, reward=0.0, traj_id="b",
                   finish_reason="length"),
    ]  # fmt: skip
    b = collate(ts, pad, eos)
    assert b.responses.tolist() == [[8, 9, eos], [8, pad, pad]]  # right-padded
    assert b.mask.tolist() == [[1, 1, 1], [1, 0, 0]]
    assert b.input_ids[1, :3].tolist() == [pad, pad, 5]  # prompts left-padded
    assert b.attention_mask[1].tolist() == [0, 0, 1, 1, 0, 0]


def test_collate_refuses_log_probs_that_do_not_match_their_response() -> None:
    """collate scatters every row's log-probs at once: a record with one too few beside one with
    one too many must not pass as two right ones, each shifted (validate() refuses such records
    at insert; collate is also handed records built by hand)."""
    ts = [
        Trajectory(prompt_ids=np.array([5]), response_ids=np.array([8, 9]),
                   logprobs=-np.ones(1), reward_raw=0.0, reward=0.0, traj_id="a"),
        Trajectory(prompt_ids=np.array([5]), response_ids=np.array([8, 9]),
                   logprobs=-np.ones(3), reward_raw=0.0, reward=0.0, traj_id="b"),
    ]  # fmt: skip
    with pytest.raises(ValueError, match="trajectory 0: 1 log-probs for 2 response tokens"):
        collate(ts, 0, 1)


def test_bpe_checkpoint_eos_is_not_pad(tmp_path: Path) -> None:
    tok = build_bpe_tokenizer(corpus(generate(5, seed=0)), tmp_path, vocab_size=300)
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    assert tok.eos_token_id != tok.pad_token_id


def test_too_long_prompts_skipped_counted_and_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    tok = build_bpe_tokenizer(corpus(generate(20, seed=0)), tmp_path / "tok", vocab_size=400)
    short, long = "What is 1+1?", "What is 1+1? " + "Think about it. " * 30
    write_jsonl(tmp_path / "d.jsonl", [{"problem": short, "answer": "2"},
                                       {"problem": long, "answer": "2"}])  # fmt: skip
    registry = CollectorRegistry()
    limit = len(tok(format_prompt(short, "qwen_math", tok)).input_ids)
    cfg = TaskConfig(kind="math", dataset=str(tmp_path / "d.jsonl"), template="qwen_math",
                     max_prompt_tokens=limit)  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="reval.math"):
        task = MathTask.from_config(cfg, tok, registry=registry)
    assert [p.text for p in task.prompts] == [format_prompt(short, "qwen_math", tok)]  # whole
    assert task.skipped == {"too_long": 1}
    assert (
        registry.get_sample_value("reval_task_prompts_skipped_total", {"reason": "too_long"}) == 1
    )
    assert "1 prompts longer than" in caplog.text and "not truncated" in caplog.text
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "wordmath.jsonl").write_text((tmp_path / "d.jsonl").read_text())
    bench = load_benchmark("wordmath", tmp_path / "b", 100, 0, "qwen_math", tok, limit)
    assert bench.too_long == 1 and [p.text for p in bench.problems] == [short]


def test_truncated_response_keeps_reward_and_finish_reason(policy) -> None:
    """A response cut at max_new_tokens is terminal: its reward is 0 by default (never counted
    as a full answer: ``algo.truncated_reward``) and its finish reason is recorded;
    ``algo.mask_truncated`` decides whether it trains."""
    engine = HFEngine(policy.model, policy.pad_id, policy.eos_id)
    task = AdditionTask()
    params = SamplingParams(n=8, max_new_tokens=1)
    result = collect_round(engine, policy.tokenizer, task, task.prompts[:4], params, seed=0,
                           reward_variant="binary", group_prefix="g")  # fmt: skip
    cut = [t for t in result.trajectories if t.finish_reason == "length"]
    assert cut and all(t.response_ids.size == 1 for t in cut)
    for t in result.trajectories:  # the verifier's reward, as decoded; 0 when cut
        text = policy.tokenizer.decode(t.response_ids, skip_special_tokens=True)
        right = text.strip() == task.prompts[int(t.group_id[2:])].answer
        assert t.reward_raw == (1.0 if right and t.finish_reason == "stop" else 0.0)

    def loss(mask: bool) -> float:
        torch.manual_seed(0)
        model = build_tiny_model(TinyModelConfig(), len(policy.tokenizer), policy.pad_id,
                                 policy.eos_id, seed=1)  # fmt: skip
        learner = Learner(model, LearnerConfig(micro_batch_size=64),
                          AlgoConfig(beta=0.1, mask_truncated=mask), policy.pad_id, policy.eos_id,
                          torch.device("cpu"))  # fmt: skip
        rewarded = [dataclasses.replace(t, reward=1.0) for t in cut]  # r != 0: a loss to mask
        return float(learner.update(rewarded).metrics["loss"])

    assert loss(mask=False) > 0
    assert loss(mask=True) == 0.0
