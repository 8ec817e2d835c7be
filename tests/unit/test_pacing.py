"""The service reuses each trajectory K times by default: the workers' pacing
(``buffer.generate_ahead``, derived from K and the round when unset) and the fresh part of each
round's updates (``RunConfig.fresh_updates``) that trains on every trajectory before the FIFO
evicts it."""

from __future__ import annotations

import pytest

from buffer.ring import MemoryRing
from learner.batches import BatchSource
from reval.config import ConfigError, load_config
from tests.conftest import make_traj


def cfg_of(*overrides: str):
    return load_config(overrides=list(overrides), environ={})


def test_generate_ahead_is_one_learner_round_by_default():
    cfg = cfg_of()  # the demo: K = 5 updates of 256 on rounds of 32 x 16 = 512
    assert cfg.buffer.generate_ahead is None
    assert cfg.samples_per_insert == 2.5
    assert cfg.generate_ahead() == 5 * 256 == cfg.samples_per_insert * cfg.round_size
    assert cfg.generate_ahead(3.0) == 3 * 512  # a live K is followed
    assert cfg_of("buffer.generate_ahead=5000").generate_ahead(3.0) == 5000
    assert cfg_of("buffer.generate_ahead=off").generate_ahead() is None
    for bad in ("-1", "soon"):
        with pytest.raises(ConfigError, match="generate_ahead"):
            cfg_of(f"buffer.generate_ahead={bad}")


def test_the_workers_never_stop_before_the_learner_can_sample():
    """Workers stop ``generate_ahead / K`` trajectories ahead of a learner that has not sampled
    yet: at least the first batch it needs (``batch_size``, ``min_size_to_sample``), derived or
    checked, else both sides would wait on each other."""
    cfg = cfg_of("rollout.prompts_per_round=1", "learner.batch_size=16",
                 "buffer.min_size_to_sample=64", "learner.first_update_fresh=false")  # fmt: skip
    assert cfg.round_size == 16 and cfg.samples_per_insert == 5.0
    assert cfg.generate_ahead() == 5 * 64  # not 5 x 16: the learner waits for 64 held
    with pytest.raises(ConfigError, match=r"generate_ahead \(0\) stops the workers"):
        cfg_of("buffer.generate_ahead=0")
    with pytest.raises(ConfigError, match=r"needs 256 trajectories held"):
        cfg_of("buffer.generate_ahead=600")  # the demo: K = 2.5 x 256 = 640 needed


@pytest.mark.parametrize(
    ("overrides", "fresh"),
    [
        ((), 2),  # the demo: rounds of 512, B = 256: two of its five updates take the round
        (("learner.batch_size=512",), 1),  # the paper: B = one round
        (("learner.batch_size=200",), 2),  # whole batches only: 400 of the 512
        (("learner.first_update_fresh=false",), 0),
        (("learner.batch_size=64", "learner.updates_per_round=3"), 3),  # at most K
        (("algo.name=grpo", "learner.updates_per_round=1", "learner.batch_size=512"), 1),
    ],
)
def test_fresh_updates_cover_the_round(overrides, fresh):
    assert cfg_of(*overrides).fresh_updates == fresh


def run_schedule(fresh_updates: int, rounds: int = 40) -> tuple[float, float]:
    """The demo's schedule on the embedded ring (M = 2560, rounds of 512 in groups of 16,
    K = 4 updates of 256): (share of evictions that were never used, samples per insert)."""
    ring = MemoryRing(2560, seed=1)
    source = BatchSource(ring, 256, on_policy=False, updates_per_round=4,
                         fresh_updates=fresh_updates)  # fmt: skip
    n = 0
    for _ in range(rounds):
        batch = []
        for _ in range(512):
            t = make_traj(n % 97)
            t.traj_id, t.group_id = f"t{n}", f"g{n // 16}"
            batch.append(t)
            n += 1
        ring.insert(batch)
        for _ in range(4):
            source.next()
    st = ring.stats()
    return st.unused_share, st.reuse


def test_the_fresh_round_leaves_no_trajectory_unused():
    """With one fresh update of 256 per round of 512, the other half is only sampled uniformly
    and about 1 in 5 of it leaves the ring unused (e^-1.5 of Poisson(1.5) draws); taking the
    whole round fresh trains on every trajectory at least once, at the same K."""
    unused_one, reuse_one = run_schedule(fresh_updates=1)
    unused_round, reuse_round = run_schedule(fresh_updates=2)
    assert reuse_one == pytest.approx(2.0, rel=0.01) and reuse_round == pytest.approx(2.0, rel=0.01)
    assert unused_one > 0.05
    assert unused_round == 0.0
