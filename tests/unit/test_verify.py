"""Math grading (rollout/grading/math_grading.py) and the grading pool (rollout/grading/pool.py,
process.py): math-verify grading, the worker pool's timeouts, crashes and threads.

One pool for the module (workers start in ~0.5 s each). The pathological answer is
``3^{1000000000}`` against a gold ``2``: sympy's ``Integer._eval_power`` computes 3**10**9 exactly;
with math-verify's alarms off it ran past 60 s here; with its alarm (1 s) it stops after ~1.2 s.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from rollout.grading.math_grading import MathVerify, choice_letter, clean_gold, last_boxed_answer
from rollout.grading.pool import VerifierPool

ROOT = Path(__file__).resolve().parents[2]
HANG = "\\boxed{3^{1000000000}}"  # against gold "2"
GRADER = MathVerify(parsing_timeout=1, verify_timeout=1)


def box(s: str) -> str:
    return f"Let's see. The final answer is \\boxed{{{s}}}."


@pytest.fixture(scope="module")
def registry() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture(scope="module")
def pool(registry: CollectorRegistry) -> Iterator[VerifierPool]:
    with VerifierPool(GRADER, workers=2, timeout=5.0, registry=registry) as p:
        assert p.wait_ready(60)
        yield p


def errors(pool: VerifierPool) -> dict[str, float]:
    return {r: pool.metrics.error_count(r) for r in ("timeout", "crash", "error", "startup")}


EQUAL = [
    ("\\frac{1}{2}", box("0.5")),
    ("0.5", box("\\frac{1}{2}")),
    ("\\frac{1}{2}", box("\\dfrac{1}{2}")),
    ("\\frac12", box("\\tfrac{1}{2}")),
    ("\\frac{1}{2}", box("\\frac{2}{4}")),
    ("\\frac{\\sqrt{2}}{2}", box("\\sqrt{2}/2")),
    ("\\frac{\\sqrt{2}}{2}", box("\\frac{1}{\\sqrt{2}}")),
    ("2\\sqrt{3}", box("\\sqrt{12}")),
    ("(0,1]", box("(0, 1]")),
    ("(0,1]", box("\\left(0,1\\right]")),
    ("\\{1,2\\}", box("\\{2,1\\}")),
    ("(1,2)", box("(1, 2)")),
    ("(1,2,3)", box("(1,2,3)")),
    ("5", box("5 \\text{ cm}")),
    ("5", box("5\\,\\mathrm{cm}")),
    ("3", box("x = 3")),
    ("x=3", box("3")),
    ("1000", box("1,000")),
    ("\\$5", box("5")),
    ("72^\\circ", box("72")),
    ("\\frac{1}{3}", box("0.333333")),  # math-verify rounds floats to 6 places
    ("x^2+2x+1", box("(x+1)^2")),
    ("\\infty", box("\\infty")),
    ("\\text{even}", box("\\text{even}")),
    ("5", box("5.")),  # fast path: normalize_answer drops the final dot (sympy cannot parse it)
    ("5", "so \\boxed 5$ it is"),
    ("2", "first \\boxed{1}, on second thought \\boxed{2}"),  # the last box counts
    ("\\boxed{7}", box("7")),  # a gold answer given boxed
    ("$-1$", box("- 1")),
]

NOT_EQUAL = [
    ("1", "first \\boxed{1}, on second thought \\boxed{2}"),
    ("2", "the answer is 2, no box"),
    ("2", ""),
    ("0.5", box("0.51")),
    ("\\frac{1}{3}", box("0.33")),
    ("\\pi", box("3.14")),
    ("10", box("10.01")),
    ("-1", box("1")),
    ("x^2", box("x^3")),
    ("3", box("x = 4")),
    ("(0,1]", box("(0,1)")),
    ("(0,1]", box("[0,1]")),
    ("\\{1,2\\}", box("\\{1,3\\}")),
    ("(1,2)", box("(2,1)")),
    ("\\frac{\\pi}{4}", box("45^\\circ")),
    ("3", box("three")),
    ("\\text{even}", box("\\text{odd}")),
]

MALFORMED = [
    "\\boxed{",
    "\\boxed{2",
    "\\boxed{}",
    "\\boxed{\\frac{2}{}}",
    "\\boxed{\\sqrt{}}",
    "\\boxed{)(}",
    "\\boxed{\\begin{pmatrix} 1 & 2}",
    "\\boxed{2^{}_{}}",
    "\\boxed{\\left( \\right.}",
    "\\boxed{" + "\\frac{" * 50 + "}",
]


# -- pure helpers ---------------------------------------------------------------------------------


def test_last_boxed_answer() -> None:
    assert last_boxed_answer("a \\boxed{1} b \\boxed{\\frac{1}{2}} c") == "\\frac{1}{2}"
    assert last_boxed_answer("\\boxed {x}") == "x"
    assert last_boxed_answer("$\\boxed 5$") == "5"
    assert last_boxed_answer("\\fbox{3}") == "3"
    assert last_boxed_answer("\\boxed{1} then \\boxed{2") is None  # last one unclosed
    assert last_boxed_answer("no box") is None
    assert last_boxed_answer("\\boxed") is None


def test_clean_gold() -> None:
    assert clean_gold(" $\\frac{1}{2}$ ") == "\\frac{1}{2}"
    assert clean_gold("\\boxed{3}") == "3"
    assert clean_gold("(0,1]") == "(0,1]"


def test_choice_letter() -> None:
    for s in ("B", "b", "(B)", "B)", "B.", "\\text{B}", "\\textbf{(B)}", "(B) 42", "B) 42", "$B$"):
        assert choice_letter(s) == "B", s
    for s in ("E", "A + B", "AB", "", "42", "\\text{}"):
        assert choice_letter(s) is None, s
    assert choice_letter("E", "ABCDE") == "E"


# -- grading ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("gold", "response"), EQUAL)
def test_equal_forms(pool: VerifierPool, gold: str, response: str) -> None:
    assert pool.score_many([(gold, response)]) == [1.0]


@pytest.mark.parametrize(("gold", "response"), NOT_EQUAL)
def test_not_equal(pool: VerifierPool, gold: str, response: str) -> None:
    assert pool.score_many([(gold, response)]) == [0.0]


def test_malformed_latex_scores_zero_without_errors(pool: VerifierPool) -> None:
    before = errors(pool)
    assert pool.score_many([("2", r) for r in MALFORMED]) == [0.0] * len(MALFORMED)
    assert errors(pool) == before
    assert pool.score_many([("2", box("2"))]) == [1.0]


def test_deep_nesting_scores_zero(pool: VerifierPool) -> None:
    before = errors(pool)
    nested = "\\boxed{" + "{" * 300 + "2" + "}" * 300 + "}"  # the ANTLR parse takes > 1 s
    assert pool.score_many([("2", nested)]) == [0.0]
    assert errors(pool)["crash"] == before["crash"]


def test_percent_as_math_verify_reads_it(pool: VerifierPool) -> None:
    """math-verify reads ``X\\%`` as X/100, and also equal to X itself when X is an integer
    (``50\\%`` = 0.5 = 50); a non-integer percentage equals only X/100."""
    cases = {
        ("0.5", box("50\\%")): 1.0,
        ("50\\%", box("0.5")): 1.0,
        ("50", box("50\\%")): 1.0,
        ("50\\%", box("50")): 1.0,
        ("50\\%", box("50 percent")): 1.0,
        ("0.125", box("12.5\\%")): 1.0,
        ("12.5", box("12.5\\%")): 0.0,
        ("12.5\\%", box("12.5")): 0.0,
        ("0.5", box("0.5\\%")): 0.0,
    }
    assert pool.score_many(list(cases)) == list(cases.values())


def test_require_think() -> None:
    g = MathVerify(require_think=True)
    assert g.grade("2", "<think>so \\boxed{2}</think> The answer is \\boxed{2}.") == 1.0
    assert g.grade("2", "The answer is \\boxed{2}.") == 0.0  # no </think>
    assert g.grade("2", "<think>\\boxed{2}</think> no box after thinking") == 0.0
    # DeepScaleR grades text.split("</think>")[1]: between the first </think> and the next one
    # (deepscaler/rewards/math_reward.py, RewardMathFn.__call__); these two were graded on the
    # text after the first </think> before, with the opposite rewards.
    assert g.grade("2", "<think>\\boxed{3}</think> \\boxed{2} </think> \\boxed{5}") == 1.0
    assert g.grade("2", "<think>\\boxed{3}</think> \\boxed{5} </think> \\boxed{2}") == 0.0
    assert g.grade("2", "\\boxed{3}</think></think> \\boxed{2}") == 0.0  # empty segment
    assert MathVerify().grade("2", "The answer is \\boxed{2}.") == 1.0


def test_multiple_choice() -> None:
    g = MathVerify(multiple_choice=True)
    assert g.grade("B", box("\\text{B}")) == 1.0
    assert g.grade("B", box("(b)")) == 1.0
    assert g.grade("(B)", box("B)")) == 1.0
    assert g.grade("\\text{B}", box("B")) == 1.0
    assert g.grade("B", box("(B) 42")) == 1.0
    assert g.grade("B", box("C")) == 0.0
    assert g.grade("B", "The answer is B") == 0.0  # not boxed
    assert g.grade("B", box("E")) == 0.0
    assert g.grade("B", "\\boxed{A} ... \\boxed{B}") == 1.0
    with pytest.raises(ValueError, match="multiple-choice gold"):
        g.grade("42", box("B"))


def test_in_process_grading_matches_pool(pool: VerifierPool) -> None:
    items = EQUAL[:8] + NOT_EQUAL[:8]
    assert [GRADER.grade(g, r) for g, r in items] == pool.score_many(items)


def test_in_process_off_main_thread_raises_not_zero() -> None:
    out: list[BaseException] = []

    def run() -> None:
        try:
            GRADER.grade("\\frac{1}{2}", box("0.5"))
        except RuntimeError as err:
            out.append(err)

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert out and "main thread" in str(out[0])


def test_verifier_protocol_and_metrics(pool: VerifierPool, registry: CollectorRegistry) -> None:
    from rollout.tasks import Prompt

    def sample(name: str) -> float:
        return registry.get_sample_value(name) or 0.0

    answers = sample("reval_verifier_answers_total")
    fast = sample("reval_verifier_fast_path_total")
    latency = sample("reval_verifier_latency_seconds_count")
    p = Prompt(id="0", text="1/2?", answer="\\frac{1}{2}")
    assert pool.score(p, box("0.5")) == 1.0  # sympy, in a worker
    assert pool.score(p, box("\\frac{1}{2}")) == 1.0  # fast path
    assert pool.score(p, "no box") == 0.0  # fast path
    assert sample("reval_verifier_answers_total") == answers + 3
    assert sample("reval_verifier_fast_path_total") == fast + 2
    assert sample("reval_verifier_latency_seconds_count") == latency + 1
    assert sample("reval_verifier_workers") == 2


def test_too_long_answer(pool: VerifierPool) -> None:
    before = pool.metrics.error_count("too_long")
    assert pool.score_many([("1", box("1+" * 2000 + "0"))]) == [0.0]
    assert pool.metrics.error_count("too_long") == before + 1


# -- timeouts, crashes, threads -----------------------------------------------------------------


def test_math_verify_timeout_inside_worker(pool: VerifierPool) -> None:
    """math-verify's own alarm stops sympy: 0, counted as a timeout, the worker is kept."""
    before, pids = errors(pool), set(pool.worker_pids)
    t0 = time.monotonic()
    assert pool.score_many([("2", HANG)]) == [0.0]
    assert time.monotonic() - t0 < 4.0
    after = errors(pool)
    assert after["timeout"] == before["timeout"] + 1
    assert after["crash"] == before["crash"]
    assert set(pool.worker_pids) == pids


def test_deadline_kills_and_replaces_worker(pool: VerifierPool) -> None:
    """With the pool's deadline before math-verify's alarm (as when sympy ignores the signal),
    the worker is SIGKILLed and replaced; the answer scores 0 within the deadline."""
    before, pids = errors(pool), set(pool.worker_pids)
    t0 = time.monotonic()
    assert pool.score_many([("2", HANG)], timeout=0.5) == [0.0]
    assert time.monotonic() - t0 < 2.5
    assert errors(pool)["timeout"] == before["timeout"] + 1
    assert pool.wait_ready(30)
    new = set(pool.worker_pids)
    assert len(new) == 2 and new != pids
    for pid in pids - new:
        assert not _alive(pid)
    assert pool.score_many([("\\frac{1}{2}", box("0.5")), ("2", box("3"))]) == [1.0, 0.0]


def test_worker_crash_is_recovered(pool: VerifierPool) -> None:
    assert pool.wait_ready(30)
    before = errors(pool)
    result: list[float] = []
    t0 = time.monotonic()
    th = threading.Thread(target=lambda: result.extend(pool.score_many([("2", HANG)], timeout=10)))
    th.start()
    time.sleep(0.3)  # in flight (math-verify's alarm would end it at ~1.2 s)
    for pid in pool.worker_pids:
        os.kill(pid, signal.SIGKILL)
    th.join(10)
    assert result == [0.0]
    assert time.monotonic() - t0 < 3.0
    after = errors(pool)
    assert after["crash"] >= before["crash"] + 1
    assert after["timeout"] == before["timeout"]
    assert pool.wait_ready(30)
    assert pool.score_many([("\\frac{1}{2}", box("0.5"))]) == [1.0]


def test_eight_threads_agree_with_serial(pool: VerifierPool) -> None:
    items = (EQUAL + NOT_EQUAL) * 2
    serial = [pool.score_many([it])[0] for it in items]
    with ThreadPoolExecutor(8) as ex:
        threaded = list(ex.map(lambda it: pool.score_many([it])[0], items))
        chunks = [items[i : i + 7] for i in range(0, len(items), 7)]
        batched = [s for part in ex.map(pool.score_many, chunks) for s in part]
    assert serial == ([1.0] * len(EQUAL) + [0.0] * len(NOT_EQUAL)) * 2
    assert threaded == serial
    assert batched == serial


def test_closed_pool_raises() -> None:
    p = VerifierPool(GRADER, workers=1)
    p.close()
    p.close()
    with pytest.raises(RuntimeError, match="closed"):
        p.score_many([("1", box("2"))])
    assert p.score_many([("1", "no box")]) == [0.0]  # decided without workers


class FailingGrader(MathVerify):
    def warm_up(self) -> None:
        os._exit(3)


def test_workers_that_cannot_start_fail_loudly() -> None:
    with VerifierPool(FailingGrader(), workers=1, max_start_failures=2) as p:
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="failed to start"):
            p.score_many([("1", box("0.5"))])
        assert time.monotonic() - t0 < 30
        assert p.metrics.error_count("startup") == 2


def test_workers_die_with_the_parent() -> None:
    script = textwrap.dedent(
        """
        import os, signal, sys
        from rollout.grading.pool import VerifierPool
        if __name__ == "__main__":
            pool = VerifierPool(workers=2)
            assert pool.wait_ready(60)
            print(*pool.worker_pids, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    pids = [int(p) for p in proc.stdout.split()]
    assert len(pids) == 2
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(p) for p in pids)


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for a reaper counts as dead)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
