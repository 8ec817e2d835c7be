"""A Ray cluster of several hosts under Docker (marked `docker`, issue 43; `make test-docker`):
a Ray head, a learner host and two rollout hosts, each a container of ``reval:cpu`` with its own
filesystem and network address and no shared volume, and Redis in a container of its own. The
commands are docs/operations.md's, "Many machines" (``ray start`` on each host with the custom
resources ``learner_host`` and ``rollout_host``, then ``reval launch`` on the head with
``RAY_ADDRESS``): the learner lands on the learner host, a worker on each rollout host, the
weights reach them over HTTP from the learner (the paths it announces exist on its host only)
and the broadcast, and both rollout hosts' trajectories are trained on. Then a rollout host is
killed (the run goes on with the other; the dead worker's replacement waits for room) and
started again (it rejoins Ray, the waiting worker starts there and takes work). Every figure
(per-host trajectories, seconds to recover) is printed. Each container's log is written under
the test's tmp dir and printed when a test fails.

The tests share one cluster (a module fixture) and run in file order."""

from __future__ import annotations

import json
import re
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from buffer.redis_layout import peek_stats
from reval import registry
from reval.control import RunControl
from tests.docker.test_stack import SMALL

pytestmark = pytest.mark.docker

IMAGE = "reval:cpu"
REDIS_IMAGE = "reval-local/redis:7"
RUN = "cluster"
PREFIX = "reval:"
HEAD_PORT = 6380
RUN_ENV = {
    **SMALL,  # (the stack test's demo, made small for 2 shared cores)
    "REVAL__NAME": RUN,
    "REVAL__OUTPUT_DIR": "/runs",
    "REVAL__BUFFER__BACKEND": "redis",
    "REVAL__LEARNER__MAX_STEPS": "100000",
    "REVAL__LAUNCH__WORKERS": "2",
    "REVAL__ROLLOUT__HEARTBEAT_S": "2",
    "REVAL__LAUNCH__LEARNER_RESOURCES": '{"learner_host": 1}',
    "REVAL__LAUNCH__ROLLOUT_RESOURCES": '{"rollout_host": 1}',
}
HOSTS = {  # container -> the resources its `ray start` offers
    "learner-host": '{"learner_host": 1}',
    "rollout-a": '{"rollout_host": 1}',
    "rollout-b": '{"rollout_host": 1}',
}
HEARTBEAT_S = 2.0  # (rollout.heartbeat_s of the run: the registrations' counts this fresh)
UP_S = 480.0  # Ray on four containers, the learner's pretraining, the first weights


def docker(*args: str, check: bool = True, timeout: float = 120) -> str:
    done = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout)
    if check and done.returncode != 0:
        raise AssertionError(f"docker {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout.strip()


def wait_for(fn: Callable[[], Any], timeout: float, what: str, cluster: Cluster) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = fn()
        if got:
            return got
        if cluster.launch is not None and cluster.launch.poll() is not None:
            cluster.dump_logs()
            raise AssertionError(f"reval launch exited {cluster.launch.returncode} while "
                                 f"waiting for {what}")  # fmt: skip
        if time.monotonic() > deadline:
            cluster.dump_logs()
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(2.0)


class Cluster:
    """The containers of one cluster, their network, and the run's Redis from outside."""

    def __init__(self, logs: Path) -> None:
        self.tag = f"reval-mh-{uuid.uuid4().hex[:6]}"
        self.net = self.tag  # (Ray's: every host)
        self.data = f"{self.tag}-data"  # (Redis's: every host too, cut from one in a test)
        self.logs = logs
        self.launch: subprocess.Popen[str] | None = None
        self.client: redis.Redis | None = None

    def name(self, role: str) -> str:
        return f"{self.tag}-{role}"

    def run(self, role: str, image: str, *command: str, extra: tuple[str, ...] = ()) -> None:
        net = self.data if role == "redis" else self.net
        docker("create", "--name", self.name(role), "--hostname", role, "--network", net,
               "--network-alias", role, "--shm-size=512m", *extra, image, *command)  # fmt: skip
        if role != "redis":  # (both networks before it starts: Ray's address stays put)
            docker("network", "connect", "--alias", role, self.data, self.name(role))
        docker("start", self.name(role))

    def ray_host(self, role: str, resources: str) -> None:
        """docs/operations.md's ``ray start`` of a host joining the head."""
        self.run(role, IMAGE, "ray", "start", f"--address=head:{HEAD_PORT}", "--num-cpus=1",
                 f"--resources={resources}", "--object-store-memory=100000000",
                 "--disable-usage-stats", "--block",
                 extra=("--security-opt", "seccomp=unconfined",
                        "--security-opt", "apparmor=unconfined"))  # fmt: skip

    def up(self) -> None:
        docker("network", "create", self.net)
        docker("network", "create", self.data)
        self.run("redis", REDIS_IMAGE, "redis-server", "--save", "", "--appendonly", "no",
                 "--protected-mode", "no", extra=("-p", "127.0.0.1::6379"))  # fmt: skip
        port = docker("port", self.name("redis"), "6379/tcp").splitlines()[0].rsplit(":", 1)[1]
        self.client = redis.Redis(host="127.0.0.1", port=int(port), socket_timeout=5)
        self.run("head", IMAGE, "ray", "start", "--head", f"--port={HEAD_PORT}", "--num-cpus=0",
                 "--object-store-memory=100000000", "--include-dashboard=false",
                 "--disable-usage-stats", "--block")  # fmt: skip
        wait_for(self._head_up, 120, "the Ray head", self)
        for role, resources in HOSTS.items():
            self.ray_host(role, resources)

    def _head_up(self) -> bool:
        done = subprocess.run(["docker", "exec", self.name("head"), "ray", "health-check",
                               "--address", f"127.0.0.1:{HEAD_PORT}"],
                              capture_output=True, timeout=60)  # fmt: skip
        return done.returncode == 0

    def start_run(self) -> None:
        """docs/operations.md's ``reval launch`` on the head (the run's settings in its
        environment)."""
        env = {**RUN_ENV, "RAY_ADDRESS": f"head:{HEAD_PORT}",
               "REVAL__REDIS__URL": "redis://redis:6379/0"}  # fmt: skip
        args = [a for k, v in env.items() for a in ("-e", f"{k}={v}")]
        out = (self.logs / "launch.log").open("w")
        self.launch = subprocess.Popen(["docker", "exec", *args, self.name("head"), "reval",
                                        "launch"], stdout=out, stderr=subprocess.STDOUT,
                                       text=True)  # fmt: skip

    def step(self) -> int:
        assert self.client is not None
        try:
            return RunControl(self.client, PREFIX, RUN).read_status().step or 0
        except (redis.RedisError, ValueError):
            return 0

    def workers(self) -> list[dict[str, Any]]:
        assert self.client is not None
        try:
            return registry.workers(self.client, PREFIX, RUN)
        except redis.RedisError:
            return []

    def by_host(self) -> dict[str, dict[str, int]]:
        """Per rollout host: its workers' trajectories and their newest policy version."""
        out: dict[str, dict[str, int]] = {}
        for w in self.workers():
            got = out.setdefault(w["host"], {"trajectories": 0, "policy_version": 0})
            got["trajectories"] += int(w.get("trajectories") or 0)
            got["policy_version"] = max(got["policy_version"], int(w.get("policy_version") or 0))
        return out

    def dump_logs(self) -> None:
        for role in ("head", *HOSTS, "redis"):
            text = docker("logs", "--tail", "200", self.name(role), check=False)
            (self.logs / f"{role}.log").write_text(text)
            print(f"--- {role} ---\n{text[-4000:]}")
        launch = self.logs / "launch.log"
        if launch.is_file():
            print(f"--- reval launch ---\n{launch.read_text()[-8000:]}")

    def down(self) -> None:
        if self.launch is not None and self.launch.poll() is None:
            self.launch.kill()
        for role in ("head", *HOSTS, "redis"):
            docker("rm", "-f", "-v", self.name(role), check=False)
        docker("network", "rm", self.net, check=False)
        docker("network", "rm", self.data, check=False)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    for image in (IMAGE, REDIS_IMAGE):
        if subprocess.run(["docker", "image", "inspect", image], capture_output=True).returncode:
            pytest.fail(f"image {image} is missing: run scripts/make_images.sh")
    c = Cluster(tmp_path_factory.mktemp("cluster"))
    try:
        c.up()
        c.start_run()
        yield c
    finally:
        c.dump_logs()
        c.down()


def test_learner_and_workers_on_their_own_hosts_train_on_both(cluster):
    t0 = time.monotonic()
    wait_for(lambda: cluster.step() >= 3, UP_S, "the learner's first updates", cluster)
    wait_for(lambda: all(h in cluster.by_host() and cluster.by_host()[h]["policy_version"] > 0
                         for h in ("rollout-a", "rollout-b")),
             240, "weights on both rollout hosts", cluster)  # fmt: skip
    hosts = cluster.by_host()
    assert set(hosts) == {"rollout-a", "rollout-b"}, hosts  # (no worker on the learner's host)
    before = {h: v["trajectories"] for h, v in hosts.items()}
    step = cluster.step()
    wait_for(lambda: cluster.step() >= step + 5, 240, "5 more updates", cluster)
    after = cluster.by_host()
    grown = {h: after[h]["trajectories"] - before[h] for h in before}
    print(f"per rollout host: {json.dumps(after)}; up in {time.monotonic() - t0:.0f} s")
    assert all(n > 0 for n in grown.values()), grown  # both hosts' trajectories keep coming
    # The learner's files exist on its host only: the workers' came over HTTP.
    ls = docker("exec", cluster.name("rollout-a"), "ls", "/runs/cluster/weights", check=False)
    assert "safetensors" not in ls


def _new_workers_on(cluster: Cluster, host: str, known: set[str]) -> list[dict[str, Any]]:
    """Workers on ``host`` not in ``known`` that have sent trajectories."""
    return [w for w in cluster.workers() if w["host"] == host and w["id"] not in known
            and int(w.get("trajectories") or 0) > 0]  # fmt: skip


def test_a_rollout_host_killed_then_started_again(cluster):
    """``docker kill`` of a rollout host: the run goes on with the other host (its worker's
    replacement waits for room: no other host offers ``rollout_host``); ``docker start``: the
    host rejoins Ray, the waiting worker starts there and sends trajectories."""
    known = {w["id"] for w in cluster.workers()}
    docker("kill", cluster.name("rollout-b"))
    t0 = time.monotonic()
    step = cluster.step()
    wait_for(lambda: cluster.step() >= step + 5, 240, "5 updates with one rollout host", cluster)
    alone = time.monotonic() - t0
    docker("start", cluster.name("rollout-b"))
    t1 = time.monotonic()
    back = wait_for(lambda: _new_workers_on(cluster, "rollout-b", known), 300,
                    "a worker on the restarted host sending trajectories", cluster)  # fmt: skip
    print(
        f"rollout host killed at step {step}: 5 updates with the other alone in {alone:.0f} "
        f"s; started again: its new worker {back[0]['id']} sent trajectories "
        f"{time.monotonic() - t1:.0f} s later"
    )
    step = cluster.step()
    wait_for(lambda: cluster.step() >= step + 3, 240, "updates after the host came back", cluster)


def test_the_learners_host_killed_then_started_again_resumes_from_its_checkpoint(cluster):
    """``docker kill`` of the learner's host: the driver restarts the learner once a node with
    ``learner_host`` is up; ``docker start`` brings the host (and its disk, with the
    checkpoints) back, and the learner resumes from its latest checkpoint there, not from step
    0 (docs/operations.md: the checkpoints live on the learner's host)."""
    launch_log = cluster.logs / "launch.log"
    before = launch_log.stat().st_size  # (lines of earlier ranks: a pid may come again)
    docker("kill", cluster.name("learner-host"))
    t0 = time.monotonic()
    # (read after the kill: the dead learner's last status, in Redis off its host; read before,
    # a learner stepping fast may pass a checkpoint or two while `docker kill` runs)
    step = cluster.step()
    time.sleep(10)
    docker("start", cluster.name("learner-host"))

    def resumed() -> re.Match[str] | None:  # (the new rank 0's line: from where)
        with launch_log.open("rb") as f:
            f.seek(before)
            text = f.read().decode(errors="replace")
        restarted = re.search(r"pids \[(\d+)\]\), resuming from the latest checkpoint", text)
        if restarted is None:
            return None
        return re.search(rf"pid={restarted[1]},.* resumed at step (\d+) from checkpoint", text)

    at = int(wait_for(resumed, 300, "the learner restarted from its checkpoint", cluster)[1])
    wait_for(lambda: cluster.step() > step, 300, "updates past the kill", cluster)
    took = time.monotonic() - t0
    print(f"learner host killed at step {step}: resumed at step {at} from its checkpoint, "
          f"updates again {took:.0f} s later (10 s of it the host was down)")  # fmt: skip
    # (a checkpoint every 10 updates: at most that many are done again)
    assert step - 10 <= at <= step + 10


def _quiet_counts(cluster: Cluster) -> tuple[int, dict[str, int]]:
    """The run paused until nothing moves: the ring's inserted count and each worker's
    trajectories as its registration says (a heartbeat after the last insert)."""
    assert cluster.client is not None
    control = RunControl(cluster.client, PREFIX, RUN)
    control.set_phase("paused")

    def settled() -> tuple[int, dict[str, int]] | None:
        stats = peek_stats(cluster.client, PREFIX, RUN)
        counts = {w["id"]: int(w.get("trajectories") or 0) for w in cluster.workers()}
        time.sleep(HEARTBEAT_S * 2 + 1)
        again = peek_stats(cluster.client, PREFIX, RUN)
        later = {w["id"]: int(w.get("trajectories") or 0) for w in cluster.workers()}
        if stats is None or again is None or stats.inserted != again.inserted or counts != later:
            return None
        return again.inserted, later

    return wait_for(settled, 120, "the paused run to settle", cluster)


def test_a_rollout_host_cut_from_redis_for_20_s_loses_and_repeats_nothing(cluster):
    """``docker network disconnect`` of a rollout host from Redis's network for 20 s (Ray's
    stays): its worker goes on generating into its spool, then pushes it; between two quiet
    moments the ring gained exactly the trajectories the workers counted, none lost, none
    twice."""
    assert cluster.client is not None
    control = RunControl(cluster.client, PREFIX, RUN)
    ring0, workers0 = _quiet_counts(cluster)
    on_a = {w["id"] for w in cluster.workers() if w["host"] == "rollout-a"}
    assert on_a
    control.set_phase("running")
    host = cluster.name("rollout-a")
    docker("network", "disconnect", cluster.data, host)
    t0 = time.monotonic()
    time.sleep(20)
    docker("network", "connect", "--alias", "rollout-a", cluster.data, host)
    cut = time.monotonic() - t0
    base = {i: workers0.get(i, 0) for i in on_a}
    wait_for(lambda: any(int(w.get("trajectories") or 0) > base[w["id"]] for w in
                         cluster.workers() if w["id"] in base), 180,
             "the cut host's worker to report again", cluster)  # fmt: skip
    back = time.monotonic() - t0 - cut
    ring1, workers1 = _quiet_counts(cluster)
    control.set_phase("running")
    counted = sum(n - workers0.get(i, 0) for i, n in workers1.items())
    print(
        f"rollout host cut from Redis for {cut:.0f} s: its worker reported again "
        f"{back:.0f} s after; the ring gained {ring1 - ring0}, the workers counted {counted}"
    )
    assert set(workers0) <= set(workers1)  # (no worker died of it)
    assert ring1 - ring0 == counted > 0
