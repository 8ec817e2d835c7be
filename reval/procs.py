"""Child processes that end with the process that started them.

A SIGKILL of a parent runs none of its exit handlers, so the children it spawned (learner ranks,
grading workers, experiment workers) went on running as orphans: a second learner beside the
next one of the run, graders holding cores, a killed ``reval experiment``'s pool finishing its
whole queue. ``follow_parent`` is the one guard every spawned child takes."""

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
