"""The honest warm start: task-shaped pretraining text that never holds a right answer.

The tiny model's format pretraining (``model.pretrain_steps``, ``learner/pretrain.py``) reads
each prompt followed by an answer, so that RL starts from a model that writes answers of the
right form, at about chance. A dataset task (math, custom) pairs a prompt with *another* row's
answer; such a pairing can still be right for the prompt (the same answer, an equivalent one, a
reward that accepts it), which would teach the answers. So every pairing is graded first, by the
task's own verifier (math-verify, the user's reward function), and only those it grades wrong are
used:

- per prompt, a few other rows' answers of the same shape (``answer_shape``: the format), the
  own answer string never among them, graded in one batch (``GRADE_BUDGET`` pairings in all);
- a prompt left with none gets other rows' answers of any shape, graded in a second batch;
- a prompt left with none after that (every candidate grades right, or the rows have no answer)
  is pretrained on the prompt alone (the format of the question, no answer), said in one log
  line with how many prompts.

A pairing is *wrong* when the verifier gives it less than ``WRONG_BELOW`` and no more than the
prompt's lowest-graded candidate: 0 under a 0/1 reward; under a reward with a format bonus, the
bonus alone. The grading happens once, on the first draw (at most ``GRADE_BUDGET //
MIN_CANDIDATES`` prompts are used, chosen by the draw's rng); each later draw only samples from
what was kept.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from rollout.task_types import Prompt, Verifier

log = logging.getLogger("reval.warm_start")

GRADE_BUDGET = 1024
"""Pairings graded in the first round (math-verify takes ~1-3 ms a pairing here): per prompt
``GRADE_BUDGET // prompts`` candidates, between ``MIN_CANDIDATES`` and ``MAX_CANDIDATES``."""
MIN_CANDIDATES = 4
MAX_CANDIDATES = 16
WRONG_BELOW = 0.5
"""A pairing graded at or above this is never used (see the module's docstring)."""


@dataclass
class WarmStart:
    """The pretraining texts of a dataset task (the module's docstring): ``texts(rng, count)`` is
    the task's ``pretrain_texts``. ``render`` turns an answer into the response text the model
    would write after the prompt (math: `` \\boxed{answer}``). ``shape`` groups answers of one
    format (``math_task.answer_shape``)."""

    prompts: Sequence[Prompt]
    verifier: Verifier
    render: Callable[[str], str]
    shape: Callable[[str], str]
    budget: int = GRADE_BUDGET
    candidates: int = field(default=0, init=False)
    """Candidates graded per prompt (per round), from ``budget``."""
    chosen: list[Prompt] = field(default_factory=list, init=False)
    kept: list[list[str]] = field(default_factory=list, init=False)
    """Per chosen prompt, the responses it may be pretrained on (empty: the prompt alone)."""
    unpaired: int = field(default=0, init=False)
    """Chosen prompts with no pairing graded wrong: pretrained on the prompt alone."""
    graded: int = field(default=0, init=False)
    built: bool = field(default=False, init=False)

    def texts(self, rng: random.Random, count: int) -> list[str]:
        """``count`` texts (at most one per prompt): a prompt and one of its kept responses."""
        if not self.built:
            self.build(random.Random(rng.random()))
        picks = rng.sample(range(len(self.chosen)), min(count, len(self.chosen)))
        return [
            self.chosen[i].text + (rng.choice(self.kept[i]) if self.kept[i] else "") for i in picks
        ]

    def build(self, rng: random.Random) -> None:
        """Choose the prompts, grade their candidate pairings, keep the wrong ones."""
        t0 = time.perf_counter()
        prompts = list(self.prompts)
        most = self.budget // MIN_CANDIDATES  # (the prompts the format pretraining uses)
        self.chosen = prompts if len(prompts) <= most else rng.sample(prompts, most)
        per = self.budget // max(len(self.chosen), 1)
        self.candidates = max(MIN_CANDIDATES, min(MAX_CANDIDATES, per))
        self.kept = [[] for _ in self.chosen]
        answers = [p.answer for p in prompts if p.answer.strip()]
        by_shape: dict[str, list[str]] = {}
        for a in answers:
            by_shape.setdefault(self.shape(a), []).append(a)
        todo = list(range(len(self.chosen)))
        for pool_of in (lambda p: by_shape.get(self.shape(p.answer), []), lambda p: answers):
            if not todo:
                break
            todo = self._grade_round(todo, pool_of, rng)
        self.unpaired = len(todo)
        self.built = True
        if not answers:
            log.warning("format pretraining: the rows have no answer: the %d prompts alone",
                        len(self.chosen))  # fmt: skip
        elif self.unpaired:
            log.warning(
                "format pretraining: %d of %d prompts have no other row's answer that the task "
                "grades wrong: pretrained on the prompt alone (never on a right answer)",
                self.unpaired, len(self.chosen),
            )  # fmt: skip
        log.info("format pretraining: %d pairings graded by the task in %.2f s, %d prompts",
                 self.graded, time.perf_counter() - t0, len(self.chosen))  # fmt: skip

    def _grade_round(
        self, todo: list[int], pool_of: Callable[[Prompt], list[str]], rng: random.Random
    ) -> list[int]:
        """Grade up to ``candidates`` answers from ``pool_of(prompt)`` for each prompt of
        ``todo`` in one batch; keep the wrong ones; the prompts still without one."""
        cands: dict[int, list[str]] = {}
        for i in todo:
            own = self.chosen[i].answer
            pool = pool_of(self.chosen[i])
            draw = pool if len(pool) <= 4 * self.candidates else rng.sample(
                pool, 4 * self.candidates
            )  # fmt: skip
            draw = [a for a in draw if a != own]  # (never the own answer, graded or not)
            rng.shuffle(draw)
            cands[i] = draw[: self.candidates]
        pairs = sorted({(i, a) for i, c in cands.items() for a in c})
        scores = dict(zip(pairs, self._score([(i, self.render(a)) for i, a in pairs]),
                          strict=True))  # fmt: skip
        self.graded += len(pairs)
        left = []
        for i in todo:
            lowest = min((scores[i, a] for a in cands[i]), default=WRONG_BELOW)
            self.kept[i] = [
                self.render(a)
                for a in cands[i]
                if scores[i, a] < WRONG_BELOW and scores[i, a] <= lowest
            ]
            if not self.kept[i]:
                left.append(i)
        return left

    def _score(self, pairs: list[tuple[int, str]]) -> list[float]:
        """The task's rewards of (chosen prompt index, response), in one batch when the
        verifier grades batches (rollout/collect.py's ``score_all``, as the evaluation does)."""
        if not pairs:
            return []
        from rollout.collect import score_all  # (torch-free callers import this module)

        scores = score_all(self.verifier, [(self.chosen[i], r) for i, r in pairs])
        drain = getattr(self.verifier, "drain_components", None)
        if drain is not None:  # (a custom reward's components: not the run's answers)
            drain()
        return scores
