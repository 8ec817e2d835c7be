"""Ctrl-C and SIGTERM on ``reval train`` (and on ``reval learner`` while it sets up):
``StopSignals``. Torch-free, so the CLI installs the handlers before it imports the training
(a stop during the set-up is one line too, and a refused run never imports torch)."""

from __future__ import annotations

import logging
import os
import signal
import threading
from typing import Any

log = logging.getLogger("reval.train")


def signal_name(signum: int) -> str:
    """How a stop signal is named in ``reval train``'s lines: ``Ctrl-C`` for SIGINT."""
    return "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name


class Stopped(BaseException):
    """A stop signal arrived during the set-up: there is nothing to keep yet. A BaseException,
    like KeyboardInterrupt, so that no ``except Exception`` on the way swallows it."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal_name(signum))
        self.signum = signum


class StopSignals:
    """SIGINT and SIGTERM on ``reval train`` (installed by the CLI, in the main thread). Before
    the rounds (``rounds`` False: set-up, pretraining, the warm-start evaluation) a signal raises
    ``Stopped``: nothing is there to keep. During the rounds the first one asks the loop to stop
    after the round in hand (``signum``), which then checkpoints; a second one exits at once
    (status 128 + the signal, no checkpoint). ``restore`` puts the previous handlers back."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.rounds = False
        self._before: dict[int, Any] = {}

    def install(self) -> StopSignals:
        """The handlers, in the main thread (elsewhere Python refuses them: none then)."""
        if threading.current_thread() is not threading.main_thread():
            return self
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._before[sig] = signal.signal(sig, self._on_signal)
        return self

    def restore(self) -> None:
        for sig, handler in self._before.items():
            signal.signal(sig, handler)
        self._before.clear()

    def _on_signal(self, signum: int, _frame: object) -> None:
        if not self.rounds:
            raise Stopped(signum)
        name = signal_name(signum)
        if self.signum is not None:
            os.write(2, f"reval train: {name} again: exiting now, no checkpoint\n".encode())
            os._exit(128 + signum)
        self.signum = signum
        log.info("%s: stopping after the round in hand, then a checkpoint (%s again: exit at "
                 "once)", name, name)  # fmt: skip
