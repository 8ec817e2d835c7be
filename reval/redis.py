"""Every Redis key reval uses, and the one way to build a Redis client (``connect``).

The layout (docs/architecture.md, "Every Redis key"): ``P`` is the key prefix (``redis.prefix``,
default ``reval:``) and ``R`` the run's name. A run's keys are ``P{R}:<what>``: the braces are
literal, ``{R}`` is the Redis Cluster hash tag, so all of a run's keys share one slot and a
script or a MULTI may touch any of them. The API's registry spans runs, so its keys have no tag:
``Papi:runs`` and ``Papi:runs:claim:<name>``. No other module spells a key; Lua scripts take
theirs as ``KEYS[]`` arguments.

No torch here, and nothing from the floors above (the ground floor).
"""

from __future__ import annotations

from typing import NamedTuple

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

SOCKET_TIMEOUT_S = 30.0
"""Seconds a command may wait for its reply before it fails (and is retried)."""
CONNECT_TIMEOUT_S = 2.0
"""Seconds to open a connection."""
HEALTH_CHECK_S = 15
"""A connection idle this long is PINGed before it is used again (a server that restarted or a
NAT that dropped it shows as a retry, not as a failed command)."""
RETRIES = 3
"""Retries of a command on a dropped connection or a timeout, with exponential backoff from
50 ms up to 1 s, before the error reaches the caller (whose own retry, if any, takes over: the
replay ring's budget, ``reval.retry.retry_redis``)."""


def connect(
    url: str,
    *,
    timeout_s: float = SOCKET_TIMEOUT_S,
    connect_timeout_s: float = CONNECT_TIMEOUT_S,
    retries: int = RETRIES,
) -> redis.Redis:
    """A client of the Redis at ``url`` (``redis://host:port/db``, ``rediss://`` for TLS, a
    password in the URL) with the run's timeouts and retries; every process builds its clients
    here. ``timeout_s``: the reply timeout (shorter for the control plane's quick reads)."""
    return redis.Redis.from_url(
        url,
        socket_timeout=timeout_s,
        socket_connect_timeout=min(connect_timeout_s, timeout_s),
        health_check_interval=HEALTH_CHECK_S,
        retry=Retry(ExponentialBackoff(cap=1.0, base=0.05), retries),
        retry_on_error=[redis.ConnectionError, redis.TimeoutError],
    )


def _run(prefix: str, run: str) -> str:
    """What every key of run ``run`` starts with: ``{prefix}{run}:`` with ``run`` in braces."""
    return f"{prefix}{{{run}}}:"


# -- one run's control plane (reval/control.py) ---------------------------------------------------


def control_key(prefix: str, run: str) -> str:
    """Hash: the run's control (phase, workers, checkpoint/export sequence numbers, hp:<name>)."""
    return _run(prefix, run) + "control"


def status_key(prefix: str, run: str) -> str:
    """Hash: the learner's status (phase, step, ..., JSON values)."""
    return _run(prefix, run) + "status"


def events_key(prefix: str, run: str) -> str:
    """Stream: the run's events (``time kind step detail``)."""
    return _run(prefix, run) + "events"


def lease_key(prefix: str, run: str) -> str:
    """String with a PX expiry: the one learner's lease (``RunLease``)."""
    return _run(prefix, run) + "learner"


# -- the workers (reval/registry.py, rollout/dealer.py) -------------------------------------------


def worker_key(prefix: str, run: str, worker_id: str) -> str:
    """String with an expiry: one rollout worker's registration (JSON)."""
    return _run(prefix, run) + f"workers:{worker_id}"


def workers_index(prefix: str, run: str) -> str:
    """Sorted set: worker id -> last-seen time."""
    return _run(prefix, run) + "workers"


def task_key(prefix: str, run: str) -> str:
    """String: the task setup the learner shares with the workers (JSON)."""
    return _run(prefix, run) + "task"


def deal_key(prefix: str, run: str, fingerprint: str) -> str:
    """String (an integer): positions dealt of the prompt set with this fingerprint."""
    return _run(prefix, run) + f"deal:{fingerprint}"


# -- weights (reval/weights/files.py) -------------------------------------------------------------


def weights_key(prefix: str, run: str) -> str:
    """Hash: the announced weights (version, lineage, broadcast address, file)."""
    return _run(prefix, run) + "weights"


# -- the REST API's registry (no hash tag: it spans runs) -----------------------------------------


def runs_key(prefix: str) -> str:
    """Hash: the REST API's registry of the runs it shows (name -> JSON entry)."""
    return f"{prefix}api:runs"


def claim_key(prefix: str, name: str) -> str:
    """String, NX with an expiry: one creator or starter of run ``name`` at a time."""
    return f"{runs_key(prefix)}:claim:{name}"


# -- the replay ring (buffer/) --------------------------------------------------------------------


class RingKeys(NamedTuple):
    """A run's ring keys, in the order its Lua scripts take them (``rec`` is the prefix of the
    record chunks' keys, ``rec + str(start)``)."""

    meta: str
    dig: str
    tree: str
    ver: str
    use: str
    chunks: str
    rec: str

    @property
    def stored(self) -> list[str]:
        """The keys other than the record chunks' (and the stages')."""
        return list(self[:6])

    @property
    def stage(self) -> str:
        """The prefix of the stage hashes that producers write chunks to (``stage + id``)."""
        return self.rec[: -len("r:")] + "stage:"

    def chunk(self, start: int) -> str:
        """The hash of the chunk whose first position is ``start``."""
        return f"{self.rec}{start}"

    def repair(self) -> str:
        """Shell commands that delete these keys and only these (the run's other keys stay)."""
        stored = " ".join(f"'{k}'" for k in self.stored)
        base = self.rec[: -len("r:")]
        return (
            f"redis-cli del {stored}; for k in r stage; do redis-cli --scan --pattern "
            f'"{base}$k:*" | xargs -r redis-cli del; done'
        )


def ring_keys(prefix: str, run: str) -> RingKeys:
    """The ring keys of run ``run`` (one hash tag, so a Redis Cluster keeps them together)."""
    if not run or any(c in run for c in "{}: \n"):
        raise ValueError(f"run id must be non-empty without braces, colons or spaces: {run!r}")
    base = _run(prefix, run)
    return RingKeys._make([*(base + k for k in RingKeys._fields[:6]), base + "r:"])
