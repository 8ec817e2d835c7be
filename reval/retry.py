"""The one retry policy for "Redis away or refusing writes", which every process rides out for
``redis.outage_s`` (the learner, the workers, the replay ring, the prompt deal, the weights
announcement, the registry).

A *wait fault* (``wait_fault``) is one that passes by itself: the connection dropped or timed
out, Redis is loading its data (LOADING) or running a long script (BUSY), or it refuses writes
for now: its disk is full (MISCONF), it is out of memory (OOM), it is a replica (READONLY,
MASTERDOWN) or lacks its replicas (NOREPLICAS). Any other error reply (a wrong type, a script's
own error) is not retried: waiting would not change it.

While a wait lasts the process logs ONE line when it starts (repeated at most once a minute,
with a count, through ``reval.ratelog.RateLog``) and ONE when Redis answers again.

A stop (SIGTERM, Ctrl-C: ``stop_waiting``, called by the learner's and the worker's handlers)
cuts every wait short at once: from then on a wait fault is raised at its first try, as when the
budget has run out, so the process checkpoints or spools what it holds and exits instead of
waiting up to ``redis.outage_s`` first (``docker stop`` SIGKILLs it after its grace period).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

import redis
from redis.exceptions import (
    AuthenticationError,
    AuthorizationError,
    BusyLoadingError,
    MasterDownError,
    OutOfMemoryError,
    ReadOnlyError,
    ResponseError,
    TryAgainError,
)

from reval.ratelog import RateLog

T = TypeVar("T")

WAIT_TYPES: tuple[type[BaseException], ...] = (
    redis.ConnectionError,  # (BusyLoadingError: LOADING is one)
    redis.TimeoutError,
    BusyLoadingError,
    ReadOnlyError,
    OutOfMemoryError,
    MasterDownError,
    TryAgainError,
    # A socket error the client did not wrap: only these, not any OSError (a full disk, a
    # missing file, a taken port or an exhausted wait of an inner caller are not Redis away).
    ConnectionResetError,
    ConnectionRefusedError,
    ConnectionAbortedError,
    BrokenPipeError,
    TimeoutError,  # (socket.timeout)
)
"""Exception types that are wait faults whatever their message."""

WAIT_REPLIES = ("MISCONF", "OOM", "READONLY", "LOADING", "BUSY ", "MASTERDOWN", "NOREPLICAS",
                "TRYAGAIN")  # fmt: skip
"""Error replies (their first word) that are wait faults: Redis refuses for now, not for good.
(``BUSY `` with its space: BUSYGROUP and BUSYKEY are answers, not waits.)"""

OUTAGE_KEY = "redis-outage"
"""The ``RateLog`` key of the outage lines (one wait per process at a time)."""

outage_log = RateLog(logging.getLogger("reval.redis"), every_s=60.0)
"""The process's outage lines: the first of a wait at once, then at most one a minute."""


NEVER_WAIT: tuple[type[BaseException], ...] = (AuthenticationError, AuthorizationError)
"""Connection errors that waiting does not change: a wrong password or user is said at once."""


def wait_fault(err: BaseException) -> bool:
    """Whether ``err`` is Redis away or refusing writes for now (retried for ``redis.outage_s``)
    rather than an answer that waiting would not change."""
    if isinstance(err, NEVER_WAIT):
        return False
    if isinstance(err, WAIT_TYPES):
        return True
    return isinstance(err, ResponseError) and str(err).startswith(WAIT_REPLIES)


_stopping = threading.Event()
"""Set by ``stop_waiting``: this process is stopping, no wait for Redis goes on."""


def stop_waiting() -> None:
    """This process is stopping (a signal handler calls it): every ``retry_redis`` wait, now
    and later, ends at once by raising its last fault."""
    _stopping.set()


def stopping() -> bool:
    """Whether ``stop_waiting`` was called: a wait fault raised now is the stop's, not an
    outage past ``redis.outage_s``."""
    return _stopping.is_set()


def cut_short(err: BaseException) -> bool:
    """Whether ``err`` is a wait cut short by the stop (``stop_waiting``): a wait fault, or an
    error raised from one (the replay ring's BufferUnavailable), while this process stops."""
    return _stopping.is_set() and (
        wait_fault(err) or (err.__cause__ is not None and wait_fault(err.__cause__))
    )


@contextlib.contextmanager
def skip_when_stopping() -> Iterator[None]:
    """Around a call a stopping process does without (a write-back, an announcement): a wait
    it had to cut short (``cut_short``) is swallowed, so that every rank goes on through the
    same collectives to the stop's checkpoint; any other error raises, as does an outage past
    ``redis.outage_s`` while not stopping."""
    try:
        yield
    except Exception as err:
        if not cut_short(err):
            raise


_waiting: dict[str, float] = {}
"""Call sites (``what``) that met a wait fault and have not got through since -> when."""
_waiting_lock = threading.Lock()


def note_wait(what: str, err: BaseException, budget_s: float | None = None) -> None:
    """``what`` met a wait fault: logged as the first line of an outage at once, then at most
    one line a minute (with a count of the calls that failed meanwhile). ``budget_s``: how long
    the caller waits (None: it carries on without Redis, e.g. the worker's spool)."""
    with _waiting_lock:
        _waiting.setdefault(what, time.monotonic())
    how = (
        f"waiting up to {budget_s:.0f} s for it (redis.outage_s)"
        if budget_s is not None
        else "carrying on without it"
    )
    outage_log.warning(
        OUTAGE_KEY,
        "Redis is away or refuses writes (%s: %s: %s); %s, nothing is dropped meanwhile",
        what, type(err).__name__, str(err).splitlines()[0][:200] if str(err) else "", how,
    )  # fmt: skip


def note_through(what: str) -> None:
    """``what`` got through: if it had met a wait fault, the outage is over (one line, once per
    outage: the first call site back says it). Other call sites that never failed say nothing
    (while Redis refuses writes, its reads get through)."""
    if not _waiting:  # (the usual case, without the lock)
        return
    with _waiting_lock:
        since = _waiting.pop(what, None)
    if since is not None:
        outage_log.recovered(
            OUTAGE_KEY, "Redis answers again (%s, after %.1f s)", what, time.monotonic() - since
        )


def retry_redis(
    fn: Callable[[], T],
    budget_s: float,
    what: str,
    on_fault: Callable[[BaseException], None] | None = None,
) -> T:
    """``fn()``, retried on a wait fault (``wait_fault``) with exponential backoff from 50 ms up
    to 2 s, for ``budget_s`` seconds (the run's ``redis.outage_s``; 0: one try); then the last
    fault is raised. Any other error is raised at once. ``what`` names the call site in the
    outage lines (``note_wait``, ``note_through``); ``on_fault`` sees each fault (a metric).
    Once the process is stopping (``stop_waiting``, also during a wait) the fault is raised
    at once."""
    deadline = time.monotonic() + budget_s
    delay = 0.05
    while True:
        try:
            out = fn()
        except Exception as err:
            if not wait_fault(err):
                raise
            if on_fault is not None:
                on_fault(err)
            note_wait(what, err, budget_s if budget_s > 0 else None)
            left = deadline - time.monotonic()
            if left <= 0 or _stopping.is_set():
                raise
            if _stopping.wait(min(delay, left)):  # (a stop wakes it at once)
                raise
            delay = min(2 * delay, 2.0)
            continue
        note_through(what)
        return out


@contextlib.contextmanager
def skip_on_outage(what: str) -> Iterator[None]:
    """Around a call the process does without while Redis is away or refuses writes (a
    heartbeat, a status line): a wait fault is noted (``note_wait``: the outage lines) and
    swallowed; any other error raises; a call that goes through ends the outage it met."""
    try:
        yield
    except Exception as err:
        if not wait_fault(err):
            raise
        note_wait(what, err)
    else:
        note_through(what)
