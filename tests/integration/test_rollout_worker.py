"""Rollout workers against the real Redis: the shared prompt deal, the weights announcement, the
worker process (`reval rollout`) producing valid records, two workers sharing one epoch, SIGTERM
drain, a Redis restart mid-stream, waiting for the learner's weights."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections import Counter
from pathlib import Path

import pytest
import redis
import torch

from buffer.redis_ring import RedisRing
from reval import registry
from reval.config import load_config
from reval.policy import load_policy
from reval.registry import worker_key
from reval.weights.files import WeightStore
from rollout.dealer import PromptDealer
from rollout.tasks import Prompt
from rollout.worker import RolloutWorker
from tests.conftest import announce_weights
from tests.integration.test_redis_buffer import OwnRedis

ROOT = Path(__file__).resolve().parents[2]

WORKER = [
    "task.kind=addition",
    "rollout.n=4",
    "rollout.worker_prompts=10",
    "rollout.max_new_tokens=4",
    "rollout.heartbeat_s=0.5",
    "rollout.weights_poll_s=0.1",
    "buffer.backend=redis",
    "buffer.capacity=5000",
    "learner.batch_size=32",
    "metrics.progress=false",
    "buffer.generate_ahead=off",  # no learner here: the workers must not wait for one
]


def worker_cfg(tmp_path: Path, url: str, prefix: str, *extra: str):
    return load_config(
        overrides=[
            *WORKER,
            f"redis.url={url}",
            f"redis.prefix={prefix}",
            f"output_dir={tmp_path}",
            "name=w",
            *extra,
        ],
        environ={},
    )


def publish(cfg, version: int, perturb: float = 0.0, broadcast: str | None = None) -> None:
    """The learner's side: announce weights (built like the worker's, optionally perturbed)."""
    policy = load_policy(cfg.model, cfg.seed)
    if perturb:
        with torch.no_grad():
            for p in policy.model.parameters():
                p.add_(perturb * torch.randn_like(p))
    store = WeightStore(
        redis.Redis.from_url(cfg.redis.url),
        cfg.redis.prefix,
        cfg.name,
        cfg.sync.weights_dir or cfg.run_dir / "weights",
    )
    announce_weights(store, policy.model.named_parameters(), version, broadcast=broadcast)


def ring_of(cfg) -> RedisRing:
    return RedisRing(cfg.name, cfg.buffer.capacity, url=cfg.redis.url, key_prefix=cfg.redis.prefix)


def spawn(cfg_args: list[str], *args: str) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "services.cli", "rollout"]
    for a in cfg_args:
        cmd += ["--set", a]
    return subprocess.Popen(
        [*cmd, *args], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def cli_args(tmp_path: Path, url: str, prefix: str, *extra: str) -> list[str]:
    return [
        *WORKER,
        f"redis.url={url}",
        f"redis.prefix={prefix}",
        f"output_dir={tmp_path}",
        "name=w",
        *extra,
    ]


def summary(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


# -- the deal -----------------------------------------------------------------------------------


def test_dealers_share_an_epoch_without_duplicates_and_resume(redis_url, redis_prefix):
    client = redis.Redis.from_url(redis_url)
    prompts = [Prompt(f"p{i}", f"q{i}", "a") for i in range(50)]
    got: list[tuple[int, str]] = []
    lock = threading.Lock()

    def worker(k: int) -> None:
        dealer = PromptDealer(client, redis_prefix, "run", prompts, seed=3)
        for _ in range(5):
            batch = dealer.take(7)
            with lock:
                got.extend((e, p.id) for e, p in batch)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 105
    first = Counter(pid for e, pid in got if e == 0)
    assert len(first) == 50 and set(first.values()) == {1}  # epoch 0: each prompt exactly once
    second = [pid for e, pid in got if e == 1]
    assert len(second) == 50 and len(set(second)) == 50
    third = [pid for e, pid in got if e == 2]
    assert len(third) == 5 and len(set(third)) == 5
    # A restarted worker resumes the deal where the fleet stopped.
    again = PromptDealer(client, redis_prefix, "run", prompts, seed=3)
    assert again.position() == {"dealt": 105, "epoch": 2, "offset": 5, "prompts": 50}
    rest = [p.id for _, p in again.take(45)]
    assert set(rest) | set(third) == {p.id for p in prompts}
    # Another dataset gets its own deal.
    other = PromptDealer(client, redis_prefix, "run", prompts[:10], seed=3)
    assert other.position()["dealt"] == 0
    with pytest.raises(ValueError):
        PromptDealer(client, redis_prefix, "run", [], seed=3)


def test_weights_are_published_atomically_and_pruned(tmp_path, redis_url, redis_prefix):
    client = redis.Redis.from_url(redis_url)
    store = WeightStore(client, redis_prefix, "run", tmp_path / "w", keep=2)
    assert store.latest() is None
    for v in range(4):
        announce_weights(store, [("a", torch.full((3,), float(v))), ("b", torch.zeros(2))], v)
    ann = store.latest()
    assert ann is not None and ann.version == 3 and ann.file_version == 3 and ann.path
    tensors = dict(store.load(ann.path))
    assert torch.equal(tensors["a"], torch.full((3,), 3.0))
    assert sorted(p.name for p in (tmp_path / "w").iterdir()) == [
        "v00000002.safetensors",
        "v00000003.safetensors",
    ]


def test_tied_weights_publish(tmp_path, redis_url, redis_prefix):
    """One unsharded rank's state dict holds tied weights as one storage under two names."""
    client = redis.Redis.from_url(redis_url)
    store = WeightStore(client, redis_prefix, "run", tmp_path / "w")
    emb = torch.arange(6.0).reshape(2, 3)
    path = store.write([("embed.weight", emb), ("lm_head.weight", emb), ("b", torch.ones(1))], 1)
    got = dict(store.load(path))
    assert torch.equal(got["embed.weight"], emb) and torch.equal(got["lm_head.weight"], emb)


# -- the worker ----------------------------------------------------------------------------------


def test_worker_process_pushes_valid_records(tmp_path, redis_url, redis_prefix):
    cfg = worker_cfg(tmp_path, redis_url, redis_prefix)
    publish(cfg, 0)
    p = spawn(
        cli_args(tmp_path, redis_url, redis_prefix), "--max-batches", "2", "--worker-id", "w0"
    )
    out, err = p.communicate(timeout=180)
    assert p.returncode == 0, err
    s = summary(out)
    # (two lockstep batches of 10 prompts: 20 groups of 4 answers)
    assert s["batches"] == 20 and s["trajectories"] == 80 and s["versions"] == [0]
    items = ring_of(cfg).items()
    assert len(items) == 80
    for t in items:
        t.validate()
        assert t.worker_id == "w0" and t.run_id == "w" and t.policy_version == 0
        assert t.finish_reason in ("stop", "length") and t.reward_raw in (0.0, 1.0)
    groups = Counter(t.group_id for t in items)
    assert len(groups) == 20 and set(groups.values()) == {4}  # N answers per prompt
    # binary rewards with the default transform: reward == raw
    assert all(t.reward == t.reward_raw for t in items)
    client = redis.Redis.from_url(redis_url)
    assert client.get(worker_key(redis_prefix, "w", "w0")) is None  # deregistered


def test_two_worker_processes_share_one_epoch(tmp_path, redis_url, redis_prefix):
    cfg = worker_cfg(tmp_path, redis_url, redis_prefix)
    publish(cfg, 0)
    args = cli_args(tmp_path, redis_url, redis_prefix)
    procs = [spawn(args, "--max-batches", "5", "--worker-id", f"w{k}") for k in range(2)]
    for p in procs:
        _, err = p.communicate(timeout=240)
        assert p.returncode == 0, err
    items = ring_of(cfg).items()
    assert len(items) == 2 * 5 * 10 * 4
    per_prompt = Counter(t.prompt_id for t in items)
    assert len(per_prompt) == 100 and set(per_prompt.values()) == {4}  # one epoch, no dupes
    assert {t.worker_id for t in items} == {"w0", "w1"}


def test_worker_takes_new_weights_between_batches(tmp_path, redis_url, redis_prefix):
    cfg = worker_cfg(tmp_path, redis_url, redis_prefix, "rollout.worker_prompts=4")
    publish(cfg, 0)
    worker = RolloutWorker(cfg, "wv")
    done = threading.Event()

    def learner() -> None:
        while worker.stats.batches < 1 and not done.is_set():
            time.sleep(0.01)
        publish(cfg, 7, perturb=0.5)

    t = threading.Thread(target=learner)
    t.start()
    stats = worker.run(max_batches=6)
    done.set()
    t.join()
    assert list(stats.versions) == [0, 7]  # (one entry per version, in order)
    assert stats.weight_loads == 2  # v0 at start, v7 between batches
    versions = Counter(t.policy_version for t in ring_of(cfg).items())
    assert set(versions) == {0, 7}
    assert worker.metrics.registry.get_sample_value("reval_rollout_policy_version") == 7


def test_worker_on_cpu_reads_files_when_the_learner_broadcasts_over_nccl(
    tmp_path, redis_url, redis_prefix
):
    """A GPU learner's hub speaks NCCL; a CPU worker cannot join it and keeps to the files."""
    from reval.weights.collective import BroadcastHub

    cfg = worker_cfg(tmp_path, redis_url, redis_prefix, "rollout.worker_prompts=2")
    publish(cfg, 3, broadcast="nccl://127.0.0.1:9/s")
    worker = RolloutWorker(cfg, "wn")
    try:
        assert worker.wait_for_weights(timeout_s=20)
        assert worker.engine.policy_version == 3 and worker.weights.backend is None
        # A gloo hub, announced with the next version: the worker joins it.
        hub = BroadcastHub(0, host="127.0.0.1", timeout_s=10)
        publish(cfg, 4, broadcast=f"gloo://127.0.0.1:{hub.port}/{hub.secret}")
        assert worker._load()
        assert worker.engine.policy_version == 4 and worker.weights.backend == "gloo"
        assert worker.stats.weight_loads == 2
    finally:
        worker.shutdown()


def test_worker_waits_for_the_learners_weights(tmp_path, redis_url, redis_prefix):
    cfg = worker_cfg(tmp_path, redis_url, redis_prefix, "rollout.worker_prompts=2")
    worker = RolloutWorker(cfg, "ww")
    timer = threading.Timer(0.8, lambda: publish(cfg, 3))
    timer.start()
    t0 = time.monotonic()
    stats = worker.run(max_batches=1)
    timer.join()
    assert time.monotonic() - t0 >= 0.7
    assert stats.versions == {3: 2}  # (one batch: two groups, both sampled by version 3)
    waited = worker.metrics.registry.get_sample_value("reval_rollout_weight_wait_seconds_total")
    assert waited >= 0.7


def test_worker_process_serves_health_and_readiness(tmp_path, redis_url, redis_prefix):
    """/readyz is 503 until the learner's first weights are loaded, then 200; /healthz 200;
    /metrics carries the worker's metrics; a pause over the run's control stops generation and
    the worker's registered status says ``paused`` until the run resumes."""
    import socket
    import urllib.error
    import urllib.request

    from reval.control import RunControl

    def get(path: str) -> int:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
                return int(r.status)
        except urllib.error.HTTPError as err:
            return int(err.code)
        except OSError:
            return 0  # not listening yet

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cfg = worker_cfg(tmp_path, redis_url, redis_prefix)
    p = spawn(cli_args(tmp_path, redis_url, redis_prefix), "--worker-id", "wh",
              "--metrics-port", str(port))  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while get("/healthz") != 200:
            assert p.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        assert get("/readyz") == 503  # no weights yet
        publish(cfg, 0)
        while get("/readyz") != 200:
            assert p.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        ring = ring_of(cfg)
        while len(ring) == 0:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        control = RunControl(redis.Redis.from_url(redis_url), redis_prefix, "w")
        control.set_phase("paused")
        time.sleep(3)  # the batch in flight finishes
        held = len(ring)
        time.sleep(2)
        assert len(ring) == held  # paused: nothing generated
        # The heartbeats (every 0.5 s) keep saying so, and a resume is seen the same way.
        client = redis.Redis.from_url(redis_url)
        key = worker_key(redis_prefix, "w", "wh")
        assert json.loads(client.get(key))["status"] == "paused"
        control.set_phase("running")
        while json.loads(client.get(key))["status"] != "running":
            assert time.monotonic() < deadline
            time.sleep(0.1)
        control.set_phase("stopping")  # the run stops: the worker drains and exits
        p.communicate(timeout=60)
        assert p.returncode == 0
    finally:
        if p.poll() is None:
            p.kill()


def test_sigterm_drains_and_deregisters(tmp_path, redis_url, redis_prefix):
    cfg = worker_cfg(tmp_path, redis_url, redis_prefix)
    publish(cfg, 0)
    p = spawn(cli_args(tmp_path, redis_url, redis_prefix), "--worker-id", "wt")
    client = redis.Redis.from_url(redis_url)
    key = worker_key(redis_prefix, "w", "wt")
    ring = ring_of(cfg)
    deadline = time.monotonic() + 120
    while len(ring) < 40:
        assert p.poll() is None, p.stderr.read() if p.stderr else ""
        assert time.monotonic() < deadline
        time.sleep(0.05)
    info = json.loads(client.get(key))
    assert info["status"] == "running" and info["engine"] == "hf"
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    s = summary(out)
    assert s["trajectories"] == len(ring) >= 40  # everything finished was pushed
    assert client.get(key) is None


def test_redis_restart_mid_stream_loses_nothing(tmp_path):
    server = OwnRedis(tmp_path / "redis")
    (tmp_path / "redis").mkdir()
    server.start()
    try:
        prefix = "reval-test:wr:"
        cfg = worker_cfg(tmp_path, server.url, prefix, "rollout.worker_prompts=5")
        publish(cfg, 0)
        p = spawn(
            cli_args(tmp_path, server.url, prefix, "rollout.worker_prompts=5"),
            "--max-batches",
            "30",
            "--worker-id",
            "wr",
        )
        ring = ring_of(cfg)
        deadline = time.monotonic() + 120
        while len(ring) < 40:
            assert p.poll() is None
            assert time.monotonic() < deadline
            time.sleep(0.05)
        server.stop(signal.SIGTERM)
        time.sleep(1.0)
        server.start()
        out, err = p.communicate(timeout=180)
        assert p.returncode == 0, err
        assert summary(out)["trajectories"] == 30 * 5 * 4
        items = ring.items()
        assert len(items) == 600 and len({t.traj_id for t in items}) == 600
    finally:
        if server.proc is not None:
            server.stop(signal.SIGKILL)


def test_rollout_cli_refuses_the_embedded_buffer(tmp_path):
    p = spawn(["buffer.backend=memory", f"output_dir={tmp_path}"], "--max-batches", "1")
    _, err = p.communicate(timeout=120)
    assert p.returncode == 2 and "buffer.backend=redis" in err


def test_math_worker_grades_in_the_process_pool(tmp_path, redis_url, redis_prefix):
    """A DeepScaleR-format file (with bad rows) through the worker: graded by math-verify in the
    process pool, bad rows skipped and counted."""
    rows = [{"problem": f"{i}+{i}", "answer": str(2 * i)} for i in range(6)]
    rows += [{"problem": "", "answer": "1"}, {"answer": "2"}, {"problem": "9" * 60, "answer": "3"}]
    data = tmp_path / "math.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    cfg = worker_cfg(
        tmp_path,
        redis_url,
        redis_prefix,
        "task.kind=math",
        f"task.dataset={data}",
        "rollout.worker_prompts=6",
        "rollout.max_new_tokens=6",
        "rollout.verifier_workers=1",
        "task.max_prompt_tokens=50",
    )
    publish(cfg, 0)
    worker = RolloutWorker(cfg, "wm")
    assert worker.task.skipped == {"empty_problem": 1, "missing_field": 1, "too_long": 1}  # type: ignore[attr-defined]
    # A correct answer the tiny model will not write by itself still grades 1 through the pool.
    scores = worker.task.verifier.score_many(  # type: ignore[attr-defined]
        [(worker.task.prompts[1], "so \\boxed{\\frac{4}{2}}"), (worker.task.prompts[1], "3")]
    )
    assert scores == [1.0, 0.0]
    stats = worker.run(max_batches=1)
    assert stats.trajectories == 24
    r = worker.metrics.registry
    assert r.get_sample_value("reval_verifier_answers_total") >= 26
    assert r.get_sample_value("reval_rollout_verify_seconds_count") == 6  # (one per group)
    assert len(ring_of(cfg).items()) == 24


def test_oneshot_calibration_goes_from_the_learner_to_the_workers(
    tmp_path, redis_url, redis_prefix
):
    """The learner's set-up (``services/setup.py``, before its ranks start) calibrates the
    one-shot task on the initial policy and shares it; a worker's verifier accepts exactly the
    learner's codes (not its own uncalibrated guess)."""
    from rollout.tasks import OneShotTask
    from services.setup import prepare_learner

    cfg = worker_cfg(
        tmp_path, redis_url, redis_prefix, "task.kind=oneshot", "task.oneshot_base_success=0.4",
        "rollout.worker_prompts=1", "model.pretrain_steps=0",  # calibrated on this policy
    )  # fmt: skip
    client = redis.Redis.from_url(redis_url)
    policy = load_policy(cfg.model, cfg.seed)
    assert prepare_learner(cfg, resume=False) == cfg  # (nothing to pretrain)
    expected = OneShotTask(base_success=0.4, seed=cfg.seed)
    p = expected.calibrate(policy)
    shared = json.loads(client.get(registry.task_key(redis_prefix, "w")))
    assert sorted(shared["accepted"]) == sorted(expected.verifier.accepted)
    assert abs(shared["base_success"] - p) < 1e-9
    # A resumed learner keeps what the workers use.
    client.set(registry.task_key(redis_prefix, "w"), json.dumps({**shared, "accepted": ["07"]}))
    prepare_learner(cfg, resume=True)
    assert json.loads(client.get(registry.task_key(redis_prefix, "w")))["accepted"] == ["07"]
    client.set(registry.task_key(redis_prefix, "w"), json.dumps(shared))

    publish(cfg, 0)
    worker = RolloutWorker(cfg, "w1shot")
    uncalibrated = set(worker.task.verifier.accepted)
    stats = worker.run(max_batches=1)
    assert stats.batches == 1
    assert set(worker.task.verifier.accepted) == set(shared["accepted"]) != uncalibrated


def test_worker_refuses_a_bad_task_setup(tmp_path, redis_url, redis_prefix):
    cfg = worker_cfg(tmp_path, redis_url, redis_prefix, "task.kind=oneshot")
    client = redis.Redis.from_url(redis_url)
    client.set(
        registry.task_key(redis_prefix, "w"), json.dumps({"kind": "oneshot", "accepted": ["x"]})
    )
    publish(cfg, 0)
    worker = RolloutWorker(cfg, "wbad")
    with pytest.raises(ValueError, match="task setup cannot be used"):
        worker.run(max_batches=1)


def test_a_worker_waits_one_learner_round_ahead_by_default(
    tmp_path, redis_url, redis_prefix, monkeypatch, caplog
):
    """The default pacing (``buffer.generate_ahead`` unset): K = 4 updates of 32 per round of
    32 x 4 is a reuse of 1, so a worker may run 1 x 128 samples ahead of the
    learner: 4 batches of 40 with no learner, then it waits (and says so), and one more batch
    once a learner samples 32."""
    import rollout.worker

    monkeypatch.setattr(rollout.worker, "AHEAD_LOG_S", 0.3)
    cfg = worker_cfg(tmp_path, redis_url, redis_prefix, "buffer.generate_ahead=null",
                     "learner.updates_per_round=4")  # fmt: skip
    assert (cfg.samples_per_insert, cfg.generate_ahead()) == (1.0, 128)
    publish(cfg, 0)
    worker = RolloutWorker(cfg, "wp")
    ring = ring_of(cfg)

    def settled(inserted: int) -> None:
        deadline = time.monotonic() + 60
        while ring.stats().inserted < inserted:
            assert time.monotonic() < deadline and t.is_alive()
            time.sleep(0.05)
        time.sleep(1.0)  # and no more
        assert ring.stats().inserted == inserted

    t = threading.Thread(target=worker.run)
    with caplog.at_level("INFO", logger="reval.rollout"):
        t.start()
        try:
            settled(160)
            assert "waiting for the learner" in caplog.text
            ring.sample(32)  # the learner's share of one batch
            settled(200)
        finally:
            worker.stop.set()
            t.join(60)
    waited = worker.metrics.registry.get_sample_value("reval_rollout_ahead_wait_seconds_total")
    assert waited > 1.0


def test_pacing_never_starves_a_schedule_of_fresh_batches(tmp_path, redis_url, redis_prefix):
    """Every update takes fresh trajectories (K = 1 of B = one round) while the limiter allows a
    reuse of 4: the learner can only use each trajectory once, so the samples it "owes" never
    come. The worker goes on while fewer never-taken trajectories are held than a round of fresh
    updates takes (by the owed samples alone both sides would wait), and no further."""
    from learner.batches import BatchSource

    cfg = worker_cfg(
        tmp_path, redis_url, redis_prefix, "buffer.generate_ahead=null",
        "buffer.samples_per_insert=4", "rollout.prompts_per_round=4", "rollout.worker_prompts=4",
        "learner.batch_size=16", "learner.updates_per_round=1",
    )  # fmt: skip
    assert (cfg.fresh_updates, cfg.generate_ahead()) == (1, 64)
    publish(cfg, 0)
    worker = RolloutWorker(cfg, "wf")
    ring = ring_of(cfg)
    source = BatchSource.from_config(ring, cfg)
    t = threading.Thread(target=worker.run)
    t.start()
    try:
        for _ in range(8):
            assert source.next(timeout=60).fresh
            time.sleep(0.2)  # a learner slower than the worker
        st = ring.stats()
        assert st.taken == 8 * 16 and 4 * st.inserted - st.sampled > 64  # far "ahead" ...
        assert st.inserted - st.taken <= 3 * 16  # ... yet it waited while fresh ones were held
    finally:
        worker.stop.set()
        t.join(60)


def test_scale_puts_the_youngest_workers_on_standby(tmp_path, redis_url, redis_prefix):
    """``reval runs scale`` below the registered workers (as under compose, where each worker is
    a service): the youngest go on standby (registered as such, generating nothing), come back
    when the count grows, and a standby worker takes over when an older one goes."""
    from reval.control import RunControl

    cfg = worker_cfg(tmp_path, redis_url, redis_prefix)
    publish(cfg, 0)
    client = redis.Redis.from_url(redis_url)
    control = RunControl(client, redis_prefix, "w")
    old = RolloutWorker(cfg, "w-old")
    young = RolloutWorker(cfg, "w-young")
    assert young.started_at > old.started_at
    old._register("running")
    beat = threading.Thread(target=old._beat, daemon=True)  # old stays registered, idle
    beat.start()
    control.set_workers(1)
    ring = ring_of(cfg)

    def status() -> str:
        raw = client.get(worker_key(redis_prefix, "w", "w-young"))
        return "" if raw is None else str(json.loads(raw)["status"])

    def wait(cond, what: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            assert time.monotonic() < deadline, f"{what}: {where()}"
            time.sleep(0.1)

    def where() -> str:  # (what a timeout says: the young worker's state and its thread's stack)
        frame = sys._current_frames().get(run.ident or -1)
        stack = "".join(traceback.format_stack(frame)[-8:]) if frame is not None else "(ended)"
        peers = [(w["id"], w.get("status")) for w in registry.workers(client, redis_prefix, "w")]
        return (f"status {young.status!r}, standby {young.standby}, paused {young.paused}, "
                f"batches {young.stats.batches}, records {young_records()}, peers {peers}, "
                f"desired {control.read().workers}, thread:\n{stack}")  # fmt: skip

    def young_records() -> int:
        """Records the young worker has pushed: the ring's running count, not what it holds (the
        young worker fills its 5,000 places in a second or two: a count of the records held
        stopped growing, and the take-over was never seen)."""
        return ring.stats().inserted  # (the old worker generates nothing: see the end)

    run = threading.Thread(target=young.run, daemon=True)
    run.start()
    try:
        wait(lambda: status() == "standby", "the young worker on standby")
        time.sleep(2.0)
        assert young_records() == 0  # on standby: nothing generated
        assert old._follow_control() and not old.standby  # the older one is the one that works
        control.set_workers(2)
        wait(lambda: young_records() > 0, "the young worker generating after scale 2")
        control.set_workers(1)
        wait(lambda: status() == "standby", "the young worker on standby again")
        time.sleep(1.0)  # its batch in flight lands
        held = young_records()
        time.sleep(2.0)
        assert young_records() == held
        old.stop.set()  # the older worker goes: the standby one takes its place
        beat.join(timeout=5)
        old._deregister()
        wait(lambda: young_records() > held, "the standby worker taking over")
        assert status() == "running"
        assert {t.worker_id for t in ring.items()} == {"w-young"}
    finally:
        young.stop.set()
        run.join(timeout=60)
        old.stop.set()
