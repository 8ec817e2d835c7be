"""The streaming rollout worker's glue (``RolloutWorker._stream``) on a fake streaming engine and
the real Redis: the shared deal, a group graded and inserted as soon as it is done, new weights
from the announcement loaded in flight (answers spanning them say so), the run's stop drains.
The scheduler itself is ``test_streaming.py``'s; the real engine is the vLLM lane's."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import redis
import torch

from buffer.redis_ring import RedisRing
from reval.config import load_config
from reval.control import RunControl
from reval.policy import build_char_tokenizer
from reval.weights.files import WeightStore
from reval.weights.receiver import LocalReceiver
from rollout import worker as worker_module
from rollout.engines import Finished, Sample, SamplingParams
from tests.conftest import announce_weights


class Engine:
    """Answers of 4, 17 or 30 tokens in turn (``"12"`` repeated, then EOS), one token per
    running answer per step (1 ms a step), labelled with the version loaded."""

    def __init__(self, tok: object) -> None:
        self.tok = tok
        self.eos = int(tok.eos_token_id)  # type: ignore[attr-defined]
        self.stop_ids = (self.eos,)
        self.digits = tok("12", add_special_tokens=False).input_ids  # type: ignore[operator]
        self.policy_version = 0
        self.inflight = "finish"
        self.receiver = LocalReceiver(self._load, "cpu")
        self.requests: dict[str, tuple[int, list[list[tuple[int, int]]]]] = {}
        self.paused = False
        self.submitted = 0
        self.device = torch.device("cpu")
        self.closed = False

    def _load(self, named: object, version: int) -> None:
        list(named)  # type: ignore[call-overload]
        self.policy_version = version

    load_weights = _load

    def generate(self, prompts: object, params: SamplingParams, seed: int) -> list[list[Sample]]:
        raise NotImplementedError("this fake answers only step by step (a streaming worker's)")

    def close(self) -> None:
        self.closed = True

    def submit(self, key: str, prompt: Sequence[int], params: SamplingParams, seed: int) -> None:
        self.submitted += 1  # (lengths 4, 17, 30, ...: groups finish apart, the engine stays busy)
        self.requests[key] = (4 + self.submitted % 3 * 13, [[] for _ in range(params.n)])

    def step(self) -> list[Finished]:
        assert not self.paused
        time.sleep(0.001)
        done = []
        for key, (length, answers) in list(self.requests.items()):
            for a in answers:
                j = len(a)
                a.append((self.eos if j == length - 1 else self.digits[j % 2], self.policy_version))
            if len(answers[0]) == length:
                del self.requests[key]
                done.append(
                    Finished(key, [_sample(a) for a in answers], [_spans(a) for a in answers])
                )
        return done

    def running(self) -> int:
        return sum(len(a) for _, a in self.requests.values())

    def pause(self) -> None:
        self.paused = True

    def resume(self) -> None:
        self.paused = False


def _sample(a: list[tuple[int, int]]) -> Sample:
    ids = np.array([t for t, _ in a], np.int32)
    return Sample(ids, np.full(ids.size, -0.3, np.float32), "stop")


def _spans(a: list[tuple[int, int]]) -> np.ndarray:
    out: list[int] = []
    for j, (_, v) in enumerate(a):
        if not out or out[-1] != v:
            out += [j, v]
    return np.array(out, np.int32)


def test_a_streaming_worker_deals_grades_inserts_and_loads_in_flight(
    tmp_path: Path, redis_url: str, redis_prefix: str, monkeypatch
) -> None:
    cfg = load_config(overrides=[
        "task.kind=addition", "rollout.engine=vllm", "rollout.n=2", "rollout.worker_prompts=4",
        "rollout.heartbeat_s=0.5", "buffer.backend=redis", "buffer.capacity=4000",
        "buffer.generate_ahead=off", f"redis.url={redis_url}",
        f"redis.prefix={redis_prefix}", f"output_dir={tmp_path}", "name=sw",
        "metrics.progress=false", "learner.batch_size=8",
    ], environ={})  # fmt: skip
    assert cfg.rollout.streams()
    tok = build_char_tokenizer()
    engine = Engine(tok)
    monkeypatch.setattr(worker_module, "build_engine", lambda *a, **k: (engine, tok))
    store = WeightStore(redis.Redis.from_url(redis_url), redis_prefix, "sw", tmp_path / "w")
    weights = [("w", torch.zeros(2))]
    announce_weights(store, weights, 1)
    w = worker_module.RolloutWorker(cfg, "sw0")
    runner = threading.Thread(target=w.run)
    runner.start()
    try:
        ring = RedisRing("sw", 4000, url=redis_url, key_prefix=redis_prefix)
        deadline = time.monotonic() + 30
        while ring.stats().inserted < 40 and time.monotonic() < deadline:
            time.sleep(0.01)
        announce_weights(store, weights, 2)
        while engine.policy_version < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.3)
        RunControl(redis.Redis.from_url(redis_url), redis_prefix, "sw").set_phase("stopping")
        runner.join(30)
        assert not runner.is_alive()
        assert engine.closed  # (the worker's end releases its engine)
    finally:
        w.stop.set()
        runner.join(30)
    records = ring.items()
    assert len(records) == len({t.traj_id for t in records}) == w.stats.trajectories >= 40
    groups: dict[str, list] = {}
    for t in records:
        groups.setdefault(t.group_id, []).append(t)
    assert all(len(g) == 2 for g in groups.values())  # whole groups only
    versions = {v for t in records for v in t.token_versions().tolist()}
    assert versions == {1, 2}
    # One entry per version (groups that sampled it), not one per group: bounded (issue 37).
    assert set(w.stats.versions) == {1, 2} and sum(w.stats.versions.values()) >= len(groups)
    spanned = [t for t in records if t.version_spans.size > 2]
    assert spanned, "no answer spanned the in-flight load"
    for t in spanned:
        assert t.policy_version == 1 and t.token_versions()[-1] == 2
    dealt = int(redis.Redis.from_url(redis_url).get(w.dealer.key) or 0)
    assert dealt == len(groups)  # every dealt prompt finished and inserted (the stop drained)
