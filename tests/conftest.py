from __future__ import annotations

import numpy as np
import pytest

from buffer.records import Trajectory


def make_traj(
    i: int = 0, *, version: int = 0, reward: float = 1.0, plen: int = 3, rlen: int = 4
) -> Trajectory:
    rng = np.random.default_rng(i)
    return Trajectory(
        prompt_ids=rng.integers(3, 50, plen),
        response_ids=np.append(rng.integers(3, 50, rlen - 1), 1),
        logprobs=-rng.random(rlen).astype(np.float32),
        reward_raw=reward,
        reward=reward,
        prompt_id=f"p{i}",
        group_id=f"g{i // 4}",
        policy_version=version,
        traj_id=f"t{i}",
    )


@pytest.fixture
def traj_factory():
    return make_traj
