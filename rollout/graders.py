"""The built-in reward functions, named like a user's (``task.reward =
"rollout.graders:NAME"``, their options in ``task.reward_args``) and run the same way: in the
grading processes of ``rollout/verify.py``, through ``rollout/rewards.py``'s ``RewardFunction``.

| name | reward | ``task.reward_args`` |
|---|---|---|
| ``math_boxed`` | 1 when the last ``\\boxed{}`` equals the row's answer (math-verify: ``MathVerify``) | ``field`` ("answer"), ``require_think`` (false) |
| ``exact_match`` | 1 when the stripped completion equals the row's answer | ``field`` ("answer"), ``ignore_case`` (false) |
| ``regex_format`` | 1 when the completion matches a regular expression | ``pattern``, ``full`` (false: ``re.search``; true: ``re.fullmatch``) |
| ``code_tests`` | the share of the row's tests the completion's code passes, run in a sandboxed subprocess | ``tests_field`` ("tests"), ``timeout_s`` (5), ``memory_mb`` (512) |
| ``http_reward`` | a reward served over HTTP (a reward model elsewhere), one POST per chunk of answers | ``url``, ``timeout_s`` (30), ``headers`` ({}), ``token_env`` |
"""  # noqa: E501

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from typing import Any


def math_boxed(
    prompt: Any,
    completion: str,
    metadata: Mapping[str, Any],
    field: str = "answer",
    require_think: bool = False,
) -> float:
    """1.0 when the completion's last ``\\boxed{}`` is math-verify-equivalent to
    ``metadata[field]`` (the math task's grader, ``verify.MathVerify``), else 0.0."""
    from rollout.verify import MathVerify

    return MathVerify(require_think=require_think).grade(str(metadata[field]), completion)


def exact_match(
    prompt: Any,
    completion: str,
    metadata: Mapping[str, Any],
    field: str = "answer",
    ignore_case: bool = False,
) -> float:
    """1.0 when the stripped completion equals the stripped ``metadata[field]``."""
    got, want = completion.strip(), str(metadata[field]).strip()
    if ignore_case:
        got, want = got.casefold(), want.casefold()
    return 1.0 if got == want else 0.0


def regex_format(
    prompt: Any, completion: str, metadata: Mapping[str, Any], pattern: str, full: bool = False
) -> float:
    """1.0 when ``pattern`` matches the completion (``re.search``; ``full``: the whole of it)."""
    match = re.fullmatch if full else re.search
    return 1.0 if match(pattern, completion, re.DOTALL) else 0.0


_FENCE = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL)

_HARNESS = """
import json, sys
source, tests = json.loads(sys.stdin.read())
passed, ran = 0, 1
namespace = {"__name__": "solution"}
try:
    exec(compile(source, "solution.py", "exec"), namespace)
except BaseException:
    tests, ran = [], 0
for test in tests:
    try:
        exec(compile(test, "test.py", "exec"), dict(namespace))
        passed += 1
    except BaseException:
        pass
print("REVAL_PASSED", passed, ran)
"""


def code_tests(
    prompt: Any,
    completion: str,
    metadata: Mapping[str, Any],
    tests_field: str = "tests",
    timeout_s: float = 5.0,
    memory_mb: int = 512,
) -> dict[str, float]:
    """The share of ``metadata[tests_field]`` (a string of test code, or a list of them, each
    run on its own) that passes against the completion's code (its last fenced ```python
    block, else all of it). The code runs in a fresh ``python -I`` in an empty temporary
    directory, with ``resource.setrlimit`` limits: ``timeout_s`` of CPU time (and of wall time),
    ``memory_mb`` of address space, no file over 1 MB, no child processes; stdin carries the
    code, nothing else is inherited but ``PATH``. Components: ``passed`` (tests passed),
    ``compiled`` (1 when the code ran to its end)."""
    tests = metadata[tests_field]
    tests = [tests] if isinstance(tests, str) else [str(t) for t in tests]
    blocks = _FENCE.findall(completion)
    source = blocks[-1] if blocks else completion

    def limits() -> None:  # (in the child, before it runs Python)
        import resource

        cpu = max(1, int(timeout_s + 0.999))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
        memory = memory_mb * 2**20
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
        resource.setrlimit(resource.RLIMIT_FSIZE, (2**20, 2**20))
        if os.getuid():  # (root ignores it)
            resource.setrlimit(resource.RLIMIT_NPROC, (0, 0))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

    with tempfile.TemporaryDirectory(prefix="reval-code-") as tmp:
        proc = subprocess.Popen(
            [sys.executable, "-I", "-c", _HARNESS],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            cwd=tmp,
            env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")},
            preexec_fn=limits,
            start_new_session=True,  # (its own process group: killed whole on timeout)
        )
        try:
            stdout, _ = proc.communicate(json.dumps([source, tests]), timeout=timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(OSError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            return {"score": 0.0, "passed": 0.0, "compiled": 0.0}
    found = re.search(r"^REVAL_PASSED (\d+) ([01])$", stdout, re.MULTILINE)
    passed, ran = (int(found.group(1)), float(found.group(2))) if found else (0, 0.0)
    return {"score": passed / len(tests) if tests else 0.0, "passed": float(passed),
            "compiled": ran}  # fmt: skip


def http_reward(
    prompts: Sequence[Any],
    completions: Sequence[str],
    metadata: Sequence[Mapping[str, Any]],
    url: str,
    timeout_s: float = 30.0,
    headers: Mapping[str, str] | None = None,
    token_env: str | None = None,
) -> list[Any]:
    """Rewards served over HTTP: one POST of ``{"prompts", "completions", "metadata"}`` (JSON)
    to ``url`` per chunk of answers, answered with ``{"rewards": [...]}``, one reward (a number
    or a dict with ``score``) per answer, in order. ``token_env``: the environment variable
    holding a bearer token (a secret stays out of the config, which is written to the run
    directory). An HTTP error or a timeout fails the chunk: each of its answers scores 0,
    counted as an ``error``. What it may reach and send is guarded (``rollout/http_guard.py``):
    http(s) only, no private, loopback or link-local address unless the operator lists it
    (``REVAL_HTTP_REWARD_HOSTS``), no redirect followed, ``token_env`` starting with
    ``REVAL_REWARD_`` or listed (``REVAL_HTTP_REWARD_TOKEN_ENVS``), an answer of at most 16 MiB,
    and ``timeout_s`` for the whole request."""
    from rollout.http_guard import check_target, check_token_env, post_json

    check_target(url)  # (before the token is read: a refused URL never sees it)
    sent = {"Content-Type": "application/json", **dict(headers or {})}
    if token_env is not None:
        check_token_env(token_env)
        token = os.environ.get(token_env)
        if not token:
            raise ValueError(f"http_reward: the environment variable {token_env} is not set")
        sent["Authorization"] = f"Bearer {token}"
    body = json.dumps(
        {"prompts": list(prompts), "completions": list(completions), "metadata": list(metadata)}
    ).encode()
    answer = json.loads(post_json(url, body, sent, float(timeout_s)))
    rewards = answer.get("rewards") if isinstance(answer, dict) else None
    if not isinstance(rewards, list):
        raise ValueError(f"{url} answered without a 'rewards' list: {str(answer)[:200]}")
    return rewards


http_reward.batched = True  # type: ignore[attr-defined]
