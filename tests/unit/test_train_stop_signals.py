"""``StopSignals`` (services/stop.py), the stop of ``reval train``: during the set-up a signal
raises ``Stopped`` (nothing to keep); during the rounds the first one asks for a stop after the
round in hand and a second one exits at once, 128 + the signal. Run in a child process: the
second signal ends the process it arrives in."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CHILD = textwrap.dedent(
    """
    import os, signal, sys, time
    from services.stop import Stopped, StopSignals

    signals = StopSignals().install()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
        print("not stopped during the set-up")
    except Stopped as stop:
        print(f"set-up stopped by {stop} ({stop.signum})")
    signals.rounds = True
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.2)
    print(f"asked to stop: {signals.signum}", flush=True)
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(5)
    print("still running after a second Ctrl-C")
    """
)


def test_set_up_stops_at_once_and_a_second_ctrl_c_exits_at_once():
    done = subprocess.run([sys.executable, "-c", CHILD], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert done.returncode == 130, (done.stdout, done.stderr)
    assert done.stdout.splitlines() == ["set-up stopped by SIGTERM (15)", "asked to stop: 2"]
    assert "Ctrl-C again: exiting now, no checkpoint" in done.stderr
    assert "Traceback" not in done.stderr


def test_the_previous_handlers_come_back():
    import signal

    from services.stop import StopSignals

    before = signal.getsignal(signal.SIGINT)
    signals = StopSignals().install()
    assert signal.getsignal(signal.SIGINT) != before
    signals.restore()
    assert signal.getsignal(signal.SIGINT) == before
