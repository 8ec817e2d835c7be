"""The FastAPI app of the control plane: the body limit, the request metrics, FastAPI's 422
made safe for non-finite numbers, and the routers over one ``RunService``."""

from __future__ import annotations

import math
import time
from typing import Any

import redis
from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from reval.config import ApiConfig
from services.api.routes import docs_router, health_router, runs_router
from services.api.runs import Launcher, RunService, Store, cut
from services.api.security import Auth, BodyLimit

API_VERSION = "v1"


def create_app(
    cfg: ApiConfig | None = None,
    client: redis.Redis | None = None,
    launcher: Launcher | None = None,
) -> FastAPI:
    """The app; ``serve`` and the Ray Serve deployment both mount what this returns.
    ``launcher(name, config_path) -> pid`` starts a run (default: ``reval launch`` in its own
    session)."""
    cfg = cfg or ApiConfig()
    store = Store(cfg, client)
    service = RunService(cfg, store, launcher)
    metrics = CollectorRegistry()
    requests_total = Counter(
        "reval_api_requests", "API requests", ["method", "route", "status"], registry=metrics
    )
    latency = Histogram(
        "reval_api_request_seconds", "API request latency", ["route"], registry=metrics
    )
    run_workers = Gauge(
        "reval_api_run_workers",
        "Rollout workers generating for a running or paused run (registered, not on standby)",
        ["run"],
        registry=metrics,
    )
    run_desired = Gauge(
        "reval_api_run_workers_desired",
        "Rollout workers the run should have (its control's count, reval runs scale)",
        ["run"],
        registry=metrics,
    )

    def refresh() -> None:
        """The run gauges, read from Redis at each scrape (none while Redis is away)."""
        run_workers.clear()
        run_desired.clear()
        try:
            counts = service.worker_counts()
        except redis.RedisError:
            return
        for run, running, desired in counts:
            run_workers.labels(run).set(running)
            run_desired.labels(run).set(desired)

    guarded = cfg.reads_need_token()  # (then /docs and /openapi.json need the token too)
    app = FastAPI(
        title="reval control plane",
        version=API_VERSION,
        description="Create, watch and steer ReVal runs: pause, resume, stop, checkpoint, "
        "export, scale rollout workers, change hyperparameters live.",
        **({"docs_url": None, "redoc_url": None, "openapi_url": None} if guarded else {}),
    )
    app.add_middleware(BodyLimit, limit=cfg.max_body_bytes)
    app.state.store = store
    app.state.service = service
    app.state.metrics = metrics
    app.state.children = service.children  # pid -> Popen of runs this process started

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        # FastAPI's own answer, except that a refused NaN or Infinity (Python's JSON parser
        # reads them) is echoed as a string: as a float it cannot be sent, and that was a 500.
        detail = _cut(_finite(jsonable_encoder(exc.errors())))
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

    auth = Auth(cfg)
    app.include_router(health_router(service, metrics, auth, refresh))
    app.include_router(runs_router(service, auth))
    if guarded:
        app.include_router(docs_router(app, auth))
    return app


def _cut(value: Any, key: str = "") -> Any:
    """FastAPI's 422 detail with every string it echoes (the input, a key in ``loc``) over
    ``NAME_SHOWN`` characters cut, with the count left out; its own ``msg`` kept whole."""
    if isinstance(value, str) and key != "msg":
        return cut(value)
    if isinstance(value, dict):
        return {k: _cut(v, k) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_cut(v, key) for v in value]
    return value


def _finite(value: Any) -> Any:
    """``value`` with every non-finite float replaced by its name (``"nan"``, ``"inf"``)."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value
