"""A consolidated Hugging Face checkpoint (safetensors + config + tokenizer): what
``from_pretrained``, vLLM and ``reval eval`` load. The learner's own checkpoints are DCP
(``learner/checkpoint.py``); this is the export of one of its states.

A LoRA policy (``model.lora``, ``reval/lora.py``) is exported twice over: the merged checkpoint
(the adapters folded into the base's weights, under the base's names: it loads like a full
fine-tune's) and, beside it in ``adapter/``, peft's adapter directory (what
``PeftModel.from_pretrained`` and vLLM's ``LoRARequest`` load over the base)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from reval.lora import base_model, base_name, is_adapter, is_lora, lora_layer, merged_weight

ADAPTER_DIR = "adapter"
"""The folder under an export that holds a LoRA policy's peft adapter directory."""


def export_hf(model: Any, tokenizer: Any, path: Path) -> Path:
    """Write ``model`` (an unsharded ``PreTrainedModel``, or one wrapped with LoRA) and
    ``tokenizer`` to ``path``; returns ``path``.

    A LoRA policy (``reval.lora.is_lora``) writes at ``path`` the merged checkpoint: the base's
    config and names, each adapted linear layer's ``W + (alpha / r) B A`` summed in fp32 and
    stored in ``W``'s dtype, tied embeddings kept tied; and at ``path / "adapter"`` the adapter
    directory (``adapter_config.json`` + ``adapter_model.safetensors``). The training model is
    left as it was (the merge builds new tensors; nothing is merged in place)."""
    path.mkdir(parents=True, exist_ok=True)
    if is_lora(model):
        base_model(model).save_pretrained(path, state_dict=merged_state_dict(model))
        model.save_pretrained(path / ADAPTER_DIR)
    else:
        model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@torch.no_grad()
def merged_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """A LoRA policy's weights with the adapters folded in, under the base's names (what
    ``model.merge_and_unload()`` would leave, without touching ``model``). Tensors that no
    adapter changes are ``model``'s own (not copied), so tied ones stay one tensor."""
    out: dict[str, Tensor] = {}
    for name, t in model.state_dict().items():
        if is_adapter(name):
            continue
        layer = lora_layer(model, name)
        if layer is not None:
            if layer.merged:  # (its W already holds B A: adding it again would count it twice)
                raise ValueError(f"{name}: the adapter is merged into the weight already")
            t = merged_weight(layer, t, lambda x: x, t.dtype)
        elif "lora_" in name:  # (an embedding's or a conv's adapter: not folded in here)
            raise ValueError(f"{name}: only adapters of linear layers can be merged")
        out[base_name(name)] = t
    _check_tied(base_model(model), out)
    return out


def _check_tied(base: nn.Module, sd: dict[str, Tensor]) -> None:
    """Refuse a merge that changed one of two tied weights (an adapter on the output head or the
    embedding of a model with ``tie_word_embeddings``): the checkpoint would load as the other."""
    tied = getattr(base, "_tied_weights_keys", None)
    if not isinstance(tied, dict):  # (transformers 5: {target: source}; before, a list)
        return
    for target, source in tied.items():
        if target in sd and source in sd and sd[target].data_ptr() != sd[source].data_ptr():
            raise ValueError(f"{target} is tied to {source}, and an adapter changed one "
                             "of them: leave the output head and the embedding out of "
                             "model.lora.target_modules")  # fmt: skip
