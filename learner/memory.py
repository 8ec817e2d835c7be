"""Activation checkpointing chosen by memory (``model.gradient_checkpointing = "auto"``).

Checkpointing recomputes every decoder layer's forward in the backward pass: it saves most of the
activations and costs about a fifth of an update (measured on an H200 at the 1.5B shape: 4.96 s
against 4.02 s per update, 32 GB against 74 GB peak; docs/learner.md). ``auto`` turns it on only
when the update would not fit without it, by this rule (bytes per learner rank; ``N`` the
parameters, ``W`` the learner ranks, ``b`` the bytes of the compute dtype, ``T`` the most tokens
one micro-batch computes, ``L`` the decoder layers, ``h`` the hidden width, ``i`` the MLP width):

    state       = N / W * (4 + 4 + 8 + b)        fp32 masters, fp32 grads, AdamW's two moments,
                                                  the frozen reference in the compute dtype
    LoRA state  = (4 N + 20 A) / W               the base's fp32 masters only; the A adapter
                                                  parameters' masters, grads, moments and the
                                                  reference's snapshot of them (no reference
                                                  model: ``learner/reference.py``)
    activations = T * L * b * (10 h + 4 i)       what autograd keeps per token and layer without
                                                  checkpointing (q, k, v, attention out, o, two
                                                  norms, two residuals, the input: ~10 h; gate,
                                                  up, act, their product: 4 i)
    checkpointed= T * L * b * h + T * b * (10 h + 4 i)   each layer's input, one layer recomputed
    off when      state + activations <= HEADROOM * device memory

``T`` is ``learner.max_tokens_per_micro_batch`` when set (a packed row, or a padded micro-batch's
count x its longest prompt + response, is at most that), else ``learner.micro_batch_size`` x
(``task.max_prompt_tokens`` + ``rollout.max_new_tokens``), the longest a padded micro-batch can
be. Checked against the H200 table of issue 27 (1.5B, 16k tokens): the rule says 75 GB without
checkpointing against 74 GB measured, so ``auto`` turns it off on an H200 (141 GB) and keeps it
on an 80 GB H100, where 74 GB leaves no room for the allocator's fragmentation.

Torch-free arithmetic, so ``reval doctor`` can print the decision too; the learner reads the
device's memory and calls :func:`plan_checkpointing` once, before it shards the model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from reval.config import LoraConfig, RunConfig

HEADROOM = 0.85
"""Share of the device's memory the plan may fill (the rest: the allocator's fragmentation, the
chunked LM head's logits, NCCL's buffers, the optimizer step's transients)."""
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class ModelShape:
    """What the rule needs of a decoder-only model."""

    params: int
    layers: int
    hidden: int
    intermediate: int
    heads: int = 0
    kv_heads: int = 0
    head_dim: int = 0

    @classmethod
    def of(cls, model_config: Any, params: int) -> ModelShape:
        """From a transformers config (``num_hidden_layers``, ``hidden_size``,
        ``intermediate_size``, which defaults to 4 h; the attention heads) and the parameter
        count."""
        hidden = int(model_config.hidden_size)
        inter = getattr(model_config, "intermediate_size", None) or 4 * hidden
        heads = int(getattr(model_config, "num_attention_heads", 0) or 0)
        kv = int(getattr(model_config, "num_key_value_heads", 0) or heads)
        head_dim = int(getattr(model_config, "head_dim", 0) or (hidden // heads if heads else 0))
        layers = int(model_config.num_hidden_layers)
        return cls(params, layers, hidden, int(inter), heads, kv, head_dim)

    def linears(self) -> dict[str, tuple[int, int]]:
        """A decoder layer's linear layers: name -> (in, out) features."""
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        i = self.intermediate
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}  # fmt: skip


def adapter_params(shape: ModelShape, lora: LoraConfig) -> int:
    """Parameters of the LoRA adapters (``r (in + out)`` per targeted linear layer and decoder
    layer; ``all-linear``: every linear layer of the decoder, not the output head)."""
    if not lora.enabled:
        return 0
    layers = shape.linears()
    names = layers if lora.target_modules == "all-linear" else lora.target_modules
    per_layer = sum(lora.rank * sum(layers[n]) for n in names if n in layers)
    return per_layer * shape.layers


def state_bytes(cfg: RunConfig, shape: ModelShape, world_size: int = 1) -> int:
    """The learner's state per rank (the module docstring's ``state``, LoRA's when
    ``model.lora`` is on)."""
    if cfg.model.lora.enabled:
        return (4 * shape.params + 20 * adapter_params(shape, cfg.model.lora)) // world_size
    return shape.params * (16 + DTYPE_BYTES[cfg.model.dtype]) // world_size


@dataclass(frozen=True)
class CheckpointPlan:
    """The decision and the figures behind it (bytes per learner rank)."""

    checkpointing: bool
    tokens: int
    state: int
    activations: int
    """Without checkpointing."""
    checkpointed: int
    """With checkpointing."""
    capacity: int
    """The device's memory."""

    def describe(self) -> str:
        gb = 1 << 30
        need = (self.state + self.activations) / gb
        room = HEADROOM * self.capacity / gb
        verdict = "on" if self.checkpointing else "off"
        return (
            f"activation checkpointing {verdict}: {self.tokens} tokens per micro-batch need "
            f"{need:.1f} GB without it ({self.state / gb:.1f} GB state + "
            f"{self.activations / gb:.1f} GB activations; {self.checkpointed / gb:.1f} GB with "
            f"it) against {room:.1f} GB ({HEADROOM:.0%} of {self.capacity / gb:.1f} GB)"
        )


def micro_batch_tokens(cfg: RunConfig) -> int:
    """The most tokens one micro-batch computes (the module docstring's ``T``)."""
    budget = cfg.learner.max_tokens_per_micro_batch
    if budget is not None:
        return budget
    longest = cfg.task.max_prompt_tokens + cfg.rollout.max_new_tokens
    return cfg.learner.micro_batch_size * longest


def plan_checkpointing(
    cfg: RunConfig, shape: ModelShape, capacity: int, world_size: int = 1
) -> CheckpointPlan:
    """Whether the learner checkpoints activations: ``model.gradient_checkpointing`` when it
    is a bool, else the module docstring's rule on ``capacity`` bytes of device memory."""
    b = DTYPE_BYTES[cfg.model.dtype]
    tokens = micro_batch_tokens(cfg)
    per_layer_token = b * (10 * shape.hidden + 4 * shape.intermediate)
    state = state_bytes(cfg, shape, world_size)
    activations = tokens * shape.layers * per_layer_token
    checkpointed = tokens * shape.layers * b * shape.hidden + tokens * per_layer_token
    chosen = cfg.model.gradient_checkpointing
    on = chosen if isinstance(chosen, bool) else state + activations > HEADROOM * capacity
    return CheckpointPlan(on, tokens, state, activations, checkpointed, capacity)


def device_memory(device: Any) -> int:
    """Bytes of memory of ``device`` (a ``torch.device``): a GPU's total memory; on the CPU the
    memory available now (``MemAvailable``), which the learner shares with its generator."""
    if device.type == "cuda":
        import torch

        return int(torch.cuda.get_device_properties(device).total_memory)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import os

    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def apply_plan(cfg: RunConfig, model: Any, device: Any, world_size: int = 1) -> CheckpointPlan:
    """Plan for ``model`` (a transformers model, its parameters counted whole: call it before
    sharding) on ``device`` and turn checkpointing on when the plan says so."""
    from reval.policy import enable_checkpointing

    params = sum(p.numel() for p in model.parameters())
    plan = plan_checkpointing(
        cfg, ModelShape.of(model.config, params), device_memory(device), world_size
    )
    if plan.checkpointing:
        enable_checkpointing(model)
    return plan
