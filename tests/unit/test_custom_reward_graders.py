"""The built-in reward functions (rollout/grading/graders.py), named and called like a user's:
``task.reward = "rollout.grading.graders:NAME"`` with ``task.reward_args``."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from reval.paths import check_reward
from rollout.grading.custom import RewardFunction
from rollout.grading.pool import VerifierPool
from rollout.task_types import Prompt


def grade(spec: str, completions: list[str], metadata: dict, **kwargs):
    """What the grading processes compute, in this process."""
    check_reward(spec, kwargs)  # (the load-time check accepts the call)
    grader = RewardFunction(spec, kwargs)
    row = Prompt("p", "question", "", raw="question", metadata=metadata)
    return grader.grade_many([(grader.item(row, c), None) for c in completions])


def scores(graded) -> list[float]:
    return [g.score for g in graded]


def test_exact_match_regex_format_and_math_boxed():
    assert scores(grade("rollout.grading.graders:exact_match", [" 42\n", "41", "Paris"],
                        {"answer": 42})) == [1.0, 0.0, 0.0]  # fmt: skip
    assert scores(grade("rollout.grading.graders:exact_match", ["paris "], {"city": "Paris"},
                        field="city", ignore_case=True)) == [1.0]  # fmt: skip
    missing = grade("rollout.grading.graders:exact_match", ["1"], {"other": 1})
    assert (missing[0].score, missing[0].reason) == (0.0, "error")  # KeyError: counted
    fmt = r"<think>.+</think>\s*<answer>.+</answer>"
    assert scores(grade("rollout.grading.graders:regex_format",
                        ["<think>a</think> <answer>1</answer>", "<answer>1</answer>"], {},
                        pattern=fmt, full=True)) == [1.0, 0.0]  # fmt: skip
    assert scores(grade("rollout.grading.graders:math_boxed",
                        ["so \\boxed{\\frac{1}{2}}", "\\boxed{0.4}", "no box"],
                        {"answer": "0.5"})) == [1.0, 0.0, 0.0]  # fmt: skip


TESTS = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(2, 2) == 5"]


def test_code_tests_scores_the_share_of_tests_passed_in_a_limited_subprocess():
    right = "Here it is:\n```python\ndef add(a, b):\n    return a + b\n```"
    wrong = "```python\ndef add(a, b):\n    return 0\n```"
    broken = "```python\ndef add(a, b) return\n```"
    graded = grade("rollout.grading.graders:code_tests", [right, wrong, broken], {"tests": TESTS})
    assert scores(graded) == pytest.approx([2 / 3, 1 / 3, 0.0])
    assert [g.components for g in graded] == [
        {"passed": 2.0, "compiled": 1.0},
        {"passed": 1.0, "compiled": 1.0},
        {"passed": 0.0, "compiled": 0.0},
    ]
    # A single test string; the limits: a loop passes the time limit, a hog the memory limit,
    # and the code sees no file of the grader (an empty working directory, no environment).
    t0 = time.perf_counter()
    loop = "```python\nwhile True:\n    pass\n```"
    hog = "```python\nx = bytearray(2 * 1024**3)\ndef add(a, b):\n    return a + b\n```"
    peek = "```python\nimport os\nfiles = os.listdir('.')\nenv = dict(os.environ)\n```"
    graded = grade("rollout.grading.graders:code_tests", [loop, hog, peek],
                   {"checks": "assert files == [] and set(env) <= {'PATH', 'LC_CTYPE'}"},
                   tests_field="checks", timeout_s=1.0, memory_mb=256)  # fmt: skip
    assert scores(graded) == [0.0, 0.0, 1.0]
    assert time.perf_counter() - t0 < 10


class RewardModel(BaseHTTPRequestHandler):
    """A reward model elsewhere: the score is the completion's length over 10, with a component."""

    seen: list[dict] = []  # noqa: RUF012 (the test reads what the server received)

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        RewardModel.seen.append(body)
        if self.headers.get("Authorization") != "Bearer t0k":
            self.send_response(401)
            self.end_headers()
            return
        rewards = [{"score": len(c) / 10, "chars": len(c)} for c in body["completions"]]
        out = json.dumps({"rewards": rewards}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def reward_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), RewardModel)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    RewardModel.seen.clear()
    yield f"http://127.0.0.1:{server.server_address[1]}/score"
    server.shutdown()
    server.server_close()


def test_http_reward_posts_each_chunk_and_reads_one_reward_per_answer(reward_server, monkeypatch):
    # The token from the environment (the grading processes inherit it), not from the config;
    # the operator lists the loopback server (refused by default: rollout/grading/http_guard.py).
    monkeypatch.setenv("REVAL_REWARD_TOKEN", "t0k")
    monkeypatch.setenv("REVAL_HTTP_REWARD_HOSTS", "127.0.0.1")
    args = {"url": reward_server, "token_env": "REVAL_REWARD_TOKEN", "timeout_s": 5}
    grader = RewardFunction("rollout.grading.graders:http_reward", args)
    assert grader.batched  # one POST per chunk of answers
    rows = [Prompt(str(i), f"q{i}", "", raw=f"q{i}", metadata={"i": i}) for i in range(5)]
    with VerifierPool(grader, workers=2, timeout=5.0) as pool:
        graded = pool.grade_many([grader.item(p, "x" * (i + 1)) for i, p in enumerate(rows)])
    assert scores(graded) == pytest.approx([0.1, 0.2, 0.3, 0.4, 0.5])
    assert [g.components for g in graded] == [{"chars": float(i + 1)} for i in range(5)]
    assert len(RewardModel.seen) == 2  # two workers, a chunk each
    sent = sorted(RewardModel.seen, key=lambda b: b["metadata"][0]["i"])
    assert sent[0]["prompts"] == ["q0", "q1", "q2"] and sent[1]["metadata"] == [{"i": 3}, {"i": 4}]
    # Refused (HTTP 401): every answer of the chunk scores 0, counted as an error.
    refused = grade("rollout.grading.graders:http_reward", ["a", "b"], {}, url=reward_server)
    assert [(g.score, g.reason) for g in refused] == [(0.0, "error")] * 2
    assert "401" in refused[0].detail
