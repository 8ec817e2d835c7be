"""The CPU stack under Docker (marked `docker`; `make test-docker` starts an engine, builds the
images with scripts/make_images.sh and runs this): docker-compose.cpu.yml comes up, every health
check passes, the demo trains through the stack, and everything is checked from outside the
containers (the API's published port, `reval runs`, Prometheus's /api/v1/query): the learner's
step advances, Prometheus scrapes the learner and both workers, the run pauses, resumes, takes
a new learning rate and a new worker count (the younger worker on standby, then back), survives
a killed worker container, keeps every buffered trajectory across a restart of Redis and one
of the API, and the learner killed in its container is started again by the restart policy and
resumes within one checkpoint interval, while one stopped with `docker stop` checkpoints, exits
143 and stays down until started. Then `down -v`. Every container's log is written under the
test's tmp dir, and printed when a test fails.

The tests share one stack (a module fixture) and run in file order."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

pytestmark = pytest.mark.docker

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "docker-compose.cpu.yml"
TOKEN = "docker-stack-test-token-0123456789"
RUN = "stack"
# scripts/make_images.sh's registry-free images.
IMAGES = {
    "REVAL_REDIS_IMAGE": "reval-local/redis:7",
    "REVAL_PROMETHEUS_IMAGE": "reval-local/prometheus:2",
    "REVAL_BASE_IMAGE": "reval-local/python:3.11",
}
# The demo, made small for 2 shared cores: a shorter format pretraining, rounds of 128
# trajectories, updates of 64 (the learner and the workers read the same settings).
SMALL = {
    "OMP_NUM_THREADS": "1",
    "REVAL__MODEL__PRETRAIN_STEPS": "60",
    "REVAL__ROLLOUT__PROMPTS_PER_ROUND": "16",
    "REVAL__ROLLOUT__N": "8",
    "REVAL__LEARNER__BATCH_SIZE": "64",
    "REVAL__LEARNER__MICRO_BATCH_SIZE": "64",
    "REVAL__LEARNER__CHECKPOINT_EVERY": "10",
}
WORKERS = ("rollout-0", "rollout-1")
HEALTHY_S = 420.0  # the learner's pretraining and the first weights on 2 shared cores


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(fn: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = fn()
        if got:
            return got
        assert time.monotonic() < deadline, f"timed out after {timeout:.0f} s waiting for {what}"
        time.sleep(1.0)


class Stack:
    """One compose project of docker-compose.cpu.yml, its published ports and its logs."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.project = f"revaltest{uuid.uuid4().hex[:8]}"
        self.ports = {name: free_port() for name in ("API", "REDIS", "PROMETHEUS", "GRAFANA")}
        self.env = {
            **os.environ,
            **IMAGES,
            "REVAL_API_TOKEN": TOKEN,
            "REDIS_PASSWORD": uuid.uuid4().hex,
            "REVAL_RUN": RUN,
            **{f"REVAL_{name}_PORT": str(port) for name, port in self.ports.items()},
        }
        override = {"services": {n: {"environment": SMALL} for n in ("learner", *WORKERS)}}
        self.override = tmp / "docker-compose.small.yml"
        self.override.write_text(yaml.safe_dump(override))
        self.api = f"http://127.0.0.1:{self.ports['API']}"
        self.prometheus = f"http://127.0.0.1:{self.ports['PROMETHEUS']}"

    def compose(self, *args: str, timeout: float = 300, check: bool = True) -> str:
        cmd = ["docker-compose", "-p", self.project, "--project-directory", str(ROOT),
               "-f", str(COMPOSE_FILE), "-f", str(self.override), *args]  # fmt: skip
        done = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=timeout)
        assert not check or done.returncode == 0, f"{' '.join(args)}: {done.stderr[-2000:]}"
        return done.stdout

    def container(self, service: str) -> str:
        return self.compose("ps", "-q", service).strip()

    def health(self) -> dict[str, str]:
        """Every running service's health (``running`` where it has no health check)."""
        ids = self.compose("ps", "-q").split()
        if not ids:
            return {}
        fmt = (
            '{{index .Config.Labels "com.docker.compose.service"}} '
            "{{if .State.Health}}{{.State.Health.Status}}{{else}}{{.State.Status}}{{end}}"
        )
        out = subprocess.run(["docker", "inspect", "-f", fmt, *ids], capture_output=True,
                             text=True, check=True).stdout  # fmt: skip
        return dict(line.split(" ", 1) for line in out.strip().splitlines())

    def wait_healthy(self, services: tuple[str, ...], timeout: float) -> None:
        def ready() -> bool:
            health = self.health()
            bad = [s for s in services if health.get(s) == "unhealthy"]
            assert not bad, f"unhealthy: {bad}"
            return all(health.get(s) == "healthy" for s in services)

        wait_for(ready, timeout, f"healthy {', '.join(services)} (now {self.health()})")

    def run_info(self) -> dict[str, Any]:
        try:
            # (the API binds 0.0.0.0 in its container: reads need the token there)
            r = httpx.get(f"{self.api}/v1/runs/{RUN}", timeout=5,
                          headers={"Authorization": f"Bearer {TOKEN}"})  # fmt: skip
        except httpx.HTTPError:
            return {}
        return dict(r.json()) if r.status_code == 200 else {}

    def step(self) -> int:
        return int(self.run_info().get("step") or 0)

    def runs(self, *args: str) -> dict[str, Any]:
        """``reval runs ARGS`` against the stack's API, as a user would type it."""
        cmd = [sys.executable, "-m", "services.cli", "runs", "--url", self.api, *args]
        done = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "REVAL_API_TOKEN": TOKEN},
                              capture_output=True, text=True, timeout=60)  # fmt: skip
        assert done.returncode == 0, f"reval runs {' '.join(args)}: {done.stderr[-1500:]}"
        return dict(json.loads(done.stdout))

    def query(self, promql: str) -> list[dict[str, Any]]:
        r = httpx.get(f"{self.prometheus}/api/v1/query", params={"query": promql}, timeout=5)
        assert r.status_code == 200, r.text
        return list(r.json()["data"]["result"])

    def advances(self, by: int, timeout: float) -> int:
        """Wait for the learner's step to go ``by`` past where it is; the new step."""
        start = self.step()
        return int(wait_for(lambda: (s := self.step()) >= start + by and s, timeout,
                            f"{by} updates past step {start}"))  # fmt: skip

    def save_logs(self) -> Path:
        logs = self.tmp / "logs"
        logs.mkdir(exist_ok=True)
        # The project's containers by their compose labels, through `docker` alone: each
        # docker-compose call costs seconds to start, a dozen of them a minute and more.
        fmt = '{{.ID}} {{.Label "com.docker.compose.service"}}'
        ps = ["docker", "ps", "-a", "--filter", f"label=com.docker.compose.project={self.project}",
              "--format", fmt]  # fmt: skip
        listed = subprocess.run(ps, capture_output=True, text=True, check=False).stdout
        for line in sorted(listed.splitlines(), key=lambda x: x.split()[-1]):
            cid, service = line.split()
            with (logs / f"{service}.log").open("a") as out:
                subprocess.run(["docker", "logs", "--timestamps", cid], stdout=out,
                               stderr=subprocess.STDOUT, check=False)  # fmt: skip
        return logs


def failed(request: pytest.FixtureRequest, before: int) -> bool:
    return request.session.testsfailed > before


@pytest.fixture(scope="module")
def stack(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[Stack]:  # fmt: skip
    for tool in ("docker", "docker-compose"):
        if shutil.which(tool) is None:
            pytest.fail(f"{tool} is not installed: run `make test-docker` (docs/operations.md)")
    if subprocess.run(["docker", "info"], capture_output=True).returncode != 0:
        pytest.fail("no Docker engine answers: run `make test-docker`, which starts one")
    for image in [*IMAGES.values(), "reval:cpu"]:
        if subprocess.run(["docker", "image", "inspect", image], capture_output=True).returncode:
            pytest.fail(f"image {image} is missing: run scripts/make_images.sh")
    s = Stack(tmp_path_factory.mktemp("stack"))
    before = request.session.testsfailed
    try:
        s.compose("up", "-d", "--no-build")
        yield s
    finally:
        logs = s.save_logs()
        if failed(request, before):
            for path in sorted(logs.iterdir()):
                print(f"===== {path.name} (last 60 lines; all in {path})")
                print("\n".join(path.read_text().splitlines()[-60:]))
        s.compose("down", "-v", "--remove-orphans", "--timeout", "5", check=False)


def test_every_health_check_passes_and_the_demo_trains(stack: Stack) -> None:
    stack.wait_healthy(("redis", "api", "learner", *WORKERS, "prometheus"), HEALTHY_S)
    info = wait_for(lambda: (i := stack.run_info()).get("step") and i, 120, "the first update")
    assert info["phase"] == "running"
    assert len(info["workers"]) == 2, info["workers"]
    stack.advances(5, 180)


def test_prometheus_scrapes_the_learner_and_both_workers(stack: Stack) -> None:
    def up(job: str) -> list[str]:
        rows = stack.query(f'up{{job="{job}"}} == 1')
        return sorted(r["metric"]["instance"] for r in rows)

    wait_for(lambda: len(up("reval-rollout")) == 2, 60, "both workers scraped")
    assert len(up("reval-learner")) == 1 and len(up("reval-api")) == 1
    # (a sample is up to one scrape interval old, and a counter starts at 0 in each learner
    # process: wait for a scrape that saw an update; CI once read 0 here right after `up`)
    deadline = time.monotonic() + 60
    while True:
        seen = stack.query("reval_learner_updates_total")
        if any(float(r["value"][1]) >= 1 for r in seen):
            break
        assert time.monotonic() < deadline, f"no scrape saw an update in 60 s: {seen}"
        time.sleep(1.0)
    rows = stack.query("sum(reval_rollout_trajectories_total)")
    assert rows and float(rows[0]["value"][1]) > 0


# Run in a worker's container: code_tests through the sandbox there (bwrap under the compose
# file's security_opt): a correct solution, a forged verdict, and a solution that adds only
# when it can read the container's secret (the Redis URL with its password) in some process's
# environment, which the probe first checks is there to be read outside the sandbox.
SANDBOX_PROBE = r"""
import json, os
from rollout.grading.graders import code_tests
assert "REVAL__REDIS__URL" in os.environ
tests = {"tests": ["assert add(2, 3) == 5", "assert add(-1, 1) == 0"]}
good = "def add(a, b):\n    return a + b\n"
forged = "print('REVAL_PASSED 300 1')\nimport os\nos._exit(0)\n"
leak = (
    "def add(a, b):\n"
    "    import glob\n"
    "    for p in glob.glob('/proc/*/environ'):\n"
    "        try:\n"
    "            if b'REVAL__REDIS__URL' in open(p, 'rb').read():\n"
    "                return a + b\n"
    "        except OSError:\n"
    "            pass\n"
)
print(json.dumps({k: code_tests(None, c, tests)["score"]
                  for k, c in (("good", good), ("forged", forged), ("leak", leak))}))
"""


def test_a_worker_container_grades_code_in_its_sandbox(stack: Stack) -> None:
    done = subprocess.run(
        ["docker", "exec", stack.container("rollout-0"), "python", "-c", SANDBOX_PROBE],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    scores = json.loads(done.stdout.strip().splitlines()[-1])
    assert scores == {"good": 1.0, "forged": 0.0, "leak": 0.0}, scores


def test_reval_runs_pauses_resumes_sets_and_scales(stack: Stack) -> None:
    assert stack.runs("pause", RUN)["action"] == "pause"
    wait_for(lambda: stack.run_info().get("phase") == "paused", 60, "the pause")
    held = stack.step()
    time.sleep(8)
    assert stack.step() == held  # no update while paused
    stack.runs("resume", RUN)
    wait_for(lambda: stack.run_info().get("phase") == "running", 60, "the resume")
    stack.advances(2, 120)
    stack.runs("set", RUN, "lr=0.0005")
    wait_for(lambda: stack.query('reval_learner_hparam{name="lr"} == 0.0005'), 90,
             "the learner's lr of 5e-4 in Prometheus")  # fmt: skip
    # Scale to one worker: the younger service goes on standby and generates nothing (the
    # learner goes on with the other); back to two, both run again.
    assert stack.runs("scale", RUN, "1")["action"] == "scale"
    assert stack.run_info()["desired_workers"] == 1

    def statuses() -> dict[str, str]:
        return {w["id"]: w.get("status") for w in stack.run_info().get("workers") or []}

    wait_for(lambda: sorted(statuses().values()) == ["running", "standby"], 90,
             f"one worker on standby (now {statuses()})")  # fmt: skip
    (idle,) = [w for w, s in statuses().items() if s == "standby"]

    def made(worker: str) -> int:
        got = [w for w in stack.run_info()["workers"] if w["id"] == worker]
        return int(got[0].get("trajectories") or 0) if got else -1

    time.sleep(5)  # its answers in flight land
    held = made(idle)
    stack.advances(2, 180)  # the other worker feeds the learner alone
    assert made(idle) == held
    stack.runs("scale", RUN, "2")
    wait_for(lambda: set(statuses().values()) == {"running"}, 90, "both workers running again")
    wait_for(lambda: made(idle) > held, 120, "the standby worker generating again")


def worker_ids(stack: Stack) -> set[str]:
    return {w["id"] for w in stack.run_info().get("workers") or []}


def test_a_killed_worker_container_is_survived(stack: Stack) -> None:
    before = worker_ids(stack)
    # `docker kill`: the container stays down (a manual stop); rollout-0 feeds the learner alone.
    subprocess.run(["docker", "kill", stack.container("rollout-1")], check=True,
                   capture_output=True)  # fmt: skip
    stack.advances(3, 180)
    stack.compose("start", "rollout-1")
    # A crash (the worker's process killed under it): restart: on-failure starts it again.
    inspect = ["docker", "inspect", "-f", "{{.State.Pid}}", stack.container("rollout-0")]
    pid = subprocess.run(inspect, capture_output=True, text=True, check=True).stdout
    os.kill(int(pid), signal.SIGKILL)
    # Both come back as new workers (a new id each) and pass their health checks again.
    wait_for(lambda: len(worker_ids(stack) - before) >= 2, 240, "both workers registered again")
    stack.wait_healthy(WORKERS, 120)
    stack.advances(3, 120)


def paused_buffer(stack: Stack) -> dict[str, Any]:
    """Pause the run and wait until its buffer stops changing; the buffer."""
    stack.runs("pause", RUN)
    wait_for(lambda: stack.run_info().get("phase") == "paused", 60, "the pause")

    def settled() -> dict[str, Any] | None:
        first = stack.run_info()["buffer"]
        time.sleep(3)  # (also past Redis's once-a-second AOF fsync)
        return first if stack.run_info()["buffer"] == first else None

    return dict(wait_for(settled, 90, "the buffer to settle"))


@pytest.mark.parametrize("service", ["redis", "api"])
def test_a_restart_loses_nothing_buffered_and_the_run_goes_on(stack: Stack, service: str) -> None:
    before = paused_buffer(stack)
    assert before["size"] > 0
    stack.compose("restart", "--timeout", "20", service)
    stack.wait_healthy((service,), 120)
    after = wait_for(stack.run_info, 60, "the run through the API")
    assert after["buffer"] == before, (before, after["buffer"])
    assert after["phase"] == "paused"
    stack.runs("resume", RUN)
    stack.advances(3, 240)


def container_log(stack: Stack, service: str, since: float | None = None) -> str:
    """The container's output (``since``: from that Unix time on)."""
    after = ["--since", f"{since:.3f}"] if since is not None else []
    done = subprocess.run(["docker", "logs", *after, stack.container(service)],
                          capture_output=True, text=True, check=False)  # fmt: skip
    return done.stdout + done.stderr


def inspect(stack: Stack, service: str, field: str) -> str:
    fmt = "{{.State." + field + "}}"
    return subprocess.run(["docker", "inspect", "-f", fmt, stack.container(service)],
                          capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip


def test_a_killed_learner_resumes_and_a_stopped_one_stays_down(stack: Stack) -> None:
    every = int(SMALL["REVAL__LEARNER__CHECKPOINT_EVERY"])
    stack.advances(every + 2, 300)  # past a checkpoint
    # A crash (the learner's process killed under it): restart: on-failure starts it again and
    # --resume-if-any resumes from the latest checkpoint, within one interval of where it was.
    since = time.time()
    at = stack.step()
    os.kill(int(inspect(stack, "learner", "Pid")), signal.SIGKILL)
    line = r"resumed at step (\d+) from checkpoint"
    wait_for(lambda: re.search(line, container_log(stack, "learner", since)), 300, line)
    # The learner steps some 20 times a second here: it may have gone a checkpoint or two past
    # `at` before the kill. Its own log says which checkpoint it wrote last before it died
    # (the line follows the save); one being saved at the kill is complete or not read.
    log = container_log(stack, "learner")
    found = list(re.finditer(line, log))[-1]
    resumed = int(found.group(1))
    saved = [int(n) for n in re.findall(r"checkpoint \S*step-(\d+)\n", log[: found.start()])]
    assert saved and resumed in (saved[-1], saved[-1] + every), (at, saved[-3:], resumed)
    assert at - every < resumed, (at, resumed)
    stack.wait_healthy(("learner",), 300)
    stack.advances(3, 240)
    # `docker stop` (SIGTERM): the update in hand, a checkpoint, one line, exit 143; a container
    # stopped by hand is not restarted.
    since = time.time()
    stack.compose("stop", "learner", timeout=200)
    assert inspect(stack, "learner", "ExitCode") == "143"
    log = container_log(stack, "learner", since)
    assert len(re.findall(r"stopped by SIGTERM at step \d+: checkpoint", log)) == 1, log[-3000:]
    assert "Traceback" not in log
    time.sleep(5)
    assert inspect(stack, "learner", "Status") == "exited"
    stack.compose("start", "learner")
    stack.wait_healthy(("learner",), 300)
    stack.advances(3, 240)
