"""The grading processes' side of the pool (``rollout/grading/pool.py``): what a grader is
(``PoolGrader``: ``MathVerify``, ``rollout/grading/math_grading.py``; a custom task's
``RewardFunction``, ``rollout/grading/custom.py``), what it returns (``Precheck`` in the caller,
``Graded`` in a worker), the reasons an answer scores 0 by failure, and a worker's main loop.

Each worker leads a process group of its own (``reval.procs.own_group``): whatever it starts (a
custom reward function that forks or runs subprocesses) is SIGKILLed with it, when the pool closes,
when the worker is replaced after a deadline, and when the pool's process dies, even by SIGKILL
(the group's guard sees the worker go). Its data memory is capped (``rollout.grading_memory_mb``,
``RLIMIT_DATA``; what it starts inherits the cap): an answer that needs more fails at once and
counts as ``memory``.

Workers import this module and their grader's (math-verify and sympy, about 0.5 s), not torch.
``spawn`` also imports the parent's ``__main__`` module in each worker (as multiprocessing always
does), so a script that builds a pool keeps its work under ``if __name__ == "__main__":``.
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from reval.procs import follow_parent, own_group

if TYPE_CHECKING:
    from rollout.task_types import Prompt

REWARD_REASONS = ("not_a_number", "not_finite")
"""What a custom reward function returned that is not a reward (``rollout/grading/custom.py``)."""
ERROR_REASONS = ("timeout", "memory", "crash", "error", "too_long", "startup", *REWARD_REASONS)


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


# -- worker process -------------------------------------------------------------------------------


def worker_main(conn: Connection, grader: PoolGrader, memory_mb: int | None = None) -> None:
    """A worker's main thread: ``(task_id, [(item, pred), ...])`` in, ``(task_id, [Graded,
    ...])`` out; ``None`` or EOF ends it. ``memory_mb``: its memory cap (``cap_memory``)."""
    # Its own process group, killed whole when it ends (what a reward function forks included),
    # before any thread starts (the group's guard is forked).
    own_group()
    # Ends with the pool's process (or, under forkserver, the server that forked it), even by
    # SIGKILL and while sympy is busy; an idle worker also ends on its pipe's EOF.
    follow_parent(os.getppid(), signal.SIGKILL, what="grading worker")
    cap_memory(memory_mb)
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
        try:
            graded = grader.grade_many(work)
        except MemoryError:  # (what the grader itself did not catch)
            graded = [Graded(0.0, "memory", "over the grading processes' memory cap")] * len(work)
        conn.send((task_id, graded))


def oom_kills() -> int | None:
    """How many processes the kernel's OOM killer has killed in this process's memory cgroup
    (v2 ``memory.events``, v1 ``memory.oom_control``: ``oom_kill``); None where not told."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = [line.rstrip("\n").split(":", 2) for line in f]
    except OSError:
        return None
    places = [
        ("/sys/fs/cgroup" + path.rstrip("/"), "memory.events")
        for _, ctrl, path in lines
        if ctrl == ""
    ]
    places += [("/sys/fs/cgroup/memory" + path.rstrip("/"), "memory.oom_control")
               for _, ctrl, path in lines if "memory" in ctrl.split(",")]  # fmt: skip
    places += [("/sys/fs/cgroup", "memory.events"), ("/sys/fs/cgroup/memory", "memory.oom_control")]
    for folder, name in places:
        try:
            with open(f"{folder}/{name}") as f:
                for line in f:
                    key, _, value = line.partition(" ")
                    if key == "oom_kill":
                        return int(value)
        except (OSError, ValueError):
            continue
    return None


def cap_memory(memory_mb: int | None) -> None:
    """Cap this process's data memory (``RLIMIT_DATA``: the heap and private mappings, not the
    shared libraries) at ``memory_mb`` MiB, soft and hard, for it and what it starts; None or 0:
    no cap. An allocation over it fails at once with MemoryError (counted as ``memory``)
    instead of drawing the machine's memory down."""
    if not memory_mb:
        return
    import resource

    limit = int(memory_mb) << 20
    _, hard = resource.getrlimit(resource.RLIMIT_DATA)
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
