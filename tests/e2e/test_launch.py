"""The service scenario, shorter, through ``reval launch`` on a local Ray: a 2-rank FSDP2 learner
and two rollout workers as Ray actors, real Redis. A worker is added and another drained from a
second process (``--add``/``--remove``), a worker killed with SIGKILL is replaced, a learner rank
killed with SIGKILL makes the driver restart the learner from its checkpoint, ``--stop`` ends the
run (checkpoint, drain)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import redis

from buffer.redis_ring import RedisRing
from reval import registry
from reval.metrics import read_jsonl
from tests.e2e.test_service import ROOT, common

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "RAY_USAGE_STATS_ENABLED": "0", "RAY_DEDUP_LOGS": "0"}


def cli(sets: list[str], *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "services.cli", "launch"]
    for s in sets:
        cmd += ["--set", s]
    return subprocess.run(
        [*cmd, *args], cwd=ROOT, capture_output=True, text=True, env=ENV, timeout=timeout
    )


def status(sets: list[str]) -> dict:
    done = cli(sets, "--status")
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def wait_for(cond, timeout: float, driver: subprocess.Popen[str], what: str):
    deadline = time.monotonic() + timeout
    while True:
        got = cond()
        if got:
            return got
        if driver.poll() is not None:
            raise AssertionError(f"the launch driver exited ({driver.returncode}) before {what}")
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


def last_update(run_dir: Path) -> int:
    rows = read_jsonl(run_dir / "learner.jsonl") if (run_dir / "learner.jsonl").is_file() else []
    return rows[-1]["update"] if rows else 0


def rows_after(run_dir: Path, logged: int) -> list[int]:
    """The updates logged after the first ``logged`` rows."""
    return [r["update"] for r in read_jsonl(run_dir / "learner.jsonl")[logged:]]


def test_launch_on_local_ray(tmp_path, redis_url, redis_prefix):
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        ops_port = sock.getsockname()[1]
    sets = common(
        tmp_path,
        redis_url,
        redis_prefix,
        "name=launch",
        "buffer.capacity=8192",
        "learner.world_size=2",
        "learner.max_steps=100000",  # ended by --stop
        "learner.checkpoint_every=5",
        "launch.workers=2",
        "launch.stop_timeout_s=30",
        f"launch.metrics_port={ops_port}",
    )
    run_dir = tmp_path / "launch"
    log_file = (tmp_path / "driver.log").open("w")
    cmd = [sys.executable, "-m", "services.cli", "launch"]
    for s in sets:
        cmd += ["--set", s]
    driver = subprocess.Popen(
        cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=log_file, text=True, env=ENV
    )
    client = redis.Redis.from_url(redis_url)
    ring = RedisRing("launch", 8192, url=redis_url, key_prefix=redis_prefix)
    try:
        wait_for(lambda: last_update(run_dir) >= 8, 240, driver, "8 updates")
        st = status(sets)
        assert st["state"] == "running" and len(st["workers"]) == 2
        # The driver's own endpoint: probes and metrics.
        import httpx

        ops = f"http://127.0.0.1:{ops_port}"
        assert httpx.get(f"{ops}/healthz").status_code == 200
        assert httpx.get(f"{ops}/readyz").status_code == 200
        assert "reval_launch_workers 2.0" in httpx.get(f"{ops}/metrics").text
        assert registry.count_alive(client, redis_prefix, "launch", 1.0) == 2

        # A newcomer from another process: its first trajectories carry current weights.
        joined_at = last_update(run_dir)
        assert cli(sets, "--add", "1").returncode == 0
        added = wait_for(
            lambda: [w for w in status(sets)["workers"] if w["id"] == "launch-w2"],
            60,
            driver,
            "the added worker",
        )
        assert added
        wait_for(
            lambda: any(t.worker_id == "launch-w2" for t in ring.items()),
            120,
            driver,
            "the added worker's trajectories",
        )
        new = [t.policy_version for t in ring.items() if t.worker_id == "launch-w2"]
        assert min(new) >= joined_at - 1  # (the version it loaded, not the initial weights)

        # A worker dies: it is replaced, the run goes on.
        st = wait_for(
            lambda: (s := status(sets)) and all(w["pid"] for w in s["workers"]) and s,
            60,
            driver,
            "worker pids",
        )
        victim = next(w for w in st["workers"] if w["id"] == "launch-w0")
        os.kill(victim["pid"], signal.SIGKILL)
        st = wait_for(
            lambda: (s := status(sets))["dead_workers"] == 1 and len(s["workers"]) == 3 and s,
            90,
            driver,
            "the replacement worker",
        )
        assert "launch-w0" not in [w["id"] for w in st["workers"]]

        # A learner rank dies: the learner restarts from its latest checkpoint (which cannot
        # move on once a rank is gone: saving is collective).
        os.kill(st["learner"]["pids"][1], signal.SIGKILL)
        logged = len(read_jsonl(run_dir / "learner.jsonl"))
        wait_for(
            lambda: status(sets)["learner"]["restarts"] == 1, 90, driver, "the learner restart"
        )
        # Read once the new ranks exist (they take seconds to start and the old ones can no
        # longer checkpoint): the checkpoint they resume from.
        resumed_from = int((run_dir / "checkpoints" / "latest").read_text().split("-")[1])
        # The first update after the restart is the one after that checkpoint. (An update number
        # that goes down is no sign of it: killed between a checkpoint and the next update's
        # row, the learner resumes past the last row it logged.)
        wait_for(lambda: rows_after(run_dir, logged), 180, driver, "an update after it")
        after = rows_after(run_dir, logged)
        if after[0] <= resumed_from:
            after = after[1:]  # a row the old rank 0 wrote as the other died
            wait_for(lambda: len(rows_after(run_dir, logged)) > 1, 60, driver, "another update")
            after = rows_after(run_dir, logged)[1:]
        assert after[0] == resumed_from + 1
        # Drain one worker on request: it leaves the registry.
        assert cli(sets, "--remove", "1").returncode == 0
        wait_for(
            lambda: (
                len(status(sets)["workers"]) == 2
                and registry.count_alive(client, redis_prefix, "launch", 1.0) == 2
            ),
            90,
            driver,
            "the drained worker to leave",
        )
        assert cli(sets, "--export").returncode == 0  # an HF checkpoint on demand
        wait_for(
            lambda: any((run_dir / "exports").glob("step-*/config.json")),
            120,
            driver,
            "the export",
        )
        inserted = ring.stats().inserted
        assert cli(sets, "--stop").returncode == 0
        out, _ = driver.communicate(timeout=180)
    finally:
        if driver.poll() is None:
            driver.send_signal(signal.SIGINT)
            try:
                driver.wait(60)
            except subprocess.TimeoutExpired:
                driver.kill()
        log_file.close()
    log = (tmp_path / "driver.log").read_text()
    assert driver.returncode == 0, log[-4000:]
    final = json.loads(out.strip().splitlines()[-1])
    assert final["state"] == "done" and final["learner"]["restarts"] == 1
    assert final["dead_workers"] == 1
    # --stop: the learner checkpointed where it stopped; the workers drained and deregistered.
    stopped_at = final["learner"]["final_state"]["step"]
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == f"step-{stopped_at:08d}"
    assert registry.count_alive(client, redis_prefix, "launch", 1.0) == 0
    assert ring.stats().inserted >= inserted  # nothing generated was lost
    rows = read_jsonl(run_dir / "learner.jsonl")
    assert any(r["staleness_mean"] > 0 for r in rows)
    assert rows[-1]["update"] == stopped_at


def test_launch_control_errors(tmp_path, redis_url, redis_prefix):
    sets = common(tmp_path, redis_url, redis_prefix, "name=nobody-launched-this")
    done = cli(sets, "--status")
    assert done.returncode == 1
    assert "no launched run" in done.stderr or "Could not find any running Ray" in done.stderr
    bad = cli([*sets, "buffer.backend=memory"])
    assert bad.returncode == 2 and "buffer.backend=redis" in bad.stderr
    neg = cli(sets, "--add", "-1")
    assert neg.returncode == 2 and "--add" in neg.stderr
