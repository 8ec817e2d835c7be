"""Multi-turn episodes through both generation engines (issue 28): the episode loop's per-turn
``generate`` on the growing token context, with the conformance suite's checkpoint. In every
episode the action mask is 0 on exactly the environment's observations, and each of the model's
turns carries the behaviour log-probs of a teacher-forced HF forward pass over the whole context
before it (observations included).

The ``vllm`` case is marked ``vllm`` (the vLLM lane, ``make test-vllm``); the ``hf`` case runs
in the main suite.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from rollout.engines import GenerationEngine, SamplingParams
from rollout.environment import Episode, EpisodeLimits, Step, run_episodes
from rollout.task_types import Prompt
from tests.integration.test_engine_conformance import (  # noqa: F401 (fixtures)
    TOL,
    checkpoint,
    engine,
    reference_logprobs,
    tokenizer,
    vllm_engine,
)

OBSERVATION = "<result>7</result>"


class Chatter:
    """Answers every turn with the same observation; the third turn ends the episode."""

    def start(self, prompt: Prompt) -> None:
        self.turns = 0

    def step(self, message: str) -> Step:
        self.turns += 1
        return Step(OBSERVATION, 0.25, self.turns >= 3)


def _segments(e: Episode) -> list[tuple[int, int, int]]:
    """(start, end, mask value) of each run of equal mask values."""
    out: list[tuple[int, int, int]] = []
    for i, m in enumerate(e.mask):
        if out and out[-1][2] == m:
            out[-1] = (out[-1][0], i + 1, m)
        else:
            out.append((i, i + 1, m))
    return out


def test_episodes_through_the_engine(
    engine: GenerationEngine,  # noqa: F811
    checkpoint: tuple[Path, PreTrainedModel],  # noqa: F811
    tokenizer: PreTrainedTokenizerBase,  # noqa: F811
) -> None:
    texts = ["3+4=", "Seven is", "Add 3 and 4:"]
    prompts = [Prompt(id=str(i), text=t, answer="7") for i, t in enumerate(texts)]
    ids = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=8)
    played = run_episodes(engine, tokenizer, Chatter, prompts, ids, params, seed=5,
                          limits=EpisodeLimits(max_turns=3, max_tokens=120))  # fmt: skip
    obs = tokenizer.encode(OBSERVATION, add_special_tokens=False)
    model = checkpoint[1]
    worst = 0.0
    for prompt_ids, group in zip(ids, played, strict=True):
        assert len(group) == 2
        for e in group:
            assert e.error is None and e.turns == 3 and e.reward == 0.75
            runs = _segments(e)
            assert [m for _, _, m in runs] == [1, 0, 1, 0, 1]
            for start, end, m in runs:
                if m == 0:
                    assert e.tokens[start:end] == obs
                    assert e.logprobs[start:end] == [0.0] * len(obs)
                else:  # the model's turn: sampled from the context before it
                    turn = np.asarray(e.tokens[start:end])
                    context = prompt_ids + e.tokens[:start]
                    ref, _ = reference_logprobs(model, context, turn, 1.0, 1.0)
                    got = np.asarray(e.logprobs[start:end])
                    worst = max(worst, float(np.abs(got - ref).max()))
    assert worst < TOL
