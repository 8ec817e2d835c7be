"""Packed micro-batches (learner/sequence.py ``pack``, learner/batches.py ``micro_batches``):
the same log-probs, V(s1), losses and gradients as the padded layout for every algorithm, with
the reference quantities; no attention across a sequence boundary; the token budget."""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from buffer.records import Trajectory
from learner.batches import micro_batches
from learner.sequence import (
    PACKED_ATTENTION,
    VARLEN_SDPA,
    collate,
    pack,
    policy_stats,
    resolve_packing,
    use_varlen_attention,
)
from learner.trainer import Learner
from reval.config import (
    AlgoConfig,
    LearnerConfig,
    TinyModelConfig,
    build_config,
    parse_overrides,
)
from reval.policy import build_tiny_model

PAD, EOS, VOCAB = 0, 1, 40
CPU = torch.device("cpu")
TOL = {"atol": 1e-5, "rtol": 1e-5}
GRAD_TOL = {"atol": 1e-5, "rtol": 1e-4}
"""Gradients sum over every token of the batch, in another order when packed: with transformers
5.24 one of 2,560 entries of the varlen-sdpa case differed by 1.3e-5 (relative 6.7e-5); a
packing bug (a token attending across sequences) moves them by orders of magnitude more."""


ATTENTION = ["sdpa", "eager", VARLEN_SDPA]


def tiny(seed: int = 0, attn: str = "sdpa") -> torch.nn.Module:
    model = build_tiny_model(TinyModelConfig(), VOCAB, PAD, EOS, seed=seed)
    if attn == VARLEN_SDPA:
        use_varlen_attention(model)
    else:
        model.config._attn_implementation = attn
    assert model.config._attn_implementation == attn
    return model


def trajs(n: int, seed: int = 0, empty: bool = False) -> list[Trajectory]:
    """Uneven prompts and responses, some ending in EOS (tokens after it are masked), some
    truncated; ``empty``: the last has no response at all (V(s1) only)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        p = rng.integers(3, VOCAB, int(rng.integers(1, 12)))
        r = rng.integers(3, VOCAB, int(rng.integers(1, 18)))
        if i % 3 == 0:
            r[int(rng.integers(0, r.size))] = EOS
        if empty and i == n - 1:
            r = r[:0]
        out.append(
            Trajectory(
                prompt_ids=p,
                response_ids=r,
                logprobs=-rng.random(r.size),
                reward_raw=float(i % 2),
                reward=float(i % 2) - 0.5,
                group_id=f"g{i // 4}",
                finish_reason="length" if i % 5 == 4 else "stop",
                traj_id=f"t{i}",
            )
        )
    return out


def equal_runs(ts: list[Trajectory]) -> list[Trajectory]:
    """Three then two consecutive trajectories of one length each (``_varlen_sdpa`` batches
    them)."""
    ts = copy.deepcopy(ts)
    for i, (p, r) in ((1, (4, 7)), (2, (4, 7)), (3, (4, 7)), (5, (6, 3)), (6, (6, 3))):
        t = ts[i]
        t.prompt_ids = np.resize(t.prompt_ids, p)
        t.response_ids = np.resize(t.response_ids, r)
        t.logprobs = np.resize(t.logprobs, r)
    return ts


@pytest.mark.parametrize("attn", ATTENTION)
@pytest.mark.parametrize("runs", [False, True])
def test_packed_stats_equal_padded(attn, runs):
    model = tiny(attn=attn)
    ts = trajs(8, seed=1, empty=True)
    if runs:
        ts = equal_runs(ts)
    padded, packed = collate(ts, PAD, EOS), pack(ts, PAD, EOS)
    assert packed.input_ids.shape == (1, sum(t.prompt_ids.size + t.response_ids.size for t in ts))
    assert packed.attention_mask is None
    assert packed.responses.shape == padded.responses.shape
    a, b = policy_stats(model, padded), policy_stats(model, packed)
    torch.testing.assert_close(b.logp, a.logp, **TOL)
    torch.testing.assert_close(b.slp, a.slp, **TOL)
    torch.testing.assert_close(b.v1, a.v1, **TOL)
    # gradients of a loss touching every output
    for stats_of in (padded, packed):
        model.zero_grad()
        s = policy_stats(model, stats_of)
        (s.slp.sum() + s.v1.pow(2).sum() + s.logp.pow(2).sum()).backward()
        if stats_of is padded:
            g = [p.grad.clone() for p in model.parameters()]
    for p, q in zip(model.parameters(), g, strict=True):
        torch.testing.assert_close(p.grad, q, **GRAD_TOL)
    with torch.no_grad():  # whatever the implementation, padded batches are as with sdpa
        torch.testing.assert_close(policy_stats(tiny(), padded).logp, a.logp, **TOL)


def _learner(algo: str, packing: bool, budget: int | None) -> Learner:
    return Learner(
        model=tiny(),
        learner_cfg=LearnerConfig(
            micro_batch_size=4, max_tokens_per_micro_batch=budget, packing=packing, lr=1e-3
        ),
        algo=AlgoConfig(name=algo, beta=0.5, mask_truncated=algo == "grpo"),  # type: ignore[arg-type]
        pad_id=PAD,
        eos_id=EOS,
        device=CPU,
    )


@pytest.mark.parametrize(
    ("algo", "weighted"),
    # (importance weights apply to the value losses only: GRPO runs unweighted)
    [(a, w) for a in ("reval", "tbrm", "regression", "grpo") for w in (False, True)
     if not (w and a == "grpo")],
)  # fmt: skip
def test_losses_gradients_and_reference_packed_equal_padded(algo, weighted):
    ts = trajs(11, seed=2)
    out = {}
    for packing, budget in ((False, None), (False, 60), (True, 60), (True, None)):
        lrn = _learner(algo, packing, budget)
        assert lrn.packed is packing and lrn.reference.packed is packing
        with torch.no_grad():  # the policy away from the reference
            gen = torch.Generator().manual_seed(3)
            for p in lrn.model.parameters():
                p.add_(0.02 * torch.randn(p.shape, generator=gen))
        mine = copy.deepcopy(ts)
        if algo == "grpo":
            lrn.remember_old_logp(mine[:5])  # part remembered, part the update's own
        w = None
        keep = None
        if weighted:
            w = torch.linspace(0.5, 1.5, len(mine))
        if algo == "grpo":
            keep = torch.tensor([t.finish_reason != "length" for t in mine]).float()
        totals, loss, delta = lrn._forward_backward(mine, w, keep)
        grads = [p.grad.clone() for p in lrn.model.parameters()]
        ref = [(t.ref_logprob_sum, t.ref_value) for t in mine]
        out[(packing, budget)] = (totals, loss, delta, grads, ref)
    base = out[(False, None)]
    for key, (totals, loss, delta, grads, ref) in out.items():
        assert loss == pytest.approx(base[1], abs=1e-5), key
        torch.testing.assert_close(delta, base[2], **TOL)
        for k, v in base[0].items():
            assert totals[k] == pytest.approx(v, abs=1e-5), (key, k)
        for g, h in zip(grads, base[3], strict=True):
            torch.testing.assert_close(g, h, **TOL)
        if algo != "grpo":
            np.testing.assert_allclose(np.array(ref), np.array(base[4]), atol=1e-5)
            assert any(r != (0.0, 0.0) for r in ref)


def test_packed_update_steps_like_padded():
    ts = trajs(9, seed=4)
    params = []
    for packing in (False, True):
        lrn = _learner("reval", packing, 48)
        for _ in range(2):
            lrn.update(copy.deepcopy(ts))
        params.append([p.detach().clone() for p in lrn.model.parameters()])
    for a, b in zip(*params, strict=True):
        torch.testing.assert_close(a, b, **TOL)


def _row_stats(model, ts, full_mask: bool = False):
    b = pack(ts, PAD, EOS)
    if full_mask:  # one causal sequence over the whole row: attention crosses the boundaries
        b = dataclasses.replace(b, attention_mask=torch.ones_like(b.input_ids), bounds=None)
    with torch.no_grad():
        return policy_stats(model, b)


@pytest.mark.parametrize("attn", ATTENTION)
def test_no_attention_across_sequences(attn):
    model = tiny(attn=attn)
    ts = equal_runs(trajs(7, seed=5))
    changed = copy.deepcopy(ts)
    a = changed[1]  # sequence A, first of a run of 3 of one length: change two tokens
    a.prompt_ids = a.prompt_ids.copy()
    a.prompt_ids[-1] = 3 + (a.prompt_ids[-1] - 2) % (VOCAB - 3)
    a.response_ids = a.response_ids.copy()
    a.response_ids[0] = 3 + (a.response_ids[0] - 2) % (VOCAB - 3)
    for full_mask in (False, True):
        s0, s1 = _row_stats(model, ts, full_mask), _row_stats(model, changed, full_mask)
        assert not torch.equal(s0.logp[1], s1.logp[1])  # A itself did change
        assert torch.equal(s0.logp[0], s1.logp[0])  # before A: causal either way
        later_same = torch.equal(s0.logp[2:], s1.logp[2:]) and torch.equal(s0.v1[2:], s1.v1[2:])
        # packed: the sequences after A are bit-identical; with the whole row attending, not
        assert later_same is not full_mask


def test_continuous_positions_would_leak():
    """The boundaries come from the positions restarting: the same row numbered 0..L-1 is one
    sequence (so the isolation test above would catch a packer that got them wrong)."""
    model = tiny()
    ts = trajs(2, seed=6)
    good = pack(ts, PAD, EOS)
    bad = dataclasses.replace(good, position_ids=torch.arange(good.input_ids.shape[1])[None])
    with torch.no_grad():
        alone = policy_stats(model, collate(ts[1:], PAD, EOS))
        assert torch.allclose(policy_stats(model, good).slp[1], alone.slp[0], atol=1e-5)
        assert not torch.allclose(policy_stats(model, bad).slp[1], alone.slp[0], atol=1e-3)


def _check_plan(sizes, max_count, budget, packed):
    parts = micro_batches(sizes, max_count, budget, packed)
    assert sorted(i for p in parts for i in p) == list(range(len(sizes)))  # each exactly once
    for p in parts:
        assert 1 <= len(p) <= max_count
        if budget is not None:
            if packed:
                cost = sum(sizes[i][0] + sizes[i][1] for i in p)
            else:
                cost = len(p) * (max(sizes[i][0] for i in p) + max(sizes[i][1] for i in p))
            assert cost <= budget
    return parts


@settings(max_examples=200, deadline=None)
@given(
    sizes=st.lists(st.tuples(st.integers(1, 600), st.integers(0, 3000)), min_size=0, max_size=80),
    max_count=st.integers(1, 40),
    slack=st.integers(0, 20_000),
    packed=st.booleans(),
    budgeted=st.booleans(),
)
def test_budget_never_exceeded_and_every_index_once(sizes, max_count, slack, packed, budgeted):
    longest = max((p + r for p, r in sizes), default=1)
    budget = longest + slack if budgeted else None
    parts = _check_plan(sizes, max_count, budget, packed)
    if packed and budget is not None:
        # first fit: no two micro-batches could have been one (the later one's first trajectory
        # would have fitted into the earlier one when it was placed)
        loads = [sum(sizes[i][0] + sizes[i][1] for i in p) for p in parts]
        for j in range(len(parts)):
            for i in range(j):
                assert loads[i] + loads[j] > budget or len(parts[i]) + len(parts[j]) > max_count


@pytest.mark.parametrize("packed", [False, True])
def test_trajectory_longer_than_the_budget_is_an_error(packed):
    with pytest.raises(ValueError, match="max_tokens_per_micro_batch"):
        micro_batches([(3, 4), (10, 20), (1, 1)], 8, 29, packed)
    assert micro_batches([(3, 4), (10, 20), (1, 1)], 8, 30, packed)


def test_packing_fills_the_budget():
    sizes = [(5, 15), (5, 5), (2, 8), (10, 10), (1, 9), (3, 2)]
    parts = micro_batches(sizes, 8, 30, packed=True)
    assert [sum(sum(sizes[i]) for i in p) for p in parts] == [30, 30, 15]
    assert sorted(len(p) for p in micro_batches(sizes, 2, None, packed=True)) == [2, 2, 2]


def test_resolve_packing():
    model = tiny()
    assert LearnerConfig().packing == "auto"
    for text, value in (("true", True), ("false", False), ("auto", "auto")):
        cfg = build_config(parse_overrides([f"learner.packing={text}"]))
        assert cfg.learner.packing == value and type(cfg.learner.packing) is type(value)
    with pytest.raises(ValueError):
        build_config(parse_overrides(["learner.packing=3"]))
    assert resolve_packing("auto", model) is (model.config._attn_implementation in PACKED_ATTENTION)
    assert resolve_packing("auto", model) is True  # the tiny model runs sdpa on the CPU
    assert resolve_packing(False, model) is False and resolve_packing(True, model) is True
    model.config._attn_implementation = "paged|sdpa"  # no packed-sequence mask: padded
    assert resolve_packing("auto", model) is False
    with pytest.raises(ValueError):
        resolve_packing("sometimes", model)
    # a packing learner gives its sdpa model (and the reference's) the per-sequence attention
    lrn = _learner("reval", True, None)
    assert lrn.model.config._attn_implementation == VARLEN_SDPA
    assert lrn.reference.model.config._attn_implementation == VARLEN_SDPA
    assert _learner("reval", False, None).model.config._attn_implementation == "sdpa"
    eager = tiny(attn="eager")
    use_varlen_attention(eager)  # only sdpa is replaced
    assert eager.config._attn_implementation == "eager"


def test_auto_packs_a_share_only_when_padding_wastes_enough():
    """``learner.packing = "auto"``: equal lengths stay padded (nothing to save); RL-like
    lengths are packed; the threshold is the device's (any padding on a GPU)."""
    from learner.batches import AUTO_PACK_BELOW, layout

    equal = [(32, 224)] * 16
    assert layout(equal, 8, None, True, AUTO_PACK_BELOW["cpu"])[0] is False
    assert layout(equal, 8, None, True, AUTO_PACK_BELOW["cuda"])[0] is False
    rng = np.random.default_rng(0)
    responses = np.minimum(rng.lognormal(4, 0.8, 64), 512).astype(int) + 1
    rl = [(int(p), int(r)) for p, r in zip(rng.integers(4, 32, 64), responses, strict=True)]
    packed, parts = layout(rl, 8, None, True, AUTO_PACK_BELOW["cpu"])
    assert packed and sorted(i for p in parts for i in p) == list(range(64))
    slight = [(8, 8)] * 7 + [(8, 9)]  # 1 token of padding in 128: kept padded on the CPU...
    assert layout(slight, 8, None, True, AUTO_PACK_BELOW["cpu"])[0] is False
    assert layout(slight, 8, None, True, AUTO_PACK_BELOW["cuda"])[0] is True  # ...not on a GPU
    assert layout(rl, 8, None, False, AUTO_PACK_BELOW["cpu"])[0] is False  # cannot pack
    assert layout(equal, 8, None, True, None)[0] is True  # packing = true
