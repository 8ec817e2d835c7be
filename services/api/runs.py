"""What the run endpoints do, for the routes in ``services/api/routes.py`` to return: the API's
registry of runs in Redis (``Store``), each run's state read through the typed readers of the
ground floor (``RunControl``, ``RunLease``, the worker registry, the ring's counters), and the
actions, each a write to the run's control keys or a ``reval launch`` process. No Redis key is
spelt here: they are built in ``reval/redis.py``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import redis
from fastapi import HTTPException

from buffer.redis_layout import peek_stats
from reval import registry
from reval.config import (
    DEPRECATED_REDIS,
    ENV_PREFIX,
    ApiConfig,
    BufferConfig,
    ConfigError,
    RedisConfig,
    RunConfig,
    build_config,
    public_dump,
)
from reval.control import DRIVER_TIMEOUT_S, STARTING_TIMEOUT_S, LiveHParams, RunControl, RunLease
from reval.redis import claim_key, connect, runs_key
from reval.run_dir import RunDir
from reval.threads import machine_cpus
from services.api.models import Accepted, BufferInfo, CreateRun, Event, Health, RunInfo, WorkerInfo
from services.api.run_checks import check_user_code, confine, invalid

FINISHED = ("stopped", "done", "failed")
LIVE = ("starting", "running", "paused")
Launcher = Callable[[str, Path], int]
"""``launcher(name, config_path) -> pid``: how a run is started (default: ``reval launch``)."""


NAME_SHOWN = 80
"""Longest run name an error repeats whole (a valid one has at most 64 characters)."""


def cut(text: str, quote: bool = False) -> str:
    """``text`` as an error message echoes it (quoted with ``quote``): cut after ``NAME_SHOWN``
    characters with the count of those left out (a 10,000-character name in a URL is not echoed
    back). The one cut of every echoed string (``shown``, the API's 422s)."""
    head = repr(text[:NAME_SHOWN]) if quote else text[:NAME_SHOWN]
    if len(text) <= NAME_SHOWN:
        return head
    return f"{head}... ({len(text) - NAME_SHOWN} more characters)"


def shown(name: str) -> str:
    """``name`` quoted for an error message, cut (``cut``)."""
    return cut(name, quote=True)


class Store:
    """The API's state in Redis."""

    def __init__(self, cfg: ApiConfig, client: redis.Redis | None = None) -> None:
        self.cfg = cfg
        self.client = client or connect(cfg.redis_url, timeout_s=10)
        self.runs_key = runs_key(cfg.key_prefix)

    def get(self, name: str) -> dict[str, Any] | None:
        raw = self.client.hget(self.runs_key, name)
        return None if raw is None else dict(json.loads(raw))

    def put(self, name: str, entry: dict[str, Any]) -> None:
        self.client.hset(self.runs_key, name, json.dumps(entry))

    def names(self) -> list[str]:
        return sorted(k.decode() for k in self.client.hkeys(self.runs_key))

    def control(self, name: str) -> RunControl:
        return RunControl(self.client, self.cfg.key_prefix, name)


def _pid_alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    # A zombie (our own child that exited) is not alive either.
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except OSError:
        return True
    return state != "Z"


class RunService:
    """The runs this API manages: what each endpoint returns, built from Redis."""

    def __init__(self, cfg: ApiConfig, store: Store, launcher: Launcher | None = None) -> None:
        self.cfg, self.store, self.launcher = cfg, store, launcher
        self.children: dict[int, subprocess.Popen[bytes]] = {}
        """Runs this process started, by pid (reaped when their status is read)."""

    # -- reading ---------------------------------------------------------------------------------

    def ready(self) -> Health:
        try:
            self.store.client.ping()
        except (redis.ConnectionError, redis.TimeoutError) as err:
            return Health(ok=False, detail=f"redis: {err}")
        return Health(ok=True)

    def entry(self, name: str) -> dict[str, Any]:
        """The run's entry in the API's registry; a 404 otherwise, saying whether anything of
        that name has started (``not_registered``)."""
        entry = self.store.get(name)
        if entry is None:
            raise HTTPException(404, self.not_registered(name))
        return entry

    def not_registered(self, name: str) -> str:
        """Why ``name`` has no entry: a learner (its lease, or its ``starting`` status) or
        workers of that name have started but the learner has not registered the run yet (it
        does once its model is built: about a minute after ``docker compose up``), it is being
        created, or nothing of it exists."""
        if len(name) > NAME_SHOWN:
            return f"no run {shown(name)}"
        client, prefix = self.store.client, self.cfg.key_prefix
        try:
            holder = RunLease(client, prefix, name, 1).holder()
            status = self.store.control(name).read_status()  # (a starting learner says so)
            if status.phase == "starting" and time.time() - (status.time or 0) < STARTING_TIMEOUT_S:
                holder = holder or {"starting": True}
            workers = registry.workers(client, prefix, name)
            creating = bool(client.exists(claim_key(prefix, name)))
        except (redis.ConnectionError, redis.TimeoutError):
            return f"no run {shown(name)} (Redis unreachable: cannot tell whether it is starting)"
        if creating:
            return f"run {shown(name)} is not registered yet: it is being created"
        if holder is not None or workers:
            who = [*(["its learner"] if holder is not None else []),
                   *([f"{len(workers)} rollout worker(s)"] if workers else [])]  # fmt: skip
            return (f"run {shown(name)} is not registered yet: {' and '.join(who)} started, and "
                    "its learner registers it once its model is built (a minute or more after "
                    "the start); ask again")  # fmt: skip
        return (f"no run {shown(name)}: not created here, and no learner or rollout worker of "
                "that name has started")  # fmt: skip

    def runs(self) -> list[RunInfo]:
        out = []
        for name in self.store.names():
            entry = self.store.get(name)
            if entry is not None:
                out.append(self.info(name, entry))
        return out

    def _phase(self, name: str, entry: dict[str, Any], control: RunControl) -> tuple[str, bool]:
        """The run's phase and whether the process driving it is alive."""
        status, ctl = control.read_status(), control.read()
        child = self.children.get(entry.get("pid"))  # type: ignore[arg-type]
        if child is not None:
            child.poll()  # reap it when it has exited
        if entry.get("external"):  # started outside the API: its status and its lease
            # The learner holds the run's lease while it lives (renewed every third of
            # learner.lease_s): a status that says running with no lease is a learner that died.
            phase = status.phase or "starting"
            held = RunLease(self.store.client, self.cfg.key_prefix, name, 1).holder() is not None
            # A learner that starts (its model, pretraining) says so every few seconds until
            # its first update (learner/ranks.py: StartingStatus).
            starting = phase == "starting" and time.time() - (status.time or 0) < STARTING_TIMEOUT_S
            alive = phase not in FINISHED and (held or starting)
            if not alive and phase not in FINISHED:
                phase = "failed"
        else:
            # The launch driver's heartbeat in Redis (any API replica or host sees it); a local
            # child's pid; or a start too recent for a first heartbeat.
            now = time.time()
            started_at = float(entry.get("started_at") or 0)
            beat = ctl.driver_seen
            alive = (
                (beat is not None and now - beat < DRIVER_TIMEOUT_S)
                or _pid_alive(entry.get("pid"))
                or (now - started_at < 120 and (beat is None or beat < started_at))
            )
            phase = status.phase or ("starting" if alive else "registered")
            if entry.get("started") and not alive and phase not in FINISHED:
                phase = "failed"  # the launch process is gone without a final status
        if alive and ctl.phase == "stopping" and phase not in FINISHED:
            phase = "stopping"
        return phase, alive

    def info(self, name: str, entry: dict[str, Any]) -> RunInfo:
        control = self.store.control(name)
        phase, _alive = self._phase(name, entry, control)
        status, ctl = control.read_status(), control.read()
        stats = peek_stats(self.store.client, self.cfg.key_prefix, name)  # (no side effect)
        buf = None
        if stats is not None:
            buf = BufferInfo(size=stats.size, capacity=stats.capacity, inserted=stats.inserted,
                             sampled=stats.sampled, evicted=stats.evicted)  # fmt: skip
        workers = [
            WorkerInfo(id=w["id"], status=w.get("status"), policy_version=w.get("policy_version"),
                       trajectories=w.get("trajectories"), last_seen=w.get("last_seen"))
            for w in registry.workers(self.store.client, self.cfg.key_prefix, name)
        ]  # fmt: skip
        return RunInfo(
            name=name,
            phase=phase,
            created=entry["created"],
            step=status.step,
            policy_version=status.policy_version,
            desired_workers=ctl.workers,
            workers=workers,
            buffer=buf,
            hparams=status.hparams,
            last_metrics=status.last,
            checkpoints=status.checkpoints,
            pid=entry.get("pid"),
        )

    def events(self, name: str, after: str, count: int) -> list[Event]:
        self.entry(name)
        if after != "-" and not _valid_stream_id(after):
            raise invalid(["query", "after"], "not a stream id")
        try:
            return [Event(**e) for e in self.store.control(name).events(count=count, after=after)]
        except redis.ResponseError as err:  # an id Redis cannot take (too large)
            raise invalid(["query", "after"], str(err)) from None

    # -- creating and starting -------------------------------------------------------------------

    def run_config(self, body: CreateRun) -> RunConfig:
        """The POSTed config made the API's (its Redis, key prefix and output directory),
        checked (422s naming the field)."""
        cfg, data = self.cfg, dict(body.config)

        def section(key: str) -> dict[str, Any]:
            """A config section given in the body: an object, or a 422 naming it."""
            value = data.get(key, {})
            if not isinstance(value, dict):
                raise invalid(["body", "config", key], f"config.{key} must be an object (a "
                              f"section of the config), got {type(value).__name__}")  # fmt: skip
            return dict(value)

        buffer, redis_section = section("buffer"), section("redis")
        # The run uses the API's replay service and key prefix: the API must see its keys (a
        # default left in a resolved config is replaced; another explicit value is refused).
        for name, key, value in (("buffer", "backend", "redis"), ("redis", "url", cfg.redis_url),
                                 ("redis", "prefix", cfg.key_prefix)):  # fmt: skip
            where = buffer if name == "buffer" else redis_section
            model = BufferConfig if name == "buffer" else RedisConfig
            old = next((o for o, n in DEPRECATED_REDIS.items() if n == key), None)
            loc = [name, key]
            given = where.get(key, value)
            if name == "redis" and old in buffer:  # (the deprecated name, buffer.<old>)
                given, loc = buffer.pop(old), ["buffer", old]
            if given != value and given != model.model_fields[key].default:
                raise invalid(["body", "config", *loc],
                              f"this API manages runs with {name}.{key}={value!r}")  # fmt: skip
            where[key] = value
        data["buffer"], data["redis"] = buffer, redis_section
        # (a resolved config, as ``reval runs create`` sends, carries the default: the API's)
        if data.get("output_dir") in (None, RunConfig.model_fields["output_dir"].default):
            data["output_dir"] = cfg.output_dir
        if body.workers is not None:
            data["launch"] = {**section("launch"), "workers": body.workers}
        try:
            run_cfg = build_config(data)
        except ConfigError as err:
            raise invalid(["body", "config"], str(err)) from None
        confine(run_cfg, cfg)
        check_user_code(run_cfg, cfg, run_env(os.environ, cfg))
        return run_cfg

    def create(self, body: CreateRun) -> RunInfo:
        run_cfg = self.run_config(body)
        name, store = run_cfg.name, self.store
        old = store.get(name)
        if old is not None and self.info(name, old).phase not in (*FINISHED, "registered"):
            raise HTTPException(409, f"run {shown(name)} exists and is live")
        checkpoints = run_cfg.paths.has_checkpoint()
        if checkpoints and not body.resume:
            raise HTTPException(409, _checkpoints_hint(name, run_cfg.run_dir, old is not None))
        if body.resume and not checkpoints:
            raise HTTPException(409, f"run {shown(name)} has no checkpoint in {run_cfg.run_dir} to "
                                "resume from: create it without resume")  # fmt: skip
        # One creator at a time per name (two concurrent creates must not both launch).
        claim = claim_key(self.cfg.key_prefix, name)
        if not store.client.set(claim, "1", nx=True, ex=30):
            raise HTTPException(409, f"run {shown(name)} is being created")
        control = store.control(name)
        control.clear()
        entry: dict[str, Any] = {
            "created": time.time(),
            "config": public_dump(run_cfg),  # (no secret in Redis: ``launch`` adds it back)
            "pid": None,
            "started": False,
        }
        control.set_workers(run_cfg.launch.workers)
        control.record("created", {"workers": run_cfg.launch.workers, "resume": body.resume})
        if body.start:
            self._start(name, entry)
        store.put(name, entry)
        store.client.delete(claim)
        return self.info(name, entry)

    def start(self, name: str) -> Accepted:
        entry, _ = self._acting(name, "start", ("registered", *FINISHED))
        claim = claim_key(self.cfg.key_prefix, name)
        if not self.store.client.set(claim, "1", nx=True, ex=30):
            raise HTTPException(409, f"run {shown(name)} is being started")
        self.store.control(name).restart()  # the last start's final status goes
        self._start(name, entry)
        self.store.put(name, entry)
        self.store.control(name).record("start")
        return Accepted(run=name, action="start", detail={"pid": entry["pid"]})

    def _start(self, name: str, entry: dict[str, Any]) -> None:
        entry["pid"] = self.launch(name, entry)
        entry["started"] = True
        entry["started_at"] = time.time()

    def launch(self, name: str, entry: dict[str, Any]) -> int:
        """Start the run: ``reval launch`` in its own session (it outlives this API process),
        ``--resume`` when its directory holds a checkpoint."""
        paths = RunDir(Path(self.cfg.output_dir) / name)
        paths.root.mkdir(parents=True, exist_ok=True)
        paths.request_config.write_text(json.dumps(entry["config"], indent=2))
        if self.launcher is not None:
            return self.launcher(name, paths.request_config)
        env = run_env(os.environ, self.cfg)  # (scrubbed: no token, no other secret)
        cmd = [sys.executable, "-m", "services.cli", "launch", "--config",
               str(paths.request_config)]  # fmt: skip
        if paths.has_checkpoint():
            cmd.append("--resume")  # a run started again continues from its checkpoint
        with paths.launch_log.open("ab") as log_file:
            proc = subprocess.Popen(
                cmd, stdout=log_file, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        for pid in [p for p, c in self.children.items() if c.poll() is not None]:
            del self.children[pid]  # reaped
        self.children[proc.pid] = proc
        return proc.pid

    # -- steering --------------------------------------------------------------------------------

    def _acting(
        self, name: str, action: str, allowed: tuple[str, ...]
    ) -> tuple[dict[str, Any], RunInfo]:
        entry = self.entry(name)
        current = self.info(name, entry)
        if current.phase not in allowed:
            raise HTTPException(409, f"cannot {action} run {shown(name)}: it is {current.phase}")
        return entry, current

    def pause(self, name: str) -> Accepted:
        self._acting(name, "pause", ("starting", "running"))
        if self.store.control(name).read().phase == "paused":
            raise HTTPException(409, f"run {shown(name)} is already pausing")
        self.store.control(name).set_phase("paused")
        return Accepted(run=name, action="pause")

    def resume(self, name: str) -> Accepted:
        # (the learner reports "paused" one update after the request: the request decides)
        self._acting(name, "resume", LIVE)
        if self.store.control(name).read().phase != "paused":
            raise HTTPException(409, f"run {shown(name)} is not paused")
        self.store.control(name).set_phase("running")
        return Accepted(run=name, action="resume")

    def stop(self, name: str) -> Accepted:
        self._acting(name, "stop", LIVE)
        self.store.control(name).set_phase("stopping")
        return Accepted(run=name, action="stop")

    def request(self, name: str, what: str) -> Accepted:
        """``checkpoint`` or ``export``: asked of the learner, done at its next update."""
        self._acting(name, what, LIVE)
        n = self.store.control(name).request(what)
        return Accepted(run=name, action=what, detail={"request": n})

    def scale(self, name: str, workers: int) -> Accepted:
        """The desired count is written to the run's control; the answer says what the
        deployment will do with it (``deployment``)."""
        entry, current = self._acting(name, "scale", LIVE)
        control = self.store.control(name)
        control.set_workers(workers)
        running = len([w for w in current.workers if w.status != "standby"])
        launcher = control.launcher() if entry.get("external") else None
        return Accepted(run=name, action="scale",
                        detail={"workers": workers, "running": running,
                                **self.deployment(entry, workers, running, launcher)})  # fmt: skip

    def deployment(
        self,
        entry: dict[str, Any],
        workers: int,
        running: int,
        launcher: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Who runs the run's workers (``executor``: ``external`` for a run started outside the
        API, under compose or by hand, that no launcher scales; ``ray`` for ``reval launch`` on
        the cluster at ``api.ray_address``, or at the address a hand-started ``reval launch``
        joined (its mark, ``launcher``: ``RunControl.launcher``); ``local-ray`` for ``reval
        launch`` on a Ray of its own), whether it can start workers (``can_start``), how many
        that own Ray has room for (``room``, CPU workers) and a ``note`` saying what happens
        next."""
        if launcher is not None:
            return self._hand_launched(launcher, workers)
        if entry.get("external"):
            note = (f"this run was started outside the API (compose or by hand): the API starts "
                    f"no worker; workers beyond {workers} go on standby")  # fmt: skip
            if workers > running:
                note += (f", but only the {running} running now generate: more need more worker "
                         "processes (a compose file with more rollout services: `reval compose "
                         "--workers N`, or `reval rollout` by hand)")  # fmt: skip
            return {"executor": "external", "can_start": False, "note": note}
        out: dict[str, Any] = {"executor": "ray", "can_start": True}
        where = f"the Ray cluster at {self.cfg.ray_address}"
        room = None
        if not self.cfg.ray_address:  # (reval launch sized a Ray of its own on this machine)
            out["executor"], where = "local-ray", "a Ray of its own on this machine"
            room = _local_room(entry.get("config") or {})
            if room is not None:
                out["room"] = room[1]
                where += f" ({room[0]:g} CPUs: room for {room[1]} workers)"
        note = (f"reval launch starts or drains workers to {workers} on {where}; each needs "
                "launch.rollout_cpus and launch.rollout_gpus, and one Ray has no room for "
                "waits until it has")  # fmt: skip
        if room is not None and workers > room[1]:
            note += f": {workers - room[1]} of them will wait"
        return {**out, "note": note}

    @staticmethod
    def _hand_launched(launcher: dict[str, Any], workers: int) -> dict[str, Any]:
        """``deployment`` of a run a ``reval launch`` started by hand drives: its driver follows
        the desired count, on the Ray its mark names."""
        out: dict[str, Any] = {"executor": "ray", "can_start": True}
        address, cpus, room = (launcher.get(k) for k in ("ray_address", "cpus", "room"))
        if address:
            where = f"the Ray cluster at {address}"
        else:
            out["executor"], where = "local-ray", "a Ray of its own on its driver's machine"
            if isinstance(cpus, int | float) and _int(room) is not None:
                out["room"] = room
                where += f" ({cpus:g} CPUs: room for {room} workers)"
        note = (f"this run was started by hand with `reval launch`, whose driver follows the "
                f"desired count: it starts or drains workers to {workers} on {where}, as many as "
                "the Ray cluster's resources allow (each needs launch.rollout_cpus and "
                "launch.rollout_gpus); one it has no room for waits until it has")  # fmt: skip
        if "room" in out and workers > out["room"]:
            note += f": {workers - out['room']} of them will wait"
        return {**out, "note": note}

    def worker_counts(self) -> list[tuple[str, int, int]]:
        """``(run, running, desired)`` of each running or paused run with a desired count:
        running is the registered workers not on standby. Read at each scrape of /metrics
        (``reval_api_run_workers``, ``reval_api_run_workers_desired``)."""
        out = []
        for name in self.store.names():
            entry = self.store.get(name)
            if entry is None:
                continue
            control = self.store.control(name)
            phase, _ = self._phase(name, entry, control)
            desired = control.read().workers
            if desired is None and entry.get("external"):
                desired = _int((entry.get("config") or {}).get("launch", {}).get("workers"))
            if phase not in ("running", "paused") or desired is None:
                continue
            workers = registry.workers(self.store.client, self.cfg.key_prefix, name)
            running = len([w for w in workers if w.get("status") != "standby"])
            out.append((name, running, desired))
        return out

    def hparams(self, name: str, body: LiveHParams) -> Accepted:
        if not body.set_fields():
            raise invalid(["body"], "no hyperparameter given")
        self._acting(name, "change", LIVE)
        typed = self.store.control(name).patch(body)
        return Accepted(run=name, action="hparams", detail=typed.set_fields())


RUN_ENV = (
    "PATH", "HOME", "USER", "LOGNAME", "SHELL", "TMPDIR", "TZ", "LANG", "LANGUAGE", "LC_*",
    "TERM", "PYTHONPATH", "VIRTUAL_ENV", "RAY_*", "REVAL__*", "REVAL_REWARD_*",
    "REVAL_HTTP_REWARD_*", "CUDA_VISIBLE_DEVICES", "CUDA_HOME", "NVIDIA_VISIBLE_DEVICES",
    "NCCL_*", "HF_HOME", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE",
    "HF_HUB_CACHE", "TRANSFORMERS_CACHE", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "SSL_CERT_FILE",
    "REQUESTS_CA_BUNDLE",
)  # fmt: skip
"""What a run launched by the API inherits of its environment (``NAME`` or ``PREFIX*``), with
``api.pass_env``: what a run needs (its Redis URL in ``REVAL__REDIS__URL``, Ray, the devices,
the model cache, ``REVAL_REWARD_*`` tokens for ``http_reward``), and no other secret."""


def _matches(name: str, patterns: tuple[str, ...] | list[str]) -> bool:
    return any(name == p or (p.endswith("*") and name.startswith(p[:-1])) for p in patterns)


def run_env(environ: Mapping[str, str], api: ApiConfig) -> dict[str, str]:
    """The environment of a run the API launches: ``environ`` (the API's) cut to ``RUN_ENV``
    and ``api.pass_env``, never the API's token; its Redis URL (``REVAL__REDIS__URL``, where
    the password travels: never through a file or the runs hash); ``RAY_ADDRESS`` from
    ``api.ray_address``."""
    env = {k: v for k, v in environ.items()
           if _matches(k, RUN_ENV) or _matches(k, api.pass_env)}  # fmt: skip
    env.pop(api.token_env, None)
    env[f"{ENV_PREFIX}REDIS__URL"] = api.redis_url
    env.pop(f"{ENV_PREFIX}BUFFER__REDIS_URL", None)  # (the old name: it would conflict)
    if api.ray_address:
        env["RAY_ADDRESS"] = api.ray_address
    elif not env.get("RAY_ADDRESS"):
        env.pop("RAY_ADDRESS", None)  # (an empty one would not mean "local")
    return env


def _checkpoints_hint(name: str, run_dir: Path, known: bool) -> str:
    """The 409 of a create over a run directory with checkpoints, with the commands that work:
    ``start`` where this API knows the run, ``create --resume`` (it registers the run over its
    checkpoints) where it does not, and a new name for a new run."""
    where = f"run {shown(name)} has checkpoints in {run_dir}"
    new = f"a new run needs a new name (--set name={name}-2)"
    if known:
        return (f"{where}: `reval runs start {name}` (POST /v1/runs/{name}/start) continues it; "
                f"{new}")  # fmt: skip
    return (f"{where} that this API did not start: the same `reval runs create` with --resume "
            '(body "resume": true) continues from them; ' + new)  # fmt: skip


def _local_room(config: dict[str, Any]) -> tuple[float, int] | None:
    """``(CPUs, workers it has room for)`` of the local Ray that ``reval launch`` started for
    a run of this (registered) config on this machine, as it sizes it
    (``LaunchConfig.local_ray_cpus``); None for GPU workers (their room is the GPUs')."""
    from reval.config import LaunchConfig

    try:
        launch = LaunchConfig(**(config.get("launch") or {}))
        world = int((config.get("learner") or {}).get("world_size", 1))
    except (TypeError, ValueError):
        return None
    if launch.rollout_gpus > 0:
        return None
    cores = machine_cpus()
    return launch.local_ray_cpus(world, cores), launch.local_ray_room(world, cores)


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _valid_stream_id(s: str) -> bool:
    ms, _, seq = s.partition("-")
    return ms.isdigit() and (seq == "" or seq.isdigit())
