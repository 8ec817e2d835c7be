"""Honest answers of the REST API (issue 38), through FastAPI's test client against real Redis: a
run whose learner has started but not registered yet is a 404 that says so (it was ``404 no run``
for ~70 s after ``docker compose up``), long names are cut in errors (a 10,000-character name was
echoed), scale answers say what the deployment can run (a compose stack with two workers said
202 to 3), and /metrics carries each live run's running and desired workers (the alert's
inputs)."""

from __future__ import annotations

import json
import re
import time
from types import SimpleNamespace

import pytest
import redis
from fastapi.testclient import TestClient

from reval import registry
from reval.config import ApiConfig
from reval.control import RunControl, RunLease, adopt_run
from services.api import create_app
from services.api.runs import NAME_SHOWN

TOKEN = "t0ken-for-the-signal-tests-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
def api_cfg(tmp_path, redis_url, redis_prefix):
    return ApiConfig(redis_url=redis_url, key_prefix=redis_prefix, output_dir=str(tmp_path))


@pytest.fixture
def client(api_cfg, monkeypatch):
    monkeypatch.setenv(api_cfg.token_env, TOKEN)
    return TestClient(create_app(api_cfg))


@pytest.fixture
def r(api_cfg):
    c = redis.Redis.from_url(api_cfg.redis_url)
    yield c
    c.close()


def worker(r, api_cfg, run: str, wid: str, status: str = "running", started: float = 1.0):
    info = {"id": wid, "status": status, "started": started, "policy_version": 1}
    registry.register(r, api_cfg.key_prefix, run, info, heartbeat_s=30)


def external_run(r, api_cfg, run: str, workers: int) -> RunLease:
    """A learner started outside the API (compose) that registered and reports running."""
    lease = RunLease(r, api_cfg.key_prefix, run, ttl_s=30)
    lease.acquire()
    adopt_run(r, api_cfg.key_prefix, run, {"name": run, "launch": {"workers": workers}})
    RunControl(r, api_cfg.key_prefix, run).publish_status({"phase": "running", "step": 3})
    return lease


def test_a_run_whose_learner_has_not_registered_yet_is_not_no_such_run(client, r, api_cfg):
    gone = client.get("/v1/runs/run").json()["detail"]
    assert "no run 'run'" in gone and "no learner or rollout worker" in gone
    lease = RunLease(r, api_cfg.key_prefix, "run", ttl_s=30)
    lease.acquire()  # the learner's first act, a minute before it registers the run
    try:
        got = client.get("/v1/runs/run")
        assert got.status_code == 404
        assert "run 'run' is not registered yet: its learner started" in got.json()["detail"]
        worker(r, api_cfg, "run", "w0")
        detail = client.get("/v1/runs/run").json()["detail"]
        assert "its learner and 1 rollout worker(s) started" in detail and "ask again" in detail
        # the same answer from the actions on it
        assert "not registered yet" in client.post("/v1/runs/run/pause", headers=AUTH).text
    finally:
        lease.release()
    registry.deregister(r, api_cfg.key_prefix, "run", "w0")
    assert "no learner" in client.get("/v1/runs/run").json()["detail"]
    # A learner still pretraining says "starting" before it takes the lease.
    RunControl(r, api_cfg.key_prefix, "run").publish_status({"phase": "starting"})
    assert "is not registered yet: its learner started" in client.get("/v1/runs/run").text


def test_long_names_are_cut_in_errors(client):
    name = "x" * 10_000
    for got in (client.get(f"/v1/runs/{name}"),
                client.post(f"/v1/runs/{name}/stop", headers=AUTH),
                client.get(f"/v1/runs/{name}/events")):  # fmt: skip
        assert got.status_code == 404
        assert len(got.text) < 300, got.text[:400]
        assert f"'{'x' * NAME_SHOWN}'... ({10_000 - NAME_SHOWN} more characters)" in got.text


def test_scale_says_what_the_deployment_can_run(client, r, api_cfg):
    lease = external_run(r, api_cfg, "stack", workers=2)
    try:
        worker(r, api_cfg, "stack", "w0", started=1.0)
        worker(r, api_cfg, "stack", "w1", started=2.0)
        got = client.post("/v1/runs/stack/scale", json={"workers": 3}, headers=AUTH)
        assert got.status_code == 202
        detail = got.json()["detail"]
        assert detail["workers"] == 3 and detail["running"] == 2
        assert detail["executor"] == "external" and detail["can_start"] is False
        assert "the API starts no worker" in detail["note"]
        assert "only the 2 running now generate" in detail["note"]
        down = client.post("/v1/runs/stack/scale", json={"workers": 1}, headers=AUTH).json()
        assert "only the" not in down["detail"]["note"]  # (fewer: the surplus goes on standby)
    finally:
        lease.release()
    # A run the API launches: reval launch on a Ray of its own (4 CPUs: the learner's 1 and
    # room for 3 workers of 1 CPU) starts them, up to its room.
    launch = {"workers": 1, "local_cpus": 4, "learner_cpus": 1, "rollout_cpus": 1}
    body = {"config": {"name": "launched", "launch": launch}, "start": False}
    assert client.post("/v1/runs", json=body, headers=AUTH).status_code == 201
    RunControl(r, api_cfg.key_prefix, "launched").publish_status({"phase": "running"})
    detail = client.post("/v1/runs/launched/scale", json={"workers": 4}, headers=AUTH).json()
    detail = detail["detail"]
    assert detail["executor"] == "local-ray" and detail["can_start"] is True
    assert detail["room"] == 3
    assert "reval launch starts or drains workers to 4" in detail["note"]
    assert (
        "(4 CPUs: room for 3 workers)" in detail["note"] and "1 of them will wait" in detail["note"]
    )
    fits = client.post("/v1/runs/launched/scale", json={"workers": 3}, headers=AUTH).json()
    assert "will wait" not in fits["detail"]["note"]


def hand_launch(monkeypatch, r, api_cfg, run: str, launch: dict):
    """``reval launch`` started by hand (no Ray: a local one of ``launch.local_cpus`` CPUs is
    only pretended): its driver marks the run at its start, before the learner registers it."""
    import importlib

    import ray

    from reval.config import RunConfig
    from services import launch as launch_mod

    # (the module: ray.util.placement_group as an attribute is the function)
    pg = importlib.import_module("ray.util.placement_group")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: None)
    monkeypatch.setattr(pg, "placement_group", lambda *a, **kw: SimpleNamespace(ready=lambda: 0))
    monkeypatch.setattr(launch_mod, "wait_logged", lambda *a, **kw: None)
    redis_cfg = {"url": api_cfg.redis_url, "prefix": api_cfg.key_prefix}
    return launch_mod.Launch(RunConfig(name=run, redis=redis_cfg, launch=launch))


def test_scale_of_a_hand_started_launch_says_its_driver_starts_them(
    client, r, api_cfg, monkeypatch
):
    launch = {"workers": 1, "local_cpus": 4, "learner_cpus": 1, "rollout_cpus": 1}
    driver = hand_launch(monkeypatch, r, api_cfg, "hand", launch)
    lease = external_run(r, api_cfg, "hand", workers=1)  # (its learner registers the run)
    try:
        worker(r, api_cfg, "hand", "w0")
        got = client.post("/v1/runs/hand/scale", json={"workers": 4}, headers=AUTH)
        assert got.status_code == 202
        detail = got.json()["detail"]
        # was: "the API starts no worker ... more need more worker processes (compose ...)"
        assert detail["executor"] == "local-ray" and detail["can_start"] is True
        assert "the API starts no worker" not in detail["note"]
        assert "started by hand with `reval launch`" in detail["note"]
        assert "starts or drains workers to 4" in detail["note"]
        assert "as many as the Ray cluster's resources allow" in detail["note"]
        assert detail["room"] == 3 and "1 of them will wait" in detail["note"]
        # Its heartbeat keeps the mark; once it is gone, nothing scales the run.
        driver.control.beat_driver({"run": "hand"})
        again = client.post("/v1/runs/hand/scale", json={"workers": 2}, headers=AUTH).json()
        assert again["detail"]["executor"] == "local-ray"
        # The driver gone (marked two minutes ago, its last heartbeat a minute ago):
        mark = {"ray_address": None, "cpus": 4, "room": 3, "since": time.time() - 120}
        r.hset(driver.control.control, mapping={"driver_seen": time.time() - 60,
                                                "launcher": json.dumps(mark)})  # fmt: skip
        gone = client.post("/v1/runs/hand/scale", json={"workers": 2}, headers=AUTH).json()
        assert gone["detail"]["executor"] == "external"
    finally:
        lease.release()


def series(text: str, name: str) -> dict[str, float]:
    out = {}
    for m in re.finditer(rf'^{name}{{run="([^"]+)"}} (\S+)$', text, re.M):
        out[m.group(1)] = float(m.group(2))
    return out


def test_metrics_carry_each_live_run_s_running_and_desired_workers(client, r, api_cfg):
    lease = external_run(r, api_cfg, "stack", workers=2)  # (compose: launch.workers = services)
    try:
        worker(r, api_cfg, "stack", "w0")
        worker(r, api_cfg, "stack", "w1", status="standby")  # (surplus: not generating)
        text = client.get("/metrics").text
        assert series(text, "reval_api_run_workers") == {"stack": 1.0}
        assert series(text, "reval_api_run_workers_desired") == {"stack": 2.0}
        RunControl(r, api_cfg.key_prefix, "stack").set_workers(1)  # reval runs scale stack 1
        text = client.get("/metrics").text
        assert series(text, "reval_api_run_workers_desired") == {"stack": 1.0}
        RunControl(r, api_cfg.key_prefix, "stack").publish_status({"phase": "done"})
        assert series(client.get("/metrics").text, "reval_api_run_workers") == {}  # (over)
    finally:
        lease.release()


def test_long_strings_are_cut_in_422s(client):
    """FastAPI's 422 echoed a 10,000-character input (and a 10,000-character unknown key)."""
    long_input = client.post("/v1/runs/r/scale", json={"workers": "q" * 10_000}, headers=AUTH)
    long_key = client.patch("/v1/runs/r/hparams", json={"x" * 10_000: 1}, headers=AUTH)
    for got in (long_input, long_key):
        assert got.status_code == 422
        assert len(got.text) < 600, got.text[:700]
        assert f"({10_000 - NAME_SHOWN} more characters)" in got.text
    short = client.post("/v1/runs/r/scale", json={"workers": "many"}, headers=AUTH).json()
    assert short["detail"][0]["input"] == "many"  # (a short one whole)
