"""The REST boundary (issue 37), against real Redis: installed code a client names is refused
unless the API lists it, without importing it and without repeating what an import said; what
is listed is checked in a throw-away process with no secret in its environment; ``http_reward``'s
URL and ``token_env`` are refused at create time as the grading processes would refuse them; a
run the API launches gets a scrubbed environment (read from the real process); and reads,
``/metrics`` and the OpenAPI document need the token when the API binds a non-loopback address
(a real uvicorn on 0.0.0.0, reached over 127.0.0.1)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import uvicorn
from fastapi.testclient import TestClient

from reval.config import ApiConfig
from services.api import create_app

TOKEN = "t0ken-for-the-tests-only-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
def api_cfg(tmp_path, redis_url, redis_prefix):
    models = tmp_path / "models"
    models.mkdir()
    return ApiConfig(redis_url=redis_url, key_prefix=redis_prefix, output_dir=str(tmp_path),
                     models_dir=str(models))  # fmt: skip


@pytest.fixture
def client(api_cfg, monkeypatch):
    monkeypatch.setenv(api_cfg.token_env, TOKEN)
    return TestClient(create_app(api_cfg))


def create(client, name: str, task: dict, start: bool = False):
    body = {"config": {"name": name, "task": {"dataset": "org/data", **task}}, "start": start}
    return client.post("/v1/runs", json=body, headers=AUTH)


def test_installed_modules_off_the_list_are_refused_unimported_and_unprobed(client):
    sys.modules.pop("antigravity", None)
    for spec in ("timeit:timeit", "antigravity:webbrowser.open", "antigravity:geohash",
                 "os:system", "subprocess:run"):  # fmt: skip
        r = create(client, "hostile", {"reward": spec})
        assert r.status_code == 422, (spec, r.text)
        (problem,) = r.json()["detail"]
        assert problem["loc"][-1] == "reward"
        text = r.text.lower()
        for leaked in ("webbrowser", "no module", "modulenotfound", "attributeerror",
                       "importerror", "traceback"):  # fmt: skip
            assert leaked not in text, (spec, r.text)
    assert "antigravity" not in sys.modules  # refused by the list: never imported here
    assert client.get("/v1/runs/hostile").status_code == 404
    # The built-in graders by name: not the module's helpers, nothing it imports.
    for name in ("os", "subprocess", "_HARNESS", "os.system", "json", "run_tests"):
        spec = f"rollout.grading.graders:{name}"
        r = create(client, "hostile", {"reward": spec})
        assert r.status_code == 422, (spec, r.text)
    r = create(client, "builtin", {"reward": "rollout.grading.graders:exact_match"})
    assert r.status_code == 201, r.text


def test_a_loss_by_import_path_is_refused_unimported(client):
    """``algo.name`` may name a loss class by import path for ``reval train``; over REST only the
    built-in losses are taken (a loss is learner code), and nothing is imported."""
    sys.modules.pop("antigravity", None)
    algo = {"name": "antigravity:Loss", "policy": "off"}
    body = {"config": {"name": "lossy", "task": {"dataset": "org/data"}, "algo": algo},
            "start": False}  # fmt: skip
    r = client.post("/v1/runs", json=body, headers=AUTH)
    assert r.status_code == 422, r.text
    (problem,) = r.json()["detail"]
    assert problem["loc"][-2:] == ["algo", "name"] and "not taken over REST" in problem["msg"]
    assert "antigravity" not in sys.modules
    body["config"]["algo"] = {"name": "tbrm"}
    assert client.post("/v1/runs", json=body, headers=AUTH).status_code == 201


def test_listed_plugins_are_checked_in_a_throwaway_process_with_no_secret(
    api_cfg, monkeypatch, tmp_path
):
    # A module the operator lists but that does not import: a generic 422.
    cfg = api_cfg.model_copy(update={"plugins": ["reval_no_such_module_37:f", "timeit:*"]})
    monkeypatch.setenv(cfg.token_env, TOKEN)
    monkeypatch.setenv("SOME_OTHER_SECRET", "hunter2-hunter2")
    client = TestClient(create_app(cfg))
    r = create(client, "missing", {"reward": "reval_no_such_module_37:f"})
    assert r.status_code == 422 and "cannot be imported here" in r.text, r.text
    assert "No module named" not in r.text
    # "timeit:*": timeit's own functions only, and checked against the call it will get.
    r = create(client, "foreign", {"reward": "timeit:time"})  # (timeit imports time)
    assert r.status_code == 422 and "not defined by" in r.text, r.text
    # A reward file under models_dir is imported in a child whose environment holds no secret.
    seen = tmp_path / "child-env.json"
    reward = Path(cfg.models_dir) / "spy.py"
    reward.write_text(
        "import json, os\n"
        f"json.dump(dict(os.environ), open({str(seen)!r}, 'w'))\n"
        "def reward(prompt, completion, metadata):\n    return 1.0\n"
    )
    r = create(client, "spy", {"reward": f"{reward}:reward"})
    assert r.status_code == 201, r.text
    env = json.loads(seen.read_text())
    assert set(env) <= {"PATH", "PYTHONPATH", "LANG", "PYTHONDONTWRITEBYTECODE", "LC_CTYPE"}, env
    assert TOKEN not in json.dumps(env) and "hunter2" not in json.dumps(env)
    assert not [
        m for m in sys.modules if m.startswith("reval_user_spy")
    ]  # the API process never imported it


def test_http_reward_urls_and_token_envs_are_refused_at_create(client, monkeypatch):
    monkeypatch.delenv("REVAL_HTTP_REWARD_HOSTS", raising=False)
    monkeypatch.delenv("REVAL_HTTP_REWARD_TOKEN_ENVS", raising=False)

    def post(**args):
        task = {"reward": "rollout.grading.graders:http_reward", "reward_args": args}
        return create(client, "http", task)

    cases = [
        ({"url": "file:///etc/passwd"}, "url"),
        ({"url": "http://169.254.169.254/latest/meta-data/"}, "url"),
        ({"url": "http://127.0.0.1:9/score"}, "url"),
        ({"url": "http://10.0.0.5/score"}, "url"),
        ({"url": "https://93.184.215.14/score", "token_env": "REVAL_API_TOKEN"}, "token_env"),
        ({"url": "https://93.184.215.14/score", "token_env": "HF_TOKEN"}, "token_env"),
    ]
    for args, field in cases:
        r = post(**args)
        assert r.status_code == 422, (args, r.text)
        assert r.json()["detail"][0]["loc"][-2:] == ["reward_args", field], (args, r.text)
        assert "root:" not in r.text  # (no file content)
    # The old spelling of the module (rollout.graders, before issue 40) is checked the same way.
    old = {"reward": "rollout.graders:http_reward", "reward_args": {"url": "http://127.0.0.1:9/"}}
    r = create(client, "http-old", old)
    assert r.status_code == 422, r.text
    assert r.json()["detail"][0]["loc"][-2:] == ["reward_args", "url"], r.text
    r = post(url="https://93.184.215.14/score", token_env="REVAL_REWARD_KEY")
    assert r.status_code == 201, r.text
    # The operator lists an internal address: accepted.
    monkeypatch.setenv("REVAL_HTTP_REWARD_HOSTS", "10.0.0.0/8")
    r = create(client, "http2", {"reward": "rollout.grading.graders:http_reward",
                                 "reward_args": {"url": "http://10.0.0.5/score"}})  # fmt: skip
    assert r.status_code == 201, r.text


def test_a_launched_run_gets_a_scrubbed_environment(api_cfg, monkeypatch):
    """The real ``reval launch`` command the API starts: its environment read from /proc."""
    cfg = api_cfg.model_copy(update={"pass_env": ["MY_CACHE_DIR"]})
    monkeypatch.setenv(cfg.token_env, TOKEN)
    monkeypatch.setenv("SOME_OTHER_SECRET", "hunter2-hunter2")
    monkeypatch.setenv("HF_TOKEN", "hf_secret_secret")
    monkeypatch.setenv("REVAL_REWARD_KEY", "reward-key")
    monkeypatch.setenv("MY_CACHE_DIR", "/cache")
    monkeypatch.setenv("HF_HOME", "/hf")
    client = TestClient(create_app(cfg))
    r = client.post("/v1/runs", json={"config": {"name": "env"}, "start": True}, headers=AUTH)
    assert r.status_code == 201, r.text
    pid = r.json()["pid"]
    try:
        # (Popen returns when exec has begun: the new program's arguments and environment
        # show in /proc a moment later)
        deadline = time.monotonic() + 10
        while not Path(f"/proc/{pid}/cmdline").read_bytes() and time.monotonic() < deadline:
            time.sleep(0.01)
        raw = Path(f"/proc/{pid}/environ").read_bytes()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
    log = Path(cfg.output_dir) / "env" / "launch.log"
    assert b"launch" in cmdline, f"the launch exited at once: {log.read_text()[-2000:]}"
    env = dict(item.split("=", 1) for item in raw.decode().split("\0") if "=" in item)
    assert cfg.token_env not in env and "SOME_OTHER_SECRET" not in env and "HF_TOKEN" not in env
    assert TOKEN not in raw.decode()
    assert env["REVAL__REDIS__URL"] == cfg.redis_url and env["PATH"] == os.environ["PATH"]
    assert env["REVAL_REWARD_KEY"] == "reward-key" and env["MY_CACHE_DIR"] == "/cache"
    assert env["HF_HOME"] == "/hf"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def _uvicorn(cfg: ApiConfig):
    server = uvicorn.Server(uvicorn.Config(create_app(cfg), host=cfg.host, port=cfg.port,
                                           log_level="warning"))  # fmt: skip
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{cfg.port}"
    finally:
        server.should_exit = True
        thread.join(10)


def test_reads_metrics_and_docs_need_the_token_on_a_public_address(api_cfg, monkeypatch):
    monkeypatch.setenv(api_cfg.token_env, TOKEN)
    cfg = api_cfg.model_copy(update={"host": "0.0.0.0", "port": _free_port()})
    assert cfg.auth_reads is None and cfg.open_metrics is None  # the defaults: automatic
    with _uvicorn(cfg) as base:
        for path in ("/v1/runs", "/v1/runs/x", "/v1/runs/x/events", "/metrics",
                     "/openapi.json", "/docs"):  # fmt: skip
            r = httpx.get(base + path, timeout=10)
            assert r.status_code == 401, (path, r.status_code, r.text)
            assert httpx.get(base + path, headers=AUTH, timeout=10).status_code in (200, 404)
        assert httpx.get(base + "/healthz", timeout=10).status_code == 200
        assert httpx.get(base + "/readyz", timeout=10).status_code == 200
        assert "/v1/runs" in httpx.get(base + "/openapi.json", headers=AUTH).json()["paths"]
    # The operator opens /metrics (a Prometheus in another container) and, explicitly, reads.
    opened = cfg.model_copy(update={"open_metrics": True, "auth_reads": False,
                                    "port": _free_port()})  # fmt: skip
    with _uvicorn(opened) as base:
        assert httpx.get(base + "/metrics", timeout=10).status_code == 200
        assert httpx.get(base + "/v1/runs", timeout=10).status_code == 200
    # On loopback both stay open by default; auth_reads=True guards them there too.
    local = api_cfg.model_copy(update={"port": _free_port()})
    with _uvicorn(local) as base:
        assert httpx.get(base + "/v1/runs", timeout=10).status_code == 200
        assert httpx.get(base + "/metrics", timeout=10).status_code == 200
    strict = TestClient(create_app(api_cfg.model_copy(update={"auth_reads": True})))
    assert strict.get("/v1/runs").status_code == 401


def test_reval_serve_reads_its_settings_from_flags_and_variables(monkeypatch, tmp_path):
    env = {"REVAL_API__MODELS_DIR": str(tmp_path), "REVAL_API__PLUGINS": "a.b:c, d:*",
           "REVAL_API__OPEN_METRICS": "true"}  # fmt: skip
    cfg = ApiConfig.load({"host": "0.0.0.0", "plugins": None}, env)
    assert cfg.models_dir == str(tmp_path) and cfg.plugins == ["a.b:c", "d:*"]
    assert cfg.reads_need_token() and not cfg.metrics_need_token()
    flags = ApiConfig.load({"models_dir": "/elsewhere", "auth_reads": False}, env)
    assert flags.models_dir == "/elsewhere" and not flags.reads_need_token()
