"""Prometheus metrics of the replay buffer (``reval_buffer_*``), one set per process.

| name | type | meaning |
|---|---|---|
| ``reval_buffer_size`` | gauge | trajectories held (as last seen by this process) |
| ``reval_buffer_capacity`` | gauge | M |
| ``reval_buffer_inserts_total`` | counter | trajectories inserted by this process |
| ``reval_buffer_samples_total`` | counter | trajectories sampled by this process |
| ``reval_buffer_evictions_total`` | counter | trajectories evicted by this process's inserts |
| ``reval_buffer_evicted_unused_total`` | counter | of those, evicted never used |
| ``reval_buffer_samples_per_insert`` | gauge | the run's realised reuse, sampled / inserted |
| ``reval_buffer_evicted_unused_ratio`` | gauge | the run's share of evictions that were unused |
| ``reval_buffer_rejected_total`` | counter | malformed records refused (insert or read) |
| ``reval_buffer_dropped_stale_total`` | counter | stale trajectories dropped/skipped |
| ``reval_buffer_sample_latency_seconds`` | histogram | one ``sample`` call, waiting included |
| ``reval_buffer_sample_wait_seconds_total`` | counter | time sampling waited (limiter, too few) |
| ``reval_buffer_staleness`` | histogram | policy-version lag of sampled trajectories |
| ``reval_buffer_reuse_count`` | histogram | use count of sampled trajectories (after this use) |
| ``reval_buffer_backend_errors_total`` | counter | failed backend (Redis) calls, retried |
| ``reval_buffer_spool_records`` | gauge | records spooled locally while Redis is unreachable |
| ``reval_buffer_spool_dropped_total`` | counter | records dropped, spool full |
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable, Iterator, Sequence

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from buffer.base import BufferStats

P = "reval_buffer_"


class BatchHistogram(Collector):
    """A Prometheus histogram observed a batch at a time: one ``searchsorted`` and ``bincount``
    per batch instead of a locked ``Histogram.observe`` per value (1024 values: about 0.9 ms ->
    0.05 ms). Exposed through the public custom-collector API with the same series as a
    ``Histogram`` (``_bucket{le}``, ``_count``, ``_sum``; ``le`` upper bounds are inclusive)."""

    def __init__(
        self, name: str, documentation: str, buckets: Sequence[float], registry: CollectorRegistry
    ) -> None:
        bounds = [float(b) for b in buckets]
        if bounds != sorted(set(bounds)) or not bounds:
            raise ValueError(f"{name}: buckets must be distinct and increasing, got {buckets}")
        if bounds[-1] != math.inf:
            bounds.append(math.inf)
        self.name, self.documentation = name, documentation
        self._bounds = np.asarray(bounds)
        self._les: list[str] = [floatToGoString(b) for b in bounds]  # type: ignore[no-untyped-call]
        self._counts = np.zeros(len(bounds), dtype=np.int64)
        self._sum = 0.0
        self._lock = threading.Lock()
        registry.register(self)

    def observe(self, value: float) -> None:
        self.observe_many([value])

    def observe_many(self, values: Iterable[float]) -> None:
        v = np.fromiter(values, dtype=np.float64) if not isinstance(values, np.ndarray) else values
        if v.size == 0:
            return
        if np.isnan(v).any():
            raise ValueError(f"{self.name}: cannot observe NaN")
        # Bucket i holds values in (bound[i-1], bound[i]]: the first bound >= the value.
        counts = np.bincount(
            np.searchsorted(self._bounds, v, side="left"), minlength=len(self._bounds)
        )
        total = float(v.sum())
        with self._lock:
            self._counts += counts
            self._sum += total

    def describe(self) -> list[HistogramMetricFamily]:
        return [HistogramMetricFamily(self.name, self.documentation)]

    def collect(self) -> Iterator[HistogramMetricFamily]:
        with self._lock:
            cumulative = np.cumsum(self._counts).tolist()
            total = self._sum
        yield HistogramMetricFamily(
            self.name,
            self.documentation,
            buckets=list(zip(self._les, cumulative, strict=True)),
            sum_value=total,
        )


class BufferMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry if registry is not None else CollectorRegistry()
        self.size = Gauge(f"{P}size", "Trajectories held", registry=r)
        self.capacity = Gauge(f"{P}capacity", "Capacity M", registry=r)
        self.inserts = Counter(f"{P}inserts", "Trajectories inserted", registry=r)
        self.samples = Counter(f"{P}samples", "Trajectories sampled", registry=r)
        self.evictions = Counter(f"{P}evictions", "Trajectories evicted", registry=r)
        self.evicted_unused = Counter(
            f"{P}evicted_unused", "Trajectories evicted never used", registry=r
        )
        self.samples_per_insert = Gauge(
            f"{P}samples_per_insert", "Realised reuse of the run: sampled / inserted", registry=r
        )
        self.evicted_unused_ratio = Gauge(
            f"{P}evicted_unused_ratio", "Share of the run's evictions that were unused", registry=r
        )
        self.rejected = Counter(f"{P}rejected", "Malformed records refused", registry=r)
        self.dropped_stale = Counter(f"{P}dropped_stale", "Stale trajectories", registry=r)
        self.sample_latency = Histogram(
            f"{P}sample_latency_seconds",
            "Latency of one sample call",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=r,
        )
        self.sample_wait = Counter(
            f"{P}sample_wait_seconds", "Time sampling waited for data or rate", registry=r
        )
        self.staleness = BatchHistogram(
            f"{P}staleness",
            "Policy-version lag of sampled trajectories",
            (0, 1, 2, 4, 8, 16, 32, 64, 128),
            r,
        )
        self.reuse = BatchHistogram(
            f"{P}reuse_count",
            "Use count of sampled trajectories",
            (1, 2, 3, 4, 6, 8, 12, 16, 32),
            r,
        )
        self.backend_errors = Counter(f"{P}backend_errors", "Failed backend calls", registry=r)
        self.spool_records = Gauge(f"{P}spool_records", "Records spooled locally", registry=r)
        self.spool_dropped = Counter(f"{P}spool_dropped", "Spooled records dropped", registry=r)

    def observe_stats(self, stats: BufferStats) -> None:
        """The run-wide figures of a ``stats()`` read: size, realised reuse, unused evictions."""
        self.size.set(stats.size)
        self.samples_per_insert.set(stats.reuse)
        self.evicted_unused_ratio.set(stats.unused_share)

    def observe_sample(
        self, latency: float, wait: float, staleness: Iterable[int], uses: Iterable[int]
    ) -> None:
        self.sample_latency.observe(latency)
        if wait > 0:
            self.sample_wait.inc(wait)
        lags = np.fromiter(staleness, dtype=np.float64)
        self.staleness.observe_many(lags)
        self.reuse.observe_many(np.fromiter(uses, dtype=np.float64))
        self.samples.inc(len(lags))
