from __future__ import annotations

import importlib.util
import os
import sys
import uuid
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

from buffer.records import Trajectory

# tests/peers needs trl, which only the peers lane's venv has (`make test-peers`); elsewhere it is
# not collected, rather than reported as skipped.
collect_ignore = [] if importlib.util.find_spec("trl") else ["peers"]


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


@pytest.fixture(autouse=True)
def _own_threads(monkeypatch: pytest.MonkeyPatch):
    """A test that runs ``reval train`` (or a learner, a worker) in this process applies its
    thread budget and starts a tuner here (``reval/threads.py``): both are put back after it, so
    no later test runs at another thread count. And the tests' runs hold their thread count
    (``OMP_NUM_THREADS``, the operator's setting, here the count torch has, as before the
    budget): a tuner picks its count by timing, and a run's float results (a learning curve a
    test holds to a bar) would then depend on the machine's load. The tuner's own tests unset
    it."""
    import torch

    from reval import threads

    monkeypatch.setattr(threads, "_tuner", None)
    before = torch.get_num_threads()
    monkeypatch.setenv("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS") or str(before))
    yield
    if torch.get_num_threads() != before:
        torch.set_num_threads(before)


@pytest.fixture
def traj_factory():
    return make_traj


@pytest.fixture
def peer_bench() -> ModuleType:
    """benchmarks/peer_bench.py as a module (benchmarks/ is not a package)."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "peer_bench.py"
    spec = importlib.util.spec_from_file_location("peer_bench", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["peer_bench"] = mod  # (its dataclasses look their module up there)
    spec.loader.exec_module(mod)
    return mod


# -- Redis ---------------------------------------------------------------------------------------
# Tests use the Redis on 127.0.0.1:6379 (or REVAL_TEST_REDIS_URL) under a key prefix of their own
# and delete only keys under that prefix. `.ci/run` makes sure a Redis answers.

REDIS_URL = os.environ.get("REVAL_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


@pytest.fixture(scope="session")
def redis_url() -> str:
    import redis

    try:
        redis.Redis.from_url(REDIS_URL, socket_connect_timeout=1).ping()
    except redis.ConnectionError as err:
        if os.environ.get("REVAL_REQUIRE_REDIS") == "1":
            pytest.fail(f"no Redis answers at {REDIS_URL} ({err}) and REVAL_REQUIRE_REDIS=1")
        pytest.skip(
            f"no Redis answers at {REDIS_URL} ({err}); start one or set REVAL_TEST_REDIS_URL"
        )
    return REDIS_URL


@pytest.fixture
def redis_prefix(redis_url: str):
    """A key prefix unique to this test; its keys are deleted afterwards."""
    import redis

    prefix = f"reval-test:{os.getpid()}:{uuid.uuid4().hex[:8]}:"
    yield prefix
    client = redis.Redis.from_url(redis_url)
    keys = list(client.scan_iter(match=prefix + "*", count=1000))
    if keys:
        client.delete(*keys)
    client.close()


def announce_weights(store, named_tensors, version: int, broadcast=None, lineage: str = "test"):
    """A learner's announcement of ``version`` as the workers see it (tests that play the
    learner without a model): the version, then its file. Returns the file's path."""
    store.announce(version, lineage, broadcast, first=False)
    path = store.write(named_tensors, version)
    assert store.announce_file(version, path, lineage)
    return path


def tensors_equal(a, b) -> bool:
    """Two ``(name, tensor)`` collections with the same names and bit-equal tensors."""
    import torch

    da, db = dict(a), dict(b)
    return da.keys() == db.keys() and all(torch.equal(da[k], db[k]) for k in da)
