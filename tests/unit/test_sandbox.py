"""The sandbox seam's start-up rules (rollout/grading/sandbox.py): code grading refuses to start, in
one line, where bubblewrap cannot run; the explicit unsafe mode warns at every start and marks every
answer; the sandbox's deadline must fit inside the grading pool's. The hostile completions are in
tests/integration/test_sandbox_hostile.py."""

from __future__ import annotations

import glob
import logging

import pytest
from pydantic import ValidationError

from reval.config import RolloutConfig
from rollout.grading import sandbox
from rollout.grading.custom import RewardFunction
from rollout.task_types import Prompt

CODE = "rollout.grading.graders:code_tests"
RIGHT = "```python\ndef add(a, b):\n    return a + b\n```"
TESTS = ["assert add(1, 2) == 3", "assert add(2, 2) == 5"]


@pytest.fixture(autouse=True)
def fresh_probe():
    sandbox._probe.cache_clear()
    yield
    sandbox._probe.cache_clear()
    sandbox.set_mode("bwrap")


def graded(grader: RewardFunction, completion: str):
    row = Prompt("p", "q", "", raw="q", metadata={"tests": TESTS})
    return grader.grade_many([(grader.item(row, completion), None)])[0]


def test_code_grading_refuses_to_start_without_bubblewrap(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # (no bwrap on it)
    with pytest.raises(sandbox.SandboxUnavailable) as err:
        RewardFunction(CODE, {}, timeout=5.0)
    assert "bubblewrap" in str(err.value) and "\n" not in str(err.value)
    # Installed but refused (as where user namespaces are not allowed): the why, in one line.
    fake = tmp_path / "bwrap"
    fake.write_text("#!/bin/sh\necho 'bwrap: No permissions to create new namespace' >&2\nexit 1\n")
    fake.chmod(0o755)
    sandbox._probe.cache_clear()
    with pytest.raises(sandbox.SandboxUnavailable) as err:
        RewardFunction(CODE, {}, timeout=5.0)
    assert "No permissions to create new namespace" in str(err.value)
    assert "\n" not in str(err.value)
    # Graders that never execute model text need no sandbox.
    RewardFunction("rollout.grading.graders:exact_match", {}, timeout=5.0)


def test_unsafe_mode_is_explicit_warns_at_every_start_and_marks_every_answer(
    tmp_path, monkeypatch, caplog
):
    monkeypatch.setenv("PATH", str(tmp_path))
    before = set(glob.glob("/tmp/reval-unsafe-*"))
    with caplog.at_level(logging.WARNING, logger="reval.sandbox"):
        grader = RewardFunction(CODE, {}, timeout=5.0, sandbox="unsafe-none")
        grader.warm_up()
        assert sum("NO sandbox" in r.getMessage() for r in caplog.records) == 1
        RewardFunction(CODE, {}, timeout=5.0, sandbox="unsafe-none")  # (another run)
        assert sum("NO sandbox" in r.getMessage() for r in caplog.records) == 2
    got = graded(grader, RIGHT)  # (benign code only: this runs on the host)
    assert got.score == 0.5 and got.components == {"passed": 1.0, "compiled": 1.0, "unsafe": 1.0}
    assert set(glob.glob("/tmp/reval-unsafe-*")) == before


def test_sandboxed_answers_carry_no_unsafe_mark_and_the_deadline_fits_the_pools():
    grader = RewardFunction(CODE, {"timeout_s": 2.0}, timeout=3.0)
    got = graded(grader, RIGHT)
    assert got.score == 0.5 and got.components == {"passed": 1.0, "compiled": 1.0}
    # The sandbox must end (and clean up) before the pool kills the grading process.
    with pytest.raises(ValueError, match=r"rollout.verifier_timeout_s \(5 s\) - 1 s"):
        RewardFunction(CODE, {"timeout_s": 5.0}, timeout=5.0)
    with pytest.raises(ValueError, match="verifier_timeout_s"):
        RewardFunction(CODE, {}, timeout=3.5)  # (the default timeout_s is 3 s)


def test_the_config_names_the_two_modes():
    assert RolloutConfig().sandbox == "bwrap"
    assert RolloutConfig(sandbox="unsafe-none").sandbox == "unsafe-none"
    with pytest.raises(ValidationError):
        RolloutConfig(sandbox="none")
