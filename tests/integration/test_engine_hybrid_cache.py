"""The HF engine's shared prefill (each distinct prompt's forward once, its cache copied to its
answers) on a model whose cache holds more than keys and values: a hybrid of linear and full
attention (Qwen3-Next's layout, tiny and random), whose linear-attention layer keeps conv and
recurrent states per row."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from rollout.engines import HFEngine, SamplingParams


@pytest.fixture(scope="module")
def hybrid() -> torch.nn.Module:
    cfg = AutoConfig.for_model(
        "qwen3_next", vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, intermediate_size=64, num_experts=0,
        layer_types=["linear_attention", "full_attention"],
    )  # fmt: skip
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg).eval()


def test_a_linear_attention_cache_is_copied_whole_to_the_answers(hybrid, monkeypatch):
    out = hybrid(input_ids=torch.tensor([[5, 6, 7]]), use_cache=True)
    layers = [type(x).__name__ for x in out.past_key_values.layers]
    assert layers == ["LinearAttentionLayer", "DynamicLayer"]  # (what the test is about)
    engine = HFEngine(hybrid, 0, 1)
    prompts, params = [[5, 6, 7], [8, 9], [5, 6, 7]], SamplingParams(n=3, max_new_tokens=5)
    shared = engine.generate(prompts, params, seed=1)
    monkeypatch.setattr(engine, "_prefill", engine._forward_prompts)  # every row's own forward
    each = engine.generate(prompts, params, seed=1)
    for a, b in zip([s for g in shared for s in g], [s for g in each for s in g], strict=True):
        assert a.token_ids.tolist() == b.token_ids.tolist() and a.finish_reason == b.finish_reason
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
