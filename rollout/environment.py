"""Multi-turn environments: the ``Environment`` protocol and the episode loop that runs one
against any generation engine.

An episode starts from a task's prompt (``Environment.start``). The model writes a turn (its
generation up to EOS, or ``rollout.max_new_tokens``); the environment takes the turn's text and
answers a ``Step``: the next observation (text, appended to the context as tokens the model did
not choose), a reward and whether the episode is done. Turns repeat until the environment says
done, ``task.max_turns`` turns have been taken or the response holds ``task.max_episode_tokens``
tokens (the model's and the environment's together; then the finish reason is ``length``).

The record of an episode (``buffer.records.Trajectory``) has one response: the model's turns and
the observations between them, in order, with ``action_mask`` 1 on the model's tokens and 0 on
the environment's, whose behaviour log-probs are 0 (they were not sampled). Its reward is the
sum of the environment's rewards. The learner keeps the environment's tokens out of the loss
(docs/tasks.md, "Environments").

Each turn is one ``GenerationEngine.generate`` call on every live episode's whole context
(prompt + response so far) with ``n = 1``: the HF engine and the vLLM engine run episodes
unchanged. An environment that raises or answers something other than a ``Step`` (or an
``(observation, reward, done)`` tuple) loses its episode only: it is logged, counted by reason
and left out of the round.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import numbers
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from buffer.records import FinishReason
from reval.answers import answer_text
from reval.config import BUILTIN_ENVIRONMENTS, TaskConfig
from rollout.engines import GenerationEngine, SamplingParams
from rollout.env_types import Environment, EnvironmentFactory, Step
from rollout.task_types import Prompt

__all__ = ["Environment", "EnvironmentFactory", "EpisodeRunner", "Step", "run_episodes"]

log = logging.getLogger("reval.environment")

SKIP_REASONS = ("start_failed", "step_failed", "bad_step")
"""Why an episode was left out: its environment raised in ``start`` or in ``step``, or ``step``
answered something that is not a ``Step``."""


class EpisodeError(ValueError):
    """An environment misbehaved; ``reason`` is one of ``SKIP_REASONS``."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def builtin_environments() -> dict[str, EnvironmentFactory]:
    """``task.environment``'s built-in names (``reval.config.BUILTIN_ENVIRONMENTS``)."""
    from rollout.calculator import CalculatorEnv

    return {"calculator": CalculatorEnv}


def environment_factory(cfg: TaskConfig) -> EnvironmentFactory | None:
    """The factory ``task.environment`` names (None when unset). ValueError naming the field
    when it cannot be loaded."""
    spec = cfg.environment
    if spec is None:
        return None
    if spec in BUILTIN_ENVIRONMENTS:
        return builtin_environments()[spec]
    from reval.plugins import load_callable

    factory: EnvironmentFactory = load_callable(spec, "task.environment")
    return factory


def as_step(value: Any) -> Step:
    """``value`` as a Step: a Step, or an ``(observation, reward, done)`` tuple of a str, a
    finite real number and a bool. EpisodeError("bad_step") otherwise."""
    if isinstance(value, Step):
        obs, reward, done = value.observation, value.reward, value.done
    elif isinstance(value, tuple) and len(value) == 3:
        obs, reward, done = value
    else:
        raise EpisodeError(
            "bad_step", f"step returned {type(value).__name__}, not a Step or a 3-tuple"
        )
    if not isinstance(obs, str):
        raise EpisodeError("bad_step", f"observation is {type(obs).__name__}, not str")
    if isinstance(reward, bool) or not isinstance(reward, numbers.Real):
        raise EpisodeError("bad_step", f"reward is {type(reward).__name__}, not a number")
    if not math.isfinite(float(reward)):
        raise EpisodeError("bad_step", f"reward {reward!r} is not finite")
    if not isinstance(done, bool | np.bool_):
        raise EpisodeError("bad_step", f"done is {type(done).__name__}, not bool")
    return Step(obs, float(reward), bool(done))


@dataclass
class Episode:
    """One episode's response: the model's turns and the observations between them."""

    prompt_ids: list[int]
    env: Environment | None
    """None once the episode is over."""
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    """1 on the model's tokens, 0 on the environment's."""
    reward: float = 0.0
    turns: int = 0
    finish_reason: FinishReason = "length"
    error: EpisodeError | None = None
    """Why it was left out (its environment misbehaved)."""
    spans: list[int] = field(default_factory=list)
    """``[start, version, ...]`` over ``tokens``: the weights that sampled the model's turns
    (the streaming loop's; empty where one version played the whole episode)."""

    @property
    def live(self) -> bool:
        return self.env is not None

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(token ids [T] int32, behaviour log-probs [T] float32, action mask [T] uint8)."""
        return (
            np.asarray(self.tokens, dtype=np.int32),
            np.asarray(self.logprobs, dtype=np.float32),
            np.asarray(self.mask, dtype=np.uint8),
        )


@dataclass
class EpisodeLimits:
    max_turns: int
    """The model's turns per episode at most (``task.max_turns``)."""
    max_tokens: int
    """Response tokens per episode at most (``task.max_episode_tokens``)."""

    @classmethod
    def from_config(cls, cfg: TaskConfig) -> EpisodeLimits:
        return cls(cfg.max_turns, cfg.max_episode_tokens)


def run_episodes(
    engine: GenerationEngine,
    tokenizer: Any,
    factory: EnvironmentFactory,
    prompts: Sequence[Prompt],
    prompt_ids: Sequence[Sequence[int]],
    params: SamplingParams,
    seed: int,
    limits: EpisodeLimits,
) -> list[list[Episode]]:
    """``params.n`` episodes per prompt, every live one advanced one turn per engine call.
    Episodes whose environment misbehaved are returned with ``error`` set (and logged)."""
    episodes = [
        [start_episode(factory, prompt, ids) for _ in range(params.n)]
        for prompt, ids in zip(prompts, prompt_ids, strict=True)
    ]
    flat = [e for group in episodes for e in group]
    for turn in range(limits.max_turns):
        live = [e for e in flat if e.live]
        if not live:
            break
        # (one token past the room: a turn the episode's limit cuts is seen as cut, never stepped)
        room = max(limits.max_tokens - len(e.tokens) for e in live)
        turn_params = dataclasses.replace(
            params, n=1, max_new_tokens=max(1, min(params.max_new_tokens, room + 1))
        )
        contexts = [e.prompt_ids + e.tokens for e in live]
        samples = engine.generate(contexts, turn_params, seed + 7919 * turn)
        last = turn == limits.max_turns - 1
        for e, (sample,) in zip(live, samples, strict=True):
            advance_episode(e, sample, tokenizer, engine.stop_ids, limits, last)
    for e in flat:
        if e.error is not None:
            log.warning("episode skipped (%s): %s", e.error.reason, e.error)
    return episodes


def start_episode(factory: EnvironmentFactory, prompt: Prompt, ids: Sequence[int]) -> Episode:
    """A new episode of ``prompt`` (one whose environment failed to start comes back over,
    with ``error`` set)."""
    try:
        env = factory()
        env.start(prompt)
    except Exception as err:  # a user's environment may raise anything
        error = EpisodeError("start_failed", f"start raised {type(err).__name__}: {err}")
        return Episode(list(ids), None, error=error)
    return Episode(list(ids), env)


def advance_episode(
    e: Episode,
    sample: Any,
    tokenizer: Any,
    stop_ids: Sequence[int],
    limits: EpisodeLimits,
    last: bool,
) -> None:
    """Add the model's turn to the episode and give it to the environment (the turn's text as
    graded everywhere: ``reval.answers.answer_text``)."""
    room = limits.max_tokens - len(e.tokens)
    ids = [int(x) for x in sample.token_ids[:room]]
    e.tokens += ids
    e.logprobs += [float(x) for x in sample.logprobs[:room]]
    e.mask += [1] * len(ids)
    e.turns += 1
    env = e.env
    assert env is not None
    if len(sample.token_ids) > room:  # the token limit cut the turn short: no step
        e.env, e.finish_reason = None, "length"
        return
    try:
        step = as_step(env.step(answer_text(tokenizer, ids, stop_ids)))
    except EpisodeError as err:
        e.env, e.error = None, err
        return
    except Exception as err:  # a user's environment may raise anything
        e.env = None
        e.error = EpisodeError("step_failed", f"step raised {type(err).__name__}: {err}")
        return
    e.reward += step.reward
    if step.done:
        e.env, e.finish_reason = None, sample.finish_reason
        return
    obs = list(tokenizer(step.observation, add_special_tokens=False).input_ids)
    space = limits.max_tokens - len(e.tokens)
    if last or len(obs) >= space:  # no turn of the model could follow it
        e.env, e.finish_reason = None, "length"
        return
    e.tokens += obs
    e.logprobs += [0.0] * len(obs)
    e.mask += [0] * len(obs)


def turn_params(e: Episode, params: SamplingParams, limits: EpisodeLimits) -> SamplingParams:
    """The sampling parameters of ``e``'s next turn on its own (the worker's loop): one answer,
    at most one token more than the episode has room for, so that a turn the episode's limit
    cuts is seen as cut (``advance_episode``: kept up to the limit, finish ``length``, never
    stepped), as in ``run_episodes``."""
    room = limits.max_tokens - len(e.tokens)
    return dataclasses.replace(
        params, n=1, max_new_tokens=max(1, min(params.max_new_tokens, room + 1))
    )


def skipped_counts(episodes: Sequence[Sequence[Episode]]) -> dict[str, int]:
    """Episodes left out, by reason (``SKIP_REASONS``)."""
    return dict(Counter(e.error.reason for g in episodes for e in g if e.error is not None))


@dataclass
class EpisodeRunner:
    """The configured environment and its limits: what a round runs instead of single-turn
    generation (``rollout.collect``)."""

    factory: EnvironmentFactory
    limits: EpisodeLimits

    @classmethod
    def from_config(cls, cfg: TaskConfig) -> EpisodeRunner | None:
        """None when ``task.environment`` is unset."""
        factory = environment_factory(cfg)
        return None if factory is None else cls(factory, EpisodeLimits.from_config(cfg))

    def run(
        self,
        engine: GenerationEngine,
        tokenizer: Any,
        prompts: Sequence[Prompt],
        prompt_ids: Sequence[Sequence[int]],
        params: SamplingParams,
        seed: int,
    ) -> list[list[Episode]]:
        return run_episodes(
            engine, tokenizer, self.factory, prompts, prompt_ids, params, seed, self.limits
        )
