"""Metrics helpers: a JSONL writer for run directories and Prometheus metrics (``reval_`` prefix).

Documented names (one-process trainer; the services add their own under the same prefix):

| name | type | meaning |
|---|---|---|
| ``reval_train_round`` | gauge | generation rounds completed |
| ``reval_policy_version`` | gauge | optimizer steps taken = version of the generating weights |
| ``reval_train_reward_mean`` | gauge | mean raw reward of the last round's trajectories |
| ``reval_eval_success_rate`` | gauge | success rate of the last evaluation over all prompts |
| ``reval_learner_loss`` | gauge | loss of the last update |
| ``reval_learner_grad_norm`` | gauge | pre-clip gradient norm of the last update |
| ``reval_learner_updates_total`` | counter | optimizer steps |
| ``reval_learner_skipped_steps_total`` | counter | steps skipped for a non-finite gradient norm |
| ``reval_rollout_trajectories_total`` | counter | trajectories generated |
| ``reval_rollout_tokens_total`` | counter | response tokens generated |
| ``reval_buffer_*`` | | the replay buffer's metrics (``buffer.metrics``) on the same registry |
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, TextIO

from prometheus_client import CollectorRegistry, Counter, Gauge

PREFIX = "reval_"


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None  # JSON has no NaN/inf
    return value


class JsonlWriter:
    """Appends one JSON object per line and flushes, so a crashed run keeps what it logged."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._fh: TextIO = self.path.open("a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        self._fh.write(json.dumps({k: _clean(v) for k, v in record.items()}) + "\n")
        self._fh.flush()

    def close(self) -> None:
        self._fh.close()


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a JSONL file; a last line without its newline is one its writer is still
    writing (a live run's log) and is left out when it does not parse yet."""
    text = Path(path).read_text(encoding="utf-8")
    lines = text.splitlines()
    if lines and not text.endswith("\n"):
        try:
            json.loads(lines[-1])
        except ValueError:
            lines.pop()
    return [json.loads(line) for line in lines if line.strip()]


class TrainMetrics:
    """The one-process trainer's Prometheus metrics, on a registry of their own (the updates'
    metrics, ``learner/step.py``'s ``UpdateMetrics``, join the same registry)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.round = Gauge(f"{PREFIX}train_round", "Generation rounds completed", registry=r)
        self.reward = Gauge(f"{PREFIX}train_reward_mean", "Mean raw reward, last round", registry=r)
        self.success = Gauge(f"{PREFIX}eval_success_rate", "Last eval success rate", registry=r)
        self.trajectories = Counter(
            f"{PREFIX}rollout_trajectories", "Trajectories generated", registry=r
        )
        self.tokens = Counter(f"{PREFIX}rollout_tokens", "Response tokens generated", registry=r)

    def serve(self, port: int, addr: str = "127.0.0.1") -> int:
        """Serve ``/metrics``, ``/healthz`` and ``/readyz`` over HTTP; returns the bound port
        (``port=0`` picks a free one)."""
        from reval.ops_http import OpsServer

        return OpsServer(port, self.registry, addr).port
