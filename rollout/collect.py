"""From prompts to verified, reward-transformed trajectory records (one generation round), and
the success-rate evaluation over a task's prompts."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
from transformers import PreTrainedTokenizerBase

from buffer.records import FinishReason, Trajectory
from reval.answers import answer_text
from reval.config import AlgoConfig
from reval.rewards import RewardVariant, transform_rewards
from rollout.engines import GenerationEngine, SamplingParams
from rollout.environment import Episode, EpisodeRunner, skipped_counts
from rollout.grading.pool import PooledVerifier
from rollout.task_types import Prompt, Task, Verifier

_NO_MASK = np.zeros(0, dtype=np.uint8)  # a single-turn answer: every token is an action
_NO_SPANS = np.zeros(0, dtype=np.int32)  # one weight version sampled it


@dataclass
class RoundResult:
    trajectories: list[Trajectory]
    reward_mean: float
    """Mean raw reward (success rate of the round's samples)."""
    tokens: int
    """Response tokens generated (an episode's: the model's only)."""
    verify_s: float = 0.0
    """Seconds spent grading."""
    turns_mean: float = 1.0
    """The model's turns per answer (multi-turn episodes; 1 without an environment)."""
    episodes_skipped: dict[str, int] = field(default_factory=dict)
    """Episodes left out because their environment misbehaved, by reason
    (``rollout.environment.SKIP_REASONS``)."""

    def episode_stats(self) -> dict[str, object]:
        """What a round of multi-turn episodes logs: ``turns_mean`` and ``episodes_skipped``."""
        return {"turns_mean": self.turns_mean, "episodes_skipped": dict(self.episodes_skipped)}


@dataclass
class Answer:
    """One answer before it is a record, from either generation loop (``collect_round``, the
    streaming worker's groups: ``rollout.streaming.group_records``)."""

    prompt: Prompt
    prompt_ids: Sequence[int]
    group: str
    """Its group id: the answers to one prompt in one round (rewards are transformed per group)."""
    token_ids: np.ndarray
    logprobs: np.ndarray
    finish_reason: FinishReason
    policy_version: int
    """The weights that sampled it (the first, when several did: ``spans``)."""
    action_mask: np.ndarray = field(default_factory=lambda: _NO_MASK)
    """A multi-turn episode's: 1 on the model's tokens (empty: every token is an action)."""
    spans: np.ndarray = field(default_factory=lambda: _NO_SPANS)
    """``[start, version, ...]``: the weight versions that sampled it (empty or one span: only
    ``policy_version``; a record keeps spans only when there are several)."""
    turns: int = 1


def grade_answers(
    task: Task,
    tokenizer: PreTrainedTokenizerBase,
    stop_ids: Sequence[int],
    answers: Sequence[Answer],
    truncation: Truncation,
) -> list[float]:
    """The raw rewards of single-turn answers: the task's verifier on each answer's text cut at
    ``stop_ids`` (the engine's stop set, ``reval.answers.answer_text``), then ``truncation`` on
    answers cut at the token limit."""
    pairs = [(a.prompt, answer_text(tokenizer, a.token_ids, stop_ids)) for a in answers]
    reasons = [a.finish_reason for a in answers]
    raw = score_all(task.verifier, pairs, reasons)
    return truncation.apply(raw, reasons, [int(a.token_ids.size) for a in answers])


def episode_answers(
    prompt: Prompt,
    prompt_ids: Sequence[int],
    group: str,
    episodes: Sequence[Episode],
    version: int,
    truncation: Truncation,
) -> tuple[list[Answer], list[float]]:
    """The answers of one prompt's played episodes and their raw rewards (the environment's,
    ``truncation`` applied, no length penalty); those whose environment misbehaved are left out.
    ``version`` sampled an episode unless its ``spans`` say otherwise (the streaming loop's)."""
    answers, raw = [], []
    for e in episodes:
        if e.error is None:
            ids, lps, mask = e.arrays()
            spans = np.asarray(e.spans, dtype=np.int32) if e.spans else _NO_SPANS
            first = int(spans[1]) if spans.size else version
            answers.append(Answer(prompt, prompt_ids, group, ids, lps, e.finish_reason, first,
                                  mask, spans=spans, turns=e.turns))  # fmt: skip
            raw.append(e.reward)
    return answers, truncation.apply(raw, [a.finish_reason for a in answers], None)


def build_records(
    answers: Sequence[Answer],
    raw: Sequence[float],
    reward_variant: RewardVariant,
    *,
    worker_id: str = "",
    run_id: str = "",
) -> list[Trajectory]:
    """The records of graded answers, their rewards transformed per group: the one place a
    trajectory is built on its way from an engine to the ring."""
    rewards = transform_rewards(list(raw), [a.group for a in answers], reward_variant)
    return [
        Trajectory(
            prompt_ids=a.prompt_ids,
            response_ids=a.token_ids,
            logprobs=a.logprobs,
            reward_raw=r_raw,
            reward=r,
            prompt_id=a.prompt.id,
            group_id=a.group,
            finish_reason=a.finish_reason,
            policy_version=a.policy_version,
            worker_id=worker_id,
            run_id=run_id,
            action_mask=a.action_mask,
            version_spans=a.spans if a.spans.size > 2 else _NO_SPANS,
        )
        for a, r_raw, r in zip(answers, raw, rewards, strict=True)
    ]


@dataclass(frozen=True)
class Truncation:
    """What an answer cut at the token limit (finish reason ``length``) earns, applied to the
    raw rewards at collection time (``algo.truncated_reward``, ``algo.overlong_penalty_tokens``;
    docs/algorithm.md, "Truncated answers"):

    - ``reward = "zero"`` (the default): a cut answer's reward is 0, whatever the verifier said
      (it is never counted as a full answer); ``"graded"``: the verifier's (a reward function
      receives ``finish_reason`` and may decide itself);
    - ``penalty_tokens`` = L_cache > 0: DAPO's soft overlong punishment (eq. 13), with L_max =
      ``max_tokens`` (``rollout.max_new_tokens``): ``min(0, (L_max - L_cache - |y|) / L_cache)``
      added to every single-turn answer's reward (0 up to L_max - L_cache tokens, then down to
      -1 at L_max).
    """

    reward: Literal["zero", "graded"] = "zero"
    penalty_tokens: int = 0
    max_tokens: int = 0

    @classmethod
    def from_config(cls, algo: AlgoConfig, max_new_tokens: int) -> Truncation:
        return cls(algo.truncated_reward, algo.overlong_penalty_tokens, max_new_tokens)

    def penalty(self, length: int) -> float:
        """DAPO's soft overlong penalty of an answer of ``length`` tokens (0 when off)."""
        if self.penalty_tokens <= 0:
            return 0.0
        cache = self.penalty_tokens
        return max(-1.0, min(0.0, (self.max_tokens - cache - length) / cache))

    def apply(
        self, raw: Sequence[float], finish_reasons: Sequence[str], lengths: Sequence[int] | None
    ) -> list[float]:
        """``raw`` with the rule applied; ``lengths`` None: multi-turn episodes (no penalty)."""
        out = []
        for i, (r, why) in enumerate(zip(raw, finish_reasons, strict=True)):
            r = 0.0 if why == "length" and self.reward == "zero" else float(r)
            if lengths is not None:
                r += self.penalty(int(lengths[i]))
            out.append(r)
        return out


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
    episodes: EpisodeRunner | None = None,
    truncation: Truncation = Truncation(),
) -> RoundResult:
    """Generate ``params.n`` answers per prompt, verify them (each answer's text:
    ``reval.answers.answer_text``), apply ``truncation`` to answers cut at the token limit,
    transform the rewards per group. With ``episodes`` (``task.environment``) each answer is a
    multi-turn episode, rewarded by its environment; episodes whose environment misbehaved are
    left out and counted."""
    prompt_ids = encode_prompts(tokenizer, prompts)
    answers: list[Answer] = []
    skipped: dict[str, int] = {}
    version = engine.policy_version
    if episodes is None:
        samples = engine.generate(prompt_ids, params, seed)
        for i, (prompt, group) in enumerate(zip(prompts, samples, strict=True)):
            answers += [Answer(prompt, prompt_ids[i], f"{group_prefix}-{i}", s.token_ids,
                               s.logprobs, s.finish_reason, version) for s in group]  # fmt: skip
        t0 = time.perf_counter()
        raw = grade_answers(task, tokenizer, engine.stop_ids, answers, truncation)
    else:
        played = episodes.run(engine, tokenizer, prompts, prompt_ids, params, seed)
        t0 = time.perf_counter()  # (the environments graded as the episodes ran)
        skipped = skipped_counts(played)
        raw = []
        for i, (prompt, eps) in enumerate(zip(prompts, played, strict=True)):
            got, rewards = episode_answers(prompt, prompt_ids[i], f"{group_prefix}-{i}", eps,
                                           version, truncation)  # fmt: skip
            answers += got
            raw += rewards
    verify_s = time.perf_counter() - t0
    trajectories = build_records(answers, raw, reward_variant, worker_id=worker_id, run_id=run_id)
    tokens = sum(int(a.action_mask.sum()) if a.action_mask.size else int(a.token_ids.size)
                 for a in answers)  # fmt: skip
    mean = sum(raw) / len(raw) if raw else 0.0
    turns = sum(a.turns for a in answers) / len(answers) if answers else 0.0
    return RoundResult(trajectories=trajectories, reward_mean=mean, tokens=tokens,
                       verify_s=verify_s, turns_mean=turns, episodes_skipped=skipped)  # fmt: skip


def score_all(
    verifier: Verifier,
    pairs: Sequence[tuple[Prompt, str]],
    finish_reasons: Sequence[str] | None = None,
) -> list[float]:
    """Scores of (prompt, response) pairs: in one batch when the verifier grades batches (the
    process-pool math verifier), else one by one. ``finish_reasons`` (one per pair) reach the
    pooled graders (a custom task's reward function receives its answer's)."""
    if finish_reasons is not None and isinstance(verifier, PooledVerifier):
        return verifier.score_many(pairs, finish_reasons)
    many = getattr(verifier, "score_many", None)
    if many is not None:
        return [float(x) for x in many(list(pairs))]
    return [verifier.score(p, r) for p, r in pairs]


@dataclass(frozen=True)
class Evaluation:
    """An evaluation's avg@n and, per prompt, its first answer: (prompt, answer, score)."""

    success: float
    answers: list[tuple[str, str, float]]


def evaluate(
    engine: GenerationEngine,
    tokenizer: PreTrainedTokenizerBase,
    task: Task,
    prompts: Sequence[Prompt],
    samples_per_prompt: int,
    temperature: float,
    max_new_tokens: int,
    seed: int,
    episodes: EpisodeRunner | None = None,
) -> Evaluation:
    """avg@n: per prompt the mean 0/1 score of n sampled answers, then the mean over prompts;
    each prompt's first answer as graded. With ``episodes`` an answer is an episode scored by
    its environment's reward (one whose environment misbehaved scores 0), its text the model's
    turns and the observations between them."""
    params = SamplingParams(
        n=samples_per_prompt, temperature=temperature, max_new_tokens=max_new_tokens
    )
    prompt_ids = encode_prompts(tokenizer, prompts)
    if episodes is not None:
        played = episodes.run(engine, tokenizer, prompts, prompt_ids, params, seed)
        means = [sum(e.reward if e.error is None else 0.0 for e in g) / len(g) for g in played]
        firsts = [
            (p.text, answer_text(tokenizer, g[0].tokens, ()),  # (the whole episode)
             g[0].reward if g[0].error is None else 0.0)
            for p, g in zip(prompts, played, strict=True)
        ]  # fmt: skip
        return Evaluation(sum(means) / len(means), firsts)
    samples = engine.generate(prompt_ids, params, seed)
    per_prompt, answers = [], []
    for prompt, group in zip(prompts, samples, strict=True):
        texts = [answer_text(tokenizer, s.token_ids, engine.stop_ids) for s in group]
        scores = score_all(task.verifier, [(prompt, t) for t in texts],
                           [s.finish_reason for s in group])  # fmt: skip
        per_prompt.append(sum(scores) / len(scores))
        answers.append((prompt.text, texts[0], float(scores[0])))
    return Evaluation(sum(per_prompt) / len(per_prompt), answers)
