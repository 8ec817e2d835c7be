"""The HF engine's sampler (``rollout.engines.sample_tokens``): the inverse of each row's
cumulative sum at its uniform draw, in place of ``torch.multinomial``; and its batch dropping
finished answers (``COMPACT_AT``) without changing any answer."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from reval.config import ModelConfig
from reval.policy import load_policy
from rollout import engines
from rollout.engines import HFEngine, SamplingParams, sample_tokens


def test_draws_follow_each_rows_distribution() -> None:
    probs = torch.tensor([[0.1, 0.2, 0.3, 0.4, 0.0], [0.0, 0.0, 2.0, 0.0, 6.0]])  # unnormalised
    gen = torch.Generator().manual_seed(0)
    n = 40_000
    draws = sample_tokens(probs.repeat(n, 1), torch.rand(2 * n, 1, generator=gen))
    draws = draws[:, 0].view(n, 2)
    for row in range(2):
        counts = torch.bincount(draws[:, row], minlength=5).double()
        expected = probs[row].double() / probs[row].sum() * n
        sd = (expected * (1 - expected / n)).sqrt()
        assert (counts - expected).abs().le(4 * sd + 1e-9).all(), (row, counts, expected)
        assert counts[probs[row] == 0].sum() == 0


@pytest.mark.parametrize(("u", "want"), [(0.0, [1, 2]), (1.0, [2, 2])])
def test_a_zero_probability_token_is_never_drawn_at_the_draws_ends(u, want) -> None:
    """The uniform's lowest, and a draw rounded up to the row's total."""
    probs = torch.tensor([[0.0, 0.5, 0.5, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0, 0.0]])
    assert sample_tokens(probs, torch.full((2, 1), u))[:, 0].tolist() == want


@pytest.fixture(scope="module")
def policy():
    torch.manual_seed(0)
    return load_policy(ModelConfig(device="cpu"), seed=0)


def test_dropping_finished_answers_changes_no_answer(policy, monkeypatch) -> None:
    """With finished answers dropped from the batch (their cache rows too), the later decoding
    forwards carry only the answers still running, and every answer, log-prob and finish reason
    is the one of decoding every row to the end."""
    engine = HFEngine(policy.model, policy.pad_id, policy.eos_id)
    rows: list[int] = []
    hook = policy.model.register_forward_pre_hook(
        lambda _m, _a, kw: rows.append(int(kw["input_ids"].shape[0])), with_kwargs=True
    )
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13, 14], [15, 16]]
    params = SamplingParams(n=16, max_new_tokens=12, temperature=1.5)
    out = {}
    try:
        for compact in (0.0, 1.0):  # drop at the first finished answer; never
            monkeypatch.setattr(engines, "COMPACT_AT", compact)
            rows.clear()
            out[compact] = [s for g in engine.generate(prompts, params, seed=7) for s in g]
            if compact == 0.0:
                dropped = list(rows)
    finally:
        hook.remove()
    assert set(rows[1:]) == {64}  # never: every row to the end
    ends = sorted(s.token_ids.size for s in out[0.0])
    assert ends[0] < ends[-1], "the test needs answers of several lengths"
    # after the prefill (4 distinct prompts), the forward for step j carries the answers longer
    # than j tokens
    assert dropped[1:] == [sum(n > j for n in ends) for j in range(1, len(dropped))]
    for a, b in zip(out[0.0], out[1.0], strict=True):
        assert a.token_ids.tolist() == b.token_ids.tolist() and a.finish_reason == b.finish_reason
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
