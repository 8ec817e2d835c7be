"""A live run steered over REST: ``reval serve`` as a process, a run created through it (the API
starts ``reval launch`` on a local Ray: a learner and two rollout workers, real Redis) on a user's
own task (a local JSONL dataset and a reward file under ``reval serve --models-dir``), launched
with a scrubbed environment (no API token, no other secret: read from the launched process), then a
live hyperparameter change that the learner applies within one step (read back from its metrics
log), scaling from 2 to 3 workers and back, an API restart in the middle (nothing lost), pause
and resume, and a graceful stop."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from reval.config import parse_overrides
from reval.metrics import read_jsonl
from tests.e2e.test_service import ROOT, common
from tests.integration.test_custom_task import write_task

TOKEN = "live-test-token-0123456789abcdef"
SECRET = "a-secret-the-runs-must-not-inherit"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def serve(tmp_path: Path, redis_url: str, prefix: str, port: int) -> subprocess.Popen[bytes]:
    env = {**os.environ, "REVAL_API_TOKEN": TOKEN, "OMP_NUM_THREADS": "1",
           "RAY_USAGE_STATS_ENABLED": "0", "SOME_OTHER_SECRET": SECRET}  # fmt: skip
    log = (tmp_path / f"serve-{time.monotonic_ns()}.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "serve", "--port", str(port), "--redis-url",
         redis_url, "--key-prefix", prefix, "--output-dir", str(tmp_path),
         "--models-dir", str(tmp_path / "models")],
        cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env,
    )  # fmt: skip
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        assert proc.poll() is None, "reval serve exited"
        assert time.monotonic() < deadline, "reval serve never became ready"
        time.sleep(0.2)


def wait_for(fn, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while True:
        got = fn()
        if got:
            return got
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.3)


def test_live_run_over_rest(tmp_path, redis_url, redis_prefix):
    data, reward = write_task(tmp_path / "models")  # the user's own task, under --models-dir
    sets = common(tmp_path, redis_url, redis_prefix, "name=live", "buffer.capacity=4096",
                  "learner.max_steps=100000", "learner.world_size=1",
                  "launch.stop_timeout_s=30", f"task.dataset={data}",
                  f"task.reward={reward}:reward", "task.prompt_field=question")  # fmt: skip
    config = parse_overrides(sets)
    port = free_port()
    api = serve(tmp_path, redis_url, redis_prefix, port)
    base = f"http://127.0.0.1:{port}/v1/runs"
    run_dir = tmp_path / "live"
    pid = None

    def get() -> dict:
        r = httpx.get(f"{base}/live", timeout=10)
        assert r.status_code == 200, r.text
        return r.json()

    try:
        r = httpx.post(base, json={"config": config, "workers": 2}, headers=AUTH, timeout=30)
        assert r.status_code == 201, r.text
        pid = r.json()["pid"]
        while not Path(f"/proc/{pid}/cmdline").read_bytes():  # (exec under way)
            time.sleep(0.01)
        launched = Path(f"/proc/{pid}/environ").read_bytes().decode()
        assert TOKEN not in launched and SECRET not in launched  # scrubbed (run_env)
        assert "REVAL__REDIS__URL=" in launched
        wait_for(lambda: (get().get("step") or 0) >= 5, 240, "5 updates")

        # A live change of beta: the learner applies it at its next step, logged with the step.
        before = get()["step"]
        r = httpx.patch(f"{base}/live/hparams", json={"beta": 0.05}, headers=AUTH, timeout=10)
        assert r.status_code == 202, r.text
        # The learner may make several updates while the two requests go out; the status it
        # publishes after each update lags its step by at most the update in progress. So the
        # change, read by the learner before every update, lands at most two steps past what
        # the status says once the PATCH has returned.
        after = get()["step"]
        applied = wait_for(
            lambda: [
                e for e in httpx.get(f"{base}/live/events").json() if e["kind"] == "hparams_applied"
            ],
            60,
            "the change to be applied",
        )[0]
        assert applied["detail"] == {"beta": 0.05}
        assert before <= applied["step"] <= after + 2, (before, after, applied["step"])
        wait_for(lambda: len(read_jsonl(run_dir / "learner.jsonl")) > applied["step"] + 1, 60,
                 "an update after the change")  # fmt: skip
        rows = read_jsonl(run_dir / "learner.jsonl")
        initial = rows[0]["beta"]
        assert initial != 0.05
        assert all(r["beta"] == initial for r in rows if r["update"] <= applied["step"])
        assert all(r["beta"] == 0.05 for r in rows if r["update"] > applied["step"])
        assert get()["hparams"]["beta"] == 0.05

        # Scale 2 -> 3 -> 2.
        assert (
            httpx.post(f"{base}/live/scale", json={"workers": 3}, headers=AUTH).status_code == 202
        )
        wait_for(lambda: len(get()["workers"]) == 3, 90, "a third worker")
        assert (
            httpx.post(f"{base}/live/scale", json={"workers": 2}, headers=AUTH).status_code == 202
        )
        wait_for(lambda: len(get()["workers"]) == 2, 90, "back to two workers")

        # The API restarts while the run goes on: nothing lost.
        api.send_signal(signal.SIGKILL)
        api.wait(10)
        api = serve(tmp_path, redis_url, redis_prefix, port)
        run = get()
        assert run["phase"] == "running" and run["desired_workers"] == 2
        s0 = run["step"]
        wait_for(lambda: get()["step"] > s0, 60, "the run to go on")

        # Pause: the learner stops updating; resume: it goes on.
        assert httpx.post(f"{base}/live/pause", headers=AUTH).status_code == 202
        wait_for(lambda: get()["phase"] == "paused", 60, "paused")
        held = get()["step"]
        time.sleep(2)
        assert get()["step"] == held
        assert httpx.post(f"{base}/live/pause", headers=AUTH).status_code == 409
        assert httpx.post(f"{base}/live/resume", headers=AUTH).status_code == 202
        wait_for(lambda: get()["step"] > held, 60, "updates after resuming")

        # A checkpoint on request, then a graceful stop.
        assert httpx.post(f"{base}/live/checkpoint", headers=AUTH).status_code == 202
        wait_for(
            lambda: any(
                e["kind"] == "request:checkpoint" for e in httpx.get(f"{base}/live/events").json()
            ),
            10,
            "the checkpoint request",
        )
        assert httpx.post(f"{base}/live/stop", headers=AUTH).status_code == 202
        final = wait_for(lambda: (g := get())["phase"] in ("stopped", "done", "failed") and g,
                         180, "the run to stop")  # fmt: skip
        assert final["phase"] == "stopped", json.dumps(final)
        assert final["workers"] == []  # drained and deregistered
        latest = (run_dir / "checkpoints" / "latest").read_text().strip()
        assert latest == f"step-{final['step']:08d}"
        kinds = [e["kind"] for e in httpx.get(f"{base}/live/events").json()]
        for k in ("created", "learner_started", "request:hparams", "hparams_applied",
                  "request:paused", "paused", "resumed", "request:stopping"):  # fmt: skip
            assert k in kinds, (k, kinds)
    finally:
        if pid:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGINT)
        api.send_signal(signal.SIGTERM)
        api.wait(20)
