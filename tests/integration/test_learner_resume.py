"""The learner service keeps its progress (issue 38): a real ``reval learner`` (one spawned rank,
the tiny model, the test's Redis and key prefix) fed by a producer in this process writes
checkpoints by time, comes back after a SIGKILL within one checkpoint interval of where it was
and says so in one line; SIGTERM and Ctrl-C stop it with a checkpoint, one line and no
traceback (exit 143 and 130); it logs a line every ``metrics.log_every`` updates (every update
with ``--verbose``)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

from buffer.records import Trajectory
from buffer.redis_ring import RedisRing
from reval.metrics import read_jsonl
from reval.run_dir import latest_in

ROOT = Path(__file__).resolve().parents[2]
EVERY_S = 1.0  # learner.checkpoint_every_s of these runs (checkpoints by time only)


class Feeder:
    """A producer: batches of valid records into the run's ring until closed."""

    def __init__(self, url: str, prefix: str, run: str) -> None:
        self.ring = RedisRing(run, 4096, url=url, key_prefix=prefix)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._feed, daemon=True)
        self.thread.start()

    def _feed(self) -> None:
        rng, i = np.random.default_rng(38), 0
        while not self.stop.wait(0.05):
            batch = []
            for _ in range(16):
                n = int(rng.integers(1, 6))
                batch.append(Trajectory(
                    prompt_ids=rng.integers(3, 40, 4), response_ids=rng.integers(3, 40, n),
                    logprobs=-rng.random(n).astype(np.float32), reward_raw=float(i % 2),
                    reward=float(i % 2), group_id=f"g{i // 4}", traj_id=f"t{i}",
                ))  # fmt: skip
                i += 1
            self.ring.insert(batch)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)


def learner(tmp: Path, url: str, prefix: str, run: str, *args: str) -> subprocess.Popen[str]:
    sets = [
        "buffer.backend=redis", f"redis.url={url}", f"redis.prefix={prefix}",
        f"output_dir={tmp}", f"name={run}", "buffer.capacity=4096", "buffer.min_size_to_sample=16",
        "learner.batch_size=16", "learner.micro_batch_size=16", "learner.max_steps=100000",
        "learner.checkpoint_every=0", f"learner.checkpoint_every_s={EVERY_S}",
        "learner.lease_s=3", "buffer.sample_timeout_s=5", "sync.timeout_s=20",
        "metrics.progress=false", "metrics.log_every=5", "model.pretrain_steps=0",
    ]  # fmt: skip
    cmd = [sys.executable, "-m", "services.cli", "learner", "--nproc", "1"]
    for s in sets:
        cmd += ["--set", s]
    cmd += args  # (a --set of its own comes after and wins)
    err = (tmp / f"{run}-{time.monotonic_ns()}.err").open("w")
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"},
                            start_new_session=True)  # fmt: skip


def rows(tmp: Path, run: str) -> list[dict]:
    path = tmp / run / "learner.jsonl"
    return read_jsonl(path) if path.is_file() else []


def wait_for(cond, timeout: float, proc: subprocess.Popen[str], what: str):
    deadline = time.monotonic() + timeout
    while not (got := cond()):
        assert proc.poll() is None, f"the learner exited ({proc.returncode}) before {what}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)
    return got


def killpg(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def err_text(tmp: Path, run: str) -> list[str]:
    return [p.read_text() for p in sorted(tmp.glob(f"{run}-*.err"))]


def test_a_killed_learner_resumes_within_one_checkpoint_interval_and_says_so(
    tmp_path, redis_url, redis_prefix
):
    feeder = Feeder(redis_url, redis_prefix, "res")
    first = second = None
    try:
        first = learner(tmp_path, redis_url, redis_prefix, "res", "--resume-if-any", "--set",
                        "learner.keep_checkpoints=2")  # fmt: skip
        # A few seconds of training: checkpoints by time (checkpoint_every=0: none by count).
        wait_for(lambda: len(rows(tmp_path, "res")) and rows(tmp_path, "res")[-1]["elapsed_s"]
                 > 4.5 * EVERY_S, 180, first, "4.5 s of updates")  # fmt: skip
        os.killpg(first.pid, signal.SIGKILL)  # the rank and its parent, as a container's kill
        first.wait(10)
        before = rows(tmp_path, "res")
        killed_at = before[-1]["policy_version"]
        (start_text,) = err_text(tmp_path, "res")
        assert f"starting at step 0: no checkpoint under {tmp_path / 'res' / 'checkpoints'}" in (
            start_text
        )
        latest = latest_in(tmp_path / "res" / "checkpoints")
        assert latest is not None, "no checkpoint by time"
        # About 4 written (every second), the newest 2 kept (learner.keep_checkpoints=2).
        kept = sorted(p.name for p in (tmp_path / "res" / "checkpoints").glob("step-*"))
        assert len(kept) == 2 and kept[-1] == latest.name, kept
        saved = int(latest.name.split("-")[1])
        # Within one interval: the checkpoint is less than checkpoint_every_s (and the update
        # and save in hand) older than the last update seen.
        elapsed = {r["policy_version"]: r["elapsed_s"] for r in before}
        assert 0 < saved <= killed_at
        assert elapsed[killed_at] - elapsed[saved] < EVERY_S + 1.0, (saved, killed_at)

        second = learner(tmp_path, redis_url, redis_prefix, "res", "--resume-if-any")
        wait_for(lambda: len(rows(tmp_path, "res")) > len(before) + 3, 180, second,
                 "updates after the restart")  # fmt: skip
        resumed = rows(tmp_path, "res")[len(before)]
        assert resumed["policy_version"] == saved + 1  # it went on from the checkpoint
        text = err_text(tmp_path, "res")[1]
        assert f"resumed at step {saved} from checkpoint {latest}" in text
        progress = re.findall(r"step (\d+) \(update (\d+)\): loss \S+, reward \S+, waited", text)
        assert progress and all(int(u) % 5 == 0 for _s, u in progress)  # metrics.log_every=5

        # SIGTERM (docker stop): the update in hand, a checkpoint, one line, exit 143.
        second.send_signal(signal.SIGTERM)
        assert second.wait(60) == 143
        text = err_text(tmp_path, "res")[1]
        final = latest_in(tmp_path / "res" / "checkpoints")
        assert final is not None
        step = int(final.name.split("-")[1])
        assert step == rows(tmp_path, "res")[-1]["policy_version"]  # nothing done is lost
        stop_lines = [ln for ln in text.splitlines() if "stopped by" in ln]
        assert (
            len(stop_lines) == 1
            and f"stopped by SIGTERM at step {step}: checkpoint {final}" in stop_lines[0]
        )
        assert "Traceback" not in text and "checkpoint and stop" not in text
    finally:
        feeder.close()
        for proc in (first, second):
            if proc is not None:
                killpg(proc)


def test_ctrl_c_on_the_learner_checkpoints_and_exits_130(tmp_path, redis_url, redis_prefix):
    """Two ranks: they agree on a checkpoint by time (each rank's clock, one decision) and on
    the stop; a line per update with --verbose."""
    feeder = Feeder(redis_url, redis_prefix, "int")
    proc = None
    try:
        proc = learner(tmp_path, redis_url, redis_prefix, "int", "--verbose", "--nproc", "2")
        wait_for(lambda: len(rows(tmp_path, "int")) >= 3
                 and "reval.learner checkpoint " in "".join(err_text(tmp_path, "int")), 180,
                 proc, "3 updates and a checkpoint by time")  # fmt: skip
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C in a terminal: the whole process group
        assert proc.wait(60) == 130
        (text,) = err_text(tmp_path, "int")
        done = rows(tmp_path, "int")
        final = latest_in(tmp_path / "int" / "checkpoints")
        assert final is not None and int(final.name.split("-")[1]) == done[-1]["policy_version"]
        stops = [ln for ln in text.splitlines() if "stopped by" in ln]
        assert len(stops) == 1, text[-3000:]
        assert f"stopped by SIGINT at step {len(done)}: checkpoint {final}" in stops[0]
        assert "Traceback" not in text and "KeyboardInterrupt" not in text
        # --verbose: a line per update
        updates = re.findall(r"\(update (\d+)\): loss", text)
        assert [int(u) for u in updates] == list(range(1, len(done) + 1))
    finally:
        feeder.close()
        if proc is not None:
            killpg(proc)


def test_a_starting_learner_reads_starting_until_its_status_goes_stale(
    tmp_path, redis_url, redis_prefix, monkeypatch
):
    """While ``reval learner`` starts again (its pretraining, its ranks building the model) the
    API shows its run ``starting``, not ``failed`` (the lease of the learner that died is gone,
    the new one's not taken yet); a ``starting`` status nobody renews reads ``failed`` after
    ``STARTING_TIMEOUT_S``; the beat ends once the new learner reports, and never writes over
    what it reported (a learner stopped within a beat of its start read ``stopping``)."""
    import json

    import redis
    from fastapi.testclient import TestClient

    from learner.ranks import StartingStatus
    from reval.config import ApiConfig, build_config
    from reval.control import (
        STARTING_BEAT_S,
        STARTING_TIMEOUT_S,
        RunControl,
        RunLease,
        adopt_run,
    )
    from services.api import create_app

    token = "t0ken-for-the-resume-tests-0123456789"
    api = ApiConfig(redis_url=redis_url, key_prefix=redis_prefix, output_dir=str(tmp_path))
    monkeypatch.setenv(api.token_env, token)
    client = TestClient(create_app(api))

    def phase() -> str:
        got = client.get("/v1/runs/boot", headers={"Authorization": f"Bearer {token}"})
        return got.json()["phase"]

    r = redis.Redis.from_url(redis_url)
    control = RunControl(r, redis_prefix, "boot")
    adopt_run(r, redis_prefix, "boot", {"name": "boot"})
    control.publish_status({"phase": "running", "step": 40})  # a learner that died at step 40
    assert phase() == "failed"
    cfg = build_config({"name": "boot", "output_dir": str(tmp_path),
                        "redis": {"url": redis_url, "prefix": redis_prefix}})  # fmt: skip
    starting = StartingStatus(cfg)
    deadline = time.monotonic() + 5
    while phase() != "starting":
        assert time.monotonic() < deadline, phase()
        time.sleep(0.05)
    assert control.read_status().step == 40  # (the status keeps the last step it reported)
    starting.close()
    r.hset(control.status, "time", json.dumps(time.time() - STARTING_TIMEOUT_S - 1))
    assert phase() == "failed"  # it died while starting

    again = StartingStatus(cfg)
    lease = RunLease(r, redis_prefix, "boot", ttl_s=5)  # the new learner's rank 0
    lease.acquire(wait_s=0)
    try:
        time.sleep(0.2)
        assert phase() == "starting"  # (held: alive; its rank 0 reports from its first update)
        # Its rank 0 reports, and stops at once (before the beat's next turn): what it wrote
        # stays, and the beat ends.
        control.publish_status({"phase": "stopped", "step": 41})
        lease.release()
        again.thread.join(STARTING_BEAT_S + 2)
        assert not again.thread.is_alive()
        assert phase() == "stopped"
    finally:
        lease.release()
        r.close()


def test_sigterm_while_the_learner_sets_up_is_one_line_and_143(tmp_path, redis_url, redis_prefix):
    """Before its ranks start (the tiny model's pretraining) there is nothing to keep: one line,
    no traceback, exit 143 (it used to die of the signal, silently)."""
    proc = learner(tmp_path, redis_url, redis_prefix, "early", "--set", "model.pretrain_steps=3000")
    try:
        wait_for(lambda: "pretraining" in "".join(err_text(tmp_path, "early")), 120, proc,
                 "the pretraining")  # fmt: skip
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 143
        (text,) = err_text(tmp_path, "early")
        assert "reval learner: stopped by SIGTERM while setting up: nothing to keep yet" in text
        assert "Traceback" not in text
    finally:
        killpg(proc)


def test_sigterm_while_the_learner_waits_for_data_stops_it_within_seconds(
    tmp_path, redis_url, redis_prefix
):
    """No worker feeds it: rank 0 waits for a batch in turns of ``STOP_POLL_S`` (5 s; it was
    a quarter of sync.timeout_s, 15 s here, longer than ``docker stop`` waits by default) and
    looks at its stop flag within them (``draw_within``), so a SIGTERM stops it at once, with its
    checkpoint (the line came 4-5 s after the signal when it waited out its turn; with the
    rank's interpreter teardown, past 8 s on a busy machine)."""
    sets = ["--set", "buffer.sample_timeout_s=60", "--set", "sync.timeout_s=60"]
    proc = learner(tmp_path, redis_url, redis_prefix, "idle", *sets)
    try:
        wait_for(lambda: "starting at step 0" in "".join(err_text(tmp_path, "idle")), 120, proc,
                 "the start line")  # fmt: skip
        time.sleep(0.2)  # (in its wait for a batch: its turn ends 4.8 s from now)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        said = wait_for(lambda: "stopped by SIGTERM" in "".join(err_text(tmp_path, "idle"))
                        or proc.poll() is not None, 30, proc, "the stop line")  # fmt: skip
        assert said and time.monotonic() - t0 < 4.0
        assert proc.wait(30) == 143
        assert time.monotonic() - t0 < 8.0
        (text,) = err_text(tmp_path, "idle")
        assert "stopped by SIGTERM at step 0: checkpoint" in text and "Traceback" not in text
    finally:
        killpg(proc)
