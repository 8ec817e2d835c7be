"""The same code path on a CUDA device (bf16 model, fp32 statistics). Marked ``gpu``: not in the
default run; ``make gpu-smoke`` runs it with the rest of ``tests/gpu`` on a GPU machine, and it
is skipped, never failed, where no CUDA device is visible (like the whole suite)."""

from __future__ import annotations

import pytest
import torch

from reval.config import load_config
from services.train import train

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_short_training_on_cuda_bf16(tmp_path):
    cfg = load_config(
        overrides=[
            "model.device=cuda",
            "model.dtype=bfloat16",
            "learner.rounds=150",
            "eval.every=50",
            f"output_dir={tmp_path}",
            "metrics.progress=false",
        ],
        environ={},
    )
    res = train(cfg)
    assert res.final_success > res.initial_success + 0.1


def test_calibrated_init_in_bf16_on_cuda():
    """docs/algorithm.md §8: in bf16, theta = ref holds only up to kernel noise; measure it."""
    from learner.trainer import Learner
    from reval.config import AlgoConfig, LearnerConfig, ModelConfig
    from reval.policy import load_policy
    from tests.conftest import make_traj

    pol = load_policy(ModelConfig(device="cuda", dtype="bfloat16"), seed=0)
    ts = [make_traj(i, reward=float(i % 2)) for i in range(16)]
    lc = LearnerConfig(micro_batch_size=5)  # reference and policy batch differently
    learner = Learner(pol.model, lc, AlgoConfig(beta=0.5), pol.pad_id, pol.eos_id, pol.device)
    out = learner.update(ts)
    want = -torch.tensor([t.reward for t in ts]) / 0.5
    assert (out.delta - want).abs().max().item() < 0.05
