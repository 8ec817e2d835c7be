"""``reval rollout``: one rollout worker (an actor of the actor-learner service; its twin, the
learner process, is ``learner/service.py``).

It registers itself in Redis with a heartbeat, waits until the learner has announced weights,
then runs one loop for every engine (``rollout/streaming.py``'s ``Streamer``): it takes prompts
from the shared deal, generates N answers each (or N multi-turn episodes, ``task.environment``),
grades each prompt's group as soon as it is done, transforms its rewards, tags every trajectory
with the policy versions that sampled it and pushes the group into the replay service. A
streaming engine (vLLM) keeps answers in flight and loads newer weights between two decode
steps; with ``rollout.streaming = false``, and always for an engine that does not stream (the HF
engine, behind ``rollout.engines.LockstepStream``), it admits ``worker_prompts`` prompts at a
time with the engine empty: lockstep batches, weights loaded between them through its
``WeightSubscriber`` (``reval/weights/receiver.py``: the broadcast or the announced file,
whichever is newer). It never waits for the learner (pushes go through the replay client's
retries and spool), survives a Redis restart, and on SIGTERM/SIGINT finishes the answers in
hand, pushes them, deregisters and exits 0. It leaves the same way, with one line, when the run
is over: its learner reported it ``done`` or ``stopped`` (the run's status, read every
``RUN_END_CHECK_S``) after this worker started, or the run's control says ``stopping``. Its long
waits (the engine's start, the first weights) say what they wait for at once and every
``PROGRESS_S``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import signal
import socket
import threading
import time
import uuid
import zlib
from collections.abc import Iterator

import redis

from buffer import make_producer
from buffer.metrics import BufferMetrics
from buffer.records import Trajectory
from reval import registry
from reval.config import RunConfig
from reval.control import RunControl
from reval.redis import connect
from reval.retry import cut_short, skip_on_outage, stop_waiting
from reval.signals import off_main
from reval.threads import apply as apply_threads
from reval.threads import budget as thread_budget
from reval.threads import tick as thread_tick
from reval.weights.receiver import build_subscriber
from rollout.collect import Truncation
from rollout.dealer import PromptDealer
from rollout.engines import SamplingParams, as_stream
from rollout.environment import EpisodeRunner
from rollout.generators import build_engine
from rollout.streaming import Group, Streamer, SubscriberSource, group_records
from rollout.tasks import Task, build_task
from rollout.worker_metrics import RolloutMetrics, WorkerStats

log = logging.getLogger("reval.rollout")

AHEAD_LOG_S = 30.0
"""A worker that has waited this long for the learner (``buffer.generate_ahead``) says so once."""

PROGRESS_S = 30.0
"""A worker's long waits (its engine's start, the learner's first weights) say what they wait
for when they start and again this often while they go on."""

RUN_ENDED = ("done",)
"""The run's status phases (its learner's last word) after which a worker has nothing to do: the
run finished. Not ``stopped``: a learner stopped by a signal (``docker stop``, a compose restart,
Ctrl-C) comes back and resumes, and its workers generate on meanwhile; a run stopped on request
(``reval runs stop``) ends its workers through the control's ``stopping`` phase."""

RUN_END_CHECK_S = 2.0
"""How often a worker reads the run's status for ``RUN_ENDED``."""


@contextlib.contextmanager
def _saying(what: str, every_s: float | None = None) -> Iterator[None]:
    """A line when ``what`` starts, one every ``every_s`` (default ``PROGRESS_S``) while it goes
    on (from a thread: the step blocks), and one with the time it took when it is done."""
    every_s = PROGRESS_S if every_s is None else every_s
    t0 = time.monotonic()
    done = threading.Event()
    log.info("%s ...", what)

    def tick() -> None:
        while not done.wait(every_s):
            log.info("%s: still at it after %.0f s", what, time.monotonic() - t0)

    threading.Thread(target=tick, name="reval-progress", daemon=True).start()
    try:
        yield
    finally:
        done.set()
    log.info("%s: done in %.1f s", what, time.monotonic() - t0)


class RolloutWorker:
    def __init__(
        self,
        cfg: RunConfig,
        worker_id: str | None = None,
        metrics: RolloutMetrics | None = None,
        client: redis.Redis | None = None,
    ) -> None:
        self.cfg = cfg
        self.worker_id = worker_id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:4]}"
        self.metrics = metrics or RolloutMetrics()
        b = cfg.buffer
        if b.backend != "redis":
            raise ValueError("a rollout worker needs buffer.backend=redis (the replay service)")
        self.client = client or connect(cfg.redis.url)
        self.stop = threading.Event()
        self.stats = WorkerStats()
        self.control = RunControl(self.client, cfg.redis.prefix, cfg.name)
        self._end_checked = 0.0
        self._status_at_start = self._ended_status()
        """The run's status when this worker started, if it had ended then (a learner run before
        this worker): not a reason to exit; a later end is (``_run_ended``)."""
        with _saying(f"worker {self.worker_id}: starting the {cfg.rollout.engine} engine"):
            engine, self.tokenizer = build_engine(cfg, cfg.seed, self.worker_id)
        self.engine = as_stream(engine)
        """The engine as the loop drives it (the HF engine behind ``LockstepStream``)."""
        self.task: Task = build_task(
            cfg.task, cfg.seed, self.tokenizer, cfg.rollout, self.metrics.registry
        )
        self.episodes = EpisodeRunner.from_config(cfg.task)
        """The multi-turn environment of ``task.environment`` (None: single-turn answers)."""
        self.ring = make_producer(
            b, cfg.name, cfg.redis, BufferMetrics(self.metrics.registry, role="producer"),
            spool_dir=cfg.paths.spool,  # (what a stop with Redis away or a corrupt ring kept)
        )  # fmt: skip
        self.dealer = PromptDealer(
            self.client, cfg.redis.prefix, cfg.name, list(self.task.prompts), seed=cfg.seed,
            retry_s=cfg.redis.outage_s,
        )  # fmt: skip
        self.weights = build_subscriber(cfg, self.client, self.worker_id)
        self.paused = False
        """The run is paused (its control's phase)."""
        self.standby = False
        """More workers are registered than the run's desired count (``reval runs scale``) and
        this is one of the youngest: it generates nothing, as when paused, until the count
        grows or an older worker goes (the order: start time, then id)."""
        self._standby_checked = 0.0
        self.started_at = time.time()
        self.status = "starting"
        """What the registration says: starting, running, paused or standby."""
        self._waiting_since: float | None = None
        self._said_waiting = False
        self.samples_per_insert: float = cfg.samples_per_insert
        """K of the limiter (live changes followed): what ``generate_ahead`` measures against."""
        self.last_tick = time.monotonic()
        self._heartbeat: threading.Thread | None = None
        self.params = SamplingParams(
            n=cfg.rollout.n,
            temperature=cfg.rollout.temperature,
            top_p=cfg.rollout.top_p,
            max_new_tokens=cfg.rollout.max_new_tokens,
        )

    # -- registration -------------------------------------------------------------------------

    def _register(self, status: str | None = None) -> None:
        """Registration with ``status`` (it becomes the worker's status; None: the status it
        has), refreshed by the heartbeat with the status of the moment."""
        if status is not None:
            self.status = status
        status = self.status
        info = {
            "id": self.worker_id,
            "engine": self.cfg.rollout.engine,
            "device": str(self.engine.device),
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "policy_version": self.engine.policy_version,
            "status": status,
            "started": self.started_at,
            "batches": self.stats.batches,
            "trajectories": self.stats.trajectories,
            "last_seen": time.time(),
        }
        with skip_on_outage(f"worker {self.worker_id}: heartbeat"):  # (Redis away: next beat)
            registry.register(self.client, self.cfg.redis.prefix, self.cfg.name, info,
                              self.cfg.rollout.heartbeat_s)  # fmt: skip

    def _beat(self) -> None:
        while not self.stop.wait(self.cfg.rollout.heartbeat_s):
            self._register()

    def _deregister(self) -> None:
        with skip_on_outage(f"worker {self.worker_id}: deregistration"):  # (it expires)
            registry.deregister(self.client, self.cfg.redis.prefix, self.cfg.name,
                                self.worker_id)  # fmt: skip

    # -- probes (/healthz, /readyz) ------------------------------------------------------------

    def health(self) -> tuple[bool, str]:
        """Its loop goes round (a batch or a pause poll at least every few minutes)."""
        idle = time.monotonic() - self.last_tick
        limit = max(600.0, 10 * self.cfg.sync.timeout_s)
        return idle < limit, f"last loop {idle:.0f} s ago"

    def ready(self) -> tuple[bool, str]:
        """It has weights and reaches Redis."""
        if self.weights.version is None:
            return False, "waiting for the learner's first weights"
        self.client.ping()
        return True, f"policy version {self.engine.policy_version}"

    def _follow_control(self) -> bool:
        """The run's control keys between batches: pause, stop (drain), the sampling
        temperature. False when the run is stopping."""
        try:
            st = self.control.read()
        except (redis.ConnectionError, redis.TimeoutError):
            return True  # Redis away: keep generating; the ring spools
        if st.phase == "stopping":
            log.info("worker %s: the run is stopping: draining", self.worker_id)
            return False
        if self._run_ended():
            return False
        paused, standby = st.phase == "paused", self._surplus(st.workers)
        if (paused, standby) != (self.paused, self.standby):
            self.paused, self.standby = paused, standby
            self._register("paused" if paused else "standby" if standby else "running")
            log.info("worker %s: %s", self.worker_id, self.status)
        if st.hparams.samples_per_insert is not None:
            self.samples_per_insert = float(st.hparams.samples_per_insert)
        temperature = st.hparams.temperature
        if temperature is not None and temperature != self.params.temperature:
            self.params = dataclasses.replace(self.params, temperature=float(temperature))
            detail = {"temperature": temperature, "worker": self.worker_id}
            self.control.record("temperature_applied", detail, step=self.engine.policy_version)
            log.info("worker %s: sampling temperature %g", self.worker_id, temperature)
        return True

    def _ended_status(self) -> tuple[str, float | None] | None:
        """The run's status phase and time when its learner has ended it (``RUN_ENDED``), else
        None (also with Redis away)."""
        try:
            st = self.control.read_status()
        except (redis.ConnectionError, redis.TimeoutError):
            return None
        return (st.phase, st.time) if st.phase in RUN_ENDED else None

    def _run_ended(self) -> bool:
        """Whether the run's learner has ended the run since this worker started (its status
        ``done``, read at most every ``RUN_END_CHECK_S``); then it says so in one
        line and the worker leaves as on a stop: a worker started by hand exits 0 when its run
        is over instead of waiting for a learner forever."""
        now = time.monotonic()
        if now - self._end_checked < RUN_END_CHECK_S:
            return False
        self._end_checked = now
        ended = self._ended_status()
        if ended is None or ended == self._status_at_start:
            return False
        log.info("worker %s: the run is %s (its learner ended it): exiting", self.worker_id,
                 ended[0])  # fmt: skip
        return True

    @property
    def idle(self) -> bool:
        """Generates nothing now: the run is paused or this worker is on standby."""
        return self.paused or self.standby

    def _surplus(self, desired: int | None) -> bool:
        """Whether this worker is beyond the run's desired count: ranked by start time among the
        registered workers (read at most once a second), it is at ``desired`` or later. Under
        ``reval launch`` the driver also stops the surplus workers; under compose, where each
        worker is a service, this is how ``reval runs scale`` takes effect."""
        if desired is None:
            return False
        now = time.monotonic()
        if now - self._standby_checked < 1.0:
            return self.standby
        self._standby_checked = now
        r = self.cfg.redis
        me = (self.started_at, self.worker_id)
        try:
            peers = registry.workers(self.client, r.prefix, self.cfg.name)
        except (redis.ConnectionError, redis.TimeoutError):
            return self.standby  # Redis away: as before
        order = {(float(w.get("started", 0.0)), str(w["id"])) for w in peers}
        return sorted(order | {me}).index(me) >= desired

    def _task_setup(self, timeout_s: float = 60.0) -> None:
        """Take the learner's calibration of the task (the one-shot task); the learner shares
        it before its first weights, so it is there once weights are."""
        if self.cfg.task.kind != "oneshot":
            return
        from rollout.tasks import apply_task_setup

        key = registry.task_key(self.cfg.redis.prefix, self.cfg.name)
        deadline = time.monotonic() + timeout_s
        while not self.stop.is_set():
            try:
                raw = self.client.get(key)
            except (redis.ConnectionError, redis.TimeoutError):
                raw = None
            if raw is not None:
                try:
                    apply_task_setup(self.task, json.loads(raw))
                except (ValueError, TypeError) as err:
                    raise ValueError(f"the learner's task setup cannot be used: {err}") from err
                log.info("worker %s: task calibrated by the learner", self.worker_id)
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"no task calibration from the learner at {key}")
            self.stop.wait(0.2)

    # -- weights --------------------------------------------------------------------------------

    def _load(self, force: bool = False) -> bool:
        """Load newer announced weights (``WeightSubscriber.update``); True if it loaded."""
        version = self.weights.update(self.engine.receiver, force=force)
        if version is None:
            return False
        self.stats.weight_loads += 1
        self.metrics.weight_loads.inc()
        self.metrics.version.set(version)
        return True

    def wait_for_weights(self, timeout_s: float | None = None) -> bool:
        """Block until the learner has announced weights and they are loaded (or stop/timeout)."""
        t0 = time.monotonic()
        said = 0.0
        while not self.stop.is_set():
            self.last_tick = time.monotonic()  # (waiting is not being stuck: /healthz)
            if self._load(force=True):
                self.metrics.weight_wait.inc(time.monotonic() - t0)
                self.stats.weight_wait_s += time.monotonic() - t0
                if said:
                    log.info("worker %s: first weights loaded after %.0f s", self.worker_id,
                             time.monotonic() - t0)  # fmt: skip
                return True
            if timeout_s is not None and time.monotonic() - t0 > timeout_s:
                break
            try:
                if self.control.read().phase == "stopping":
                    log.info("worker %s: the run stopped before any weights", self.worker_id)
                    break
            except (redis.ConnectionError, redis.TimeoutError):
                pass
            if self._run_ended():
                break
            if not said or time.monotonic() - said >= PROGRESS_S:
                log.info("worker %s: waiting for the learner's first weights of run %r (%.0f s "
                         "so far; it announces them once it has started)", self.worker_id,
                         self.cfg.name, time.monotonic() - t0)  # fmt: skip
                said = time.monotonic()
            self.stop.wait(self.cfg.rollout.weights_poll_s)
        self.metrics.weight_wait.inc(time.monotonic() - t0)
        self.stats.weight_wait_s += time.monotonic() - t0
        return False

    # -- the loop -------------------------------------------------------------------------------

    def run(self, max_batches: int | None = None) -> WorkerStats:
        """Register, wait for the first weights, then generate until stopped (``max_batches``:
        at most that many batches, streaming: groups)."""
        self._register("starting")
        self._heartbeat = threading.Thread(target=self._beat, name="heartbeat", daemon=True)
        self._heartbeat.start()
        try:
            if self.cfg.rollout.wait_for_weights and not self.wait_for_weights():
                return self.stats
            self._task_setup()
            self._register("running")
            self._stream(max_batches)
        except Exception as err:
            if not cut_short(err):
                raise
            # (a stop during an outage: the shutdown keeps its records in the spool directory,
            # and says so in one line)
            log.debug("worker %s: its wait for Redis cut short: %s", self.worker_id, err)
        finally:
            self.shutdown()
        return self.stats

    def _stream(self, max_batches: int | None) -> None:
        """The one loop (``rollout/streaming.py``'s ``Streamer``, for every engine and for
        multi-turn episodes): a "batch" is one prompt's group, graded and inserted as soon as
        its answers are done. ``rollout.streaming = false`` (and every engine that does not
        stream, the HF engine) admits ``worker_prompts`` prompts at a time, with the engine
        empty: lockstep batches, weights loaded between them."""
        r = self.cfg.rollout
        n_prompts = r.worker_prompts or r.prompts_per_round
        lockstep = not r.streams()

        def on_group(group: Group) -> None:  # (the grading thread)
            t0 = time.perf_counter()
            records, raw = group_records(
                group, self.task, self.tokenizer, self.cfg.algo.reward,
                stop_ids=self.engine.stop_ids, truncation=self._truncation(),
                worker_id=self.worker_id, run_id=self.cfg.name,
            )  # fmt: skip
            verify_s = time.perf_counter() - t0
            if skipped := group.skipped():
                log.warning("worker %s: episodes skipped (their environment misbehaved): %s",
                            self.worker_id, skipped)  # fmt: skip
                for reason, n in skipped.items():
                    self.metrics.episodes_skipped.labels(reason=reason).inc(n)
            if not records:  # (every episode's environment failed to start or step)
                return
            self.ring.insert(records)  # never waits for the learner; spools if needed
            tokens = sum(int(t.action_mask.sum()) if t.action_mask.size else
                         int(t.response_ids.size) for t in records)  # fmt: skip
            gen_s = max(time.monotonic() - group.submitted - verify_s, 0.0)
            self._counted(records, tokens, sum(raw) / max(len(raw), 1), gen_s, verify_s)

        def load() -> int | None:
            if not self._load():
                return None
            self._register()
            return self.engine.policy_version

        def should_stop() -> bool:
            self.last_tick = time.monotonic()
            return self.stop.is_set() or not self._follow_control()

        ahead_since: list[float] = []
        batch_s = [0.0]

        def on_step(seconds: float) -> None:
            """Lockstep: a batch's engine steps (one, or one per turn of its episodes), summed
            and given to the thread tuner (``reval/threads.py``) once the batch is done."""
            batch_s[0] += seconds
            if not self.engine.running():
                thread_tick(batch_s[0], "batch")
                batch_s[0] = 0.0

        def may_admit() -> bool:
            if self.idle:
                return False
            now = time.monotonic()
            if self._ahead():
                self._say_waiting(now)
                if ahead_since:
                    self.metrics.ahead_wait.inc(now - ahead_since[0])
                ahead_since[:] = [now]
                return False
            if ahead_since:
                self.metrics.ahead_wait.inc(now - ahead_since.pop())
            self._waiting_since = None
            return True

        streamer = Streamer(
            self.engine,
            self.tokenizer,
            lambda _prompt: self.params,
            on_group,
            n=r.n,
            max_inflight=n_prompts * r.n if lockstep else r.max_inflight or n_prompts * r.n,
            inflight="finish" if lockstep else r.inflight_updates,
            weights=SubscriberSource(self.weights, load),
            seed=zlib.crc32(f"{self.cfg.seed}/{self.worker_id}".encode()) & 0x7FFFFFFF,
            key_prefix=f"{self.worker_id}-{uuid.uuid4().hex[:6]}",  # (group ids: one run's own)
            episodes=self.episodes,
            lockstep=lockstep,
            on_step=on_step if lockstep else None,
        )
        max_groups = None if max_batches is None else max_batches * (n_prompts if lockstep else 1)
        t0 = time.monotonic()
        stats = streamer.run(lambda k: [p for _, p in self.dealer.take(k)], should_stop,
                             may_admit, max_groups)  # fmt: skip
        self.stats.busy_s += time.monotonic() - t0 - stats.idle_s

    def _say_waiting(self, now: float) -> None:
        """One log line when the worker has waited for the learner for a while (a worker run
        with no learner, say, would otherwise look stuck)."""
        if self._waiting_since is None:
            self._waiting_since, self._said_waiting = now, False
        elif now - self._waiting_since > AHEAD_LOG_S and not self._said_waiting:
            self._said_waiting = True
            log.info("worker %s: waiting for the learner: generation is %s samples ahead of it "
                     "(buffer.generate_ahead; \"off\" lets workers run unpaced)",
                     self.worker_id, self.cfg.generate_ahead(self.samples_per_insert))  # fmt: skip

    def _ahead(self) -> bool:
        """Whether generation is more than ``buffer.generate_ahead`` samples ahead of the
        learner under the limiter (then the worker waits: each trajectory is used K times),
        unless the learner's fresh updates would run short: fewer never-taken trajectories are
        held than one round of them takes (a schedule that cannot reach K, e.g. every update
        fresh with ``buffer.samples_per_insert`` above 1, would otherwise wait on both sides)."""
        limit = self.cfg.generate_ahead(self.samples_per_insert)
        if limit is None:
            return False
        try:
            st = self.ring.stats()
        except (redis.ConnectionError, redis.TimeoutError, ConnectionError):
            return False  # Redis away: generate; the ring spools
        if self.samples_per_insert * st.inserted - st.sampled <= limit:
            return False
        untaken = st.inserted - st.taken - st.evicted_unused
        return untaken >= self.cfg.fresh_updates * self.cfg.batch_size

    def _truncation(self) -> Truncation:
        """What an answer cut at the token limit earns (``algo.truncated_reward``,
        ``algo.overlong_penalty_tokens``)."""
        return Truncation.from_config(self.cfg.algo, self.params.max_new_tokens)

    def _counted(self, records: list[Trajectory], tokens: int, reward_mean: float, gen_s: float,
                 verify_s: float) -> None:  # fmt: skip
        """A group inserted: the worker's stats and metrics. Rates are over its generation and
        grading time together."""
        self.stats.batches += 1
        self.stats.trajectories += len(records)
        self.stats.tokens += tokens
        versions = {t.policy_version for t in records}
        versions.update(int(v) for t in records for v in t.version_spans[1::2])
        for v in versions:
            self.stats.versions[v] = self.stats.versions.get(v, 0) + 1
        m = self.metrics
        m.batches.inc()
        m.trajectories.inc(len(records))
        m.tokens.inc(tokens)
        seconds = max(gen_s + verify_s, 1e-9)
        m.tokens_per_s.set(tokens / seconds)
        m.traj_per_s.set(len(records) / seconds)
        m.reward.set(reward_mean)
        m.verify_seconds.observe(verify_s)
        m.gen_seconds.observe(gen_s)
        m.version.set(self.engine.policy_version)

    def shutdown(self) -> None:
        """Push what is finished (flush the spool), deregister, release the grading pool and the
        engine."""
        self.stop.set()
        self.ring.close(flush_s=30.0)
        if self.ring.spooled:
            n = self.ring.spooled
            log.error("worker %s: %d trajectories could not be pushed", self.worker_id, n)
        self._deregister()
        self.weights.close()
        close_verifier = getattr(self.task.verifier, "close", None)
        if close_verifier is not None:  # the math task's grading pool
            close_verifier()
        self.engine.close()  # (the vLLM engine's processes: left running, they hold its pipes)


def main(cfg: RunConfig, worker_id: str | None, max_batches: int | None, port: int | None) -> int:
    port = port if port is not None else cfg.metrics.prometheus_port
    if port is not None:  # a taken port is said before the engine starts (minutes on a GPU)
        from reval.ops_http import check_port

        check_port(port, cfg.metrics.addr)
    apply_threads(thread_budget("worker"))  # before the engine starts (OMP_NUM_THREADS wins)
    metrics = RolloutMetrics()
    worker = RolloutWorker(cfg, worker_id, metrics)

    def on_signal(signum: int) -> None:
        log.info("worker %s: signal %d, draining", worker.worker_id, signum)
        worker.stop.set()
        stop_waiting()  # (a wait for Redis ends now: its records go to the spool directory)

    signal.signal(signal.SIGTERM, off_main(on_signal))  # (reval/signals.py: why a thread)
    signal.signal(signal.SIGINT, off_main(on_signal))
    if port is not None:
        from reval.ops_http import OpsServer

        OpsServer(port, metrics.registry, cfg.metrics.addr, worker.health, worker.ready)
    stats = worker.run(max_batches)
    # Its work is done: a SIGTERM from now on (a supervisor stopping the workers of a run that
    # ended, as they leave by themselves) must not kill the exit under way: the interpreter's
    # teardown puts SIGTERM's default back for a Python handler, and the worker ended -15.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    print(
        json.dumps(
            {
                "worker": worker.worker_id,
                "batches": stats.batches,
                "trajectories": stats.trajectories,
                "tokens": stats.tokens,
                "weight_loads": stats.weight_loads,
                "versions": sorted(set(stats.versions)),
                "weight_wait_s": round(stats.weight_wait_s, 3),
                "busy_s": round(stats.busy_s, 3),
                "elapsed_s": round(time.monotonic() - stats.started, 3),
            }
        ),
        flush=True,
    )
    if worker.weights.joined_broadcast:
        # The broadcast receiver's thread may sit in a gloo or TCPStore call (the learner gone):
        # leave without the interpreter's teardown, which would abort under it. Everything
        # that matters (pushes, deregistration, the summary) is done.
        logging.shutdown()
        os._exit(0)
    return 0
