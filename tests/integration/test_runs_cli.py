"""`reval runs ...` against a real `reval serve` process, and every subcommand's --help."""

from __future__ import annotations

import json
import os
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "cli-test-token-0123456789abc"


def reval(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "services.cli", *args]
    env = env or dict(os.environ)
    return subprocess.run(cmd, cwd=ROOT, text=True, capture_output=True, env=env, timeout=120)


def test_every_command_explains_itself():
    top = reval("--help")
    assert top.returncode == 0
    for cmd in ("train", "learner", "rollout", "launch", "serve", "runs"):
        assert cmd in top.stdout
        done = reval(cmd, "--help")
        assert done.returncode == 0 and len(done.stdout) > 200, cmd
    for sub in ("list", "get", "create", "pause", "resume", "stop", "scale", "set", "events"):
        assert reval("runs", sub, "--help").returncode == 0, sub


def test_serve_refuses_a_weak_token(redis_url):
    env = {**os.environ, "REVAL_API_TOKEN": "changeme"}
    done = reval("serve", "--redis-url", redis_url, env=env)
    assert done.returncode == 2 and "REVAL_API_TOKEN" in done.stderr


@pytest.mark.timeout(180)
def test_runs_client_against_a_live_api(tmp_path, redis_url, redis_prefix):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "REVAL_API_TOKEN": TOKEN, "REVAL_API_URL": f"http://127.0.0.1:{port}"}
    # The directory it may read a user's own task from, by its variable (reval serve
    # --models-dir is the flag).
    env["REVAL_API__MODELS_DIR"] = str(tmp_path / "models")
    server_log = tmp_path / "serve.log"
    api = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "serve", "--port", str(port), "--redis-url",
         redis_url, "--key-prefix", redis_prefix, "--output-dir", str(tmp_path)],
        cwd=ROOT, env=env, stdout=server_log.open("wb"), stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline and api.poll() is None
            time.sleep(0.2)
        made = reval("runs", "create", "--set", "name=cli", "--set", "buffer.backend=redis",
                     "--workers", "3", "--no-start", env=env)  # fmt: skip
        assert made.returncode == 0, made.stderr
        assert json.loads(made.stdout)["desired_workers"] == 3
        listed = json.loads(reval("runs", "list", env=env).stdout)
        assert [r["name"] for r in listed] == ["cli"]
        got = reval("runs", "get", "cli", env=env)
        assert json.loads(got.stdout)["phase"] == "registered"
        assert "HTTP Request" not in got.stdout + got.stderr  # no per-request log lines
        assert "HTTP Request" in reval("runs", "--verbose", "get", "cli", env=env).stderr
        assert "Uvicorn running" in server_log.read_text()  # the server logs, but no request
        assert "GET /v1/runs" not in server_log.read_text()
        # Errors come back with the API's code and message, exit status 1.
        paused = reval("runs", "pause", "cli", env=env)
        assert paused.returncode == 1 and "409" in paused.stderr
        bad = reval("runs", "set", "cli", "beta=-1", env=env)
        assert bad.returncode == 1 and "422" in bad.stderr and "beta" in bad.stderr
        assert reval("runs", "set", "cli", "beta", env=env).returncode == 2
        assert reval("runs", "get", "nobody", env=env).returncode == 1
        no_token = {k: v for k, v in env.items() if k != "REVAL_API_TOKEN"}
        denied = reval("runs", "scale", "cli", "2", env=no_token)
        assert denied.returncode == 1 and "401" in denied.stderr
        assert "REVAL_API_TOKEN" in denied.stderr  # where the token goes
        # Checkpoints the API did not make (`reval train`'s): the 409 ends with the exact
        # command that continues them, and that command works.
        (tmp_path / "old" / "checkpoints").mkdir(parents=True)
        (tmp_path / "old" / "checkpoints" / "latest").write_text("step-00000004")
        args = ["--set", "name=old", "--set", "buffer.backend=redis", "--workers", "1",
                "--no-start"]  # fmt: skip
        refused = reval("runs", "create", *args, env=env)
        assert refused.returncode == 1 and "409" in refused.stderr
        assert len(refused.stderr.splitlines()) == 1, refused.stderr
        hint = shlex.split(refused.stderr.split("to continue it: ", 1)[1])
        assert hint == ["reval", "runs", "create", *args, "--resume"]
        assert reval("runs", "start", "old", env=env).returncode == 1  # (unknown to the API)
        resumed = reval(*hint[1:], env=env)
        assert resumed.returncode == 0, resumed.stderr
        assert json.loads(reval("runs", "get", "old", env=env).stdout)["phase"] == "registered"
        # A user's own task under the served directory: created; installed code off the
        # API's list: refused.
        from tests.integration.test_custom_task import write_task

        data, reward = write_task(tmp_path / "models")
        own = ["--set", f"task.dataset={data}", "--set", "task.prompt_field=question",
               "--set", "buffer.backend=redis", "--no-start"]  # fmt: skip
        mine = reval("runs", "create", "--set", "name=mine", "--set",
                     f"task.reward={reward}:reward", *own, env=env)  # fmt: skip
        assert mine.returncode == 0, mine.stderr
        hostile = reval("runs", "create", "--set", "name=hostile", "--set",
                        "task.reward=timeit:timeit", *own, env=env)  # fmt: skip
        assert hostile.returncode == 1 and "422" in hostile.stderr, hostile.stderr
        assert "plugin list" in hostile.stderr
        events = json.loads(reval("runs", "events", "cli", env=env).stdout)
        assert "created" in [e["kind"] for e in events]
        gone = reval("runs", "--url", "http://127.0.0.1:1", "list", env=env)
        assert gone.returncode == 1 and "cannot reach the API" in gone.stderr
    finally:
        api.terminate()
        api.wait(20)
