"""Signal handlers that take no lock (``reval/signals.py``): a Ctrl-C that arrives while the
main thread holds the lock of the event its handler sets (inside ``Event.wait``), or a second
signal inside the first one's handler (Ctrl-C to the process group, then the parent's forward:
``reval learner``'s ranks), must not hang the process. Each case runs in a process of its own,
where the handler is the real one and the signal a real ``kill``."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SCRIPT = textwrap.dedent(
    """
    import os, signal, sys, threading
    from reval.signals import off_main

    ev = threading.Event()
    if sys.argv[1] == "off_main":
        signal.signal(signal.SIGINT, off_main(lambda _s: ev.set()))
    else:  # the handler as it was: Event.set in the handler itself
        signal.signal(signal.SIGINT, lambda _s, _f: ev.set())
    with ev._cond:  # the main thread inside Event.wait: it holds the event's lock
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)  # (and a second signal, as from a forward)
        sum(range(1000))  # (bytecodes: the handlers run here)
    print("stopped" if ev.wait(10) else "never set", flush=True)
    """
)
ROOT = Path(__file__).resolve().parents[2]


def run(how: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", SCRIPT, how], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)  # fmt: skip


def test_a_signal_while_the_main_thread_holds_the_events_lock_stops_the_process():
    done = run("off_main", 30)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "stopped"


def test_setting_the_event_in_the_handler_itself_hangs():
    """The hazard ``off_main`` exists for (what ``reval learner`` did until it used it)."""
    with pytest.raises(subprocess.TimeoutExpired):
        run("direct", 3)
