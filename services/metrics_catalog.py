"""Every Prometheus metric each reval process exports, from the processes' own registries: what
``docs/metrics.md`` lists (``python -m services.metrics_catalog`` prints that table) and what the
tests check the docs, the dashboard and the alert rules against.

    .venv/bin/python -m services.metrics_catalog > /tmp/table.md
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, generate_latest


@dataclass(frozen=True)
class MetricInfo:
    name: str
    """The family name (counters without ``_total``, as Prometheus client libraries name them)."""
    kind: str
    labels: tuple[str, ...]
    help: str
    process: str


def registries() -> dict[str, CollectorRegistry]:
    """A fresh registry per process kind, filled as that process fills its own."""
    from buffer.metrics import BufferMetrics
    from learner.reporting import LearnerMetrics
    from learner.step import UpdateMetrics
    from reval.metrics import TrainMetrics
    from rollout.grading.pool import VerifierMetrics
    from rollout.math_task import TaskMetrics
    from rollout.worker_metrics import RolloutMetrics

    learner = LearnerMetrics()
    BufferMetrics(learner.registry, role="consumer")
    rollout = RolloutMetrics()
    BufferMetrics(rollout.registry, role="producer")
    VerifierMetrics(rollout.registry)
    TaskMetrics(rollout.registry)
    train = TrainMetrics()
    BufferMetrics(train.registry)
    VerifierMetrics(train.registry)  # (a math task's grading pool)
    TaskMetrics(train.registry)
    UpdateMetrics(train.registry)  # (the update step's, as in the learner)
    from services.evaluate import EvalMetrics
    from services.launch import LaunchMetrics

    return {
        "launch": LaunchMetrics().registry,
        "eval": EvalMetrics().registry,
        "learner": learner.registry,
        "rollout": rollout.registry,
        "train": train.registry,
        "api": api_registry(),
    }


def api_registry() -> CollectorRegistry:
    from reval.config import ApiConfig
    from services.api import create_app

    app = create_app(ApiConfig())  # (no Redis call at creation)
    registry: CollectorRegistry = app.state.metrics
    return registry


def catalog() -> list[MetricInfo]:
    out: dict[tuple[str, str], MetricInfo] = {}
    for process, registry in registries().items():
        declared = _declared_labels(registry)
        for family in registry.collect():
            labels: set[str] = set(declared.get(family.name, ()))
            for sample in family.samples:
                labels |= set(sample.labels) - {"le", "quantile"}
            key = (family.name, process)
            out[key] = MetricInfo(family.name, family.type, tuple(sorted(labels)),
                                  family.documentation, process)  # fmt: skip
    return sorted(out.values(), key=lambda m: (m.name, m.process))


def _declared_labels(registry: CollectorRegistry) -> dict[str, tuple[str, ...]]:
    """Label names as declared (a labelled metric has no sample before its first use)."""
    out: dict[str, tuple[str, ...]] = {}
    for collector in list(getattr(registry, "_collector_to_names", {})):
        name = getattr(collector, "_name", None)
        if name is not None:
            out[str(name)] = tuple(getattr(collector, "_labelnames", ()))
    return out


def series_names() -> set[str]:
    """Every sample name a scrape can show (``_total``, ``_bucket``, ``_sum``, ``_count``...)."""
    names: set[str] = set()
    for registry in registries().values():
        for family in registry.collect():
            for sample in family.samples:
                names.add(sample.name)
            if family.type == "histogram":
                names |= {f"{family.name}_bucket", f"{family.name}_sum", f"{family.name}_count"}
            if family.type == "counter":
                names.add(f"{family.name}_total")
            if family.type in ("gauge", "unknown"):
                names.add(family.name)  # (a labelled one has no sample before its first use)
    return names


def expositions() -> dict[str, bytes]:
    return {process: generate_latest(r) for process, r in registries().items()}


def markdown() -> str:
    rows = ["| metric | type | labels | processes | meaning |", "|---|---|---|---|---|"]
    merged: dict[str, tuple[MetricInfo, list[str]]] = {}
    for m in catalog():
        if m.name in merged:
            merged[m.name][1].append(m.process)
        else:
            merged[m.name] = (m, [m.process])
    for name, (m, procs) in sorted(merged.items()):
        shown = f"{name}_total" if m.kind == "counter" else name
        labels = ", ".join(m.labels) or "-"
        rows.append(f"| `{shown}` | {m.kind} | {labels} | {', '.join(procs)} | {m.help} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(markdown(), end="")
