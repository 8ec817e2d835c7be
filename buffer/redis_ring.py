"""The replay service's Redis backend: a per-run FIFO ring shared by every rollout worker and the
learner, kept across restarts of any of them (and of Redis, with AOF on: see docs/buffer.md).

A ring has two halves over one ``RingLayout`` (``buffer.redis_layout``: the run's keys, the Lua
scripts of ``buffer.redis_lua``, retries, checked reads of the bookkeeping): ``RedisProducer``
(``buffer.redis_producer``: insert, the local spool, flush; a rollout worker) and
``RedisConsumer`` (``buffer.redis_consumer``: sample, take, quarantine, write-back; the learner).
Writes go through server-side Lua scripts, so concurrent producers and consumers see atomic
inserts and samples. ``RedisRing`` is both halves in one object, for a process that fills and
drains the ring itself (``reval train`` with ``buffer.backend = "redis"``, the tests, the
benchmarks): a ``ReplayBuffer``.
"""

from __future__ import annotations

import redis

from buffer.base import Sampling
from buffer.metrics import BufferMetrics
from buffer.records import NO_LIMITS, RecordLimits
from buffer.redis_consumer import RedisConsumer
from buffer.redis_layout import RingCorrupt, RingLayout
from buffer.redis_producer import RedisProducer

__all__ = ["RedisConsumer", "RedisProducer", "RedisRing", "RingCorrupt", "RingLayout"]


class RedisRing(RedisProducer, RedisConsumer):
    """A ReplayBuffer on Redis: a producer and a consumer over one layout (one client). One
    instance per process (not shared across threads while sampling; the underlying connection
    pool is thread-safe)."""

    def __init__(
        self,
        run: str,
        capacity: int,
        *,
        url: str = "redis://127.0.0.1:6379/0",
        key_prefix: str = "reval:",
        client: redis.Redis | None = None,
        seed: int | None = None,
        sampling: Sampling | None = None,
        spool_max_bytes: int = 256 << 20,
        retry_s: float = 30.0,
        metrics: BufferMetrics | None = None,
        max_record_bytes: int = 64 << 20,
        reset: bool = False,
        open_retry_s: float = 5.0,
        background: bool = False,
        limits: RecordLimits = NO_LIMITS,
    ) -> None:
        """The arguments of ``RingLayout``, ``RedisProducer`` and ``RedisConsumer``."""
        layout = RingLayout(
            run, capacity, url=url, key_prefix=key_prefix, client=client, retry_s=retry_s,
            metrics=metrics, reset=reset, open_retry_s=open_retry_s,
        )  # fmt: skip
        RedisConsumer.__init__(self, layout, seed=seed, sampling=sampling,
                               max_record_bytes=max_record_bytes, limits=limits)  # fmt: skip
        RedisProducer.__init__(
            self, layout, prioritized=self.sampling.prioritized, spool_max_bytes=spool_max_bytes,
            max_record_bytes=max_record_bytes, background=background, limits=limits,
        )  # fmt: skip
