"""LoRA's memory (issue 41): the adapters' size from a model's shape equals what peft builds,
the learner's state under LoRA leaves out the reference model and the base's optimizer state,
and ``reval doctor`` says both figures."""

from __future__ import annotations

import json

from learner.memory import ModelShape, adapter_params, state_bytes
from reval import lora
from reval.config import LoraConfig, load_config
from reval.policy import load_policy
from services.doctor import Facts, check_lora, model_shape


def test_adapter_count_from_the_shape_equals_peft_on_the_tiny_model():
    cfg = load_config(overrides=["model.lora.rank=8"], environ={})
    model = load_policy(cfg.model, seed=0).model
    shape = ModelShape.of(model.config, sum(p.numel() for p in model.parameters()))
    wrapped = lora.wrap(model, cfg.model.lora)
    built = sum(p.numel() for _, p in lora.adapter_parameters(wrapped))
    assert adapter_params(shape, cfg.model.lora) == built
    some = LoraConfig(rank=8, target_modules=["q_proj", "v_proj"])
    h, q, kv = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    assert adapter_params(shape, some) == shape.layers * 8 * ((h + q) + (h + kv))


def test_lora_state_leaves_out_the_reference_and_the_base_optimizer():
    shape = ModelShape(params=1000, layers=1, hidden=4, intermediate=8, heads=1, kv_heads=1,
                       head_dim=4)  # fmt: skip
    full = load_config(overrides=["model.dtype=bfloat16"], environ={})
    with_lora = load_config(overrides=["model.dtype=bfloat16", "model.lora.rank=1"], environ={})
    assert state_bytes(full, shape) == 1000 * 18  # masters, grads, moments, bf16 reference
    adapters = adapter_params(shape, with_lora.model.lora)
    assert state_bytes(with_lora, shape) == 4 * 1000 + 20 * adapters
    assert state_bytes(with_lora, shape, world_size=2) == (4 * 1000 + 20 * adapters) // 2


def test_doctor_gives_the_lora_state_against_full_fine_tuning(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
        "num_attention_heads": 12, "num_key_value_heads": 2, "vocab_size": 151936,
        "tie_word_embeddings": True,
    }))  # fmt: skip
    over = ["model.dtype=bfloat16", f"model.name_or_path={tmp_path}"]
    cfg = load_config(overrides=[*over, "model.lora.rank=32"], environ={})
    facts = Facts(True, "2", "12", None, 1, None, 1 << 40, "/", None, model_shape=model_shape(cfg))
    assert facts.model_shape is not None
    assert abs(facts.model_shape.params - 1.5437e9) < 1e6  # Qwen2.5-1.5B without its biases
    check = check_lora(cfg, facts)
    assert check.status == "ok"
    assert "36,929,536 adapter parameters" in check.message  # rank 32 on all linear layers
    assert "6.4 GiB per rank against 25.9 GiB" in check.message
    off = load_config(overrides=over, environ={})
    assert check_lora(off, facts).status == "skip"
    assert check_lora(cfg, Facts(True, "2", "12", None, 1, None, 1, "/", None)).status == "skip"
