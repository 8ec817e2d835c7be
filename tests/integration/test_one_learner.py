"""One learner per run (issue 19): the run's lease in Redis (``reval/control.py: RunLease``), and
a spawned rank that stops when its ``reval learner`` parent is SIGKILLed (it used to train on as
an orphan, beside the next learner of the run, interleaving ``learner.jsonl`` and overwriting
its checkpoints)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from reval.control import LeaseHeld, RunControl, RunLease, lease_key

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def client(redis_url):
    c = redis.Redis.from_url(redis_url)
    yield c
    c.close()


def test_a_second_holder_is_refused_by_name_until_the_first_releases(client, redis_prefix):
    first = RunLease(client, redis_prefix, "r", ttl_s=0.6)
    first.acquire()
    try:
        time.sleep(1.0)  # longer than the lease: the renewals keep it
        second = RunLease(client, redis_prefix, "r", ttl_s=0.6)
        second.identity = json.dumps({"host": "elsewhere", "pid": 1, "started": 0})
        t0 = time.monotonic()
        with pytest.raises(LeaseHeld) as err:
            second.acquire()
        assert time.monotonic() - t0 >= 0.5  # it waited one lease time for the holder to go
        assert f"pid {os.getpid()}" in str(err.value) and "stop it first" in str(err.value)
    finally:
        first.release()
    assert client.get(lease_key(redis_prefix, "r")) is None
    second.acquire(wait_s=0)
    second.release()


def test_a_dead_holder_frees_the_lease(client, redis_prefix):
    key = lease_key(redis_prefix, "r")
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    import socket

    # A holder on this host whose process is gone: taken at once.
    client.set(key, json.dumps({"host": socket.gethostname(), "pid": int(gone.stdout)}), px=60_000)
    lease = RunLease(client, redis_prefix, "r", ttl_s=60)
    lease.acquire(wait_s=0)
    lease.release()
    # A holder elsewhere that stopped renewing: taken once its lease time is over.
    client.set(key, json.dumps({"host": "elsewhere", "pid": 7}), px=300)
    lease = RunLease(client, redis_prefix, "r", ttl_s=5)
    lease.acquire(wait_s=2)
    lease.release()


def test_a_lease_taken_over_is_lost(client, redis_prefix):
    lease = RunLease(client, redis_prefix, "r", ttl_s=0.3)
    lease.acquire()
    client.set(lease_key(redis_prefix, "r"), json.dumps({"host": "h", "pid": 1}))
    assert lease.lost.wait(2)
    lease.release()
    assert client.get(lease_key(redis_prefix, "r")) is not None  # (not its to delete)


def _learner(tmp_path: Path, url: str, prefix: str) -> subprocess.Popen[str]:
    sets = [
        "buffer.backend=redis",
        f"redis.url={url}",
        f"redis.prefix={prefix}",
        f"output_dir={tmp_path}",
        "name=one",
        "learner.lease_s=3",
        "learner.checkpoint_every=0",
        "buffer.sample_timeout_s=2",
        "sync.timeout_s=8",
        "metrics.progress=false",
    ]
    cmd = [sys.executable, "-m", "services.cli", "learner", "--nproc", "1"]
    for s in sets:
        cmd += ["--set", s]
    return subprocess.Popen(
        cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True,
    )  # fmt: skip


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_one_learner_per_run_and_no_orphan_ranks(tmp_path, redis_url, redis_prefix, client):
    key = lease_key(redis_prefix, "one")
    first = _learner(tmp_path, redis_url, redis_prefix)
    rank_pid = None
    try:
        deadline = time.monotonic() + 120
        while rank_pid is None:
            assert first.poll() is None, first.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the learner never took its lease"
            raw = client.get(key)
            rank_pid = json.loads(raw)["pid"] if raw else None
            time.sleep(0.2)
        assert rank_pid != first.pid  # the lease names the rank that trains

        second = _learner(tmp_path, redis_url, redis_prefix)
        _, err = second.communicate(timeout=120)
        assert second.returncode == 2, err[-3000:]
        assert f"has a learner already: pid {rank_pid}" in err

        # SIGKILL of the parent alone (not its group): the rank stops within seconds.
        os.kill(first.pid, signal.SIGKILL)
        first.wait(10)
        t0 = time.monotonic()
        while _alive(rank_pid) and time.monotonic() - t0 < 30:
            time.sleep(0.2)
        assert not _alive(rank_pid), "the rank outlived its parent"
        stopped_in = time.monotonic() - t0
        assert client.get(key) is None  # it stopped cleanly and gave the lease back
        assert stopped_in < 30
    finally:
        for proc in (first,):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        if rank_pid is not None and _alive(rank_pid):
            os.kill(rank_pid, signal.SIGKILL)


def test_the_learner_ranks_store_listens_on_master_addr_only(monkeypatch):
    """torch's env:// store listens on every interface whatever MASTER_ADDR says; the learner's
    own (``process_group_store``) listens on MASTER_ADDR only (127.0.0.2 is this machine too,
    but not the address it was given)."""
    import datetime as dt
    import socket

    from learner.parallel import process_group_store

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    store = process_group_store(dt.timedelta(seconds=5))
    assert store is not None
    monkeypatch.setenv("RANK", "1")
    other = process_group_store(dt.timedelta(seconds=5))  # rank 1 joins it
    other.set("k", "v")
    assert store.get("k") == b"v"
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.2", port), timeout=2).close()
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    assert process_group_store(dt.timedelta(seconds=5)) is None  # (torchrun's agent hosts it)


def test_a_learner_that_lost_its_lease_leaves_the_run_status_alone(
    tmp_path, redis_url, redis_prefix, client
):
    """A learner whose lease another learner took over stops without writing the run's status:
    ``stopped`` over the new learner's status sent that learner's workers away and told the API
    the run had stopped."""
    key = lease_key(redis_prefix, "one")
    first = _learner(tmp_path, redis_url, redis_prefix)
    try:
        deadline = time.monotonic() + 120
        while client.get(key) is None:
            assert first.poll() is None, first.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the learner never took its lease"
            time.sleep(0.2)
        time.sleep(3)  # (into its loop: waiting for data)
        control = RunControl(client, redis_prefix, "one")
        client.set(key, json.dumps({"host": "elsewhere", "pid": 7}), px=60_000)
        control.publish_status({"phase": "running", "step": 999, "updates": 999})
        _, err = first.communicate(timeout=60)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
            first.communicate()
    assert "lease went to another learner" in err, err[-3000:]
    st = RunControl(client, redis_prefix, "one").read_status()
    assert (st.phase, st.step) == ("running", 999), err[-3000:]
