"""LoRA's adapters published alone (``model.lora.publish = "adapter"``, issue 41): the base
travels once per learner (a base file announced beside the versions), every version holds only
the adapters, and an HF worker built from another seed (another base) ends up computing exactly
what the learner's policy computes; over files and over the gloo broadcast."""

from __future__ import annotations

import time

import pytest
import redis
import torch

from reval import lora
from reval.policy import load_policy
from reval.weights.receiver import build_subscriber
from reval.weights.sender import adapter_base, build_sender, published_tensors
from rollout.generators import build_engine
from tests.integration.test_weight_sync import config

IDS = torch.tensor([[5, 9, 12, 7, 3, 20, 1, 8]])


def _logp(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits.float().log_softmax(-1)


def _train_a_little(model: torch.nn.Module, seed: int) -> None:
    """Move the adapters (as updates do): every A and B gets new values."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in lora.adapter_parameters(model):
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)


def _wait_file(store, version: int) -> None:
    deadline = time.monotonic() + 30
    while (ann := store.latest()) is None or ann.file_version != version:
        assert time.monotonic() < deadline, "the file was never announced"
        time.sleep(0.02)


def learner_and_worker(tmp_path, redis_url: str, redis_prefix: str, *extra: str) -> tuple:
    """A LoRA learner publishing its adapters alone (``model.lora.rank=8``: the policy, its
    sender) and a worker built from another seed (another base: its engine, its subscriber)."""
    extra = ("model.lora.rank=8", "model.lora.publish=adapter", "sync.broadcast_bind=127.0.0.1",
             "sync.broadcast_host=127.0.0.1", *extra)  # fmt: skip
    cfg = config(tmp_path, redis_url, redis_prefix, *extra)
    client = redis.Redis.from_url(redis_url)
    policy = lora.wrap(load_policy(cfg.model, 0).model, cfg.model.lora).eval()
    sender = build_sender(cfg, client, 0, "cpu", torch.float32)
    engine, _ = build_engine(cfg, seed=7)
    return policy, sender, engine, build_subscriber(cfg, client, "w0")


@pytest.mark.parametrize("broadcast", [False, True], ids=["files", "broadcast"])
def test_adapters_alone_reach_an_hf_worker_on_the_learners_base(
    tmp_path, redis_url, redis_prefix, broadcast
):
    policy, sender, engine, sub = learner_and_worker(tmp_path, redis_url, redis_prefix,
                                                     f"sync.broadcast={broadcast}")  # fmt: skip
    try:
        assert lora.is_lora(engine.model)  # type: ignore[attr-defined]
        assert not torch.allclose(_logp(engine.model), _logp(policy))  # type: ignore[attr-defined]
        _train_a_little(policy, 1)
        first = sender.send(policy, 1)
        adapter_bytes = sum(t.numel() * 4 for _, t in lora.adapter_parameters(policy))
        assert first.nbytes == adapter_bytes  # a version holds the adapters, nothing else
        _wait_file(sender.store, 1)
        ann = sender.store.latest()
        assert ann is not None and ann.base is not None and ann.base.is_file()
        assert sub.update(engine.receiver) == 1 and sub.base == ann.base
        torch.testing.assert_close(_logp(engine.model), _logp(policy), rtol=0, atol=1e-6)  # type: ignore[attr-defined]
        for version in (2, 3):
            _train_a_little(policy, version)
            sender.send(policy, version)
            _wait_file(sender.store, version)
            if broadcast:  # (the hub's version arrives on the receiver's thread)
                deadline = time.monotonic() + 30
                while engine.receiver.ready() != version:  # type: ignore[attr-defined]
                    assert time.monotonic() < deadline
                    time.sleep(0.02)
            assert sub.update(engine.receiver) == version
            torch.testing.assert_close(_logp(engine.model), _logp(policy), rtol=0, atol=1e-6)  # type: ignore[attr-defined]
        assert sub.base == ann.base  # the base came once
        if broadcast:
            assert sub.source == "broadcast"
        assert len(list(sender.store.dir.glob("base-*.safetensors"))) == 1
    finally:
        sub.close()
        sender.close()


def test_merged_publish_is_the_base_names_and_the_adapted_weights(tmp_path, redis_url,
                                                                  redis_prefix):  # fmt: skip
    cfg = config(tmp_path, redis_url, redis_prefix, "model.lora.rank=8")
    policy = lora.wrap(load_policy(cfg.model, 0).model, cfg.model.lora).eval()
    _train_a_little(policy, 1)
    sender = build_sender(cfg, redis.Redis.from_url(redis_url), 0, "cpu", torch.float32)
    engine, _ = build_engine(cfg, seed=7)  # merged: an unwrapped engine
    sub = build_subscriber(cfg, redis.Redis.from_url(redis_url), "w0")
    try:
        assert not lora.is_lora(engine.model)  # type: ignore[attr-defined]
        names = [n for n, _ in published_tensors(policy, lora_publish="merged")]
        assert names == [n for n, _ in published_tensors(engine.model)]  # type: ignore[attr-defined]
        sender.send(policy, 1)
        _wait_file(sender.store, 1)
        assert sub.update(engine.receiver) == 1
        ann = sender.store.latest()
        assert ann is not None and ann.base is None  # nothing to apply adapters to
        torch.testing.assert_close(_logp(engine.model), _logp(policy), rtol=0, atol=1e-5)  # type: ignore[attr-defined]
    finally:
        sub.close()
        sender.close()


def test_a_new_lineage_loads_its_base_with_its_first_adapters(tmp_path, redis_url, redis_prefix):
    """A resumed learner (a new lineage) announces its base before its first file: the worker
    waits for the file and loads both together, never labelling answers with a version it does
    not hold; the base is named in every announce of the lineage."""
    extra = ["model.lora.rank=8", "model.lora.publish=adapter"]
    cfg = config(tmp_path, redis_url, redis_prefix, *extra)
    client = redis.Redis.from_url(redis_url)
    engine, _ = build_engine(cfg, seed=7)
    sub = build_subscriber(cfg, client, "w0")
    store = sub.store
    policy = lora.wrap(load_policy(cfg.model, 3).model, cfg.model.lora).eval()
    _train_a_little(policy, 5)
    try:
        engine.policy_version = 4  # type: ignore[attr-defined]
        base = store.write_base(adapter_base(policy), "new")
        store.announce(1, "new", None, first=True, base=base)
        assert sub.update(engine.receiver) is None  # no file yet: nothing loaded
        assert engine.policy_version == 4  # type: ignore[attr-defined]
        assert sub.base is None
        path = store.write(published_tensors(policy, lora_publish="adapter"), 1)
        assert store.announce_file(1, path, "new")
        assert sub.update(engine.receiver) == 1 and sub.base == base
        torch.testing.assert_close(_logp(engine.model), _logp(policy), rtol=0, atol=1e-6)  # type: ignore[attr-defined]
        store.announce(2, "new", None, first=False, base=base)
        client.hdel(store.key, "base")  # (a hash recreated without it: the next announce)
        store.announce(3, "new", None, first=False, base=base)
        assert store.latest().base == base  # type: ignore[union-attr]
    finally:
        sub.close()


def test_eval_follow_applies_the_adapters_to_the_announced_base(
    tmp_path, redis_url, redis_prefix, monkeypatch
):
    from services import evaluate

    cfg = config(tmp_path, redis_url, redis_prefix, "model.lora.rank=8",
                 "model.lora.publish=adapter")  # fmt: skip
    store = build_subscriber(cfg, redis.Redis.from_url(redis_url), "e").store
    policy = lora.wrap(load_policy(cfg.model, 3).model, cfg.model.lora).eval()
    _train_a_little(policy, 5)
    base = store.write_base(adapter_base(policy), "l")
    store.announce(1, "l", None, first=True, base=base)
    store.announce_file(1, store.write(published_tensors(policy, lora_publish="adapter"), 1), "l")
    seen: list = []
    monkeypatch.setattr(
        evaluate, "_prepare", lambda *a: (build_engine(cfg, 7)[0], None, None, None)
    )
    monkeypatch.setattr(evaluate, "_report", lambda *a: None)

    def evaluated(cfg_, loaded, engine, *rest):
        seen.append(_logp(engine.model))
        return {"policy_version": rest[-1], "avg": 0.0, "scores": {}}, {}

    monkeypatch.setattr(evaluate, "_evaluate_version", evaluated)
    evaluate.follow(cfg, [], None, every=1, max_evals=1, poll_s=0.05)
    torch.testing.assert_close(seen[0], _logp(policy), rtol=0, atol=1e-6)


def test_adapters_on_a_tied_head_are_refused():
    from reval.config import LoraConfig

    model = load_policy(config_model(), 0).model
    assert model.config.tie_word_embeddings
    with pytest.raises(ValueError, match="ties its input embeddings"):
        lora.wrap(model, LoraConfig(rank=8, target_modules=["q_proj", "lm_head"]))


def config_model():
    from reval.config import ModelConfig

    return ModelConfig(device="cpu")
