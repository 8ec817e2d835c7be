"""Replay service: the trajectory record and the FIFO ring (embedded memory backend, Redis)."""

from __future__ import annotations

from typing import Any

from buffer.base import (
    BufferStats,
    BufferUnavailable,
    ReplayBuffer,
    SampledBatch,
    SampleTimeout,
)
from buffer.metrics import BufferMetrics
from buffer.records import NO_LIMITS, RecordError, RecordLimits, Trajectory, decode, encode
from buffer.ring import MemoryRing

__all__ = [
    "BufferMetrics",
    "BufferStats",
    "BufferUnavailable",
    "MemoryRing",
    "RecordError",
    "RecordLimits",
    "ReplayBuffer",
    "SampleTimeout",
    "SampledBatch",
    "Trajectory",
    "decode",
    "encode",
    "make_buffer",
]


def make_buffer(
    cfg: Any,
    run: str,
    seed: int | None = 0,
    metrics: BufferMetrics | None = None,
    reset: bool = False,
    samples_per_insert: float | None = None,
    limits: RecordLimits = NO_LIMITS,
) -> ReplayBuffer:
    """The buffer a ``BufferConfig`` describes, for run ``run`` (``reset``: start it empty,
    whatever a previous run of the same id left in Redis; ``samples_per_insert``: the run's K,
    ``RunConfig.samples_per_insert``, when the section leaves it unset; ``limits``: what the
    consumer does with a record, a record beyond them is quarantined)."""
    spi = cfg.samples_per_insert if cfg.samples_per_insert is not None else samples_per_insert
    common: dict[str, Any] = {
        "samples_per_insert": spi,
        "rate_slack": cfg.rate_slack,
        "min_size_to_sample": cfg.min_size_to_sample,
        "max_staleness": cfg.max_staleness,
        "prioritized": cfg.prioritized,
        "priority_alpha": cfg.priority_alpha,
        "priority_beta": cfg.priority_beta,
        "priority_eps": cfg.priority_eps,
        "metrics": metrics,
        "limits": limits,
    }
    if cfg.backend == "memory":
        return MemoryRing(cfg.capacity, seed=seed or 0, **common)
    if cfg.backend == "redis":
        from buffer.redis_ring import RedisRing  # redis-py only where it is used

        return RedisRing(
            run,
            cfg.capacity,
            url=cfg.redis_url,
            key_prefix=cfg.key_prefix,
            seed=seed,
            spool_max_bytes=int(cfg.spool_max_mb * (1 << 20)),
            retry_s=cfg.sample_timeout_s,
            reset=reset,
            **common,
        )
    raise ValueError(f"unknown buffer backend {cfg.backend!r}")
