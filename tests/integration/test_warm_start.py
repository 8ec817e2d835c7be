"""The honest warm start (issue 37): the tiny model's format pretraining never reads a prompt
followed by an answer its task grades right (``rollout/warm_start.py``), for letters, digits and
mixed answers, custom and math tasks; a "reverse the word" and a "reverse the number" task, as
a user writes them (a JSONL dataset and a reward file), start below 0.1 success before RL with
the pretraining a user gets by default (``configs/demo.toml``: 300 steps of 64 texts), as
``summary.json``'s ``success_before_rl`` says; a run that starts suspiciously high says so.

On the old pairing (another row's answer of the same ``answer_shape``, where letters were never
merged), every letters-only answer was a shape of its own: the draws below counted thousands of
right pairings and "reverse the word" started at 0.99."""

from __future__ import annotations

import json
import logging
import random
import string
from pathlib import Path

import pytest

from reval.config import load_config
from rollout.custom_task import CustomTask
from rollout.grading.math_grading import MathVerify
from rollout.grading.pool import PooledVerifier
from rollout.math_task import MathTask, answer_shape
from services.cli import main

REWARD = """
def reward(prompt, completion, metadata):
    # case-insensitive, as a user may write it: 'cbA' is right for 'Abc' and for 'abc'
    return float(completion.strip().lower() == str(metadata["answer"]).lower())


def anything(prompt, completion, metadata):
    return 1.0
"""


def words(n: int, seed: int) -> list[str]:
    """``n`` distinct pronounceable letters-only words of 3-6 letters."""
    rng = random.Random(seed)
    out: set[str] = set()
    while len(out) < n:
        out.add("".join(rng.choice("bcdfghklmnprstvz" if i % 2 == 0 else "aeiou")
                        for i in range(rng.randint(3, 6))))  # fmt: skip
    return sorted(out)


def numbers(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [str(x) for x in rng.sample(range(10, 100000), n)]


def mixed(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    chars = string.ascii_lowercase + string.digits
    return sorted({"".join(rng.choice(chars) for _ in range(rng.randint(3, 5))) for _ in range(n)})


def write_task(root: Path, items: list[str]) -> tuple[Path, Path]:
    """A "reverse it" dataset (``question``, ``answer`` = the item reversed) and its reward."""
    root.mkdir(parents=True, exist_ok=True)
    data = root / "reverse.jsonl"
    with data.open("w") as fh:
        for item in items:
            fh.write(json.dumps({"question": f"reverse {item}: ", "answer": item[::-1]}) + "\n")
    module = root / "my_reward.py"
    module.write_text(REWARD)
    return data, module


def custom_task(root: Path, items: list[str], reward: str = "reward") -> CustomTask:
    data, module = write_task(root, items)
    cfg = load_config(overrides=[
        f"task.dataset={data}", f"task.reward={module}:{reward}", "task.prompt_field=question",
        "rollout.verifier_workers=1",
    ], environ={})  # fmt: skip
    return CustomTask.from_config(cfg.task, None, cfg.rollout)


def draws(task, n: int = 3000, seed: int = 0) -> list[tuple[object, str]]:
    """``n`` pretraining texts (batches of 64, as the pretraining draws them), each split into
    its prompt and the response after it."""
    rng = random.Random(seed)
    by_len = sorted(task.prompts, key=lambda p: -len(p.text))
    out = []
    while len(out) < n:
        for text in task.pretrain_texts(rng, 64):
            prompt = next(p for p in by_len if text.startswith(p.text))
            out.append((prompt, text[len(prompt.text) :]))
    return out[:n]


def test_answer_shape_groups_letters_by_length_and_digits_by_run():
    assert answer_shape("olleh") == answer_shape("dlrow") == "aaaaa"
    assert answer_shape("olleh") != answer_shape("eno")
    assert answer_shape("\\frac{3}{4}") == answer_shape("\\frac{1}{12}")
    assert answer_shape("-4") != answer_shape("x+4")
    assert answer_shape("B") == answer_shape("C")  # (multiple choice: one format)


@pytest.mark.parametrize("kind", [words, numbers, mixed])
def test_no_pretraining_text_pairs_a_prompt_with_an_answer_its_reward_grades_right(tmp_path, kind):
    """Thousands of draws, graded by the task's own reward: not one right, not one own answer,
    and (the format) nearly every answer of the prompt's own shape. 'Abc' and 'abc' (different
    answers that the case-insensitive reward grades right for each other) are caught by the
    grading, not by the shape."""
    items = [*kind(150, seed=1), "Abc", "abc", "level", "stop", "pots"]
    task = custom_task(tmp_path / "user", items)
    try:
        pairs = draws(task)
        graded = task.verifier.score_many(pairs)  # type: ignore[attr-defined]
        right = [pair for pair, s in zip(pairs, graded, strict=True) if s > 0]
        assert right == [], right[:5]
        assert not any(r == p.answer for p, r in pairs)
        same = sum(answer_shape(r) == answer_shape(p.answer) for p, r in pairs)
        assert same >= 0.95 * len(pairs), same
        assert task.warm_start.unpaired == 0
    finally:
        task.verifier.close()  # type: ignore[attr-defined]


def math_task(answers: list[str]) -> MathTask:
    rows = [{"problem": f"problem {i}?", "answer": a} for i, a in enumerate(answers)]
    return MathTask.from_rows(rows, verifier=PooledVerifier(MathVerify(), workers=1))


def test_a_math_task_never_pairs_an_equivalent_answer():
    """math-verify is the judge: ``2/4`` has the shape of ``1/2`` and grades right for it."""
    task = math_task(["1/2", "2/4", "3/6", "1/3", "2/6", "3/4", "6/8", "0.5", "7", "7.0", "8"])
    try:
        pairs = draws(task, 1000)
        graded = task.verifier.score_many(pairs)  # type: ignore[attr-defined]
        assert sum(s > 0 for s in graded) == 0
        assert task.warm_start.unpaired == 0 and all(r.startswith(" \\boxed{") for _, r in pairs)
        # (the graded pool held right ones: three times as many pairings graded as kept)
        assert task.warm_start.graded > sum(map(len, task.warm_start.kept))
    finally:
        task.verifier.close()  # type: ignore[attr-defined]


def test_where_every_pairing_grades_right_the_prompt_alone_and_one_line(caplog):
    task = math_task(["1/2", "2/4", "3/6", "0.5", "4/8"])
    try:
        with caplog.at_level(logging.INFO, logger="reval.warm_start"):
            pairs = draws(task, 200)
        assert {r for _, r in pairs} == {""}
        lines = [r.getMessage() for r in caplog.records if "prompt alone" in r.getMessage()]
        assert len(lines) == 1 and lines[0].startswith("format pretraining: 5 of 5 prompts")
    finally:
        task.verifier.close()  # type: ignore[attr-defined]


def sets(*items: str) -> list[str]:
    return [arg for item in items for arg in ("--set", item)]


RUN = [
    "task.prompt_field=question",
    # The pretraining a user gets by default (configs/demo.toml): 300 steps of 64, lr 3e-3.
    "rollout.max_new_tokens=8",
    "rollout.prompts_per_round=2",
    "rollout.n=2",
    "rollout.verifier_workers=1",
    "buffer.capacity=16",
    "learner.batch_size=4",
    "learner.micro_batch_size=4",
    "learner.updates_per_round=1",
    "learner.rounds=1",
    "eval.max_prompts=100",
    "metrics.progress=false",
    "metrics.plot=false",
]


def before_rl(tmp_path: Path, items: list[str], *extra: str) -> dict:
    data, module = write_task(tmp_path / "user", items)
    user = [f"task.dataset={data}", f"task.reward={module}:reward"]
    rc = main(["train", "--no-progress",
               *sets(*user, *RUN, *extra, f"output_dir={tmp_path}", "name=w")])  # fmt: skip
    assert rc == 0
    summary: dict = json.loads((tmp_path / "w" / "summary.json").read_text())
    assert summary["pretrain_steps"] == 300 and "success_before_rl" in summary
    return summary


def test_reverse_the_word_starts_near_chance(tmp_path):
    """Letters only: the old pairing pretrained on the reversed words themselves (0.99)."""
    summary = before_rl(tmp_path, words(100, seed=2))
    assert summary["success_before_rl"] < 0.1, summary
    assert summary["pretrain_prompts_unpaired"] == 0 and summary["warnings"] == [], summary


def test_reverse_the_number_starts_near_chance(tmp_path):
    summary = before_rl(tmp_path, numbers(100, seed=3))
    assert summary["success_before_rl"] < 0.1, summary
    assert summary["pretrain_prompts_unpaired"] == 0 and summary["warnings"] == [], summary


def test_a_run_that_starts_suspiciously_high_says_so(tmp_path, caplog):
    """A reward that grades every answer right: no pairing is wrong, so every prompt is
    pretrained alone (one line), and success before RL (1.0) comes with the warning."""
    data, module = write_task(tmp_path / "user", words(20, seed=4))
    user = [f"task.dataset={data}", f"task.reward={module}:anything", "model.pretrain_steps=2"]
    with caplog.at_level(logging.INFO):
        rc = main(["train", "--no-progress",
                   *sets(*user, *RUN, f"output_dir={tmp_path}", "name=w")])  # fmt: skip
    assert rc == 0
    summary = json.loads((tmp_path / "w" / "summary.json").read_text())
    assert summary["success_before_rl"] == 1.0 and summary["pretrain_prompts_unpaired"] == 20
    assert len(summary["warnings"]) == 1 and "may leak answers" in summary["warnings"][0]
    messages = [r.getMessage() for r in caplog.records]
    assert sum("20 of 20 prompts" in m for m in messages) == 1, messages
