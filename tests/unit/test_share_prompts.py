"""Shared prefixes (learner/sequence.py ``share_prompts``): each distinct prefix of a micro-batch
(each prompt, the answers' common starts) once in the row, the same log-probs, V(s1) and
gradients as the padded layout, no attention from one answer to another answer of the same
prompt, and the learner's choice of it."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from buffer.records import Trajectory
from learner.sequence import (
    SHARED_MAX_KEYS,
    VARLEN_SDPA,
    can_share_prompts,
    collate,
    make_batch,
    policy_stats,
    share_prompts,
    use_varlen_attention,
)
from learner.trainer import Learner
from reval.config import AlgoConfig, LearnerConfig, TinyModelConfig
from reval.policy import build_tiny_model

PAD, EOS, VOCAB = 0, 1, 40
CPU = torch.device("cpu")
TOL = {"atol": 1e-5, "rtol": 1e-5}
GRAD_TOL = {"atol": 5e-5, "rtol": 1e-4}
"""The gradients sum the same tokens in another order (float32): one element of 2560 differed by
1.7e-5 on one machine's CPU kernels (none on another), past test_packing's 1e-5."""


def tiny(seed: int = 0) -> torch.nn.Module:
    model = build_tiny_model(TinyModelConfig(), VOCAB, PAD, EOS, seed=seed)
    use_varlen_attention(model)
    assert model.config._attn_implementation == VARLEN_SDPA
    return model


def groups(n_prompts: int, per: int, seed: int = 0) -> list[Trajectory]:
    """``per`` answers to each of ``n_prompts`` prompts of uneven lengths, interleaved (as the
    replay buffer hands them out), with an empty answer, a one-token one and an EOS inside."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, VOCAB, int(rng.integers(1, 7))) for _ in range(n_prompts)]
    out = []
    for i in range(n_prompts * per):
        r = rng.integers(3, VOCAB, int(rng.integers(0, 6)))
        if i % 4 == 1 and r.size > 1:
            r[0] = EOS
        out.append(
            Trajectory(
                prompt_ids=prompts[i % n_prompts].copy(),
                response_ids=r,
                logprobs=-rng.random(r.size),
                reward_raw=float(i % 2),
                reward=float(i % 2) - 0.5,
                group_id=f"g{i % n_prompts}",
                traj_id=f"t{i}",
            )
        )
    out[3].response_ids, out[3].logprobs = out[3].response_ids[:0], out[3].logprobs[:0]
    out[4].response_ids, out[4].logprobs = out[4].response_ids[:1], out[4].logprobs[:1]
    return out


def prefixes(ts: list[Trajectory]) -> set[tuple[int, ...]]:
    """Every distinct prefix of the sequences ``share_prompts`` lays out (each prompt, then its
    response but the last token)."""
    out = set()
    for t in ts:
        s = tuple(t.prompt_ids.tolist()) + tuple(t.response_ids[:-1].tolist())
        out.update(s[: j + 1] for j in range(len(s)))
    return out


def alike(seed: int = 0) -> list[Trajectory]:
    """Answers that repeat and start alike, to prompts that start alike (a template's start),
    interleaved: the prefixes the tree merges."""
    rng = np.random.default_rng(seed)
    start = rng.integers(3, VOCAB, 3)
    prompts = [np.concatenate([start[: int(rng.integers(0, 4))], rng.integers(3, VOCAB, n)])
               for n in (1, 2, 2, 3)]  # fmt: skip
    answers = [np.array([5, 6, EOS]), np.array([5, 7, EOS]), np.array([5, EOS]),
               np.array([9]), np.array([], dtype=np.int64), np.array([5, 6, 8, EOS])]  # fmt: skip
    out = []
    for i in range(40):
        r = answers[int(rng.integers(0, len(answers)))].copy()
        out.append(Trajectory(prompt_ids=prompts[i % 4].copy(), response_ids=r,
                              logprobs=-rng.random(r.size), reward_raw=float(i % 2),
                              reward=float(i % 2) - 0.5, group_id=f"g{i % 4}",
                              traj_id=f"t{i}"))  # fmt: skip
    return out


@pytest.mark.parametrize("make", [lambda: groups(3, 5), alike])
def test_each_distinct_prefix_once(make):
    ts = make()
    b = share_prompts(ts, PAD, EOS)
    assert b.kv_index is not None and b.kv_valid is not None
    assert b.input_ids.shape == (1, len(prefixes(ts)))
    assert b.kv_index.shape == (b.input_ids.shape[1], b.kv_valid.shape[1])
    padded = collate(ts, PAD, EOS)
    for name in ("responses", "mask", "rollout_logp", "reward"):
        assert torch.equal(getattr(b, name), getattr(padded, name))
    # every position attends to itself last among its valid keys, and the keys of a position
    # spell its prefix: each of the row's positions is one distinct prefix
    last = b.kv_valid.long().cumsum(1).argmax(1)
    me = torch.arange(b.input_ids.shape[1])
    assert torch.equal(b.kv_index[me, last], me)
    ids = b.input_ids[0]
    spelled = {tuple(ids[b.kv_index[i][b.kv_valid[i]]].tolist()) for i in range(len(me))}
    assert spelled == prefixes(ts)
    assert torch.equal(b.position_ids[0], b.kv_valid.sum(1) - 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("make", [lambda: groups(4, 6, seed=1), lambda: alike(1)])
def test_shared_stats_and_gradients_equal_padded(dtype, make):
    model = tiny()
    ts = make()
    padded, shared = collate(ts, PAD, EOS), share_prompts(ts, PAD, EOS)
    out = []
    for batch in (padded, shared):
        model.zero_grad()
        s = policy_stats(model, batch, dtype)
        (s.slp.sum() + s.v1.pow(2).sum() + s.logp.pow(2).sum()).backward()
        out.append((s, [p.grad.clone() for p in model.parameters()]))
    (a, ga), (b, gb) = out
    tol = TOL if dtype == torch.float32 else {"atol": 5e-2, "rtol": 5e-2}
    torch.testing.assert_close(b.logp, a.logp, **tol)
    torch.testing.assert_close(b.slp, a.slp, **tol)
    torch.testing.assert_close(b.v1, a.v1, **tol)
    if dtype == torch.float32:
        for p, q in zip(gb, ga, strict=True):
            torch.testing.assert_close(p, q, **GRAD_TOL)


def test_answers_of_one_prompt_do_not_see_each_other():
    model = tiny()
    ts = groups(2, 4, seed=2)
    changed = copy.deepcopy(ts)
    a = next(i for i, t in enumerate(changed) if t.response_ids.size >= 3)
    changed[a].response_ids = changed[a].response_ids.copy()
    changed[a].response_ids[0] = 3 + (changed[a].response_ids[0] - 2) % (VOCAB - 3)
    with torch.no_grad():
        s0 = policy_stats(model, share_prompts(ts, PAD, EOS))
        s1 = policy_stats(model, share_prompts(changed, PAD, EOS))
    assert not torch.equal(s0.logp[a], s1.logp[a])
    others = [i for i in range(len(ts)) if i != a]
    torch.testing.assert_close(s0.logp[others], s1.logp[others], atol=1e-6, rtol=0)
    torch.testing.assert_close(s0.v1, s1.v1, atol=1e-6, rtol=0)


def test_long_sequences_are_not_shared():
    ts = groups(2, 3)
    assert make_batch(ts, PAD, EOS, False, share=True).kv_index is not None
    assert make_batch(ts, PAD, EOS, False, share=False).kv_index is None
    long = copy.deepcopy(ts)
    long[0].response_ids = np.full(SHARED_MAX_KEYS + 1, 5)
    long[0].logprobs = np.zeros(SHARED_MAX_KEYS + 1)
    b = make_batch(long, PAD, EOS, True, share=True)
    assert b.kv_index is None and b.bounds is not None  # packed as before


def test_learner_shares_prompts_on_the_cpu_only_when_it_can_pack(monkeypatch):
    import learner.sequence as sequence

    model = tiny()
    monkeypatch.setattr(sequence, "SHARE_PROMPTS", False)
    assert not can_share_prompts(model, CPU)  # (the switch)
    monkeypatch.setattr(sequence, "SHARE_PROMPTS", True)

    def learner(packing: bool) -> Learner:
        return Learner(model=tiny(), learner_cfg=LearnerConfig(packing=packing),
                       algo=AlgoConfig(name="reval"), pad_id=PAD, eos_id=EOS,
                       device=CPU)  # fmt: skip

    on, off = learner(True), learner(False)
    assert on.share_prompts and on.reference.share
    assert not off.share_prompts and not off.reference.share
    assert can_share_prompts(model, CPU)
    assert not can_share_prompts(model, torch.device("cuda"))
    model.config._attn_implementation = "sdpa"
    assert not can_share_prompts(model, CPU)


def test_update_steps_like_padded():
    ts = groups(3, 6, seed=3)
    params = []
    for share in (False, True):
        lrn = Learner(model=tiny(), learner_cfg=LearnerConfig(lr=1e-3, micro_batch_size=8),
                      algo=AlgoConfig(name="reval", beta=0.5), pad_id=PAD, eos_id=EOS,
                      device=CPU)  # fmt: skip
        lrn.share_prompts = lrn.reference.share = share
        for _ in range(2):
            lrn.update(copy.deepcopy(ts))
        params.append([p.detach().clone() for p in lrn.model.parameters()])
    for a, b in zip(*params, strict=True):  # (two AdamW steps on GRAD_TOL's gradients: AdamW
        torch.testing.assert_close(a, b, **GRAD_TOL)  # divides them by their own size)
