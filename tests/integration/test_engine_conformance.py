"""The generation-engine conformance suite: ``HFEngine`` and ``VLLMEngine`` against one
``GenerationEngine`` contract: seeded sampling, ``n`` samples per prompt, behaviour log-probs equal
to a teacher-forced HF forward pass with temperature and top-p applied, EOS and finish reasons,
in-place weight loading (for vLLM also over NCCL, and dropping its prefix cache).

The ``vllm`` cases are marked ``gpu``: they need a CUDA device and vLLM (``pip install
'reval[gpu]'``) and are skipped otherwise; the ``hf`` cases run on the CPU in the default suite.
The model is a tiny random Qwen2 saved to disk with the project's own tokenizer and loaded by each
engine the way it loads a real checkpoint; both run it in float32 so the HF reference (float32,
on the CPU) can be compared closely.
"""

from __future__ import annotations

import copy
import importlib.util
import multiprocessing as mp
import socket
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import PreTrainedTokenizerBase, Qwen2ForCausalLM

from reval.config import TinyModelConfig
from reval.policy import build_char_tokenizer, build_tiny_model
from reval.weights import pack_buckets
from rollout.engines import GenerationEngine, HFEngine, Sample, SamplingParams, top_p_filter
from rollout.vllm_engine import VLLMEngine

VLLM_MARKS = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None,
        reason="vllm is not installed (pip install 'reval[gpu]')",
    ),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
]

# head_dim 64: every vLLM attention backend takes it (FlashAttention's list in 0.10.2 has no 16).
SHAPE = TinyModelConfig(
    hidden_size=256,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
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
) -> tuple[Path, Qwen2ForCausalLM]:
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


@pytest.fixture(scope="module", params=["hf", pytest.param("vllm", marks=VLLM_MARKS)])
def engine(
    request: pytest.FixtureRequest, checkpoint: tuple[Path, Qwen2ForCausalLM]
) -> Iterator[GenerationEngine]:
    if request.param == "hf":
        model = Qwen2ForCausalLM.from_pretrained(checkpoint[0], dtype=torch.float32).eval()
        tok = build_char_tokenizer()
        yield HFEngine(model, int(tok.pad_token_id), int(tok.eos_token_id))  # type: ignore[arg-type]
        return
    eng = VLLMEngine(
        str(checkpoint[0]),
        seed=0,
        dtype="float32",
        gpu_memory_utilization=0.25,
        max_model_len=512,
        enforce_eager=True,
    )
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def vllm_engine(engine: GenerationEngine) -> VLLMEngine:
    if not isinstance(engine, VLLMEngine):
        pytest.skip("vLLM-only")
    return engine


def encode(tok: PreTrainedTokenizerBase, texts: Sequence[str]) -> list[list[int]]:
    return [tok.encode(t, add_special_tokens=False) for t in texts]


@torch.no_grad()
def reference_logprobs(
    model: Qwen2ForCausalLM,
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
    model: Qwen2ForCausalLM,
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


def test_finish_reasons_and_eos(
    engine: GenerationEngine, tokenizer: PreTrainedTokenizerBase
) -> None:
    eos = engine.eos_id
    prompts = encode(tokenizer, SHORT + LONG)
    out = engine.generate(prompts, SamplingParams(n=8, temperature=1.5, max_new_tokens=40), seed=3)
    reasons: Counter[str] = Counter()
    for s in (s for samples in out for s in samples):
        reasons[s.finish_reason] += 1
        ids = s.token_ids.tolist()
        if s.finish_reason == "stop":
            assert ids[-1] == eos and eos not in ids[:-1]
        else:
            assert len(ids) == 40 and eos not in ids
    assert reasons["stop"] > 0 and reasons["length"] > 0, reasons
    one = engine.generate(prompts, SamplingParams(n=8, temperature=1.5, max_new_tokens=1), seed=4)
    for s in (s for samples in one for s in samples):
        assert len(s.token_ids) == 1
        assert s.finish_reason == ("stop" if s.token_ids[0] == eos else "length")


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.6, 1.0), (1.3, 0.8)])
def test_logprobs_match_teacher_forced(
    engine: GenerationEngine,
    checkpoint: tuple[Path, Qwen2ForCausalLM],
    tokenizer: PreTrainedTokenizerBase,
    temperature: float,
    top_p: float,
) -> None:
    prompts = encode(tokenizer, SHORT + LONG)
    params = SamplingParams(n=4, temperature=temperature, top_p=top_p, max_new_tokens=32)
    out = engine.generate(prompts, params, seed=5)
    assert_matches_reference(checkpoint[1], prompts, out, temperature, top_p)


def perturbed_copy(model: Qwen2ForCausalLM, seed: int) -> Qwen2ForCausalLM:
    other = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
    return other


def test_load_weights_changes_outputs_and_version(
    engine: GenerationEngine,
    checkpoint: tuple[Path, Qwen2ForCausalLM],
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
    finally:
        engine.load_weights(base.named_parameters(), version=0)
    assert engine.policy_version == 0
    assert same_samples(before, engine.generate(prompts, params, seed=9))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _nccl_sender(port: int, state_path: str, bucket_bytes: int, version: int) -> None:
    """The learner's side of one sync, in its own process on cuda:1 (NCCL refuses two ranks on
    one GPU)."""
    from vllm.distributed.device_communicators.pynccl import (  # type: ignore[import-not-found]
        PyNcclCommunicator,
    )
    from vllm.distributed.utils import StatelessProcessGroup  # type: ignore[import-not-found]

    device = torch.device("cuda:1")
    torch.cuda.set_device(device)
    state: dict[str, torch.Tensor] = torch.load(state_path)
    group = StatelessProcessGroup.create(
        host="127.0.0.1", port=port, rank=0, world_size=2, store_timeout=120
    )
    comm = PyNcclCommunicator(group, device=device)
    group.barrier(timeout=120)
    stream = torch.cuda.current_stream()
    for bucket in pack_buckets(state.items(), bucket_bytes, version=version):
        comm.broadcast(bucket.data.to(device), src=0, stream=stream)
    torch.cuda.synchronize(device)


@pytest.mark.timeout(300)
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2,
    reason="the NCCL broadcast test needs 2 GPUs (learner and vLLM on different devices)",
)
def test_update_weights_from_nccl_broadcast(
    vllm_engine: VLLMEngine,
    checkpoint: tuple[Path, Qwen2ForCausalLM],
    tokenizer: PreTrainedTokenizerBase,
    tmp_path: Path,
) -> None:
    base = checkpoint[1]
    new = perturbed_copy(base, seed=2)
    state = {name: t.detach().clone() for name, t in new.named_parameters()}
    state_path = tmp_path / "state.pt"
    torch.save(state, state_path)
    bucket_bytes = 256 << 10  # several buckets, mixed with one-tensor buckets
    headers = [b.header() for b in pack_buckets(state.items(), bucket_bytes, version=3)]
    assert len(headers) > 1
    port = _free_port()
    sender = mp.get_context("spawn").Process(
        target=_nccl_sender, args=(port, str(state_path), bucket_bytes, 3), daemon=True
    )
    sender.start()
    engine = vllm_engine
    timeout = engine.weight_sync_timeout_s
    engine.weight_sync_timeout_s = 120.0
    try:
        assert engine.init_weight_update_group("127.0.0.1", port, 1, 2) == [1]
        engine.update_weights_from_broadcast(headers, version=3)
        sender.join(60)
        assert sender.exitcode == 0
        assert engine.policy_version == 3
        prompts = encode(tokenizer, SHORT)
        out = engine.generate(prompts, SamplingParams(n=2, max_new_tokens=16), seed=2)
        assert_matches_reference(new, prompts, out, 1.0, 1.0)
    finally:
        engine.weight_sync_timeout_s = timeout
        if sender.is_alive():
            sender.kill()
        engine.destroy_weight_update_group()
        engine.load_weights(base.named_parameters(), version=0)
