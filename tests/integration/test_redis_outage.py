"""Redis faults that every process waits out instead of dying (issue 38): Redis away, Redis
refusing writes (OOM, READONLY, NOREPLICAS: what MISCONF's full disk looks like to a client), a
corrupt ring that stops each process with one line and keeps a worker's pending batch in its
spool, a taken metrics port. Each against a redis-server of the test's own that it stops, starts
and reconfigures (the shared one is never touched)."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import msgpack
import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from buffer import make_consumer, make_producer
from buffer.redis_ring import RedisRing, RingCorrupt
from reval.config import build_config
from reval.ops_http import OpsServer, PortTaken
from reval.retry import wait_fault
from tests.conftest import make_traj
from tests.integration.test_redis_buffer import OwnRedis, _free_port
from tests.integration.test_rollout_worker import cli_args, publish, spawn, worker_cfg

PREFIX = "reval-test:outage:"


def _cfg(tmp_path: Path, url: str, outage_s: float, **buffer: object):
    """A run whose old budget (``buffer.sample_timeout_s``, 1 s) is far shorter than its
    outage budget (``redis.outage_s``): the code before issue 38 gave up after the first."""
    return build_config(
        {
            "name": "out",
            "output_dir": str(tmp_path),
            "buffer": {"backend": "redis", "capacity": 100_000, "sample_timeout_s": 1, **buffer},
            "redis": {"url": url, "prefix": PREFIX, "outage_s": outage_s},
            "metrics": {"progress": False, "plot": False},
        }
    )


@pytest.fixture
def own_redis(tmp_path: Path):
    """A redis-server of the test's own (``OwnRedis``), killed afterwards."""
    if shutil.which("redis-server") is None:
        if os.environ.get("REVAL_REQUIRE_REDIS") == "1":  # (make test: a missing one fails)
            pytest.fail("redis-server is not installed and REVAL_REQUIRE_REDIS=1")
        pytest.skip("redis-server is not installed: cannot start a Redis of the test's own")
    (tmp_path / "redis").mkdir()
    server = OwnRedis(tmp_path / "redis")
    server.extra = ["--enable-protected-configs", "yes"]  # (``_refuse_writes``' MISCONF)
    server.start()
    yield server
    if server.proc is not None:
        server.stop(signal.SIGKILL)


@pytest.fixture
def own_signals():
    """The learner's ``main`` forwards signals to its ranks: this process's handlers come back."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)}
    yield
    for s, h in saved.items():
        signal.signal(s, h)


def _refuse_writes(server: OwnRedis, how: str = "oom") -> None:
    """Redis answers, reads included, but refuses every write: ``oom`` (out of memory) or
    ``misconf`` (it cannot persist: its snapshot failed, as on a full disk)."""
    admin = redis.Redis(port=server.port)
    if how == "oom":
        admin.config_set("maxmemory-policy", "noeviction")
        admin.config_set("maxmemory", 1)
        return
    admin.config_set("save", "3600 1")
    admin.config_set("dir", "/proc")  # (no file can be made there: the snapshot fails)
    _snapshot(admin, "err")


def _snapshot(admin: redis.Redis, status: str) -> None:
    """BGSAVE and wait until its status is ``status``."""
    admin.bgsave()
    deadline = time.monotonic() + 10
    while admin.info("persistence")["rdb_last_bgsave_status"] != status:
        assert time.monotonic() < deadline
        time.sleep(0.05)


def _take_writes(server: OwnRedis, how: str = "oom") -> None:
    admin = redis.Redis(port=server.port)
    if how == "oom":
        admin.config_set("maxmemory", 0)
        return
    admin.config_set("dir", str(server.dir))
    while admin.info("persistence")["rdb_bgsave_in_progress"]:
        time.sleep(0.05)
    _snapshot(admin, "ok")
    admin.config_set("save", "")


def test_wait_faults_are_told_from_answers(own_redis):
    """Away, loading, OOM, READONLY, NOREPLICAS are waits; a wrong type is an answer."""
    once = Retry(NoBackoff(), 0)  # (redis-py's own retries would only slow the test)
    r = redis.Redis(port=own_redis.port, retry=once)
    r.set("s", "x")
    for how in ("oom", "misconf"):
        _refuse_writes(own_redis, how)
        with pytest.raises(redis.ResponseError) as err:
            r.set("a", 1)
        assert wait_fault(err.value), err.value
        assert r.get("s") == b"x"  # (reads go through)
        _take_writes(own_redis, how)
        assert r.set("a", 1)
    r.replicaof("127.0.0.1", _free_port())  # a replica of a dead primary: READONLY
    with pytest.raises(redis.ResponseError) as err:
        r.set("a", 1)
    assert wait_fault(err.value)
    r.replicaof("NO", "ONE")
    r.config_set("min-replicas-to-write", 1)
    with pytest.raises(redis.ResponseError, match="NOREPLICAS") as err:
        r.set("a", 1)
    assert wait_fault(err.value)
    r.config_set("min-replicas-to-write", 0)
    with pytest.raises(redis.ResponseError, match="WRONGTYPE") as err:
        r.hget("s", "f")
    assert not wait_fault(err.value)
    for text in (
        "MISCONF Errors writing to the AOF file: No space left on device",
        "LOADING Redis is loading the dataset in memory",
        "BUSY Redis is busy",
    ):
        assert wait_fault(redis.ResponseError(text)), text
    for text in ("BUSYGROUP Consumer Group name already exists", "ERR unknown command"):
        assert not wait_fault(redis.ResponseError(text)), text
    r.config_set("requirepass", "right")
    with pytest.raises(redis.AuthenticationError) as err:  # (a ConnectionError to redis-py)
        redis.Redis(port=own_redis.port, password="wrong", retry=once).ping()
    assert not wait_fault(err.value)  # a wrong password is said at once, not waited on
    own_redis.stop()
    with pytest.raises(redis.ConnectionError) as err:
        r.ping()
    assert wait_fault(err.value)


def _ride_out(
    own_redis: OwnRedis, tmp_path: Path, down_s: float, refuse_s: float, caplog, how: str
) -> None:
    """A producer (a worker's, ``make_producer``) inserting every 20 ms and a consumer (the
    learner's, ``make_consumer``) publishing its policy version and writing back through Redis
    down for ``down_s``, then refusing writes for ``refuse_s``: neither raises, and every
    record inserted is in the ring once, in order."""
    cfg = _cfg(tmp_path, own_redis.url, outage_s=down_s + refuse_s + 60)
    producer = make_producer(cfg.buffer, cfg.name, cfg.redis, spool_dir=cfg.paths.spool)
    consumer = make_consumer(cfg.buffer, cfg.name, redis=cfg.redis, seed=0)
    for pool in (producer.client.connection_pool, consumer.client.connection_pool):
        pool.connection_kwargs["socket_timeout"] = 2.0  # (a dead server fails fast)
    stop = threading.Event()
    sent: list[str] = []
    most = [0]  # (the most records spooled at once)
    errors: list[BaseException] = []

    def produce() -> None:
        i = 0
        try:
            while not stop.is_set():
                batch = [make_traj(i + k) for k in range(4)]
                for k, t in enumerate(batch):
                    t.traj_id = f"o-{i + k:07d}"
                producer.insert(batch)
                sent.extend(t.traj_id for t in batch)
                most[0] = max(most[0], producer.spooled)
                i += 4
                time.sleep(0.02)
        except BaseException as err:  # asserted below (before: OOM raised from insert)
            errors.append(err)

    thread = threading.Thread(target=produce)
    thread.start()
    while len(consumer) < 40:
        time.sleep(0.02)
    held = consumer.sample(8, timeout=5)
    caplog.clear()
    own_redis.stop(signal.SIGTERM)
    learner: dict[str, float] = {}

    def learn() -> None:  # the learner's calls of an update, made while Redis is away
        t0 = time.monotonic()
        try:
            consumer.set_policy_version(1)
            consumer.write_back(held.trajectories)
            consumer.set_policy_version(2)
        except BaseException as err:  # asserted below (before: BufferUnavailable after 1 s)
            errors.append(err)
        learner["waited_s"] = time.monotonic() - t0

    waiter = threading.Thread(target=learn)
    waiter.start()
    time.sleep(down_s)
    own_redis.start()
    _refuse_writes(own_redis, how)
    time.sleep(refuse_s)
    _take_writes(own_redis, how)
    waiter.join(timeout=refuse_s + 120)
    deadline = time.monotonic() + 60
    while producer.spooled and time.monotonic() < deadline:
        time.sleep(0.05)  # (the next insert sends the spool first)
    stop.set()
    thread.join(timeout=60)
    producer.close(flush_s=30)
    assert not errors, errors
    assert learner["waited_s"] >= down_s  # it waited, it did not give up
    assert producer.spooled == 0 and producer.spool_dropped == 0
    ids = [t.traj_id for t in consumer.items()]
    assert ids == sent, (len(ids), len(sent))  # every record once, in order: none lost
    assert consumer.stats().policy_version == 2
    assert not list(cfg.paths.spool.glob("*.spool")) if cfg.paths.spool.is_dir() else True
    waits = [r for r in caplog.records if "Redis is away or refuses writes" in r.getMessage()]
    backs = [r for r in caplog.records if "Redis answers again" in r.getMessage()]
    # One line when a wait starts and one when Redis is back (Redis away, then refusing
    # writes, may be one wait or two), at most one more a minute while it lasts.
    assert 1 <= len(waits) <= 2 + (down_s + refuse_s) / 60 * 2, [r.getMessage() for r in waits]
    assert 1 <= len(backs) <= 2, [r.getMessage() for r in backs]
    print(f"Redis down {down_s} s, then refusing writes {refuse_s} s: {len(ids)} of "
          f"{len(sent)} records inserted held once, in order (max spooled {most[0]}); the "
          f"learner's calls waited {learner['waited_s']:.1f} s; {len(waits)} wait and "
          f"{len(backs)} back lines")  # fmt: skip
    consumer.close()


def test_a_producer_and_the_learners_calls_ride_out_redis_down_then_misconf(
    own_redis, tmp_path, caplog
):
    """Down 4 s, then MISCONF 4 s (it cannot persist, as on a full disk): longer than the 1 s
    budget the code before gave the learner's calls (``buffer.sample_timeout_s``), inside
    ``redis.outage_s``."""
    caplog.set_level(logging.INFO)
    _ride_out(own_redis, tmp_path, down_s=4, refuse_s=4, caplog=caplog, how="misconf")


@pytest.mark.slow  # (7 min: Redis down 5 min, then refusing writes 2 min)
def test_redis_down_5_min_and_refusing_writes_2_min_cost_no_record(own_redis, tmp_path, caplog):
    caplog.set_level(logging.INFO)
    _ride_out(own_redis, tmp_path, down_s=300, refuse_s=120, caplog=caplog, how="misconf")


# -- a corrupt ring -----------------------------------------------------------------------------


def test_a_capacity_damaged_under_an_open_ring_is_corrupt(redis_url, redis_prefix):
    ring = RedisRing("cap", 8, url=redis_url, key_prefix=redis_prefix)
    ring.insert([make_traj(i) for i in range(4)])
    ring.client.hset(ring.keys.meta, "capacity", 7)
    with pytest.raises(RingCorrupt, match="corrupt \\(meta capacity=7") as err:
        ring.insert([make_traj(9)])
    assert "redis-cli --scan --pattern" in str(err.value)  # the repair
    # A client that never had the ring open cannot tell: it names both.
    with pytest.raises(ValueError, match=r"capacity 7 but the client asks for 8.*corrupt"):
        RedisRing("cap", 8, url=redis_url, key_prefix=redis_prefix)
    ring.client.hset(ring.keys.meta, "capacity", 8)
    ring.close()


def _spooled(directory: Path) -> list[str]:
    """The trajectory ids kept in a spool directory's files."""
    return [i for f in sorted(directory.glob("*.spool"))
            for i in msgpack.unpackb(f.read_bytes())["ids"]]  # fmt: skip


def test_a_corrupt_ring_stops_a_worker_with_one_line_and_its_batch_in_the_spool(
    own_redis, tmp_path
):
    """``meta capacity=7`` under a running worker: it exits non-zero with one line naming the
    damage and the repair, no traceback; what of the batch it was pushing had not reached the ring
    is in the run's ``spool/``, and a worker started after the repair sends it."""
    server = own_redis
    cfg = worker_cfg(tmp_path, server.url, PREFIX)
    publish(cfg, 0)
    p = spawn(cli_args(tmp_path, server.url, PREFIX), "--worker-id", "wc")
    ring = RedisRing(cfg.name, cfg.buffer.capacity, url=server.url, key_prefix=PREFIX)
    deadline = time.monotonic() + 120
    while len(ring) < 40:
        assert p.poll() is None, p.communicate()[1][-3000:]
        assert time.monotonic() < deadline
        time.sleep(0.05)
    ring.client.hset(ring.keys.meta, "capacity", 7)
    _out, err = p.communicate(timeout=120)
    assert p.returncode != 0
    assert "Traceback" not in err, err[-3000:]
    said = [line for line in err.splitlines() if "bookkeeping in Redis is corrupt" in line]
    assert len(said) == 1, err[-3000:]
    assert said[0].startswith("reval rollout: ") and "meta capacity=7" in said[0]
    assert "redis-cli del" in said[0]  # the repair
    kept = _spooled(cfg.paths.spool)
    batch = cfg.rollout.worker_prompts * cfg.rollout.n
    # Groups are inserted one by one as they are graded, so the damage can land inside a batch:
    # the groups pushed before it are in the ring (``head``), the rest of the batch in hand is
    # kept, none lost in the shutdown's flush.
    inserted = int(ring.client.hget(ring.keys.meta, "head"))
    assert kept and len(kept) % cfg.rollout.n == 0
    assert (inserted + len(kept)) % batch == 0 and inserted >= batch, (inserted, len(kept))

    command = re.search(r"(redis-cli del .*; done)", said[0])
    assert command is not None
    cli = f"redis-cli -p {server.port}"
    subprocess.run(["bash", "-c", command.group(1).replace("redis-cli", cli)], check=True)
    p = spawn(cli_args(tmp_path, server.url, PREFIX), "--worker-id", "wd",
              "--max-batches", "1")  # fmt: skip
    _out, err = p.communicate(timeout=180)
    assert p.returncode == 0, err[-3000:]
    ring = RedisRing(cfg.name, cfg.buffer.capacity, url=server.url, key_prefix=PREFIX)
    ids = [t.traj_id for t in ring.items()]
    assert ids[: len(kept)] == kept  # sent first, in order
    assert len(ids) == len(kept) + batch
    assert _spooled(cfg.paths.spool) == []
    assert f"took back {len(kept)} records" in err


def test_a_producer_closed_while_redis_is_away_keeps_its_spool_for_the_next(own_redis, tmp_path):
    """What ``close`` cannot send goes to the spool directory (it was lost before: "closing
    with N records still spooled"); the next producer on it sends it first, once."""
    cfg = _cfg(tmp_path, own_redis.url, outage_s=60)
    first = make_producer(cfg.buffer, cfg.name, cfg.redis, spool_dir=cfg.paths.spool)
    first.insert([make_traj(i) for i in range(4)])
    own_redis.stop(signal.SIGTERM)
    for lo in (4, 8):  # (two chunks: kept and taken back in order)
        first.insert([make_traj(i) for i in range(lo, lo + 4)])
    assert first.spooled == 8
    first.close(flush_s=0.5)
    assert _spooled(cfg.paths.spool) == [f"t{i}" for i in range(4, 12)]
    own_redis.start()
    second = make_producer(cfg.buffer, cfg.name, cfg.redis, spool_dir=cfg.paths.spool)
    assert second.spooled == 8  # taken back (claimed: a third producer would not take them)
    assert make_producer(cfg.buffer, cfg.name, cfg.redis, spool_dir=cfg.paths.spool).spooled == 0
    second.insert([make_traj(12)])
    ring = RedisRing(cfg.name, cfg.buffer.capacity, url=own_redis.url, key_prefix=PREFIX)
    assert [t.traj_id for t in ring.items()] == [f"t{i}" for i in range(13)]
    assert not list(cfg.paths.spool.iterdir())  # sent: the files are gone
    second.close()
    ring.close()


# -- a taken port -------------------------------------------------------------------------------


def test_a_taken_port_is_one_line_naming_it(tmp_path, redis_url, redis_prefix):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        from prometheus_client import CollectorRegistry

        with pytest.raises(PortTaken) as err:
            OpsServer(port, CollectorRegistry(), "127.0.0.1")
        assert f"127.0.0.1:{port}" in str(err.value)
        assert "--set metrics.prometheus_port=" in str(err.value)
        cfg = worker_cfg(tmp_path, redis_url, redis_prefix)
        publish(cfg, 0)
        p = spawn(cli_args(tmp_path, redis_url, redis_prefix, "metrics.addr=127.0.0.1"),
                  "--metrics-port", str(port), "--max-batches", "1")  # fmt: skip
        _out, out_err = p.communicate(timeout=120)
    assert p.returncode in (1, 2)
    assert "Traceback" not in out_err, out_err[-3000:]
    said = [line for line in out_err.splitlines() if f":{port}" in line]
    assert len(said) == 1 and said[0].startswith("reval rollout: "), out_err[-3000:]
    assert "starting the hf engine" not in out_err  # said before the engine (minutes on a GPU)


def test_a_taken_port_stops_the_learner_before_its_ranks_start(
    tmp_path, redis_url, redis_prefix, own_signals
):
    from learner.ranks import main
    from tests.integration.test_chaos_faults import _config

    cfg = _config(tmp_path, redis_url, redis_prefix, max_steps=1)
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        cfg.metrics.prometheus_port, cfg.metrics.addr = port, "127.0.0.1"
        t0 = time.monotonic()
        with pytest.raises(PortTaken, match=f"127.0.0.1:{port} .*metrics.prometheus_port="):
            main(cfg, nproc=2)
    assert time.monotonic() - t0 < 5  # (before: the ranks started, then rank 0's traceback)


@pytest.mark.slow  # (10-32 s: a two-rank learner starts)
def test_a_corrupt_ring_stops_a_two_rank_learner_with_one_line(
    tmp_path, redis_url, redis_prefix, own_signals, capfd
):
    """``meta head=abc`` under a two-rank learner: rank 0 says it on one line, rank 1 (whose
    collective rank 0's exit breaks) and the parent say nothing more; no traceback; exit 1."""
    from learner.ranks import main
    from tests.integration.test_chaos_faults import _config, _good

    ring = RedisRing("chaos", 64, url=redis_url, key_prefix=redis_prefix)
    ring.insert([_good(i) for i in range(64)])

    def damage() -> None:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not ring.stats().taken:
            time.sleep(0.1)  # (the learner is updating)
        ring.client.hset(ring.keys.meta, "head", "abc")

    thread = threading.Thread(target=damage, daemon=True)
    thread.start()
    assert main(_config(tmp_path, redis_url, redis_prefix, max_steps=100_000), nproc=2) == 1
    err = capfd.readouterr().err
    said = [line for line in err.splitlines() if "bookkeeping in Redis is corrupt" in line]
    assert len(said) == 1 and said[0].startswith("reval learner: "), err[-3000:]
    assert "head=abc" in said[0] and "redis-cli del" in said[0]
    assert "Traceback" not in err and "onnection closed" not in err, err[-3000:]
    assert "learner ranks exited" not in err
    ring.client.hset(ring.keys.meta, "head", "64")
    ring.close()


# -- the processes: a learner and a worker ------------------------------------------------------


def _ride_out_processes(own_redis, tmp_path: Path, capfd, down_s: float, refuse_s: float) -> None:
    """A learner (``learner.ranks.main``, one rank) and a worker process (``reval rollout``)
    through Redis down for ``down_s``, then refusing writes for ``refuse_s``: both keep going
    (the learner steps on after it), and every record the worker pushed is in the ring. The old
    budget (``buffer.sample_timeout_s``, 1 s) is shorter than the outage; ``redis.outage_s``
    is longer."""
    from learner.ranks import main

    extra = ["buffer.sample_timeout_s=1", f"redis.outage_s={down_s + refuse_s + 120}"]
    learner_cfg = worker_cfg(
        tmp_path, own_redis.url, PREFIX, *extra, "learner.world_size=1",
        "learner.max_steps=1000000", "learner.lease_s=5", "sync.timeout_s=20",
        "learner.batch_size=16", "learner.micro_batch_size=16",
    )  # fmt: skip
    ring = RedisRing(learner_cfg.name, learner_cfg.buffer.capacity, url=own_redis.url,
                     key_prefix=PREFIX)  # fmt: skip
    got: dict[str, object] = {}

    def choreography() -> None:
        try:
            worker = spawn(cli_args(tmp_path, own_redis.url, PREFIX, *extra), "--worker-id", "wo")
            got["worker"] = worker
            deadline = time.monotonic() + 240
            while ring.stats().sampled < 64:  # (the learner updates on the worker's records)
                assert worker.poll() is None and time.monotonic() < deadline
                time.sleep(0.1)
            got["before"] = ring.stats().sampled
            own_redis.stop(signal.SIGTERM)
            time.sleep(down_s)
            own_redis.start()
            _refuse_writes(own_redis)
            time.sleep(refuse_s)
            _take_writes(own_redis)
            after = ring.stats().sampled
            deadline = time.monotonic() + 120
            while ring.stats().sampled < after + 64:  # the learner steps on
                assert worker.poll() is None and time.monotonic() < deadline
                time.sleep(0.1)
            worker.send_signal(signal.SIGTERM)
            got["worker_out"], got["worker_err"] = worker.communicate(timeout=120)
        except BaseException as err:
            got["error"] = err
        finally:
            os.kill(os.getpid(), signal.SIGTERM)  # (main forwards it: the learner stops)

    thread = threading.Thread(target=choreography, daemon=True)
    thread.start()
    code = main(learner_cfg, nproc=1)
    thread.join(timeout=180)
    err = capfd.readouterr().err
    assert "error" not in got, (got.get("error"), err[-3000:])
    assert code == 128 + signal.SIGTERM, err[-3000:]  # stopped by the test, not by the outage
    worker = got["worker"]
    assert worker.returncode == 0, got["worker_err"][-3000:]
    assert "Traceback" not in got["worker_err"] and "Traceback" not in err
    pushed = json.loads(got["worker_out"].strip().splitlines()[-1])["trajectories"]
    assert ring.stats().inserted == pushed  # every record the worker made arrived
    assert "Redis answers again" in got["worker_err"] and "Redis answers again" in err
    stats = ring.stats()
    print(f"Redis down {down_s} s, then refusing writes {refuse_s} s: the worker pushed "
          f"{pushed}, the ring took {stats.inserted} (0 lost); the learner sampled "
          f"{got['before']} before, {stats.sampled} by the end; exit codes: learner {code}, "
          f"worker {worker.returncode}")  # fmt: skip
    ring.close()


def test_a_learner_and_a_worker_ride_out_redis_down_then_refusing_writes(
    own_redis, tmp_path, own_signals, capfd
):
    _ride_out_processes(own_redis, tmp_path, capfd, down_s=4, refuse_s=4)


@pytest.mark.slow  # (8 min: Redis down 5 min, then refusing writes 2 min)
def test_a_learner_and_a_worker_ride_out_redis_down_5_min_and_refusing_writes_2_min(
    own_redis, tmp_path, own_signals, capfd
):
    _ride_out_processes(own_redis, tmp_path, capfd, down_s=300, refuse_s=120)
