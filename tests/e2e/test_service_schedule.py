"""The service keeps the algorithm's schedule (real Redis, `reval learner` and `reval rollout`
as processes, the demo's addition task):

- GRPO through the service uses every trajectory exactly once and never a partial group, on 2
  learner ranks (each rank gets whole groups);
- ReVal with K = 2 on the defaults (``buffer.samples_per_insert`` and ``buffer.generate_ahead``
  left unset: both follow from the schedule) reuses each trajectory twice at steady state, as
  ``reval train`` does, and evicts next to none unused: the limiter holds the learner back when
  it is faster, the workers' pacing holds them back when they are.
"""

from __future__ import annotations

import json
import signal

from buffer.redis_ring import RedisRing
from reval.metrics import read_jsonl
from tests.e2e.test_service import logs, start


def sets_for(tmp_path, url: str, prefix: str, name: str, *extra: str) -> list[str]:
    return [
        "buffer.backend=redis",
        f"redis.url={url}",
        f"redis.prefix={prefix}",
        f"output_dir={tmp_path}",
        f"name={name}",
        "buffer.capacity=4096",
        "buffer.sample_timeout_s=120",
        "rollout.n=4",
        "rollout.heartbeat_s=1",
        "rollout.weights_poll_s=0.2",
        "model.pretrain_steps=100",
        "sync.timeout_s=10",
        "metrics.progress=false",
        *extra,
    ]


def test_grpo_service_uses_every_trajectory_once_in_whole_groups(tmp_path, redis_url, redis_prefix):
    batches, per_batch = 6, 4 * 4  # per worker: 6 batches of 4 prompts x 4 answers
    sets = sets_for(
        tmp_path, redis_url, redis_prefix, "grpo",
        "algo.name=grpo", "learner.updates_per_round=1", "learner.first_update_fresh=true",
        "rollout.prompts_per_round=4", "rollout.worker_prompts=4",
        "learner.batch_size=16", "learner.micro_batch_size=4",
        f"learner.max_steps={2 * batches}",
    )  # fmt: skip
    learner = start("learner", sets, "--nproc", "2")
    workers = [
        start("rollout", sets, "--worker-id", f"w{k}", "--max-batches", str(batches))
        for k in range(2)
    ]
    try:
        out, _ = learner.communicate(timeout=600)
        assert learner.returncode == 0, logs(tmp_path, "learner")
        for w in workers:
            w.communicate(timeout=120)
            assert w.returncode == 0, logs(tmp_path, "rollout")
    finally:
        for p in (learner, *workers):
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
    assert json.loads(out.strip().splitlines()[-1])["updates"] == 2 * batches
    ring = RedisRing("grpo", 4096, url=redis_url, key_prefix=redis_prefix)
    stats = ring.stats()
    assert stats.inserted == 2 * batches * per_batch
    assert stats.sampled == stats.inserted  # every trajectory handed out ...
    held = ring.items()
    assert len(held) == stats.inserted and {t.use_count for t in held} == {1}  # ... once
    rows = read_jsonl(tmp_path / "grpo" / "learner.jsonl")
    assert len(rows) == 2 * batches
    assert all(r["group_sizes"] == {"4": 4} for r in rows), [r["group_sizes"] for r in rows]
    assert all(r["use_count_mean"] == 1 for r in rows)


def test_reval_service_reuses_each_trajectory_k_times(tmp_path, redis_url, redis_prefix):
    sets = sets_for(
        tmp_path, redis_url, redis_prefix, "k2",
        "learner.updates_per_round=2", "learner.first_update_fresh=true",
        "rollout.prompts_per_round=4", "rollout.worker_prompts=1",
        "learner.batch_size=16", "learner.micro_batch_size=16", "sync.every=4",
        "learner.max_steps=300", "buffer.capacity=128",
    )  # fmt: skip
    learner = start("learner", sets, "--nproc", "1")
    worker = start("rollout", sets, "--worker-id", "w0")
    try:
        learner.communicate(timeout=600)
        assert learner.returncode == 0, logs(tmp_path, "learner")
    finally:
        worker.send_signal(signal.SIGTERM)
        worker.communicate(timeout=120)
    config = json.loads((tmp_path / "k2" / "config.json").read_text())
    assert config["buffer"]["samples_per_insert"] == 2.0  # K * B / (prompts * n)
    assert config["buffer"]["generate_ahead"] is None  # the default: one learner round
    rows = read_jsonl(tmp_path / "k2" / "learner.jsonl")
    assert [r["fresh"] for r in rows] == [1, 0] * (len(rows) // 2)  # a round: take, then sample
    # Steady state: from the first update where the learner has caught up with the workers'
    # start (the limiter binds: at most two batches short of K uses per insert) to the end.
    b = 16
    caught = next(
        i for i, r in enumerate(rows) if 2 * r["buffer_inserted"] - r["buffer_sampled"] <= 2 * b
    )
    assert caught < len(rows) // 2, [(r["buffer_inserted"], r["buffer_sampled"]) for r in rows]
    first, last = rows[caught], rows[-1]
    ratio = (last["buffer_sampled"] - first["buffer_sampled"]) / (
        last["buffer_inserted"] - first["buffer_inserted"]
    )
    assert 1.8 <= ratio <= 2.2, (ratio, caught, first, last)
    # Every trajectory was trained on before it left the ring (the workers never ran ahead).
    assert last["buffer_evicted"] > 4 * 128, last
    assert last["buffer_evicted_unused"] < 0.05 * last["buffer_evicted"], last
    assert abs(last["buffer_reuse"] - 2.0) <= 0.2, last
