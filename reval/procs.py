"""Child processes that end with the process that started them.

A SIGKILL of a parent runs none of its exit handlers, so the children it spawned (learner ranks,
grading workers, experiment workers) went on running as orphans: a second learner beside the
next one of the run, graders holding cores, a killed ``reval experiment``'s pool finishing its
whole queue. ``follow_parent`` is the one guard every spawned child takes.

A child of such a child (a reward function that forks, in a grading process) is not covered by
it: ``own_group`` puts a process and everything it starts in a process group that a guard
SIGKILLs when the process ends, and ``kill_group`` is how its owner ends the group."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import sys
import threading
import time

log = logging.getLogger("reval.procs")

PR_SET_PDEATHSIG = 1
"""``<linux/prctl.h>``: the signal the kernel sends this process when its parent thread dies."""

PR_SET_NAME = 15
"""``<linux/prctl.h>``: this thread's name (``comm``, 15 bytes)."""


def follow_parent(parent: int, sig: int = signal.SIGTERM, grace_s: float = 0.0,
                  what: str = "process") -> None:  # fmt: skip
    """End this process when ``parent`` (the pid that started it) is gone, even by SIGKILL.

    On Linux the kernel sends ``sig`` (``prctl(PR_SET_PDEATHSIG)``); everywhere a watchdog
    thread sees the re-parenting within half a second and sends ``sig`` itself, then exits
    hard if the process still runs ``grace_s`` later (SIGTERM lets a learner rank stop
    cleanly; SIGKILL ends a worker at once). A parent already gone when this is called counts."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0)

    def watch() -> None:
        while os.getppid() == parent:  # (checked after prctl: a parent already gone counts)
            time.sleep(0.5)
        log.error("the process %d that started this %s is gone: stopping", parent, what)
        os.kill(os.getpid(), sig)
        time.sleep(grace_s)
        log.error("still running %.0f s after the parent died: exiting", grace_s)
        os._exit(1)

    threading.Thread(target=watch, name="reval-parent-watch", daemon=True).start()


def own_group() -> int:
    """Make this process the leader of a session (and process group) of its own, with a guard
    that SIGKILLs the whole group when this process ends, however it ends (a SIGKILL included).

    Everything this process starts, and everything those start (a reward function that forks,
    the grandchildren of a subprocess), is in the group unless it makes a session of its own,
    so nothing it started outlives it: the guard, a child forked here (before any thread
    starts), has the kernel signal it when this process dies (``PR_SET_PDEATHSIG``; it also
    looks once a second) and kills the group. The guard holds no descriptor of this process's.
    Call it first thing in a process spawned for the purpose (the grading processes of
    ``rollout/grading/process.py``); ``kill_group`` is its owner's side. Returns the guard's pid."""
    with contextlib.suppress(PermissionError):  # (already a group's leader: that group is ours)
        os.setsid()
    leader = os.getpid()
    guard = os.fork()
    if guard == 0:  # the guard: no return from here
        try:
            _guard(leader)
        finally:
            os._exit(0)
    return guard


def _guard(leader: int) -> None:
    """The guard's life (see ``own_group``)."""
    keep = {0, 1, 2}
    with contextlib.suppress(OSError):
        for name in os.listdir("/proc/self/fd"):  # (the pipes and the resource tracker's)
            if int(name) not in keep:
                with contextlib.suppress(OSError):
                    os.close(int(name))

    def end(*_: object) -> None:
        kill_group(leader)  # (this guard is in the group: it ends here)
        os._exit(0)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGUSR1, end)
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(PR_SET_NAME, b"reval-guard", 0, 0, 0)  # (its name in ps and top)
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGUSR1, 0, 0, 0)
    while os.getppid() == leader:  # (checked after prctl: a leader already gone counts)
        time.sleep(1.0)
    end()


def kill_group(leader: int) -> bool:
    """SIGKILL the process group of ``leader`` (a process that called ``own_group``): it and
    everything it started. Call it while ``leader`` is alive or not yet reaped, or while the
    group has members (its pid cannot be reused then). True if a group was there."""
    if leader <= 1:
        return False
    try:
        os.killpg(leader, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` is a live process on this machine (one of another user's counts; a pid
    reused by another process cannot be told from the one that had it)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
