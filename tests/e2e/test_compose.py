"""docker-compose.yml, validated and run without Docker: the compose file, and the one
``reval compose`` writes for an 8-GPU node, pass ``docker-compose config`` (Debian's package) and
the compose-spec JSON schema (``check-jsonschema``), and the commands of its api, learner and
rollout services run here as local processes with the services' own environment, pointed at
loopback (the test's Redis and key prefix, free ports, a temporary /runs, the CPU demo config).
The run is then steered through the API like a deployment would be: health and readiness of
every process, the run visible in the API, the learner killed mid-run and started again with the
same command (as Docker's restart policy does) resuming within one checkpoint interval while the
API shows it starting, a live change, a stop that drains the worker."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from reval.metrics import read_jsonl
from reval.redis import lease_key

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "compose-test-token-0123456789"
REDIS_PASSWORD = "compose0redis0password"
SECRETS = {"REVAL_API_TOKEN": TOKEN, "GRAFANA_ADMIN_PASSWORD": "compose-test",
           "REDIS_PASSWORD": REDIS_PASSWORD}  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def compose_config(path: Path = ROOT / "docker-compose.yml", **env: str) -> dict:
    tool = shutil.which("docker-compose")
    if tool is None:
        pytest.fail("docker-compose is not installed (`make test` runs scripts/ensure_tools.sh)")
    done = subprocess.run([tool, "-f", str(path), "--project-directory", str(ROOT), "config"],
                          capture_output=True, text=True, env={**os.environ, **env})  # fmt: skip
    assert done.returncode == 0, done.stderr
    return dict(yaml.safe_load(done.stdout))


def schema_check(path: Path) -> None:
    schema = subprocess.run(
        [sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.compose-spec",
         str(path)],
        capture_output=True, text=True,
    )  # fmt: skip
    assert schema.returncode == 0, schema.stdout + schema.stderr


def gpu_ids(service: dict) -> list[str]:
    devices = service["deploy"]["resources"]["reservations"]["devices"]
    assert all("count" not in d for d in devices), devices  # count: N takes the first N GPUs
    return [str(i) for d in devices for i in d["device_ids"]]


def test_generated_compose_for_8_gpus_is_valid_and_shares_no_gpu(tmp_path):
    out = tmp_path / "docker-compose.gpu8.yml"
    cmd = [sys.executable, "-m", "services.cli", "compose", "--gpus", "8", "--learner-gpus", "4",
           "--out", str(out)]  # fmt: skip
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    schema_check(out)
    services = compose_config(out, **SECRETS)["services"]
    rollouts = sorted(n for n in services if n.startswith("rollout-"))
    assert rollouts == [f"rollout-{i}" for i in range(4)] and "eval" not in services
    gpu_services = [n for n, s in services.items() if "deploy" in s and n != "ray-head"]
    assert sorted(gpu_services) == sorted(["learner", *rollouts])
    ids = [i for n in gpu_services for i in gpu_ids(services[n])]
    assert sorted(ids, key=int) == [str(i) for i in range(8)]  # every GPU once: none shared
    assert gpu_ids(services["learner"]) == ["0", "1", "2", "3"]
    assert services["learner"]["environment"]["REVAL__LEARNER__WORLD_SIZE"] == "4"
    for name in gpu_services:  # NCCL and vLLM need more than Docker's 64 MB of /dev/shm
        assert services[name].get("shm_size") or services[name].get("ipc") == "host", name
    for name in rollouts:  # Prometheus scrapes the DNS name `rollout` (one A record each)
        assert "rollout" in services[name]["networks"]["default"]["aliases"]
        assert gpu_ids(services[name]) == [str(4 + int(name.split("-")[1]))]


def test_compose_file_is_valid():
    cfg = compose_config(**SECRETS)
    services = cfg["services"]
    assert set(services) == {"redis", "api", "learner", "rollout-0", "prometheus", "grafana",
                             "ray-head", "eval"}  # fmt: skip
    assert services["ray-head"]["profiles"] == ["ray"]  # opt-in
    assert services["eval"]["profiles"] == ["eval"]
    # One GPU each, none shared; the learner runs a rank per GPU it reserves.
    assert [gpu_ids(services[n]) for n in ("learner", "rollout-0", "eval")] == [["0"], ["1"], ["2"]]
    assert services["learner"]["environment"]["REVAL__LEARNER__WORLD_SIZE"] == "1"
    for name in ("redis", "api", "learner", "rollout-0", "prometheus"):
        assert "healthcheck" in services[name], name
    assert services["api"]["depends_on"]["redis"]["condition"] == "service_healthy"
    assert services["learner"]["deploy"]["resources"]["reservations"]["devices"][0][
        "capabilities"
    ] == ["gpu"]
    # Required settings are ${VAR:?}: without them the file does not resolve.
    tool = shutil.which("docker-compose")
    assert tool is not None
    env = {k: v for k, v in os.environ.items() if k != "REVAL_API_TOKEN"} | {
        k: v for k, v in SECRETS.items() if k != "REVAL_API_TOKEN"
    }
    done = subprocess.run([tool, "-f", str(ROOT / "docker-compose.yml"), "config"],
                          capture_output=True, text=True, env=env)  # fmt: skip
    assert done.returncode != 0 and "REVAL_API_TOKEN" in done.stderr
    schema_check(ROOT / "docker-compose.yml")


def test_cpu_compose_file_is_valid_with_two_secrets():
    """docker-compose.cpu.yml, the new user's one command: it resolves with the two secrets alone
    (no Grafana password: the CPU stack has no Grafana), reserves no GPU, and its images are the
    official ones unless the REVAL_*_IMAGE variables name scripts/make_images.sh's."""
    path = ROOT / "docker-compose.cpu.yml"
    schema_check(path)
    two = {k: SECRETS[k] for k in ("REVAL_API_TOKEN", "REDIS_PASSWORD")}
    env = {k: v for k, v in os.environ.items() if not k.startswith(("REVAL_", "GRAFANA_"))}
    tool = shutil.which("docker-compose")
    assert tool is not None
    done = subprocess.run([tool, "-f", str(path), "config"], capture_output=True, text=True,
                          env={**env, **two})  # fmt: skip
    assert done.returncode == 0, done.stderr
    services = yaml.safe_load(done.stdout)["services"]
    assert set(services) == {"redis", "api", "learner", "rollout-0", "rollout-1", "prometheus"}
    assert not [n for n, s in services.items() if "deploy" in s]
    assert services["redis"]["image"] == "redis:7.2"
    assert services["api"]["build"]["args"]["BASE_IMAGE"] == "python:3.11-slim"
    local_images = compose_config(path, **two, REVAL_REDIS_IMAGE="reval-local/redis:7",
                                  REVAL_API_PORT="18080")["services"]  # fmt: skip
    assert local_images["redis"]["image"] == "reval-local/redis:7"
    assert local_images["api"]["ports"] == ["127.0.0.1:18080:8080/tcp"]
    for name in ("rollout-0", "rollout-1"):  # Prometheus scrapes the DNS name `rollout`
        assert "rollout" in services[name]["networks"]["default"]["aliases"]


def local(service: dict, tmp: Path, redis_url: str, prefix: str, ports: dict[int, int]):
    """The service's command and environment, pointed at this machine."""

    def fix(text: str) -> str:
        text = text.replace(f"redis://:{REDIS_PASSWORD}@redis:6379/0", redis_url)
        text = text.replace("/app/configs", str(ROOT / "configs"))
        text = text.replace("/runs", str(tmp / "runs"))
        for port, here in ports.items():  # "9401" and "metrics.prometheus_port=9400"
            text = re.sub(rf"(?<![0-9]){port}(?![0-9])", str(here), text)
        return text

    cmd = [fix(str(a)) for a in service["command"]]
    env = {k: fix(str(v)) for k, v in (service.get("environment") or {}).items()}
    if "REVAL__REDIS__PREFIX" in env:
        env["REVAL__REDIS__PREFIX"] = prefix  # the test's own keys on the shared Redis
    if cmd[:2] == ["reval", "serve"]:
        cmd += ["--key-prefix", prefix]
    cmd = [sys.executable, "-m", "services.cli", *cmd[1:]]
    return cmd, {**os.environ, **env, "OMP_NUM_THREADS": "1"}


def get(url: str) -> int:
    try:
        return httpx.get(url, timeout=3).status_code
    except httpx.HTTPError:
        return 0


def wait_for(fn, timeout: float, what: str, procs=()):
    deadline = time.monotonic() + timeout
    while True:
        got = fn()
        if got:
            return got
        for name, p in procs:
            assert p.poll() is None, f"{name} exited ({p.returncode})"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.3)


def phases_while(cond, api: str, auth: dict, timeout: float, procs) -> list[str]:
    """The run's phases as the API shows them (every change) until ``cond()``."""
    seen: list[str] = []
    deadline = time.monotonic() + timeout
    while not cond():
        phase = httpx.get(f"{api}/v1/runs/composed", headers=auth).json().get("phase")
        if not seen or seen[-1] != phase:
            seen.append(phase)
        for name, p in procs:
            assert p.poll() is None, f"{name} exited ({p.returncode})"
        assert time.monotonic() < deadline, f"timed out; phases {seen}"
        time.sleep(0.2)
    return seen


def test_compose_services_run_as_local_processes(tmp_path, redis_url, redis_prefix):
    cfg = compose_config(**SECRETS, REVAL_CONFIG="demo.toml", REVAL_RUN="composed")
    services = cfg["services"]
    ports = {8080: free_port(), 9400: free_port(), 9401: free_port()}
    procs: dict[str, subprocess.Popen[bytes]] = {}
    every = 5  # learner.checkpoint_every of this run
    extra = {"learner": ["--set", "learner.max_steps=100000", "--set", "model.pretrain_steps=100",
                         "--set", f"learner.checkpoint_every={every}", "--set",
                         "learner.lease_s=3"],
             "rollout-0": ["--set", "model.pretrain_steps=100"]}  # fmt: skip

    def start(name: str, log_name: str) -> subprocess.Popen[bytes]:
        cmd, env = local(services[name], tmp_path, redis_url, redis_prefix, ports)
        log = (tmp_path / f"{log_name}.log").open("wb")
        return subprocess.Popen([*cmd, *extra.get(name, [])], cwd=ROOT, env=env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip

    try:
        for name in ("api", "learner", "rollout-0"):
            procs[name] = start(name, name)
        listed = list(procs.items())
        api = f"http://127.0.0.1:{ports[8080]}"
        wait_for(lambda: get(f"{api}/readyz") == 200, 60, "the API", listed)
        for port in (ports[9400], ports[9401]):
            wait_for(lambda p=port: get(f"http://127.0.0.1:{p}/readyz") == 200, 240,
                     f"readiness on {port}", listed)  # fmt: skip
            assert get(f"http://127.0.0.1:{port}/healthz") == 200
            assert "reval_" in httpx.get(f"http://127.0.0.1:{port}/metrics").text
        # The API binds 0.0.0.0 in the compose file: its reads need the token there.
        auth = {"Authorization": f"Bearer {TOKEN}"}
        assert httpx.get(f"{api}/v1/runs/composed").status_code == 401
        # The learner registered its run for the API; it trains.
        run = wait_for(lambda: (r := httpx.get(f"{api}/v1/runs/composed", headers=auth))
                       .status_code == 200 and (r.json().get("step") or 0) >= 3 and r.json(),
                       240, "3 updates", listed)  # fmt: skip
        assert run["phase"] == "running" and len(run["workers"]) == 1
        # The learner killed mid-run (a container's SIGKILL: the parent and its rank), then
        # started again with the same command, as the restart policy does: it resumes from
        # its latest checkpoint, within one checkpoint interval of where it was.
        jsonl = tmp_path / "runs" / "composed" / "learner.jsonl"
        wait_for(lambda: len(read_jsonl(jsonl)) > every + 2, 120, "a checkpoint", listed)
        os.killpg(procs["learner"].pid, signal.SIGKILL)
        procs["learner"].wait(30)
        killed_at = read_jsonl(jsonl)[-1]["policy_version"]
        lease = lease_key(redis_prefix, "composed")
        others = [(n, p) for n, p in listed if n != "learner"]
        phases_while(lambda: get_key(redis_url, lease) is None, api, auth, 30, others)
        assert httpx.get(f"{api}/v1/runs/composed", headers=auth).json()["phase"] == "failed"
        procs["learner"] = start("learner", "learner-restarted")
        listed = list(procs.items())
        restarted = tmp_path / "learner-restarted.log"
        seen = phases_while(lambda: "resumed at step" in restarted.read_text(), api, auth, 180,
                            listed)  # fmt: skip
        resumed_at = int(
            re.findall(r"resumed at step (\d+) from checkpoint", restarted.read_text())[0]
        )
        # (its last update's checkpoint may be on disk before its line in learner.jsonl)
        assert resumed_at % every == 0 and killed_at - every < resumed_at <= killed_at + 1

        def step() -> int:
            return httpx.get(f"{api}/v1/runs/composed", headers=auth).json().get("step") or 0

        seen += phases_while(lambda: step() > resumed_at, api, auth, 120, listed)
        # The API said the learner was starting, never that the run had failed, once started.
        assert "starting" in seen and "failed" not in seen[seen.index("starting") :], seen
        r = httpx.patch(f"{api}/v1/runs/composed/hparams", json={"lr": 1e-4}, headers=auth)
        assert r.status_code == 202
        wait_for(lambda: any(row.get("lr") == 1e-4 for row in
                             read_jsonl(tmp_path / "runs" / "composed" / "learner.jsonl")),
                 60, "the new learning rate", listed)  # fmt: skip
        assert httpx.post(f"{api}/v1/runs/composed/stop", headers=auth).status_code == 202
        for name in ("learner", "rollout-0"):
            procs[name].wait(180)
            log_name = "learner-restarted" if name == "learner" else name
            assert procs[name].returncode == 0, (tmp_path / f"{log_name}.log").read_text()[-3000:]
        final = httpx.get(f"{api}/v1/runs/composed", headers=auth).json()
        assert final["phase"] == "stopped" and final["workers"] == []
    finally:
        for p in procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in procs.values():
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)


def get_key(url: str, key: str) -> bytes | None:
    import redis

    client = redis.Redis.from_url(url)
    try:
        return client.get(key)
    finally:
        client.close()


def test_redis_requires_the_password_everyone_uses():
    """deploy/redis.conf runs in protected mode (issue 19): Redis takes the password from
    REDIS_PASSWORD, the file does not resolve without it, and every URL carries it."""
    conf = (ROOT / "deploy" / "redis.conf").read_text()
    assert "\nprotected-mode yes\n" in conf and "requirepass" not in conf.replace(
        "--requirepass", ""
    )  # (no password in the repository)
    services = compose_config(**SECRETS)["services"]
    command = services["redis"]["command"]
    assert command[command.index("--requirepass") + 1] == REDIS_PASSWORD
    assert services["redis"]["environment"]["REDISCLI_AUTH"] == REDIS_PASSWORD
    url = f"redis://:{REDIS_PASSWORD}@redis:6379/0"
    for name, svc in services.items():
        env = svc.get("environment") or {}
        if "REVAL__REDIS__URL" in env:
            assert env["REVAL__REDIS__URL"] == url, name
    assert url in services["api"]["command"]
    tool = shutil.which("docker-compose")
    assert tool is not None
    env = {k: v for k, v in os.environ.items() if k != "REDIS_PASSWORD"} | {
        k: v for k, v in SECRETS.items() if k != "REDIS_PASSWORD"
    }
    done = subprocess.run([tool, "-f", str(ROOT / "docker-compose.yml"), "config"],
                          capture_output=True, text=True, env=env)  # fmt: skip
    assert done.returncode != 0 and "REDIS_PASSWORD" in done.stderr
