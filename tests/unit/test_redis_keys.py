"""reval/redis.py: the one module that spells Redis keys and builds clients."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from redis.crc import key_slot

from reval import redis as keys

ROOT = Path(__file__).resolve().parents[2]
LIBRARY = ("reval", "buffer", "rollout", "learner", "services")
# How a key is spelt in Python: a run's hash tag in an f-string, the API's registry, a claim.
SPELT = re.compile(r"\}\{\{\{\w+\}\}\}:|api:runs|:claim:")


def _run_keys(prefix: str, run: str) -> list[str]:
    ring = keys.ring_keys(prefix, run)
    return [
        keys.control_key(prefix, run),
        keys.status_key(prefix, run),
        keys.events_key(prefix, run),
        keys.lease_key(prefix, run),
        keys.worker_key(prefix, run, "w-1"),
        keys.workers_index(prefix, run),
        keys.task_key(prefix, run),
        keys.deal_key(prefix, run, "64-0123456789ab"),
        keys.weights_key(prefix, run),
        *ring.stored,
        ring.chunk(128),
        ring.stage + "0a1b",
    ]


def test_a_runs_keys_are_distinct_and_share_its_cluster_slot():
    run_a, run_b = _run_keys("p:", "demo"), _run_keys("p:", "other")
    assert len(set(run_a)) == len(run_a)
    assert {key_slot(k.encode()) for k in run_a} == {key_slot(b"{demo}")}
    assert all(k.startswith("p:{demo}:") for k in run_a)
    assert not set(run_a) & set(run_b)
    # The API's registry spans runs: no tag, and one claim per name beside it.
    assert keys.runs_key("p:") == "p:api:runs"
    assert keys.claim_key("p:", "demo") != keys.claim_key("p:", "other")
    assert keys.claim_key("p:", "demo").startswith(keys.runs_key("p:"))


def test_a_run_id_that_breaks_the_layout_is_refused():
    for bad in ("", "a:b", "a{b", "a}b", "a b"):
        with pytest.raises(ValueError, match="run id"):
            keys.ring_keys("p:", bad)


def test_the_ring_repair_deletes_only_the_rings_keys():
    ring = keys.ring_keys("p:", "demo")
    repair = ring.repair()
    for key in ring.stored:
        assert f"'{key}'" in repair
    for other in (keys.control_key("p:", "demo"), keys.weights_key("p:", "demo")):
        assert other not in repair
    assert '"p:{demo}:$k:*"' in repair  # (k in r stage: the chunks and the stages)


def test_no_other_module_spells_a_redis_key():
    found = []
    for pkg in LIBRARY:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            if path == ROOT / "reval" / "redis.py":
                continue
            for n, line in enumerate(path.read_text().splitlines(), 1):
                code = line.split("#", 1)[0]
                if SPELT.search(code):
                    found.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not found, "keys belong in reval/redis.py:\n" + "\n".join(found)


def test_every_client_is_built_by_connect():
    found = []
    for pkg in LIBRARY:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            if path == ROOT / "reval" / "redis.py":
                continue
            text = path.read_text()
            for pattern in ("Redis.from_url(", "redis.Redis(", "StrictRedis("):
                if pattern in text:
                    found.append(f"{path.relative_to(ROOT)}: {pattern}")
    assert not found, "build clients with reval.redis.connect:\n" + "\n".join(found)
