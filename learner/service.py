"""``reval learner``: the learner half of the actor-learner service.

One process per rank under torch.distributed (gloo on CPU, NCCL on GPU; the same code), the
policy and the frozen reference sharded with FSDP2 (``fully_shard`` per decoder layer, then the
root). Rank 0 samples batches from the replay service (under its sample-to-insert limiter,
prefetching the next batch while an update runs) and hands each rank an equal share; every rank
updates on its share (FSDP averages the gradients), writes back its share's cached reference
quantities and priorities. After every ``sync.every`` updates the full weights are gathered on
rank 0, written and announced to the rollout workers (``reval/weight_sync.py``). Checkpoints with
torch distributed checkpoint every ``learner.checkpoint_every`` updates and on SIGTERM;
``--resume`` continues with the same step, policy version, reference and optimizer state (the
buffer is in Redis: nothing generated is lost). A consolidated Hugging Face checkpoint is
exported at the end, on SIGUSR1 while it runs (``run_dir/exports/step-N``), and from the
latest checkpoint with ``reval learner --export``.
"""

from __future__ import annotations

import contextlib
import copy
import datetime as dt
import json
import logging
import os
import random
import signal
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import redis
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from buffer import make_buffer
from buffer.base import SampleTimeout
from buffer.metrics import BufferMetrics
from buffer.prefetch import Prefetcher
from buffer.records import Trajectory
from learner.trainer import Learner
from reval import registry
from reval.config import RunConfig, dump_config
from reval.control import HPARAMS, RunControl, adopt_run
from reval.metrics import PREFIX, JsonlWriter
from reval.policy import load_policy
from reval.weight_sync import WeightStore

log = logging.getLogger("reval.learner")


@dataclass
class LearnerState:
    step: int = 0
    """Optimizer steps taken = the policy version of the weights."""
    updates: int = 0
    """Update attempts (skipped non-finite steps included)."""
    ref_version: int = 0
    ref_resets: int = 0


class LearnerMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        p = f"{PREFIX}learner_"
        self.loss = Gauge(f"{p}loss", "Loss of the last update", registry=r)
        self.grad_norm = Gauge(f"{p}grad_norm", "Pre-clip grad norm of the last update", registry=r)
        self.updates = Counter(f"{p}updates", "Optimizer steps", registry=r)
        self.skipped = Counter(f"{p}skipped_steps", "Steps skipped (non-finite norm)", registry=r)
        self.version = Gauge(f"{PREFIX}policy_version", "Version of the policy", registry=r)
        self.wait_data = Counter(f"{p}wait_data_seconds", "Time waiting for a batch", registry=r)
        self.update_s = Counter(f"{p}update_seconds", "Time in updates", registry=r)
        self.sync_s = Counter(f"{p}sync_seconds", "Time publishing weights", registry=r)
        self.staleness = Gauge(f"{p}staleness_mean", "Mean lag of the last batch", registry=r)
        self.reward = Gauge(
            f"{p}batch_reward_mean", "Mean raw reward of the last batch", registry=r
        )
        self.workers = Gauge(f"{p}workers_alive", "Rollout workers registered", registry=r)
        self.hparam = Gauge(
            f"{p}hparam", "Live hyperparameters in force (changed over the run's control)",
            ["name"], registry=r,
        )  # fmt: skip
        self.paused = Gauge(f"{p}paused", "1 while the run is paused", registry=r)
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
        self.sync_bytes = Counter(f"{p}sync_bytes", "Weight bytes published", registry=r)
        self.ref_version = Gauge(f"{p}ref_version", "Version of the reference", registry=r)


def _shard(model: nn.Module, mesh: Any, reshard_root: bool = False) -> nn.Module:
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is not None:
        for layer in layers:
            fully_shard(layer, mesh=mesh)
    # The frozen reference only runs forward: free its root's gathered weights after each.
    fully_shard(model, mesh=mesh, reshard_after_forward=True if reshard_root else None)
    return model


def _reduce(x: float, op: str) -> float:
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    return float(t.item())


def split_shares(batch: Sequence[Trajectory], world: int) -> list[list[Trajectory]]:
    """Equal contiguous shares in group order (a group stays on one rank when ``n`` divides the
    share, which GRPO needs)."""
    ordered = sorted(batch, key=lambda t: t.group_id)
    size = len(ordered) // world
    return [list(ordered[r * size : (r + 1) * size]) for r in range(world)]


class LearnerService:
    def __init__(self, cfg: RunConfig, resume: bool = False) -> None:
        self.cfg = cfg
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        b = cfg.batch_size
        if b % self.world:
            raise ValueError(f"learner.batch_size ({b}) must divide by world_size ({self.world})")
        self.device = torch.device("cuda", self.rank % torch.cuda.device_count()) if (
            torch.cuda.is_available() and cfg.model.device != "cpu"
        ) else torch.device("cpu")  # fmt: skip
        self.run_dir = cfg.run_dir
        self.ckpt_dir = self.run_dir / "checkpoints"
        self.metrics = LearnerMetrics()
        self.started = time.time()
        self.stop = threading.Event()
        self.export_now = threading.Event()
        """Set (SIGUSR1, ``reval launch --export``): export an HF checkpoint before the next
        update, into ``run_dir/exports/step-N``."""
        self.state = LearnerState()
        self.last_staleness = 0.0
        bc = cfg.buffer
        self.ring = make_buffer(
            bc,
            cfg.name,
            seed=cfg.seed * 7919 + self.rank,
            metrics=BufferMetrics(self.metrics.registry) if self.rank == 0 else None,
        )
        self.client = redis.Redis.from_url(bc.redis_url, socket_timeout=30)
        self.weights = WeightStore(
            self.client,
            bc.key_prefix,
            cfg.name,
            cfg.sync.weights_dir or str(self.run_dir / "weights"),
        )
        # Identical initial weights on every rank: rank 0 builds (and pretrains the tiny model),
        # then broadcasts before sharding.
        torch.manual_seed(cfg.seed)
        policy = load_policy(cfg.model.model_copy(update={"device": "cpu"}), cfg.seed)
        self.tokenizer = policy.tokenizer
        if self.rank == 0 and cfg.model.pretrain_steps and not resume:
            from rollout.pretrain import pretrain
            from rollout.tasks import build_task

            task = build_task(cfg.task, cfg.seed, policy.tokenizer)
            m = cfg.model
            loss = pretrain(policy, task, m.pretrain_steps, m.pretrain_lr, m.pretrain_batch_size,
                            cfg.seed)  # fmt: skip
            log.info("pretrained the tiny model: loss %.3f", loss)
        if self.rank == 0:
            self._share_task_setup(policy, resume)
        for t in list(policy.model.parameters()) + list(policy.model.buffers()):
            dist.broadcast(t.data, src=0)
        model = policy.model.to(self.device)
        reference = copy.deepcopy(model)  # not a second load of the checkpoint
        reference.to(self.device).eval().requires_grad_(False)
        mesh = init_device_mesh(self.device.type, (self.world,))
        self.model = _shard(model, mesh)
        self.reference_model = _shard(reference, mesh, reshard_root=True)
        self.learner = Learner(
            self.model,
            cfg.learner,
            cfg.algo,
            policy.pad_id,
            policy.eos_id,
            self.device,
            reference_model=self.reference_model,
            reduce=_reduce if self.world > 1 else None,
        )
        self.writer = JsonlWriter(self.run_dir / "learner.jsonl") if self.rank == 0 else None
        self.hub: Any = None
        if self.rank == 0 and cfg.sync.broadcast:
            from reval.broadcast import BroadcastHub

            # One code path: NCCL groups from a GPU learner, gloo from a CPU one.
            hub_backend = "nccl" if self.device.type == "cuda" else "gloo"
            if cfg.sync.backend != "auto":
                hub_backend = cfg.sync.backend
            self.hub = BroadcastHub(
                cfg.sync.broadcast_port,
                timeout_s=cfg.sync.timeout_s,
                bucket_bytes=int(cfg.sync.bucket_mb * (1 << 20)),
                backend=hub_backend,
                device=self.device if hub_backend == "nccl" else "cpu",
            )
            log.info("broadcast hub (%s) on port %d", hub_backend, self.hub.port)
        self.broadcast_to = 0
        self.saved_step = -1
        self.control = RunControl(self.client, bc.key_prefix, cfg.name)
        self.seen = {"checkpoint": 0, "export": 0}
        if self.rank == 0:  # requests made before this learner started are not replayed
            with contextlib.suppress(redis.ConnectionError, redis.TimeoutError):
                st = self.control.read()
                self.seen = {"checkpoint": st.checkpoint, "export": st.export}
                self.control.clear_stale_stop(self.started)  # (a stop of an earlier start)
                self.control.record("learner_started", {"resume": resume})
                if adopt_run(self.client, bc.key_prefix, cfg.name, cfg.model_dump(mode="json")):
                    log.info("run %s registered for the REST API", cfg.name)
        self.paused = False
        self.published = False
        self.last_tick = time.monotonic()
        self.hparams: dict[str, Any] = {
            "beta": cfg.algo.beta,
            "lr": cfg.learner.lr,
            "samples_per_insert": bc.samples_per_insert,
            "ref_reset_steps": cfg.learner.ref_reset_steps,
            "max_staleness": bc.max_staleness,
        }
        self.reset_every = cfg.learner.ref_reset_steps * cfg.learner.updates_per_round
        if resume:
            self.load_checkpoint()

    def _share_task_setup(self, policy: Any, resume: bool) -> None:
        """Calibrate the one-shot task on the initial policy and share it with the workers
        (a resumed learner keeps the calibration the workers already use)."""
        from reval.registry import task_key
        from rollout.tasks import build_task, task_setup

        cfg = self.cfg
        if cfg.task.kind != "oneshot":
            return
        key = task_key(cfg.buffer.key_prefix, cfg.name)
        if resume and self.client.exists(key):
            return
        task = build_task(cfg.task, cfg.seed, policy.tokenizer)
        p = task.calibrate(policy)  # type: ignore[attr-defined]
        self.client.set(key, json.dumps(task_setup(task)))
        log.info("one-shot task calibrated: base success %.3f, shared with the workers", p)

    # -- checkpoints -------------------------------------------------------------------------

    def _state_dict(self) -> dict[str, Any]:
        return {
            "model": get_model_state_dict(self.model),
            "reference": get_model_state_dict(self.reference_model),
            "optim": get_optimizer_state_dict(self.model, self.learner.optimizer),
        }

    def save_checkpoint(self) -> Path:
        path = self.ckpt_dir / f"step-{self.state.step:08d}"
        dcp.save(self._state_dict(), checkpoint_id=str(path))
        if self.rank == 0:
            meta = {
                "step": self.state.step,
                "updates": self.state.updates,
                "ref_version": self.learner.reference.version,
                "ref_resets": self.state.ref_resets,
                "skipped_steps": self.learner.skipped_steps,
                "rng": random.getstate()[1][:4],
                "time": time.time(),
            }
            (path / "reval_state.json").write_text(json.dumps(meta))
            (self.ckpt_dir / "latest").write_text(path.name)
        dist.barrier()
        self.saved_step = self.state.step
        log.info("checkpoint %s", path)
        return path

    def load_checkpoint(self) -> None:
        latest = self.ckpt_dir / "latest"
        if not latest.is_file():
            raise FileNotFoundError(f"--resume: no checkpoint under {self.ckpt_dir}")
        path = self.ckpt_dir / latest.read_text().strip()
        sd = self._state_dict()
        dcp.load(sd, checkpoint_id=str(path))
        set_model_state_dict(self.model, sd["model"])
        set_model_state_dict(self.reference_model, sd["reference"])
        set_optimizer_state_dict(self.model, self.learner.optimizer, sd["optim"])
        meta = json.loads((path / "reval_state.json").read_text())
        self.state.step = self.learner.step = int(meta["step"])
        self.state.updates = int(meta["updates"])
        self.state.ref_resets = int(meta["ref_resets"])
        self.learner.reference.version = int(meta["ref_version"])
        self.learner.skipped_steps = int(meta["skipped_steps"])
        self.saved_step = self.state.step
        log.info("resumed from %s at step %d", path, self.state.step)

    def full_state(self) -> dict[str, torch.Tensor]:
        """Full weights on rank 0 (every rank must call this; others get {})."""
        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        sd = get_model_state_dict(self.model, options=opts)
        return sd if self.rank == 0 else {}

    # -- probes (/healthz, /readyz on rank 0) -----------------------------------------------

    def health(self) -> tuple[bool, str]:
        """Its loop goes round (an update, a wait for data or a pause poll)."""
        idle = time.monotonic() - self.last_tick
        limit = max(900.0, 10 * self.cfg.sync.timeout_s, 2 * self.cfg.buffer.sample_timeout_s)
        return idle < limit, f"last loop {idle:.0f} s ago"

    def ready(self) -> tuple[bool, str]:
        """It has published its first weights and reaches Redis."""
        if not self.published:
            return False, "starting (first weights not published yet)"
        self.client.ping()
        return True, f"step {self.state.step}"

    # -- live control -------------------------------------------------------------------------

    def _control(self) -> dict[str, Any]:
        """Rank 0 reads the run's control keys (``reval/control.py``) and every rank gets the
        same decisions: stop, pause, a checkpoint or an export now, hyperparameters to apply
        before this step (each applied change is recorded in the run's events with the step)."""
        todo: dict[str, Any] = {"stop": False, "pause": False, "checkpoint": False,
                                "export": False, "hparams": {}}  # fmt: skip
        if self.rank == 0:
            try:
                st = self.control.read()
            except (redis.ConnectionError, redis.TimeoutError):
                st = None  # Redis away: carry on as before; the buffer retries on its own
            if st is not None:
                todo["stop"] = st.phase == "stopping"
                todo["pause"] = st.phase == "paused"
                todo["checkpoint"] = st.checkpoint > self.seen["checkpoint"]
                todo["export"] = st.export > self.seen["export"]
                self.seen["checkpoint"], self.seen["export"] = st.checkpoint, st.export
                todo["hparams"] = {
                    k: v for k, v in st.hparams.items()
                    if HPARAMS[k][3] == "learner" and self.hparams.get(k) != v
                }  # fmt: skip
                if todo["pause"] != self.paused:
                    with contextlib.suppress(redis.RedisError):
                        self.control.record("paused" if todo["pause"] else "resumed",
                                            step=self.state.step)  # fmt: skip
        if self.world > 1:
            box = [todo]
            dist.broadcast_object_list(box, src=0)
            todo = box[0]
        self.paused = bool(todo["pause"])
        if todo["hparams"]:
            self._apply_hparams(todo["hparams"])
        return todo

    def _apply_hparams(self, values: dict[str, Any]) -> None:
        for name, value in values.items():
            if name == "beta":
                self.learner.algo.beta = float(value)
            elif name == "lr":
                for group in self.learner.optimizer.param_groups:
                    group["lr"] = float(value)
            elif name == "ref_reset_steps":
                self.reset_every = int(value) * self.cfg.learner.updates_per_round
            elif name == "samples_per_insert":
                self.ring.samples_per_insert = float(value)
            elif name == "max_staleness":
                self.ring.max_staleness = None if int(value) < 0 else int(value)
            self.hparams[name] = value
            self.metrics.hparam.labels(name=name).set(float(value))
        if self.rank == 0:
            log.info("step %d: applied %s", self.state.step, values)
            with contextlib.suppress(redis.RedisError):  # (the change itself is made)
                self.control.record("hparams_applied", values, step=self.state.step)

    def export_path(self) -> Path:
        return self.run_dir / "exports" / f"step-{self.state.step:08d}"

    def export_hf(self, path: Path) -> Path | None:
        """A consolidated Hugging Face checkpoint (safetensors + config + tokenizer); every
        rank calls it (the weights are gathered), rank 0 writes."""
        sd = self.full_state()
        if self.rank != 0:
            dist.barrier()
            return None
        model = load_policy(self.cfg.model.model_copy(update={"device": "cpu"}), 0).model
        model.load_state_dict(sd)
        path.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(path)
        self.tokenizer.save_pretrained(path)
        dist.barrier()
        log.info("exported a Hugging Face checkpoint to %s", path)
        return path

    def publish(self) -> None:
        t0 = time.perf_counter()
        sd = self.full_state()
        if self.rank == 0:
            where = None
            if self.hub is not None:
                where = f"{self.hub.backend}://{self.cfg.sync.broadcast_host}:{self.hub.port}"
            self.weights.publish(sd.items(), self.state.step, broadcast=where)
            self.metrics.sync_bytes.inc(sum(t.numel() * t.element_size() for t in sd.values()))
            if self.hub is not None:
                self.broadcast_to = self.hub.sync(sd.items(), self.state.step)
            self.ring.set_policy_version(self.state.step)
        self.published = True
        self.metrics.sync_s.inc(time.perf_counter() - t0)

    # -- the loop ------------------------------------------------------------------------------

    def _next_batch(self, prefetch: Prefetcher | None) -> tuple[list[Any], float]:
        """Rank 0 samples; every rank gets its share (and the importance weights)."""
        payload: list[Any] = [None]
        wait = 0.0
        if self.rank == 0:
            t0 = time.perf_counter()
            # Wait in short turns: the other ranks wait in a collective meanwhile, whose
            # timeout (sync.timeout_s) must not run out while the buffer is empty.
            poll = min(self.cfg.buffer.sample_timeout_s, self.cfg.sync.timeout_s / 4)
            try:
                if prefetch is not None:
                    batch = prefetch.get(timeout=poll)
                else:
                    batch = self.ring.sample(self.cfg.batch_size, timeout=poll)
                weights = dict(zip(batch.traj_ids, batch.weights.tolist(), strict=True))
                shares = split_shares(batch.trajectories, self.world)
                payload = [
                    [(share, [weights[t.traj_id] for t in share]) for share in shares],
                    float(np.mean(batch.staleness)) if len(batch) else 0.0,
                ]
                self.last_staleness = payload[1]
            except SampleTimeout as err:
                payload = [None, str(err)]
            wait = time.perf_counter() - t0
        else:
            payload = [None, None]
        dist.broadcast_object_list(payload, src=0)
        if payload[0] is None:
            return [], -1.0
        share, weights = payload[0][self.rank]
        self.metrics.staleness.set(payload[1])
        self.last_staleness = payload[1]
        return [share, weights], wait

    def run(self) -> LearnerState:
        cfg = self.cfg
        total = cfg.learner.max_steps or cfg.learner.rounds * cfg.learner.updates_per_round
        self.reset_every = cfg.learner.ref_reset_steps * cfg.learner.updates_per_round
        if self.rank == 0:
            dump_config(cfg, self.run_dir / "config.json")
        self.publish()  # the workers wait for these before they generate
        prefetch = None
        if self.rank == 0 and cfg.learner.sample_prefetch:
            prefetch = Prefetcher(
                self.ring, cfg.batch_size, depth=cfg.learner.sample_prefetch, workers=1
            )
        t_start = time.perf_counter()
        waited_since = 0.0
        try:
            while self.state.updates < total:
                self.last_tick = time.monotonic()
                flags = torch.tensor([float(self.stop.is_set()), float(self.export_now.is_set())])
                dist.all_reduce(flags, op=dist.ReduceOp.MAX)  # any rank's request counts
                todo = self._control()  # the run's control keys, as rank 0 read them
                if flags[1].item() or todo["export"]:
                    self.export_now.clear()
                    self.export_hf(self.export_path())
                if todo["checkpoint"]:
                    self.save_checkpoint()
                if flags[0].item() or todo["stop"]:
                    log.info("stopping: checkpoint at step %d", self.state.step)
                    break
                if todo["pause"]:
                    self._status("paused")
                    time.sleep(0.2)
                    continue
                got, wait = self._next_batch(prefetch)
                self.metrics.wait_data.inc(max(wait, 0.0))
                if not got:
                    waited_since = waited_since or time.monotonic()
                    if time.monotonic() - waited_since > cfg.buffer.sample_timeout_s:
                        log.warning(
                            "no batch for %.0f s (no workers, or the limiter): waiting on",
                            time.monotonic() - waited_since,
                        )
                        waited_since = time.monotonic()
                    continue
                waited_since = 0.0
                share, weights = got
                t0 = time.perf_counter()
                use_w = weights if cfg.buffer.prioritized else None
                out = self.learner.update(share, use_w)
                self.ring.write_back(share)
                if cfg.buffer.prioritized:
                    self.ring.update_priorities(
                        [t.traj_id for t in share], out.delta.abs().tolist()
                    )
                self.state.updates += 1
                self.state.step = self.learner.step
                upd_s = time.perf_counter() - t0
                self.metrics.update_s.inc(upd_s)
                if self.reset_every and self.state.updates % self.reset_every == 0:
                    self.learner.reset_reference()
                    self.state.ref_resets += 1
                if self.state.updates % cfg.sync.every == 0:
                    self.publish()
                if cfg.learner.checkpoint_every and (
                    self.state.updates % cfg.learner.checkpoint_every == 0
                ):
                    self.save_checkpoint()
                self._log(out.metrics, share, wait, upd_s, time.perf_counter() - t_start)
        finally:
            if prefetch is not None:
                prefetch.close()
        if self.saved_step != self.state.step:  # (not twice for one step)
            self.save_checkpoint()
        if self.state.updates >= total:
            self.export_hf(self.run_dir / "final")
        self._status("done" if self.state.updates >= total else "stopped")
        return self.state

    def _log(
        self,
        metrics: dict[str, float],
        share: list[Trajectory],
        wait: float,
        upd_s: float,
        elapsed: float,
    ) -> None:
        loss = _reduce(metrics["loss"], "sum") / self.world if self.world > 1 else metrics["loss"]
        reward = float(np.mean([t.reward_raw for t in share])) if share else 0.0
        success = float(np.mean([t.reward_raw > 0 for t in share])) if share else 0.0
        keys = ("delta_abs_mean", "v1_mean", "v1_ref_mean", "log_ratio_mean")
        terms = {k: float(metrics[k]) for k in keys if k in metrics}  # (the same on every rank)
        if self.world > 1:
            reward = _reduce(reward, "sum") / self.world
            success = _reduce(success, "sum") / self.world
            terms = {k: _reduce(v, "sum") / self.world for k, v in terms.items()}
        if self.rank != 0:
            return
        m = self.metrics
        m.loss.set(loss)
        m.grad_norm.set(metrics["grad_norm"])
        m.updates.inc(0 if metrics["skipped"] else 1)
        m.skipped.inc(1 if metrics["skipped"] else 0)
        m.version.set(self.state.step)
        m.reward.set(reward)
        m.success.set(success)
        m.step_s.observe(upd_s)
        m.ref_version.set(self.learner.reference.version)
        for gauge, key in ((m.delta, "delta_abs_mean"), (m.v1, "v1_mean"),
                           (m.v1_ref, "v1_ref_mean"), (m.kl, "log_ratio_mean")):  # fmt: skip
            if key in terms:
                gauge.set(terms[key])
        alive = registry.count_alive(
            self.client, self.cfg.buffer.key_prefix, self.cfg.name, self.cfg.rollout.heartbeat_s
        )
        m.workers.set(alive)
        record = {
            "update": self.state.updates,
            "policy_version": self.state.step,
            "loss": loss,
            "grad_norm": metrics["grad_norm"],
            "batch_reward_mean": reward,
            "staleness_mean": self.last_staleness,
            "ref_version": self.learner.reference.version,
            "wait_data_s": wait,
            "update_s": upd_s,
            "elapsed_s": elapsed,
            "workers": alive,
            "broadcast_to": self.broadcast_to,
            "beta": self.learner.algo.beta,
            "lr": self.learner.optimizer.param_groups[0]["lr"],
        }
        if self.writer is not None:
            self.writer.write(record)
        self._status("paused" if self.paused else "running", record)

    def _status(self, phase: str, last: dict[str, Any] | None = None) -> None:
        """The run's status hash (rank 0): what ``GET /v1/runs/{name}`` shows."""
        if self.rank != 0:
            return
        self.metrics.paused.set(1 if phase == "paused" else 0)
        status: dict[str, Any] = {
            "phase": phase,
            "step": self.state.step,
            "updates": self.state.updates,
            "policy_version": self.state.step,
            "hparams": {k: v for k, v in self.hparams.items() if v is not None},
            "checkpoints": sorted(p.name for p in self.ckpt_dir.glob("step-*"))[-5:],
        }
        if last is not None:
            status["last"] = last
        try:
            self.control.publish_status(status)
        except (redis.ConnectionError, redis.TimeoutError) as err:
            log.warning("could not publish the run status: %s", err)


_EARLY_STOP: list[threading.Event] = []
"""Set by a signal that arrives before a spawned rank's service exists (``_rank_main``)."""


def _rank_main(
    rank: int, world: int, port: int, cfg_json: str, resume: bool, out: str, export: bool
) -> None:
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # (its default ends the process) until set
    # A Ctrl-C or SIGTERM while the rank starts (before the service's handlers exist) must not
    # kill one rank and leave the others in a collective: remember it, stop once running.
    early = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda _s, _f: early.set())
    _EARLY_STOP.append(early)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world)
    )
    cfg = RunConfig.model_validate_json(cfg_json)
    run_rank(cfg, resume, out, export_only=export)


def run_rank(
    cfg: RunConfig,
    resume: bool,
    out: str | None,
    on_service: Callable[[LearnerService], None] | None = None,
    handle_signals: bool = True,
    export_only: bool = False,
) -> LearnerState:
    """One rank: join the process group, run, leave. ``on_service`` gets the service before it
    runs (a Ray actor keeps it to stop it); ``handle_signals``: SIGTERM/SIGINT checkpoint and
    stop (only in a process's main thread)."""
    # OMP_NUM_THREADS, when set, is the operator's choice (torch already follows it); otherwise
    # the ranks share the machine's cores. More threads than cores left to this process make
    # OpenMP's spinning threads wait on each other: updates were 10x slower beside a worker.
    if not os.environ.get("OMP_NUM_THREADS"):
        world = max(1, int(os.environ["WORLD_SIZE"]))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    backend = "nccl" if torch.cuda.is_available() and cfg.model.device != "cpu" else "gloo"
    if cfg.sync.backend != "auto":
        backend = cfg.sync.backend
    # Rank 0 may spend up to ~4 sync timeouts in the broadcast hub (a dead worker: the failed
    # collective, then two timeouts of acknowledgements, then the new group) while the other
    # ranks wait in the next collective.
    dist.init_process_group(backend, timeout=dt.timedelta(seconds=4 * cfg.sync.timeout_s + 60))
    try:
        service = LearnerService(cfg, resume)

        def on_signal(signum: int, _frame: object) -> None:
            log.info("rank %d: signal %d: checkpoint and stop", service.rank, signum)
            service.stop.set()

        if export_only:  # the latest checkpoint as a Hugging Face checkpoint, no training
            path = service.export_hf(service.export_path())
            if service.rank == 0 and out:
                Path(out).write_text(json.dumps({**service.state.__dict__, "export": str(path)}))
            return service.state

        def on_export(signum: int, _frame: object) -> None:
            log.info("rank %d: signal %d: export before the next update", service.rank, signum)
            service.export_now.set()

        if handle_signals:
            signal.signal(signal.SIGTERM, on_signal)
            signal.signal(signal.SIGINT, on_signal)
            signal.signal(signal.SIGUSR1, on_export)
        if on_service is not None:
            on_service(service)
        if any(e.is_set() for e in _EARLY_STOP):
            log.info("rank %d: a stop arrived while starting: checkpoint and stop", service.rank)
            service.stop.set()
        if service.rank == 0 and cfg.metrics.prometheus_port is not None:
            from reval.ops_http import OpsServer

            OpsServer(cfg.metrics.prometheus_port, service.metrics.registry, cfg.metrics.addr,
                      service.health, service.ready)  # fmt: skip
        state = service.run()
        if service.rank == 0 and out:
            Path(out).write_text(json.dumps(state.__dict__))
        dist.barrier()  # every rank is done before any tears its process group down
        return state
    finally:
        dist.destroy_process_group()


def main(
    cfg: RunConfig, resume: bool = False, nproc: int | None = None, export: bool = False
) -> int:
    """Under torchrun (RANK set): this process is one rank. Otherwise spawn ``nproc`` ranks
    (default ``learner.world_size``) on this machine. ``export``: write the latest checkpoint
    as a Hugging Face checkpoint (``run_dir/exports/step-N``) and stop; a running learner
    exports on SIGUSR1 instead."""
    if cfg.buffer.backend != "redis":
        raise ValueError("the learner service needs buffer.backend=redis (the replay service)")
    cfg.run_dir.mkdir(parents=True, exist_ok=True)
    if export:
        resume = True
        if not (cfg.run_dir / "checkpoints" / "latest").is_file():
            raise ValueError(f"--export: no checkpoint under {cfg.run_dir / 'checkpoints'}")
    if "RANK" in os.environ:
        state = run_rank(cfg, resume, None, export_only=export)
        print(json.dumps(state.__dict__), flush=True)
        return 0
    world = nproc or cfg.learner.world_size
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = str(cfg.run_dir / "learner_state.json")
    # Children ignore SIGINT/SIGTERM until they install their handlers; the parent forwards.
    ctx = torch.multiprocessing.get_context("spawn")
    procs = [
        ctx.Process(
            target=_rank_main, args=(r, world, port, cfg.model_dump_json(), resume, out, export)
        )
        for r in range(world)
    ]
    for p in procs:
        p.start()

    def forward(signum: int, _frame: object) -> None:
        for p in procs:
            if p.pid is not None and p.is_alive():
                os.kill(p.pid, signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    signal.signal(signal.SIGUSR1, forward)
    for p in procs:
        p.join()
    codes = [p.exitcode for p in procs]
    if any(codes):
        log.error("learner ranks exited with %s", codes)
        return 1
    print(Path(out).read_text(), flush=True)
    return 0
