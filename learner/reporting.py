"""What the learner reports (rank 0): its Prometheus metrics beyond the updates'
(``LearnerMetrics``), the row of each update in ``learner.jsonl`` with the replay service's
counters and the live workers, the progress line every ``metrics.log_every`` updates, and the
run's status hash (``RunStatus``: what ``GET /v1/runs/{name}`` shows).

``LearnerReporting`` is the part of ``LearnerService`` (``learner/service.py``) that does it:
the service's class inherits it, and its methods read the service's state.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import redis
from prometheus_client import CollectorRegistry, Counter, Gauge

from learner.checkpoint import PARTIAL
from learner.step import UpdateMetrics
from reval import registry
from reval.control import RunControl, RunStatus
from reval.metrics import PREFIX, JsonlWriter
from reval.retry import skip_on_outage
from reval.trackers import Trackers

if TYPE_CHECKING:
    from buffer.base import ReplayConsumer
    from buffer.metrics import BufferMetrics
    from learner.step import UpdateStep
    from learner.trainer import Learner
    from reval.config import RunConfig
    from reval.weights.sender import WeightSender

log = logging.getLogger("reval.learner")


class LearnerMetrics:
    """The learner process's metrics beyond the updates' (``learner/step.py``)."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        p = f"{PREFIX}learner_"
        self.wait_data = Counter(f"{p}wait_data_seconds", "Time waiting for a batch", registry=r)
        self.update_s = Counter(f"{p}update_seconds", "Time in updates", registry=r)
        self.sync_s = Counter(f"{p}sync_seconds", "Time publishing weights", registry=r)
        self.workers = Gauge(f"{p}workers_alive", "Rollout workers registered", registry=r)
        self.paused = Gauge(f"{p}paused", "1 while the run is paused", registry=r)
        self.sync_bytes = Counter(f"{p}sync_bytes", "Weight bytes published", registry=r)
        self.file_version = Gauge(
            f"{p}weights_file_version", "Newest version written to a weights file", registry=r
        )
        self.files_skipped = Counter(
            f"{p}weights_files_skipped",
            "Versions without a file (the previous one was still being written)",
            registry=r,
        )
        self.file_errors = Counter(
            f"{p}weights_file_errors", "Weights files that could not be written", registry=r
        )
        self.update = UpdateMetrics(r)


class LearnerReporting:
    """The reports of one learner rank (rank 0 writes them; the others return at once). A part
    of ``LearnerService``: these are the service's attributes that its methods read."""

    cfg: RunConfig
    rank: int
    metrics: LearnerMetrics
    buffer_metrics: BufferMetrics | None
    ring: ReplayConsumer
    client: redis.Redis
    control: RunControl
    writer: JsonlWriter | None
    trackers: Trackers | None
    sender: WeightSender
    learner: Learner
    update_step: UpdateStep
    ckpt_dir: Path
    broadcast_to: int
    paused: bool
    _files_counted: tuple[int, int]
    _window: list[Any]

    if TYPE_CHECKING:

        @property
        def state(self) -> Any:  # a ``LearnerState`` (``learner/service.py`` imports this module)
            ...

    def _file_metrics(self) -> None:
        """The background file writer's counts, as of now (rank 0)."""
        files, m = self.sender.files, self.metrics
        if files is None:
            return
        skipped, errors = files.skipped, files.errors
        m.files_skipped.inc(skipped - self._files_counted[0])
        m.file_errors.inc(errors - self._files_counted[1])
        self._files_counted = (skipped, errors)
        if files.last_written is not None:
            m.file_version.set(files.last_written)

    def _log(self, record: dict[str, Any], wait: float, elapsed: float) -> None:
        if self.rank != 0:
            return
        alive: int | None = None  # (Redis away or refusing: not known; the outage is logged)
        with skip_on_outage("learner: the workers' registry"):
            alive = registry.count_alive(
                self.client, self.cfg.redis.prefix, self.cfg.name, self.cfg.rollout.heartbeat_s
            )
            self.metrics.workers.set(alive)
        try:
            ring = self.ring.stats()
            counters = {
                "buffer_inserted": ring.inserted,
                "buffer_sampled": ring.sampled,
                "buffer_evicted": ring.evicted,
                "buffer_evicted_unused": ring.evicted_unused,
                "buffer_reuse": ring.reuse,
            }
            if self.buffer_metrics is not None:
                self.buffer_metrics.observe_stats(ring)
        except (redis.ConnectionError, redis.TimeoutError, ConnectionError):
            counters = {}
        record = {
            **record,
            **counters,
            "wait_data_s": wait,
            "elapsed_s": elapsed,
            "workers": alive,
            "broadcast_to": self.broadcast_to,
        }
        if self.writer is not None:
            self.writer.write(record)
        if self.trackers is not None:
            self.trackers.log_row(int(record.get("policy_version", self.learner.step)), record)
        self._progress(record, wait)
        self._status("paused" if self.paused else "running", record)

    def _progress(self, record: dict[str, Any], wait: float) -> None:
        """Rank 0's line every ``metrics.log_every`` updates (every update with ``reval learner
        --verbose``): step, loss, batch reward, the wait for data and the throughput since the
        last line."""
        w = self._window
        w[1], w[2], w[3] = w[1] + 1, w[2] + int(record.get("batch_size", 0)), w[3] + wait
        every = self.cfg.metrics.log_every
        if not every or self.update_step.counts.updates % every:
            return
        took = max(time.monotonic() - w[0], 1e-9)
        log.info(
            "step %d (update %d): loss %.4g, reward %.3f, waited %.1f s for data, "
            "%.2f updates/s, %.1f trajectories/s",
            self.learner.step, self.update_step.counts.updates, record["loss"],
            record["batch_reward_mean"], w[3], w[1] / took, w[2] / took,
        )  # fmt: skip
        self._window = [time.monotonic(), 0, 0, 0.0]

    def _status(self, phase: str, last: dict[str, Any] | None = None) -> None:
        """The run's status hash (rank 0): what ``GET /v1/runs/{name}`` shows."""
        if self.rank != 0:
            return
        self.metrics.paused.set(1 if phase == "paused" else 0)
        st = self.state
        status = RunStatus(
            phase=phase,
            step=st.step,
            updates=st.updates,
            policy_version=st.step,
            hparams=self.update_step.applied.set_fields(),
            checkpoints=sorted(
                p.name for p in self.ckpt_dir.glob("step-*") if not p.name.endswith(PARTIAL)
            )[-5:],
        )
        if last is not None:
            status.last = last
        with skip_on_outage("learner: the run status"):  # (Redis away: the next one)
            self.control.publish_status(status)
