"""Prometheus metrics of the replay buffer (``reval_buffer_*``), one set per process.

| name | type | meaning |
|---|---|---|
| ``reval_buffer_size`` | gauge | trajectories held (as last seen by this process) |
| ``reval_buffer_capacity`` | gauge | M |
| ``reval_buffer_inserts_total`` | counter | trajectories inserted by this process |
| ``reval_buffer_samples_total`` | counter | trajectories sampled by this process |
| ``reval_buffer_evictions_total`` | counter | trajectories evicted by this process's inserts |
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

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

P = "reval_buffer_"


class BufferMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry if registry is not None else CollectorRegistry()
        self.size = Gauge(f"{P}size", "Trajectories held", registry=r)
        self.capacity = Gauge(f"{P}capacity", "Capacity M", registry=r)
        self.inserts = Counter(f"{P}inserts", "Trajectories inserted", registry=r)
        self.samples = Counter(f"{P}samples", "Trajectories sampled", registry=r)
        self.evictions = Counter(f"{P}evictions", "Trajectories evicted", registry=r)
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
        self.staleness = Histogram(
            f"{P}staleness",
            "Policy-version lag of sampled trajectories",
            buckets=(0, 1, 2, 4, 8, 16, 32, 64, 128),
            registry=r,
        )
        self.reuse = Histogram(
            f"{P}reuse_count",
            "Use count of sampled trajectories",
            buckets=(1, 2, 3, 4, 6, 8, 12, 16, 32),
            registry=r,
        )
        self.backend_errors = Counter(f"{P}backend_errors", "Failed backend calls", registry=r)
        self.spool_records = Gauge(f"{P}spool_records", "Records spooled locally", registry=r)
        self.spool_dropped = Counter(f"{P}spool_dropped", "Spooled records dropped", registry=r)

    def observe_sample(
        self, latency: float, wait: float, staleness: Iterable[int], uses: Iterable[int]
    ) -> None:
        self.sample_latency.observe(latency)
        if wait > 0:
            self.sample_wait.inc(wait)
        n = 0
        for s in staleness:
            self.staleness.observe(s)
            n += 1
        for u in uses:
            self.reuse.observe(u)
        self.samples.inc(n)
