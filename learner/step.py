"""One update step, the only one: ``reval train`` (embedded buffer, in-process generation) and
``reval learner`` (ranks, the Redis replay service) both run it.

An update is: the configured loss over the batch in micro-batches with the reference quantities
filled first (``Learner.update``), the write-backs (the cached reference quantities and, with
prioritized replay, the priorities, for the whole batch: the ranks' shares are gathered on rank 0,
which holds the buffer), the reference-reset schedule (every ``ref_reset_steps *
updates_per_round`` updates: every ``ref_reset_steps`` rounds) and the metrics of the update
(Prometheus and a record for the run's log). Live hyperparameters are applied here too.
"""

from __future__ import annotations

import time
from collections import Counter as Tally
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from buffer.base import ReplayConsumer, SampledBatch
from buffer.records import Trajectory
from learner.trainer import Learner
from reval.config import RunConfig
from reval.control import LiveHParams
from reval.metrics import PREFIX
from reval.retry import skip_when_stopping

Reduce = Callable[[float, str], float]
"""``reduce(x, "sum" | "max")`` over the learner ranks."""
Gather = Callable[[Any], list[Any] | None]
"""Every rank's object on rank 0 (a list, rank order); None on the other ranks."""

_TERMS = ("delta_abs_mean", "v1_mean", "v1_ref_mean", "log_ratio_mean")
_RECORDED = frozenset({"loss", "grad_norm", "skipped"})


class UpdateMetrics:
    """The Prometheus metrics of the updates (rank 0's registry)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r = self.registry = registry
        p = f"{PREFIX}learner_"
        self.loss = Gauge(f"{p}loss", "Loss of the last update", registry=r)
        self.grad_norm = Gauge(f"{p}grad_norm", "Pre-clip grad norm of the last update", registry=r)
        self.updates = Counter(f"{p}updates", "Optimizer steps", registry=r)
        self.skipped = Counter(f"{p}skipped_steps", "Steps skipped (non-finite norm)", registry=r)
        self.version = Gauge(f"{PREFIX}policy_version", "Version of the policy", registry=r)
        self.staleness = Gauge(f"{p}staleness_mean", "Mean lag of the last batch", registry=r)
        self.reward = Gauge(
            f"{p}batch_reward_mean", "Mean raw reward of the last batch", registry=r
        )
        self.success = Gauge(
            f"{p}batch_success_rate", "Fraction of the last batch with a positive raw reward",
            registry=r,
        )  # fmt: skip
        self.delta = Gauge(f"{p}delta_abs_mean", "Mean |Bellman residual| of the last batch",
                           registry=r)  # fmt: skip
        self.v1 = Gauge(f"{p}v1_mean", "Mean V1 (policy soft value at the prompt) of the last "
                        "batch", registry=r)  # fmt: skip
        self.v1_ref = Gauge(f"{p}v1_ref_mean", "Mean V1 of the reference on the last batch",
                            registry=r)  # fmt: skip
        self.kl = Gauge(
            f"{p}kl_estimate",
            "Mean log pi - log pi_ref over the last batch's responses (a sequence KL estimate)",
            registry=r,
        )
        self.step_s = Histogram(
            f"{p}step_seconds", "Time of one update (forward, backward, optimizer)",
            buckets=(0.01, 0.03, 0.1, 0.3, 1, 3, 10, 30, 100), registry=r,
        )  # fmt: skip
        self.ref_version = Gauge(f"{p}ref_version", "Version of the reference", registry=r)
        self.hparam = Gauge(
            f"{p}hparam", "Live hyperparameters in force (changed over the run's control)",
            ["name"], registry=r,
        )  # fmt: skip


@dataclass
class StepCounts:
    updates: int = 0
    """Update attempts (skipped non-finite steps included)."""
    ref_resets: int = 0


def token_staleness_mean(batch: SampledBatch) -> float:
    """Mean policy-version lag per response token: an answer that spanned an in-flight weight
    update has tokens of several versions (``Trajectory.version_spans``). The policy's version
    is a record's staleness plus its ``policy_version``."""
    at = batch.staleness + np.array([t.policy_version for t in batch], dtype=np.int64)
    total = count = 0  # (whole numbers: the mean is the same float as numpy's of every lag)
    for t, v in zip(batch, at.tolist(), strict=True):
        n = t.response_ids.size
        if t.version_spans.size:  # (an answer across weight updates: a lag per token)
            total += int((v - t.token_versions()).sum())
        else:
            total += (v - t.policy_version) * n
        count += n
    return total / count if count else 0.0


class UpdateStep:
    """The update of every way of running a learner. ``buffer`` and ``metrics`` on the rank
    that draws the batches (rank 0), None elsewhere; ``reduce``/``gather`` with several ranks."""

    def __init__(
        self,
        learner: Learner,
        cfg: RunConfig,
        buffer: ReplayConsumer | None,
        metrics: UpdateMetrics | None = None,
        reduce: Reduce | None = None,
        gather: Gather | None = None,
    ) -> None:
        self.learner = learner
        self.cfg = cfg
        self.buffer = buffer
        self.metrics = metrics
        self.reduce = reduce
        self.gather = gather
        self.counts = StepCounts()
        self.applied = LiveHParams(
            beta=cfg.algo.beta,
            lr=cfg.learner.lr,
            samples_per_insert=cfg.samples_per_insert,
            ref_reset_steps=cfg.learner.ref_reset_steps,
            max_staleness=cfg.buffer.max_staleness,
        )
        if metrics is not None:
            for name, value in self.applied.set_fields().items():
                metrics.hparam.labels(name=name).set(float(value))

    def state_dict(self) -> dict[str, int]:
        """The step's counters, for a checkpoint."""
        return {"updates": self.counts.updates, "ref_resets": self.counts.ref_resets}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.counts.updates = int(state["updates"])
        self.counts.ref_resets = int(state["ref_resets"])

    @property
    def reset_every(self) -> int:
        """Updates between reference resets (0: never)."""
        return (self.applied.ref_reset_steps or 0) * self.cfg.learner.updates_per_round

    def __call__(
        self,
        share: Sequence[Trajectory],
        weights: Sequence[float] | None = None,
        batch: SampledBatch | None = None,
    ) -> dict[str, Any]:
        """Update on this rank's ``share`` (every rank calls it together); ``weights``: the
        share's importance weights (prioritized replay); ``batch``: the whole batch as drawn
        (rank 0). Returns the update's record (complete on rank 0)."""
        t0 = time.perf_counter()
        prioritized = self.cfg.buffer.prioritized
        out = self.learner.update(share, weights if prioritized else None)
        self._write_back(share, out.delta.tolist(), batch)
        self.counts.updates += 1
        if self.reset_every and self.counts.updates % self.reset_every == 0:
            self.learner.reset_reference()
            self.counts.ref_resets += 1
        return self._record(out.metrics, share, batch, time.perf_counter() - t0)

    def _write_back(
        self, share: Sequence[Trajectory], deltas: list[float], batch: SampledBatch | None
    ) -> None:
        """The cached reference quantities (and priorities) of the whole batch, by rank 0."""
        if not (self.learner.uses_reference or self.cfg.buffer.prioritized):
            return  # (GRPO: nothing to write back, no gather)
        mine = [
            (t.traj_id, t.ref_version, t.ref_logprob_sum, t.ref_value, d)
            for t, d in zip(share, deltas, strict=True)
        ]
        parts = self.gather(mine) if self.gather is not None else [mine]
        if self.buffer is None or parts is None:
            return
        held = {t.traj_id: t for t in (batch if batch is not None else share)}
        done: list[Trajectory] = []
        ids: list[str] = []
        res: list[float] = []
        for part in parts:
            for tid, ref_version, slp, v1, delta in part:
                t = held.get(tid)
                if t is None:
                    continue
                t.ref_version, t.ref_logprob_sum, t.ref_value = ref_version, slp, v1
                done.append(t)
                ids.append(tid)
                res.append(delta)
        with skip_when_stopping():  # (a stop during an outage: not written, the ranks go on)
            if self.learner.uses_reference:
                self.buffer.write_back(done)
            if self.cfg.buffer.prioritized:
                self.buffer.update_priorities(ids, res)

    def _mean(self, values: Sequence[float]) -> float:
        """The batch mean of per-trajectory values from every rank's share."""
        total, n = float(sum(values)), float(len(values))
        if self.reduce is not None:
            total, n = self.reduce(total, "sum"), self.reduce(n, "sum")
        return total / max(n, 1.0)

    def _record(
        self,
        metrics: dict[str, float],
        share: Sequence[Trajectory],
        batch: SampledBatch | None,
        update_s: float,
    ) -> dict[str, Any]:
        loss = metrics["loss"]
        terms = {k: float(metrics[k]) for k in _TERMS if k in metrics}
        if self.reduce is not None:
            world = self.reduce(1.0, "sum")
            loss = self.reduce(loss, "sum") / world  # (each rank's loss is its part x world)
            n = len(share)
            weight = self.reduce(float(n), "sum")
            terms = {k: self.reduce(v * n, "sum") / weight for k, v in terms.items()}
        reward = self._mean([t.reward_raw for t in share])
        success = self._mean([float(t.reward_raw > 0) for t in share])
        learner = self.learner
        record: dict[str, Any] = {
            "update": self.counts.updates,
            "policy_version": learner.step,
            "loss": loss,
            "grad_norm": metrics["grad_norm"],
            "skipped": bool(metrics["skipped"]),
            "batch_reward_mean": reward,
            "batch_success_rate": success,
            "ref_version": learner.reference.version,
            "update_s": update_s,
            "beta": learner.algo.beta,
            "lr": learner.optimizer.param_groups[0]["lr"],
            **terms,
            **{k: v for k, v in metrics.items() if k not in _RECORDED and k not in terms},
        }
        if batch is not None:
            sizes = Tally(Tally(t.group_id for t in batch).values())
            record["batch_size"] = len(batch)
            record["staleness_mean"] = float(batch.staleness.mean()) if len(batch) else 0.0
            record["token_staleness_mean"] = token_staleness_mean(batch)
            record["group_sizes"] = {str(k): v for k, v in sorted(sizes.items())}
            record["use_count_mean"] = sum(t.use_count for t in batch) / max(len(batch), 1)
            record["fresh"] = int(batch.fresh)
        m = self.metrics
        if m is not None:
            m.loss.set(loss)
            m.grad_norm.set(metrics["grad_norm"])
            (m.skipped if metrics["skipped"] else m.updates).inc()
            m.version.set(learner.step)
            m.reward.set(reward)
            m.success.set(success)
            m.step_s.observe(update_s)
            m.ref_version.set(learner.reference.version)
            if "staleness_mean" in record:
                m.staleness.set(record["staleness_mean"])
            for gauge, key in ((m.delta, "delta_abs_mean"), (m.v1, "v1_mean"),
                               (m.v1_ref, "v1_ref_mean"), (m.kl, "log_ratio_mean")):  # fmt: skip
                if key in terms:
                    gauge.set(terms[key])
        return record

    # -- live hyperparameters ------------------------------------------------------------------

    def apply(self, changes: LiveHParams) -> dict[str, Any]:
        """Apply the learner's live hyperparameters (every rank, before the same update); returns
        what changed."""
        if changes.beta is not None:
            self.learner.algo.beta = float(changes.beta)
        if changes.lr is not None:
            for group in self.learner.optimizer.param_groups:
                group["lr"] = float(changes.lr)
        if self.buffer is not None:
            if changes.samples_per_insert is not None:
                self.buffer.sampling.samples_per_insert = float(changes.samples_per_insert)
            if changes.max_staleness is not None:
                value = int(changes.max_staleness)
                self.buffer.sampling.max_staleness = None if value < 0 else value
        self.applied = self.applied.merged(changes)
        done = changes.set_fields()
        if self.metrics is not None:
            for name, value in done.items():
                self.metrics.hparam.labels(name=name).set(float(value))
        return done
