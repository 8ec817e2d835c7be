"""The HF engine's sampler (``rollout.engines.sample_tokens``): the inverse of each row's
cumulative sum at one uniform draw, in place of ``torch.multinomial``."""

from __future__ import annotations

import torch

from rollout import engines
from rollout.engines import sample_tokens


def test_draws_follow_each_rows_distribution() -> None:
    probs = torch.tensor([[0.1, 0.2, 0.3, 0.4, 0.0], [0.0, 0.0, 2.0, 0.0, 6.0]])  # unnormalised
    gen = torch.Generator().manual_seed(0)
    n = 40_000
    draws = sample_tokens(probs.repeat(n, 1), gen)[:, 0].view(n, 2)
    for row in range(2):
        counts = torch.bincount(draws[:, row], minlength=5).double()
        expected = probs[row].double() / probs[row].sum() * n
        sd = (expected * (1 - expected / n)).sqrt()
        assert (counts - expected).abs().le(4 * sd + 1e-9).all(), (row, counts, expected)
        assert counts[probs[row] == 0].sum() == 0


def test_a_zero_probability_token_is_never_drawn_at_the_draws_ends(monkeypatch) -> None:
    probs = torch.tensor([[0.0, 0.5, 0.5, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0, 0.0]])
    gen = torch.Generator().manual_seed(0)
    for u in (0.0, 1.0):  # the uniform's lowest, and a draw rounded up to the row's total
        monkeypatch.setattr(engines.torch, "rand", lambda shape, u=u, **_: torch.full(shape, u))
        picked = sample_tokens(probs, gen)[:, 0].tolist()
        assert picked == ([1, 2] if u == 0.0 else [2, 2])


def test_the_generator_makes_the_draws() -> None:
    probs = torch.full((64, 10), 0.1)
    a = sample_tokens(probs, torch.Generator().manual_seed(3))
    b = sample_tokens(probs, torch.Generator().manual_seed(3))
    c = sample_tokens(probs, torch.Generator().manual_seed(4))
    assert torch.equal(a, b) and not torch.equal(a, c)
