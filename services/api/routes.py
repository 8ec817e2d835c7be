"""The API's endpoints: each one a line that asks ``RunService`` (``services/api/runs.py``) and
returns what it built. docs/api.md describes them for users."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any

from fastapi import APIRouter, Depends, FastAPI, Query
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse
from prometheus_client import CollectorRegistry, generate_latest

from reval.control import LiveHParams
from services.api.models import Accepted, CreateRun, Event, Health, RunInfo, Scale
from services.api.runs import RunService
from services.api.security import Auth


def health_router(
    service: RunService,
    metrics: CollectorRegistry,
    auth: Auth,
    refresh: Callable[[], None] = lambda: None,
) -> APIRouter:
    """``/healthz`` (the process answers), ``/readyz`` (and its Redis does): open;
    ``/metrics``: open where ``api.open_metrics`` says (``Auth.metrics``), after ``refresh()``
    (the gauges read from Redis at each scrape)."""
    router = APIRouter(tags=["health"])

    @router.get("/healthz", response_model=Health)
    def healthz() -> Health:
        return Health(ok=True)

    @router.get("/readyz", response_model=Health, responses={503: {"model": Health}})
    def readyz() -> Any:
        ready = service.ready()
        return ready if ready.ok else JSONResponse(ready.model_dump(), 503)

    @router.get("/metrics", response_class=PlainTextResponse,
                dependencies=[Depends(auth.metrics)])  # fmt: skip
    def prometheus() -> PlainTextResponse:
        refresh()
        return PlainTextResponse(generate_latest(metrics).decode(),
                                 media_type="text/plain; version=0.0.4")  # fmt: skip

    return router


def docs_router(app: FastAPI, auth: Auth) -> APIRouter:
    """``/openapi.json`` and ``/docs`` behind ``Auth.read`` (mounted when reads need the
    token; FastAPI's own open ones otherwise)."""
    router = APIRouter(include_in_schema=False, dependencies=[Depends(auth.read)])

    @router.get("/openapi.json")
    def openapi() -> JSONResponse:
        return JSONResponse(app.openapi())

    @router.get("/docs")
    def docs() -> HTMLResponse:
        return get_swagger_ui_html(openapi_url="/openapi.json", title=app.title)

    return router


def runs_router(service: RunService, auth: Auth) -> APIRouter:
    """``/v1/runs``: create, read and steer runs. Writes need the token; reads too where
    ``api.reads_need_token()``."""
    router = APIRouter(prefix="/v1/runs", tags=["runs"])
    read, write = [Depends(auth.read)], [Depends(auth.write)]
    accepted: dict[str, Any] = {"response_model": Accepted, "status_code": 202,
                                "dependencies": write}  # fmt: skip

    @router.get("", response_model=list[RunInfo], dependencies=read)
    def list_runs() -> list[RunInfo]:
        return service.runs()

    @router.post("", response_model=RunInfo, status_code=201, dependencies=write)
    def create_run(body: CreateRun) -> RunInfo:
        return service.create(body)

    @router.get("/{name}", response_model=RunInfo, dependencies=read,
                responses={404: {"description": "no such run"}})  # fmt: skip
    def get_run(name: str) -> RunInfo:
        return service.info(name, service.entry(name))

    @router.post("/{name}/start", **accepted)
    def start_run(name: str) -> Accepted:
        return service.start(name)

    @router.post("/{name}/pause", **accepted)
    def pause_run(name: str) -> Accepted:
        return service.pause(name)

    @router.post("/{name}/resume", **accepted)
    def resume_run(name: str) -> Accepted:
        return service.resume(name)

    @router.post("/{name}/stop", **accepted)
    def stop_run(name: str) -> Accepted:
        return service.stop(name)

    @router.post("/{name}/checkpoint", **accepted)
    def checkpoint_run(name: str) -> Accepted:
        return service.request(name, "checkpoint")

    @router.post("/{name}/export", **accepted)
    def export_run(name: str) -> Accepted:
        return service.request(name, "export")

    @router.post("/{name}/scale", **accepted)
    def scale_run(name: str, body: Scale) -> Accepted:
        return service.scale(name, body.workers)

    @router.patch("/{name}/hparams", **accepted)
    def patch_hparams(name: str, body: LiveHParams) -> Accepted:
        """Live hyperparameters (``reval/control.py: LiveHParams``, at least one): the learner
        applies its own at its next update, the rollout workers ``temperature`` between
        batches."""
        return service.hparams(name, body)

    @router.get("/{name}/events", response_model=list[Event], dependencies=read)
    def run_events(
        name: str, after: str = "-", count: Annotated[int, Query(ge=1, le=10_000)] = 100
    ) -> list[Event]:
        return service.events(name, after, count)

    return router
