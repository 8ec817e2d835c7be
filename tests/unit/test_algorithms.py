"""The loss table (``learner/algorithms/``, issue 40): the registry agrees with the config's list
of built-in losses, a loss of the user's own by import path trains (the worked example of
docs/algorithm.md, "Adding a loss", run as it is written there), and a wrong name or policy is
one clear error."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from learner.algorithms import ALGORITHMS, build_algorithm
from learner.trainer import Learner
from reval.config import BUILTIN_ALGORITHMS, AlgoConfig, LearnerConfig
from tests.unit.test_packing import CPU, EOS, PAD, tiny, trajs

ROOT = Path(__file__).resolve().parents[2]


def doc_example(tmp_path: Path) -> str:
    """docs/algorithm.md's ``my_losses.py``, written to a file: its import path."""
    text = (ROOT / "docs" / "algorithm.md").read_text()
    section = text[text.index("### Adding a loss") :]
    code = re.search(r"```python\n(# my_losses\.py\n.*?)```", section, re.S)
    assert code is not None, "docs/algorithm.md lost its worked example"
    path = tmp_path / "my_losses.py"
    path.write_text(code.group(1))
    return f"{path}:HuberReVal"


def test_the_registry_is_the_configs_list_and_says_the_same_policy() -> None:
    assert set(ALGORITHMS) == set(BUILTIN_ALGORITHMS)
    for name, on_policy in BUILTIN_ALGORITHMS.items():
        algo = AlgoConfig(name=name)
        assert build_algorithm(algo).on_policy is on_policy is algo.on_policy


def _grads(algo: AlgoConfig, delta: float | None = None) -> tuple[list[torch.Tensor], float]:
    lrn = Learner(model=tiny(), learner_cfg=LearnerConfig(micro_batch_size=4, lr=1e-3),
                  algo=algo, pad_id=PAD, eos_id=EOS, device=CPU)  # fmt: skip
    if delta is not None:
        lrn.algorithm.delta = delta  # type: ignore[attr-defined]
    with torch.no_grad():  # the policy away from the reference
        gen = torch.Generator().manual_seed(3)
        for p in lrn.model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    _, loss, _ = lrn._forward_backward(copy.deepcopy(trajs(9, seed=2)), None, None)
    return [p.grad.clone() for p in lrn.model.parameters()], loss


def test_a_loss_of_ones_own_by_import_path_trains(tmp_path: Path) -> None:
    spec = doc_example(tmp_path)
    reval, reval_loss = _grads(AlgoConfig(name="reval", beta=0.5))
    mine = AlgoConfig(name=spec, policy="off", beta=0.5)
    assert not mine.on_policy
    # Within delta the Huber loss is half the square: half of ReVal's loss and gradients.
    huber, huber_loss = _grads(mine, delta=1e9)
    assert huber_loss == pytest.approx(reval_loss / 2, rel=1e-5)
    for g, h in zip(reval, huber, strict=True):
        torch.testing.assert_close(h, g / 2, atol=1e-6, rtol=1e-4)
    # At delta = 1 the large residuals are clipped: another gradient.
    clipped, _ = _grads(mine)
    assert any(not torch.allclose(c, h) for c, h in zip(clipped, huber, strict=True))


def test_a_wrong_loss_name_or_policy_is_one_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="nor a built-in loss"):
        AlgoConfig(name="reval2")
    with pytest.raises(ValidationError, match=r"needs algo\.policy"):
        AlgoConfig(name="my_losses.py:HuberReVal")
    with pytest.raises(ValidationError, match="grpo is on-policy"):
        AlgoConfig(name="grpo", policy="off")
    assert AlgoConfig(name="grpo", policy="on").on_policy
    spec = doc_example(tmp_path)
    with pytest.raises(ValueError, match=r"is off-policy, but algo\.policy says on"):
        _grads(AlgoConfig(name=spec, policy="on"))
    with pytest.raises(ValueError, match=r"algo\.name: cannot import"):
        build_algorithm(AlgoConfig(name="no_such_module_xyz:Loss", policy="off"))
