"""A live learner (``LearnerService``, one gloo rank in this process) training from a Redis ring
that holds damaged records (issue 19): it never exits, every bad record is quarantined and
counted, and every good one is trained on, once. A batch that still makes the update raise is
quarantined whole and training goes on."""

from __future__ import annotations

import datetime as dt
import math

import msgpack
import numpy as np
import pytest
import torch
import torch.distributed as dist

from buffer.record_codec import decode, encode
from buffer.records import SCHEMA_VERSION, WIRE_FIELDS, RecordError, RecordLimits, Trajectory
from buffer.redis_ring import RedisRing
from learner.service import MAX_FAILED_BATCHES, LearnerService
from reval.config import build_config

COL = {name: i for i, name in enumerate(WIRE_FIELDS)}
N_RECORDS = 10_000
BATCH = 250
SEED = 19


@pytest.fixture
def one_rank():
    """A process group of one gloo rank in this process (what a spawned rank joins)."""
    dist.init_process_group(
        "gloo", rank=0, world_size=1, store=dist.HashStore(), timeout=dt.timedelta(seconds=60)
    )
    torch.set_num_threads(1)
    yield
    dist.destroy_process_group()


def _config(tmp_path, redis_url, prefix, max_steps: int, capacity: int = N_RECORDS):
    (tmp_path / "fuzz").mkdir(exist_ok=True)  # (``main`` makes the run directory)
    return build_config(
        {
            "name": "fuzz",
            "output_dir": str(tmp_path),
            "buffer": {
                "backend": "redis",
                "redis_url": redis_url,
                "key_prefix": prefix,
                "capacity": capacity,
                "sample_timeout_s": 5,
            },
            "rollout": {"prompts_per_round": 32, "n": 8},
            "learner": {
                "batch_size": BATCH,
                "micro_batch_size": BATCH,
                "updates_per_round": 1,  # every update takes never-used records: each good one
                "first_update_fresh": True,  # is trained on exactly once
                "max_steps": max_steps,
                "sample_prefetch": 0,
                "lr": 1e-4,
            },
            "sync": {"timeout_s": 20},
            "metrics": {"progress": False, "plot": False},
        }
    )


def _good(rng: np.random.Generator, i: int, vocab: int) -> Trajectory:
    rlen = int(rng.integers(1, 9))
    return Trajectory(
        prompt_ids=rng.integers(3, vocab, int(rng.integers(1, 9))),
        response_ids=rng.integers(3, vocab, rlen),
        logprobs=-rng.random(rlen).astype(np.float32),
        reward_raw=float(rng.integers(0, 2)),
        reward=float(rng.integers(0, 2)),
        group_id=f"g{i // 8}",
        traj_id=f"fuzz-{i}",
    )


def _row(t: Trajectory) -> list:
    return msgpack.unpackb(encode(t), use_list=True)


def _mutated(rng: np.random.Generator, t: Trajectory, vocab: int) -> bytes:
    """One of the ways a record goes bad: beyond the learner's limits, wrong on the wire, or
    bytes damaged at random (which may or may not leave a valid record: the oracle decides)."""
    kind = int(rng.integers(12))
    row = _row(t)
    if kind == 0:  # a token id past the embedding (IndexError in the update before the fix)
        ids = np.frombuffer(row[COL["response_ids"]], np.int32).copy()
        ids[int(rng.integers(ids.size))] = int(rng.integers(vocab, 2**31 - 1))
        row[COL["response_ids"]] = ids.tobytes()
    elif kind == 1:  # a finite reward far out of bounds
        row[COL["reward"]] = float(rng.choice([1e30, -1e30, 1e6, -101.0]))
    elif kind == 2:  # non-finite values
        row[COL[str(rng.choice(["reward_raw", "reward", "ref_logprob_sum", "ref_value"]))]] = float(
            rng.choice([math.nan, math.inf, -math.inf])
        )
    elif kind == 3:  # negative token id
        ids = np.frombuffer(row[COL["prompt_ids"]], np.int32).copy()
        ids[0] = -int(rng.integers(1, 2**31 - 1))
        row[COL["prompt_ids"]] = ids.tobytes()
    elif kind == 4:  # positive log-prob
        lp = np.frombuffer(row[COL["logprobs"]], np.float32).copy()
        lp[0] = 3.0
        row[COL["logprobs"]] = lp.tobytes()
    elif kind == 5:  # lengths that disagree
        lp = row[COL["logprobs"]]
        row[COL["logprobs"]] = lp[:-4] if len(lp) > 4 else lp + lp
    elif kind == 6:  # a wrong type (a bool is not an int; a string for a number)
        row[COL[str(rng.choice(["policy_version", "use_count", "reward"]))]] = (
            bool(rng.integers(2)) if rng.random() < 0.5 else "x"
        )
    elif kind == 7:  # another schema version, or missing fields
        row = [SCHEMA_VERSION + 1, *row[1:]] if rng.random() < 0.5 else row[: len(row) - 2]
    elif kind == 8:  # random bytes
        return rng.bytes(int(rng.integers(0, 200)))
    else:  # a good record's bytes, damaged: flipped bytes, cut short, or junk appended
        blob = bytearray(encode(t))
        if kind == 9:
            for _ in range(int(rng.integers(1, 4))):
                blob[int(rng.integers(len(blob)))] = int(rng.integers(256))
        elif kind == 10:
            del blob[int(rng.integers(1, len(blob))) :]
        else:
            blob += rng.bytes(int(rng.integers(1, 16)))
        return bytes(blob)
    return msgpack.packb(row, use_bin_type=True)


def _is_good(blob: bytes, limits: RecordLimits) -> bool:
    """The oracle: the one-record decode (not the batch path the ring reads with)."""
    try:
        decode(blob, limits=limits)
    except RecordError:
        return False
    return True


def _write_straight_in(ring: RedisRing, blobs: list[bytes]) -> None:
    """Placeholder records give the ring its positions and chunks; then each position's bytes
    are overwritten in Redis with the blob (as a foreign or broken writer would)."""
    placeholders = [_good(np.random.default_rng(i), i, 40) for i in range(len(blobs))]
    for t in placeholders:
        t.traj_id = f"placeholder-{t.traj_id}"
    ring.insert(placeholders)
    chunks = ring.client.zrange(ring.keys.chunks, 0, -1, withscores=True)
    pipe = ring.client.pipeline(transaction=False)
    for end, start in chunks:
        start, end = int(start), int(end)
        for pos in range(start, end):
            pipe.hset(f"{ring.keys.rec}{start}", str(pos - start), blobs[pos])
    pipe.execute()


def test_fuzzed_ring_a_live_learner_trains_only_on_the_good_records(
    tmp_path, redis_url, redis_prefix, one_rank
):
    rng = np.random.default_rng(SEED)
    vocab = 99  # the tiny model's (checked against the learner's embedding below)
    limits = RecordLimits(vocab, 100.0)
    blobs: list[bytes] = []
    for i in range(N_RECORDS):
        t = _good(rng, i, vocab)
        blobs.append(_mutated(rng, t, vocab) if rng.random() < 0.3 else encode(t))
    good = [_is_good(b, limits) for b in blobs]
    # Whole batches of good records: the surplus good ones get a token past the vocabulary.
    surplus = sum(good) % BATCH
    for i in [i for i, g in enumerate(good) if g][:surplus]:
        row = _row(decode(blobs[i]))
        row[COL["response_ids"]] = (
            np.full(1, vocab, np.int32).tobytes() + row[COL["response_ids"]][4:]
        )
        blobs[i], good[i] = msgpack.packb(row, use_bin_type=True), False
    n_good, n_bad = sum(good), N_RECORDS - sum(good)
    assert n_bad > 2000 and n_good > 6000 and n_good % BATCH == 0

    cfg = _config(tmp_path, redis_url, redis_prefix, max_steps=n_good // BATCH)
    producer = RedisRing("fuzz", N_RECORDS, url=redis_url, key_prefix=redis_prefix)
    _write_straight_in(producer, blobs)

    service = LearnerService(cfg)
    assert service.vocab_size == vocab
    state = service.run()  # before the fix: IndexError out of the first update with a bad id
    assert state.updates == n_good // BATCH

    stats = producer.stats()
    assert stats.rejected == n_bad
    held = {t.traj_id: t.use_count for t in producer.items()}
    good_ids = {decode(b).traj_id for b, g in zip(blobs, good, strict=True) if g}
    assert set(held) == good_ids  # every bad record was emptied from its slot
    assert set(held.values()) == {1}  # every good one trained on, once
    producer.close()


def test_a_batch_the_update_raises_on_is_quarantined_and_training_goes_on(
    tmp_path, redis_url, redis_prefix, one_rank, monkeypatch
):
    cfg = _config(tmp_path, redis_url, redis_prefix, max_steps=2, capacity=4 * BATCH)
    rng = np.random.default_rng(1)
    producer = RedisRing("fuzz", 4 * BATCH, url=redis_url, key_prefix=redis_prefix)
    producer.insert([_good(rng, i, 99) for i in range(3 * BATCH)])
    service = LearnerService(cfg)
    real = service.update_step.__class__.__call__
    calls = []

    def flaky(self, share, weights=None, batch=None):
        calls.append(len(share))
        if len(calls) == 1:
            raise RuntimeError("an update that fails on this batch")
        return real(self, share, weights, batch)

    monkeypatch.setattr(service.update_step.__class__, "__call__", flaky)
    state = service.run()
    assert state.updates == 2 and len(calls) == 3
    assert producer.stats().rejected == BATCH  # the whole first batch, counted
    assert len(producer.items()) == 2 * BATCH
    events = service.control.client.xrange(service.control.events_key)
    assert any(f[b"kind"] == b"batch_quarantined" for _, f in events)
    producer.close()


def test_a_learner_that_fails_on_every_batch_gives_up(
    tmp_path, redis_url, redis_prefix, one_rank, monkeypatch
):
    cfg = _config(tmp_path, redis_url, redis_prefix, max_steps=10, capacity=8 * BATCH)
    producer = RedisRing("fuzz", 8 * BATCH, url=redis_url, key_prefix=redis_prefix)
    producer.insert([_good(np.random.default_rng(i), i, 99) for i in range(8 * BATCH)])
    service = LearnerService(cfg)

    def broken(self, share, weights=None, batch=None):
        raise RuntimeError("the learner itself is broken")

    monkeypatch.setattr(service.update_step.__class__, "__call__", broken)
    with pytest.raises(RuntimeError, match="itself is broken"):
        service.run()
    assert producer.stats().rejected == MAX_FAILED_BATCHES * BATCH
    producer.close()
