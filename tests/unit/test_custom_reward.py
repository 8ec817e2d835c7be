"""Custom rewards by import path (issue 28): how a reward function is called and what it may return
(rollout/grading/custom.py; the task: rollout/custom_task.py), its failures scored 0 and counted in
the one grading pool (rollout/grading/pool.py), the load-time checks naming task.reward
(reval/paths.py), and the prompt field (strings and chat messages)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from reval.config import ConfigError, load_config
from reval.paths import RewardNotFound, check_reward, check_run_paths
from rollout.custom_task import CustomTask, read_prompts
from rollout.grading.custom import RewardFunction, to_graded
from rollout.grading.pool import VerifierPool
from rollout.task_types import Prompt

ROOT = Path(__file__).resolve().parents[2]

REWARDS = """
import asyncio
import time

def exact(prompt, completion, metadata):
    right = completion.strip() == str(metadata["answer"])
    return {"score": float(right), "length": len(completion), "note": "text is not a component"}

def by_mode(prompt, completion, metadata):
    mode = metadata["mode"]
    if mode == "raise":
        raise ValueError("the grader broke")
    if mode == "hang":
        time.sleep(60)
    if mode == "nan":
        return float("nan")
    if mode == "string":
        return "high"
    if mode == "no_score":
        return {"length": 3.0}
    return 1.0

def lengths(prompts, completions, metadata):
    return [len(c) + len(m["answer"]) for c, m in zip(completions, metadata)]
lengths.batched = True

def wrong_count(prompts, completions, metadata):
    return [1.0]
wrong_count.batched = True

async def later(prompt, completion, metadata, delay=0.0):
    await asyncio.sleep(delay)
    return {"score": 0.5, "delay": delay}

async def sleepy(prompt, completion, metadata):
    await asyncio.sleep(float(completion))
    return 1.0

NOT_CALLABLE = 3
"""


@pytest.fixture(scope="module")
def rewards(tmp_path_factory) -> Path:
    """The reward module, in a directory outside the project."""
    path = tmp_path_factory.mktemp("user") / "my_rewards.py"
    path.write_text(REWARDS)
    return path


def prompt(mode: str = "ok", answer: str = "7") -> Prompt:
    return Prompt("p", "3+4=", answer, raw="3+4=", metadata={"answer": answer, "mode": mode})


# -- what a reward may return ---------------------------------------------------------------------


def test_numbers_and_dicts_are_rewards_other_values_score_0_with_a_reason():
    assert to_graded(0.25).score == 0.25 and to_graded(0.25).reason is None
    assert to_graded(True).score == 1.0
    assert to_graded(np.float32(0.5)).score == 0.5
    g = to_graded({"score": 2, "length": 3, "label": "x", "bad": float("nan")})
    assert (g.score, g.reason, g.components) == (2.0, None, {"length": 3.0})
    refused = [
        ("high", "not_a_number"), (None, "not_a_number"), ([1.0], "not_a_number"),
        ({"length": 1}, "not_a_number"), ({"score": "1"}, "not_a_number"),
        (float("nan"), "not_finite"), (math.inf, "not_finite"),
        ({"score": -math.inf}, "not_finite"),
    ]  # fmt: skip
    for value, reason in refused:
        got = to_graded(value)
        assert (got.score, got.reason) == (0.0, reason), value


def test_plain_batched_and_async_functions_are_called_their_way(rewards):
    # In this process (the pool calls the same grade_many in its workers).
    plain = RewardFunction(f"{rewards}:exact")
    assert not plain.batched
    work = [(plain.item(prompt(), "7"), None), (plain.item(prompt(), " 8"), None)]
    graded = plain.grade_many(work)
    assert [g.score for g in graded] == [1.0, 0.0]
    assert [g.components for g in graded] == [{"length": 1.0}, {"length": 2.0}]

    batched = RewardFunction(f"{rewards}:lengths")
    assert batched.batched and batched.batch_call
    assert [g.score for g in batched.grade_many(work)] == [2.0, 3.0]
    bad = RewardFunction(f"{rewards}:wrong_count").grade_many(work)
    assert [(g.score, g.reason) for g in bad] == [(0.0, "not_a_number")] * 2
    assert "1 rewards for 2 answers" in bad[0].detail

    # Async: recognised by inspect.iscoroutinefunction, a chunk awaited together, each answer
    # under the per-answer deadline.
    later = RewardFunction(f"{rewards}:later", {"delay": 0.2})
    assert later.is_async and later.batched and not later.batch_call
    import time

    t0 = time.perf_counter()
    graded = later.grade_many(work * 4)
    assert time.perf_counter() - t0 < 1.0  # 8 answers of 0.2 s each, awaited together
    assert [g.score for g in graded] == [0.5] * 8 and graded[0].components == {"delay": 0.2}
    sleepy = RewardFunction(f"{rewards}:sleepy", timeout=0.3)
    graded = sleepy.grade_many([(sleepy.item(prompt(), "0"), None),
                                (sleepy.item(prompt(), "5"), None)])  # fmt: skip
    assert [(g.score, g.reason) for g in graded] == [(1.0, None), (0.0, "timeout")]


# -- failures in the pool: scored 0, counted, the next answers graded -----------------------------


@pytest.fixture(scope="module")
def by_mode_pool(rewards):
    grader = RewardFunction(f"{rewards}:by_mode", timeout=1.0)
    with VerifierPool(grader, workers=2, timeout=1.0) as pool:
        yield pool


def grade_mode(pool: VerifierPool, mode: str, reason: str) -> None:
    before = pool.metrics.error_count(reason)
    graded = pool.grade_many([pool.grader.item(prompt(mode), "7"),
                              pool.grader.item(prompt("ok"), "7")])  # fmt: skip
    assert [(g.score, g.reason) for g in graded] == [(0.0, reason), (1.0, None)]
    assert pool.metrics.error_count(reason) == before + 1
    # The pool goes on: the next answer is graded.
    assert pool.score_many([pool.grader.item(prompt("ok"), "7")]) == [1.0]


def test_a_reward_that_raises_scores_0_counted_as_error(by_mode_pool):
    grade_mode(by_mode_pool, "raise", "error")


def test_a_reward_that_hangs_scores_0_counted_as_timeout_and_its_process_is_replaced(by_mode_pool):
    pids = set(by_mode_pool.worker_pids)
    grade_mode(by_mode_pool, "hang", "timeout")
    assert by_mode_pool.wait_ready(30)
    assert set(by_mode_pool.worker_pids) != pids  # the hung process was killed and replaced


def test_a_reward_that_returns_nan_scores_0_counted_as_not_finite(by_mode_pool):
    grade_mode(by_mode_pool, "nan", "not_finite")


def test_a_reward_that_returns_a_string_scores_0_counted_as_not_a_number(by_mode_pool):
    grade_mode(by_mode_pool, "string", "not_a_number")
    grade_mode(by_mode_pool, "no_score", "not_a_number")


def test_batched_rewards_go_to_the_workers_in_chunks_with_components_observed(rewards):
    grader = RewardFunction(f"{rewards}:lengths")
    with VerifierPool(grader, workers=2, timeout=2.0) as pool:
        items = [grader.item(prompt(answer="1" * k), "x" * k) for k in range(7)]
        assert pool.score_many(items) == [2.0 * k for k in range(7)]
    exact = RewardFunction(f"{rewards}:exact")
    with VerifierPool(exact, workers=1, timeout=2.0) as pool:
        pool.score_many([exact.item(prompt(), "7"), exact.item(prompt(), "123")])
        count = pool.metrics.registry.get_sample_value
        assert count("reval_reward_component_count", {"name": "length"}) == 2
        assert count("reval_reward_component_sum", {"name": "length"}) == 4


# -- the load-time checks -------------------------------------------------------------------------


def cfg_with(tmp_path: Path, *sets: str):
    data = tmp_path / "data.jsonl"
    if not data.exists():
        data.write_text("".join(json.dumps({"prompt": f"{a}+1=", "answer": str(a + 1)}) + "\n"
                                for a in range(5)))  # fmt: skip
    return load_config(overrides=[f"task.dataset={data}", f"output_dir={tmp_path}", *sets],
                       environ={})  # fmt: skip


def test_a_reward_makes_the_task_custom_and_a_custom_task_needs_its_parts(tmp_path, rewards):
    cfg = cfg_with(tmp_path, f"task.reward={rewards}:exact")  # (the demo preset says addition)
    assert cfg.task.kind == "custom"
    check_run_paths(cfg)  # imports, callable, the call fits
    with pytest.raises(ConfigError, match=r"task: kind=custom needs task.reward \(docs/tasks.md\)"):
        cfg_with(tmp_path, "task.kind=custom")
    with pytest.raises(ConfigError, match=r"task.reward.*not 'package.module:function'"):
        cfg_with(tmp_path, "task.reward=no_colon")


@pytest.mark.parametrize(
    "spec, args, message",
    [
        ("no_such_package.rewards:score", {}, r"task.reward: cannot import 'no_such_package"),
        ("{dir}/missing.py:score", {}, r"task.reward: the file '.*missing.py' does not exist"),
        ("{file}:scroe", {}, r"task.reward: .* has no 'scroe'"),
        ("{file}:NOT_CALLABLE", {}, r"task.reward: .* is a int, not callable"),
        ("{file}:exact", {"unknown": 1}, r"task.reward: .* cannot be called as f\(prompt, "),
        ("rollout.grading.graders:regex_format", {}, r"missing a required argument: 'pattern'"),
    ],
    ids=[
        "bad-import-path",
        "missing-file",
        "missing-callable",
        "not-callable",
        "bad-args",
        "builtin-needs-args",
    ],
)
def test_a_reward_that_cannot_be_called_is_one_line_naming_the_field(rewards, spec, args, message):
    spec = spec.format(dir=rewards.parent, file=rewards)
    with pytest.raises(RewardNotFound, match=message) as err:
        check_reward(spec, args)
    assert "\n" not in str(err.value)


def test_reval_train_refuses_a_bad_reward_before_any_work(tmp_path, rewards):
    # One line and exit status 2, before the model is loaded (no torch import, no run dir).
    code = (
        "import sys; from services.cli import main; rc = main(sys.argv[1:]); "
        "assert 'torch' not in sys.modules; sys.exit(rc)"
    )
    data = cfg_with(tmp_path).task.dataset
    for spec, expect in [("no_such_package.rewards:score", "cannot import"),
                         (f"{rewards}:scroe", "has no 'scroe'")]:  # fmt: skip
        done = subprocess.run(
            [sys.executable, "-c", code, "train", "--no-progress",
             "--set", f"task.reward={spec}", "--set", f"task.dataset={data}",
             "--set", f"output_dir={tmp_path}"],
            cwd=ROOT, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert done.returncode == 2, done.stderr[-2000:]
        last = done.stderr.strip().splitlines()[-1]
        assert last.startswith("reval train: task.reward:") and expect in last, done.stderr
        assert not (tmp_path / "demo").exists()


# -- the prompt field ---------------------------------------------------------------------------


class ChatTokenizer:
    """What read_prompts needs of a tokenizer: a chat template and the token count."""

    chat_template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>"

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
        from jinja2 import Template

        return Template(self.chat_template).render(messages=messages)

    def __call__(self, text, add_special_tokens=False):
        from types import SimpleNamespace

        return SimpleNamespace(input_ids=list(text))


def test_a_chat_message_prompt_goes_through_the_chat_template_and_reaches_the_reward_as_is(
    rewards,
):
    messages = [{"role": "system", "content": "Add."}, {"role": "user", "content": "3+4="}]
    rows = [{"id": "a", "messages": messages, "answer": "7", "level": 2},
            {"id": "b", "messages": [], "answer": "1"},
            {"id": "c", "messages": "plain text", "answer": "2"}]  # fmt: skip
    prompts, skipped = read_prompts(rows, "messages", ChatTokenizer(), 64)
    assert [p.text for p in prompts] == ["<system>Add.<user>3+4=<assistant>", "plain text"]
    assert skipped == {"missing_field": 1}  # (an empty list is no chat)
    first = prompts[0]
    assert first.raw == messages and first.metadata == {"id": "a", "answer": "7", "level": 2}
    grader = RewardFunction(f"{rewards}:exact")
    assert grader.item(first, "7") == (
        messages,
        "7",
        {"id": "a", "answer": "7", "level": 2},
        "stop",
    )
    with pytest.raises(ValueError, match=r"task.prompt_field holds chat messages but the model's "
                       "tokenizer has no chat template"):  # fmt: skip
        read_prompts(rows, "messages", None, 64)


def test_a_missing_prompt_field_is_an_error_naming_it_and_the_columns(tmp_path, rewards):
    cfg = cfg_with(tmp_path, f"task.reward={rewards}:exact", "task.prompt_field=question")
    with pytest.raises(ValueError, match=r"task.prompt_field: no row of task.dataset .* has a "
                       r"usable 'question' .*columns: answer, prompt"):  # fmt: skip
        CustomTask.from_config(cfg.task, None, cfg.rollout)
    # Rows without it are skipped and counted; the others are the task.
    data = tmp_path / "mixed.jsonl"
    data.write_text('{"question": "1+1=", "answer": "2"}\n{"answer": "3"}\n')
    cfg = cfg_with(tmp_path, f"task.reward={rewards}:exact", "task.prompt_field=question",
                   f"task.dataset={data}")  # fmt: skip
    task = CustomTask.from_config(cfg.task, None, cfg.rollout)
    assert [p.text for p in task.prompts] == ["1+1="] and task.skipped == {"missing_field": 1}
    task.verifier.close()  # type: ignore[attr-defined]
