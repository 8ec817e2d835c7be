"""Math answers graded for equivalence with math-verify, in a pool of worker processes.

``MathVerify`` is the grading function: the last ``\\boxed{...}`` of a response against the gold
answer. It is the one grader of math answers: ``reval train``, the rollout workers and
``reval eval`` all grade through ``PooledVerifier``/``VerifierPool``. The pool runs any
``PoolGrader``: a custom task's reward function (``rollout/rewards.py``: ``RewardFunction``)
grades in the same processes, under the same deadline, with the same accounting.

Cheap decisions come first and need no sympy (no box: 0; require_think without ``</think>``: 0; the
normalized strings equal, ``normalize_answer``: 1; multiple choice: letters compared); the rest goes
through math-verify's ``parse`` and ``verify`` (gold and answer both read as ``\\boxed{...}`` LaTeX;
math-verify's defaults: numbers rounded to 6 places, strict variables, ``x = 3`` read as ``3``
against a gold ``3``).

math-verify bounds its own work with ``signal.alarm``: it only works on a process's main thread
(elsewhere ``parse``/``verify`` raise ``ValueError``) and its ``TimeoutException`` is a
``BaseException``. ``VerifierPool`` therefore grades in the main thread of worker processes
(``spawn`` context), each looping over tasks read from its pipe, with math-verify's alarms set so
that hard inputs give up quickly; the pool's dispatcher thread keeps a deadline per answer and
SIGKILLs and replaces a worker that passes it (math-verify's alarms are per call and in whole
seconds, and cannot stop C code that does not return to the interpreter). Such an answer scores 0
and counts as an error; a caller never waits on a stuck worker. Any thread may call
``score``/``score_many``; answers are graded in arrival order.

Workers import this module only (math-verify and sympy, about 0.5 s), not torch. ``spawn`` also
imports the parent's ``__main__`` module in each worker (as multiprocessing always does), so a
script that builds a pool keeps its work under ``if __name__ == "__main__":``.

Metrics (``prometheus_client``, on the registry given to the pool or one of its own):

| name | type | meaning |
|---|---|---|
| ``reval_verifier_answers_total`` | counter | answers graded (every path) |
| ``reval_verifier_fast_path_total`` | counter | answers decided without a worker |
| ``reval_verifier_errors_total{reason}`` | counter | ``timeout`` (math-verify's alarm or the
  pool's deadline), ``crash`` (a worker died), ``error`` (an exception while grading),
  ``too_long`` (boxed answer over ``max_answer_chars``), ``startup`` (a worker failed to start),
  ``not_a_number`` (a reward that is no number, or a dict without a numeric ``score``),
  ``not_finite`` (a NaN or infinite reward) |
| ``reval_reward_component{name}`` | summary | a custom reward's named components, per answer |
| ``reval_verifier_latency_seconds`` | histogram | one answer in a worker, dispatch to result |
| ``reval_verifier_workers`` | gauge | workers started and ready |
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import itertools
import logging
import os
import re
import signal
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing import get_context
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Summary

from reval.procs import follow_parent

if TYPE_CHECKING:
    from rollout.task_types import Prompt

log = logging.getLogger("reval.verify")

REWARD_REASONS = ("not_a_number", "not_finite")
"""What a custom reward function returned that is not a reward (``rollout/rewards.py``)."""
ERROR_REASONS = ("timeout", "crash", "error", "too_long", "startup", *REWARD_REASONS)

# -- extraction (pure string work, no sympy) -------------------------------------------------------

_BOX_RE = re.compile(r"\\(?:boxed|fbox)")


def last_boxed_answer(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` / ``\\fbox{...}`` (brace-matched), ``\\boxed 5`` (up to
    the next ``$`` or white space) too; None when there is none or the last one is not closed."""
    matches = list(_BOX_RE.finditer(text))
    if not matches:
        return None
    i = matches[-1].end()
    j = i
    while j < len(text) and text[j] in " \t":
        j += 1
    if j < len(text) and text[j] == "{":
        depth = 0
        for k in range(j, len(text)):
            c = text[k]
            if c == "{":
                depth += 1
            elif c == "}":
                depth -= 1
                if depth == 0:
                    return text[j + 1 : k]
        return None
    if j > i and j < len(text):  # "\boxed 5$": a single token
        m = re.match(r"[^\s$]+", text[j:])
        return m.group(0) if m else None
    return None


def clean_gold(gold: str) -> str:
    """The gold answer as LaTeX: inside its last ``\\boxed{}`` when it has one, ``$`` stripped."""
    g = str(gold).strip()
    if _BOX_RE.search(g):
        g = last_boxed_answer(g) or g
    g = g.strip()
    while len(g) >= 2 and g[0] == "$" and g[-1] == "$":
        g = g[1:-1].strip()
    return g


_TEXT_WRAP = re.compile(r"\\(?:text|textbf|mathrm|mathbf|textrm|mbox)\s*\{([^{}]*)\}")
_CHOICE_RE = re.compile(r"\(([A-Za-z])\)(?:\s+.*)?|([A-Za-z])[).:](?:\s+.*)?|([A-Za-z])", re.S)


def choice_letter(answer: str, choices: str = "ABCD") -> str | None:
    """The option letter of a multiple-choice answer (``B``, ``(B)``, ``B)``, ``\\text{B}``,
    ``(B) 42``), upper case; None when the answer is not one of ``choices``."""
    s = answer.strip().replace("$", "")
    for _ in range(3):  # \textbf{\text{B}}
        s = _TEXT_WRAP.sub(r"\1", s)
    s = s.replace("\\left", "").replace("\\right", "").replace("\\,", " ").strip()
    m = _CHOICE_RE.fullmatch(s)
    if m is None:
        return None
    letter = next(g for g in m.groups() if g).upper()
    return letter if letter in choices.upper() else None


_SPACES = re.compile(r"\s+")


def normalize_answer(ans: str) -> str:
    """A boxed answer as a plain string for the fast path: spaces, ``\\left``/``\\right``,
    degree signs, dollars and a final dot dropped, ``\\dfrac``/``\\tfrac`` read as ``\\frac``,
    ``10.0`` read as ``10``."""
    s = _SPACES.sub("", ans)
    for a, b in (
        ("\\dfrac", "\\frac"),
        ("\\tfrac", "\\frac"),
        ("\\left", ""),
        ("\\right", ""),
        ("^{\\circ}", ""),
        ("^\\circ", ""),
        ("\\$", ""),
        ("$", ""),
        ("\\!", ""),
    ):
        s = s.replace(a, b)
    s = s.rstrip(".")
    if re.fullmatch(r"-?\d+\.0+", s):
        s = s.split(".")[0]
    return s


class Precheck(NamedTuple):
    """What a grader's ``precheck`` decided in the caller's process: a ``score``, or (``score``
    None) the answer goes to a worker with ``pred`` (math: the extracted boxed answer)."""

    score: float | None
    pred: str | None = None
    reason: str | None = None
    """An error reason (``ERROR_REASONS``) when the answer was refused."""


class Graded(NamedTuple):
    """One answer graded in a worker: its score, the error reason that made it 0 (None when it
    was graded), a detail for the log, and the named components of a custom reward."""

    score: float
    reason: str | None = None
    detail: str = ""
    components: dict[str, float] | None = None


class PoolGrader(Protocol):
    """What ``VerifierPool`` runs (``MathVerify``, ``rewards.RewardFunction``); picklable, sent
    to each worker process once. An item is the tuple a caller hands ``score_many``."""

    batched: bool
    """True: the answers of one ``score_many`` call go to the workers in chunks (one chunk per
    worker, deadline ``timeout`` times its size); False: one answer per task."""

    def item(self, prompt: Prompt, response: str, finish_reason: str = "stop") -> tuple[Any, ...]:
        """The item grading ``response`` to ``prompt`` needs (``finish_reason``: ``stop`` or
        ``length``, the answer cut at the token limit)."""
        ...

    def precheck(self, *item: Any) -> Precheck:
        """The caller's side: a decision without a worker, or what goes to one."""
        ...

    def grade_many(self, work: Sequence[tuple[tuple[Any, ...], str | None]]) -> list[Graded]:
        """The worker's side: ``(item, pred)`` pairs graded, in order (main thread)."""
        ...

    def warm_up(self) -> None:
        """Load what the first answer would (a worker's start)."""
        ...


# -- math-verify, in the main thread of a process ------------------------------------------------


def _is_timeout(err: BaseException) -> bool:
    return type(err).__name__ == "TimeoutException"


@functools.lru_cache(maxsize=1)
def _configs() -> tuple[Any, Any, Any]:
    from math_verify import ExprExtractionConfig, LatexExtractionConfig  # type: ignore[import-untyped]

    latex = LatexExtractionConfig(boxed_match_priority=0)
    return latex, ExprExtractionConfig(), [latex]


@functools.lru_cache(maxsize=4096)
def _parse_gold(gold: str, parsing_timeout: int) -> tuple[Any, ...]:
    """Gold answers repeat (n samples per prompt): parsed once per worker. Timeouts and errors
    raise, so they are not cached."""
    from math_verify import parse  # type: ignore[import-untyped]

    latex, expr, _ = _configs()
    return tuple(
        parse(
            f"\\boxed{{{gold}}}",
            extraction_config=[latex, expr],
            parsing_timeout=parsing_timeout,
            raise_on_error=True,
        )
    )


@dataclass(frozen=True)
class MathVerify:
    """Grades the last boxed answer of a response against a gold answer (1.0 or 0.0).

    ``require_think``: DeepScaleR's rule for thinking models (``deepscaler/rewards/
    math_reward.py``, ``RewardMathFn.__call__``): the decoded prompt + response must hold
    ``<think>`` and ``</think>`` (else 0), and only ``text.split("</think>")[1]`` is graded, the
    text between the first ``</think>`` and the next one, if any. The ``r1_distill`` template
    ends the prompt with ``<think>`` (``math_task.format_prompt``), so the response needs
    ``</think>``. ``multiple_choice``: the
    boxed answer is an option letter of ``choices`` (``B``, ``(B)``, ``B)``, ``\\text{B}``),
    compared with the gold letter case-insensitively; sympy is not used. ``parsing_timeout`` and
    ``verify_timeout`` are math-verify's own alarms (whole seconds; per parse, per comparison).

    ``grade``/``score`` run math-verify in this process: main thread only (math-verify's alarm);
    from other threads use ``VerifierPool``.
    """

    require_think: bool = False
    multiple_choice: bool = False
    batched = False  # (a class attribute: one answer per task)
    choices: str = "ABCD"
    parsing_timeout: int = 1
    verify_timeout: int = 2
    float_rounding: int = 6
    max_answer_chars: int = 2000

    def extract(self, response: str) -> str | None:
        """The answer to grade: the last boxed content (with require_think, of the text between
        the first ``</think>`` and the next one, as DeepScaleR grades)."""
        if self.require_think:
            parts = response.split("</think>")
            if len(parts) < 2:
                return None
            response = parts[1]
        return last_boxed_answer(response)

    def precheck(self, gold: str, response: str) -> Precheck:
        """Everything that needs no sympy. Raises ValueError for a multiple-choice gold answer
        that is not a letter of ``choices`` (a data error, not a wrong answer)."""
        pred = self.extract(response)
        if self.multiple_choice:
            g = choice_letter(clean_gold(gold), self.choices)
            if g is None:
                raise ValueError(
                    f"multiple-choice gold answer {gold!r} is not one of {self.choices}"
                )
            if pred is None:
                return Precheck(0.0)
            return Precheck(1.0 if choice_letter(pred, self.choices) == g else 0.0)
        if pred is None or not pred.strip():
            return Precheck(0.0)
        if normalize_answer(pred) == normalize_answer(clean_gold(gold)):
            return Precheck(1.0)
        if len(pred) > self.max_answer_chars:
            return Precheck(0.0, reason="too_long")
        return Precheck(None, pred=pred)

    def equivalent(self, gold: str, pred: str) -> bool:
        """math-verify's equivalence of a boxed answer and the gold answer.

        Raises math-verify's ``TimeoutException`` (a ``BaseException``) when one of its alarms
        fires, and whatever else parsing or comparing raised when no comparison succeeded.
        """
        self._check_thread()
        from math_verify import parse, verify  # type: ignore[import-untyped]

        _, _, pred_config = _configs()
        golds = _parse_gold(clean_gold(gold), self.parsing_timeout)
        if not golds:
            return False
        preds = parse(
            f"\\boxed{{{pred}}}",
            extraction_config=pred_config,
            parsing_timeout=self.parsing_timeout,
            raise_on_error=True,
        )
        failure: BaseException | None = None
        for g, p in itertools.product(golds, preds):
            try:
                if verify(
                    g,
                    p,
                    float_rounding=self.float_rounding,
                    timeout_seconds=self.verify_timeout,
                    raise_on_error=True,
                ):
                    return True
            except Exception as err:
                failure = failure or err
            except BaseException as err:
                if not _is_timeout(err):
                    raise
                failure = failure or err
        if failure is not None:
            raise failure
        return False

    def _check_thread(self) -> None:
        # Raised, never caught into a 0 score: that would silently fail every answer.
        if (self.parsing_timeout or self.verify_timeout) and (
            threading.current_thread() is not threading.main_thread()
        ):
            raise RuntimeError(
                "math-verify's timeouts use signal.alarm and only work on the main thread; "
                "grade through VerifierPool"
            )

    def grade_extracted(self, gold: str, pred: str) -> tuple[float, str | None, str]:
        """(score, error reason or None, detail) of an extracted answer, grading exceptions
        caught: what a worker runs. Raises RuntimeError off the main thread."""
        self._check_thread()
        try:
            return (1.0 if self.equivalent(gold, pred) else 0.0), None, ""
        except Exception as err:
            return 0.0, "error", f"{type(err).__name__}: {err}"[:500]
        except BaseException as err:
            if _is_timeout(err):
                return 0.0, "timeout", "math-verify timeout"
            raise

    def item(self, prompt: Prompt, response: str, finish_reason: str = "stop") -> tuple[str, str]:
        return (prompt.answer, response)

    def grade_many(self, work: Sequence[tuple[tuple[Any, ...], str | None]]) -> list[Graded]:
        """``((gold, response), pred)`` pairs: each extracted answer against its gold."""
        return [Graded(*self.grade_extracted(item[0], str(pred))) for item, pred in work]

    def grade(self, gold: str, response: str) -> float:
        """Reward of ``response`` against ``gold``, graded in this process (main thread)."""
        pre = self.precheck(gold, response)
        if pre.score is not None:
            return pre.score
        assert pre.pred is not None
        return self.grade_extracted(gold, pre.pred)[0]

    def score(self, prompt: Prompt, response: str) -> float:
        return self.grade(prompt.answer, response)

    def warm_up(self) -> None:
        """Loads math-verify's parser (the first parse costs ~0.1 s)."""
        with contextlib.suppress(Exception):
            self.equivalent("\\frac{1}{2}", "0.5")


# -- worker process -------------------------------------------------------------------------------


def _worker_main(conn: Connection, grader: PoolGrader) -> None:
    """A worker's main thread: ``(task_id, [(item, pred), ...])`` in, ``(task_id, [Graded,
    ...])`` out; ``None`` or EOF ends it."""
    # Ends with the pool's process (or, under forkserver, the server that forked it), even by
    # SIGKILL and while sympy is busy; an idle worker also ends on its pipe's EOF.
    follow_parent(os.getppid(), signal.SIGKILL, what="grading worker")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's business
    for name in ("math_verify", "latex2sympy2_extended"):
        logging.getLogger(name).setLevel(logging.ERROR)
    grader.warm_up()
    conn.send(("ready", os.getpid()))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        task_id, work = msg
        conn.send((task_id, grader.grade_many(work)))


# -- the pool ------------------------------------------------------------------------------------


class VerifierMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry if registry is not None else CollectorRegistry()
        self.answers = Counter("reval_verifier_answers", "Answers graded", registry=r)
        self.fast_path = Counter(
            "reval_verifier_fast_path", "Answers decided without a worker", registry=r
        )
        self.errors = Counter(
            "reval_verifier_errors", "Answers scored 0 by failure", ["reason"], registry=r
        )
        for reason in ERROR_REASONS:
            self.errors.labels(reason)
        self.latency = Histogram(
            "reval_verifier_latency_seconds",
            "One answer in a worker, dispatch to result",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=r,
        )
        self.workers = Gauge("reval_verifier_workers", "Workers started and ready", registry=r)
        self.components = Summary(
            "reval_reward_component",
            "A custom reward's named components, per answer (rate of _sum over _count: the mean)",
            ["name"],
            registry=r,
        )

    def error_count(self, reason: str) -> float:
        value = self.registry.get_sample_value("reval_verifier_errors_total", {"reason": reason})
        return value or 0.0


class _Batch:
    """Results of one ``grade_many`` call; the dispatcher fills them."""

    def __init__(self, n: int) -> None:
        self.results = [Graded(0.0)] * n
        self.remaining = n
        self.error: BaseException | None = None
        self.done = threading.Event()
        if n == 0:
            self.done.set()

    def resolve(self, index: int, value: Graded) -> None:
        self.results[index] = value
        self.remaining -= 1
        if self.remaining <= 0:
            self.done.set()

    def fail(self, err: BaseException) -> None:
        self.error = err
        self.done.set()


@dataclass
class _Task:
    """Answers sent to one worker together: ``work[j]`` is answer ``indices[j]`` of ``batch``."""

    batch: _Batch
    indices: list[int]
    work: list[tuple[tuple[Any, ...], str | None]]
    timeout: float
    id: int = 0


@dataclass
class _Worker:
    proc: BaseProcess
    conn: Connection
    started: float
    ready: bool = False
    pid: int = 0
    task: _Task | None = None
    sent: float = 0.0
    dead: bool = False


class VerifierPool:
    """A ``PoolGrader`` (default ``MathVerify``) in ``workers`` processes, with a deadline of
    ``timeout`` seconds per answer.

    Implements ``Verifier`` (``score``), ``score_many([item, ...])`` (math: ``(gold, response)``)
    and ``grade_many`` (the same with each answer's ``Graded``); all may be called from any
    number of threads. An answer that passes its deadline scores 0, its worker is SIGKILLed and
    replaced; an answer whose worker dies scores 0. Raises RuntimeError when the pool is closed,
    or when workers repeatedly fail to start (``max_start_failures`` in a row).
    """

    def __init__(
        self,
        grader: PoolGrader | None = None,
        workers: int = 2,
        timeout: float = 5.0,
        registry: CollectorRegistry | None = None,
        mp_context: str = "spawn",
        start_timeout: float = 60.0,
        max_start_failures: int = 3,
    ) -> None:
        import importlib.util

        if importlib.util.find_spec("math_verify") is None:
            raise ImportError(
                "VerifierPool needs math-verify: pip install 'math-verify[antlr4-13-2]'"
            )
        if workers < 1 or timeout <= 0:
            raise ValueError("workers >= 1 and timeout > 0")
        if mp_context not in ("spawn", "forkserver"):
            raise ValueError(
                "mp_context: 'spawn' or 'forkserver' (fork from a threaded parent is unsafe)"
            )
        self.grader: PoolGrader = grader if grader is not None else MathVerify()
        self.size = workers
        self.timeout = timeout
        self.start_timeout = start_timeout
        self.max_start_failures = max_start_failures
        self.metrics = VerifierMetrics(registry)
        self._ctx: Any = get_context(mp_context)
        self._lock = threading.Lock()
        self._ready_cond = threading.Condition(self._lock)
        self._pending: deque[_Task] = deque()
        self._closing = False
        self._broken: BaseException | None = None
        self._pids: list[int] = []
        self._ids = itertools.count(1)
        self._start_failures = 0
        self._warned: set[str] = set()  # error reasons logged once as a warning
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._workers: list[_Worker] = []  # the dispatcher's own
        self._thread = threading.Thread(target=self._run, name="verifier-pool", daemon=True)
        self._thread.start()
        atexit.register(self.close)  # before multiprocessing's exit handler kills the workers

    # -- callers' side

    def score(self, prompt: Prompt, response: str) -> float:
        return self.score_many([self.grader.item(prompt, response)])[0]

    def score_many(
        self, items: Sequence[tuple[Any, ...]], timeout: float | None = None
    ) -> list[float]:
        """Rewards of the grader's items (math: ``(gold answer, response)`` pairs), in order.
        ``timeout`` overrides the pool's deadline per answer (seconds, from dispatch)."""
        return [g.score for g in self.grade_many(items, timeout)]

    def grade_many(
        self, items: Sequence[tuple[Any, ...]], timeout: float | None = None
    ) -> list[Graded]:
        """Each item's ``Graded``, in order (see ``score_many``)."""
        deadline = self.timeout if timeout is None else timeout
        if deadline <= 0:
            raise ValueError("timeout must be > 0")
        t0 = time.perf_counter()
        prechecks = [self.grader.precheck(*item) for item in items]
        batch = _Batch(len(items))
        slow: list[int] = []
        fast = 0
        for i, pre in enumerate(prechecks):
            if pre.score is not None:
                batch.resolve(i, Graded(pre.score, pre.reason))
                fast += 1
                if pre.reason is not None:
                    self.metrics.errors.labels(pre.reason).inc()
            else:
                slow.append(i)
        # A batched grader gets one chunk per worker; any other one answer per task.
        per = -(-len(slow) // self.size) if self.grader.batched else 1
        tasks = [
            _Task(batch, part, [(tuple(items[i]), prechecks[i].pred) for i in part],
                  deadline * len(part))
            for part in (slow[k : k + per] for k in range(0, len(slow), max(per, 1)))
        ]  # fmt: skip
        self.metrics.answers.inc(len(items))
        if fast:
            self.metrics.fast_path.inc(fast)
        if tasks:
            with self._lock:
                self._check_open()
                self._pending.extend(tasks)
            self._wake()
            while not batch.done.wait(1.0):
                if not self._thread.is_alive():
                    raise RuntimeError("verifier pool dispatcher died") from self._broken
        if batch.error is not None:
            raise RuntimeError(f"verifier pool failed: {batch.error}") from batch.error
        log.debug("graded %d answers in %.3f s", len(items), time.perf_counter() - t0)
        return batch.results

    def wait_ready(self, timeout: float = 60.0) -> bool:
        """Wait until every worker has started; False on timeout."""
        end = time.monotonic() + timeout
        with self._ready_cond:
            while len(self._pids) < self.size:
                self._check_open()
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self._ready_cond.wait(min(left, 0.5))
        return True

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of the ready workers."""
        with self._lock:
            return list(self._pids)

    def close(self) -> None:
        """Stop the workers (idempotent); pending answers raise RuntimeError in their callers."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
        atexit.unregister(self.close)
        self._wake()
        self._thread.join(timeout=10)
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)

    def __enter__(self) -> VerifierPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closing:
            raise RuntimeError("verifier pool is closed")
        if self._broken is not None:
            raise RuntimeError(f"verifier pool is broken: {self._broken}") from self._broken

    def _wake(self) -> None:
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")

    # -- the dispatcher thread

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as err:
            log.exception("verifier pool dispatcher failed")
            with self._lock:
                self._broken = err
            self._fail_all(err)
        finally:
            for w in list(self._workers):
                self._stop(w, graceful=not self._broken)
            self._workers.clear()
            with self._lock:
                self._pids.clear()
                self.metrics.workers.set(0)
            self._fail_all(RuntimeError("verifier pool closed"))

    def _fail_all(self, err: BaseException) -> None:
        with self._lock:
            pending, self._pending = list(self._pending), deque()
        for task in pending:
            task.batch.fail(err)
        for w in self._workers:
            if w.task is not None:
                w.task.batch.fail(err)
                w.task = None

    def _loop(self) -> None:
        for _ in range(self.size):
            self._spawn()
        while True:
            for w in [w for w in self._workers if w.dead]:
                self._replace(w)
            assigned: list[tuple[_Worker, _Task]] = []
            with self._lock:
                if self._closing:
                    return
                for w in self._workers:
                    if not self._pending:
                        break
                    if w.ready and w.task is None and not w.dead:
                        assigned.append((w, self._pending.popleft()))
            for w, task in assigned:
                self._send(w, task)
            now = time.monotonic()
            deadlines = [w.sent + w.task.timeout for w in self._workers if w.task is not None]
            deadlines += [w.started + self.start_timeout for w in self._workers if not w.ready]
            wait_s = min([1.0, *(d - now for d in deadlines)])
            objects: list[Any] = [self._wake_r]
            for w in self._workers:
                objects += [w.conn, w.proc.sentinel]
            ready = set(wait(objects, timeout=max(0.0, wait_s)))
            if self._wake_r in ready:
                with contextlib.suppress(OSError):
                    while os.read(self._wake_r, 4096):
                        pass
            for w in self._workers:
                if w.conn in ready or w.proc.sentinel in ready:
                    self._receive(w)
                if w.proc.sentinel in ready and not w.dead:
                    self._receive(w)  # a result sent just before exiting
                    self._died(w, "crash")
            now = time.monotonic()
            for w in self._workers:
                if w.dead:
                    continue
                if w.task is not None and now > w.sent + w.task.timeout:
                    self._kill(w)
                    self._fail_task(w, "timeout", "deadline passed: worker killed")
                elif not w.ready and now > w.started + self.start_timeout:
                    self._died(w, "startup")

    def _spawn(self) -> None:
        parent_conn, child_conn = self._ctx.Pipe(duplex=True)
        proc = self._ctx.Process(
            target=_worker_main,
            args=(child_conn, self.grader),
            name="verifier-worker",
            daemon=True,
        )
        proc.start()
        child_conn.close()
        self._workers.append(_Worker(proc=proc, conn=parent_conn, started=time.monotonic()))

    def _send(self, w: _Worker, task: _Task) -> None:
        task.id = next(self._ids)
        w.task, w.sent = task, time.monotonic()
        try:
            w.conn.send((task.id, task.work))
        except (OSError, ValueError):  # died before it could read: the answer is not lost
            w.task = None
            with self._lock:
                self._pending.appendleft(task)
            self._died(w, "crash")

    def _receive(self, w: _Worker) -> None:
        try:
            while not w.dead and w.conn.poll(0):
                msg = w.conn.recv()
                if msg[0] == "ready":
                    w.ready, w.pid = True, int(msg[1])
                    self._start_failures = 0
                    with self._ready_cond:
                        self._pids.append(w.pid)
                        self.metrics.workers.set(len(self._pids))
                        self._ready_cond.notify_all()
                    continue
                task_id, graded = msg
                if w.task is not None and w.task.id == task_id:
                    self._finish(w, [Graded(*g) for g in graded])
        except (EOFError, OSError, ValueError, TypeError):
            self._died(w, "crash")

    def _finish(self, w: _Worker, graded: list[Graded]) -> None:
        task, w.task = w.task, None
        assert task is not None
        if len(graded) != len(task.indices):  # (a grader's bug: every answer of the task fails)
            graded = [Graded(0.0, "error", f"{len(graded)} results for {len(task.indices)}")] * len(
                task.indices
            )
        self.metrics.latency.observe(time.monotonic() - w.sent)
        for index, (item, _), g in zip(task.indices, task.work, graded, strict=True):
            if g.reason is not None:
                self.metrics.errors.labels(g.reason).inc()
                first = g.reason not in self._warned and g.reason in ("error", *REWARD_REASONS)
                self._warned.add(g.reason)
                log.log(logging.WARNING if first else logging.DEBUG,
                        "answer %r scored 0 (%s): %s%s", str(item[1])[:200], g.reason, g.detail,
                        " (the next ones are counted in reval_verifier_errors_total)"
                        if first else "")  # fmt: skip
            for name, value in (g.components or {}).items():
                self.metrics.components.labels(name).observe(value)
            task.batch.resolve(index, g)

    def _fail_task(self, w: _Worker, reason: str, detail: str) -> None:
        """Every answer of the worker's task scores 0 for ``reason``."""
        assert w.task is not None
        self._finish(w, [Graded(0.0, reason, detail)] * len(w.task.indices))

    def _died(self, w: _Worker, reason: str) -> None:
        """A worker is gone (crash or failed start): its answer scores 0."""
        if w.dead:
            return
        self._kill(w)
        if w.task is not None:
            self._fail_task(w, "crash", f"worker {w.pid} died")
        elif reason == "crash" and w.ready:
            self.metrics.errors.labels("crash").inc()
        if not w.ready:
            w.proc.join(timeout=0.5)
            self.metrics.errors.labels("startup").inc()
            self._start_failures += 1
            log.warning("verifier worker failed to start (exit code %s)", w.proc.exitcode)
            if self._start_failures >= self.max_start_failures:
                err = RuntimeError(
                    f"{self._start_failures} verifier workers in a row failed to start "
                    f"(last exit code {w.proc.exitcode})"
                )
                with self._lock:
                    self._broken = err
                self._fail_all(err)

    def _kill(self, w: _Worker) -> None:
        w.dead = True
        if w.proc.is_alive():
            with contextlib.suppress(OSError):
                w.proc.kill()
        with self._lock:
            if w.pid in self._pids:
                self._pids.remove(w.pid)
                self.metrics.workers.set(len(self._pids))

    def _replace(self, w: _Worker) -> None:
        w.proc.join(timeout=1.0)
        w.conn.close()
        with contextlib.suppress(ValueError):
            w.proc.close()
        self._workers.remove(w)
        if self._broken is None and not self._closing:
            self._spawn()

    def _stop(self, w: _Worker, graceful: bool) -> None:
        if graceful and not w.dead and w.task is None:
            with contextlib.suppress(OSError, ValueError):
                w.conn.send(None)
            w.proc.join(timeout=1.0)
        if w.proc.is_alive():
            w.proc.kill()
            w.proc.join(timeout=1.0)
        w.conn.close()


class PooledVerifier:
    """The ``Verifier`` of math and custom tasks: ``grader`` (``MathVerify``, a custom task's
    ``RewardFunction``) in a ``VerifierPool`` of ``workers`` processes, started on the first
    answer graded (a task that is built and never graded starts none), a batch of (prompt,
    response) pairs per ``score_many``. ``reval train``, the rollout workers and ``reval eval``
    grade through it, so an answer earns the same reward in every loop. A custom reward's
    components are kept for ``drain_components`` (and observed on the pool's metrics)."""

    def __init__(
        self,
        grader: PoolGrader,
        workers: int = 2,
        timeout: float = 5.0,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.grader = grader
        self.workers = workers
        self.timeout = timeout
        self.registry = registry
        self._pool: VerifierPool | None = None
        self._closed = False
        self._lock = threading.Lock()
        self._components: dict[str, tuple[float, int]] = {}

    @property
    def require_think(self) -> bool:
        return bool(getattr(self.grader, "require_think", False))

    @property
    def pool(self) -> VerifierPool:
        with self._lock:
            if self._closed:
                raise RuntimeError("verifier pool is closed")
            if self._pool is None:
                self._pool = VerifierPool(
                    self.grader, workers=self.workers, timeout=self.timeout, registry=self.registry
                )
            return self._pool

    def score(self, prompt: Prompt, response: str) -> float:
        return self.score_many([(prompt, response)])[0]

    def score_many(
        self, pairs: Sequence[tuple[Prompt, str]], finish_reasons: Sequence[str] | None = None
    ) -> list[float]:
        """Scores of (prompt, response) pairs; ``finish_reasons`` (one per pair, default
        ``stop``) go to the grader with each answer."""
        reasons = ["stop"] * len(pairs) if finish_reasons is None else list(finish_reasons)
        if len(reasons) != len(pairs):
            raise ValueError(f"{len(reasons)} finish reasons for {len(pairs)} answers")
        items = [self.grader.item(p, r, f) for (p, r), f in zip(pairs, reasons, strict=True)]
        graded = self.pool.grade_many(items)
        with self._lock:
            for g in graded:
                for name, value in (g.components or {}).items():
                    total, n = self._components.get(name, (0.0, 0))
                    self._components[name] = (total + value, n + 1)
        return [float(g.score) for g in graded]

    def drain_components(self) -> dict[str, float]:
        """The mean of each named reward component over the answers graded since the last
        call (``reval train``'s rows); empty for graders without components."""
        with self._lock:
            got, self._components = self._components, {}
        return {name: total / n for name, (total, n) in got.items()}

    def close(self) -> None:
        """Stop the pool's processes (idempotent); a later answer raises RuntimeError."""
        with self._lock:
            pool, self._pool, self._closed = self._pool, None, True
        if pool is not None:
            pool.close()
