"""Retrying a Redis call with exponential backoff (the replay client has its own, with metrics
and a spool; this one serves the small callers: the prompt deal, the weights announcement)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

import redis

T = TypeVar("T")


def retry_redis(fn: Callable[[], T], budget_s: float, what: str, log: logging.Logger) -> T:
    """``fn()``, retried on a dropped connection or a timeout for ``budget_s`` seconds."""
    deadline = time.monotonic() + budget_s
    delay = 0.05
    while True:
        try:
            return fn()
        except (redis.ConnectionError, redis.TimeoutError) as err:
            if time.monotonic() > deadline:
                raise
            log.warning("%s: Redis unreachable, retrying: %s", what, err)
            time.sleep(delay)
            delay = min(2 * delay, 2.0)
