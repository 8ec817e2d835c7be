"""The learning-curve figure draws every run quietly: a value loss on a log axis, GRPO's
surrogate (negative) and an all-zero start on a symmetric one, with no warning either way."""

from __future__ import annotations

import warnings

import pytest

from services.plot import plot_curve


@pytest.mark.parametrize(
    "losses", [[4.0, 2.0, 1.0], [0.3, -0.2, 0.0], [0.0, 0.0, 0.0]], ids=["reval", "grpo", "zero"]
)
def test_curve_draws_any_loss_without_warnings(tmp_path, losses):
    history = [
        {"round": i, "loss": v, "reward_mean": 0.1 * i, "eval_success": 0.1 * i}
        for i, v in enumerate(losses)
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # matplotlib's about the axis
        # (not a deprecation of a library under matplotlib: pyparsing 3.3's beside matplotlib
        # 3.8, the floors lane's, is a UserWarning too)
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        path = plot_curve(history, tmp_path / "curve.png", title="t")
    assert path.stat().st_size > 0
