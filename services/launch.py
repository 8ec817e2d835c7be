"""``reval launch``: a whole run on Ray. The learner ranks and the rollout workers are Ray actors
(``services/launch_actors.py``) with per-role resources (``[launch]``: CPUs here, GPUs on a GPU
node), on a local Ray by default or on the cluster at ``RAY_ADDRESS``; Redis is the one in the
config. This is how a run grows past one machine: the learner ranks sit in one placement group,
the workers go wherever Ray finds room.

The launching process (the *driver*) is the control loop. It owns every actor, so they end with
it, and it:

- starts the learner ranks (FSDP2 over ``learner.world_size`` actors; rank 0's node address and a
  free port are the rendezvous) and ``launch.workers`` rollout workers;
- restarts the whole learner from its latest checkpoint when a rank dies (up to
  ``launch.max_learner_restarts``): the workers keep generating with their old weights meanwhile,
  and the buffer is in Redis, so nothing generated is lost; not a rank a corrupt ring stopped
  (``RingCorrupt``): the launch ends with its one line;
- replaces a worker that died (``launch.replace_dead_workers``), not one that finished by itself
  (it saw the run end);
- follows the run's control keys in Redis (``reval/control.py``: the one control channel, which
  the REST API, ``reval launch --add N`` / ``--remove N`` / ``--stop`` / ``--export`` from any
  other process, and its own SIGINT/SIGTERM all write): the desired number of workers, a stop;
  an export is the learner's to follow. It writes its heartbeat and status there once a loop,
  which ``reval launch --status`` reads;
- when the learner has done its steps (or on SIGINT/SIGTERM: the learner checkpoints), drains the
  workers (they push what they hold and deregister) and ends.

Ray's API as used here (ray 2.x): ``ray.init(address=..., namespace=..., num_cpus=...)``,
``@ray.remote`` classes with ``.options(num_cpus=, num_gpus=, max_concurrency=, name=,
scheduling_strategy=)``, ``ray.util.placement_group`` with
``PlacementGroupSchedulingStrategy``, ``ray.wait``, ``ray.kill``, ``ray.get_actor(name,
namespace=)``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import redis

from buffer.redis_layout import RingCorrupt
from reval.config import RunConfig
from reval.ratelog import RateLog
from reval.retry import skip_on_outage
from reval.run_dir import checkpoint_step
from reval.signals import off_main
from reval.threads import machine_cpus
from services.launch_actors import RING_CORRUPT, LearnerRank, RolloutActor
from services.launch_cluster import cluster_sync, failure_line

log = logging.getLogger("reval.launch")

control_log = RateLog(log, every_s=60.0)
"""The loop's line for a run control it cannot use (an error that is no outage): once a minute."""

TICK_S = 0.5

WAIT_LOG_S = 15.0
"""While the driver waits (Ray placing the learner, actors starting, the learner's first
update), a line this often says what for and for how long."""

BEAT_S = 5.0
"""While the driver waits for the learner's ranks and set-up (a start, or a restart after a rank
died: the tiny model's pretraining, tens of seconds on a busy machine), it writes its heartbeat
this often, well inside ``DRIVER_TIMEOUT_S`` (30 s): without it a restart that took longer
read as no driver at all (``reval launch --status``, the REST API)."""


def wait_logged(
    ray: Any,
    refs: list[Any],
    what: str,
    timeout_s: float,
    beat: Callable[[], None] | None = None,
) -> list[Any]:
    """``ray.get(refs)`` that says what it waits for every ``WAIT_LOG_S`` seconds until they
    are ready; TimeoutError (naming ``what``) after ``timeout_s``. ``beat``: called every
    ``BEAT_S`` while it waits (the driver's heartbeat, which its loop writes otherwise)."""
    t0 = logged = time.monotonic()
    pending = list(refs)
    while pending:
        if beat is not None:
            beat()
        waited = time.monotonic() - t0
        if waited >= timeout_s:
            raise TimeoutError(f"{what}: not ready after {timeout_s:.0f} s")
        step = min(WAIT_LOG_S, timeout_s - waited)
        if beat is not None:
            step = min(step, BEAT_S)
        _, pending = ray.wait(pending, num_returns=len(pending), timeout=step)
        if pending and time.monotonic() - logged >= WAIT_LOG_S:
            logged = time.monotonic()
            log.info("waiting for %s (%.0f s so far)", what, logged - t0)
    return list(ray.get(list(refs)))


class LaunchMetrics:
    """The driver's metrics (``reval_launch_*``)."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge

        r = self.registry = CollectorRegistry()
        self.workers = Gauge("reval_launch_workers", "Rollout worker actors running", registry=r)
        self.desired = Gauge("reval_launch_workers_desired", "Rollout workers wanted",
                             registry=r)  # fmt: skip
        self.dead = Counter("reval_launch_dead_workers", "Rollout worker actors that died",
                            registry=r)  # fmt: skip
        self.restarts = Counter("reval_launch_learner_restarts", "Learner restarts after a "
                                "rank died", registry=r)  # fmt: skip


@dataclass
class _Worker:
    worker_id: str
    actor: Any
    ref: Any
    pid: int | None = None
    pid_ref: Any = None
    stopping: bool = False
    started: float = field(default_factory=time.time)


class Launch:
    """The driver's control loop over one run (see the module docstring)."""

    def __init__(self, cfg: RunConfig, resume: bool = False) -> None:
        import ray
        from ray.util.placement_group import placement_group

        self.ray = ray
        self.cfg = cfg
        lc = cfg.launch
        self.world = cfg.learner.world_size
        cores: int | None = None  # (a Ray of someone else's: its nodes are not known here)
        ray_at: dict[str, Any] = {"ray_address": os.environ.get("RAY_ADDRESS") or None}
        if not ray.is_initialized():
            address = os.environ.get("RAY_ADDRESS") or None
            if address is None:  # an empty RAY_ADDRESS (compose) means a local Ray
                os.environ.pop("RAY_ADDRESS", None)
            kwargs: dict[str, Any] = {"namespace": lc.namespace, "log_to_driver": True}
            if address:
                kwargs["address"] = address
                cfg = self.cfg = cluster_sync(cfg)
            else:
                cores = machine_cpus()
                kwargs["num_cpus"] = lc.local_ray_cpus(self.world, cores)
                ray_at["cpus"] = kwargs["num_cpus"]
                if not lc.rollout_gpus:  # (GPU workers: their room is the GPUs')
                    ray_at["room"] = lc.local_ray_room(self.world, cores)
            t0 = time.monotonic()
            log.info("starting Ray: %s", f"joining {address}" if address else
                     f"a local one with {kwargs['num_cpus']} CPUs")  # fmt: skip
            ray.init(**kwargs)
            log.info("Ray up in %.0f s", time.monotonic() - t0)
        self.learner_cpus, self.rollout_cpus = lc.cpus(self.world, cores)
        """Each rank's and each worker's ``num_cpus`` (``launch.learner_cpus``, ``rollout_cpus``:
        ``"auto"`` splits a local Ray's machine between them; their thread budgets follow)."""
        log.info("each learner rank gets %g CPU(s), each rollout worker %g (launch.learner_cpus, "
                 "launch.rollout_cpus)", self.learner_cpus, self.rollout_cpus)  # fmt: skip
        from reval.control import RunControl
        from reval.redis import connect

        self.control = RunControl(connect(cfg.redis.url, timeout_s=5), cfg.redis.prefix, cfg.name)
        if self.control.driver() is not None:
            raise RuntimeError(f"run {cfg.name!r} is already launched (its driver's heartbeat "
                               "is in Redis)")  # fmt: skip
        self.control.mark_launched(ray_at)  # (the API's scale answers: this driver scales it)
        bundle: dict[str, float] = {"CPU": self.learner_cpus, **lc.learner_resources}
        if lc.learner_gpus:
            bundle["GPU"] = lc.learner_gpus
        self.pg = placement_group([dict(bundle) for _ in range(self.world)], strategy=lc.placement)
        wait_logged(ray, [self.pg.ready()], f"Ray to place the learner's {self.world} "
                    f"rank(s) ({bundle} each, {lc.placement})", 600)  # fmt: skip
        self.cfg_json = cfg.model_dump_json()
        self.resume = resume
        self.restarts = 0
        self.ranks: list[Any] = []
        self.rank_refs: list[Any] = []
        self.rank_pids: list[int] = []
        self.learner_state: dict[str, Any] | None = None
        self.workers: dict[str, _Worker] = {}
        self.next_worker = 0
        self.dead_workers = 0
        self.stop_requested = False
        self.stop_signalled = False
        """A SIGINT/SIGTERM stopped the run: the loop writes it to the control keys."""
        self.state = "starting"
        self.metrics = LaunchMetrics()
        self.last_tick = time.monotonic()
        self.started = time.time()
        self.replace_after = 0.0  # (backoff of replacing workers that keep dying)
        self.ended_workers = 0
        """Workers that finished by themselves (they saw the run end): not replaced."""
        self.deaths: list[float] = []
        self.under_way = False
        """The learner has made its first update since this launch (``report_start``)."""
        self.step_before: int | None = None
        self.next_report = time.monotonic() + WAIT_LOG_S
        self.ops: Any = None
        if lc.metrics_port is not None:
            from reval.ops_http import OpsServer

            self.ops = OpsServer(lc.metrics_port, self.metrics.registry, cfg.metrics.addr,
                                 self.health, self.ready)  # fmt: skip

    # -- learner --------------------------------------------------------------------------------

    def start_learner(self, resume: bool | None) -> None:
        """The learner's ranks, in the placement group. ``resume``: from the latest checkpoint
        (``--resume``: one must be there), not (a fresh start), or None: if the learner's host
        has one (a restart). Rank 0's actor decides on its own host: the checkpoints are on the
        learner's disk, which may not be the driver's."""
        addr, port = self._rank_actors()
        # (the tiny model's pretraining, ..., on the learner's host: its ranks load it there)
        at_step = 0  # (a restart: the run's newest checkpoint, to refuse starting it over)
        if resume is None:
            with contextlib.suppress(redis.RedisError, ValueError):
                names = self.control.read_status().checkpoints
                at_step = max(map(checkpoint_step, names), default=0)
        prepared = self.ranks[0].prepare.remote(self.cfg_json, resume, at_step)
        ((ranks_json, resume),) = wait_logged(self.ray, [prepared], "the learner's set-up (the "
                                              "tiny model's pretraining)", 900,
                                              beat=self.beat)  # fmt: skip
        self.rank_refs = [a.run.remote(ranks_json, addr, port, resume) for a in self.ranks]
        if self.stop_requested:  # (a stop that came while they started went to the old ones)
            for a in self.ranks:
                a.stop.remote()
        log.info(
            "learner: %d rank(s) at %s:%d (pids %s)%s",
            self.world,
            addr,
            port,
            self.rank_pids,
            ", resuming from the latest checkpoint" if resume else "",
        )

    def _rank_actors(self, timeout_s: float = 300.0) -> tuple[str, int]:
        """The ranks' actors, started: rank 0's address and a free port there. An actor Ray
        placed on a node that then turned out dead (a learner host killed: its bundle is
        placed again once Ray marks the node dead) never runs: made again until
        ``timeout_s``."""
        from ray.exceptions import ActorDiedError, ActorUnavailableError
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        lc = self.cfg.launch
        cls = self.ray.remote(LearnerRank)
        deadline = time.monotonic() + timeout_s
        while True:
            self.ranks = [
                cls.options(
                    num_cpus=self.learner_cpus,
                    num_gpus=lc.learner_gpus,
                    max_concurrency=2,  # run() and stop()
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        placement_group=self.pg, placement_group_bundle_index=r
                    ),
                ).remote(r, self.world)
                for r in range(self.world)
            ]
            refs = [self.ranks[0].endpoint.remote(), *[a.pid.remote() for a in self.ranks[1:]]]
            try:
                (addr, port, pid0), *pids = wait_logged(
                    self.ray, refs, f"the learner's {self.world} rank actor(s) to start",
                    max(1.0, deadline - time.monotonic()), beat=self.beat,
                )  # fmt: skip
            except (ActorDiedError, ActorUnavailableError) as err:
                for a in self.ranks:
                    self.ray.kill(a, no_restart=True)
                if time.monotonic() > deadline:
                    raise
                log.warning("a learner rank's actor never ran (%s): placing them again",
                            failure_line(err))  # fmt: skip
                time.sleep(2.0)
                continue
            self.rank_pids = [pid0, *(int(p) for p in pids)]
            return addr, port

    def _check_learner(self) -> str:
        """'running', 'done' or 'restarted'; raises when out of restarts, and RingCorrupt (no
        restart) when a corrupt ring stopped a rank."""
        ready, _ = self.ray.wait(self.rank_refs, num_returns=len(self.rank_refs), timeout=0)
        if not ready:
            return "running"
        failed = None
        for ref in ready:
            try:
                result = self.ray.get(ref)
            except Exception as err:  # a rank died or raised
                failed = err
                break
            if isinstance(result, dict) and RING_CORRUPT in result:
                failed = RingCorrupt(result[RING_CORRUPT])
                break
            if ref is self.rank_refs[0]:
                self.learner_state = result
        cause = getattr(failed, "cause", None) or failed  # (Ray's task error: the rank's)
        if isinstance(cause, RingCorrupt):
            for a in self.ranks:
                self.ray.kill(a, no_restart=True)
            raise RingCorrupt(str(cause))
        if failed is None:
            if len(ready) == len(self.rank_refs):
                return "done"
            return "running"  # rank 0 returned first; the others follow
        log.error("learner rank failed: %s", failure_line(failed))
        for a in self.ranks:
            self.ray.kill(a, no_restart=True)
        if self.stop_requested or self.restarts >= self.cfg.launch.max_learner_restarts:
            raise RuntimeError(
                f"the learner failed and is not restarted ({self.restarts} restart(s) so far)"
            )
        self.restarts += 1
        self.metrics.restarts.inc()
        log.warning(
            "restarting the learner (%d/%d): from its latest checkpoint where its host has one "
            "(on a cluster, once a node with the learner's resources is up)",
            self.restarts, self.cfg.launch.max_learner_restarts,
        )  # fmt: skip
        self.start_learner(None)
        return "restarted"

    # -- workers --------------------------------------------------------------------------------

    def add_workers(self, n: int) -> list[str]:
        lc = self.cfg.launch
        cls = self.ray.remote(RolloutActor)
        ids = []
        for _ in range(n):
            wid = f"{self.cfg.name}-w{self.next_worker}"
            self.next_worker += 1
            actor = cls.options(
                num_cpus=self.rollout_cpus,
                num_gpus=lc.rollout_gpus,
                max_concurrency=2,
                resources=dict(lc.rollout_resources) or None,
            ).remote(wid)
            self.workers[wid] = _Worker(wid, actor, actor.run.remote(self.cfg_json))
            ids.append(wid)
        log.info("started rollout worker(s) %s", ids)
        return ids

    def remove_workers(self, n: int) -> list[str]:
        """Drain the n newest workers (they push what they hold, then leave)."""
        live = [w for w in self.workers.values() if not w.stopping]
        gone = sorted(live, key=lambda w: w.started)[-n:] if n > 0 else []
        for w in gone:
            w.stopping = True
            w.actor.stop.remote()
        log.info("draining rollout worker(s) %s", [w.worker_id for w in gone])
        return [w.worker_id for w in gone]

    def _check_workers(self) -> None:
        refs = {w.ref: w for w in self.workers.values()}
        if not refs:
            return
        ready, _ = self.ray.wait(list(refs), num_returns=len(refs), timeout=0)
        for ref in ready:
            w = refs[ref]
            del self.workers[w.worker_id]
            try:
                summary = self.ray.get(ref)
                log.info("worker %s finished: %s", w.worker_id, summary)
                if not w.stopping:  # it saw the run end (rollout/worker.py): its slot stays
                    self.ended_workers += 1  # empty (a worker that dies later is replaced)
            except Exception as err:
                self.dead_workers += 1
                self.metrics.dead.inc()
                # Workers that keep dying (a bad config, a broken node) are replaced with a
                # growing delay (deaths in the last minute x 2 s, at most a minute).
                now = time.monotonic()
                self.deaths = [t for t in self.deaths if now - t < 60] + [now]
                self.replace_after = now + min(60.0, 2.0 * (len(self.deaths) - 1))
                log.error("worker %s died: %s", w.worker_id, str(err).splitlines()[0])
                if not w.stopping and not self.cfg.launch.replace_dead_workers:
                    with contextlib.suppress(redis.RedisError):
                        self.control.set_workers(max(0, self._desired() - 1))
                # (otherwise the desired count stays and _follow_control starts a new one)
            self.ray.kill(w.actor, no_restart=True)

    def _worker_pids(self) -> None:
        """Each worker's pid, asked once, read when it answered (never waits)."""
        asked = {}
        for w in self.workers.values():
            if w.pid is None:
                if w.pid_ref is None:
                    w.pid_ref = w.actor.pid.remote()
                asked[w.pid_ref] = w
        if asked:
            ready, _ = self.ray.wait(list(asked), num_returns=len(asked), timeout=0)
            for ref in ready:
                with contextlib.suppress(Exception):  # a worker that died before answering
                    asked[ref].pid = int(self.ray.get(ref))

    def health(self) -> tuple[bool, str]:
        idle = time.monotonic() - self.last_tick
        return idle < 120, f"control loop {idle:.0f} s ago"

    def ready(self) -> tuple[bool, str]:
        return self.state in ("running", "stopping"), self.state

    # -- the loop -------------------------------------------------------------------------------

    def beat(self) -> None:
        """The driver's heartbeat with its status, which ``reval launch --status`` and the REST
        API read (``DRIVER_TIMEOUT_S`` without one: no driver); a failed write is skipped."""
        with contextlib.suppress(Exception):
            self.control.beat_driver(self.status())

    def status(self) -> dict[str, Any]:
        return {
            "run": self.cfg.name,
            "state": self.state,
            "learner": {
                "world_size": self.world,
                "pids": self.rank_pids,
                "restarts": self.restarts,
                "final_state": self.learner_state,
            },
            "workers": [
                {"id": w.worker_id, "pid": w.pid, "draining": w.stopping}
                for w in self.workers.values()
            ],
            "dead_workers": self.dead_workers,
            "time": time.time(),
        }

    def _desired(self) -> int:
        try:
            got = self.control.read().workers
        except Exception:
            got = None
        return got if got is not None else len([w for w in self.workers.values() if not w.stopping])

    def _follow_control(self) -> None:
        """The run's control keys (the REST API writes them): the desired number of workers
        and a stop."""
        try:
            st = self.control.read()
        except Exception as err:  # Redis away: carry on, the buffer clients retry
            log.debug("control unreadable: %s", err)
            return
        if st.phase == "stopping":
            self.request_stop()
            return
        if st.workers is not None and not self.stop_requested:
            live = [w for w in self.workers.values() if not w.stopping]
            filled = len(live) + self.ended_workers
            if st.workers > filled and time.monotonic() >= self.replace_after:
                self.add_workers(st.workers - filled)
            elif st.workers < len(live):
                self.remove_workers(len(live) - st.workers)

    def report_start(self) -> None:
        """Until the learner's first update of this launch, a line every ``WAIT_LOG_S`` saying
        what the run waits for (the learner's phase, the workers up); then one line that the
        run is under way. Called once a loop; Redis errors are the loop's."""
        if self.under_way:
            return
        status = self.control.read_status()
        up = sum(1 for w in self.workers.values() if w.pid is not None)
        if status.step is not None and status.step != self.step_before:
            self.under_way = True
            log.info("under way: the learner is at step %d, %d worker(s) up (%.0f s after Ray "
                     "was up)", status.step, up, time.time() - self.started)  # fmt: skip
        elif time.monotonic() >= self.next_report:
            self.next_report = time.monotonic() + WAIT_LOG_S
            log.info("waiting for the learner's first update (learner: %s; %d of %d worker(s) "
                     "up; %.0f s after Ray was up)", status.phase or "not reported yet", up,
                     self._desired(), time.time() - self.started)  # fmt: skip

    def _tick_control(self) -> None:
        """A loop's reads and writes of the run's control keys (a stop signalled, the desired
        workers, the start's report); tried again next tick when they fail. Redis away or
        refusing writes is the one outage line (``skip_on_outage``: once a minute, and when it
        is back), not a line every tick; any other Redis error a line at most once a minute."""
        try:
            with skip_on_outage(f"reval launch's control of run {self.cfg.name}"):
                if self.stop_signalled and self.control.read().phase != "stopping":
                    self.control.set_phase("stopping")  # (seen by the API and the runs CLI)
                self._follow_control()
                self.report_start()
        except redis.RedisError as err:
            control_log.warning("run-control", "run control unavailable: %s", err)

    def request_stop(self) -> None:
        if not self.stop_requested:
            log.info("stopping: the learner checkpoints, the workers drain")
            self.stop_requested = True
            self.state = "stopping"
            for a in self.ranks:
                a.stop.remote()

    def run(self) -> dict[str, Any]:
        cfg = self.cfg
        resume = self.resume  # (--resume without a checkpoint: rank 0's set-up says so)
        with contextlib.suppress(redis.RedisError):  # (a resumed run's status has its old step)
            self.step_before = self.control.read_status().step
        self.start_learner(resume)
        # A stop left by an earlier launch of this run is over (one sent since we started is
        # kept: _follow_control stops the run).
        self.control.clear_stale_stop(self.started)
        if self.control.read().workers is None or not self.resume:
            self.control.set_workers(cfg.launch.workers)  # _follow_control starts them
        self._follow_control()
        self.state = "running"
        ok = False
        try:
            while True:
                outcome = self._check_learner()
                if outcome == "done":
                    ok = True
                    break
                self._tick_control()
                self._check_workers()
                self._worker_pids()
                self.last_tick = time.monotonic()
                self.beat()
                self.metrics.workers.set(len(self.workers))
                self.metrics.desired.set(self._desired())
                time.sleep(TICK_S)
        finally:
            self.state = "draining"
            self.beat()
            self.shutdown()
        self.state = "done" if ok else "failed"
        return self.status()

    def shutdown(self) -> None:
        """Drain the workers (bounded by ``launch.stop_timeout_s``), then end every actor."""
        ray = self.ray
        for w in self.workers.values():
            w.actor.stop.remote()
        refs = [w.ref for w in self.workers.values()]
        if refs:
            _, pending = ray.wait(
                refs, num_returns=len(refs), timeout=self.cfg.launch.stop_timeout_s
            )
            if pending:
                log.warning("%d worker(s) did not drain in time: killed", len(pending))
        for w in self.workers.values():
            ray.kill(w.actor, no_restart=True)
        self.workers.clear()
        for a in self.ranks:
            ray.kill(a, no_restart=True)
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(self.pg)


def launch(cfg: RunConfig, resume: bool = False) -> int:
    """Run a whole run on Ray until the learner is done; 0 on success."""
    import json

    import ray

    cfg.run_dir.mkdir(parents=True, exist_ok=True)
    driver = Launch(cfg, resume)

    def on_signal(signum: int) -> None:
        log.info("signal %d", signum)
        driver.stop_signalled = True
        driver.request_stop()

    signal.signal(signal.SIGTERM, off_main(on_signal))  # (reval/signals.py: why a thread)
    signal.signal(signal.SIGINT, off_main(on_signal))
    try:
        status = driver.run()
    except RingCorrupt as err:  # the learner's one line (it says how to repair the ring)
        print(f"reval launch: {err}", file=sys.stderr, flush=True)
        return 1
    except Exception as err:
        log.error("launch failed: %s", failure_line(err))
        return 1
    finally:
        ray.shutdown()
    print(json.dumps(status), flush=True)
    return 0


def control(
    cfg: RunConfig, add: int = 0, remove: int = 0, stop: bool = False, export: bool = False
) -> dict[str, Any]:
    """From another process: requests to a launched run through its control keys in Redis (the
    same channel as the REST API's), and the status its driver last wrote. LookupError when no
    driver runs it (no heartbeat within ``DRIVER_TIMEOUT_S``)."""
    from reval.control import RunControl
    from reval.redis import connect

    try:
        control = RunControl(connect(cfg.redis.url, timeout_s=5), cfg.redis.prefix, cfg.name)
        status = control.driver()
    except redis.RedisError as err:
        raise ConnectionError(f"Redis at redis.url: {err}") from err
    if status is None:
        raise LookupError(f"no launched run {cfg.name!r}: no driver's heartbeat in Redis at "
                          f"prefix {cfg.redis.prefix!r}")  # fmt: skip
    if add or remove:
        live = [w for w in status.get("workers", []) if not w.get("draining")]
        desired = control.read().workers
        desired = len(live) if desired is None else desired
        control.set_workers(max(0, desired + add - remove))
    if export:
        control.request("export")
    if stop:
        control.set_phase("stopping")
    return status


__all__: Sequence[str] = ["Launch", "control", "launch"]
