"""One publisher, one subscriber (``reval/weight_sync.py``), against the real Redis and real gloo
groups: a subscriber loads the same weights whether they came through the files or the
broadcast; it follows a resumed learner (a new hub, a lower version); it keeps to the files when
the hub speaks NCCL and its engine is off CUDA; a bucket-loading engine gets the learner's buckets
as they were packed, once; an engine that receives in processes of its own (vLLM's adapter; the
real one in ``test_vllm_weights.py``) gets the hub's address and the files' paths, never tensors
from the subscriber; and the rollout worker uses nothing but the subscriber."""

from __future__ import annotations

import ast
import time
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import pytest
import redis
import torch
from safetensors.torch import load_file

from reval.broadcast import BroadcastReceiver, parse_address
from reval.config import RunConfig, load_config
from reval.policy import load_policy
from reval.weight_sync import (
    WeightPublisher,
    WeightStore,
    WeightSubscriber,
    build_publisher,
    build_subscriber,
)
from reval.weights import Bucket, plan_buckets
from rollout.engines import HFEngine, SamplingParams

ROOT = Path(__file__).resolve().parents[2]
BUCKET_MB = 0.02  # ~20 KB: the tiny model's weights go in many buckets


def config(tmp_path: Path, url: str, prefix: str, *extra: str) -> RunConfig:
    return load_config(
        overrides=[
            "buffer.backend=redis",
            f"buffer.redis_url={url}",
            f"buffer.key_prefix={prefix}",
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


def learner_weights(cfg: RunConfig, seed: int) -> dict[str, torch.Tensor]:
    """A full state dict like the learner's (tied aliases included), away from any engine's."""
    model = load_policy(cfg.model, 0).model
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5 * torch.randn(p.shape, generator=gen))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def joined(publisher: WeightPublisher, n: int, timeout: float = 20.0) -> None:
    hub = publisher.hub
    assert hub is not None
    deadline = time.monotonic() + timeout
    while int(hub.store.add("tickets", 0)) < n:
        assert time.monotonic() < deadline, "no worker joined the hub"
        time.sleep(0.01)


def received(sub: WeightSubscriber, n: int, timeout: float = 20.0) -> None:
    """Wait until the broadcast has delivered ``n`` versions to ``sub`` (the learner announces
    the file first: an update before the broadcast lands reads the file)."""
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


class BucketEngine:
    """An engine that takes packed buckets (as ``VLLMEngine`` does), recording what it got."""

    def __init__(self) -> None:
        self.policy_version = 0
        self.got: list[tuple[bytes, bytes]] = []
        self.plain_loads = 0

    def load_buckets(self, buckets: Iterable[Bucket], version: int) -> None:
        self.got = [(b.header(), b.data.numpy().tobytes()) for b in buckets]
        self.policy_version = version

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        self.plain_loads += 1
        self.policy_version = version


class SelfReceivingEngine(CountingEngine):
    """An engine that receives broadcasts and reads files in "processes of its own" (as
    ``VLLMEngine`` does inside its vLLM workers; here a ``BroadcastReceiver`` it owns), so that
    the subscriber holds no receiver and never loads tensors itself."""

    def __init__(self, cfg: RunConfig, seed: int) -> None:
        policy = load_policy(cfg.model, seed)
        policy.model.eval()
        super().__init__(policy.model, policy.pad_id, policy.eos_id, policy.device)
        self.receiver: BroadcastReceiver | None = None
        self.broadcast_backend: str | None = None
        self.calls: list[str] = []

    def load_weights_file(self, path: Path, version: int) -> None:
        self.calls.append("file")
        self.load_weights(load_file(str(path)).items(), version)

    def join_broadcast(self, address: str, worker_id: str, timeout_s: float) -> bool:
        self.calls.append("join")
        backend, host, port, secret = parse_address(address)
        if backend != "gloo":
            return False
        self.receiver = BroadcastReceiver(host, port, worker_id, secret, timeout_s=timeout_s)
        self.broadcast_backend = backend
        return True

    def broadcast_state(self) -> tuple[int | None, int]:
        r = self.receiver
        return (r.latest_version, r.received) if r is not None else (None, 0)

    def take_broadcast(self, newer_than: int | None) -> int | None:
        self.calls.append("take")
        got = self.receiver.take() if self.receiver is not None else None
        if got is None or (newer_than is not None and got[0] <= newer_than):
            return None
        self.load_weights(got[1], got[0])
        return got[0]

    def leave_broadcast(self) -> None:
        self.calls.append("leave")
        if self.receiver is not None:
            self.receiver.close()
        self.receiver, self.broadcast_backend = None, None


@pytest.mark.timeout(180)
def test_files_and_gloo_broadcast_load_the_same_weights(tmp_path, redis_url, redis_prefix):
    cfg = config(tmp_path, redis_url, redis_prefix, "sync.broadcast=true")
    client = redis.Redis.from_url(redis_url)
    publisher = build_publisher(cfg, client, torch.device("cpu"))
    assert publisher.hub is not None and publisher.hub.backend == "gloo"
    assert publisher.address == f"gloo://127.0.0.1:{publisher.hub.port}/{publisher.hub.secret}"
    engine_a, engine_b = hf_engine(cfg, 1), hf_engine(cfg, 2)
    a = build_subscriber(cfg, client, "a")
    b = build_subscriber(cfg, client, "b")
    try:
        assert a.update(engine_a) is None and a.version is None  # nothing announced yet
        w1 = learner_weights(cfg, 1)
        r1 = publisher.publish(w1.items(), 1)
        assert r1.receivers == 0 and r1.version == 1 and r1.path.is_file()
        assert r1.nbytes == sum(t.numel() * t.element_size() for t in w1.values())
        assert a.update(engine_a) == 1 and a.source == "file" and a.backend == "gloo"
        assert a.hub == publisher.address and a.joined_broadcast
        assert a.update(engine_a) is None  # nothing new
        joined(publisher, 1)
        w2 = learner_weights(cfg, 2)
        assert publisher.publish(w2.items(), 2).receivers == 1
        received(a, 1)
        assert a.update(engine_a) == 2
        assert a.source == "broadcast" and engine_a.policy_version == 2
        # A newcomer reads the same version from the file.
        assert b.update(engine_b) == 2 and b.source == "file"
        assert engine_b.policy_version == 2
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
        joined(publisher, 2)
        w3 = learner_weights(cfg, 3)
        assert publisher.publish(w3.items(), 3).receivers == 2
        received(a, 2)
        assert a.update(engine_a) == 3 and a.source == "broadcast"
        assert b.update(engine_b, force=True) == 3 and b.source == "file"  # not the broadcast
        received(b, 1)  # the broadcast brought b v3 as well: not loaded a second time
        loads = engine_b.loads
        assert b.update(engine_b) is None and b.version == 3 and engine_b.loads == loads
        assert_same(state_of(engine_a), w3)
        assert_same(state_of(engine_b), w3)
    finally:
        a.close()
        b.close()
        publisher.close()


@pytest.mark.timeout(180)
def test_bucket_engines_get_the_learners_buckets_unrepacked(tmp_path, redis_url, redis_prefix):
    """The broadcast's buckets reach an engine that loads buckets exactly as the learner packed
    them: no second packing into other buckets."""
    cfg = config(tmp_path, redis_url, redis_prefix, "sync.broadcast=true")
    client = redis.Redis.from_url(redis_url)
    publisher = build_publisher(cfg, client, "cpu")
    fake = BucketEngine()
    s1 = build_subscriber(cfg, client, "bucket-engine")
    try:
        w1 = learner_weights(cfg, 1)
        publisher.publish(w1.items(), 1)
        assert s1.update(fake) == 1 and fake.plain_loads == 1  # a file: plain tensors
        joined(publisher, 1)
        w2 = learner_weights(cfg, 2)
        assert publisher.publish(w2.items(), 2).receivers == 1
        received(s1, 1)
        assert s1.update(fake) == 2 and s1.source == "broadcast"
        plan = plan_buckets(w2.items(), int(BUCKET_MB * (1 << 20)), 2)
        assert len(plan) > 3
        assert fake.got == [(p.header(), p.pack().data.numpy().tobytes()) for p in plan]
    finally:
        s1.close()
        publisher.close()


@pytest.mark.timeout(180)
def test_an_engine_that_receives_itself_gets_everything_past_the_subscriber(
    tmp_path, redis_url, redis_prefix
):
    """An engine with its own receiver (the vLLM engine's shape): the subscriber joins the hub
    through it, takes broadcasts through it and hands it announced files by path; it holds no
    receiver of its own, and a version is still loaded once, newest first."""
    cfg = config(tmp_path, redis_url, redis_prefix, "sync.broadcast=true")
    client = redis.Redis.from_url(redis_url)
    publisher = build_publisher(cfg, client, "cpu")
    engine = SelfReceivingEngine(cfg, 1)
    sub = build_subscriber(cfg, client, "self-receiving")
    try:
        w1 = learner_weights(cfg, 1)
        publisher.publish(w1.items(), 1)
        assert sub.update(engine) == 1 and sub.source == "file"
        assert engine.calls == ["join", "file"] and engine.loads == 1
        assert sub._receiver is None and sub.joined_broadcast and sub.backend == "gloo"
        joined(publisher, 1)
        w2 = learner_weights(cfg, 2)
        assert publisher.publish(w2.items(), 2).receivers == 1
        received(sub, 1)
        assert sub.update(engine) == 2 and sub.source == "broadcast"
        assert_same(state_of(engine), w2)
        assert sub.update(engine) is None and engine.loads == 2  # v2 is not read from the file
        sub.close()
        assert engine.calls[-1] == "leave" and engine.receiver is None
    finally:
        sub.close()
        publisher.close()


@pytest.mark.timeout(180)
def test_a_resumed_learner_with_a_new_hub_and_a_lower_version(tmp_path, redis_url, redis_prefix):
    cfg = config(tmp_path, redis_url, redis_prefix, "sync.broadcast=true")
    client = redis.Redis.from_url(redis_url)
    first = build_publisher(cfg, client, "cpu")
    engine = hf_engine(cfg, 1)
    sub = build_subscriber(cfg, client, "w")
    second = None
    try:
        first.publish(learner_weights(cfg, 1).items(), 5)
        assert sub.update(engine) == 5 and sub.hub == first.address
        first.close()
        second = build_publisher(cfg, client, "cpu")  # resumed from step 3, on a new port
        assert second.address != first.address
        w3 = learner_weights(cfg, 3)
        second.publish(w3.items(), 3)
        assert sub.update(engine) == 3 and sub.source == "file" and sub.hub == second.address
        assert_same(state_of(engine), w3)
        joined(second, 1)
        w4 = learner_weights(cfg, 4)
        assert second.publish(w4.items(), 4).receivers == 1
        received(sub, 1)
        assert sub.update(engine) == 4 and sub.source == "broadcast"
        assert_same(state_of(engine), w4)
        # Restarted once more, without a hub: the subscriber leaves the old one. Versions 3-5
        # are still on disk; the lower version 2 is the newest file, not the first pruned.
        store = WeightStore(client, redis_prefix, "ws", cfg.run_dir / "weights")
        store.publish(w3.items(), 2)
        ann = store.latest()
        assert ann is not None and ann.version == 2 and ann.broadcast is None
        on_disk = sorted(p.name for p in (cfg.run_dir / "weights").iterdir())
        assert on_disk == [f"v0000000{v}.safetensors" for v in (2, 3, 4)]
        assert sub.update(engine) == 2 and sub.source == "file"
        assert sub.hub is None and sub.backend is None
        assert_same(state_of(engine), w3)
    finally:
        sub.close()
        if second is not None:
            second.close()


def test_an_nccl_hub_and_an_engine_off_cuda_means_files(tmp_path, redis_url, redis_prefix):
    cfg = config(tmp_path, redis_url, redis_prefix)
    client = redis.Redis.from_url(redis_url)
    store = WeightStore(client, redis_prefix, "ws", cfg.run_dir / "weights")
    w = learner_weights(cfg, 1)
    store.publish(w.items(), 2, broadcast="nccl://127.0.0.1:9/s")
    engine = hf_engine(cfg, 1)
    sub = build_subscriber(cfg, client, "w")
    try:
        assert sub.update(engine) == 2 and sub.source == "file"
        assert sub.hub == "nccl://127.0.0.1:9/s" and sub.backend is None
        assert not sub.joined_broadcast
        assert_same(state_of(engine), w)
        store.publish(w.items(), 3, broadcast="nccl://127.0.0.1:9/s")
        assert sub.update(engine) == 3 and sub.backend is None
    finally:
        sub.close()


def test_publisher_without_a_hub_and_the_backend_choice(tmp_path, redis_url, redis_prefix):
    client = redis.Redis.from_url(redis_url)
    cfg = config(tmp_path, redis_url, redis_prefix)
    publisher = build_publisher(cfg, client, "cpu")
    assert publisher.hub is None and publisher.address is None
    w = learner_weights(cfg, 1)
    r = publisher.publish(iter(w.items()), 4)  # any iterable, read once
    assert r.receivers == 0 and r.path == cfg.run_dir / "weights" / "v00000004.safetensors"
    ann = publisher.store.latest()
    assert ann is not None and ann.version == 4 and ann.broadcast is None
    # sync.backend overrides the choice from the device; an NCCL hub needs a CUDA device.
    gloo = build_publisher(
        config(tmp_path, redis_url, redis_prefix, "sync.broadcast=true", "sync.backend=gloo",
               "sync.broadcast_host=learner-0", "sync.broadcast_bind=127.0.0.1"),
        client,
        "cuda",
    )  # fmt: skip
    try:
        assert gloo.hub is not None and gloo.hub.backend == "gloo"
        assert gloo.hub.device == torch.device("cpu")
        assert gloo.address == f"gloo://learner-0:{gloo.hub.port}/{gloo.hub.secret}"
    finally:
        gloo.close()
    nccl = config(tmp_path, redis_url, redis_prefix, "sync.broadcast=true", "sync.backend=nccl")
    with pytest.raises(ValueError, match="CUDA"):
        build_publisher(nccl, client, "cpu")


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
    forbidden = {"WeightStore", "BroadcastReceiver", "BroadcastHub", "reval.broadcast"}
    assert not names & forbidden
    assert not any(word in source for word in forbidden)
    assert "build_subscriber" in names and "update" in names


def test_an_auto_broadcast_host_announces_the_learners_own_address(
    tmp_path, redis_url, redis_prefix, monkeypatch
):
    """``sync.broadcast_host = "auto"``: the hub is announced at the address other hosts reach
    the learner at (its host name resolved), not at the loopback address."""
    import reval.weight_sync as ws

    monkeypatch.setattr(ws.socket, "getfqdn", lambda: "learner-0.reval.svc")
    monkeypatch.setattr(
        ws.socket, "gethostbyname", lambda name: {"learner-0.reval.svc": "10.4.0.7"}[name]
    )
    client = redis.Redis.from_url(redis_url)
    cfg = config(
        tmp_path,
        redis_url,
        redis_prefix,
        "sync.broadcast=true",
        "sync.broadcast_host=auto",
        "sync.broadcast_bind=127.0.0.1",  # (10.4.0.7 is not this machine's)
    )
    publisher = build_publisher(cfg, client, "cpu")
    try:
        assert publisher.hub is not None
        assert publisher.address == f"gloo://10.4.0.7:{publisher.hub.port}/{publisher.hub.secret}"
        publisher.publish(learner_weights(cfg, 1).items(), 1)  # (no member: nothing is sent)
        ann = publisher.store.latest()
        assert ann is not None and ann.broadcast == publisher.address
    finally:
        publisher.close()
    monkeypatch.setattr(ws.socket, "gethostbyname", lambda name: (_ for _ in ()).throw(OSError()))
    assert ws.discover_host() == "learner-0.reval.svc"  # a name that does not resolve: as is


@pytest.mark.parametrize("damage", ["pruned", "cut short", "not safetensors"])
def test_an_unreadable_announced_file_keeps_the_weights_in_hand(
    tmp_path, redis_url, redis_prefix, damage
):
    """The weights-file race (issue 19): the learner prunes (or a shared volume cuts short) the
    file a worker is about to read. safetensors raises FileNotFoundError for a missing file but
    SafetensorError for a damaged one; neither may end the worker."""
    cfg = config(tmp_path, redis_url, redis_prefix)
    client = redis.Redis.from_url(redis_url)
    store = WeightStore(client, redis_prefix, "ws", cfg.run_dir / "weights")
    engine = hf_engine(cfg, 1)
    sub = WeightSubscriber(store, "w")
    w1 = learner_weights(cfg, 1)
    store.publish(w1.items(), 1)
    assert sub.update(engine) == 1
    path = store.publish(learner_weights(cfg, 2).items(), 2)
    if damage == "pruned":
        path.unlink()
    elif damage == "cut short":
        path.write_bytes(path.read_bytes()[:-64])
    else:
        path.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}garbage")
    assert sub.update(engine) is None  # before: SafetensorError out of the worker's loop
    assert sub.version == 1
    assert_same(state_of(engine), w1)
    store.publish(learner_weights(cfg, 3).items(), 3)
    assert sub.update(engine) == 3  # the next announcement is read as usual
    sub.close()
