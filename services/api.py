"""The REST control plane: ``reval serve`` runs this FastAPI app under uvicorn (``serve``); in a
Ray cluster ``reval serve --ray`` mounts the same app as a Ray Serve deployment (``ray_app``,
``run_on_ray``; ``services/api_serve.py`` is the import path for Serve's CLI and KubeRay).

Everything the API knows lives in Redis (the runs it manages in its registry hash, each run's
control, status and events keys, the replay ring's counters, the worker registry; every key is
built in ``reval/redis.py``), so the API restarts without losing anything while runs go on. A run
is started as a ``reval launch`` process (its own session, so it outlives an API restart); every
later action is a write to the run's control keys, which the learner, the workers and the launch
driver follow between steps.

Security: mutating endpoints need ``Authorization: Bearer <token>`` (the token from the
environment variable ``api.token_env``, compared in constant time); ``serve`` refuses to start
with an empty, default, short or low-entropy token (``token_problem``) unless ``dev``; reads
need it too with ``auth_reads``. Bodies beyond ``max_body_bytes`` get 413. The listen address
is loopback unless configured.
"""

from __future__ import annotations

import hmac
import json
import logging
import math
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import redis
from fastapi import Depends, FastAPI, HTTPException, Query, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from pydantic import BaseModel, ConfigDict, Field

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
from reval.control import LiveHParams, RunControl
from reval.redis import (
    claim_key,
    connect,
    lease_key,
    ring_keys,
    runs_key,
    worker_key,
    workers_index,
)
from reval.run_dir import RunDir

log = logging.getLogger("reval.api")

API_VERSION = "v1"
DEFAULT_TOKENS = {"", "changeme", "change-me", "token", "secret", "reval"}
FINISHED = ("stopped", "done", "failed")

_bearer = HTTPBearer(auto_error=False)
Creds = Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]
"""The bearer credentials (module level: FastAPI resolves annotations by name)."""


# -- request and response models -------------------------------------------------------------


class CreateRun(BaseModel):
    """A run from a config: the same tree as a TOML file (``reval/config.py``)."""

    model_config = ConfigDict(extra="forbid")
    config: dict[str, Any] = Field(default_factory=dict)
    """The run's config as a JSON object (sections and fields as in the TOML presets)."""
    workers: int | None = Field(None, ge=0, le=4096)
    """Rollout workers to start (default: ``launch.workers`` of the config)."""
    start: bool = True
    """Start it now (``reval launch``); False only registers it."""
    resume: bool = False
    """Continue from the checkpoints already in its run directory (``reval launch --resume``;
    they may come from ``reval train`` or another API): without it such a directory is a 409."""


class Scale(BaseModel):
    model_config = ConfigDict(extra="forbid")
    workers: int = Field(..., ge=0, le=4096)


class Accepted(BaseModel):
    run: str
    action: str
    detail: dict[str, Any] = Field(default_factory=dict)


class WorkerInfo(BaseModel):
    id: str
    status: str | None = None
    policy_version: int | None = None
    trajectories: int | None = None
    last_seen: float | None = None


class BufferInfo(BaseModel):
    size: int
    capacity: int
    inserted: int
    sampled: int
    evicted: int


class RunInfo(BaseModel):
    name: str
    phase: str
    """starting, running, paused, stopping, stopped, done, failed, or registered (not started)."""
    created: float
    step: int | None = None
    policy_version: int | None = None
    desired_workers: int | None = None
    workers: list[WorkerInfo] = Field(default_factory=list)
    buffer: BufferInfo | None = None
    hparams: dict[str, Any] = Field(default_factory=dict)
    last_metrics: dict[str, Any] | None = None
    checkpoints: list[str] = Field(default_factory=list)
    pid: int | None = None


class Event(BaseModel):
    id: str
    time: float
    kind: str
    step: int | None = None
    detail: dict[str, Any] = Field(default_factory=dict)


class Health(BaseModel):
    ok: bool
    detail: str = ""


# -- the app ----------------------------------------------------------------------------------


def _under(path: str | Path, root: str | Path) -> bool:
    """Whether ``path`` is ``root`` or lies below it, symbolic links and ``..`` resolved (as
    the run, started from this process's directory, would resolve them)."""
    real, base = os.path.realpath(path), os.path.realpath(root)
    return real == base or real.startswith(base.rstrip(os.sep) + os.sep)


def _hub_id(name: str) -> bool:
    """``NAME`` or ``ORG/NAME`` that is not also a path here (``from_pretrained`` prefers a
    local directory of that name)."""
    return (
        not name.startswith(("/", ".", "~", "\\"))
        and name.count("/") <= 1
        and not os.path.lexists(name)
    )


def _confine(run: RunConfig, api: ApiConfig) -> None:
    """A POSTed config writes only under the API's ``output_dir`` and reads local models and
    datasets only under its ``models_dir``; a 422 naming the field otherwise."""
    problems: list[tuple[list[str], str]] = []
    for loc, value in ((["output_dir"], run.output_dir), (["sync", "weights_dir"],
                                                          run.sync.weights_dir)):  # fmt: skip
        if value is not None and not _under(value, api.output_dir):
            problems.append((loc, f"must lie under the API's output_dir {api.output_dir!r}"))
    from reval.paths import reward_file

    reward = run.task.reward and reward_file(run.task.reward)  # (a module name: installed code)
    env = run.task.environment and reward_file(run.task.environment)  # (the same forms)
    for loc, value in ((["model", "name_or_path"], run.model.name_or_path),
                       (["task", "dataset"], run.task.dataset),
                       (["task", "reward"], reward or None),
                       (["task", "environment"], env or None)):  # fmt: skip
        if value is None or _hub_id(value):
            continue
        if api.models_dir is None:
            problems.append((loc, "must be a hub id (ORG/NAME): this API has no models_dir "
                             "for local paths"))  # fmt: skip
        elif not _under(value, api.models_dir):
            problems.append((loc, "must be a hub id (ORG/NAME) or a path under the API's "
                             f"models_dir {api.models_dir!r}"))  # fmt: skip
    if problems:
        raise HTTPException(422, [{"loc": ["body", "config", *loc], "msg": msg,
                                   "type": "value_error"} for loc, msg in problems])  # fmt: skip


class _BodyLimit:
    """413 for a body over ``limit`` bytes: by its Content-Length up front, and for a chunked
    body while it streams in (counted as it arrives, never buffered whole)."""

    def __init__(self, app: Any, limit: int) -> None:
        self.app, self.limit = app, limit

    async def _refuse(self, send: Any) -> None:
        body = json.dumps({"detail": f"body over {self.limit} bytes"}).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode())]})  # fmt: skip
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.limit):
            await self._refuse(send)
            return
        seen = 0
        started = refused = False

        async def counted() -> Any:
            nonlocal seen, refused
            message = await receive()
            if message["type"] == "http.request" and not refused:
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    # Answer 413 now and tell the app the client left (FastAPI would turn an
                    # exception raised here into a 400).
                    if not started:
                        await self._refuse(send)
                    refused = True
                    return {"type": "http.disconnect"}
            return message

        async def watched(message: Any) -> None:
            nonlocal started
            if refused:
                return  # the app's own answer after the 413: dropped
            started = started or message["type"] == "http.response.start"
            await send(message)

        await self.app(scope, counted, watched)


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


def create_app(
    cfg: ApiConfig | None = None,
    client: redis.Redis | None = None,
    launcher: Callable[[str, Path], int] | None = None,
) -> FastAPI:
    """The app; ``serve`` and the Ray Serve deployment both mount what this returns.
    ``launcher(name, config_path) -> pid`` starts a run (default: ``reval launch`` in its own
    session)."""
    cfg = cfg or ApiConfig()
    store = Store(cfg, client)
    token = os.environ.get(cfg.token_env, "")
    metrics = CollectorRegistry()
    requests_total = Counter(
        "reval_api_requests", "API requests", ["method", "route", "status"], registry=metrics
    )
    latency = Histogram(
        "reval_api_request_seconds", "API request latency", ["route"], registry=metrics
    )
    app = FastAPI(
        title="reval control plane",
        version=API_VERSION,
        description="Create, watch and steer ReVal runs: pause, resume, stop, checkpoint, "
        "export, scale rollout workers, change hyperparameters live.",
    )
    app.add_middleware(_BodyLimit, limit=cfg.max_body_bytes)
    app.state.store = store
    app.state.metrics = metrics
    app.state.children = {}  # pid -> Popen of runs this process started (reaped on status)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        # FastAPI's own answer, except that a refused NaN or Infinity (Python's JSON parser
        # reads them) is echoed as a string: as a float it cannot be sent, and that was a 500.
        detail = _finite(jsonable_encoder(exc.errors()))
        return JSONResponse({"detail": detail}, status_code=422)

    @app.middleware("http")
    async def count(request: Request, call_next: Any) -> Any:
        t0 = time.perf_counter()
        response = await call_next(request)
        route = request.scope.get("route")
        path = getattr(route, "path", "unmatched")
        requests_total.labels(request.method, path, str(response.status_code)).inc()
        latency.labels(path).observe(time.perf_counter() - t0)
        return response

    def check(creds: HTTPAuthorizationCredentials | None) -> None:
        if creds is None or creds.scheme.lower() != "bearer":
            raise HTTPException(401, f"bearer token required: set {cfg.token_env} to the API's "
                                "token (reval runs sends it as Authorization: Bearer)",
                                {"WWW-Authenticate": "Bearer"})  # fmt: skip
        if not token or not hmac.compare_digest(creds.credentials.encode(), token.encode()):
            raise HTTPException(403, f"wrong token: not the {cfg.token_env} this API was "
                                "started with")  # fmt: skip

    def write_auth(creds: Creds) -> None:
        check(creds)

    def read_auth(creds: Creds) -> None:
        if cfg.auth_reads:
            check(creds)

    def entry_of(name: str) -> dict[str, Any]:
        entry = store.get(name)
        if entry is None:
            raise HTTPException(404, f"no run {name!r}")
        return entry

    def info(name: str, entry: dict[str, Any]) -> RunInfo:
        control = store.control(name)
        status = control.read_status()
        ctl = control.read()
        pid = entry.get("pid")
        child = app.state.children.get(pid)
        if child is not None:
            child.poll()  # reap it when it has exited
        if entry.get("external"):  # started outside the API: its status and its lease
            # The learner holds the run's lease while it lives (renewed every third of
            # learner.lease_s): a status that says running with no lease is a learner that died.
            phase = status.get("phase", "starting")
            held = bool(store.client.exists(lease_key(cfg.key_prefix, name)))
            alive = phase not in FINISHED and held
            if not alive and phase not in FINISHED:
                phase = "failed"
        else:
            # The launch driver's heartbeat in Redis (any API replica or host sees it); a local
            # child's pid; or a start too recent for a first heartbeat.
            now = time.time()
            started_at = float(entry.get("started_at") or 0)
            beat = ctl.driver_seen
            alive = (
                (beat is not None and now - beat < 30)
                or _pid_alive(pid)
                or (now - started_at < 120 and (beat is None or beat < started_at))
            )
            phase = status.get("phase", "starting" if alive else "registered")
            if entry.get("started") and not alive and phase not in FINISHED:
                phase = "failed"  # the launch process is gone without a final status
        if alive and ctl.phase == "stopping" and phase not in FINISHED:
            phase = "stopping"
        buf = None
        meta = store.client.hmget(ring_keys(cfg.key_prefix, name).meta,
                                  ["capacity", "head", "tail", "evicted", "sampled"])  # fmt: skip
        if meta[0] is not None:  # (read directly: no side effect on a run not started)
            cap, head, tail, evicted, sampled = (int(x or 0) for x in meta)
            buf = BufferInfo(size=head - tail, capacity=cap, inserted=head, sampled=sampled,
                             evicted=evicted)  # fmt: skip
        workers = []
        index = workers_index(cfg.key_prefix, name)
        for wid in sorted(m.decode() for m in store.client.zrange(index, 0, -1)):
            raw = store.client.get(worker_key(cfg.key_prefix, name, wid))
            if raw is None:
                continue
            w = json.loads(raw)
            workers.append(WorkerInfo(id=wid, status=w.get("status"),
                                      policy_version=w.get("policy_version"),
                                      trajectories=w.get("trajectories"),
                                      last_seen=w.get("last_seen")))  # fmt: skip
        return RunInfo(
            name=name,
            phase=phase,
            created=entry["created"],
            step=status.get("step"),
            policy_version=status.get("policy_version"),
            desired_workers=ctl.workers,
            workers=workers,
            buffer=buf,
            hparams=status.get("hparams", {}),
            last_metrics=status.get("last"),
            checkpoints=status.get("checkpoints", []),
            pid=pid,
        )

    def launch(name: str, entry: dict[str, Any]) -> int:
        run_dir = Path(cfg.output_dir) / name
        run_dir.mkdir(parents=True, exist_ok=True)
        path = RunDir(run_dir).request_config
        path.write_text(json.dumps(entry["config"], indent=2))
        if launcher is not None:
            return launcher(name, path)
        # The run's Redis URL is the API's own (create_run made it so); its password reaches
        # the run through the environment, never through a file or the runs hash.
        env = {**os.environ, f"{ENV_PREFIX}REDIS__URL": cfg.redis_url}
        env.pop(f"{ENV_PREFIX}BUFFER__REDIS_URL", None)  # (the old name: it would conflict)
        if cfg.ray_address:
            env["RAY_ADDRESS"] = cfg.ray_address
        elif not env.get("RAY_ADDRESS"):
            env.pop("RAY_ADDRESS", None)  # (an empty one would not mean "local")
        cmd = [sys.executable, "-m", "services.cli", "launch", "--config", str(path)]
        if RunDir(run_dir).has_checkpoint():
            cmd.append("--resume")  # a run started again continues from its checkpoint
        with RunDir(run_dir).launch_log.open("ab") as log_file:
            proc = subprocess.Popen(
                cmd, stdout=log_file, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )  # (it outlives this API process)
        for pid in [p for p, c in app.state.children.items() if c.poll() is not None]:
            del app.state.children[pid]  # reaped
        app.state.children[proc.pid] = proc
        return proc.pid

    # -- health -------------------------------------------------------------------------------

    @app.get("/healthz", response_model=Health, tags=["health"])
    def healthz() -> Health:
        return Health(ok=True)

    @app.get("/readyz", response_model=Health, tags=["health"],
             responses={503: {"model": Health}})  # fmt: skip
    def readyz() -> Any:
        try:
            store.client.ping()
        except (redis.ConnectionError, redis.TimeoutError) as err:
            return JSONResponse(Health(ok=False, detail=f"redis: {err}").model_dump(), 503)
        return Health(ok=True)

    @app.get("/metrics", response_class=PlainTextResponse, tags=["health"])
    def prometheus() -> PlainTextResponse:
        return PlainTextResponse(generate_latest(metrics).decode(),
                                 media_type="text/plain; version=0.0.4")  # fmt: skip

    # -- runs ---------------------------------------------------------------------------------

    @app.get("/v1/runs", response_model=list[RunInfo], dependencies=[Depends(read_auth)])
    def list_runs() -> list[RunInfo]:
        out = []
        for name in store.names():
            entry = store.get(name)
            if entry is not None:
                out.append(info(name, entry))
        return out

    @app.post("/v1/runs", response_model=RunInfo, status_code=201,
              dependencies=[Depends(write_auth)])  # fmt: skip
    def create_run(body: CreateRun) -> RunInfo:
        data = dict(body.config)

        def section(key: str) -> dict[str, Any]:
            """A config section given in the body: an object, or a 422 naming it."""
            value = data.get(key, {})
            if not isinstance(value, dict):
                raise HTTPException(422, [{"loc": ["body", "config", key],
                                           "msg": f"config.{key} must be an object (a section "
                                                  f"of the config), got {type(value).__name__}",
                                           "type": "value_error"}])  # fmt: skip
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
                raise HTTPException(422, [{"loc": ["body", "config", *loc],
                                           "msg": f"this API manages runs with {name}.{key}="
                                                  f"{value!r}",
                                           "type": "value_error"}])  # fmt: skip
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
            raise HTTPException(422, [{"loc": ["body", "config"], "msg": str(err),
                                       "type": "value_error"}]) from None  # fmt: skip
        _confine(run_cfg, cfg)
        if run_cfg.task.reward is not None:  # (its file under models_dir: imported only now)
            from reval.paths import RewardNotFound, check_reward

            try:
                check_reward(run_cfg.task.reward, run_cfg.task.reward_args)
            except RewardNotFound as err:
                where = ["body", "config", "task", "reward"]
                raise HTTPException(422, [{"loc": where, "msg": str(err),
                                           "type": "value_error"}]) from None  # fmt: skip
        from reval.paths import check_environment  # (task.environment: the same)

        try:
            check_environment(run_cfg)
        except ValueError as err:
            where = ["body", "config", "task", "environment"]
            raise HTTPException(422, [{"loc": where, "msg": str(err),
                                       "type": "value_error"}]) from None  # fmt: skip
        name = run_cfg.name
        old = store.get(name)
        if old is not None and info(name, old).phase not in (*FINISHED, "registered"):
            raise HTTPException(409, f"run {name!r} exists and is live")
        checkpoints = run_cfg.paths.has_checkpoint()
        if checkpoints and not body.resume:
            raise HTTPException(409, _checkpoints_hint(name, run_cfg.run_dir, old is not None))
        if body.resume and not checkpoints:
            raise HTTPException(409, f"run {name!r} has no checkpoint in {run_cfg.run_dir} to "
                                "resume from: create it without resume")  # fmt: skip
        # One creator at a time per name (two concurrent creates must not both launch).
        if not store.client.set(claim_key(cfg.key_prefix, name), "1", nx=True, ex=30):
            raise HTTPException(409, f"run {name!r} is being created")
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
            entry["pid"] = launch(name, entry)
            entry["started"] = True
            entry["started_at"] = time.time()
        store.put(name, entry)
        store.client.delete(claim_key(cfg.key_prefix, name))
        return info(name, entry)

    @app.get("/v1/runs/{name}", response_model=RunInfo, dependencies=[Depends(read_auth)],
             responses={404: {"description": "no such run"}})  # fmt: skip
    def get_run(name: str) -> RunInfo:
        return info(name, entry_of(name))

    def act(name: str, action: str, allowed: tuple[str, ...]) -> tuple[dict[str, Any], RunInfo]:
        entry = entry_of(name)
        current = info(name, entry)
        if current.phase not in allowed:
            raise HTTPException(409, f"cannot {action} run {name!r}: it is {current.phase}")
        return entry, current

    live = ("starting", "running", "paused")

    @app.post("/v1/runs/{name}/start", response_model=Accepted, status_code=202,
              dependencies=[Depends(write_auth)])  # fmt: skip
    def start_run(name: str) -> Accepted:
        entry, _ = act(name, "start", ("registered", *FINISHED))
        if not store.client.set(claim_key(cfg.key_prefix, name), "1", nx=True, ex=30):
            raise HTTPException(409, f"run {name!r} is being started")
        control = store.control(name)
        # The last start's final status goes: the run is starting again.
        control.client.delete(control.status)
        control.client.hset(control.control, "phase", "running")
        entry["pid"] = launch(name, entry)
        entry["started"] = True
        entry["started_at"] = time.time()
        store.put(name, entry)
        store.control(name).record("start")
        return Accepted(run=name, action="start", detail={"pid": entry["pid"]})

    @app.post("/v1/runs/{name}/pause", response_model=Accepted, status_code=202,
              dependencies=[Depends(write_auth)])  # fmt: skip
    def pause_run(name: str) -> Accepted:
        act(name, "pause", ("starting", "running"))
        if store.control(name).read().phase == "paused":
            raise HTTPException(409, f"run {name!r} is already pausing")
        store.control(name).set_phase("paused")
        return Accepted(run=name, action="pause")

    @app.post("/v1/runs/{name}/resume", response_model=Accepted, status_code=202,
              dependencies=[Depends(write_auth)])  # fmt: skip
    def resume_run(name: str) -> Accepted:
        # (the learner reports "paused" one update after the request: the request decides)
        act(name, "resume", ("starting", "running", "paused"))
        if store.control(name).read().phase != "paused":
            raise HTTPException(409, f"run {name!r} is not paused")
        store.control(name).set_phase("running")
        return Accepted(run=name, action="resume")

    @app.post("/v1/runs/{name}/stop", response_model=Accepted, status_code=202,
              dependencies=[Depends(write_auth)])  # fmt: skip
    def stop_run(name: str) -> Accepted:
        act(name, "stop", live)
        store.control(name).set_phase("stopping")
        return Accepted(run=name, action="stop")

    @app.post("/v1/runs/{name}/checkpoint", response_model=Accepted, status_code=202,
              dependencies=[Depends(write_auth)])  # fmt: skip
    def checkpoint_run(name: str) -> Accepted:
        act(name, "checkpoint", live)
        n = store.control(name).request("checkpoint")
        return Accepted(run=name, action="checkpoint", detail={"request": n})

    @app.post("/v1/runs/{name}/export", response_model=Accepted, status_code=202,
              dependencies=[Depends(write_auth)])  # fmt: skip
    def export_run(name: str) -> Accepted:
        act(name, "export", live)
        n = store.control(name).request("export")
        return Accepted(run=name, action="export", detail={"request": n})

    @app.post("/v1/runs/{name}/scale", response_model=Accepted, status_code=202,
              dependencies=[Depends(write_auth)])  # fmt: skip
    def scale_run(name: str, body: Scale) -> Accepted:
        act(name, "scale", live)
        store.control(name).set_workers(body.workers)
        return Accepted(run=name, action="scale", detail={"workers": body.workers})

    @app.patch("/v1/runs/{name}/hparams", response_model=Accepted, status_code=202,
               dependencies=[Depends(write_auth)])  # fmt: skip
    def patch_hparams(name: str, body: LiveHParams) -> Accepted:
        """Live hyperparameters (``reval/control.py: LiveHParams``, at least one): the learner
        applies its own at its next update, the rollout workers ``temperature`` between
        batches."""
        if not body.set_fields():
            raise HTTPException(422, [{"loc": ["body"], "msg": "no hyperparameter given",
                                       "type": "value_error"}])  # fmt: skip
        act(name, "change", live)
        typed = store.control(name).patch(body)
        return Accepted(run=name, action="hparams", detail=typed.set_fields())

    @app.get("/v1/runs/{name}/events", response_model=list[Event],
             dependencies=[Depends(read_auth)])  # fmt: skip
    def run_events(
        name: str, after: str = "-", count: Annotated[int, Query(ge=1, le=10_000)] = 100
    ) -> list[Event]:
        entry_of(name)
        if after != "-" and not _valid_stream_id(after):
            raise HTTPException(422, [{"loc": ["query", "after"], "msg": "not a stream id",
                                       "type": "value_error"}])  # fmt: skip
        try:
            return [Event(**e) for e in store.control(name).events(count=count, after=after)]
        except redis.ResponseError as err:  # an id Redis cannot take (too large)
            raise HTTPException(422, [{"loc": ["query", "after"], "msg": str(err),
                                       "type": "value_error"}]) from None  # fmt: skip

    return app


def _checkpoints_hint(name: str, run_dir: Path, known: bool) -> str:
    """The 409 of a create over a run directory with checkpoints, with the commands that work:
    ``start`` where this API knows the run, ``create --resume`` (it registers the run over its
    checkpoints) where it does not, and a new name for a new run."""
    where = f"run {name!r} has checkpoints in {run_dir}"
    new = f"a new run needs a new name (--set name={name}-2)"
    if known:
        return (f"{where}: `reval runs start {name}` (POST /v1/runs/{name}/start) continues it; "
                f"{new}")  # fmt: skip
    return (f"{where} that this API did not start: the same `reval runs create` with --resume "
            '(body "resume": true) continues from them; ' + new)  # fmt: skip


def _finite(value: Any) -> Any:
    """``value`` with every non-finite float replaced by its name (``"nan"``, ``"inf"``)."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def _valid_stream_id(s: str) -> bool:
    ms, _, seq = s.partition("-")
    return ms.isdigit() and (seq == "" or seq.isdigit())


MIN_TOKEN_CHARS = 16
MIN_TOKEN_BITS = 30.0
"""A token's length times the Shannon entropy of its own characters must reach this (a measure
of how varied it is, not of how it was made): 16 random hex digits measure 51 bits on average
and never below 32 in 200,000 draws; ``aaaaaaaaaaaaaaaa`` measures 0, ``abababababababab`` 16."""


def token_problem(token: str) -> str | None:
    """What is wrong with an API token (None: nothing): empty or a default, shorter than
    ``MIN_TOKEN_CHARS``, or too little entropy (one character repeated, a short pattern)."""
    if token.strip().lower() in DEFAULT_TOKENS:
        return "is empty or a default"
    if len(token) < MIN_TOKEN_CHARS:
        return f"is shorter than {MIN_TOKEN_CHARS} characters"
    counts = [token.count(c) for c in set(token)]
    bits = sum(n * math.log2(len(token) / n) for n in counts)
    if bits < MIN_TOKEN_BITS:
        return f"has too little entropy ({bits:.0f} bits, at least {MIN_TOKEN_BITS:.0f})"
    return None


def serve(cfg: ApiConfig, ray: bool = False, replicas: int = 1, access_log: bool = False) -> int:
    """``reval serve``: uvicorn on ``cfg.host:cfg.port`` (or Ray Serve with ``ray``). No line per
    request unless ``access_log``: ``reval_api_requests_total`` counts them."""

    token = os.environ.get(cfg.token_env, "")
    problem = token_problem(token)
    if not cfg.dev and problem is not None:
        print(
            f"reval serve: {cfg.token_env} {problem}: set it to a random secret, e.g. "
            "`python -c 'import secrets; print(secrets.token_urlsafe(32))'` "
            "(or --dev for development only)",
            file=sys.stderr,
        )
        return 2
    if cfg.dev and not token:
        log.warning("dev mode with no token: every mutating request is refused (403)")
    if ray:
        run_on_ray(cfg, replicas)
        return 0
    import uvicorn

    uvicorn.run(create_app(cfg), host=cfg.host, port=cfg.port, log_level="info",
                access_log=access_log)  # fmt: skip
    return 0


# -- Ray Serve ---------------------------------------------------------------------------------
# (here, beside the app it mounts; ``services/api_serve.py`` is the entry point for Serve's CLI
# and KubeRay)

DEPLOYMENT = "reval-api"


def ray_app(cfg: ApiConfig, replicas: int = 1) -> Any:
    """The bound Serve application of the API: ``serve.ingress`` with a builder evaluated on
    each replica, so each builds its own app (its Redis connections are not pickled across)."""
    from ray import serve

    cfg_json = cfg.model_dump_json()

    def builder() -> Any:  # runs on each replica
        return create_app(ApiConfig.model_validate_json(cfg_json))

    @serve.deployment(name=DEPLOYMENT, num_replicas=replicas,
                      ray_actor_options={"num_cpus": 0.1})  # fmt: skip
    @serve.ingress(builder)
    class RevalApi:
        pass

    return RevalApi.bind()  # type: ignore[attr-defined]


def run_on_ray(cfg: ApiConfig, replicas: int = 1, block: bool = True) -> None:
    """Start Serve's HTTP proxy on ``cfg.host:cfg.port`` and deploy the API on it (the Ray
    cluster at ``RAY_ADDRESS``, or a local one)."""
    import ray
    from ray import serve

    if not ray.is_initialized():
        address = os.environ.get("RAY_ADDRESS")
        ray.init(address=address, namespace="reval") if address else ray.init(namespace="reval")
    serve.start(http_options={"host": cfg.host, "port": cfg.port})
    serve.run(ray_app(cfg, replicas), name="reval", route_prefix="/")
    while block:
        time.sleep(3600)
