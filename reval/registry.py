"""Where rollout workers announce themselves: one key per worker with its details (expiring
after three missed heartbeats) and a sorted set of last-seen times, so counting the live workers
is one ZCOUNT, not a SCAN over the run's keyspace (which holds every record)."""

from __future__ import annotations

import json
import time
from typing import Any

import redis

from reval.redis import task_key as task_key  # (where the workers read the task setup)
from reval.redis import worker_key, workers_index


def register(
    client: redis.Redis, prefix: str, run: str, info: dict[str, Any], heartbeat_s: float
) -> None:
    now = time.time()
    ttl = max(1, int(3 * heartbeat_s + 0.999))
    pipe = client.pipeline(transaction=True)
    pipe.set(worker_key(prefix, run, info["id"]), json.dumps(info), ex=ttl)
    pipe.zadd(workers_index(prefix, run), {info["id"]: now})
    pipe.execute()


def deregister(client: redis.Redis, prefix: str, run: str, worker_id: str) -> None:
    pipe = client.pipeline(transaction=True)
    pipe.delete(worker_key(prefix, run, worker_id))
    pipe.zrem(workers_index(prefix, run), worker_id)
    pipe.execute()


def workers(client: redis.Redis, prefix: str, run: str) -> list[dict[str, Any]]:
    """The registered workers' details (what each last registered: ``id``, ``status``,
    ``policy_version``, ...), by id; one whose key has expired is left out."""
    out = []
    for wid in sorted(m.decode() for m in client.zrange(workers_index(prefix, run), 0, -1)):
        raw = client.get(worker_key(prefix, run, wid))
        if raw is not None:
            out.append({**json.loads(raw), "id": wid})
    return out


def count_alive(client: redis.Redis, prefix: str, run: str, heartbeat_s: float) -> int:
    """Workers seen within three heartbeats (older entries are dropped from the index)."""
    index = workers_index(prefix, run)
    since = time.time() - 3 * heartbeat_s
    pipe = client.pipeline(transaction=False)
    pipe.zremrangebyscore(index, "-inf", f"({since}")
    pipe.zcard(index)
    return int(pipe.execute()[1])
