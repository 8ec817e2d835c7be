"""The grading pool: a ``PoolGrader`` (``rollout/grading/process.py``; ``MathVerify`` by default,
``rollout/grading/math_grading.py``) in a pool of worker processes. ``reval train``, the rollout
workers and ``reval eval`` all grade through ``PooledVerifier``/``VerifierPool``; a custom task's
reward function (``rollout/grading/custom.py``: ``RewardFunction``) grades in the same processes,
under the same deadline, with the same accounting.

math-verify's timeouts (``signal.alarm``) work only on a process's main thread, so
``VerifierPool`` grades in the main thread of worker processes (``spawn`` context), each looping
over tasks read from its pipe (``process.worker_main``); the pool's dispatcher thread
keeps a deadline per answer and SIGKILLs and replaces a worker that passes it (math-verify's
alarms are per call and in whole seconds, and cannot stop C code that does not return to the
interpreter). Such an answer scores 0 and counts as an error; a caller never waits on a stuck
worker. Any thread may call ``score``/``score_many``; answers are graded in arrival order.

Metrics (``prometheus_client``, on the registry given to the pool or one of its own):

| name | type | meaning |
|---|---|---|
| ``reval_verifier_answers_total`` | counter | answers graded (every path) |
| ``reval_verifier_fast_path_total`` | counter | answers decided without a worker |
| ``reval_verifier_errors_total{reason}`` | counter | ``timeout`` (math-verify's alarm or the
  pool's deadline), ``memory`` (over ``rollout.grading_memory_mb``: a MemoryError, or the
  worker killed by the kernel's OOM killer, ``oom_kills``), ``crash`` (a
  worker died), ``error`` (an exception while grading),
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
import itertools
import logging
import os
import signal
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing import get_context
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Summary

from reval.procs import kill_group
from rollout.grading.math_grading import MathVerify
from rollout.grading.process import (
    ERROR_REASONS,
    REWARD_REASONS,
    Graded,
    PoolGrader,
    oom_kills,
    worker_main,
)

if TYPE_CHECKING:
    from rollout.task_types import Prompt

log = logging.getLogger("reval.verify")

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
    number of threads. An answer that passes its deadline scores 0, its worker is SIGKILLed (with
    its process group: what it started) and replaced; an answer whose worker dies scores 0.
    ``memory_mb``: each worker's data memory cap (``cap_memory``; None: none). Raises
    RuntimeError when the pool is closed, or when workers repeatedly fail to start
    (``max_start_failures`` in a row).
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
        memory_mb: int | None = None,
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
        self.memory_mb = memory_mb
        """Each grading process's memory cap in MiB (``rollout.grading_memory_mb``; None: none)."""
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
        self._oom_kills = oom_kills()
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
            target=worker_main,
            args=(child_conn, self.grader, self.memory_mb),
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
        """A worker is gone (crash or failed start): its answer scores 0. One SIGKILLed by the
        kernel's OOM killer (``oom_kills`` went up) counts as ``memory``."""
        if w.dead:
            return
        if reason == "crash":
            w.proc.join(timeout=0.5)  # (its pipe closes a moment before it can be reaped)
            kills, self._oom_kills = self._oom_kills, oom_kills()
            if w.proc.exitcode == -signal.SIGKILL and (kills or 0) < (self._oom_kills or 0):
                reason = "memory"
        self._kill(w)
        if w.task is not None:
            detail = "killed (out of memory?)" if reason == "memory" else "died"
            self._fail_task(w, reason, f"worker {w.pid} {detail}")
        elif reason in ("crash", "memory") and w.ready:
            self.metrics.errors.labels(reason).inc()
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
        """SIGKILL the worker and everything it started (its process group: ``own_group``)."""
        w.dead = True
        if w.proc.is_alive():
            with contextlib.suppress(OSError):
                w.proc.kill()
        if w.proc.pid is not None:
            kill_group(w.proc.pid)
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
        if w.proc.pid is not None:
            kill_group(w.proc.pid)  # (what it started; its guard does the same)
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
        memory_mb: int | None = None,
    ) -> None:
        self.grader = grader
        self.workers = workers
        self.timeout = timeout
        self.registry = registry
        self.memory_mb = memory_mb
        """Each grading process's memory cap in MiB (``rollout.grading_memory_mb``; None: none)."""
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
                    self.grader, workers=self.workers, timeout=self.timeout,
                    registry=self.registry, memory_mb=self.memory_mb,
                )  # fmt: skip
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
