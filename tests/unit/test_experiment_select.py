"""The one-shot study's selection rules: censored medians, the best grid value, ties."""

from __future__ import annotations

import pytest

from services.experiments import Cell, _median, choose, parse_floats, select_beta, select_lr


def cell(d: str, m: str, seed: int, lr: float, beta: float, rounds: int | None) -> Cell:
    return Cell(d, m, seed, lr, beta, rounds, [0.4], 0.0)


def test_median_counts_a_run_that_never_got_there_beyond_the_cap():
    assert _median([10, None, None], cap=50) == 51
    assert _median([10, 20, None], cap=50) == 20


def test_choose_takes_the_lowest_score_and_the_smaller_value_on_a_tie():
    assert choose({0.3: 5.0, 0.1: 7.0}) == 0.3
    assert choose({0.3: 5.0, 0.1: 5.0, 1.0: 5.0}) == 0.1


def test_select_beta_averages_the_medians_over_difficulty_and_method():
    cells = [
        cell("hard", "reval-8", 100, 1e-3, 0.1, 10), cell("hard", "reval-8", 101, 1e-3, 0.1, 30),
        cell("easy", "reval-8", 100, 1e-3, 0.1, 10), cell("easy", "reval-8", 101, 1e-3, 0.1, 10),
        cell("hard", "reval-8", 100, 1e-3, 0.3, 12), cell("hard", "reval-8", 101, 1e-3, 0.3, 12),
        cell("easy", "reval-8", 100, 1e-3, 0.3, None), cell("easy", "reval-8", 101, 1e-3, 0.3, 4),
    ]  # fmt: skip
    beta, scores = select_beta(cells, cap=50)
    assert scores == {0.1: pytest.approx((20 + 10) / 2), 0.3: pytest.approx((12 + 27.5) / 2)}
    assert beta == 0.1


def test_select_lr_is_per_method():
    cells = [
        cell("hard", "grpo", 100, 1e-3, 0.1, 40), cell("hard", "grpo", 100, 1e-2, 0.1, 5),
        cell("hard", "reval-8", 100, 1e-3, 0.1, 3), cell("hard", "reval-8", 100, 1e-2, 0.1, None),
    ]  # fmt: skip
    lrs, scores = select_lr(cells, cap=50)
    assert lrs == {"grpo": 1e-2, "reval-8": 1e-3}
    assert scores["reval-8"][1e-2] == 51


def test_parse_floats():
    assert parse_floats("1e-3, 3e-3") == (1e-3, 3e-3)
    assert parse_floats("") == ()
    for bad in ("0", "-1", "nan", "x"):
        with pytest.raises(ValueError):
            parse_floats(bad)
