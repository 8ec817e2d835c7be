"""The REST API's request and response bodies (the OpenAPI schema at ``/docs`` is built from
these)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class CreateRun(BaseModel):
    """A run from a config: the same tree as a TOML file (``reval/config/``)."""

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
