"""Signal handlers that take no lock: ``off_main``.

A Python signal handler runs in the main thread between two bytecodes, wherever that thread is:
inside ``Event.wait`` holding the event's lock, or inside the same handler already (Ctrl-C
reaches a whole process group, and a parent that forwards it sends its ranks a second one a
moment later: CPython runs the second handler inside the first). A handler that sets a
``threading.Event`` (a plain ``Lock``, not reentrant) then waits on a lock its own thread holds:
the process hangs for good (``reval learner``'s two ranks, Ctrl-C, CI). ``off_main`` hands the
work to a thread of its own, started with ``_thread`` (no lock of ``threading``'s taken in the
handler), so the handler returns at once and the work waits, if at all, for a lock the main
thread lets go of.
"""

from __future__ import annotations

import _thread
import os
import sys
from collections.abc import Callable
from typing import Any

Handler = Callable[[int, Any], None]


def off_main(act: Callable[[int], None]) -> Handler:
    """A handler for ``signal.signal`` that runs ``act(signum)`` on a new thread (one per
    signal: ``act`` must be safe to run twice, and concurrently). At the interpreter's exit,
    where no thread starts any more, ``act`` runs in the handler itself."""

    def handler(signum: int, _frame: Any) -> None:
        try:
            _thread.start_new_thread(act, (signum,))
        except RuntimeError:
            if sys.is_finalizing():  # (the interpreter is shutting down: no thread starts)
                act(signum)
            else:  # (no thread to be had: said, never done here, where it could hang)
                os.write(2, f"signal {signum}: no thread to handle it; ignored\n".encode())

    return handler
