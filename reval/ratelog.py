"""Log lines that repeat, at most once per interval, with a count of those held back.

A worker loading weights 625 times in 8 minutes, or a full disk refusing every version, wrote a
line each time: the one line that mattered scrolled away. ``RateLog`` is the one throttle every
process uses for a line that repeats (weight loads, repeated faults, waits): the first is
logged, then at most one per ``every_s`` per key, saying how many were held back since; a line
whose text changes (``changed``) or a recovery (``recovered``) is logged at once."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class _Seen:
    last: float
    held: int = 0
    state: str | None = None


class RateLog:
    """At most one line per ``every_s`` seconds per key (``log``, ``warning``, ``error``);
    ``clock`` is for tests."""

    def __init__(
        self,
        logger: logging.Logger,
        every_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.logger = logger
        self.every_s = every_s
        self.clock = clock
        self._seen: dict[str, _Seen] = {}
        self._lock = threading.Lock()

    def log(self, level: int, key: str, msg: str, *args: object, state: str | None = None) -> bool:
        """Log ``msg % args`` under ``key`` unless a line of that key went out less than
        ``every_s`` ago with the same ``state`` (a change of ``state`` is logged at once).
        Lines held back are counted and named in the next one. True when logged."""
        now = self.clock()
        with self._lock:
            seen = self._seen.get(key)
            if seen is not None and now - seen.last < self.every_s and state == seen.state:
                seen.held += 1
                return False
            held = seen.held if seen is not None else 0
            self._seen[key] = _Seen(now, 0, state)
        if held:
            msg = f"{msg} (and {held} more like it since the last line)"
        self.logger.log(level, msg, *args)
        return True

    def info(self, key: str, msg: str, *args: object, state: str | None = None) -> bool:
        return self.log(logging.INFO, key, msg, *args, state=state)

    def warning(self, key: str, msg: str, *args: object, state: str | None = None) -> bool:
        return self.log(logging.WARNING, key, msg, *args, state=state)

    def error(self, key: str, msg: str, *args: object, state: str | None = None) -> bool:
        return self.log(logging.ERROR, key, msg, *args, state=state)

    def recovered(self, key: str, msg: str, *args: object) -> bool:
        """The fault of ``key`` is over: log ``msg`` once (with the count held back) and forget
        the key, so that the next fault is logged at once. False (nothing logged) when no line
        of ``key`` went out."""
        with self._lock:
            seen = self._seen.pop(key, None)
        if seen is None:
            return False
        if seen.held:
            msg = f"{msg} ({seen.held + 1} lines of it in all)"
        self.logger.info(msg, *args)
        return True

    def active(self, key: str) -> bool:
        """Whether a line of ``key`` went out and no ``recovered`` since."""
        with self._lock:
            return key in self._seen
