"""What a rollout worker counts: its Prometheus metrics (``RolloutMetrics``, the
``reval_rollout_*`` family of docs/metrics.md) and the stats of its summary line
(``WorkerStats``), both per group (one prompt's answers or episodes) graded and pushed."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from reval.metrics import PREFIX


class RolloutMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry if registry is not None else CollectorRegistry()
        p = f"{PREFIX}rollout_"
        self.tokens = Counter(f"{p}tokens", "Response tokens generated", registry=r)
        self.trajectories = Counter(f"{p}trajectories", "Trajectories pushed", registry=r)
        self.batches = Counter(
            f"{p}batches", "Groups (a prompt's answers or episodes) graded and pushed", registry=r
        )
        self.tokens_per_s = Gauge(
            f"{p}tokens_per_second",
            "Tokens/s of the last group (its generation and grading)",
            registry=r,
        )
        self.traj_per_s = Gauge(
            f"{p}trajectories_per_second", "Trajectories/s of the last group", registry=r
        )
        self.reward = Gauge(f"{p}reward_mean", "Mean raw reward of the last group", registry=r)
        self.version = Gauge(f"{p}policy_version", "Version of the weights in use", registry=r)
        self.weight_wait = Counter(
            f"{p}weight_wait_seconds", "Time spent waiting for weights", registry=r
        )
        self.weight_loads = Counter(f"{p}weight_loads", "New weights loaded", registry=r)
        self.ahead_wait = Counter(
            f"{p}ahead_wait_seconds",
            "Time waiting while generation is buffer.generate_ahead samples ahead of the learner",
            registry=r,
        )
        self.verify_seconds = Histogram(
            f"{p}verify_seconds",
            "Grading time of one group",
            buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 60),
            registry=r,
        )
        self.episodes_skipped = Counter(
            f"{p}episodes_skipped",
            "Multi-turn episodes left out because their environment misbehaved (task.environment)",
            ["reason"],
            registry=r,
        )
        self.gen_seconds = Histogram(
            f"{p}generate_seconds",
            "Generation time of one group (from its admission)",
            buckets=(0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 300),
            registry=r,
        )


@dataclass
class WorkerStats:
    batches: int = 0
    """Groups (one prompt's answers or episodes) graded and inserted; ``max_batches`` counts
    lockstep batches of ``worker_prompts`` groups, or streaming groups."""
    trajectories: int = 0
    tokens: int = 0
    weight_loads: int = 0
    versions: dict[int, int] = field(default_factory=dict)
    """Per weight version, the groups it sampled tokens of."""
    weight_wait_s: float = 0.0
    """Time spent blocked waiting for weights (only before the first load: after it the worker
    generates with what it has and takes newer weights between batches)."""
    busy_s: float = 0.0
    """Time generating, grading and pushing (not waiting to admit or for weights)."""
    started: float = field(default_factory=time.monotonic)
