"""The REST API (``services/api/``) against real Redis, through FastAPI's test client: every
endpoint, bad bodies (422 naming the field), missing or wrong tokens (401/403), unknown runs (404),
conflicting actions (409), oversize bodies (413), and a restart of the API losing nothing. The
run's phases are driven here by writing its status as a learner would; the live run is in
``tests/e2e/test_api_live.py``."""

from __future__ import annotations

import time

import pytest
import redis
from fastapi.testclient import TestClient

from reval.config import ApiConfig
from reval.control import LiveHParams, RunControl
from services.api import create_app

TOKEN = "t0ken-for-the-tests-only-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
def api_cfg(tmp_path, redis_url, redis_prefix):
    return ApiConfig(redis_url=redis_url, key_prefix=redis_prefix, output_dir=str(tmp_path))


@pytest.fixture
def client(api_cfg, monkeypatch):
    monkeypatch.setenv(api_cfg.token_env, TOKEN)
    return TestClient(create_app(api_cfg))


def small(name: str = "r1") -> dict:
    return {"name": name, "learner": {"max_steps": 5}, "launch": {"workers": 2}}


def create(client, name="r1", **extra):
    r = client.post("/v1/runs", json={"config": small(name), "start": False, **extra}, headers=AUTH)
    assert r.status_code == 201, r.text
    return r.json()


def as_learner(api_cfg, name: str, phase: str, step: int = 3) -> None:
    control = RunControl(redis.Redis.from_url(api_cfg.redis_url), api_cfg.key_prefix, name)
    status = {"phase": phase, "step": step, "policy_version": step}
    control.publish_status({**status, "hparams": {"beta": 0.1}, "checkpoints": ["step-00000002"]})


def test_health_ready_metrics_and_openapi(client):
    assert client.get("/healthz").json() == {"ok": True, "detail": ""}
    assert client.get("/readyz").status_code == 200
    spec = client.get("/openapi.json").json()
    paths = set(spec["paths"])
    assert {"/v1/runs", "/v1/runs/{name}", "/v1/runs/{name}/hparams",
            "/v1/runs/{name}/scale", "/v1/runs/{name}/events"} <= paths  # fmt: skip
    # The PATCH body is LiveHParams itself: its bounds, docstrings and who applies each field.
    body = spec["components"]["schemas"]["LiveHParams"]
    assert body["additionalProperties"] is False
    assert body["properties"]["temperature"]["applied_by"] == "rollout"
    assert body["properties"]["beta"]["applied_by"] == "learner"
    assert {"exclusiveMinimum": 0, "maximum": 1e6, "type": "number"} in (
        body["properties"]["beta"]["anyOf"]
    )
    assert "KL strength" in body["properties"]["beta"]["description"]
    text = client.get("/metrics").text
    assert 'reval_api_requests_total{method="GET",route="/readyz",status="200"} 1.0' in text


def test_readyz_reports_a_missing_redis(tmp_path, monkeypatch):
    monkeypatch.setenv("REVAL_API_TOKEN", TOKEN)
    cfg = ApiConfig(redis_url="redis://127.0.0.1:1/0", output_dir=str(tmp_path))
    r = TestClient(create_app(cfg)).get("/readyz")
    assert r.status_code == 503 and r.json()["ok"] is False


def test_create_get_list(client, api_cfg):
    run = create(client)
    assert run["name"] == "r1" and run["phase"] == "registered"
    assert run["desired_workers"] == 2 and run["buffer"] is None
    assert client.get("/v1/runs/r1").json()["name"] == "r1"
    assert [r["name"] for r in client.get("/v1/runs").json()] == ["r1"]
    as_learner(api_cfg, "r1", "running", step=7)
    got = client.get("/v1/runs/r1").json()
    assert got["phase"] == "running" and got["step"] == 7
    assert got["hparams"] == {"beta": 0.1} and got["checkpoints"] == ["step-00000002"]
    # The run's config was completed with the API's replay service.
    events = client.get("/v1/runs/r1/events").json()
    assert [e["kind"] for e in events][:2] == ["request:scale", "created"]


@pytest.mark.parametrize(
    ("config", "needle"),
    [
        ({"learner": {"lr": -1}}, "learner.lr"),
        ({"learner": {"nonsense": 1}}, "learner.nonsense"),
        ({"buffer": {"key_prefix": "someone-else:"}}, "key_prefix"),
        ({"buffer": {"capacity": 8}}, "learner.batch_size"),
        # A section that is not an object (found by the OpenAPI fuzz: it was a 500).
        ({"buffer": [[]]}, "config.buffer must be an object"),
        ({"buffer": None}, "config.buffer must be an object"),
        ({"learner": [[]]}, "learner"),
        ({"launch": "x"}, "launch"),
    ],
)
def test_bad_configs_are_422_naming_the_field(client, config, needle):
    r = client.post("/v1/runs", json={"config": config, "start": False}, headers=AUTH)
    assert r.status_code == 422, r.text
    assert needle in r.text
    assert client.get("/v1/runs").json() == []  # nothing registered


def test_a_launch_section_that_is_not_an_object_is_422_with_workers(client):
    r = client.post("/v1/runs", json={"config": {"launch": []}, "workers": 2, "start": False},
                    headers=AUTH)  # fmt: skip
    assert r.status_code == 422, r.text
    assert "config.launch must be an object" in r.text
    assert client.get("/v1/runs").json() == []


def test_bad_bodies_are_422(client):
    create(client)
    for path, body in [
        ("/v1/runs", {"config": {}, "surprise": 1}),
        ("/v1/runs", {"config": [], "start": False}),
        ("/v1/runs/r1/scale", {"workers": -1}),
        ("/v1/runs/r1/scale", {"workers": "many"}),
    ]:
        r = client.post(path, json=body, headers=AUTH)
        assert r.status_code == 422, (path, body, r.text)
    for body in ({"beta": -1}, {"gamma": 1}, {}, {"beta": None}, {"ref_reset_steps": 1.5},
                 {"lr": "fast"}, {"beta": "0.1"}, {"beta": True}, {"temperature": 0},
                 {"max_staleness": -2}, [1]):  # fmt: skip
        r = client.patch("/v1/runs/r1/hparams", json=body, headers=AUTH)
        assert r.status_code == 422, (body, r.text)
        if isinstance(body, dict) and body and None not in body.values():
            # (the field named in the error's location)
            assert [e["loc"] for e in r.json()["detail"]] == [["body", *body]], r.text
    # Python's JSON parser reads NaN and Infinity: refused, and the answer is still JSON.
    r = client.patch("/v1/runs/r1/hparams", content='{"beta": NaN, "lr": -Infinity}',
                     headers={**AUTH, "Content-Type": "application/json"})  # fmt: skip
    assert r.status_code == 422, r.text
    assert [(e["loc"], e["input"]) for e in r.json()["detail"]] == [
        (["body", "beta"], "nan"), (["body", "lr"], "-inf")
    ]  # fmt: skip
    r = client.get("/v1/runs/r1/events", params={"after": "yesterday"})
    assert r.status_code == 422


def test_tokens(client, api_cfg, monkeypatch):
    r = client.post("/v1/runs", json={"config": small(), "start": False})
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    assert api_cfg.token_env in r.json()["detail"]  # where the token goes (REVAL_API_TOKEN)
    bad = {"Authorization": "Bearer wrong-token-wrong-token-0000"}
    assert client.post("/v1/runs", json={"config": small()}, headers=bad).status_code == 403
    assert (
        client.post("/v1/runs/x/pause", headers={"Authorization": "Basic abc"}).status_code == 401
    )
    assert client.get("/v1/runs").status_code == 200  # reads are open by default
    strict = TestClient(create_app(api_cfg.model_copy(update={"auth_reads": True})))
    assert strict.get("/v1/runs").status_code == 401
    assert strict.get("/v1/runs", headers=AUTH).status_code == 200
    monkeypatch.setenv(api_cfg.token_env, "")
    no_token = TestClient(create_app(api_cfg))  # dev mode without a token: writes refused
    assert no_token.post("/v1/runs/x/pause", headers=AUTH).status_code == 403


def test_unknown_run_is_404(client):
    assert client.get("/v1/runs/ghost").status_code == 404
    assert client.post("/v1/runs/ghost/pause", headers=AUTH).status_code == 404
    assert client.patch("/v1/runs/ghost/hparams", json={"beta": 1}, headers=AUTH).status_code == 404
    assert client.get("/v1/runs/ghost/events").status_code == 404


def test_actions_and_conflicts(client, api_cfg):
    create(client)
    control = RunControl(redis.Redis.from_url(api_cfg.redis_url), api_cfg.key_prefix, "r1")
    # Not started: nothing to pause or stop.
    assert client.post("/v1/runs/r1/pause", headers=AUTH).status_code == 409
    as_learner(api_cfg, "r1", "running")
    assert client.post("/v1/runs/r1/resume", headers=AUTH).status_code == 409  # not paused
    assert client.post("/v1/runs/r1/pause", headers=AUTH).status_code == 202
    assert control.read().phase == "paused"
    as_learner(api_cfg, "r1", "paused")
    assert client.post("/v1/runs/r1/pause", headers=AUTH).status_code == 409  # already
    assert client.post("/v1/runs/r1/resume", headers=AUTH).status_code == 202
    assert control.read().phase == "running"
    as_learner(api_cfg, "r1", "running")
    r = client.post("/v1/runs/r1/checkpoint", headers=AUTH)
    assert r.status_code == 202 and r.json()["detail"] == {"request": 1}
    assert client.post("/v1/runs/r1/export", headers=AUTH).json()["detail"] == {"request": 1}
    assert client.post("/v1/runs/r1/scale", json={"workers": 3}, headers=AUTH).status_code == 202
    r = client.patch("/v1/runs/r1/hparams", json={"beta": 0.05, "temperature": 0.8}, headers=AUTH)
    assert r.status_code == 202 and r.json()["detail"] == {"beta": 0.05, "temperature": 0.8}
    st = control.read()
    assert st.workers == 3 and st.checkpoint == 1 and st.export == 1
    assert st.hparams == LiveHParams(beta=0.05, temperature=0.8)
    hp_events = [e for e in client.get("/v1/runs/r1/events").json()
                 if e["kind"] == "request:hparams"]  # fmt: skip
    assert [e["detail"] for e in hp_events] == [{"beta": 0.05, "temperature": 0.8}]
    assert client.post("/v1/runs/r1/stop", headers=AUTH).status_code == 202
    assert control.read().phase == "stopping"
    as_learner(api_cfg, "r1", "stopped")
    for action in ("pause", "resume", "stop", "checkpoint", "export"):
        assert client.post(f"/v1/runs/r1/{action}", headers=AUTH).status_code == 409, action
    assert client.patch("/v1/runs/r1/hparams", json={"beta": 1}, headers=AUTH).status_code == 409
    kinds = [e["kind"] for e in client.get("/v1/runs/r1/events").json()]
    for k in ("request:paused", "request:running", "request:checkpoint", "request:export",
              "request:scale", "request:hparams", "request:stopping"):  # fmt: skip
        assert k in kinds
    # A stopped run can be created again (a new run under its name).
    assert client.post("/v1/runs", json={"config": small(), "start": False},
                       headers=AUTH).status_code == 201  # fmt: skip


def test_a_live_run_cannot_be_created_twice(client, api_cfg):
    create(client)
    as_learner(api_cfg, "r1", "running")
    r = client.post("/v1/runs", json={"config": small(), "start": False}, headers=AUTH)
    assert r.status_code == 409


def test_body_limit(api_cfg, monkeypatch):
    monkeypatch.setenv(api_cfg.token_env, TOKEN)
    c = TestClient(create_app(api_cfg.model_copy(update={"max_body_bytes": 2048})))
    big = {"config": {"name": "x" * 5000}, "start": False}
    assert c.post("/v1/runs", json=big, headers=AUTH).status_code == 413


def test_restarted_api_sees_everything(client, api_cfg, monkeypatch):
    create(client, "a")
    create(client, "b")
    as_learner(api_cfg, "a", "running", step=11)
    client.post("/v1/runs/a/scale", json={"workers": 5}, headers=AUTH)
    again = TestClient(create_app(api_cfg))  # a new API process: all state is in Redis
    runs = {r["name"]: r for r in again.get("/v1/runs").json()}
    assert set(runs) == {"a", "b"}
    assert runs["a"]["step"] == 11 and runs["a"]["desired_workers"] == 5
    assert any(e["kind"] == "request:scale" for e in again.get("/v1/runs/a/events").json())


def test_chunked_body_over_the_limit_is_refused_while_streaming(api_cfg, monkeypatch):
    monkeypatch.setenv(api_cfg.token_env, TOKEN)
    c = TestClient(create_app(api_cfg.model_copy(update={"max_body_bytes": 2048})))

    def chunks():
        for _ in range(100):
            yield b"x" * 1024

    r = c.post("/v1/runs", content=chunks(), headers={**AUTH, "content-type": "application/json"})
    assert r.status_code == 413


def test_run_names_are_checked(client):
    for bad in ("../escape", "/abs", "a{b}", "", "x" * 80):
        r = client.post("/v1/runs", json={"config": {"name": bad}, "start": False}, headers=AUTH)
        assert r.status_code == 422, bad


def test_start_again_resumes_and_recreate_is_refused(api_cfg, monkeypatch, tmp_path):
    monkeypatch.setenv(api_cfg.token_env, TOKEN)
    started: list[str] = []
    c = TestClient(create_app(api_cfg, launcher=lambda name, path: started.append(name) or 0))
    create(c, "again")
    as_learner(api_cfg, "again", "stopped", step=9)
    ckpt = tmp_path / "again" / "checkpoints"
    ckpt.mkdir(parents=True)
    (ckpt / "latest").write_text("step-00000009")
    r = c.post("/v1/runs", json={"config": small("again"), "start": False}, headers=AUTH)
    assert r.status_code == 409 and "`reval runs start again`" in r.json()["detail"]
    assert c.post("/v1/runs/again/start", headers=AUTH).status_code == 202  # (what it says)
    assert started == ["again"]
    got = c.get("/v1/runs/again").json()
    assert got["phase"] == "starting" and got["step"] is None  # the old final status is gone
    assert c.post("/v1/runs/again/start", headers=AUTH).status_code == 409  # not twice


# -- issue 19: API-created runs stay in their directories -----------------------------------------


@pytest.mark.parametrize(
    ("config", "loc"),
    [
        ({"output_dir": "../../../tmp/x"}, ["output_dir"]),
        ({"output_dir": "/tmp"}, ["output_dir"]),
        ({"sync": {"weights_dir": "/tmp/w"}}, ["sync", "weights_dir"]),
        ({"metrics": {"tensorboard_dir": "/root/.ssh"}}, ["metrics", "tensorboard_dir"]),
        (
            {"metrics": {"mlflow": {"tracking_uri": "file:///etc/cron.d"}}},
            ["metrics", "mlflow", "tracking_uri"],
        ),
        (
            {"metrics": {"mlflow": {"tracking_uri": "sqlite:////var/lib/x.db"}}},
            ["metrics", "mlflow", "tracking_uri"],
        ),
        (
            {"metrics": {"mlflow": {"tracking_uri": "sqlite+pysqlite:////etc/x.db"}}},
            ["metrics", "mlflow", "tracking_uri"],
        ),
        (
            {"metrics": {"mlflow": {"tracking_uri": "../../elsewhere"}}},
            ["metrics", "mlflow", "tracking_uri"],
        ),
        ({"model": {"name_or_path": "/etc"}}, ["model", "name_or_path"]),
        ({"model": {"name_or_path": "./somewhere/else"}}, ["model", "name_or_path"]),
        ({"task": {"kind": "math", "dataset": "/data/x.jsonl"}}, ["task", "dataset"]),
    ],
)
def test_a_posted_config_cannot_reach_outside_the_apis_directories(client, api_cfg, config, loc):
    r = client.post(
        "/v1/runs", json={"config": {**small(), **config}, "start": False}, headers=AUTH
    )
    assert r.status_code == 422, r.text
    assert r.json()["detail"][0]["loc"] == ["body", "config", *loc]
    assert client.get("/v1/runs/r1").status_code == 404  # nothing registered


def test_paths_inside_the_apis_directories_are_fine(api_cfg, monkeypatch, tmp_path):
    models = tmp_path / "models"
    (models / "m").mkdir(parents=True)
    monkeypatch.setenv(api_cfg.token_env, TOKEN)
    c = TestClient(create_app(api_cfg.model_copy(update={"models_dir": str(models)})))
    config = {
        **small(),
        "output_dir": str(tmp_path / "sub"),
        "sync": {"weights_dir": str(tmp_path / "sub" / "w")},
        "model": {"name_or_path": str(models / "m")},
        "metrics": {
            "tensorboard_dir": str(tmp_path / "sub" / "tb"),
            "mlflow": {"tracking_uri": (tmp_path / "sub" / "mlruns").as_uri()},
        },
    }
    r = c.post("/v1/runs", json={"config": config, "start": False}, headers=AUTH)
    assert r.status_code == 201, r.text
    hub = {
        **small("r2"),
        "model": {"name_or_path": "Qwen/Qwen2.5-Math-7B"},
        "metrics": {"mlflow": {"tracking_uri": "https://mlflow.example.com"}},
    }
    r = c.post("/v1/runs", json={"config": hub, "start": False}, headers=AUTH)
    assert r.status_code == 201, r.text
    outside = {**small("r3"), "model": {"name_or_path": str(tmp_path / "models-evil")}}
    r = c.post("/v1/runs", json={"config": outside, "start": False}, headers=AUTH)
    assert r.status_code == 422 and "models_dir" in r.text


def test_a_learner_started_by_hand_that_died_shows_failed(client, api_cfg):
    """Run status from the learner's heartbeat, its lease (issue 19): a learner started outside
    the API registers itself; once its lease is gone without a final status it is ``failed``,
    and mutating calls on it are 409 (they were 202, for a learner that had crashed)."""
    from reval.control import RunLease, adopt_run

    r = redis.Redis.from_url(api_cfg.redis_url)
    adopt_run(r, api_cfg.key_prefix, "hand", {"name": "hand"})
    lease = RunLease(r, api_cfg.key_prefix, "hand", ttl_s=0.5)
    lease.acquire()
    as_learner(api_cfg, "hand", "running")
    assert client.get("/v1/runs/hand").json()["phase"] == "running"
    r2 = client.patch("/v1/runs/hand/hparams", json={"lr": 1e-5}, headers=AUTH)
    assert r2.status_code == 202
    lease._stop.set()  # the learner dies: its lease is no longer renewed (nor released)
    lease._thread.join()
    time.sleep(0.7)
    assert client.get("/v1/runs/hand").json()["phase"] == "failed"
    for call in (
        lambda: client.patch("/v1/runs/hand/hparams", json={"lr": 1e-5}, headers=AUTH),
        lambda: client.post("/v1/runs/hand/pause", headers=AUTH),
        lambda: client.post("/v1/runs/hand/checkpoint", headers=AUTH),
    ):
        assert call().status_code == 409
    as_learner(api_cfg, "hand", "stopped")  # (a learner that stopped cleanly said so)
    assert client.get("/v1/runs/hand").json()["phase"] == "stopped"


@pytest.mark.parametrize(
    ("token", "why"),
    [
        ("aaaaaaaaaaaaaaaa", "too little entropy (0 bits"),
        ("abababababababab", "too little entropy (16 bits"),
        ("changeme", "empty or a default"),
        ("short-Tok3n", "shorter than 16"),
    ],
)
def test_serve_refuses_a_weak_token(api_cfg, monkeypatch, capsys, token, why):
    from services.api import serve

    monkeypatch.setenv(api_cfg.token_env, token)
    assert serve(api_cfg) == 2  # (before: aaaaaaaaaaaaaaaa was accepted)
    assert why in capsys.readouterr().err


def test_real_tokens_pass_the_entropy_check():
    import random
    import secrets

    from services.api import token_problem

    rng = random.Random(19)
    for _ in range(5000):  # 16 random hex digits
        assert token_problem("".join(rng.choice("0123456789abcdef") for _ in range(16))) is None
    assert token_problem(secrets.token_urlsafe(32)) is None
    assert token_problem(TOKEN) is None


def test_the_redis_password_is_never_written(tmp_path, redis_url, redis_prefix, monkeypatch):
    """Secrets redacted (issue 19): the Redis URL's password was written to the runs hash and
    to the run's config files. (Redis's default user has no password here: it takes any.)"""
    from reval.config import build_config, dump_config, public_dump

    host = redis_url.split("://", 1)[1]
    url = f"redis://default:s3cret-pw@{host}"
    cfg = ApiConfig(redis_url=url, key_prefix=redis_prefix, output_dir=str(tmp_path))
    monkeypatch.setenv(cfg.token_env, TOKEN)
    launched = []
    app = create_app(cfg, launcher=lambda name, path: launched.append(path.read_text()) or 0)
    c = TestClient(app)
    assert (
        c.post("/v1/runs", json={"config": small(), "start": True}, headers=AUTH).status_code == 201
    )
    r = redis.Redis.from_url(redis_url)
    stored = b"".join(r.hvals(f"{redis_prefix}api:runs"))
    assert b"s3cret-pw" not in stored and b"default:***@" in stored
    assert launched and "s3cret-pw" not in launched[0]
    run = build_config({"buffer": {"backend": "redis", "redis_url": url}})
    dump_config(run, tmp_path / "config.json")
    assert "s3cret-pw" not in (tmp_path / "config.json").read_text()
    assert public_dump(run)["redis"]["url"] == f"redis://default:***@{host}"


# -- issue 25: the 409's advice leads to a command that works --------------------------------------


def test_checkpoints_the_api_did_not_make_resume_with_the_command_it_names(
    api_cfg, monkeypatch, tmp_path
):
    """After `make demo`, creating "demo" was a 409 saying POST /start continues it, and start was
    a 404: the API never knew the run. Now the 409 names `reval runs create ... --resume`, and
    that create (body "resume": true) registers the run over its checkpoints and launches
    `reval launch --resume` (the API's own launcher, with Popen recorded instead of run)."""
    import services.api.runs

    launched: list[list[str]] = []

    class Popen:  # what the API's own launcher runs, recorded instead of run
        def __init__(self, cmd, **_kwargs):
            launched.append(list(cmd))
            self.pid = 4_000_000 + len(launched)

        def poll(self):
            return None

    monkeypatch.setenv(api_cfg.token_env, TOKEN)
    monkeypatch.setattr(services.api.runs.subprocess, "Popen", Popen)
    c = TestClient(create_app(api_cfg))
    ckpt = tmp_path / "demo" / "checkpoints"  # as `reval train` leaves them
    ckpt.mkdir(parents=True)
    (ckpt / "latest").write_text("step-00002400")
    r = c.post("/v1/runs", json={"config": small("demo")}, headers=AUTH)
    assert r.status_code == 409, r.text
    hint = r.json()["detail"]
    assert "`reval runs create` with --resume" in hint and "--set name=demo-2" in hint
    assert "reval runs start" not in hint  # (the API does not know it: that was the 404)
    assert c.post("/v1/runs/demo/start", headers=AUTH).status_code == 404
    assert launched == []

    r = c.post("/v1/runs", json={"config": small("demo"), "resume": True}, headers=AUTH)
    assert r.status_code == 201, r.text
    assert r.json()["phase"] == "starting"
    [cmd] = launched
    assert cmd[-4:] == ["launch", "--config", str(tmp_path / "demo" / "config.request.json"),
                        "--resume"]  # fmt: skip
    assert c.get("/v1/runs/demo").json()["name"] == "demo"
    created = [e for e in c.get("/v1/runs/demo/events").json() if e["kind"] == "created"]
    assert created[-1]["detail"]["resume"] is True
    # The other way out: a new name is a new run.
    r = c.post("/v1/runs", json={"config": small("demo-2"), "start": False}, headers=AUTH)
    assert r.status_code == 201, r.text


def test_resume_needs_checkpoints(client):
    r = client.post("/v1/runs", json={"config": small("fresh"), "resume": True}, headers=AUTH)
    assert r.status_code == 409 and "no checkpoint" in r.json()["detail"]
    assert client.get("/v1/runs/fresh").status_code == 404
