"""Replay service: the trajectory record and the FIFO ring (embedded memory backend, Redis)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from buffer.base import (
    BufferStats,
    BufferUnavailable,
    ReplayBuffer,
    ReplayConsumer,
    ReplayProducer,
    SampledBatch,
    SampleTimeout,
    Sampling,
)
from buffer.metrics import BufferMetrics
from buffer.record_codec import decode, encode
from buffer.records import NO_LIMITS, RecordError, RecordLimits, Trajectory
from buffer.ring import MemoryRing

if TYPE_CHECKING:
    from buffer.redis_producer import RedisProducer

__all__ = [
    "BufferMetrics",
    "BufferStats",
    "BufferUnavailable",
    "MemoryRing",
    "RecordError",
    "RecordLimits",
    "ReplayBuffer",
    "ReplayConsumer",
    "ReplayProducer",
    "SampleTimeout",
    "SampledBatch",
    "Sampling",
    "Trajectory",
    "decode",
    "encode",
    "make_buffer",
    "make_consumer",
    "make_producer",
]


def _settings(cfg: Any, samples_per_insert: float | None, limits: RecordLimits) -> dict[str, Any]:
    """What both backends' consumers take from a ``BufferConfig``: its ``Sampling``, whole."""
    return {"sampling": Sampling.of(cfg, samples_per_insert), "limits": limits}


def _where(redis: Any) -> tuple[str, str]:
    """(url, key prefix) of a ``RedisConfig``."""
    if redis is None:
        raise ValueError("buffer.backend=redis needs the run's redis section (redis.url)")
    return str(redis.url), str(redis.prefix)


def make_buffer(
    cfg: Any,
    run: str,
    seed: int | None = 0,
    metrics: BufferMetrics | None = None,
    reset: bool = False,
    samples_per_insert: float | None = None,
    limits: RecordLimits = NO_LIMITS,
    redis: Any = None,
) -> ReplayBuffer:
    """Both halves of the buffer a ``BufferConfig`` describes, for run ``run``, in one object
    (a process that fills and drains its own ring: ``reval train``). ``reset``: start it
    empty, whatever a previous run of the same id left in Redis; ``samples_per_insert``: the
    run's K, ``RunConfig.samples_per_insert``, when the section leaves it unset; ``limits``:
    what the consumer does with a record, a record beyond them is quarantined; ``redis``: the
    run's ``RedisConfig`` (where the Redis backend lives)."""
    common = _settings(cfg, samples_per_insert, limits)
    if cfg.backend == "memory":
        return MemoryRing(cfg.capacity, seed=seed or 0, metrics=metrics, **common)
    if cfg.backend == "redis":
        from buffer.redis_ring import RedisRing  # redis-py only where it is used

        url, prefix = _where(redis)
        return RedisRing(
            run,
            cfg.capacity,
            url=url,
            key_prefix=prefix,
            seed=seed,
            spool_max_bytes=int(cfg.spool_max_mb * (1 << 20)),
            retry_s=redis.outage_s,
            reset=reset,
            metrics=metrics,
            **common,
        )
    raise ValueError(f"unknown buffer backend {cfg.backend!r}")


def make_consumer(
    cfg: Any,
    run: str,
    seed: int | None = 0,
    metrics: BufferMetrics | None = None,
    reset: bool = False,
    samples_per_insert: float | None = None,
    limits: RecordLimits = NO_LIMITS,
    redis: Any = None,
) -> ReplayConsumer:
    """The consumer half of the buffer a ``BufferConfig`` describes (the learner's), with the
    arguments of ``make_buffer``. On Redis it holds no producer (no spool, no sender)."""
    common = _settings(cfg, samples_per_insert, limits)
    if cfg.backend == "redis":
        from buffer.redis_consumer import RedisConsumer  # redis-py only where it is used
        from buffer.redis_layout import RingLayout

        url, prefix = _where(redis)
        layout = RingLayout(
            run, cfg.capacity, url=url, key_prefix=prefix, retry_s=redis.outage_s,
            metrics=metrics, reset=reset,
        )  # fmt: skip
        return RedisConsumer(layout, seed=seed, **common)
    return make_buffer(cfg, run, seed, metrics, reset, samples_per_insert, limits, redis)


def make_producer(
    cfg: Any,
    run: str,
    redis: Any,
    metrics: BufferMetrics | None = None,
    spool_dir: str | Path | None = None,
) -> RedisProducer:
    """The producer half of the Redis ring a ``BufferConfig`` describes, in the Redis that
    ``redis`` (a ``RedisConfig``) names: a rollout worker's (it inserts, spooling while Redis is
    away or refuses writes, and reads the counters). ``spool_dir``: where it keeps what it
    could not send when it closes, and takes back what an earlier one kept (the run
    directory's ``spool/``)."""
    if cfg.backend != "redis":
        raise ValueError("a rollout worker needs buffer.backend=redis (the replay service)")
    from buffer.redis_layout import RingLayout  # redis-py only where it is used
    from buffer.redis_producer import RedisProducer

    url, prefix = _where(redis)
    layout = RingLayout(run, cfg.capacity, url=url, key_prefix=prefix, metrics=metrics)
    return RedisProducer(
        layout, prioritized=cfg.prioritized, spool_max_bytes=int(cfg.spool_max_mb * (1 << 20)),
        spool_dir=spool_dir,
    )  # fmt: skip
