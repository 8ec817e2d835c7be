"""From prompts to verified, reward-transformed trajectory records (one generation round), and
the success-rate evaluation over a task's prompts."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from buffer.records import Trajectory
from reval.rewards import RewardVariant, transform_rewards
from rollout.engines import GenerationEngine, SamplingParams
from rollout.tasks import Prompt, Task, Verifier


@dataclass
class RoundResult:
    trajectories: list[Trajectory]
    reward_mean: float
    """Mean raw reward (success rate of the round's samples)."""
    tokens: int
    """Response tokens generated."""
    verify_s: float = 0.0
    """Seconds spent grading."""


def encode_prompts(
    tokenizer: PreTrainedTokenizerBase, prompts: Sequence[Prompt]
) -> list[list[int]]:
    return [list(tokenizer(p.text, add_special_tokens=False).input_ids) for p in prompts]


def collect_round(
    engine: GenerationEngine,
    tokenizer: PreTrainedTokenizerBase,
    task: Task,
    prompts: Sequence[Prompt],
    params: SamplingParams,
    seed: int,
    reward_variant: RewardVariant,
    group_prefix: str,
    run_id: str = "",
    worker_id: str = "",
) -> RoundResult:
    """Generate ``params.n`` answers per prompt, verify them, transform the rewards per group."""
    prompt_ids = encode_prompts(tokenizer, prompts)
    samples = engine.generate(prompt_ids, params, seed)
    rows: list[tuple[int, Prompt, str]] = []
    pairs: list[tuple[Prompt, str]] = []
    flat = []
    for i, (prompt, group) in enumerate(zip(prompts, samples, strict=True)):
        gid = f"{group_prefix}-{i}"
        for s in group:
            pairs.append((prompt, tokenizer.decode(s.token_ids, skip_special_tokens=True)))
            rows.append((i, prompt, gid))
            flat.append(s)
    t0 = time.perf_counter()
    raw = score_all(task.verifier, pairs)
    verify_s = time.perf_counter() - t0
    rewards = transform_rewards(raw, [gid for _, _, gid in rows], reward_variant)
    trajectories = [
        Trajectory(
            prompt_ids=prompt_ids[i],
            response_ids=s.token_ids,
            logprobs=s.logprobs,
            reward_raw=r_raw,
            reward=r,
            prompt_id=prompt.id,
            group_id=gid,
            finish_reason=s.finish_reason,
            policy_version=engine.policy_version,
            worker_id=worker_id,
            run_id=run_id,
        )
        for (i, prompt, gid), s, r_raw, r in zip(rows, flat, raw, rewards, strict=True)
    ]
    tokens = sum(int(s.token_ids.size) for s in flat)
    mean = sum(raw) / len(raw) if raw else 0.0
    return RoundResult(
        trajectories=trajectories, reward_mean=mean, tokens=tokens, verify_s=verify_s
    )


def score_all(verifier: Verifier, pairs: Sequence[tuple[Prompt, str]]) -> list[float]:
    """Scores of (prompt, response) pairs: in one batch when the verifier grades batches (the
    process-pool math verifier), else one by one."""
    many = getattr(verifier, "score_many", None)
    if many is not None:
        return [float(x) for x in many(list(pairs))]
    return [verifier.score(p, r) for p, r in pairs]


def evaluate(
    engine: GenerationEngine,
    tokenizer: PreTrainedTokenizerBase,
    task: Task,
    prompts: Sequence[Prompt],
    samples_per_prompt: int,
    temperature: float,
    max_new_tokens: int,
    seed: int,
) -> float:
    """avg@n: per prompt the mean 0/1 score of n sampled answers, then the mean over prompts."""
    params = SamplingParams(
        n=samples_per_prompt, temperature=temperature, max_new_tokens=max_new_tokens
    )
    samples = engine.generate(encode_prompts(tokenizer, prompts), params, seed)
    per_prompt = []
    for prompt, group in zip(prompts, samples, strict=True):
        scores = score_all(
            task.verifier,
            [(prompt, tokenizer.decode(s.token_ids, skip_special_tokens=True)) for s in group],
        )
        per_prompt.append(sum(scores) / len(scores))
    return sum(per_prompt) / len(per_prompt)
