"""The GPU presets (configs/*.toml with ``model.device = "cuda"``) are ready for a GPU node as
they stand: ``reval launch`` reserves a GPU for every learner rank and every vLLM worker (the
defaults reserve none, which Ray would run on the CPU), the node's 8 GPUs are split 4 + 4 as in
docs/reproduce-paper.md, and the replay limiter gives the paper's K = 2 reuse of each
trajectory."""

from __future__ import annotations

from pathlib import Path

import pytest

from reval.config import load_config

ROOT = Path(__file__).resolve().parents[2]
PRESETS = sorted(p for p in (ROOT / "configs").glob("*.toml") if 'device = "cuda"' in p.read_text())
NODE_GPUS = 8  # the paper's scale: one 8-GPU node (docs/reproduce-paper.md)


def test_the_paper_presets_are_the_gpu_presets():
    assert {p.name for p in PRESETS} == {
        "r1_distill_qwen_1p5b.toml", "qwen25_math_7b.toml", "qwen25_math_7b_lora.toml"
    }  # fmt: skip


def test_the_lora_preset_is_the_7b_run_with_adapters():
    full = load_config(str(ROOT / "configs/qwen25_math_7b.toml"), [], environ={})
    lora = load_config(str(ROOT / "configs/qwen25_math_7b_lora.toml"), [], environ={})
    assert lora.model.lora.rank == 32 and lora.model.lora.target_modules == "all-linear"
    assert lora.learner.lr == pytest.approx(10 * full.learner.lr)  # the field's 10x
    assert not full.model.lora.enabled
    # Otherwise the same run: the same task, sampling, buffer, algorithm and node split.
    for section in ("task", "rollout", "buffer", "algo", "launch"):
        assert getattr(lora, section) == getattr(full, section), section


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.stem)
def test_gpu_preset_reserves_gpus_and_reuses_each_trajectory_k_times(preset: Path):
    cfg = load_config(str(preset), [], environ={})
    assert cfg.model.device == "cuda" and cfg.rollout.engine == "vllm"
    launch = cfg.launch
    # One GPU per learner rank and per vLLM worker (0, the default, would place them on CPUs).
    assert launch.learner_gpus == 1 and launch.rollout_gpus == 1
    gpus = cfg.learner.world_size * launch.learner_gpus + launch.workers * launch.rollout_gpus
    assert gpus == NODE_GPUS, gpus
    assert cfg.learner.world_size == 4 and launch.workers == 4
    # The paper: 128 prompts x 8 answers per iteration, B = 1024, K = 2 updates, M = 5120.
    assert cfg.round_size == 1024 and cfg.batch_size == 1024
    assert cfg.learner.updates_per_round == 2 and cfg.learner.first_update_fresh
    assert cfg.buffer.capacity == 5120
    assert cfg.samples_per_insert == 2.0  # derived: K * B / round
    # Generation runs at most one round ahead of the learner, so K holds either way round.
    assert cfg.buffer.generate_ahead == cfg.samples_per_insert * cfg.round_size
