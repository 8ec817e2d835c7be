"""The export of a LoRA policy (issue 41): the merged Hugging Face checkpoint gives the adapted
model's log-probs, the adapter directory loads over a fresh base with ``PeftModel``, the
training model is left as it was, and a full fine-tune's export is as before."""

from __future__ import annotations

import json

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from learner.export import ADAPTER_DIR, export_hf
from reval import lora
from reval.config import LoraConfig, ModelConfig
from reval.policy import load_policy

TOL = 1e-5
"""fp32: the merged W and the adapted layer's W x + s B A x differ by rounding only."""


def _tokens(vocab: int) -> torch.Tensor:
    """A few sequences of token ids ``[4, 12]``."""
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, vocab, (4, 12), generator=g)


@torch.no_grad()
def _logprobs(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Each next token's log-prob ``[B, T-1]``."""
    model.eval()
    logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits.float()
    return torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]


def _adapted():
    """The tiny policy wrapped with rank-8 adapters whose B is nonzero (the adapter matters)."""
    policy = load_policy(ModelConfig(device="cpu"), seed=0)
    model = lora.wrap(policy.model, LoraConfig(rank=8))
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, p in lora.adapter_parameters(model):
            if ".lora_B." in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
    return model, policy.tokenizer


def test_merged_checkpoint_and_adapter_give_the_adapted_log_probs(tmp_path):
    model, tokenizer = _adapted()
    ids = _tokens(model.config.vocab_size)
    adapted = _logprobs(model, ids)
    with model.disable_adapter():
        base = _logprobs(model, ids)
    assert (adapted - base).abs().max() > 1e-2  # (else the comparisons below prove nothing)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}

    out = export_hf(model, tokenizer, tmp_path / "final")

    merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert not lora.is_lora(merged)
    torch.testing.assert_close(_logprobs(merged, ids), adapted, atol=TOL, rtol=0)
    assert merged.get_output_embeddings().weight is merged.get_input_embeddings().weight
    names = set(load_file(out / "model.safetensors"))
    assert not any("lora_" in n or "base_layer" in n or n.startswith("base_model") for n in names)
    assert (out / "tokenizer_config.json").exists()

    adapter_dir = out / ADAPTER_DIR
    assert json.loads((adapter_dir / "adapter_config.json").read_text())["r"] == 8
    assert (adapter_dir / "adapter_model.safetensors").exists()
    fresh = load_policy(ModelConfig(device="cpu"), seed=0).model
    reloaded = PeftModel.from_pretrained(fresh, adapter_dir)
    torch.testing.assert_close(_logprobs(reloaded, ids), adapted, atol=TOL, rtol=0)

    # the training model is as it was: still wrapped, unmerged, the same parameters
    assert lora.is_lora(model)
    layers = [m for m in model.modules() if hasattr(m, "merged")]
    assert layers and not any(m.merged for m in layers)
    after = dict(model.named_parameters())
    assert after.keys() == before.keys()
    for n, p in after.items():
        assert torch.equal(p, before[n]), n
    torch.testing.assert_close(_logprobs(model, ids), adapted, atol=0, rtol=0)


def test_a_full_fine_tunes_export_is_the_model_itself(tmp_path):
    policy = load_policy(ModelConfig(device="cpu"), seed=0)
    ids = _tokens(policy.model.config.vocab_size)
    out = export_hf(policy.model, policy.tokenizer, tmp_path / "final")
    assert not (out / ADAPTER_DIR).exists()
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    torch.testing.assert_close(_logprobs(loaded, ids), _logprobs(policy.model, ids), atol=0, rtol=0)


def test_adapters_that_would_untie_the_embeddings_are_refused():
    policy = load_policy(ModelConfig(device="cpu"), seed=0)
    with pytest.raises(ValueError, match="ties its input embeddings"):  # refused at wrap
        lora.wrap(policy.model, LoraConfig(rank=8, target_modules=["q_proj", "lm_head"]))
