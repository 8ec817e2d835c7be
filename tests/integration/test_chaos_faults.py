"""Faults of the chaos run (issue 31): a record valid on the wire but longer than the model's
context crashed a 2-rank learner on allocation, and again after every ``--resume`` (it was never
quarantined); a hand-written ``meta.head=abc`` surfaced from ``RedisRing.stats()`` as a bare
``ValueError`` instead of ``RingCorrupt`` with its repair hint."""

from __future__ import annotations

import signal

import numpy as np
import pytest

from buffer.record_codec import decode_many, encode
from buffer.records import RecordError, RecordLimits, Trajectory
from buffer.redis_ring import RedisRing, RingCorrupt
from learner.ranks import main
from reval.config import build_config

VOCAB = 99  # the tiny model's
CONTEXT = 128  # its max_position_embeddings (model.tiny's default)
BATCH = 8


def _good(i: int) -> Trajectory:
    rng = np.random.default_rng(i)
    rlen = int(rng.integers(1, 9))
    return Trajectory(
        prompt_ids=rng.integers(3, VOCAB, int(rng.integers(1, 9))),
        response_ids=rng.integers(3, VOCAB, rlen),
        logprobs=-rng.random(rlen).astype(np.float32),
        reward_raw=float(rng.integers(0, 2)),
        reward=float(rng.integers(0, 2)),
        group_id=f"g{i // 4}",
        traj_id=f"good-{i}",
    )


def _too_long(prompt: int = 100, response: int = 4900) -> Trajectory:
    rng = np.random.default_rng(31)
    return Trajectory(
        prompt_ids=rng.integers(3, VOCAB, prompt),
        response_ids=rng.integers(3, VOCAB, response),
        logprobs=-rng.random(response).astype(np.float32),
        reward_raw=1.0,
        reward=1.0,
        group_id="long",
        traj_id="too-long",
    )


def test_a_record_longer_than_the_context_breaks_the_limits():
    limits = RecordLimits(VOCAB, 100.0, CONTEXT)
    at_limit = _too_long(64, 64)  # exactly the context: fine
    at_limit.traj_id = "at-limit"
    blobs = [encode(_good(0)), encode(_too_long()), encode(at_limit)]
    good, bad = decode_many(blobs, limits=limits)
    assert [t.traj_id for t in good] == ["good-0", "at-limit"]
    assert [i for i, _ in bad] == [1]
    assert "5000 tokens" in str(bad[0][1]) and "context length 128" in str(bad[0][1])
    with pytest.raises(RecordError, match="context length 128"):
        _too_long().validate(limits)
    assert len(decode_many([encode(_too_long())], limits=RecordLimits(VOCAB))[0]) == 1


def test_corrupt_meta_head_from_stats_is_ring_corrupt_with_the_repair(redis_url, redis_prefix):
    ring = RedisRing("c", 8, url=redis_url, key_prefix=redis_prefix, seed=1)
    ring.insert([_good(i) for i in range(4)])
    ring.client.hset(ring.keys.meta, "head", "abc")
    for call in (ring.stats, lambda: len(ring)):
        with pytest.raises(RingCorrupt, match="head=abc") as err:  # was: ValueError from int()
            call()
        assert "redis-cli --scan --pattern" in str(err.value)
        assert f"'{redis_prefix}{{c}}:meta'" in str(err.value)
    ring.client.hset(ring.keys.meta, "head", "4")
    # Every other counter of the bookkeeping too, from the client and from the scripts.
    for field in ("sampled", "version", "rejected"):
        ring.client.hset(ring.keys.meta, field, "x1")
        for call in (ring.stats, lambda: ring.sample(2, timeout=1)):
            with pytest.raises(RingCorrupt, match=f"{field}=x1") as err:
                call()
            assert "redis-cli --scan --pattern" in str(err.value)
        ring.client.hset(ring.keys.meta, field, "0")
    assert ring.stats().size == 4
    ring.close()


def test_the_repair_deletes_the_ring_and_nothing_else_of_the_run(redis_url, redis_prefix):
    """Following RingCorrupt's repair, as written, empties the ring and keeps the run's other
    keys (control, status, weights: the repair used to delete every key of the run)."""
    import re
    import subprocess

    ring = RedisRing("c", 8, url=redis_url, key_prefix=redis_prefix, seed=1)
    ring.insert([_good(i) for i in range(4)])
    others = [f"{redis_prefix}{{c}}:{k}" for k in ("control", "status", "weights")]
    for key in others:
        ring.client.hset(key, "x", "1")
    ring.client.hset(ring.keys.meta, "head", "abc")
    with pytest.raises(RingCorrupt) as err:
        ring.stats()
    command = re.search(r"(redis-cli del .*; done)", str(err.value))
    assert command is not None, str(err.value)
    cli = f"redis-cli -u {redis_url}"
    subprocess.run(["bash", "-c", command.group(1).replace("redis-cli", cli)], check=True)
    left = sorted(k.decode() for k in ring.client.scan_iter(match=f"{redis_prefix}*"))
    assert left == sorted(others)
    fresh = RedisRing("c", 8, url=redis_url, key_prefix=redis_prefix, seed=1)
    assert fresh.stats().size == 0  # a fresh ring: the workers refill it
    fresh.close()
    ring.close()


def _config(tmp_path, redis_url, prefix, max_steps: int):
    return build_config(
        {
            "name": "chaos",
            "output_dir": str(tmp_path),
            "buffer": {
                "backend": "redis",
                "redis_url": redis_url,
                "key_prefix": prefix,
                "capacity": 64,
                "sample_timeout_s": 5,
            },
            "rollout": {"prompts_per_round": 2, "n": 4},
            "learner": {
                "world_size": 2,
                "batch_size": BATCH,
                "micro_batch_size": BATCH,
                "updates_per_round": 1,  # every update takes never-used records, oldest first
                "first_update_fresh": True,
                "max_steps": max_steps,
                "sample_prefetch": 0,
                "checkpoint_every": 0,
                "lease_s": 5,
            },
            "sync": {"timeout_s": 20},
            "metrics": {"progress": False, "plot": False},
        }
    )


@pytest.fixture
def own_signals():
    """``main`` forwards SIGTERM/SIGINT/SIGUSR1 to its ranks: this process's own handlers come
    back afterwards."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)}
    yield
    for s, h in saved.items():
        signal.signal(s, h)


@pytest.mark.slow  # (~70 s: two learner starts of two ranks; the limit itself is tested above)
def test_a_two_rank_learner_quarantines_a_record_longer_than_the_context(
    tmp_path, redis_url, redis_prefix, own_signals, capfd
):
    producer = RedisRing("chaos", 64, url=redis_url, key_prefix=redis_prefix)
    # The worker's ring does not know the learner's model: the record lands, first in line.
    producer.insert([_too_long(), *(_good(i) for i in range(2 * BATCH))])
    assert main(_config(tmp_path, redis_url, redis_prefix, max_steps=2), nproc=2) == 0
    stats = producer.stats()
    assert stats.rejected == 1  # before: trained on (on a GPU: out of memory, every restart)
    held = {t.traj_id: t.use_count for t in producer.items()}
    assert "too-long" not in held
    assert held == {f"good-{i}": 1 for i in range(2 * BATCH)}
    err = capfd.readouterr().err
    line = "trajectory of 5000 tokens (100 prompt + 4900 response) > the model's context length 128"
    assert err.count(line) == 1, err[-3000:]

    # --resume: the record is not drawn again; training goes on with the new ones.
    producer.insert([_good(i) for i in range(2 * BATCH, 4 * BATCH)])
    cfg = _config(tmp_path, redis_url, redis_prefix, max_steps=4)
    assert main(cfg, resume=True, nproc=2) == 0
    out = capfd.readouterr()
    assert '"updates": 4' in out.out, out.err[-3000:]
    assert line not in out.err
    assert producer.stats().rejected == 1
    held = {t.traj_id: t.use_count for t in producer.items()}
    assert held == {f"good-{i}": 1 for i in range(4 * BATCH)}
    producer.close()
