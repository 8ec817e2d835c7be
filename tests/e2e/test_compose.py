"""docker-compose.yml, validated and run without Docker: the compose file passes
``docker-compose config`` (Debian's package) and the compose-spec JSON schema
(``check-jsonschema``), and the commands of its api, learner and rollout services run here as
local processes with the services' own environment, pointed at loopback (the test's Redis and
key prefix, free ports, a temporary /runs, the CPU demo config). The run is then steered through
the API like a deployment would be: health and readiness of every process, the run visible in
the API, a live change, a stop that drains the worker."""

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

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "compose-test-token-0123456789"
SECRETS = {"REVAL_API_TOKEN": TOKEN, "GRAFANA_ADMIN_PASSWORD": "compose-test"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def compose_config(**env: str) -> dict:
    tool = shutil.which("docker-compose")
    if tool is None:
        pytest.fail("docker-compose is not installed (`make test` runs scripts/ensure_tools.sh)")
    done = subprocess.run([tool, "-f", str(ROOT / "docker-compose.yml"), "config"],
                          capture_output=True, text=True, env={**os.environ, **env})  # fmt: skip
    assert done.returncode == 0, done.stderr
    return dict(yaml.safe_load(done.stdout))


def test_compose_file_is_valid():
    cfg = compose_config(**SECRETS)
    services = cfg["services"]
    assert set(services) == {"redis", "api", "learner", "rollout", "prometheus", "grafana",
                             "ray-head", "eval"}  # fmt: skip
    assert services["ray-head"]["profiles"] == ["ray"]  # opt-in
    assert services["eval"]["profiles"] == ["eval"]
    # LEARNER_GPUS sets both the GPUs reserved and the learner's ranks.
    learner = compose_config(**SECRETS, LEARNER_GPUS="4")["services"]["learner"]
    assert learner["environment"]["REVAL__LEARNER__WORLD_SIZE"] == "4"
    assert int(learner["deploy"]["resources"]["reservations"]["devices"][0]["count"]) == 4
    for name in ("redis", "api", "learner", "rollout", "prometheus"):
        assert "healthcheck" in services[name], name
    assert services["api"]["depends_on"]["redis"]["condition"] == "service_healthy"
    assert services["learner"]["deploy"]["resources"]["reservations"]["devices"][0][
        "capabilities"
    ] == ["gpu"]
    # Required settings are ${VAR:?}: without them the file does not resolve.
    tool = shutil.which("docker-compose")
    assert tool is not None
    env = {k: v for k, v in os.environ.items() if k not in SECRETS}
    done = subprocess.run([tool, "-f", str(ROOT / "docker-compose.yml"), "config"],
                          capture_output=True, text=True, env=env)  # fmt: skip
    assert done.returncode != 0 and "REVAL_API_TOKEN" in done.stderr
    schema = subprocess.run(
        [sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.compose-spec",
         str(ROOT / "docker-compose.yml")],
        capture_output=True, text=True,
    )  # fmt: skip
    assert schema.returncode == 0, schema.stdout + schema.stderr


def local(service: dict, tmp: Path, redis_url: str, prefix: str, ports: dict[int, int]):
    """The service's command and environment, pointed at this machine."""

    def fix(text: str) -> str:
        text = text.replace("redis://redis:6379/0", redis_url)
        text = text.replace("/app/configs", str(ROOT / "configs"))
        text = text.replace("/runs", str(tmp / "runs"))
        for port, here in ports.items():  # "9401" and "metrics.prometheus_port=9400"
            text = re.sub(rf"(?<![0-9]){port}(?![0-9])", str(here), text)
        return text

    cmd = [fix(str(a)) for a in service["command"]]
    env = {k: fix(str(v)) for k, v in (service.get("environment") or {}).items()}
    if "REVAL__BUFFER__KEY_PREFIX" in env:
        env["REVAL__BUFFER__KEY_PREFIX"] = prefix  # the test's own keys on the shared Redis
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


def test_compose_services_run_as_local_processes(tmp_path, redis_url, redis_prefix):
    cfg = compose_config(**SECRETS, REVAL_CONFIG="demo.toml", REVAL_RUN="composed")
    services = cfg["services"]
    ports = {8080: free_port(), 9400: free_port(), 9401: free_port()}
    procs: dict[str, subprocess.Popen[bytes]] = {}
    extra = {"learner": ["--set", "learner.max_steps=100000", "--set", "model.pretrain_steps=100",
                         "--set", "learner.checkpoint_every=5"],
             "rollout": ["--set", "model.pretrain_steps=100"]}  # fmt: skip
    try:
        for name in ("api", "learner", "rollout"):
            cmd, env = local(services[name], tmp_path, redis_url, redis_prefix, ports)
            log = (tmp_path / f"{name}.log").open("wb")
            procs[name] = subprocess.Popen([*cmd, *extra.get(name, [])], cwd=ROOT, env=env,
                                           stdout=log, stderr=subprocess.STDOUT,
                                           start_new_session=True)  # fmt: skip
        listed = list(procs.items())
        api = f"http://127.0.0.1:{ports[8080]}"
        wait_for(lambda: get(f"{api}/readyz") == 200, 60, "the API", listed)
        for port in (ports[9400], ports[9401]):
            wait_for(lambda p=port: get(f"http://127.0.0.1:{p}/readyz") == 200, 240,
                     f"readiness on {port}", listed)  # fmt: skip
            assert get(f"http://127.0.0.1:{port}/healthz") == 200
            assert "reval_" in httpx.get(f"http://127.0.0.1:{port}/metrics").text
        # The learner registered its run for the API; it trains.
        run = wait_for(lambda: (r := httpx.get(f"{api}/v1/runs/composed")).status_code == 200
                       and (r.json().get("step") or 0) >= 3 and r.json(), 240, "3 updates",
                       listed)  # fmt: skip
        assert run["phase"] == "running" and len(run["workers"]) == 1
        auth = {"Authorization": f"Bearer {TOKEN}"}
        r = httpx.patch(f"{api}/v1/runs/composed/hparams", json={"lr": 1e-4}, headers=auth)
        assert r.status_code == 202
        wait_for(lambda: any(row.get("lr") == 1e-4 for row in
                             read_jsonl(tmp_path / "runs" / "composed" / "learner.jsonl")),
                 60, "the new learning rate", listed)  # fmt: skip
        assert httpx.post(f"{api}/v1/runs/composed/stop", headers=auth).status_code == 202
        for name in ("learner", "rollout"):
            procs[name].wait(180)
            assert procs[name].returncode == 0, (tmp_path / f"{name}.log").read_text()[-3000:]
        final = httpx.get(f"{api}/v1/runs/composed").json()
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
