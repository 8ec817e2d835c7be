"""A CPU learning run with the calculator tool (issue 28): products ``a*b=`` of single digits,
which the tiny model cannot compute, learned through ``reval train``'s loop with
``task.environment = "calculator"``. The model is first pretrained on the *format* only: half
its texts answer directly with a random number, half call ``<calc>a*b</calc>``, get the
``<result>``, then write the result or, as often, a random number. From there ReVal raises
success with the tool (``task.max_turns = 3``) far over the same start without it
(``task.max_turns = 1``: a tool call ends the episode unanswered), and the share of episodes
that call the tool rises.

Marked ``slow`` (minutes). The figures of docs/tasks.md come from

    .venv/bin/python -m tests.integration.test_env_learning

which prints them for seeds 0 and 1.
"""

from __future__ import annotations

import copy
import random
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from reval.config import RunConfig, TinyModelConfig, load_config
from reval.metrics import TrainMetrics
from reval.policy import Policy, build_char_tokenizer, build_tiny_model
from rollout.task_types import Prompt
from rollout.tasks import ExactMatch
from services.train import Prepared, train

OPERANDS = range(2, 10)
ROUNDS = 40
SEEDS = (0, 1)
PRETRAIN_STEPS = 800
COPY_P = 0.25
"""In pretraining, how often a tool call's answer is the result (else a random number)."""


@dataclass
class ProductTask:
    """``a*b=`` for single digits a, b >= 2, answered with the product."""

    name: str = "products"
    verifier: ExactMatch = field(default_factory=ExactMatch)

    def __post_init__(self) -> None:
        self.prompts = [
            Prompt(id=f"{a}*{b}", text=f"{a}*{b}=", answer=str(a * b))
            for a in OPERANDS
            for b in OPERANDS
        ]

    def pretrain_texts(self, rng: random.Random, count: int) -> list[str]:
        raise NotImplementedError("pretrained by _pretrain (turns end with EOS inside a text)")


def _pretrain(policy: Policy, task: ProductTask, seed: int) -> None:
    """Next-token pretraining on the format: direct answers and tool episodes (module doc)."""
    tok, eos, pad = policy.tokenizer, policy.eos_id, policy.pad_id
    rng = random.Random(seed)

    def ids(text: str) -> list[int]:
        return list(tok(text, add_special_tokens=False).input_ids)

    def row() -> list[int]:
        a, b = rng.choice(OPERANDS), rng.choice(OPERANDS)
        guess = str(rng.randint(4, 81))
        if rng.random() < 0.5:
            return [*ids(f"{a}*{b}={guess}"), eos]
        answer = str(a * b) if rng.random() < COPY_P else guess
        return [*ids(f"{a}*{b}=<calc>{a}*{b}</calc>"), eos,
                *ids(f"<result>{a * b}</result>{answer}"), eos]  # fmt: skip

    model = policy.model
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    for _ in range(PRETRAIN_STEPS):
        rows = [row() for _ in range(64)]
        width = max(map(len, rows))
        x = torch.full((len(rows), width), pad)
        labels = torch.full((len(rows), width), -100)
        for i, r in enumerate(rows):
            x[i, : len(r)] = torch.tensor(r)
            labels[i, : len(r)] = torch.tensor(r)
        loss = model(input_ids=x, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()


def pretrained(seed: int) -> Policy:
    torch.manual_seed(seed)
    tok = build_char_tokenizer()
    model = build_tiny_model(TinyModelConfig(), len(tok), int(tok.pad_token_id),
                             int(tok.eos_token_id), seed=seed)  # fmt: skip
    policy = Policy(model, tok, torch.device("cpu"))
    _pretrain(policy, ProductTask(), seed)
    return policy


def config(seed: int, max_turns: int, out: Path, rounds: int = ROUNDS) -> RunConfig:
    return load_config(
        overrides=[
            f"name=tool-{max_turns}-{seed}", f"seed={seed}", f"output_dir={out}",
            "task.environment=calculator", f"task.max_turns={max_turns}",
            "task.max_episode_tokens=64", "rollout.max_new_tokens=24",
            "rollout.prompts_per_round=16", "rollout.n=8", "rollout.temperature=1.0",
            f"learner.rounds={rounds}", "learner.batch_size=128", "learner.updates_per_round=2",
            "learner.micro_batch_size=128", "learner.lr=2e-3", "learner.ref_reset_steps=0",
            "algo.name=reval", "algo.beta=0.1", "eval.every=0", "eval.samples_per_prompt=2",
            "metrics.plot=false", "metrics.progress=false", "model.pretrain_steps=0",
        ],
        environ={},
    )  # fmt: skip


def run_one(policy: Policy, seed: int, max_turns: int, out: Path, rounds: int = ROUNDS) -> dict:
    """One training run from a copy of ``policy``: initial and final success (avg@2 over the
    64 prompts, episodes scored by the environment), and the tool-call share of the first and
    last five rounds' episodes (``turns_mean - 1`` over its most, one call per episode)."""
    task = ProductTask()
    own = Policy(copy.deepcopy(policy.model), policy.tokenizer, policy.device)
    prepared = Prepared(TrainMetrics(), own, task, {}, list(task.prompts))  # type: ignore[arg-type]
    result = train(config(seed, max_turns, out, rounds), prepared=prepared)
    rows = [r for r in result.history if "turns_mean" in r]
    calls = [min(r["turns_mean"] - 1.0, 1.0) for r in rows]
    return {
        "initial": result.initial_success,
        "final": result.final_success,
        "calls_first": sum(calls[:5]) / 5,
        "calls_last": sum(calls[-5:]) / 5,
    }


def experiment(
    seeds: tuple[int, ...], out: Path, rounds: int = ROUNDS, say: Any = None
) -> dict[str, list[dict]]:
    runs: dict[str, list[dict]] = {"tool": [], "no_tool": []}
    for seed in seeds:
        policy = pretrained(seed)
        for name, turns in (("tool", 3), ("no_tool", 1)):
            runs[name].append(run_one(policy, seed, turns, out, rounds))
            if say is not None:
                say(name, seed, runs[name][-1])
    return runs


@pytest.mark.slow
def test_the_tool_is_learned(tmp_path: Path) -> None:
    runs = experiment(SEEDS, tmp_path)
    for tool, base in zip(runs["tool"], runs["no_tool"], strict=True):
        assert tool["final"] > base["final"] + 0.2, (tool, base)
        assert tool["final"] > tool["initial"] + 0.1, tool
        assert tool["calls_last"] > tool["calls_first"], tool


def main(argv: list[str]) -> None:
    rounds = int(argv[0]) if argv else ROUNDS
    seeds = tuple(int(x) for x in argv[1:]) or SEEDS
    torch.set_num_threads(1)
    print(f"products a*b= (a, b in 2..9), {rounds} rounds of 16 prompts x 8, seeds {seeds}")
    print("| run | seed | success before | success after | tool calls, first 5 rounds | last 5 |")
    print("|---|---|---|---|---|---|", flush=True)

    def say(name: str, seed: int, r: dict) -> None:
        print(f"| {name} | {seed} | {r['initial']:.3f} | {r['final']:.3f} | "
              f"{r['calls_first']:.2f} | {r['calls_last']:.2f} |", flush=True)  # fmt: skip

    with tempfile.TemporaryDirectory() as tmp:
        experiment(seeds, Path(tmp), rounds, say)


if __name__ == "__main__":
    main(sys.argv[1:])
