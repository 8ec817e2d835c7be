"""LoRA on the policy (``model.lora``), through peft: the wrapping, the names, the merged weights.

Why peft and not layers of our own: it is what every peer trains RL adapters with (verl, TRL,
NeMo-RL, SkyRL), it resolves ``all-linear`` per architecture (every linear layer but the output
head), and its adapter directories are what vLLM's ``LoRARequest`` and
``PeftModel.from_pretrained`` load; our own layers would need their own export and loader.

Layout after ``wrap`` (a ``PeftModel``): the base's linear ``W`` of ``model.layers.0.mlp.up_proj``
is ``base_model.model.model.layers.0.mlp.up_proj.base_layer.weight`` (frozen), its adapter
``...up_proj.lora_A.default.weight`` ``[r, in]`` and ``...lora_B.default.weight`` ``[out, r]``
(trainable; ``B`` starts at zero, so the wrapped model computes what the base does). The layer
computes ``W x + (alpha / r) B A x``; ``merged_weight`` folds that into one ``W``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from reval.config import LoraConfig

ADAPTER = "default"
"""peft's name of the one adapter the policy trains."""
PREFIX = "base_model.model."
"""What peft puts before the base model's own parameter names."""
BASE_LAYER = ".base_layer"
"""What peft puts between a wrapped linear layer's name and its own weight and bias."""


def wrap(model: nn.Module, cfg: LoraConfig) -> nn.Module:
    """``model`` with LoRA adapters (a ``PeftModel``): the base frozen, the adapters trainable,
    in the base's dtype (``autocast_adapter_dtype=False``: FSDP2 shards adapter and base in one
    unit, which needs one dtype; the learner's masters are fp32 anyway)."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
    if tied and isinstance(cfg.target_modules, list):
        shared = sorted({"lm_head", "embed_tokens"} & set(cfg.target_modules))
        if shared:
            raise ValueError(
                f"model.lora.target_modules names {', '.join(shared)}, but the model ties its "
                "input embeddings to its output head: an adapter on one would untie them"
            )

    peft_cfg = PeftLoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.scale_alpha,
        lora_dropout=cfg.dropout,
        target_modules=cfg.target_modules,
        bias="none",
        task_type="CAUSAL_LM",
    )
    wrapped: nn.Module = get_peft_model(model, peft_cfg, autocast_adapter_dtype=False)  # type: ignore[arg-type]
    embedded = sorted({n.split(".lora_embedding_")[0] for n, _ in wrapped.named_parameters()
                       if ".lora_embedding_" in n})  # fmt: skip
    if embedded:  # (peft's embedding adapters: another layout, neither published nor merged)
        raise ValueError(
            f"model.lora.target_modules puts adapters on embeddings ({', '.join(embedded)}); "
            "reval trains adapters on linear layers only: leave embed_tokens out"
        )
    return wrapped


def is_lora(model: nn.Module) -> bool:
    """Whether ``model`` is a peft-wrapped policy."""
    return hasattr(model, "peft_config") and hasattr(model, "disable_adapter")


def is_adapter(name: str) -> bool:
    """Whether a parameter name of a wrapped policy is an adapter's (``lora_A``/``lora_B``)."""
    return ".lora_A." in name or ".lora_B." in name


def adapter_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The adapters' parameters, by name, in the model's order."""
    return [(n, p) for n, p in model.named_parameters() if is_adapter(n)]


def base_name(name: str) -> str:
    """A wrapped policy's parameter name as the base model calls it (what a Hugging Face
    checkpoint, vLLM's ``load_weights`` and an unwrapped engine use)."""
    if name.startswith(PREFIX):
        name = name[len(PREFIX) :]
    return name.replace(BASE_LAYER + ".", ".")


def base_model(model: nn.Module) -> nn.Module:
    """The model under the adapters (the ``PreTrainedModel`` whose ``model.layers`` are the
    decoder layers); ``model`` itself when it is not wrapped."""
    if not is_lora(model):
        return model
    inner: nn.Module = model.get_base_model()  # type: ignore[operator]
    return inner


def lora_layer(model: nn.Module, name: str) -> Any | None:
    """The peft LoRA layer whose frozen weight is ``name`` (``...q_proj.base_layer.weight``),
    or None when ``name`` is not such a weight."""
    suffix = BASE_LAYER + ".weight"
    if not name.endswith(suffix):
        return None
    layer = model.get_submodule(name[: -len(suffix)])
    return layer if hasattr(layer, "lora_A") and ADAPTER in layer.lora_A else None


def merged_weight(
    layer: Any, weight: Tensor, full: Callable[[Tensor], Tensor], dtype: torch.dtype
) -> Tensor:
    """``W + (alpha / r) B A`` of a LoRA layer in ``dtype``, the sum taken in fp32 (a bf16 sum
    loses small updates). ``weight``: the layer's frozen weight; ``full`` gathers a parameter
    whole (under FSDP a collective: every rank calls it in the same order)."""
    a = full(layer.lora_A[ADAPTER].weight).float()
    b = full(layer.lora_B[ADAPTER].weight).float()
    w = full(weight).float()
    return (w + layer.scaling[ADAPTER] * (b @ a)).to(dtype)


def trainable_summary(model: nn.Module) -> str:
    """``"LoRA: 19,456 of 125,056 parameters trained (15.6%)"`` (counts of the local shards'
    global shapes: the same on every rank)."""
    total = sum(p.numel() for p in model.parameters())
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return f"LoRA: {trained:,} of {total:,} parameters trained ({100 * trained / total:.1f}%)"
