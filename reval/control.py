"""Live control of a run through Redis: what the REST API (``services/api/``) and
``reval runs ...`` write, and what the learner, the rollout workers and the ``reval launch``
driver read between steps. Everything lives in Redis, so the API can restart while a run goes on.

Keys of run R (built in ``reval.redis``; the run's hash tag, so one Redis Cluster slot):

- ``control`` (hash): the desired ``phase`` (``running``, ``paused``, ``stopping``),
  the desired rollout ``workers`` (``reval launch`` scales to it), the sequence numbers of
  ``checkpoint`` and ``export`` requests, one field ``hp:<name>`` (a JSON number) per live
  hyperparameter requested (``LiveHParams``), and what ``reval launch``'s driver adds about
  itself (``driver_seen`` and its status, ``driver``; its mark, ``launcher``: the run's
  workers follow ``workers``).
- ``status`` (hash): what the learner reports after each update (phase, step,
  policy version, the last metrics, the checkpoints, the hyperparameters in force).
- ``events`` (stream): every request and every change applied, with the learner's
  step: ``reval runs events`` and ``GET /v1/runs/{R}/events`` read it.
- ``learner`` (string with a time to live): the lease of the run's one learner
  (``RunLease``), holding its identity.

The live hyperparameters are one typed model, ``LiveHParams``: the API's PATCH body, what
``RunControl.patch`` writes and what ``RunControl.read`` returns. The learner applies its fields
at its next step and records each change with that step; the rollout workers apply theirs
(``temperature``) between batches.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, cast

import redis
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from reval.procs import pid_alive
from reval.redis import control_key, events_key, lease_key, runs_key, status_key

PHASES = ("running", "paused", "stopping")

Applier = Literal["learner", "rollout"]
"""Who applies a live hyperparameter: the learner (at its next step) or the rollout workers
(between batches)."""


def _applied_by(who: Applier) -> dict[str, Any]:
    return {"applied_by": who}


class LiveHParams(BaseModel):
    """The hyperparameters that change without a restart: the body of
    ``PATCH /v1/runs/{name}/hparams``, what the control hash holds (one ``hp:<name>`` field each)
    and what ``RunControl.read()`` hands to the learner and the workers. Every field is optional
    (None: not set, the run's config is in force); unknown names, non-numbers (strings, booleans),
    non-finite values and values out of bounds are refused. Immutable: build a new one with
    ``merged``. Each field's ``applied_by`` (its JSON schema extra; ``applied_by(name)``) says who
    applies it."""

    model_config = ConfigDict(
        extra="forbid", frozen=True, allow_inf_nan=False, use_attribute_docstrings=True
    )

    beta: float | None = Field(None, gt=0, le=1e6, json_schema_extra=_applied_by("learner"))
    """KL strength beta of the soft Bellman residual (``algo.beta``)."""
    lr: float | None = Field(None, gt=0, le=10.0, json_schema_extra=_applied_by("learner"))
    """Learning rate of every optimizer parameter group (``learner.lr``)."""
    samples_per_insert: float | None = Field(
        None, gt=0, le=1e6, json_schema_extra=_applied_by("learner")
    )
    """K: the replay limiter's sample-to-insert ratio (``buffer.samples_per_insert``)."""
    ref_reset_steps: int | None = Field(
        None, ge=0, le=1_000_000_000, json_schema_extra=_applied_by("learner")
    )
    """Copy the policy into the reference every this many rounds; 0: never
    (``learner.ref_reset_steps``)."""
    max_staleness: int | None = Field(
        None, ge=-1, le=1_000_000_000, json_schema_extra=_applied_by("learner")
    )
    """Skip trajectories more than this many policy versions old; -1 turns the check off
    (``buffer.max_staleness``)."""
    temperature: float | None = Field(
        None, gt=0, le=100.0, json_schema_extra=_applied_by("rollout")
    )
    """Sampling temperature of the rollout workers, from their next batch
    (``rollout.temperature``)."""

    @field_validator("*", mode="before")
    @classmethod
    def _a_number(cls, value: Any) -> Any:
        # Numbers only: no "0.1" and no True (which lax validation would take as 1).
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
            raise ValueError(f"must be a number, got {value!r}")
        return value

    @classmethod
    def applied_by(cls, name: str) -> Applier:
        """``"learner"`` or ``"rollout"``; KeyError for a name that is not a field."""
        extra = cls.model_fields[name].json_schema_extra
        assert isinstance(extra, dict)
        return cast(Applier, extra["applied_by"])

    @classmethod
    def checked(cls, values: Mapping[str, Any]) -> LiveHParams:
        """``values`` validated; a ValueError naming every bad field (``name: why``)."""
        try:
            return cls.model_validate(dict(values))
        except ValidationError as err:
            problems = []
            for e in err.errors():
                name = ".".join(str(p) for p in e["loc"]) or "hparams"
                if e["type"] == "extra_forbidden":
                    why = f"not a live hyperparameter (one of {sorted(cls.model_fields)})"
                else:
                    why = e["msg"].removeprefix("Value error, ")
                problems.append(f"{name}: {why}")
            raise ValueError("; ".join(problems)) from None

    def set_fields(self) -> dict[str, Any]:
        """The fields that are set (not None), by name: for logs, events and status."""
        return self.model_dump(exclude_none=True)

    def merged(self, other: LiveHParams) -> LiveHParams:
        """These values with ``other``'s set fields on top."""
        return self.model_copy(update=other.set_fields())

    def learner_changes(self, applied: LiveHParams) -> LiveHParams:
        """The learner-applied fields set here whose value differs from ``applied`` (the
        values in force); every other field None. Empty (no field set) when nothing changes."""
        return LiveHParams(**{
            name: value for name, value in self.set_fields().items()
            if self.applied_by(name) == "learner" and getattr(applied, name) != value
        })  # fmt: skip


EVENTS_MAXLEN = 10_000


def _float(text: str | None) -> float | None:
    try:
        return None if text is None else float(text)
    except ValueError:
        return None


def adopt_run(client: redis.Redis, prefix: str, run: str, config: dict[str, Any]) -> bool:
    """Show a run started outside the API (``reval learner`` under compose or by hand) in the
    API's registry; a run the API created keeps its entry. True if it was added."""
    entry = {"created": time.time(), "config": config, "pid": None, "started": True,
             "external": True}  # fmt: skip
    return bool(client.hsetnx(runs_key(prefix), run, json.dumps(entry)))


class RunStatus(BaseModel):
    """What the learner reports after each update (the run's ``status`` hash): what
    ``GET /v1/runs/{name}`` shows."""

    model_config = ConfigDict(extra="ignore")
    phase: str | None = None
    """``starting``, ``running``, ``paused``, ``stopped``, ``done``, ``failed`` (None: nothing
    reported)."""
    step: int | None = None
    """Optimizer steps taken."""
    updates: int | None = None
    """Update attempts (skipped steps included)."""
    policy_version: int | None = None
    """The version of the weights last published."""
    hparams: dict[str, Any] = Field(default_factory=dict)
    """The live hyperparameters in force."""
    checkpoints: list[str] = Field(default_factory=list)
    """The newest checkpoints' names."""
    last: dict[str, Any] | None = None
    """The last update's metrics."""
    time: float | None = None
    """When it was written."""


DRIVER_TIMEOUT_S = 30.0
"""A ``reval launch`` driver whose heartbeat is older than this is gone."""

LAUNCH_START_S = 900.0
"""A ``reval launch`` driver's mark with no heartbeat since, older than this, is a driver that
died while it started (its placement wait is 600 s, then the learner's start)."""

STARTING_BEAT_S = 5.0
"""While ``reval learner`` starts (the model, the tiny model's pretraining, the ranks joining),
it writes the run's status phase ``starting`` this often (``learner/ranks.py:
StartingStatus``), until its rank 0 reports a phase of its own (after its first update, a
pause or a stop), which the beat never writes over."""

STARTING_TIMEOUT_S = 30.0
"""A ``starting`` status older than this, with the run's lease not held, is a learner that died
while it started."""


@dataclass
class ControlState:
    phase: str = "running"
    workers: int | None = None
    checkpoint: int = 0
    export: int = 0
    hparams: LiveHParams = field(default_factory=LiveHParams)
    """The live hyperparameters requested so far (unset fields: the config's values)."""
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

    def patch(self, values: LiveHParams | Mapping[str, Any]) -> LiveHParams:
        """Request live hyperparameters (validated first: a ValueError naming the bad field
        writes nothing); returns them typed."""
        typed = values if isinstance(values, LiveHParams) else LiveHParams.checked(values)
        if changed := typed.set_fields():
            self.client.hset(
                self.control, mapping={f"hp:{k}": json.dumps(v) for k, v in changed.items()}
            )
            self.record("request:hparams", changed)
        return typed

    # -- the services' side -------------------------------------------------------------------

    def read(self) -> ControlState:
        raw = {k.decode(): v.decode() for k, v in self.client.hgetall(self.control).items()}
        hp: dict[str, Any] = {}
        for k, v in raw.items():
            if k.startswith("hp:") and k[3:] in LiveHParams.model_fields:
                try:
                    hp.update(LiveHParams.checked({k[3:]: json.loads(v)}).set_fields())
                except ValueError:  # (json.JSONDecodeError is one)
                    continue  # a foreign writer's garbage never reaches a learner
        phase = raw.get("phase", "running")
        return ControlState(
            phase=phase if phase in PHASES else "running",
            workers=int(raw["workers"]) if raw.get("workers", "").isdigit() else None,
            checkpoint=int(raw.get("checkpoint", 0) or 0),
            export=int(raw.get("export", 0) or 0),
            hparams=LiveHParams.model_validate(hp),
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

    def publish_status(self, status: RunStatus | Mapping[str, Any]) -> None:
        """Write the fields ``status`` sets (the others keep what was there), and the time."""
        given = RunStatus.model_validate(status).model_dump(exclude_unset=True)
        given["time"] = time.time()
        self.client.hset(self.status, mapping={k: json.dumps(v) for k, v in given.items()})

    def read_status(self) -> RunStatus:
        """The run's status as its learner last wrote it; a field a foreign writer garbled is
        left out."""
        raw = {k.decode(): v for k, v in self.client.hgetall(self.status).items()}
        fields: dict[str, Any] = {}
        for k, v in raw.items():
            try:
                value = json.loads(v)
                RunStatus.model_validate({k: value})
            except ValueError:  # (json.JSONDecodeError and ValidationError are ValueErrors)
                continue
            fields[k] = value
        return RunStatus.model_validate(fields)

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

    def beat_driver(self, status: Mapping[str, Any]) -> None:
        """The ``reval launch`` driver's heartbeat, once a loop: when it last went round and its
        status (its workers, the learner's restarts), which ``reval launch --status`` reads."""
        driver = json.dumps(status, default=str)
        self.client.hset(self.control, mapping={"driver_seen": time.time(), "driver": driver})

    def driver(self) -> dict[str, Any] | None:
        """The status the run's driver last wrote, while its heartbeat is fresher than
        ``DRIVER_TIMEOUT_S``; None when no driver runs the run."""
        seen, raw = self.client.hmget(self.control, ["driver_seen", "driver"])
        beat = _float(seen.decode() if seen else None)
        if beat is None or raw is None or time.time() - beat >= DRIVER_TIMEOUT_S:
            return None
        out = json.loads(raw)
        return out if isinstance(out, dict) else None

    def mark_launched(self, where: Mapping[str, Any]) -> None:
        """``reval launch``'s driver marks the run it drives, at its start (before the learner
        registers the run, which shows it as started outside the API): it starts and drains the
        run's workers to the desired count. ``where``: its Ray (``ray_address``, None for a Ray
        of its own; that one's ``cpus`` and ``room`` for CPU workers)."""
        mark = json.dumps({**where, "since": time.time()}, default=str)
        self.client.hset(self.control, "launcher", mark)

    def launcher(self) -> dict[str, Any] | None:
        """The mark of the ``reval launch`` driver that drives the run (``mark_launched``) while
        it does: its heartbeat is fresher than ``DRIVER_TIMEOUT_S``, or it marked the run since
        its last heartbeat less than ``LAUNCH_START_S`` ago (Ray placing the learner, its
        start). None for a run no driver drives (compose, ``reval learner`` by hand)."""
        seen, raw = self.client.hmget(self.control, ["driver_seen", "launcher"])
        try:
            mark = json.loads(raw) if raw is not None else None
        except ValueError:
            return None
        if not isinstance(mark, dict):
            return None
        now, beat = time.time(), _float(seen.decode() if seen else None)
        if beat is not None and now - beat < DRIVER_TIMEOUT_S:
            return mark
        since = _float(str(mark.get("since")))
        if since is None or (beat is not None and beat >= since) or now - since >= LAUNCH_START_S:
            return None
        return mark

    def restart(self) -> None:
        """The run starts again: its last final status goes and its phase is running."""
        self.client.delete(self.status)
        self.client.hset(self.control, "phase", "running")

    def clear(self) -> None:
        """A new run under this name starts with no requests pending."""
        self.client.delete(self.control, self.status, self.events_key)


# -- one learner per run ------------------------------------------------------------------------


class LeaseHeld(RuntimeError):
    """Another learner holds the run's lease; the message names it."""


_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


def _alive_here(holder: dict[str, Any]) -> bool:
    """Whether a holder on this host may still run: its pid is a live process (or not a pid
    at all). A pid reused by another process (a restarted container) counts as alive: its lease
    then runs out."""
    pid = holder.get("pid")
    return not isinstance(pid, int) or pid <= 0 or pid_alive(pid)


class RunLease:
    """The run's one-learner lease: a Redis key set with ``SET NX PX`` holding the holder's
    identity (host, pid, start time), renewed every third of its time by a thread while the
    learner runs, deleted on release (only by its holder). A second learner on the run waits up
    to one lease time for it (a holder that died frees it by then; one on this host that is
    gone frees it at once), then refuses, naming the holder."""

    def __init__(self, client: redis.Redis, prefix: str, run: str, ttl_s: float) -> None:
        self.client = client
        self.key = lease_key(prefix, run)
        self.run = run
        self.ttl_ms = max(1, int(ttl_s * 1000))
        self.identity = json.dumps(
            {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time()}
        )
        self.lost = threading.Event()
        """Set when a renewal found the lease gone to another holder: stop without writing."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def holder(self) -> dict[str, Any] | None:
        raw = self.client.get(self.key)
        if raw is None:
            return None
        try:
            out = json.loads(raw)
        except ValueError:
            return {"raw": raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)}
        return out if isinstance(out, dict) else {"raw": str(out)}

    def live_holder(self) -> dict[str, Any] | None:
        """The holder while it may be alive; None when the lease is free or its holder on this
        host is gone (``acquire`` would take it at once)."""
        holder = self.holder()
        if holder and holder.get("host") == socket.gethostname() and not _alive_here(holder):
            return None
        return holder

    def acquire(self, wait_s: float | None = None) -> None:
        """Take the lease (waiting up to ``wait_s``, default one lease time, for a holder to
        go) and start renewing it; LeaseHeld naming the holder otherwise."""
        deadline = time.monotonic() + (self.ttl_ms / 1000 if wait_s is None else wait_s)
        while not self.client.set(self.key, self.identity, nx=True, px=self.ttl_ms):
            holder = self.holder() or {}
            if holder.get("host") == socket.gethostname() and not _alive_here(holder):
                self.client.eval(_RELEASE, 1, self.key, json.dumps(holder))  # a dead one's
                continue
            if time.monotonic() >= deadline:
                raise LeaseHeld(
                    f"run {self.run!r} has a learner already: pid {holder.get('pid')} on "
                    f"{holder.get('host')!r}, started "
                    f"{time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(holder.get('started', 0)))}"
                    f" UTC (Redis key {self.key}); stop it first. A learner that died frees the "
                    f"lease within {self.ttl_ms / 1000:g} s"
                )
            time.sleep(min(0.5, self.ttl_ms / 4000))
        self._thread = threading.Thread(target=self._renew, name="reval-lease", daemon=True)
        self._thread.start()

    def _renew(self) -> None:
        while not self._stop.wait(self.ttl_ms / 3000):
            try:
                if self.client.eval(_RENEW, 1, self.key, self.identity, self.ttl_ms):
                    continue
                # Expired (Redis was away longer than a lease): take it again if nobody has.
                if self.client.set(self.key, self.identity, nx=True, px=self.ttl_ms):
                    continue
                self.lost.set()
                return
            except redis.RedisError:
                continue  # Redis away: try again next turn

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        with contextlib.suppress(redis.RedisError):  # (it expires)
            self.client.eval(_RELEASE, 1, self.key, self.identity)
