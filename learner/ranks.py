"""How the learner's processes run (``reval learner``): ``main`` spawns the ranks of one machine
(or each rank runs under torchrun), ``run_rank`` is one rank's life (its thread budget, the
process group, the run's one-learner lease on rank 0, the service of ``learner/service.py``, its
stop), ``StartingStatus`` says "starting" in Redis while the ranks load, and a fault rank 0 said in
one line reaches the other ranks, which exit quietly; ``stop_status`` is the exit status of a
stopped run (128 + the signal).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis
import torch
import torch.distributed as dist

from buffer.redis_layout import RingCorrupt
from learner.checkpoint import CheckpointWriteError
from learner.parallel import init_group
from learner.service import LearnerService, LearnerState
from reval.config import RunConfig
from reval.control import (
    STARTING_BEAT_S,
    LeaseHeld,
    RunControl,
    RunLease,
)
from reval.ops_http import PortTaken, check_port
from reval.procs import follow_parent
from reval.redis import connect
from reval.signals import off_main
from reval.threads import apply as apply_threads
from reval.threads import budget as thread_budget
from reval.threads import ray_cpus

log = logging.getLogger("reval.learner")

PARENT_GRACE_S = 60.0
"""A spawned rank whose ``reval learner`` parent died stops at once (SIGTERM: checkpoint and
stop, as on a Ctrl-C); if it has not ended this many seconds later it exits hard."""

LEASE_HELD_EXIT = 3
"""Exit status of a spawned rank that found the run's lease held by another learner."""

_EARLY_STOP: list[int] = []
"""The signals that arrived before a spawned rank's service existed (``_rank_main``)."""


def _rank_main(
    rank: int,
    world: int,
    port: int,
    cfg_json: str,
    resume: bool,
    out: str,
    export: bool,
    parent: int,
) -> None:
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # (its default ends the process) until set
    # A Ctrl-C or SIGTERM while the rank starts (before the service's handlers exist) must not
    # kill one rank and leave the others in a collective: remember it, stop once running.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda s, _f: _EARLY_STOP.append(s))
    # (A spawned process has no logging set up: rank 0 says what it does, the others warn.)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(name)s %(message)s")  # fmt: skip
    # A SIGKILL of the parent left its ranks training on as orphans, beside the next learner.
    follow_parent(parent, signal.SIGTERM, PARENT_GRACE_S, what="learner rank")
    if sys.platform.startswith("linux"):  # spawned ranks are all on this machine: gloo on lo
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),  # (one node: the rank picks its GPU, learner/parallel.py)
    )
    cfg = RunConfig.model_validate_json(cfg_json)
    try:
        state = run_rank(cfg, resume, out, export_only=export)
    except LeaseHeld as err:
        if rank == 0:
            print(f"reval learner: {err}", file=sys.stderr, flush=True)
        sys.exit(LEASE_HELD_EXIT)
    except CheckpointWriteError as err:  # one line, not a traceback per rank
        if rank == 0:
            print(f"reval learner: {err}", file=sys.stderr, flush=True)
        sys.exit(1)
    except (RingCorrupt, PortTaken) as err:  # rank 0's: one line; the others see it die
        if rank == 0:
            _said_for(parent, out).write_text(str(err))
            print(f"reval learner: {err}", file=sys.stderr, flush=True)
        sys.exit(1)
    except Exception:
        if rank != 0 and _rank0_said(parent, out):
            sys.exit(1)  # (rank 0 stopped the run with its one line: its collective broke)
        raise
    # Its work is done and on disk (checkpoint, state, trackers closed, group destroyed): end
    # now. The interpreter's teardown of torch and the rest took 1-4.5 s more (a busy machine),
    # out of the 10 s a SIGTERM's sender (docker stop) grants.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(128 + state.stopped_by if state.stopped_by else 0)  # (the parent's status too)


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
    # The ranks share the CPUs given (reval/threads.py; OMP_NUM_THREADS, when set, wins). More
    # threads than cores left to this process make OpenMP's spinning threads wait on each
    # other: updates were 10x slower beside a worker.
    # (A Ray actor's num_cpus is its own already: no second split.)
    local = int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ["WORLD_SIZE"])
    apply_threads(thread_budget("learner rank", share=1 if ray_cpus() else max(1, local)))
    # Rank 0 may spend up to ~4 sync timeouts in the broadcast hub (a dead worker: the failed
    # collective, then two timeouts of acknowledgements, then the new group) while the other
    # ranks wait in the next collective. (The hub's groups are its own: a dead worker never
    # stalls this group's collectives, reval/weights/collective.py.)
    # Rank 0 may also wait out a Redis outage (redis.outage_s) in a call of the replay ring.
    init_group(cfg.model.device, cfg.sync.backend,
               max(4 * cfg.sync.timeout_s, cfg.redis.outage_s) + 60)  # fmt: skip
    lease = None
    service: LearnerService | None = None
    try:
        lease = _take_lease(cfg)
        service = LearnerService(cfg, resume, trackers=not export_only)
        service.lease = lease

        def on_signal(signum: int) -> None:
            service.request_stop(signum)  # (rank 0's one line comes with the checkpoint)

        if export_only:  # the latest checkpoint as a Hugging Face checkpoint, no training
            path = service.export_hf(service.export_path())
            if service.rank == 0 and out:
                Path(out).write_text(json.dumps({**service.state.__dict__, "export": str(path)}))
            return service.state

        def on_export(signum: int) -> None:
            log.info("rank %d: signal %d: export before the next update", service.rank, signum)
            service.export_now.set()

        if handle_signals:  # (off the main thread: a handler that takes a lock may hang it)
            signal.signal(signal.SIGTERM, off_main(on_signal))
            signal.signal(signal.SIGINT, off_main(on_signal))
            signal.signal(signal.SIGUSR1, off_main(on_export))
        if on_service is not None:
            on_service(service)
        if _EARLY_STOP:  # a stop that arrived while it started
            service.request_stop(_EARLY_STOP[0])
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
        if service is not None:
            service.close_trackers()  # (an error's way out too: their last rows written)
        if lease is not None:
            lease.release()
        dist.destroy_process_group()


def _take_lease(cfg: RunConfig) -> RunLease | None:
    """Rank 0 takes the run's one-learner lease (``reval/control.py: RunLease``); every rank
    learns whether it did, and all raise LeaseHeld (naming the holder) if not. The lease of
    rank 0, None elsewhere."""
    verdict: list[Any] = [None]
    lease = None
    if dist.get_rank() == 0:
        client = connect(cfg.redis.url)
        lease = RunLease(client, cfg.redis.prefix, cfg.name, cfg.learner.lease_s)
        try:
            lease.acquire()
        except LeaseHeld as err:
            verdict[0] = str(err)
            lease = None
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(verdict, src=0)
    if verdict[0] is not None:
        raise LeaseHeld(verdict[0])
    return lease


_STARTING = """
local t = redis.call('HGET', KEYS[1], 'time')
if t and tonumber(t) and tonumber(t) >= tonumber(ARGV[1])
    and redis.call('HGET', KEYS[1], 'phase') ~= ARGV[2] then
  return 0
end
redis.call('HSET', KEYS[1], 'phase', ARGV[2], 'time', ARGV[3])
return 1
"""
"""Write ``starting`` into a run's status hash (KEYS[1]) unless a learner that started after
ARGV[1] has reported there (another phase written since): 1 if written."""


class StartingStatus:
    """While ``reval learner`` starts (the tiny model's pretraining, the ranks building the model
    and joining), the run's status says ``starting``, written every ``STARTING_BEAT_S``: the API
    shows a restarted learner's run as starting, not ``failed`` (its lease is not held yet).
    A thread of the starting process; it ends once this start's rank 0 has reported a phase of
    its own (after its first update, a pause or a stop: never written over, ``_STARTING``), or
    on ``close``."""

    @classmethod
    def begin(cls, cfg: RunConfig) -> StartingStatus | None:
        """One for the process that starts the learner (under torchrun: rank 0's)."""
        return cls(cfg) if os.environ.get("RANK", "0") == "0" else None

    def __init__(self, cfg: RunConfig) -> None:
        self.client = connect(cfg.redis.url)
        self.key = RunControl(self.client, cfg.redis.prefix, cfg.name).status
        self.since = time.time()
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._beat, name="reval-starting", daemon=True)
        self.thread.start()

    def _beat(self) -> None:
        phase = json.dumps("starting")  # (the status hash's values are JSON)
        while True:
            try:
                now = json.dumps(time.time())
                if not self.client.eval(_STARTING, 1, self.key, self.since, phase, now):
                    return  # (rank 0 of this start reports from now on)
            except redis.RedisError as err:
                log.debug("starting status not written: %s", err)  # (Redis away: next turn)
            if self.done.wait(STARTING_BEAT_S):
                return

    def close(self) -> None:
        self.done.set()
        self.thread.join(timeout=5)


def _said_for(parent: int, out: str) -> Path:
    """The file by which rank 0 of the ranks ``parent`` spawned tells the others and the parent
    that it stopped the run with one line (a corrupt ring): they exit without a traceback of
    the collective its exit broke."""
    from reval.run_dir import RunDir

    return RunDir(Path(out).parent).learner_stopped(parent)


def _rank0_said(parent: int, out: str, wait_s: float = 5.0) -> bool:
    """Whether rank 0 stopped the run with its one line (``_said_for``), waiting up to
    ``wait_s`` for it to say so (its process group may go down before it writes the file)."""
    deadline = time.monotonic() + wait_s
    while not _said_for(parent, out).exists():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def _agent_store(timeout_s: float) -> dist.TCPStore | None:
    """Under torchrun, a client of its agent's store (``MASTER_ADDR:MASTER_PORT``, hosted by
    the agent: it outlives rank 0); None otherwise (then ``_said_for``'s file tells)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true":
        return None
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                         is_master=False, timeout=dt.timedelta(seconds=timeout_s))  # fmt: skip


def _said_key() -> str:
    """The agent store's key by which rank 0 of this torchrun attempt says it stopped the run
    with one line (a corrupt ring, a taken port)."""
    return f"reval/learner-said/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def _tell_ranks(said: str) -> None:
    """Rank 0 under torchrun stopped the run with one line (``said``): the other ranks, whose
    collective its exit breaks, learn it from the agent's store and exit 1 without a
    traceback (``_told_by_rank0``). Nothing when not rank 0 or not under torchrun's agent."""
    if os.environ.get("RANK") != "0":
        return
    with contextlib.suppress(Exception):  # (its own line is said whatever happens here)
        store = _agent_store(5.0)
        if store is not None:
            store.set(_said_key(), said)


def _told_by_rank0(wait_s: float = 5.0) -> bool:
    """Whether rank 0 of this torchrun attempt said it stopped the run (``_tell_ranks``),
    waiting up to ``wait_s`` for it (its process group may go down before it says so)."""
    try:
        store = _agent_store(wait_s)
        if store is None:
            return False
        store.wait([_said_key()], dt.timedelta(seconds=wait_s))
    except Exception:  # (not said in time, or no store to ask)
        return False
    return True


def stop_status(codes: list[int | None]) -> int | None:
    """The exit status of ``reval learner`` whose ranks all stopped on a signal (SIGTERM 143,
    SIGINT 130: they wrote their checkpoint and exited with it, or died of it before they could
    catch it), else None."""
    stops = {128 + s for s in (signal.SIGINT, signal.SIGTERM)}
    as_status = [128 - c if c is not None and c < 0 else c for c in codes]
    if as_status and all(c in stops for c in as_status):
        return max(c for c in as_status if c is not None)
    return None


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
        if not cfg.paths.has_checkpoint():
            raise ValueError(f"--export: no checkpoint under {cfg.run_dir / 'checkpoints'}")
    if "RANK" in os.environ:
        try:
            state = run_rank(cfg, resume, None, export_only=export)
        except (RingCorrupt, PortTaken) as err:  # (its command says it in one line)
            _tell_ranks(str(err))
            raise
        except Exception:
            if int(os.environ["RANK"]) != 0 and _told_by_rank0():
                return 1  # (rank 0 stopped the run with its one line: its collective broke)
            raise
        if state.stopped_by:
            return 128 + state.stopped_by  # (its one line said where the checkpoint is)
        print(json.dumps(state.__dict__), flush=True)
        return 0
    if nproc is not None and nproc < 1:
        raise ValueError(f"nproc must be >= 1, got {nproc}")
    world = nproc if nproc is not None else cfg.learner.world_size
    if cfg.metrics.prometheus_port is not None and not export:  # (rank 0 binds it, later)
        check_port(cfg.metrics.prometheus_port, cfg.metrics.addr)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = str(cfg.paths.learner_state)
    # Children ignore SIGINT/SIGTERM until they install their handlers; the parent forwards.
    ctx = torch.multiprocessing.get_context("spawn")
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(r, world, port, cfg.model_dump_json(), resume, out, export, os.getpid()),
        )
        for r in range(world)
    ]
    received: list[int] = []

    def forward(signum: int, _frame: object) -> None:
        if signum != signal.SIGUSR1:
            received.append(signum)
        for p in procs:
            if p.pid is not None and p.is_alive():
                os.kill(p.pid, signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    signal.signal(signal.SIGUSR1, forward)
    for p in procs:
        p.start()
    for signum in received[:1]:  # (one that came while they started)
        forward(signum, None)
    for p in procs:
        p.join()
    codes = [p.exitcode for p in procs]
    said = _said_for(os.getpid(), out)
    if said.exists():  # rank 0 said why on one line (a corrupt ring)
        said.unlink()
        return 1
    if LEASE_HELD_EXIT in codes:
        return 2  # (rank 0 said which learner holds the run)
    status = stop_status(codes)
    if status is not None:
        return status  # (rank 0's one line said where the checkpoint is)
    if any(codes):
        log.error("learner ranks exited with %s", codes)
        return 1
    print(Path(out).read_text(), flush=True)
    return 0
