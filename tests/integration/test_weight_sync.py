"""One seam for the weights (``reval/weights/``), against the real Redis and real gloo groups:
the learner's ``WeightSender.send(model, version)`` and each engine's ``WeightReceiver`` fed by
the worker's ``WeightSubscriber``. Engines get bit-identical weights through the file and the
broadcast; a late joiner reads the newest file, then follows the broadcast; a receiver killed
mid-sync costs one timeout; a resumed learner (a new lineage) is followed to lower versions; the
file is written off the critical path (skipped, not waited for, while the last one is written);
the sender never builds a full host copy and keeps its buffers within the bucket bound."""

from __future__ import annotations

import ast
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import pytest
import redis
import torch
from torch import nn

from reval.config import RunConfig, load_config
from reval.policy import load_policy
from reval.weights.buckets import plan_buckets
from reval.weights.collective import IN_FLIGHT
from reval.weights.files import WeightStore, file_lineage, safetensors_header
from reval.weights.receiver import WeightSubscriber, build_subscriber
from reval.weights.sender import build_sender, published_tensors
from rollout.engines import HFEngine, SamplingParams

ROOT = Path(__file__).resolve().parents[2]
BUCKET_MB = 0.02  # ~20 KB: the tiny model's weights go in many buckets


def config(tmp_path: Path, url: str, prefix: str, *extra: str) -> RunConfig:
    return load_config(
        overrides=[
            "buffer.backend=redis",
            f"redis.url={url}",
            f"redis.prefix={prefix}",
            f"output_dir={tmp_path}",
            "name=ws",
            "sync.timeout_s=10",
            f"sync.bucket_mb={BUCKET_MB}",
            *extra,
        ],
        environ={},
    )


class CountingEngine(HFEngine):
    loads = 0

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        super().load_weights(named_tensors, version)
        self.loads += 1


def hf_engine(cfg: RunConfig, seed: int) -> CountingEngine:
    policy = load_policy(cfg.model, seed)
    policy.model.eval()
    return CountingEngine(policy.model, policy.pad_id, policy.eos_id, policy.device)


class Learner:
    """A learner's rank 0 as far as the weights go: its model and its sender."""

    def __init__(self, cfg: RunConfig, client: redis.Redis) -> None:
        self.model = load_policy(cfg.model, 0).model
        self.sender = build_sender(cfg, client, 0, "cpu", torch.float32)

    def send(self, seed: int, version: int, wait_file: bool = True) -> dict[str, torch.Tensor]:
        """New weights (from ``seed``) published as ``version``; the state dict it sent."""
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in self.model.parameters():
                p.copy_(torch.randn(p.shape, generator=gen))
        self.result = self.sender.send(self.model, version)
        if wait_file:
            assert self.sender.files is not None and self.sender.files.wait(30)
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    @property
    def address(self) -> str | None:
        return self.sender.address

    def joined(self, n: int, timeout: float = 20.0) -> None:
        hub = self.sender.hub
        assert hub is not None
        deadline = time.monotonic() + timeout
        while int(hub.store.add("tickets", 0)) < n:
            assert time.monotonic() < deadline, "no worker joined the hub"
            time.sleep(0.01)

    def close(self) -> None:
        self.sender.close()


def received(sub: WeightSubscriber, n: int, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while sub.received < n:
        assert time.monotonic() < deadline, f"{n} broadcasts never arrived"
        time.sleep(0.01)


def state_of(engine: HFEngine) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in engine.model.state_dict().items()}


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.timeout(180)
def test_files_and_gloo_broadcast_give_bit_identical_weights(tmp_path, redis_url, redis_prefix):
    cfg = config(tmp_path, redis_url, redis_prefix, "sync.broadcast=true")
    client = redis.Redis.from_url(redis_url)
    learner = Learner(cfg, client)
    hub = learner.sender.hub
    assert hub is not None and hub.backend == "gloo"
    assert learner.address == f"gloo://127.0.0.1:{hub.port}/{hub.secret}"
    engine_a, engine_b = hf_engine(cfg, 1), hf_engine(cfg, 2)
    a = build_subscriber(cfg, client, "a")
    b = build_subscriber(cfg, client, "b")
    try:
        assert a.update(engine_a.receiver) is None and a.version is None  # nothing announced
        w1 = learner.send(1, 1)
        assert learner.result.receivers == 0 and learner.result.file
        nbytes = sum(t.numel() * t.element_size() for _, t in published_tensors(learner.model))
        assert learner.result.nbytes == nbytes
        assert a.update(engine_a.receiver) == 1 and a.source == "file"
        assert a.hub == learner.address and a.joined_broadcast
        assert a.update(engine_a.receiver) is None  # nothing new
        assert_same(state_of(engine_a), w1)
        learner.joined(1)
        w2 = learner.send(2, 2)
        assert learner.result.receivers == 1
        received(a, 1)
        assert a.update(engine_a.receiver) == 2
        assert a.source == "broadcast" and engine_a.policy_version == 2
        # A newcomer reads the same version from the file: bit for bit the broadcast's.
        assert b.update(engine_b.receiver) == 2 and b.source == "file"
        got_a, got_b = state_of(engine_a), state_of(engine_b)
        assert_same(got_a, got_b)
        assert_same(got_a, w2)
        params = SamplingParams(n=3, max_new_tokens=6)
        out_a = engine_a.generate([[5, 6, 7], [8, 9]], params, seed=4)
        out_b = engine_b.generate([[5, 6, 7], [8, 9]], params, seed=4)
        for ga, gb in zip(out_a, out_b, strict=True):
            for sa, sb in zip(ga, gb, strict=True):
                np.testing.assert_array_equal(sa.token_ids, sb.token_ids)
                np.testing.assert_array_equal(sa.logprobs, sb.logprobs)
        # Both follow the broadcast now; the same version is not loaded twice.
        learner.joined(2)
        w3 = learner.send(3, 3)
        assert learner.result.receivers == 2
        received(a, 2)
        assert a.update(engine_a.receiver) == 3 and a.source == "broadcast"
        assert b.update(engine_b.receiver, force=True) == 3 and b.source == "file"
        received(b, 1)  # the broadcast brought b v3 as well: not loaded a second time
        loads = engine_b.loads
        assert b.update(engine_b.receiver) is None and b.version == 3 and engine_b.loads == loads
        assert_same(state_of(engine_a), w3)
        assert_same(state_of(engine_b), w3)
    finally:
        a.close()
        b.close()
        learner.close()


def test_the_file_is_safetensors_in_the_buckets_order(tmp_path, redis_url, redis_prefix):
    """The background writer's file (header from the layout, the mirror's bytes) reads back with
    safetensors as the tensors sent, in the compute dtype."""
    from safetensors.torch import load_file

    cfg = config(tmp_path, redis_url, redis_prefix)
    client = redis.Redis.from_url(redis_url)
    learner = Learner(cfg, client)
    learner.sender.dtype = torch.bfloat16
    learner.sender._plan = None
    try:
        w = learner.send(1, 7)
        ann = learner.sender.store.latest()  # type: ignore[union-attr]
        assert ann is not None and ann.file_version == 7 and ann.path is not None
        got = load_file(str(ann.path))
        want = {n: t.to(torch.bfloat16) for n, t in published_tensors(learner.model)}
        assert got.keys() == want.keys()
        for n in want:
            assert got[n].dtype == torch.bfloat16 and torch.equal(got[n], want[n]), n
        assert set(want) <= set(w)
        metas = [m for b in plan_buckets(want.items(), 4096) for m in b.metas]
        header = safetensors_header(metas, 7, ann.lineage)  # (the lineage: its metadata)
        assert ann.path.read_bytes()[: len(header)] == header
        assert file_lineage(ann.path) == ann.lineage
    finally:
        learner.close()


@pytest.mark.timeout(180)
def test_a_late_joiner_reads_the_newest_file_then_follows_the_broadcast(
    tmp_path, redis_url, redis_prefix
):
    cfg = config(tmp_path, redis_url, redis_prefix, "sync.broadcast=true")
    client = redis.Redis.from_url(redis_url)
    learner = Learner(cfg, client)
    early = hf_engine(cfg, 1)
    e = build_subscriber(cfg, client, "early")
    late_engine = hf_engine(cfg, 2)
    late = build_subscriber(cfg, client, "late")
    try:
        learner.send(1, 1)
        assert e.update(early.receiver) == 1
        learner.joined(1)
        for v in (2, 3, 4):
            w = learner.send(v, v)
        received(e, 3)
        assert late.update(late_engine.receiver) == 4 and late.source == "file"
        assert_same(state_of(late_engine), w)
        learner.joined(2)
        w5 = learner.send(5, 5)
        assert learner.result.receivers == 2
        received(late, 1)
        assert late.update(late_engine.receiver) == 5 and late.source == "broadcast"
        assert_same(state_of(late_engine), w5)
    finally:
        e.close()
        late.close()
        learner.close()


DOOMED = """
import sys, time, torch
from reval.weights.receiver import LocalReceiver
r = LocalReceiver(lambda tensors, version: None, "cpu")
assert r.join(sys.argv[1], "doomed", 3.0)
time.sleep(600)
"""


@pytest.mark.timeout(180)
def test_a_receiver_killed_mid_sync_costs_one_timeout(tmp_path, redis_url, redis_prefix):
    cfg = config(tmp_path, redis_url, redis_prefix, "sync.broadcast=true", "sync.timeout_s=3")
    client = redis.Redis.from_url(redis_url)
    learner = Learner(cfg, client)
    engine = hf_engine(cfg, 1)
    sub = build_subscriber(cfg, client, "alive")
    learner.send(1, 1)
    assert sub.update(engine.receiver) == 1
    doomed = subprocess.Popen([sys.executable, "-c", DOOMED, str(learner.address)], cwd=ROOT)
    try:
        learner.joined(2)
        learner.send(2, 2)
        assert learner.result.receivers == 2
        hub = learner.sender.hub
        assert hub is not None
        # Kill the doomed member as soon as the next sync's headers are out: mid-sync.
        seq = hub.seq + 1

        def kill() -> None:
            while not hub.store.check([f"sync/{hub.generation}/{seq}"]):
                time.sleep(0.001)
            doomed.send_signal(signal.SIGKILL)

        killer = threading.Thread(target=kill)
        killer.start()
        t0 = time.monotonic()
        learner.send(3, 3)
        first = learner.result.receivers
        w4 = learner.send(4, 4)  # re-forms without the dead member
        elapsed = time.monotonic() - t0
        killer.join(10)
        assert first in (0, 2) and learner.result.receivers == 1
        assert elapsed < 3 * 3 + 8, elapsed
        deadline = time.monotonic() + 20
        while sub.update(engine.receiver) != 4:
            assert time.monotonic() < deadline, "v4 never reached the live worker"
            time.sleep(0.05)
        assert_same(state_of(engine), w4)
    finally:
        sub.close()
        learner.close()
        if doomed.poll() is None:
            doomed.kill()


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


class PeakRSS:
    """The peak resident memory while a block runs, above what it was before."""

    def __enter__(self) -> PeakRSS:
        self.base = self.peak = _rss()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()
        return self

    def _watch(self) -> None:
        while not self.stop.is_set():
            self.peak = max(self.peak, _rss())
            time.sleep(0.0005)

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()
        self.peak = max(self.peak, _rss())

    @property
    def growth(self) -> int:
        return self.peak - self.base


def big_model(mb: int) -> nn.Module:
    layers = [nn.Linear(1024, 1024) for _ in range(mb // 4)]
    return nn.Sequential(*layers)


@pytest.mark.timeout(180)
def test_the_sender_builds_no_full_host_copy_and_keeps_to_its_buckets(
    tmp_path, redis_url, redis_prefix, monkeypatch
):
    """A 96 MB model sent over gloo to a member and to a file: no full state dict (the old path's
    ``get_model_state_dict``) and, once the file mirror exists, no memory beyond the bucket
    bound; the meter itself sees a full copy when one is made."""
    import torch.distributed.checkpoint.state_dict as dcp_sd

    def refuse(*a: object, **k: object) -> None:
        raise AssertionError("publish built a full state dict")

    monkeypatch.setattr(dcp_sd, "get_model_state_dict", refuse)
    bucket = 1 << 20
    cfg = config(tmp_path, redis_url, redis_prefix, "sync.broadcast=true", "sync.bucket_mb=1")
    client = redis.Redis.from_url(redis_url)
    sender = build_sender(cfg, client, 0, "cpu", torch.float32)
    model = big_model(96)
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    hub = sender.hub
    assert hub is not None
    got_path = tmp_path / "received.pt"
    member = subprocess.Popen(
        [sys.executable, "-c", MEMBER, str(sender.address), str(got_path)], cwd=ROOT
    )  # (in a process of its own: its buffers are not the learner's memory)
    try:
        while int(hub.store.add("tickets", 0)) < 1:
            time.sleep(0.01)
        assert sender.send(model, 1).receivers == 1
        assert sender.files is not None and sender.files.wait(60)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        allocated = hub.pool.allocated
        with PeakRSS() as meter:
            assert sender.send(model, 2).receivers == 1
        assert sender.files.wait(60)
        assert hub.pool.allocated == allocated  # steady state: the buffers are reused
        assert allocated <= IN_FLIGHT + 2
        bound = (IN_FLIGHT + 2) * bucket + (16 << 20)  # buckets + one bucket's gather + slack
        assert meter.growth < bound, (meter.growth, bound, model_bytes)
        with PeakRSS() as calibration:  # what a full host copy looks like to the meter
            copy = [p.detach().clone() for p in model.parameters()]
        assert calibration.growth > 0.8 * model_bytes
        del copy
        assert member.wait(60) == 0
        got = torch.load(got_path)
        want = dict(published_tensors(model))
        assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want)
    finally:
        if member.poll() is None:
            member.kill()
        sender.close()


MEMBER = """
import sys, time, torch
from reval.weights.receiver import LocalReceiver
got = {}
def load(tensors, version):
    if version == 2:
        got.update((n, t.clone()) for n, t in tensors)
r = LocalReceiver(load, "cpu")
assert r.join(sys.argv[1], "member", 20.0)
deadline = time.monotonic() + 60
while not got and time.monotonic() < deadline:
    r.take(None)
    time.sleep(0.01)
torch.save(got, sys.argv[2])
r.leave()
"""


@pytest.mark.timeout(120)
def test_the_learner_never_waits_for_the_disk(tmp_path, redis_url, redis_prefix, monkeypatch):
    """While a file is being written (here: a disk that takes 2 s), the next versions are
    announced and broadcast at once, their files skipped; a worker without the broadcast keeps
    the older file's version and loads the next file written."""
    cfg = config(tmp_path, redis_url, redis_prefix)
    client = redis.Redis.from_url(redis_url)
    learner = Learner(cfg, client)
    store = learner.sender.store
    assert store is not None
    slow = threading.Event()
    atomic = store._atomic

    def slow_atomic(path: Path, write: object) -> None:
        if slow.is_set():
            time.sleep(2.0)
        atomic(path, write)

    monkeypatch.setattr(store, "_atomic", slow_atomic)
    engine = hf_engine(cfg, 1)
    sub = build_subscriber(cfg, client, "files-only")
    try:
        learner.send(1, 1)
        assert sub.update(engine.receiver) == 1
        slow.set()
        t0 = time.monotonic()
        w2 = learner.send(2, 2, wait_file=False)
        learner.send(3, 3, wait_file=False)
        assert not learner.result.file  # v2's file still being written: v3's skipped
        assert time.monotonic() - t0 < 1.5  # the learner did not wait for the disk
        ann = store.latest()
        assert ann is not None and ann.version == 3 and ann.file_version == 1
        assert sub.update(engine.receiver) is None and sub.version == 1
        assert learner.sender.files is not None and learner.sender.files.wait(30)
        assert learner.sender.files.skipped == 1
        assert sub.update(engine.receiver) == 2  # the newest file: two versions lag at most
        assert_same(state_of(engine), w2)
    finally:
        sub.close()
        learner.close()


@pytest.mark.timeout(180)
def test_a_resumed_learner_is_followed_to_a_lower_version(tmp_path, redis_url, redis_prefix):
    cfg = config(tmp_path, redis_url, redis_prefix, "sync.broadcast=true")
    client = redis.Redis.from_url(redis_url)
    first = Learner(cfg, client)
    engine = hf_engine(cfg, 1)
    sub = build_subscriber(cfg, client, "w")
    second = third = None
    try:
        first.send(1, 5)
        assert sub.update(engine.receiver) == 5 and sub.hub == first.address
        first.close()
        second = Learner(cfg, client)  # resumed from step 3, on a new port: a new lineage
        assert second.address != first.address
        assert second.sender.lineage != first.sender.lineage
        w3 = second.send(3, 3)
        assert sub.update(engine.receiver) == 3 and sub.source == "file"
        assert sub.hub == second.address
        assert_same(state_of(engine), w3)
        second.joined(1)
        w4 = second.send(4, 4)
        assert second.result.receivers == 1
        received(sub, 1)
        assert sub.update(engine.receiver) == 4 and sub.source == "broadcast"
        assert_same(state_of(engine), w4)
        second.close()
        # Restarted once more, without a hub: the subscriber leaves the old one. Versions 3-5
        # are on disk; the lower version 2 is the newest file, not the first pruned.
        third = Learner(config(tmp_path, redis_url, redis_prefix), client)
        w2 = third.send(2, 2)
        ann = third.sender.store.latest()  # type: ignore[union-attr]
        assert ann is not None and ann.version == 2 and ann.broadcast is None
        on_disk = sorted(p.name for p in (cfg.run_dir / "weights").iterdir())
        assert on_disk == [f"v0000000{v}.safetensors" for v in (2, 3, 4)]
        assert sub.update(engine.receiver) == 2 and sub.source == "file"
        assert sub.hub is None and not sub._receiver
        assert_same(state_of(engine), w2)
    finally:
        sub.close()
        for learner in (second, third):
            if learner is not None:
                learner.close()


def test_a_new_lineage_does_not_offer_the_old_ones_file(tmp_path, redis_url, redis_prefix):
    """A resumed learner's first announcement drops the previous learner's file: a worker never
    takes the old lineage's file for the new one's."""
    cfg = config(tmp_path, redis_url, redis_prefix)
    client = redis.Redis.from_url(redis_url)
    store = WeightStore(client, redis_prefix, "ws", cfg.run_dir / "weights")
    store.announce(5, "old", None, first=True)
    path = store.write([("x", torch.ones(2))], 5)
    assert store.announce_file(5, path, "old")
    store.announce(3, "new", None, first=True)
    ann = store.latest()
    assert ann is not None and (ann.version, ann.lineage, ann.path) == (3, "new", None)
    assert not store.announce_file(5, path, "old")  # the old learner's late writer: ignored
    assert store.latest().path is None  # type: ignore[union-attr]


def test_an_nccl_hub_and_an_engine_off_cuda_means_files(tmp_path, redis_url, redis_prefix):
    cfg = config(tmp_path, redis_url, redis_prefix)
    client = redis.Redis.from_url(redis_url)
    store = WeightStore(client, redis_prefix, "ws", cfg.run_dir / "weights")
    w = dict(published_tensors(load_policy(cfg.model, 3).model))
    store.announce(2, "l", "nccl://127.0.0.1:9/s", first=True)
    store.announce_file(2, store.write(w.items(), 2), "l")
    engine = hf_engine(cfg, 1)
    sub = build_subscriber(cfg, client, "w")
    try:
        assert sub.update(engine.receiver) == 2 and sub.source == "file"
        assert sub.hub == "nccl://127.0.0.1:9/s" and not sub.joined_broadcast
        assert all(torch.equal(engine.model.get_parameter(n), t) for n, t in w.items())
        store.announce(3, "l", "nccl://127.0.0.1:9/s", first=False)
        store.announce_file(3, store.write(w.items(), 3), "l")
        assert sub.update(engine.receiver) == 3
    finally:
        sub.close()


def test_sender_without_a_hub_and_the_backend_choice(tmp_path, redis_url, redis_prefix):
    client = redis.Redis.from_url(redis_url)
    cfg = config(tmp_path, redis_url, redis_prefix)
    sender = build_sender(cfg, client, 0, "cpu", torch.float32)
    assert sender.hub is None and sender.address is None
    assert build_sender(cfg, None, 1, "cpu", torch.float32).store is None  # other ranks gather
    # sync.backend overrides the choice from the device; an NCCL hub needs a CUDA device.
    gloo = build_sender(
        config(tmp_path, redis_url, redis_prefix, "sync.broadcast=true", "sync.backend=gloo",
               "sync.broadcast_host=learner-0", "sync.broadcast_bind=127.0.0.1"),
        client, 0, "cuda", torch.bfloat16,
    )  # fmt: skip
    try:
        assert gloo.hub is not None and gloo.hub.backend == "gloo"
        assert gloo.hub.device == torch.device("cpu")
        assert gloo.address == f"gloo://learner-0:{gloo.hub.port}/{gloo.hub.secret}"
    finally:
        gloo.close()
    nccl = config(tmp_path, redis_url, redis_prefix, "sync.broadcast=true", "sync.backend=nccl")
    with pytest.raises(ValueError, match="CUDA"):
        build_sender(nccl, client, 0, "cpu", torch.float32)


def test_the_worker_uses_only_the_subscriber():
    """The rollout worker reconciles no sources by hand: no file store, no receiver, no hub."""
    source = (ROOT / "rollout" / "worker.py").read_text()
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            names.add(node.module or "")
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.Attribute):
            names.add(node.attr)
    forbidden = {"WeightStore", "BroadcastReceiver", "BroadcastHub", "LocalReceiver",
                 "reval.weights.collective"}  # fmt: skip
    assert not names & forbidden
    assert not any(word in source for word in forbidden)
    assert "build_subscriber" in names and "update" in names


def test_the_engines_implement_the_receiver_protocol_without_probing():
    """Every engine declares its receiver; nothing on the weight path asks an engine with
    ``getattr`` what it can do."""
    from reval.weights.receiver import LocalReceiver, WeightReceiver
    from rollout.vllm_worker import VLLMReceiver

    for cls in (LocalReceiver, VLLMReceiver):
        for name in ("load_file", "join", "take", "received", "leave"):
            assert callable(getattr(cls, name)), (cls, name)
            assert name in WeightReceiver.__dict__
    for path in ("reval/weights/receiver.py", "reval/weights/sender.py"):
        assert "getattr(" not in (ROOT / path).read_text(), path


def test_an_auto_broadcast_host_announces_the_learners_own_address(
    tmp_path, redis_url, redis_prefix, monkeypatch
):
    import reval.weights.sender as ws

    monkeypatch.setattr(ws.socket, "getfqdn", lambda: "learner-0.reval.svc")
    monkeypatch.setattr(
        ws.socket, "gethostbyname", lambda name: {"learner-0.reval.svc": "10.4.0.7"}[name]
    )
    client = redis.Redis.from_url(redis_url)
    cfg = config(tmp_path, redis_url, redis_prefix, "sync.broadcast=true",
                 "sync.broadcast_host=auto", "sync.broadcast_bind=127.0.0.1")  # fmt: skip
    learner = Learner(cfg, client)
    try:
        hub = learner.sender.hub
        assert hub is not None
        assert learner.address == f"gloo://10.4.0.7:{hub.port}/{hub.secret}"
        learner.send(1, 1)  # (no member: nothing is sent)
        ann = learner.sender.store.latest()  # type: ignore[union-attr]
        assert ann is not None and ann.broadcast == learner.address
    finally:
        learner.close()
    monkeypatch.setattr(ws.socket, "gethostbyname", lambda name: (_ for _ in ()).throw(OSError()))
    assert ws.discover_host() == "learner-0.reval.svc"  # a name that does not resolve: as is


@pytest.mark.parametrize("damage", ["pruned", "cut short", "not safetensors"])
def test_an_unreadable_announced_file_keeps_the_weights_in_hand(
    tmp_path, redis_url, redis_prefix, damage
):
    """The weights-file race: the learner prunes (or a shared volume cuts short) the file a
    worker is about to read; neither may end the worker."""
    cfg = config(tmp_path, redis_url, redis_prefix)
    client = redis.Redis.from_url(redis_url)
    learner = Learner(cfg, client)
    engine = hf_engine(cfg, 1)
    sub = WeightSubscriber(learner.sender.store, "w")  # type: ignore[arg-type]
    try:
        w1 = learner.send(1, 1)
        assert sub.update(engine.receiver) == 1
        learner.send(2, 2)
        path = learner.sender.store.path_of(2)  # type: ignore[union-attr]
        if damage == "pruned":
            path.unlink()
        elif damage == "cut short":
            path.write_bytes(path.read_bytes()[:-64])
        else:
            path.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}garbage")
        assert sub.update(engine.receiver) is None
        assert sub.version == 1
        assert_same(state_of(engine), w1)
        learner.send(3, 3)
        assert sub.update(engine.receiver) == 3  # the next announcement is read as usual
    finally:
        sub.close()
        learner.close()


def test_two_ranks_gather_and_rank_0_sends(tmp_path, redis_url, redis_prefix):
    """Under FSDP2 over two gloo ranks every rank gathers each tensor in the compute dtype and
    rank 0's file holds the full weights, bit for bit the model's cast."""
    script = tmp_path / "two_ranks.py"  # (spawned ranks import their function from a file)
    script.write_text(TWO_RANKS)
    out = subprocess.run(
        [sys.executable, str(script), redis_url, redis_prefix, str(tmp_path)],
            cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "same"


TWO_RANKS = r"""
import os, sys, socket
import torch, torch.distributed as dist, torch.multiprocessing as mp

def rank_main(rank, port, url, prefix, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    import redis
    from torch.distributed.device_mesh import init_device_mesh
    from reval.config import load_config
    from reval.policy import load_policy
    from learner.parallel import shard
    from reval.weights.sender import build_sender
    cfg = load_config(overrides=["buffer.backend=redis", f"redis.url={url}",
        f"redis.prefix={prefix}", f"output_dir={out}", "name=two", "sync.bucket_mb=0.02"],
        environ={})
    model = load_policy(cfg.model, 0).model
    full = {k: v.detach().to(torch.bfloat16).clone() for k, v in model.named_parameters()}
    shard(model, init_device_mesh("cpu", (2,)), torch.bfloat16)
    client = redis.Redis.from_url(url) if rank == 0 else None
    sender = build_sender(cfg, client, rank, "cpu", torch.bfloat16)
    sender.send(model, 1)
    if rank == 0:
        from safetensors.torch import load_file
        sender.files.wait(60)
        got = load_file(str(sender.store.latest().path))
        same = got.keys() == full.keys() and all(torch.equal(got[k], full[k]) for k in full)
        print("same" if same else "different", flush=True)
    sender.close()
    dist.barrier()  # both ranks tear gloo down together (rank 1 alone aborted once, loaded CI)
    dist.destroy_process_group()

if __name__ == "__main__":
    s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
    mp.spawn(rank_main, args=(port, *sys.argv[1:4]), nprocs=2)
"""
