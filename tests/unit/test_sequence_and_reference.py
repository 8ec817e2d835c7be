"""Model plumbing on the real tiny model: layout, padding invariance, micro-batching, reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from buffer.records import Trajectory
from learner.losses import grpo_advantages, grpo_loss, value_loss
from learner.reference import ReferencePolicy
from learner.sequence import collate, policy_stats
from learner.trainer import Learner
from reval.config import AlgoConfig, LearnerConfig, TinyModelConfig
from reval.policy import build_tiny_model

PAD, EOS, VOCAB = 0, 1, 40


@pytest.fixture
def model():
    torch.manual_seed(0)
    return build_tiny_model(TinyModelConfig(), VOCAB, PAD, EOS, seed=0)


def trajs(n: int, seed: int = 0) -> list[Trajectory]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        p = rng.integers(3, VOCAB, int(rng.integers(2, 7)))
        r = rng.integers(3, VOCAB, int(rng.integers(1, 6)))
        if i % 2 == 0:
            r = np.append(r, EOS)
        out.append(
            Trajectory(
                prompt_ids=p,
                response_ids=r,
                logprobs=-np.ones(r.size),
                reward_raw=float(i % 3 == 0),
                reward=float(i % 3 == 0),
                traj_id=f"t{i}",
            )
        )
    return out


def unpadded_stats(model, t: Trajectory):
    ids = torch.tensor(np.concatenate([t.prompt_ids, t.response_ids]), dtype=torch.long)[None]
    logits = model(input_ids=ids).logits[0].float()
    p = t.prompt_ids.size
    z = logits[p - 1 : -1]
    y = torch.tensor(t.response_ids, dtype=torch.long)
    logp = z.log_softmax(-1).gather(-1, y[:, None])[:, 0]
    return logp.sum().item(), torch.logsumexp(z[0], -1).item()


def test_collate_layout():
    ts = trajs(3)
    b = collate(ts, PAD, EOS)
    plen = max(t.prompt_ids.size for t in ts)
    for i, t in enumerate(ts):
        # last prompt token sits at index P-1 for every row (left padding)
        assert b.input_ids[i, plen - 1].item() == t.prompt_ids[-1]
        assert b.mask[i].sum().item() == t.response_ids.size
        assert b.position_ids[i, plen].item() == t.prompt_ids.size  # positions ignore padding


def test_padded_batch_equals_one_by_one(model):
    model.eval()
    ts = trajs(6)
    with torch.no_grad():
        st = policy_stats(model, collate(ts, PAD, EOS))
        for i, t in enumerate(ts):
            slp, v1 = unpadded_stats(model, t)
            assert st.slp[i].item() == pytest.approx(slp, abs=1e-4)
            assert st.v1[i].item() == pytest.approx(v1, abs=1e-4)


def test_microbatched_gradient_equals_full_batch(model):
    ts = trajs(8)
    ref = ReferencePolicy(model, PAD, EOS, micro_batch_size=8)
    for p in model.parameters():  # move the policy away from the reference
        p.data.add_(0.01 * torch.randn_like(p))
    ref.fill(ts, torch.device("cpu"))

    def grads(chunks):
        model.zero_grad()
        for c in chunks:
            b = collate(c, PAD, EOS)
            s = policy_stats(model, b)
            sr = torch.tensor([t.ref_logprob_sum for t in c])
            vr = torch.tensor([t.ref_value for t in c])
            value_loss("reval", s.slp, s.v1, sr, vr, b.reward, 0.5, denom=len(ts)).loss.backward()
        return [p.grad.clone() for p in model.parameters()]

    full = grads([ts])
    split = grads([ts[:3], ts[3:5], ts[5:]])
    for a, b in zip(full, split, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_reference_cache_is_per_version_and_reset_calibrates(model):
    ts = trajs(5)
    lc = LearnerConfig(micro_batch_size=2, lr=1e-2)
    learner = Learner(model, lc, AlgoConfig(beta=0.5), PAD, EOS, torch.device("cpu"))
    ref = learner.reference
    assert ref.fill(ts, torch.device("cpu")) == 5
    assert ref.fill(ts, torch.device("cpu")) == 0  # cached, same version
    # at the start theta = ref: delta = -r/beta for every trajectory
    out = learner.update(ts)
    want = -torch.tensor([t.reward for t in ts]) / 0.5
    torch.testing.assert_close(out.delta, want, atol=1e-4, rtol=0)
    before = [t.ref_logprob_sum for t in ts]
    learner.update(ts)  # the policy moves; the reference does not
    assert [t.ref_logprob_sum for t in ts] == before
    learner.reset_reference()
    assert ref.version == 1
    out = learner.update(ts)  # caches are stale: recomputed against the new reference
    assert all(t.ref_version == 1 for t in ts)
    assert [t.ref_logprob_sum for t in ts] != before
    torch.testing.assert_close(out.delta, want, atol=1e-4, rtol=0)


def test_nonfinite_gradient_step_is_skipped(model):
    ts = trajs(4)
    learner = Learner(model, LearnerConfig(), AlgoConfig(beta=0.5), PAD, EOS, torch.device("cpu"))
    learner.reference.fill(ts, torch.device("cpu"))
    ts[0].ref_logprob_sum = float("inf")  # poisons the residual
    before = [p.detach().clone() for p in model.parameters()]
    out = learner.update(ts)
    assert out.skipped and learner.skipped_steps == 1 and learner.step == 0
    for a, p in zip(before, model.parameters(), strict=True):
        assert torch.equal(a, p)


def test_grpo_update_moves_toward_rewarded_answers(model):
    ts = trajs(8)
    for i, t in enumerate(ts):
        t.group_id = "g"
        t.reward_raw = float(i < 4)
    lc = LearnerConfig(micro_batch_size=3, lr=1e-2, updates_per_round=1)
    learner = Learner(model, lc, AlgoConfig(name="grpo"), PAD, EOS, torch.device("cpu"))
    with torch.no_grad():
        before = policy_stats(model, collate(ts, PAD, EOS)).slp
    for _ in range(5):
        learner.update(ts)
    with torch.no_grad():
        after = policy_stats(model, collate(ts, PAD, EOS)).slp
    gain = after - before
    assert gain[:4].mean() > gain[4:].mean()


def test_grpo_later_update_of_a_round_clips_against_the_pre_round_policy(model):
    """Two updates per round: the second update's ratio is taken against the log-probs the
    round started with (verl's old_log_prob, TRL's steps_per_generation), not its own (1)."""
    ts = trajs(16)
    for i, t in enumerate(ts):
        t.group_id = f"g{i // 8}"
        t.reward_raw = float(i % 2)
    first, second = ts[:8], ts[8:]
    lc = LearnerConfig(micro_batch_size=8, lr=5e-2, grad_clip=100.0)  # one micro-batch
    learner = Learner(model, lc, AlgoConfig(name="grpo", tis_cap=0.0), PAD, EOS,
                      torch.device("cpu"))  # fmt: skip
    with torch.no_grad():
        pre = policy_stats(model, collate(second, PAD, EOS)).logp
    learner.remember_old_logp(ts)
    assert learner.update(first).metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    with torch.no_grad():
        now = policy_stats(model, collate(second, PAD, EOS))
    raw = torch.tensor([t.reward_raw for t in second])
    adv = grpo_advantages(raw, [t.group_id for t in second])
    expected = grpo_loss(now.logp, pre, adv, collate(second, PAD, EOS).mask, tis_cap=0.0)
    got = learner.update(second).metrics
    assert abs(expected.metrics["ratio_mean"] - 1.0) > 1e-3  # the first update moved the policy
    assert got["ratio_mean"] == pytest.approx(expected.metrics["ratio_mean"], rel=1e-5)
    assert got["ppo_kl"] == pytest.approx(expected.metrics["ppo_kl"], rel=1e-4, abs=1e-7)
    assert learner.old_logp == {}  # each remembered row serves one update
    # Without a remembered round the update is its own old policy.
    assert learner.update(second).metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-5)
