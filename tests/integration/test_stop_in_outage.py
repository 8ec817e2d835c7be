"""A stop (SIGTERM) that arrives while a process waits out a Redis outage (issue 38): the wait
ends at once (``reval.retry.stop_waiting``), instead of after ``redis.outage_s`` (600 s here,
longer than ``docker stop``'s grace period, after which the process is SIGKILLed): the learner
writes its checkpoint and exits 143 with its one line, a worker keeps its unsent records in the
run's ``spool/`` and exits. Each against a redis-server of the test's own, stopped under it."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgpack
import pytest
import redis

from buffer.base import BufferUnavailable
from buffer.redis_ring import RedisRing
from reval import retry
from tests.integration.test_learner_resume import Feeder, err_text, killpg, learner, rows, wait_for
from tests.integration.test_redis_outage import own_redis  # noqa: F401  (a fixture)
from tests.integration.test_rollout_worker import (
    ROOT,
    cli_args,
    publish,
    summary,
    worker_cfg,
)

PREFIX = "reval-test:stop-outage:"
OUTAGE = "redis.outage_s=600"
"""Far longer than the test: the code before waited the whole of it before it stopped."""
EXIT_S = 15.0
"""How soon after the SIGTERM the process must have exited (measured on 2 busy cores: the learner
6.5-11 s, most of it its checkpoint and torch's teardown; the worker 4 s)."""


@pytest.fixture
def own_stop(monkeypatch):
    """A stop event of the test's own (``stop_waiting`` sets it for the whole process); the
    outage its waits began is over afterwards (the process's outage lines start afresh)."""
    monkeypatch.setattr(retry, "_stopping", threading.Event())
    yield
    retry.note_through("test: stop")


def test_a_stop_ends_a_wait_for_redis_at_once_and_later_ones_at_their_first_try(own_stop):
    tries: list[float] = []

    def away() -> None:
        tries.append(time.monotonic())
        raise redis.ConnectionError("Connection refused")

    threading.Timer(0.3, retry.stop_waiting).start()
    t0 = time.monotonic()
    with pytest.raises(redis.ConnectionError):
        retry.retry_redis(away, 600.0, "test: stop")
    assert 0.3 <= time.monotonic() - t0 < 2.0  # (the old wait: 600 s)
    n = len(tries)
    with pytest.raises(redis.ConnectionError):
        retry.retry_redis(away, 600.0, "test: stop")
    assert len(tries) == n + 1  # stopping: one try, no wait
    with pytest.raises(ValueError):  # (not a wait fault: raised as ever)
        retry.retry_redis(lambda: int("x"), 600.0, "test: stop")


def test_skip_when_stopping_swallows_only_a_wait_cut_short_by_the_stop(own_stop):
    cut = BufferUnavailable("away past redis.outage_s")
    cut.__cause__ = redis.ConnectionError("Connection refused")
    # Not stopping: an outage past its budget raises.
    with pytest.raises(BufferUnavailable), retry.skip_when_stopping():
        raise cut
    retry.stop_waiting()
    with retry.skip_when_stopping():
        raise cut
    with retry.skip_when_stopping():
        raise redis.ConnectionError("Connection refused")
    with pytest.raises(ValueError), retry.skip_when_stopping():
        raise ValueError("not Redis")


def test_reval_launchs_stop_of_a_learner_rank_ends_its_waits_for_redis(own_stop):
    """``reval launch`` stops a learner rank through its Ray actor (``LearnerRank.stop``): its
    service stops after the update in hand and a wait for Redis in hand ends too."""
    from learner.service import LearnerService
    from services.launch_actors import LearnerRank

    service = LearnerService.__new__(LearnerService)  # (only its stop; no model)
    service.stop, service.stop_signal = threading.Event(), 0
    actor = LearnerRank(0, 1)
    actor.service = service
    actor.stop()
    assert service.stop.is_set() and retry.stopping()


def _learner_stops_at_once(own_redis, tmp_path: Path, nproc: int) -> None:  # noqa: F811
    run = f"so{nproc}"
    feeder = Feeder(own_redis.url, PREFIX, run)
    proc = learner(tmp_path, own_redis.url, PREFIX, run, "--set", OUTAGE, "--nproc", str(nproc))
    try:
        wait_for(lambda: len(rows(tmp_path, run)) >= 3, 120, proc, "three updates")
        feeder.close()
        own_redis.stop(signal.SIGTERM)  # Redis away: rank 0 waits for it in its next call
        wait_for(lambda: "Redis is away" in "".join(err_text(tmp_path, run)), 60, proc,
                 "the learner's wait for Redis")  # fmt: skip
        time.sleep(1.5)  # (its calls in hand meet the outage: each waits up to 600 s)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail("the learner still waits for Redis 60 s after SIGTERM")
        took = time.monotonic() - t0
    finally:
        feeder.stop.set()
        killpg(proc)
    err = "".join(err_text(tmp_path, run))
    assert code == 128 + signal.SIGTERM, err[-3000:]
    assert took < EXIT_S, f"exited {took:.1f} s after SIGTERM"
    assert "Traceback" not in err, err[-3000:]
    said = [line for line in err.splitlines() if "stopped by SIGTERM" in line]
    assert len(said) == 1, err[-3000:]
    got = re.search(r"stopped by SIGTERM at step (\d+): checkpoint (\S+)", said[0])
    assert got is not None, said[0]
    checkpoint = Path(got.group(2))
    assert checkpoint.is_dir() and checkpoint.name == f"step-{int(got.group(1)):08d}", said[0]
    print(f"{nproc} rank(s): exited {code} {took:.1f} s after SIGTERM with Redis away "
          f"(redis.outage_s=600), checkpoint {checkpoint.name}")  # fmt: skip


def test_a_sigterm_during_a_redis_outage_stops_the_learner_at_once(own_redis, tmp_path):  # noqa: F811
    _learner_stops_at_once(own_redis, tmp_path, nproc=1)


@pytest.mark.slow  # (two ranks start: 19 s on 2 cores)
def test_a_sigterm_during_a_redis_outage_stops_a_two_rank_learner_at_once(own_redis, tmp_path):  # noqa: F811
    _learner_stops_at_once(own_redis, tmp_path, nproc=2)


HELD_WORKER = """
import runpy, sys, time
from pathlib import Path
import rollout.worker as w
hold, held = Path(sys.argv[1]), Path(sys.argv[2])
graded = w.group_records
def group_records(*args, **kwargs):
    result = graded(*args, **kwargs)
    while hold.exists():  # (the test stops Redis meanwhile: this group's insert meets it)
        held.touch()
        time.sleep(0.05)
    return result
w.group_records = group_records
sys.argv = ["services.cli", *sys.argv[3:]]
runpy.run_module("services.cli", run_name="__main__")
"""
"""The worker's CLI with a group held between its grading and its insert while a ``hold``
file exists (it touches ``held`` then): Redis stops while a group is in hand, every time. (The
test before stopped Redis at a moment of its own: when the worker was between batches, its next
call waited for Redis and no batch was in hand, so the spool was empty: one CI failure.)"""


def test_a_sigterm_during_a_redis_outage_stops_a_worker_with_its_records_in_the_spool(
    own_redis,  # noqa: F811
    tmp_path,
):
    """A worker generating while Redis goes away: its batch in hand goes to its spool, its next
    call waits for Redis; SIGTERM ends the wait, the spool goes to ``spool/``: nothing it made
    is lost."""
    cfg = worker_cfg(tmp_path, own_redis.url, PREFIX, OUTAGE)
    publish(cfg, 0)
    hold, held = tmp_path / "hold", tmp_path / "held"
    cmd = [sys.executable, "-c", HELD_WORKER, str(hold), str(held), "rollout", "--worker-id", "ws"]
    for a in cli_args(tmp_path, own_redis.url, PREFIX, OUTAGE):
        cmd += ["--set", a]
    log = (tmp_path / "worker.err").open("w")  # (a file: a pipe left unread could fill)
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=log, text=True)
    said = lambda: (tmp_path / "worker.err").read_text()[-3000:]  # noqa: E731
    try:
        ring = RedisRing(cfg.name, cfg.buffer.capacity, url=own_redis.url, key_prefix=PREFIX)
        deadline = time.monotonic() + 120
        while len(ring) < 80:
            assert p.poll() is None, said()
            assert time.monotonic() < deadline, said()
            time.sleep(0.05)
        ring.close()
        hold.touch()
        while not held.exists():  # a batch generated, not yet inserted
            assert p.poll() is None, said()
            assert time.monotonic() < deadline, said()
            time.sleep(0.05)
        own_redis.stop(signal.SIGTERM)
        hold.unlink()
        time.sleep(2.0)  # (its batch in hand goes to its spool; its next call waits for Redis)
        t0 = time.monotonic()
        p.send_signal(signal.SIGTERM)
        try:
            out, _ = p.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail("the worker still waits for Redis 60 s after SIGTERM")
    finally:  # (a failed wait above must not leave the worker held, or running)
        hold.unlink(missing_ok=True)
        if p.poll() is None:
            p.kill()
            p.wait()
        log.close()
    err = (tmp_path / "worker.err").read_text()
    took = time.monotonic() - t0
    assert p.returncode == 0, err[-3000:]
    assert took < EXIT_S, f"exited {took:.1f} s after SIGTERM"
    assert "Traceback" not in err, err[-3000:]
    kept = [i for f in sorted(cfg.paths.spool.glob("*.spool"))
            for i in msgpack.unpackb(f.read_bytes())["ids"]]  # fmt: skip
    own_redis.start()
    ring = RedisRing(cfg.name, cfg.buffer.capacity, url=own_redis.url, key_prefix=PREFIX)
    pushed = summary(out)["trajectories"]
    assert kept, err[-3000:]  # the batch generated while Redis was away
    assert ring.stats().inserted + len(kept) == pushed  # nothing it made is lost
    assert len([line for line in err.splitlines() if "kept" in line and "spool" in line]) == 1
    print(f"worker: exited {p.returncode} {took:.1f} s after SIGTERM with Redis away "
          f"(redis.outage_s=600), {len(kept)} records in spool/, {pushed} made")  # fmt: skip
    ring.close()


# -- a corrupt ring under torchrun --------------------------------------------------------------


def test_a_corrupt_ring_under_torchrun_is_one_line_and_the_other_ranks_are_quiet(
    tmp_path, redis_url, redis_prefix
):
    """``meta head=abc`` under ``torchrun --nproc_per_node 2 -m services.cli learner``: rank 0
    says it in one line; rank 1, whose collective rank 0's exit broke, learns it from the
    agent's store and exits 1 without a traceback (before: gloo's "Connection closed"). 10 s."""
    run = "tr"
    feeder = Feeder(redis_url, redis_prefix, run)
    sets = [
        "buffer.backend=redis", f"redis.url={redis_url}", f"redis.prefix={redis_prefix}",
        f"output_dir={tmp_path}", f"name={run}", "buffer.capacity=4096",
        "buffer.min_size_to_sample=16", "learner.batch_size=16", "learner.micro_batch_size=16",
        "learner.max_steps=100000", "learner.checkpoint_every=0", "learner.lease_s=3",
        "buffer.sample_timeout_s=5", "sync.timeout_s=20", "metrics.progress=false",
        "model.pretrain_steps=0", "learner.sample_prefetch=0",
    ]  # fmt: skip
    logs = tmp_path / "logs"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "--log-dir", str(logs), "--redirects", "3", "-m", "services.cli", "learner"]  # fmt: skip
    for s in sets:
        cmd += ["--set", s]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=env, start_new_session=True)  # fmt: skip
    try:
        wait_for(lambda: len(rows(tmp_path, run)) >= 3, 180, proc, "three updates")
        feeder.close()
        feeder.ring.client.hset(feeder.ring.keys.meta, "head", "abc")
        try:
            proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            pytest.fail("the ranks did not stop on the corrupt ring")
    finally:
        feeder.stop.set()
        killpg(proc)
    errs = {int(p.parent.name): p.read_text() for p in logs.rglob("stderr.log")}
    assert sorted(errs) == [0, 1], sorted(logs.rglob("*"))
    said = [line for line in errs[0].splitlines() if "bookkeeping in Redis is corrupt" in line]
    assert len(said) == 1 and said[0].startswith("reval learner: "), errs[0][-3000:]
    assert "Traceback" not in errs[0], errs[0][-3000:]
    assert "Traceback" not in errs[1] and "onnection closed" not in errs[1], errs[1][-3000:]
    assert "corrupt" not in errs[1]  # (rank 0 said it)
    feeder.ring.client.hset(feeder.ring.keys.meta, "head", "0")
