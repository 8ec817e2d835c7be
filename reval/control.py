"""Live control of a run through Redis: what the REST API (``services/api.py``) and
``reval runs ...`` write, and what the learner, the rollout workers and the ``reval launch``
driver read between steps. Everything lives in Redis, so the API can restart while a run goes on.

Keys of run R (the run's hash tag, so one Redis Cluster slot):

- ``{prefix}{R}:control`` (hash): the desired ``phase`` (``running``, ``paused``, ``stopping``),
  the desired rollout ``workers`` (``reval launch`` scales to it), the sequence numbers of
  ``checkpoint`` and ``export`` requests, and one field per live hyperparameter (``HPARAMS``).
- ``{prefix}{R}:status`` (hash): what the learner reports after each update (phase, step,
  policy version, the last metrics, the checkpoints, the hyperparameters in force).
- ``{prefix}{R}:events`` (stream): every request and every change applied, with the learner's
  step: ``reval runs events`` and ``GET /v1/runs/{R}/events`` read it.

The learner applies hyperparameters at its next step and records each change with that step.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from typing import Any

import redis

PHASES = ("running", "paused", "stopping")

# name -> (type, lower bound, upper bound, who applies it)
HPARAMS: dict[str, tuple[type, float, float, str]] = {
    "beta": (float, 1e-6, 1e6, "learner"),
    "lr": (float, 1e-12, 10.0, "learner"),
    "samples_per_insert": (float, 1e-3, 1e6, "learner"),
    "ref_reset_steps": (int, 0, 1e9, "learner"),
    "max_staleness": (int, -1, 1e9, "learner"),
    "temperature": (float, 1e-3, 100.0, "workers"),
}
"""Hyperparameters that change without a restart. ``max_staleness = -1`` turns the check off."""

EVENTS_MAXLEN = 10_000


def _float(text: str | None) -> float | None:
    try:
        return None if text is None else float(text)
    except ValueError:
        return None


def runs_key(prefix: str) -> str:
    """The REST API's registry of the runs it shows (name -> JSON entry)."""
    return f"{prefix}api:runs"


def adopt_run(client: redis.Redis, prefix: str, run: str, config: dict[str, Any]) -> bool:
    """Show a run started outside the API (``reval learner`` under compose or by hand) in the
    API's registry; a run the API created keeps its entry. True if it was added."""
    entry = {"created": time.time(), "config": config, "pid": None, "started": True,
             "external": True}  # fmt: skip
    return bool(client.hsetnx(runs_key(prefix), run, json.dumps(entry)))


def control_key(prefix: str, run: str) -> str:
    return f"{prefix}{{{run}}}:control"


def status_key(prefix: str, run: str) -> str:
    return f"{prefix}{{{run}}}:status"


def events_key(prefix: str, run: str) -> str:
    return f"{prefix}{{{run}}}:events"


def validate_hparams(values: dict[str, Any]) -> dict[str, float | int]:
    """Checked and typed values; ValueError naming the first bad one."""
    out: dict[str, float | int] = {}
    for name, value in values.items():
        if name not in HPARAMS:
            raise ValueError(f"{name}: not a live hyperparameter (one of {sorted(HPARAMS)})")
        kind, lo, hi, _ = HPARAMS[name]
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"{name}: must be a number, got {value!r}")
        if kind is int and float(value) != int(value):
            raise ValueError(f"{name}: must be an integer, got {value!r}")
        if not math.isfinite(float(value)):
            raise ValueError(f"{name}: must be finite, got {value!r}")
        typed = int(value) if kind is int else float(value)
        if not (lo <= typed <= hi) or typed != typed:
            raise ValueError(f"{name}: {value!r} outside [{lo:g}, {hi:g}]")
        out[name] = typed
    return out


@dataclass
class ControlState:
    phase: str = "running"
    workers: int | None = None
    checkpoint: int = 0
    export: int = 0
    hparams: dict[str, float | int] = field(default_factory=dict)
    driver_seen: float | None = None
    """When the ``reval launch`` driver of the run last went round its loop (its heartbeat)."""


class RunControl:
    """One run's control keys (both sides)."""

    def __init__(self, client: redis.Redis, prefix: str, run: str) -> None:
        self.client = client
        self.run = run
        self.control = control_key(prefix, run)
        self.status = status_key(prefix, run)
        self.events_key = events_key(prefix, run)

    # -- the API's side -----------------------------------------------------------------------

    def current_step(self) -> int | None:
        """The learner's last reported step (None before its first update)."""
        raw = self.client.hget(self.status, "step")
        try:
            return None if raw is None else int(json.loads(raw))
        except (ValueError, TypeError):
            return None

    def record(
        self, kind: str, detail: dict[str, Any] | None = None, step: int | None = None
    ) -> str:
        """Append an event; without ``step``, the learner's last reported step (a request's
        step is the last update finished before it)."""
        if step is None:
            step = self.current_step()
        fields = {"time": f"{time.time():.3f}", "kind": kind, "detail": json.dumps(detail or {})}
        if step is not None:
            fields["step"] = str(step)
        out = self.client.xadd(self.events_key, fields, maxlen=EVENTS_MAXLEN, approximate=True)
        return out.decode() if isinstance(out, bytes) else str(out)

    def set_phase(self, phase: str) -> None:
        if phase not in PHASES:
            raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")
        self.client.hset(self.control, "phase", phase)
        self.record(f"request:{phase}")

    def request(self, what: str) -> int:
        """A checkpoint or an export before the learner's next update; returns its number."""
        if what not in ("checkpoint", "export"):
            raise ValueError(f"cannot request {what!r}")
        n = int(self.client.hincrby(self.control, what, 1))
        self.record(f"request:{what}", {"seq": n})
        return n

    def set_workers(self, n: int) -> None:
        if not isinstance(n, int) or n < 0:
            raise ValueError(f"workers must be an integer >= 0, got {n!r}")
        self.client.hset(self.control, "workers", n)
        self.record("request:scale", {"workers": n})

    def patch(self, values: dict[str, Any]) -> dict[str, float | int]:
        typed = validate_hparams(values)
        if typed:
            self.client.hset(
                self.control, mapping={f"hp:{k}": json.dumps(v) for k, v in typed.items()}
            )
            self.record("request:hparams", typed)
        return typed

    # -- the services' side -------------------------------------------------------------------

    def read(self) -> ControlState:
        raw = {k.decode(): v.decode() for k, v in self.client.hgetall(self.control).items()}
        hp: dict[str, float | int] = {}
        for k, v in raw.items():
            if k.startswith("hp:") and k[3:] in HPARAMS:
                try:
                    hp.update(validate_hparams({k[3:]: json.loads(v)}))
                except (ValueError, json.JSONDecodeError):
                    continue  # a foreign writer's garbage never reaches a learner
        phase = raw.get("phase", "running")
        return ControlState(
            phase=phase if phase in PHASES else "running",
            workers=int(raw["workers"]) if raw.get("workers", "").isdigit() else None,
            checkpoint=int(raw.get("checkpoint", 0) or 0),
            export=int(raw.get("export", 0) or 0),
            hparams=hp,
            driver_seen=_float(raw.get("driver_seen")),
        )

    def clear_stale_stop(self, started: float) -> bool:
        """A process that starts at ``started`` (epoch seconds) means to run: a stop requested
        before it is over (phase back to running). A stop requested since is kept, so a stop
        sent while the run was starting still stops it. True if it cleared one."""
        if self.read().phase != "stopping":
            return False
        for _eid, fields in self.client.xrevrange(self.events_key, count=200):
            if fields.get(b"kind") == b"request:stopping":
                if float(fields.get(b"time", b"0")) >= started:
                    return False
                break
        self.client.hset(self.control, "phase", "running")
        return True

    def publish_status(self, status: dict[str, Any]) -> None:
        self.client.hset(
            self.status,
            mapping={k: json.dumps(v) for k, v in status.items()}
            | {"time": json.dumps(time.time())},
        )

    def read_status(self) -> dict[str, Any]:
        return {k.decode(): json.loads(v) for k, v in self.client.hgetall(self.status).items()}

    def events(self, count: int = 100, after: str = "-") -> list[dict[str, Any]]:
        start = after if after == "-" else f"({after}"
        rows = self.client.xrange(self.events_key, min=start, max="+", count=count)
        out = []
        for eid, fields in rows:
            f = {k.decode(): v.decode() for k, v in fields.items()}
            out.append(
                {
                    "id": eid.decode(),
                    "time": float(f["time"]),
                    "kind": f["kind"],
                    "step": int(f["step"]) if "step" in f else None,
                    "detail": json.loads(f.get("detail", "{}")),
                }
            )
        return out

    def clear(self) -> None:
        """A new run under this name starts with no requests pending."""
        self.client.delete(self.control, self.status, self.events_key)
