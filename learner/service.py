"""``reval learner``: the learner half of the actor-learner service: ranks + the replay service
+ the one update step (``learner/step.py``, the same as ``reval train``'s).

One process per rank under torch.distributed (gloo on CPU, NCCL on GPU; the same code; how the
ranks are started and stopped: ``learner/ranks.py``), the
policy and the frozen reference sharded with FSDP2 (``fully_shard`` per decoder layer, then the
root). Rank 0 draws the batches from the replay service by the algorithm's rule
(``learner/batches.py``: fresh then replayed under the sample-to-insert limiter for the value
losses, whole groups once for GRPO), prefetching the next while an update runs, and hands each
rank its share (whole groups for GRPO); every rank updates on its share (FSDP averages the
gradients) and rank 0 writes back the batch's cached reference quantities and priorities. After
every ``sync.every`` updates every rank sends the weights (``reval/weights/sender.py``: gathered
in the compute dtype on the devices, broadcast from rank 0's device, the file written in the
background). Checkpoints (``learner/checkpoint.py``, DCP) every
``learner.checkpoint_every`` updates or ``learner.checkpoint_every_s`` seconds, whichever comes
first, the newest ``learner.keep_checkpoints`` kept, and on every stop: SIGTERM or Ctrl-C finish
the update in hand, checkpoint, log one line and exit 143 or 130. ``--resume`` continues with
the same step, policy version, reference and optimizer state (the buffer is in Redis: nothing
generated is lost); the first line of a start says from which step and checkpoint it resumed,
or why it starts at step 0. A consolidated Hugging Face checkpoint is exported at the end, on
SIGUSR1 while it runs (``run_dir/exports/step-N``), and from the latest checkpoint with
``reval learner --export``.
What the run needs before its first update (the tiny model's pretraining, the one-shot task's
calibration) is done above, by ``services/setup.py``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import redis
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from buffer import make_consumer
from buffer.base import BufferUnavailable, SampledBatch, SampleTimeout
from buffer.metrics import BufferMetrics
from buffer.prefetch import Prefetcher
from buffer.records import RecordLimits, Trajectory
from buffer.redis_layout import RingCorrupt
from learner.batches import BatchSource, context_limits, draw_within, split_shares
from learner.checkpoint import Checkpointer, latest_checkpoint
from learner.export import export_hf
from learner.parallel import build_models, rank_device, reduce_scalar
from learner.reporting import LearnerMetrics, LearnerReporting
from learner.step import UpdateStep
from learner.trainer import Learner, UpdateMemoryError
from reval import lora
from reval.config import RunConfig, dump_config, public_dump
from reval.control import (
    LiveHParams,
    RunControl,
    RunLease,
    adopt_run,
)
from reval.metrics import JsonlWriter
from reval.policy import compute_dtype, load_policy
from reval.redis import connect
from reval.retry import cut_short, skip_when_stopping, stop_waiting
from reval.threads import tick as thread_tick
from reval.trackers import build_trackers
from reval.weights.sender import build_sender

log = logging.getLogger("reval.learner")

STOP_POLL_S = 5.0
"""Rank 0 waits for a batch in turns of at most this long (the other ranks wait in a collective
meanwhile); the run's control (a REST stop or pause) is read between turns, its stop flag (a
SIGTERM, Ctrl-C) within them (``learner/batches.py: draw_within``)."""

MAX_FAILED_BATCHES = 3
"""Updates in a row that may raise on their batch (each batch quarantined) before the learner
gives up: beyond that the fault is the learner's, not the data's."""


@dataclass
class LearnerState:
    step: int = 0
    """Optimizer steps taken = the policy version of the weights."""
    updates: int = 0
    """Update attempts (skipped non-finite steps included)."""
    ref_version: int = 0
    ref_resets: int = 0
    stopped_by: int = 0
    """The signal that stopped the learner (SIGTERM, SIGINT; 0: it finished, or was stopped
    otherwise): its ranks and ``reval learner`` exit with 128 + it."""


@dataclass
class Pending:
    """What the run's control keys ask of the learner before its next update, as rank 0 read
    them (``LearnerService._control``; broadcast so that every rank does the same)."""

    stop: bool = False
    """Checkpoint and stop (phase ``stopping``)."""
    pause: bool = False
    """Wait, taking no batch (phase ``paused``)."""
    checkpoint: bool = False
    """A checkpoint now (a new ``checkpoint`` request)."""
    export: bool = False
    """A Hugging Face export now (a new ``export`` request)."""
    hparams: LiveHParams | None = None
    """Live hyperparameters to apply before this update (only those that change)."""


def _gather(obj: Any) -> list[Any] | None:
    out: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out


class LearnerService(LearnerReporting):
    """One rank of the learner: the policy and reference sharded over the ranks, rank 0 drawing
    the batches (``learner/batches.py``) from the replay service and publishing the weights,
    every rank running the one update step (``learner/step.py``) on its share; what it reports
    (metrics, log rows, progress lines, the run's status) is ``LearnerReporting``'s
    (``learner/reporting.py``)."""

    def __init__(self, cfg: RunConfig, resume: bool = False, trackers: bool = True) -> None:
        self.cfg = cfg
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        b = cfg.batch_size
        if b % self.world and not cfg.algo.on_policy:
            raise ValueError(f"learner.batch_size ({b}) must divide by world_size ({self.world})")
        self.device = rank_device(os.environ, torch.cuda.device_count(), cfg.model.device)
        self.run_dir = cfg.run_dir
        self.ckpt_dir = cfg.paths.checkpoints
        self.metrics = LearnerMetrics()
        self.started = time.time()
        self.stop = threading.Event()
        self.stop_signal = 0
        """The signal that asked for the stop (``request_stop``; 0: none)."""
        self.export_now = threading.Event()
        """Set (SIGUSR1, ``reval launch --export``): export an HF checkpoint before the next
        update, into ``run_dir/exports/step-N``."""
        self.tokenizer, self.model, self.reference_model = build_models(cfg, self.device)
        # Token ids index the embedding (and the logits' last dimension): a record with an id
        # past it would raise inside the update, so the ring quarantines it on read.
        self.vocab_size = int(self.model.config.vocab_size)
        self.buffer_metrics = (
            BufferMetrics(self.metrics.registry, role="consumer") if self.rank == 0 else None
        )
        self._build_update(cfg)
        self.client = connect(cfg.redis.url)
        self.writer = JsonlWriter(cfg.paths.learner_log) if self.rank == 0 else None
        # (``trackers=False``: an export of the latest checkpoint logs nothing)
        self.trackers = (
            build_trackers(cfg, cfg.run_dir, resume) if self.rank == 0 and trackers else None
        )
        # The one weight sender (every rank gathers; rank 0 broadcasts, writes and announces).
        self.sender = build_sender(cfg, self.client if self.rank == 0 else None, self.rank,
                                   self.device, compute_dtype(cfg.model))  # fmt: skip
        self.broadcast_to = 0
        self._files_counted = (0, 0)
        self.saved_step = -1
        self.saved_at = time.monotonic()
        """When the last checkpoint was written (or this learner started): the clock of
        ``learner.checkpoint_every_s``."""
        self.last_checkpoint: Path | None = None
        self.control = RunControl(self.client, cfg.redis.prefix, cfg.name)
        self.seen = {"checkpoint": 0, "export": 0}
        if self.rank == 0:
            self._register(resume)
        self.lease: RunLease | None = None
        """The run's one-learner lease (rank 0, set by ``run_rank``)."""
        self.paused = False
        self.failed_in_a_row = 0
        """Updates in a row that raised on their batch (``_quarantine_batch``)."""
        self.published = False
        self.last_tick = time.monotonic()
        self.last_staleness = 0.0
        self._window = [time.monotonic(), 0, 0, 0.0]
        """Since the last progress line (``_progress``): its time, updates, trajectories and
        seconds waited for data."""
        if resume:
            self.load_checkpoint()
        elif self.rank == 0:
            log.info("%s", self._fresh_start())

    # -- building ------------------------------------------------------------------------------

    def _build_update(self, cfg: RunConfig) -> None:
        """What an update needs: the ring it samples (rank 0 draws the batches), the batch
        source, the learner, the one update step, the checkpointer of all their state."""
        multi = self.world > 1
        self.ring = make_consumer(
            cfg.buffer,
            cfg.name,
            seed=cfg.seed * 7919 + self.rank,
            metrics=self.buffer_metrics,
            samples_per_insert=cfg.samples_per_insert,
            limits=RecordLimits(self.vocab_size, cfg.buffer.reward_bound),
            redis=cfg.redis,
        )
        self.source = BatchSource.from_config(self.ring, cfg)
        self.learner = Learner(
            self.model,
            cfg.learner,
            cfg.algo,
            int(self.tokenizer.pad_token_id),
            int(self.tokenizer.eos_token_id),
            self.device,
            reference_model=self.reference_model,
            reduce=reduce_scalar if multi else None,
            compute_dtype=compute_dtype(cfg.model),
        )
        self.update_step = UpdateStep(
            self.learner,
            cfg,
            self.ring if self.rank == 0 else None,
            self.metrics.update if self.rank == 0 else None,
            reduce=reduce_scalar if multi else None,
            gather=_gather if multi else None,
        )
        self.checkpointer = Checkpointer(
            self.ckpt_dir, self.model, self.reference_model, self.learner.optimizer,
            [self.learner, self.update_step, self.source], cfg.learner.keep_checkpoints,
        )  # fmt: skip

    def _register(self, resume: bool) -> None:
        """Requests made before this learner started are not replayed; the run is registered
        for the REST API."""
        cfg = self.cfg
        with contextlib.suppress(redis.ConnectionError, redis.TimeoutError):
            st = self.control.read()
            self.seen = {"checkpoint": st.checkpoint, "export": st.export}
            self.control.clear_stale_stop(self.started)  # (a stop of an earlier start)
            self.control.record("learner_started", {"resume": resume})
            if adopt_run(self.client, cfg.redis.prefix, cfg.name, public_dump(cfg)):
                log.info("run %s registered for the REST API", cfg.name)

    @property
    def state(self) -> LearnerState:
        return LearnerState(
            step=self.learner.step,
            updates=self.update_step.counts.updates,
            ref_version=self.learner.reference.version,
            ref_resets=self.update_step.counts.ref_resets,
            stopped_by=self.stop_signal,
        )

    # -- checkpoints -------------------------------------------------------------------------

    def save_checkpoint(self, quiet: bool = False) -> Path:
        """A checkpoint now (every rank); ``quiet``: the caller's own line names it."""
        path = self.checkpointer.save()
        self.saved_step = self.learner.step
        self.saved_at = time.monotonic()
        self.last_checkpoint = path
        if not quiet and self.rank == 0:
            log.info("checkpoint %s", path)
        return path

    def load_checkpoint(self) -> None:
        """The latest checkpoint into every part; rank 0 says from which step and checkpoint
        the run resumed (one line)."""
        if not self.cfg.paths.has_checkpoint():
            raise FileNotFoundError(f"--resume: no checkpoint under {self.ckpt_dir}")
        path, _meta = self.checkpointer.load()
        self.saved_step = self.learner.step
        self.last_checkpoint = path
        if self.rank == 0:
            log.info("resumed at step %d from checkpoint %s", self.learner.step, path)

    def _fresh_start(self) -> str:
        """The line of a learner that does not resume: why it starts at step 0."""
        latest = latest_checkpoint(self.ckpt_dir)
        if latest is None:
            return f"starting at step 0: no checkpoint under {self.ckpt_dir}"
        return (
            f"starting over at step 0 although {latest} exists: neither --resume nor "
            "--resume-if-any was given (this run's checkpoints replace the old ones: "
            "learner.keep_checkpoints)"
        )

    def request_stop(self, signum: int = 0) -> None:
        """Checkpoint and stop after the update in hand (every rank agrees before the next);
        ``signum``: the signal that asked, which the exit status then carries. A wait for Redis
        in hand (an outage ridden out for ``redis.outage_s``) ends at once (``stop_waiting``):
        the checkpoint needs no Redis, and ``docker stop`` kills a learner after its grace."""
        self.stop_signal = self.stop_signal or signum
        self.stop.set()
        stop_waiting()

    def full_state(self) -> dict[str, torch.Tensor]:
        """Full weights on rank 0 (every rank must call this; others get {})."""
        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        sd = get_model_state_dict(self.model, options=opts)
        return sd if self.rank == 0 else {}

    # -- probes (/healthz, /readyz on rank 0) -----------------------------------------------

    def health(self) -> tuple[bool, str]:
        """Its loop goes round (an update, a wait for data or a pause poll)."""
        idle = time.monotonic() - self.last_tick
        c = self.cfg  # (a Redis outage is ridden out, not stuck: redis.outage_s)
        limit = max(
            900.0, 10 * c.sync.timeout_s, 2 * c.buffer.sample_timeout_s, c.redis.outage_s + 60
        )
        return idle < limit, f"last loop {idle:.0f} s ago"

    def ready(self) -> tuple[bool, str]:
        """It has published its first weights and reaches Redis."""
        if not self.published:
            return False, "starting (first weights not published yet)"
        self.client.ping()
        return True, f"step {self.learner.step}"

    # -- live control -------------------------------------------------------------------------

    def _control(self) -> Pending:
        """Rank 0 reads the run's control keys (``reval/control.py``) and every rank gets the
        same decisions: stop, pause, a checkpoint or an export now, hyperparameters to apply
        before this step (each applied change is recorded in the run's events with the step)."""
        todo = Pending()
        if self.rank == 0:
            try:
                st = self.control.read()
            except (redis.ConnectionError, redis.TimeoutError):
                st = None  # Redis away: carry on as before; the buffer retries on its own
            if st is not None:
                changes = st.hparams.learner_changes(self.update_step.applied)
                todo = Pending(
                    stop=st.phase == "stopping",
                    pause=st.phase == "paused",
                    checkpoint=st.checkpoint > self.seen["checkpoint"],
                    export=st.export > self.seen["export"],
                    hparams=changes if changes.set_fields() else None,
                )
                self.seen["checkpoint"], self.seen["export"] = st.checkpoint, st.export
                if todo.pause != self.paused:
                    with contextlib.suppress(redis.RedisError):
                        self.control.record("paused" if todo.pause else "resumed",
                                            step=self.learner.step)  # fmt: skip
        if self.world > 1:
            box = [todo]
            dist.broadcast_object_list(box, src=0)
            todo = box[0]
        self.paused = todo.pause
        if todo.hparams is not None:
            done = self.update_step.apply(todo.hparams)
            if self.rank == 0:
                log.info("step %d: applied %s", self.learner.step, done)
                with contextlib.suppress(redis.RedisError):  # (the change itself is made)
                    self.control.record("hparams_applied", done, step=self.learner.step)
        return todo

    def export_path(self) -> Path:
        return self.cfg.paths.export(self.learner.step)

    def export_hf(self, path: Path) -> Path | None:
        """A consolidated Hugging Face checkpoint (``learner/export.py``); every rank calls it
        (the weights are gathered), rank 0 writes."""
        sd = self.full_state()
        if self.rank != 0:
            dist.barrier()
            return None
        with torch.random.fork_rng():  # (the rank's own random state goes on untouched)
            model = load_policy(self.cfg.model.model_copy(update={"device": "cpu"}), 0).model
            if self.cfg.model.lora.enabled:  # (peft's names: merged and the adapter directory)
                model = lora.wrap(model, self.cfg.model.lora)  # type: ignore[assignment]
        model.load_state_dict(sd)
        export_hf(model, self.tokenizer, path)
        dist.barrier()
        log.info("exported a Hugging Face checkpoint to %s", path)
        return path

    def publish(self) -> None:
        """Send the weights as the policy version (every rank: they gather together)."""
        t0 = time.perf_counter()
        version = self.learner.step
        done = self.sender.send(self.model, version)
        if self.rank == 0:
            self.metrics.sync_bytes.inc(done.nbytes)
            self.broadcast_to = done.receivers
            with skip_when_stopping():
                self.ring.set_policy_version(version)
            self._file_metrics()
        self.published = True
        self.metrics.sync_s.inc(time.perf_counter() - t0)

    # -- the loop ------------------------------------------------------------------------------

    def _next_batch(
        self, prefetch: Prefetcher | None
    ) -> tuple[list[Trajectory], list[float], SampledBatch | None, float] | None:
        """Rank 0 draws the batch; every rank gets its share (and its importance weights).
        None when there was no batch within a poll."""
        payload: list[Any] = [None, None]
        batch: SampledBatch | None = None
        wait = 0.0
        if self.rank == 0:
            t0 = time.perf_counter()
            # Wait in short turns: the other ranks wait in a collective meanwhile, whose
            # timeout (sync.timeout_s) must not run out while the buffer is empty.
            poll = min(self.cfg.buffer.sample_timeout_s, self.cfg.sync.timeout_s / 4, STOP_POLL_S)
            try:
                draw = prefetch.get if prefetch else self.source.next
                batch = draw_within(draw, poll, self.stop)
                weights = dict(zip(batch.traj_ids, batch.weights.tolist(), strict=True))
                shares = split_shares(batch.trajectories, self.world, self.source.on_policy)
                payload = [[(s, [weights[t.traj_id] for t in s]) for s in shares], None]
            except SampleTimeout as err:
                payload = [None, str(err)]
            except Exception as err:
                if not cut_short(err):
                    raise
                payload = [None, "stopping"]  # (the wait for Redis, cut short: the loop stops)
            wait = time.perf_counter() - t0
        if self.world > 1:
            dist.broadcast_object_list(payload, src=0)
        if payload[0] is None:
            return None
        share, weights = payload[0][self.rank]
        return share, weights, batch, wait

    def run(self) -> LearnerState:
        cfg = self.cfg
        total = cfg.learner.max_steps or cfg.learner.rounds * cfg.learner.updates_per_round
        if self.rank == 0:
            dump_config(cfg, cfg.paths.config)
            # Longer than the context: quarantined on read.
            self.ring.limits = context_limits(self.ring.limits, self.model.config)
        self.publish()  # the workers wait for these before they generate
        prefetch = None
        if self.rank == 0 and cfg.learner.sample_prefetch:
            prefetch = Prefetcher(
                self.ring, cfg.batch_size, depth=cfg.learner.sample_prefetch, workers=1,
                draw=self.source.next,
            )  # fmt: skip
        t_start = time.perf_counter()
        waited_since = 0.0
        stopped = False
        try:
            while self.update_step.counts.updates < total:
                self.last_tick = time.monotonic()
                action = self._between_updates()
                if action == "stop":
                    stopped = True
                    break
                if action == "lost":
                    break
                if action == "pause":
                    time.sleep(0.2)
                    continue
                got = self._next_batch(prefetch)
                if got is None:
                    waited_since = waited_since or time.monotonic()
                    if time.monotonic() - waited_since > cfg.buffer.sample_timeout_s:
                        log.warning(
                            "no batch for %.0f s (no workers, or the limiter): waiting on",
                            time.monotonic() - waited_since,
                        )
                        waited_since = time.monotonic()
                    continue
                waited_since = 0.0
                share, weights, batch, wait = got
                self.metrics.wait_data.inc(wait)
                try:
                    record = self.update_step(share, weights, batch)
                except (BufferUnavailable, RingCorrupt, redis.RedisError, ConnectionError):
                    raise  # the replay service's fault, not the batch's
                except UpdateMemoryError as err:  # (raised by every rank together)
                    self._quarantine_batch(batch, err, every_rank=True)
                    continue
                except Exception as err:  # a batch the checks let through
                    self._quarantine_batch(batch, err)
                    continue
                self._after_update(record, wait, t_start)
        finally:
            if prefetch is not None:
                prefetch.close()
        if self.saved_step != self.learner.step:  # (not twice for one step)
            self.save_checkpoint(quiet=stopped)
        if stopped and self.rank == 0:
            why = signal.Signals(self.stop_signal).name if self.stop_signal else "a stop request"
            log.info(
                "stopped by %s at step %d: checkpoint %s (--resume or --resume-if-any "
                "continues from it)", why, self.learner.step, self.last_checkpoint,
            )  # fmt: skip
        finished = self.update_step.counts.updates >= total
        lost = self.lease is not None and self.lease.lost.is_set()
        if finished and not lost:
            self.export_hf(self.cfg.paths.final)
        if not lost:  # (the run's status is the learner's that took the lease over)
            self._status("done" if finished else "stopped")
        self.sender.close()
        if self.trackers is not None:  # (rank 0's)
            self.trackers.log_summary(dict(self.state.__dict__))
        self.close_trackers()
        return self.state

    def close_trackers(self) -> None:
        """Close the trackers (rank 0's), once: after the last rows, or on the way out of an
        error (``learner/ranks.py``), so that their last rows are written and their runs end."""
        trackers, self.trackers = self.trackers, None
        if trackers is not None:
            trackers.close()

    def _between_updates(self) -> Literal["go", "stop", "lost", "pause"]:
        """Every rank's requests and the run's control between two updates, agreed by all ranks
        (one all-reduce; any rank's request counts): an export, a checkpoint (asked for, or due
        by ``learner.checkpoint_every_s``) done here; what the loop does next returned."""
        every_s = self.cfg.learner.checkpoint_every_s
        lost = self.lease is not None and self.lease.lost.is_set()
        due = every_s > 0 and time.monotonic() - self.saved_at >= every_s
        flags = torch.tensor(
            [float(self.stop.is_set()), float(self.export_now.is_set()), float(lost),
             float(due), float(self.stop_signal)]
        )  # fmt: skip
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        stop, export, lost, due = (bool(flags[i].item()) for i in range(4))
        todo = self._control()  # the run's control keys, as rank 0 read them
        if export and not todo.export and self.rank == 0:
            # SIGUSR1 goes on the run's one control channel too (its events show it)
            with contextlib.suppress(redis.RedisError):
                self.seen["export"] = self.control.request("export")
        if export or todo.export:
            self.export_now.clear()
            self.export_hf(self.export_path())
        if todo.checkpoint:
            self.save_checkpoint()
        if stop or todo.stop:
            self.stop_signal = int(flags[4].item())  # (every rank: the same status)
            return "stop"
        if lost:
            log.error("the run's lease went to another learner: stopping, no checkpoint")
            self.saved_step = self.learner.step  # (that learner writes them now)
            return "lost"
        if due and self.saved_step != self.learner.step:
            self.save_checkpoint()  # learner.checkpoint_every_s since the last one
        if todo.pause:
            self._status("paused")
            return "pause"
        return "go"

    def _after_update(self, record: dict[str, Any], wait: float, t_start: float) -> None:
        """An update done: its time counted, the weights published every ``sync.every``
        updates, a checkpoint every ``learner.checkpoint_every``, its row logged (its
        ``elapsed_s`` since ``t_start``, the publish and checkpoint included)."""
        self.failed_in_a_row = 0
        self.metrics.update_s.inc(record["update_s"])
        thread_tick(record["update_s"], "update")  # (the thread tuner: reval/threads.py)
        updates = self.update_step.counts.updates
        if updates % self.cfg.sync.every == 0:
            self.publish()
        every = self.cfg.learner.checkpoint_every
        if every and updates % every == 0:
            self.save_checkpoint()
        self._log(record, wait, time.perf_counter() - t_start)

    def _quarantine_batch(
        self, batch: SampledBatch | None, err: Exception, every_rank: bool = False
    ) -> None:
        """An update that raised on a batch: the batch is quarantined whole (counted in the
        ring's ``rejected``, logged; rank 0 holds the batch) and training goes on with the next.
        Not with several ranks unless ``every_rank`` raised it together (an update out of
        memory, ``UpdateMemoryError``; otherwise the others are inside the update's
        collectives: the process group's timeout ends them), nor after ``MAX_FAILED_BATCHES``
        in a row (then the fault is the learner's, not the data's: it raises)."""
        self.failed_in_a_row += 1
        if (self.world > 1 and not every_rank) or self.failed_in_a_row > MAX_FAILED_BATCHES:
            raise err
        log.exception("update %d raised on its batch: quarantined", self.update_step.counts.updates)
        if batch is not None:
            ids = batch.traj_ids
            self.ring.quarantine(ids, f"the update raised {type(err).__name__}: {err}")
            with contextlib.suppress(redis.RedisError):
                self.control.record(
                    "batch_quarantined", {"records": len(ids), "error": repr(err)[:500]},
                    step=self.learner.step,
                )  # fmt: skip
