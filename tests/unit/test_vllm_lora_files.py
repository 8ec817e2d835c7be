"""The PEFT directory a vLLM worker writes for each adapter version (``rollout/vllm_lora.py``'s
``write_adapter``; no vLLM needed): peft itself loads it back into the same model, and adapters
of a rank the worker does not serve are refused."""

from __future__ import annotations

import json

import pytest
import torch

from reval import lora
from reval.config import LoraConfig, TinyModelConfig
from reval.policy import build_tiny_model
from rollout.vllm_lora import CONFIG_FILE, WEIGHTS_FILE, peft_name, target_modules, write_adapter

IDS = torch.tensor([[3, 9, 12, 7, 5, 20]])


def _policy(rank: int = 8, seed: int = 1) -> torch.nn.Module:
    model = build_tiny_model(TinyModelConfig(), 40, 0, 1, seed=0)
    policy = lora.wrap(model, LoraConfig(rank=rank, alpha=12.0))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in lora.adapter_parameters(policy):
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return policy.eval()


def test_peft_loads_the_written_adapter_into_the_same_model(tmp_path):
    from peft import PeftModel

    policy = _policy()
    write_adapter(lora.adapter_parameters(policy), tmp_path, 12.0, 8, version=5)
    config = json.loads((tmp_path / CONFIG_FILE).read_text())
    assert config["r"] == 8 and config["lora_alpha"] == 12.0
    assert set(config["target_modules"]) >= {"q_proj", "v_proj", "down_proj"}
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([CONFIG_FILE, WEIGHTS_FILE])
    loaded = PeftModel.from_pretrained(build_tiny_model(TinyModelConfig(), 40, 0, 1, seed=0),
                                       tmp_path).eval()  # fmt: skip
    with torch.no_grad():
        torch.testing.assert_close(loaded(IDS).logits, policy(IDS).logits, rtol=0, atol=1e-6)
        with policy.disable_adapter():  # (the adapters matter)
            assert not torch.allclose(loaded(IDS).logits, policy(IDS).logits, atol=1e-3)


def test_adapters_of_another_rank_are_refused_and_nothing_is_left(tmp_path):
    policy = _policy(rank=8)
    with pytest.raises(ValueError, match=r"rank 8; this worker serves rank 16"):
        write_adapter(lora.adapter_parameters(policy), tmp_path, 32.0, 16, version=2)
    full = [(n, t) for n, t in policy.named_parameters() if not lora.is_adapter(n)][:2]
    with pytest.raises(ValueError, match="not a LoRA adapter"):
        write_adapter(full, tmp_path, 16.0, 8, version=3)
    assert list(tmp_path.iterdir()) == []


def test_names_as_peft_saves_them():
    name = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight"
    assert peft_name(name) == "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    modules = target_modules([peft_name(name), "x.mlp.up_proj.lora_B.weight"])
    assert modules == ["q_proj", "up_proj"]
