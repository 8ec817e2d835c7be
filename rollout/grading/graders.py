"""The built-in reward functions, named like a user's (``task.reward =
"rollout.grading.graders:NAME"``, their options in ``task.reward_args``) and run the same way:
in the grading processes of ``rollout/grading/pool.py``, through ``rollout/grading/custom.py``'s
``RewardFunction``.

| name | reward | ``task.reward_args`` |
|---|---|---|
| ``math_boxed`` | 1 when the last ``\\boxed{}`` equals the row's answer (math-verify: ``MathVerify``) | ``field`` ("answer"), ``require_think`` (false) |
| ``exact_match`` | 1 when the stripped completion equals the row's answer | ``field`` ("answer"), ``ignore_case`` (false) |
| ``regex_format`` | 1 when the completion matches a regular expression | ``pattern``, ``full`` (false: ``re.search``; true: ``re.fullmatch``) |
| ``code_tests`` | the share of the row's tests the completion's code passes, run in the sandbox (``rollout/grading/sandbox.py``) | ``tests_field`` ("tests"), ``timeout_s`` (3), ``memory_mb`` (512) |
| ``http_reward`` | a reward served over HTTP (a reward model elsewhere), one POST per chunk of answers | ``url``, ``timeout_s`` (30), ``headers`` ({}), ``token_env`` |
"""  # noqa: E501

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

from rollout.grading import sandbox
from rollout.grading.custom import batched, preflighted


def math_boxed(
    prompt: Any,
    completion: str,
    metadata: Mapping[str, Any],
    field: str = "answer",
    require_think: bool = False,
) -> float:
    """1.0 when the completion's last ``\\boxed{}`` is math-verify-equivalent to
    ``metadata[field]`` (the math task's grader, ``math_grading.MathVerify``), else 0.0."""
    from rollout.grading.math_grading import MathVerify

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

# The solution's process (model code): its first frame is the limits, its second the source.
# After the source has run, it answers frames ``(name, args, kwargs)`` with ``("ok", value)``,
# ``("raise", exception name)`` or ``("bad", type name)``; all of it is hostile to the harness.
_SOLUTION = (
    sandbox.CONFINE
    + r"""
import ast, os, struct, sys
rx, tx = os.fdopen(os.dup(0), "rb"), os.fdopen(os.dup(1), "wb")
os.dup2(2, 1)
os.dup2(os.open("/dev/null", os.O_RDONLY), 0)
def _frame():
    head = rx.read(4)
    return None if len(head) < 4 else rx.read(struct.unpack(">I", head)[0]).decode()
def _send(value):
    data = repr(value).encode()
    tx.write(struct.pack(">I", len(data)) + data)
    tx.flush()
PLAIN = (int, float, bool, str, bytes, complex, type(None))
def _plain(v, depth=0):
    if depth > 50:
        return False
    if type(v) in PLAIN:
        return True
    if type(v) in (list, tuple, set):
        return all(_plain(x, depth + 1) for x in v)
    if type(v) is dict:
        return all(_plain(k, depth + 1) and _plain(x, depth + 1) for k, x in v.items())
    return False
limits = ast.literal_eval(_frame())
source = _frame()
_confine(*limits)
del limits
ns = {"__name__": "solution", "__builtins__": __builtins__}
try:
    exec(compile(source, "solution.py", "exec"), ns)
except BaseException as err:
    _send(("error", type(err).__name__))
    os._exit(0)
_send(("ok", {k: (None if callable(v) else v) for k, v in list(ns.items())
              if not k.startswith("__")
              and (callable(v) or (_plain(v) and len(repr(v)) <= 1 << 16))}))
while (req := _frame()) is not None:
    name, args, kwargs = ast.literal_eval(req)
    try:
        value = ns[name](*args, **kwargs)
    except BaseException as err:
        _send(("raise", type(err).__name__))
        continue
    _send(("ok", value) if _plain(value) else ("bad", type(value).__name__))
"""
)

# The harness (trusted; pid 1 of the sandbox): runs each test in its own process, with the
# solution's functions as proxies that return only plain values parsed by ``ast.literal_eval``.
_HARNESS = (
    sandbox.HIDE
    + r"""
_hide()
import ast, json, os, struct, subprocess, sys
nonce, fd = sys.stdin.buffer.readline().split()
job = json.loads(sys.stdin.buffer.read())
report = os.fdopen(int(fd), "w", buffering=1)
def say(*words):
    report.write(" ".join([nonce.decode(), *map(str, words)]) + "\n")
MAX_FRAME = 1 << 20
class Solution:
    def __init__(self):
        self.proc = subprocess.Popen([sys.executable, "-I", "-S", "-X", "utf8", "-c", job["boot"]],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, env={})
        try:
            self.send(repr(tuple(job["limits"])))
            self.send(job["source"])
            kind, self.names = self.recv()
            if kind != "ok" or type(self.names) is not dict:
                raise RuntimeError("the solution did not run")
        except BaseException:
            self.close()
            raise
    def send(self, text):
        data = text.encode()
        self.proc.stdin.write(struct.pack(">I", len(data)) + data)
        self.proc.stdin.flush()
    def recv(self):
        head = self.proc.stdout.read(4)
        if len(head) < 4:
            raise RuntimeError("the solution's process ended")
        n = struct.unpack(">I", head)[0]
        if n > MAX_FRAME:
            raise RuntimeError("answer too long")
        data = self.proc.stdout.read(n)
        if len(data) < n:
            raise RuntimeError("the solution's process ended")
        got = ast.literal_eval(data.decode())
        if type(got) is not tuple or len(got) != 2:
            raise RuntimeError("not an answer")
        return got
    def call(self, name, args, kwargs):
        request = repr((name, args, kwargs))
        if ast.literal_eval(request) != (name, args, kwargs):
            raise TypeError("only plain values can be passed to the solution")
        self.send(request)
        kind, value = self.recv()
        if kind != "ok":
            raise RuntimeError(f"{kind}: {value}")
        return value
    def namespace(self):
        ns = {}
        for name, value in self.names.items():
            if type(name) is not str:
                continue
            if value is None:
                ns[name] = lambda *a, _n=name, **k: self.call(_n, a, k)
            else:
                ns[name] = ast.literal_eval(repr(value))  # (a fresh copy per test)
        return ns
    def close(self):
        self.proc.kill()
        self.proc.wait()
solution, compiled = None, False
for i, test in enumerate(job["tests"]):
    try:
        if solution is None or solution.proc.poll() is not None:
            if solution is not None:
                solution.close()
            solution = None
            solution = Solution()
            if not compiled:
                say("compiled", 1)
                compiled = True
        exec(compile(test, "test.py", "exec"), solution.namespace())
        say("test", i, 1)
    except BaseException:
        say("test", i, 0)
say("end")
"""
)


def _preflight(args: Mapping[str, Any], pool_timeout_s: float, sandbox_mode: str) -> None:
    """When grading starts (``RewardFunction``): the sandbox can run (else one line,
    ``sandbox.SandboxUnavailable``), and ``timeout_s`` leaves the pool's deadline its margin."""
    timeout_s = float(args.get("timeout_s", 3.0))
    sandbox.check_deadline(timeout_s, pool_timeout_s, "task.reward_args.timeout_s")
    sandbox.preflight(sandbox_mode)


@preflighted(_preflight)
def code_tests(
    prompt: Any,
    completion: str,
    metadata: Mapping[str, Any],
    tests_field: str = "tests",
    timeout_s: float = 3.0,
    memory_mb: int = 512,
) -> dict[str, float]:
    """The share of ``metadata[tests_field]`` (a string of test code, or a list of them, each run on
    its own) that passes against the completion's code (its last fenced ```python block, else all of
    it), run through the sandbox seam (``rollout/grading/sandbox.py``: bubblewrap, or the operator's
    explicit ``rollout.sandbox = "unsafe-none"``). Components: ``passed`` (tests passed),
    ``compiled`` (1 when the code ran to its end), and ``unsafe`` (1, only when it ran with no
    sandbox). ``timeout_s`` is the whole answer's deadline (the sandbox's start included; its CPU
    limit too) and must be at most ``rollout.verifier_timeout_s`` - 1 s (checked when grading
    starts); ``memory_mb`` the address space of the code's process.

    How a score cannot be forged: the code runs in a process of its own, which may not start
    others; the tests run in the harness's process, which the code cannot write to or read
    (non-dumpable, pid 1 of the sandbox); the verdicts go from the harness to the grader over a
    pipe only the harness holds, each line keyed with a nonce; the code's stdout is never read.
    A test sees the code's top-level names: a function as a proxy that calls it in the code's
    process and returns its value only when it is plain data (``int float bool str bytes
    complex None`` and ``list tuple set dict`` of them: exact types, copied by ``repr`` and
    ``ast.literal_eval``; at most 1 MiB), and plain values (up to 64 KiB each) as copies. So
    an object whose ``__eq__`` is always true never reaches a test, and a test's expected values
    never reach the code.

    Its limits: a function's other return values (objects of the code's classes, generators,
    functions, NaN) fail the test; arguments must be plain data (no callables), passed by copy
    (a test that checks a list mutated in place fails); a test can call the code's functions
    but not use its classes or modules. The code's process is restarted when it dies (a test
    after the one that killed it runs), and every test shares the one deadline: tests that
    reported before it count."""
    tests = metadata[tests_field]
    tests = [tests] if isinstance(tests, str) else [str(t) for t in tests]
    outcome = run_tests(completion, tests, timeout_s, memory_mb)
    passed = {int(w[1]) for w in (ln.split() for ln in outcome.report)
              if len(w) == 3 and w[0] == "test" and w[2] == "1" and w[1].isdigit()
              and int(w[1]) < len(tests)}  # fmt: skip
    graded = {"score": len(passed) / len(tests) if tests else 0.0, "passed": float(len(passed)),
              "compiled": 1.0 if "compiled 1" in outcome.report else 0.0}  # fmt: skip
    if outcome.unsafe:
        graded["unsafe"] = 1.0
    return graded


def run_tests(completion: str, tests: list[str], timeout_s: float = 3.0,
              memory_mb: int = 512) -> sandbox.Outcome:  # fmt: skip
    """``code_tests``' run: the completion's code against ``tests`` in the sandbox; the report
    lines are ``compiled 1``, ``test I 0|1`` and ``end``."""
    blocks = _FENCE.findall(completion)
    source = blocks[-1] if blocks else completion
    limits = sandbox.Limits(wall_s=timeout_s, cpu_s=max(1, int(timeout_s + 0.999)),
                            memory_mb=memory_mb)  # fmt: skip
    caps = [limits.cpu_s, limits.memory_mb, limits.file_mb, limits.open_files]
    job = {"boot": _SOLUTION, "source": source, "tests": tests, "limits": caps}
    return sandbox.run(_HARNESS, json.dumps(job).encode(), limits)


@batched
def http_reward(
    prompts: Sequence[Any],
    completions: Sequence[str],
    metadata: Sequence[Mapping[str, Any]],
    url: str,
    timeout_s: float = 30.0,
    headers: Mapping[str, str] | None = None,
    token_env: str | None = None,
) -> list[Any]:
    """Rewards served over HTTP: one POST of ``{"prompts", "completions", "metadata"}`` (JSON) to
    ``url`` per chunk of answers, answered with ``{"rewards": [...]}``, one reward (a number or a
    dict with ``score``) per answer, in order. ``token_env``: the environment variable holding a
    bearer token (a secret stays out of the config, which is written to the run directory). An HTTP
    error or a timeout fails the chunk: each of its answers scores 0, counted as an ``error``. What
    it may reach and send is guarded (``rollout/grading/http_guard.py``): http(s) only, no private,
    loopback or link-local address unless the operator lists it (``REVAL_HTTP_REWARD_HOSTS``), no
    redirect followed, ``token_env`` starting with ``REVAL_REWARD_`` or listed
    (``REVAL_HTTP_REWARD_TOKEN_ENVS``), an answer of at most 16 MiB, and ``timeout_s`` for the whole
    request."""
    from rollout.grading.http_guard import check_token_env, post_json

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
