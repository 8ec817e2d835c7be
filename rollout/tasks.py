"""Built-in verifiable tasks: prompts, a verifier each, and task-shaped pretraining text.

- ``addition``: every ``a+b=`` with operands 0..max_operand. Many prompts, one function to learn.
- ``oneshot``: a single prompt answered with a two-digit code; the accepted codes are chosen
  against the initial policy so that it succeeds with a set probability (the paper's one-shot
  hard/medium/easy problems have base success of about 0.10 / 0.40 / 0.68).

A verifier maps (prompt, response text) to a reward in [0, 1]. The math task's (math-verify in a
process pool, ``rollout/grading/pool.py``) and the custom task's (the user's reward function in the
same pool, ``rollout/grading/custom.py``) implement the same protocol. ``Prompt``, ``Verifier`` and
``Task`` live in ``rollout/task_types.py`` (re-exported here).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from reval.config import RolloutConfig, TaskConfig
from reval.policy import Policy
from rollout.task_types import Prompt, Task, Verifier
from rollout.warm_start import WRONG_BELOW


class ExactMatch:
    """Reward 1 when the stripped response equals the gold answer."""

    def score(self, prompt: Prompt, response: str) -> float:
        return 1.0 if response.strip() == prompt.answer else 0.0


@dataclass
class AdditionTask:
    max_operand: int = 9
    name: str = "addition"
    verifier: Verifier = field(default_factory=ExactMatch)
    prompts: list[Prompt] = field(init=False)

    def __post_init__(self) -> None:
        n = self.max_operand + 1
        self.prompts = [
            Prompt(id=f"{a}+{b}", text=f"{a}+{b}=", answer=str(a + b))
            for a in range(n)
            for b in range(n)
        ]

    def pretrain_texts(self, rng: random.Random, count: int) -> list[str]:
        """Right format, the answer drawn uniformly from the answer range among those the task's
        verifier grades wrong (never the sum, even by chance: ``rollout/warm_start.py``): the
        pretrained model knows how an answer looks, not which one is right."""
        n, top = self.max_operand + 1, 2 * self.max_operand
        out = []
        for _ in range(count):
            prompt = self.prompts[rng.randrange(n * n)]
            answer = str(rng.randint(0, top))
            while self.verifier.score(prompt, answer) >= WRONG_BELOW:
                answer = str(rng.randint(0, top))
            out.append(prompt.text + answer)
        return out


class AcceptSet:
    """Reward 1 when the stripped response is one of the accepted codes."""

    def __init__(self, accepted: Sequence[str]) -> None:
        self.accepted = frozenset(accepted)

    def score(self, prompt: Prompt, response: str) -> float:
        return 1.0 if response.strip() in self.accepted else 0.0


ONESHOT_CODES = [f"{i:02d}" for i in range(100)]


@dataclass
class OneShotTask:
    """One prompt; success probability of the initial policy set by ``base_success``."""

    base_success: float = 0.4
    seed: int = 0
    name: str = "oneshot"
    prompts: list[Prompt] = field(init=False)
    verifier: AcceptSet = field(init=False)
    order: list[str] = field(init=False)
    achieved_base_success: float | None = None

    def __post_init__(self) -> None:
        self.order = list(ONESHOT_CODES)
        random.Random(self.seed).shuffle(self.order)
        self.prompts = [Prompt(id="oneshot", text="code:", answer="")]
        # Before calibration assume a uniform policy over the 100 codes.
        self.verifier = AcceptSet(self.order[: max(1, round(self.base_success * 100))])

    def pretrain_texts(self, rng: random.Random, count: int) -> list[str]:
        """Every code alike. No code is right yet: ``calibrate`` chooses the accepted ones
        after the pretraining, against the pretrained policy, for the set base success."""
        return [f"code:{rng.choice(ONESHOT_CODES)}" for _ in range(count)]

    def calibrate(self, policy: Policy) -> float:
        """Choose the accepted codes so the policy's exact probability of answering one of them
        (code then EOS) is as close as possible to ``base_success``; returns that probability."""
        probs = code_probabilities(policy, self.prompts[0].text, ONESHOT_CODES)
        accepted: list[str] = []
        total = 0.0
        for code in self.order:
            p = probs[code]
            if abs(total + p - self.base_success) < abs(total - self.base_success) or not accepted:
                accepted.append(code)
                total += p
            if total >= self.base_success:
                break
        self.verifier = AcceptSet(accepted)
        self.achieved_base_success = total
        return total


@torch.no_grad()
def code_probabilities(policy: Policy, prompt: str, codes: Sequence[str]) -> dict[str, float]:
    """Exact probability of each completion ``code + EOS`` under the policy (teacher forcing)."""
    tok = policy.tokenizer
    p_ids = tok(prompt, add_special_tokens=False).input_ids
    rows = [p_ids + tok(c, add_special_tokens=False).input_ids + [policy.eos_id] for c in codes]
    width = max(len(r) for r in rows)
    if any(len(r) != width for r in rows):
        raise ValueError("codes must tokenize to the same length")
    ids = torch.tensor(rows, device=policy.device)
    logits = policy.model(input_ids=ids, use_cache=False).logits.float()
    logp = logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0]
    resp = logp[:, len(p_ids) - 1 :].sum(-1).exp()
    return {c: float(p) for c, p in zip(codes, resp.tolist(), strict=True)}


def task_setup(task: Task) -> dict[str, object] | None:
    """What a task learned about the initial policy that every worker must share (the one-shot
    task's calibrated accepted codes), as JSON-able data; None for tasks without any."""
    if isinstance(task, OneShotTask) and task.achieved_base_success is not None:
        return {
            "kind": "oneshot",
            "accepted": sorted(task.verifier.accepted),
            "base_success": task.achieved_base_success,
        }
    return None


def apply_task_setup(task: Task, setup: dict[str, object]) -> None:
    """Give a worker's task the learner's calibration; ValueError when it does not fit."""
    if not isinstance(task, OneShotTask) or setup.get("kind") != "oneshot":
        raise ValueError(f"task setup of kind {setup.get('kind')!r} does not fit {task.name!r}")
    accepted = setup.get("accepted")
    if not isinstance(accepted, list) or not accepted or not set(accepted) <= set(ONESHOT_CODES):
        raise ValueError(f"bad accepted codes in the task setup: {accepted!r}")
    task.verifier = AcceptSet([str(a) for a in accepted])
    base = setup.get("base_success")
    task.achieved_base_success = float(base) if isinstance(base, int | float) else None


def build_task(
    cfg: TaskConfig,
    seed: int = 0,
    tokenizer: object | None = None,
    rollout: RolloutConfig | None = None,
    registry: object | None = None,
) -> Task:
    """The task the config names. A math or custom task (``rollout/custom_task.py``) grades in a
    process pool sized by ``rollout`` (``verifier_workers``, ``verifier_timeout_s``), with its
    metrics on ``registry``."""
    if cfg.kind == "addition":
        return AdditionTask(max_operand=cfg.max_operand)
    if cfg.kind == "oneshot":
        return OneShotTask(base_success=cfg.oneshot_base_success, seed=seed)
    if cfg.kind == "math":
        from rollout.math_task import MathTask

        return MathTask.from_config(cfg, tokenizer, rollout, registry)
    if cfg.kind == "custom":
        from rollout.custom_task import CustomTask

        return CustomTask.from_config(cfg, tokenizer, rollout, registry)
    raise ValueError(f"unknown task kind {cfg.kind!r}")
