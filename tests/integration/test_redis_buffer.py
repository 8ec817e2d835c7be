"""The Redis replay service beyond the conformance suite: several producer processes, a Redis
restart in the middle of a producer's stream (a redis-server of the test's own), dropped
connections, the producer spool, restarted learners, corrupt records, isolated runs."""

from __future__ import annotations

import json
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from buffer.base import SampleTimeout, Sampling
from buffer.metrics import BufferMetrics
from buffer.record_codec import encode
from buffer.records import RecordError
from buffer.redis_ring import RedisRing
from reval.redis import ring_keys
from tests.conftest import make_traj

ROOT = Path(__file__).resolve().parents[2]


def _producer(url: str, prefix: str, tag: str, **kw: object) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "tests.integration.redis_producer", "--url", url]
    cmd += ["--prefix", prefix, "--tag", tag]
    for k, v in kw.items():
        cmd += [f"--{k.replace('_', '-')}", str(v)]
    return subprocess.Popen(
        cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class OwnRedis:
    """A redis-server of the test's own (AOF everysec, as deploy/redis.conf) that it can stop,
    kill and restart on the same port and data directory."""

    def __init__(self, tmp: Path) -> None:
        self.port = _free_port()
        self.dir = tmp
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen[bytes] | None = None
        self.extra: list[str] = []
        """More redis-server arguments (``--enable-protected-configs yes``: CONFIG SET dir)."""

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [
                "redis-server",
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--dir",
                str(self.dir),
                "--appendonly",
                "yes",
                "--appendfsync",
                "everysec",
                "--save",
                "",
                *self.extra,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while True:
            try:
                redis.Redis(port=self.port, socket_connect_timeout=0.2).ping()
                return
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """SIGTERM: a clean shutdown (AOF fsynced). SIGKILL: a crash."""
        assert self.proc is not None
        self.proc.send_signal(sig)
        self.proc.wait(timeout=10)
        self.proc = None


@pytest.fixture
def own_redis(tmp_path: Path):
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed: cannot start a Redis of the test's own")
    server = OwnRedis(tmp_path)
    server.start()
    yield server
    if server.proc is not None:
        server.stop(signal.SIGKILL)


def test_producer_processes_and_a_consumer_lose_and_duplicate_nothing(redis_url, redis_prefix):
    procs = [_producer(redis_url, redis_prefix, f"p{k}", count=400, batch=8) for k in range(4)]
    learner = RedisRing("mp", 100_000, url=redis_url, key_prefix=redis_prefix, seed=0)
    sampled = 0
    while any(p.poll() is None for p in procs):
        if len(learner) >= 32:
            batch = learner.sample(32)
            assert len(set(batch.traj_ids)) == 32
            sampled += 32
    for p in procs:
        _out, err = p.communicate(timeout=60)
        assert p.returncode == 0, err
    ids = [t.traj_id for t in learner.items()]
    assert len(ids) == len(set(ids)) == 1600
    for k in range(4):  # each producer's records in its own order
        mine = [i for i in ids if i.startswith(f"p{k}-")]
        assert mine == sorted(mine) and len(mine) == 400
    s = learner.stats()
    assert s.inserted == 1600 and s.sampled == sampled
    assert sum(t.use_count for t in learner.items()) == sampled


def test_redis_restart_mid_stream_loses_nothing(own_redis):
    """A clean Redis restart (SIGTERM, AOF everysec) while a producer streams and the learner
    waits: the producer spools and flushes, the learner's sample retries; every record lands
    exactly once, in order."""
    prefix = "reval-test:restart:"
    p = _producer(own_redis.url, prefix, "r", count=1500, batch=10, sleep=0.004)
    learner = RedisRing("mp", 100_000, url=own_redis.url, key_prefix=prefix, retry_s=30)
    while len(learner) < 300:
        time.sleep(0.02)
    own_redis.stop(signal.SIGTERM)
    got: dict[str, object] = {}

    def sample_while_down() -> None:
        try:
            got["batch"] = learner.sample(16, timeout=20)
        except Exception as err:  # pragma: no cover - asserted below
            got["error"] = err

    waiter = threading.Thread(target=sample_while_down)
    waiter.start()
    time.sleep(1.5)  # the producer keeps generating into its spool
    own_redis.start()
    out, err = p.communicate(timeout=120)
    waiter.join(timeout=30)
    assert p.returncode == 0, err
    report = json.loads(out.strip().splitlines()[-1])
    assert report["max_spooled"] > 0 and report["left"] == 0 and report["dropped"] == 0
    assert report["errors"] > 0
    assert "Redis is away or refuses writes" in err  # a clear log line
    assert "error" not in got and len(got["batch"]) == 16  # type: ignore[arg-type]
    ids = [t.traj_id for t in learner.items()]
    assert ids == [f"r-{i:06d}" for i in range(1500)]
    assert learner.stats().sampled == 16


def test_redis_crash_keeps_the_ring_consistent(own_redis):
    """SIGKILL (a crash): with AOF everysec up to about a second of writes may be lost, but the
    ring stays consistent (counters match what is held, no duplicates) and the producer goes on."""
    prefix = "reval-test:crash:"
    p = _producer(own_redis.url, prefix, "c", count=1000, batch=10, sleep=0.004)
    ring = RedisRing("mp", 100_000, url=own_redis.url, key_prefix=prefix, retry_s=30)
    while len(ring) < 300:
        time.sleep(0.02)
    own_redis.stop(signal.SIGKILL)
    time.sleep(0.5)
    own_redis.start()
    _out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    ids = [t.traj_id for t in ring.items()]
    assert len(ids) == len(set(ids)) and ids == sorted(ids)
    s = ring.stats()
    stored = sum(ring.client.hlen(k) for k in ring.client.scan_iter(match=ring.keys.rec + "*"))
    assert s.size == len(ids) == stored
    assert len(ids) >= 1000 - 400  # at most ~1 s of a 250 records/s stream lost
    assert ids[-1] == "c-000999"  # everything after the crash landed


def test_dropped_connection_is_retried(own_redis):
    ring = RedisRing("drop", 100, url=own_redis.url, key_prefix="t:")
    ring.insert([make_traj(i) for i in range(4)])
    admin = redis.Redis(port=own_redis.port)
    killed = admin.client_kill_filter(_type="normal", skipme=True)
    assert killed >= 1
    ring.insert([make_traj(i) for i in range(4, 8)])
    assert len(ring.sample(8)) == 8
    assert [t.traj_id for t in ring.items()] == [f"t{i}" for i in range(8)]


def test_spool_is_bounded_and_flushes_in_order(own_redis, caplog):
    m = BufferMetrics()
    size = len(encode(make_traj(0)))
    ring = RedisRing(
        "spool", 1000, url=own_redis.url, key_prefix="t:", metrics=m, spool_max_bytes=25 * size
    )
    ring.client.connection_pool.connection_kwargs["socket_timeout"] = 1.0
    own_redis.stop()
    t0 = time.perf_counter()
    for k in range(6):  # 60 records, room for 25: the oldest batches are dropped
        assert ring.insert([make_traj(10 * k + i) for i in range(10)]) == 0
    assert time.perf_counter() - t0 < 10  # producers are not blocked by a dead Redis
    assert ring.spooled <= 30
    assert ring.spool_dropped == 60 - ring.spooled
    drops = [r for r in caplog.records if "spool full" in r.getMessage()]
    assert len(drops) <= 1  # several drops in a minute: one line at most (one a minute, counted)
    assert m.registry.get_sample_value("reval_buffer_spool_dropped_total") == ring.spool_dropped
    assert m.registry.get_sample_value("reval_buffer_spool_records") == ring.spooled
    assert m.registry.get_sample_value("reval_buffer_backend_errors_total") >= 6
    own_redis.start()
    ring.flush(retry_s=10)
    assert ring.spooled == 0
    ids = [int(t.traj_id[1:]) for t in ring.items()]
    assert ids == list(range(60 - len(ids), 60))  # the newest, in order
    assert m.registry.get_sample_value("reval_buffer_spool_records") == 0


def test_a_producer_may_start_before_redis(own_redis):
    own_redis.stop()
    ring = RedisRing("early", 10, url=own_redis.url, key_prefix="t:", open_retry_s=0.2)
    ring.client.connection_pool.connection_kwargs["socket_timeout"] = 1.0
    ring.insert([make_traj(0)])
    assert ring.spooled == 1
    own_redis.start()
    ring.flush(retry_s=10)
    assert [t.traj_id for t in ring.items()] == ["t0"]


def test_a_restarted_learner_finds_the_buffer_intact(redis_url, redis_prefix):
    kw = {
        "url": redis_url,
        "key_prefix": redis_prefix,
        "sampling": Sampling(samples_per_insert=2.0),
    }
    first = RedisRing("run", 8, seed=1, **kw)
    first.insert([make_traj(i, version=i) for i in range(10)])
    first.sample(8)
    first.set_policy_version(12)
    before = first.stats()
    first.client.close()
    del first
    again = RedisRing("run", 8, seed=2, **kw)  # a new process would do exactly this
    assert again.stats() == before
    assert [t.traj_id for t in again.items()] == [f"t{i}" for i in range(2, 10)]
    assert sum(t.use_count for t in again.items()) == 8
    again.sample(8)
    assert again.stats().sampled == 16
    with pytest.raises(SampleTimeout, match="rate limited"):  # 24 > 2 x 10: the limiter persists
        again.sample(8)


def test_runs_are_isolated_and_capacity_is_per_run(redis_url, redis_prefix):
    kw = {"url": redis_url, "key_prefix": redis_prefix}
    a = RedisRing("a", 4, **kw)
    b = RedisRing("b", 9, **kw)
    a.insert([make_traj(i) for i in range(6)])
    b.insert([make_traj(i) for i in range(6)])
    assert (len(a), len(b)) == (4, 6)
    with pytest.raises(ValueError, match="capacity 4 but the client asks for 9"):
        RedisRing("a", 9, **kw)
    c = RedisRing("a", 9, reset=True, **kw)  # a new run under the same id, new M
    assert len(c) == 0 and c.stats().capacity == 9
    c.insert([make_traj(i) for i in range(12)])
    assert [t.traj_id for t in c.items()] == [f"t{i}" for i in range(3, 12)]
    assert len(b) == 6
    with pytest.raises(ValueError, match="run id"):
        ring_keys("p:", "bad:run")


def test_a_corrupt_record_in_redis_is_quarantined_and_counted(redis_url, redis_prefix):
    m = BufferMetrics()
    ring = RedisRing("c", 6, url=redis_url, key_prefix=redis_prefix, metrics=m, seed=4)
    ring.insert([make_traj(i) for i in range(6)])
    # One chunk (positions 0..5, key r:0); t2 is at offset 2.
    assert ring.client.hexists(ring.keys.rec + "0", "2")
    ring.client.hset(ring.keys.rec + "0", "2", b"\x93not a record")
    batch = ring.sample(5)
    assert len(batch) == 5 and "t2" not in batch.traj_ids
    assert ring.stats().rejected == 1
    assert m.registry.get_sample_value("reval_buffer_rejected_total") == 1
    assert "t2" not in [t.traj_id for t in ring.items()]
    with pytest.raises(SampleTimeout):
        ring.sample(6)  # only 5 usable remain


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(junk=st.lists(st.binary(max_size=300), min_size=1, max_size=8), good=st.integers(0, 4))
def test_encoded_records_from_outside_are_checked(redis_url, redis_prefix, junk, good):
    ring = RedisRing("enc", 1000, url=redis_url, key_prefix=redis_prefix, reset=True)
    blobs = [encode(make_traj(i)) for i in range(good)] + junk
    inserted, rejected = ring.insert_encoded(blobs)
    assert inserted + rejected == len(blobs)
    assert inserted >= good and len(ring) == inserted
    assert ring.stats().rejected == rejected


def test_bad_record_message_names_it(redis_url, redis_prefix):
    ring = RedisRing("bad", 10, url=redis_url, key_prefix=redis_prefix)
    t = make_traj(3)
    t.response_ids = t.response_ids[:-1]
    with pytest.raises(RecordError, match=r"record 0 \('t3'\).*log-probs"):
        ring.insert([t])
    assert len(ring) == 0


def test_keys_live_under_the_prefix_only(redis_url, redis_prefix):
    buf = RedisRing("k", 10, url=redis_url, key_prefix=redis_prefix,
                    sampling=Sampling(prioritized=True))  # fmt: skip
    buf.insert([make_traj(0)])
    keys = {k.decode() for k in buf.client.scan_iter(match=redis_prefix + "*")}
    k = ring_keys(redis_prefix, "k")
    assert keys == {k.meta, k.dig, k.tree, k.ver, k.use, k.chunks, k.rec + "0"}
    buf.sample(1)
    buf.write_back(buf.items())
    for i in range(1, 13, 3):  # chunks at positions 1, 4, 7, 10; 0..2 evicted (M = 10)
        buf.insert([make_traj(j) for j in range(i, i + 3)])
    keys = {k.decode() for k in buf.client.scan_iter(match=redis_prefix + "*")}
    assert keys == {*k.stored, *(k.rec + str(b) for b in (1, 4, 7, 10))}
    buf.reset()
    assert {k.decode() for k in buf.client.scan_iter(match=redis_prefix + "*")} == {k.meta}


def test_the_deploy_redis_config_runs_with_aof_everysec(tmp_path):
    """deploy/redis.conf as compose mounts it and starts it (with --requirepass; only the data
    dir and port moved here): clients without the password are refused."""
    import yaml

    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    mounts = compose["services"]["redis"]["volumes"]
    assert "./deploy/redis.conf:/usr/local/etc/redis/redis.conf:ro" in mounts
    port = _free_port()
    conf = (ROOT / "deploy" / "redis.conf").read_text().replace("dir /data", f"dir {tmp_path}")
    conf = conf.replace("port 6379", f"port {port}").replace("bind 0.0.0.0", "bind 127.0.0.1")
    (tmp_path / "redis.conf").write_text(conf)
    proc = subprocess.Popen(
        ["redis-server", str(tmp_path / "redis.conf"), "--requirepass", "pw-of-the-test"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        client = redis.Redis(port=port, socket_connect_timeout=0.2, password="pw-of-the-test")
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                assert proc.poll() is None, proc.communicate()[0]
                assert time.monotonic() < deadline
                time.sleep(0.05)
        assert client.config_get("appendonly") == {"appendonly": "yes"}
        assert client.config_get("appendfsync") == {"appendfsync": "everysec"}
        assert client.config_get("maxmemory-policy") == {"maxmemory-policy": "noeviction"}
        assert client.config_get("protected-mode") == {"protected-mode": "yes"}
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=port).ping()
        url = f"redis://:pw-of-the-test@127.0.0.1:{port}/0"
        ring = RedisRing("conf", 10, url=url, key_prefix="t:")
        ring.insert([make_traj(0)])
        assert len(ring.sample(1)) == 1
    finally:
        proc.kill()
        proc.wait(timeout=10)


def test_background_sender_keeps_order_and_survives_an_outage(own_redis):
    m = BufferMetrics()
    ring = RedisRing("bg", 10_000, url=own_redis.url, key_prefix="t:", background=True, metrics=m)
    ring.client.connection_pool.connection_kwargs["socket_timeout"] = 1.0
    for k in range(10):
        assert ring.insert([make_traj(10 * k + i) for i in range(10)]) == 0
    assert ring.wait_sent(timeout=10)
    own_redis.stop()
    for k in range(10, 20):  # never blocks: the sender retries in the background
        ring.insert([make_traj(10 * k + i) for i in range(10)])
    own_redis.start()
    assert ring.wait_sent(timeout=30)
    ids = [int(t.traj_id[1:]) for t in ring.items()]
    assert ids == list(range(200))
    assert m.registry.get_sample_value("reval_buffer_inserts_total") == 200
    ring.close()


def _stage_and_chunk_keys(ring: RedisRing) -> tuple[set[str], set[str]]:
    stages = {k.decode() for k in ring.client.scan_iter(match=ring.keys.stage + "*")}
    chunks = {k.decode() for k in ring.client.scan_iter(match=ring.keys.rec + "*")}
    return stages, chunks


def test_chunks_of_any_size_are_evicted_whole_and_nothing_lingers(redis_url, redis_prefix):
    ring = RedisRing("mix", 8, url=redis_url, key_prefix=redis_prefix, seed=3)
    sizes = [3, 7, 1, 5, 2, 9, 4, 1, 1, 6]  # 9 > M: a batch that evicts some of its own
    n = 0
    for size in sizes:
        ring.insert([make_traj(n + i) for i in range(size)])
        n += size
        held = [t.traj_id for t in ring.items()]
        assert held == [f"t{i}" for i in range(max(0, n - 8), n)]
        tail = n - len(held)
        starts = [int(k.rsplit(":", 1)[1]) for k in _stage_and_chunk_keys(ring)[1]]
        ends = {int(e): int(s) for e, s in ring.client.zrange(ring.keys.chunks, 0, -1,
                                                              withscores=True)}  # fmt: skip
        assert sorted(starts) == sorted(ends.values())
        assert all(end > tail for end in ends)  # every chunk still holds a held record
        assert _stage_and_chunk_keys(ring)[0] == set()
        got = ring.sample(min(len(held), 5))
        assert len(set(got.traj_ids)) == len(got) and set(got.traj_ids) <= set(held)


def test_a_failed_insert_leaves_no_stage_behind(redis_url, redis_prefix):
    kw = {"url": redis_url, "key_prefix": redis_prefix}
    old = RedisRing("stage", 4, **kw)
    old.insert([make_traj(0)])
    RedisRing("stage", 9, reset=True, **kw)  # the run starts over with another M
    with pytest.raises(ValueError, match="capacity 9 but the client asks for 4"):
        old.insert([make_traj(1)])
    assert _stage_and_chunk_keys(old) == (set(), set())


def test_samples_racing_evictions_hand_out_only_held_records(redis_url, redis_prefix):
    """A small ring under a fast producer: positions drawn by a sample are often evicted before
    the sample reads them; they are drawn again, and `sampled` counts only what was handed out."""
    kw = {"url": redis_url, "key_prefix": redis_prefix, "seed": 5}
    producer = RedisRing("race", 40, **kw)
    learner = RedisRing("race", 40, **kw)
    stop = threading.Event()
    errors: list[BaseException] = []

    def produce() -> None:
        i = 0
        try:
            while not stop.is_set():
                producer.insert([make_traj(i + j) for j in range(7)])
                i += 7
        except BaseException as err:  # pragma: no cover - reported below
            errors.append(err)

    producer.insert([make_traj(10_000 + j) for j in range(40)])
    thread = threading.Thread(target=produce)
    thread.start()
    handed = 0
    try:
        for _ in range(150):
            batch = learner.sample(16, timeout=5)
            assert len(set(batch.traj_ids)) == 16
            assert all(t.use_count >= 1 for t in batch)
            handed += 16
    finally:
        stop.set()
        thread.join()
    assert not errors
    assert learner.stats().sampled == handed
    assert sum(t.use_count for t in learner.items()) <= handed


def test_a_learner_follows_a_reset_made_by_another_client(redis_url, redis_prefix):
    kw = {"url": redis_url, "key_prefix": redis_prefix, "seed": 2}
    learner = RedisRing("rs", 8, **kw)
    learner.insert([make_traj(i) for i in range(8)])
    learner.sample(4)
    other = RedisRing("rs", 8, reset=True, **kw)  # the run starts over (positions from 0)
    other.insert([make_traj(100 + i) for i in range(3)])
    batch = learner.sample(3, timeout=5)
    assert sorted(batch.traj_ids) == ["t100", "t101", "t102"]
    assert learner.stats().sampled == 3
    assert learner.write_back([make_traj(0)]) == 0  # t0's old position means nothing now


def test_a_worker_and_the_learner_each_hold_one_half(redis_url, redis_prefix):
    """The producer and the consumer are separate objects over their own layouts (two processes
    in a run): each is only the half of the protocol its caller needs, and they meet in Redis."""
    from buffer.base import ReplayBuffer, ReplayConsumer, ReplayProducer
    from buffer.redis_consumer import RedisConsumer
    from buffer.redis_layout import RingLayout
    from buffer.redis_producer import RedisProducer

    kw = {"url": redis_url, "key_prefix": redis_prefix}
    producer = RedisProducer(RingLayout("halves", 16, **kw))
    consumer = RedisConsumer(RingLayout("halves", 16, **kw), seed=1)
    assert isinstance(producer, ReplayProducer) and not isinstance(producer, ReplayConsumer)
    assert isinstance(consumer, ReplayConsumer) and not isinstance(consumer, ReplayProducer)
    assert not isinstance(consumer, ReplayBuffer)
    producer.insert([make_traj(i) for i in range(6)])
    batch = consumer.take(4, oldest_first=True)
    assert batch.traj_ids == ["t0", "t1", "t2", "t3"]
    assert consumer.quarantine(batch.traj_ids[:2], "test") == 2
    assert producer.stats().rejected == 2  # the worker's pacing reads the same counters
    assert [t.traj_id for t in consumer.items()] == ["t2", "t3", "t4", "t5"]
    producer.close()
    consumer.close()


def test_a_prioritized_service_run_samples_what_its_workers_insert(redis_url, redis_prefix):
    """``buffer.prioritized`` in the service: the worker's producer (``make_producer``) and the
    learner's consumer (``make_consumer``) are built apart from one config; the producer gave
    new records no priority (it was built without the flag), so the learner never got a batch:
    "fewer than 8 trajectories with a priority" (found in review; ``reval train`` was fine: its
    one ring holds both halves)."""
    from buffer import make_consumer, make_producer
    from reval.config import load_config

    cfg = load_config(overrides=["buffer.backend=redis", "buffer.prioritized=true",
                                 f"redis.url={redis_url}", f"redis.prefix={redis_prefix}",
                                 "buffer.capacity=64", "learner.batch_size=8"],
                      environ={})  # fmt: skip
    consumer = make_consumer(cfg.buffer, "prio", reset=True, redis=cfg.redis)
    producer = make_producer(cfg.buffer, "prio", cfg.redis)
    try:
        producer.insert([make_traj(i) for i in range(16)])
        batch = consumer.sample(8, timeout=5)
        assert len(batch.trajectories) == 8 and len(set(batch.traj_ids)) == 8
        assert batch.weights is not None and (batch.weights > 0).all()
    finally:
        producer.close()
        consumer.close()
