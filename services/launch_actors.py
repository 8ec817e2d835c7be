"""The Ray actors of ``reval launch`` (``services/launch.py``, whose driver owns them): a
learner rank (``LearnerRank``: one FSDP2 rank of ``learner/service.py``) and a rollout worker
(``RolloutActor``: ``rollout/worker.py``), each in its own actor process, with per-role
resources set by the driver. Each runs its part to the end and returns a summary; ``stop``
asks it to finish (a learner rank checkpoints, a worker drains).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from typing import Any

from buffer.redis_layout import RingCorrupt
from reval.config import RunConfig


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def _actor_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")


RING_CORRUPT = "ring_corrupt"
"""The key of a learner rank's answer when a corrupt ring stopped it (its message): the driver
ends the launch with that one line and restarts nothing (a restart would meet the same ring)."""


class LearnerRank:
    """One FSDP2 rank of ``learner/service.py`` in a Ray actor."""

    def __init__(self, rank: int, world: int) -> None:
        _actor_logging()
        self.rank, self.world = rank, world
        self.service: Any = None
        self.stopping = threading.Event()

    def endpoint(self) -> tuple[str, int, int]:
        import ray

        return ray.util.get_node_ip_address(), _free_port(), os.getpid()

    def pid(self) -> int:
        return os.getpid()

    def prepare(self, cfg_json: str, resume: bool | None, at_step: int = 0) -> tuple[str, bool]:
        """``services/setup.py: prepare_learner`` on the learner's host (rank 0's actor): the
        tiny model's pretraining goes to its ``run_dir/initial``, which the ranks load, and the
        checkpoints are its own (the driver's host may be another, with a disk of its own).
        ``resume`` None: if this host has a checkpoint (a restart of a run whose newest
        checkpoint was at ``at_step``: none here is refused, its checkpoints were on a host that
        is gone; a run that never wrote one starts afresh). The ranks' config, as JSON, and
        whether they resume. FileNotFoundError for a ``resume`` without a checkpoint here."""
        from services.setup import prepare_learner

        cfg = RunConfig.model_validate_json(cfg_json)
        found = cfg.paths.has_checkpoint()
        if resume and not found:
            raise FileNotFoundError(f"--resume: no checkpoint under {cfg.run_dir / 'checkpoints'} "
                                    f"on the learner's host {socket.gethostname()}")  # fmt: skip
        if resume is None and not found and at_step > 0:
            raise FileNotFoundError(
                f"the learner's host {socket.gethostname()} has no checkpoint of run "
                f"{cfg.name!r}, which had one at step {at_step}: its checkpoints are on the host "
                "it ran on. Start that host again (ray start), or copy its "
                f"{cfg.run_dir / 'checkpoints'} here, then reval launch --resume"
            )
        resume = found if resume is None else resume
        return prepare_learner(cfg, resume).model_dump_json(), resume

    def run(self, cfg_json: str, addr: str, port: int, resume: bool) -> dict[str, Any]:
        from learner.ranks import run_rank

        os.environ.update(
            MASTER_ADDR=addr,
            MASTER_PORT=str(port),
            RANK=str(self.rank),
            WORLD_SIZE=str(self.world),
            LOCAL_RANK="0",  # Ray gives each rank its own device(s): CUDA_VISIBLE_DEVICES
        )
        cfg = RunConfig.model_validate_json(cfg_json)

        def keep(service: Any) -> None:
            self.service = service
            if self.stopping.is_set():
                service.request_stop()  # (a wait for Redis in hand ends too)

        try:
            state = run_rank(cfg, resume, None, on_service=keep, handle_signals=False)
        except RingCorrupt as err:  # (the driver ends the launch with its one line, no restart)
            return {RING_CORRUPT: str(err)}
        return dict(state.__dict__)

    def stop(self) -> None:
        """Checkpoint and stop after the current update (every rank agrees through rank 0)."""
        self.stopping.set()
        if self.service is not None:
            self.service.request_stop()  # (a wait for Redis in hand ends too)


class RolloutActor:
    """One rollout worker (``rollout/worker.py``) in a Ray actor."""

    def __init__(self, worker_id: str) -> None:
        _actor_logging()
        self.worker_id = worker_id
        self.worker: Any = None
        self.stopping = threading.Event()

    def pid(self) -> int:
        return os.getpid()

    def run(self, cfg_json: str) -> dict[str, Any]:
        from reval.threads import apply, budget
        from rollout.worker import RolloutWorker

        cfg = RunConfig.model_validate_json(cfg_json)
        apply(budget("worker"))  # (its num_cpus: reval/threads.py; before the engine starts)
        self.worker = RolloutWorker(cfg, self.worker_id)
        if self.stopping.is_set():
            self.worker.stop.set()
        stats = self.worker.run()
        return {
            "worker": self.worker_id,
            "batches": stats.batches,
            "trajectories": stats.trajectories,
            "versions": sorted(set(stats.versions)),
        }

    def stop(self) -> None:
        """Drain: finish the batch, push, deregister."""
        self.stopping.set()
        if self.worker is not None:
            self.worker.stop.set()
