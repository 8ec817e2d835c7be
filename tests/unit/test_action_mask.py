"""The action mask of multi-turn records (issue 28): it travels (and old records without it still
decode, every token an action), bad masks are refused, and the environment's tokens leave the
loss: the gradient of ReVal, TBRM, regression and GRPO with respect to the logits that predict
them is exactly zero, padded and packed."""

from __future__ import annotations

import dataclasses

import msgpack
import numpy as np
import pytest
import torch

import learner.sequence as sequence
from buffer.record_codec import decode, decode_many, encode, encode_many
from buffer.records import OLD_SCHEMA_VERSION, WIRE_FIELDS, RecordError, Trajectory
from learner.losses import grpo_loss, value_loss
from learner.sequence import collate, make_batch, policy_stats
from reval.config import TinyModelConfig
from reval.policy import build_tiny_model

PAD, EOS, VOCAB = 0, 1, 40


def episode(i: int, turns: int = 2) -> Trajectory:
    """A response of ``turns`` model turns (each ending with EOS) with an observation between
    each two (mask 0, log-prob 0)."""
    rng = np.random.default_rng(i)
    ids: list[int] = []
    mask: list[int] = []
    for k in range(turns):
        turn = [*rng.integers(3, VOCAB, int(rng.integers(1, 4))).tolist(), EOS]
        ids += turn
        mask += [1] * len(turn)
        if k < turns - 1:
            obs = rng.integers(3, VOCAB, int(rng.integers(2, 5))).tolist()
            ids += obs
            mask += [0] * len(obs)
    m = np.array(mask, dtype=np.uint8)
    return Trajectory(
        prompt_ids=rng.integers(3, VOCAB, int(rng.integers(2, 6))),
        response_ids=np.array(ids),
        logprobs=np.where(m == 1, -0.5, 0.0),
        reward_raw=float(i % 2),
        reward=float(i % 2),
        group_id="g",
        traj_id=f"e{i}",
        action_mask=m,
    )


def test_an_old_record_decodes_with_the_mask_absent():
    t = episode(0)
    single = dataclasses.replace(t, action_mask=np.zeros(0, np.uint8))
    row = msgpack.unpackb(encode(single))
    at, spans = WIRE_FIELDS.index("action_mask"), WIRE_FIELDS.index("version_spans")
    old = msgpack.packb([OLD_SCHEMA_VERSION, *row[1:at], *row[at + 1 : spans], *row[spans + 1 :]],
                        use_bin_type=True)  # fmt: skip
    back = decode(old)
    assert back.action_mask.size == 0
    assert back.response_ids.tolist() == t.response_ids.tolist()
    good, bad = decode_many([old, encode(t)])
    assert not bad and good[0].action_mask.size == 0
    assert good[1].action_mask.tolist() == t.action_mask.tolist()
    # Absent = every token an action: the learner's mask is the EOS rule (cut at the first EOS).
    first_eos = int(np.argmax(t.response_ids == EOS))
    assert collate([back], PAD, EOS).mask[0].tolist() == [
        float(j <= first_eos) for j in range(t.response_ids.size)
    ]


def test_the_mask_travels():
    ts = [episode(i) for i in range(3)]
    for back, t in zip(decode_many(encode_many(ts))[0], ts, strict=True):
        assert back.action_mask.tolist() == t.action_mask.tolist()
    assert decode(encode(ts[0])).action_mask.dtype == np.uint8


@pytest.mark.parametrize(
    ("make", "words"),
    [
        (lambda n: [1, 0], "entries for"),
        (lambda n: [0] + [1] * (n - 1), "first response token"),
        (lambda n: [1] + [2] * (n - 1), "0 or 1"),
    ],
)
def test_a_bad_mask_is_refused(make, words):
    t = episode(1)
    bad = dataclasses.replace(t, action_mask=np.array(make(t.response_ids.size), np.uint8))
    with pytest.raises(RecordError, match=words):
        bad.validate()
    with pytest.raises(RecordError, match=words):
        encode_many([t, bad])
    # On the wire (another producer's bytes): the batch decoder finds exactly that record.
    row = msgpack.unpackb(encode(t))
    row[WIRE_FIELDS.index("action_mask")] = bad.action_mask.tobytes()
    good, errors = decode_many([encode(t), msgpack.packb(row, use_bin_type=True)])
    assert len(good) == 1 and [i for i, _ in errors] == [1] and words in str(errors[0][1])


# -- the loss ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return build_tiny_model(TinyModelConfig(), VOCAB, PAD, EOS, seed=0)


def _logits_grad(model, trajs, packed: bool, kind: str, monkeypatch) -> tuple[torch.Tensor, ...]:
    """(|dL/dz| per response position [B, T], the batch's mask [B, T], slp [B]): z the logits
    that predict each response token, from the real ``policy_stats`` path."""
    captured: list[torch.Tensor] = []
    plain = sequence._logp_lse

    def spy(z, y):
        if z.requires_grad:
            z.retain_grad()
            captured.append(z)
        return plain(z, y)

    monkeypatch.setattr(sequence, "_logp_lse", spy)
    monkeypatch.setattr(sequence, "checkpoint", lambda f, *a, **_: f(*a))  # keep z in the graph
    batch = make_batch(trajs, PAD, EOS, packed)
    model.zero_grad()
    stats = policy_stats(model, batch)
    bsz = len(trajs)
    if kind == "grpo":
        adv = torch.tensor([1.0, -1.0] * (bsz // 2))
        old = stats.logp.detach() + 0.05
        out = grpo_loss(stats.logp, old, adv, batch.mask, rollout_logp=batch.rollout_logp)
    else:
        ref = torch.full((bsz,), -3.0), torch.full((bsz,), 2.0)
        out = value_loss(kind, stats.slp, stats.v1, ref[0], ref[1], batch.reward, 0.1)  # type: ignore[arg-type]
    out.loss.backward()
    (z,) = captured
    g = z.grad.abs().sum(-1)
    t = batch.response_len
    grid = g.new_zeros(bsz * t).index_copy(0, batch.dest, g[0]).view(bsz, t) if packed else g
    return grid, batch.mask, stats.slp.detach()


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("kind", ["reval", "tbrm", "regression", "grpo"])
def test_no_gradient_reaches_the_environments_tokens(model, packed, kind, monkeypatch):
    trajs = [episode(i, turns=2 + i % 2) for i in range(4)]
    grid, mask, _ = _logits_grad(model, trajs, packed, kind, monkeypatch)
    for b, t in enumerate(trajs):
        n = t.response_ids.size
        env = torch.from_numpy(t.action_mask == 0)
        assert env.any()
        assert mask[b, :n].tolist() == t.action_mask.tolist()
        assert (grid[b, :n][env] == 0).all(), (kind, packed, b)
        assert (grid[b, :n][~env] > 0).all(), (kind, packed, b)  # every action still learns
        assert (grid[b, n:] == 0).all()


def test_the_log_prob_sum_is_over_the_actions_only(model):
    """slp of an episode = the sum of log pi over its model tokens (from a plain forward), and
    V(s1) is at the position that predicts the first response token."""
    trajs = [episode(i) for i in range(3)]
    with torch.no_grad():
        for packed in (False, True):
            stats = policy_stats(model, make_batch(trajs, PAD, EOS, packed))
            for b, t in enumerate(trajs):
                ids = torch.tensor(np.concatenate([t.prompt_ids, t.response_ids]))[None].long()
                z = model(input_ids=ids).logits[0, t.prompt_ids.size - 1 : -1].float()
                logp = z.log_softmax(-1).gather(-1, ids[0, t.prompt_ids.size :, None])[:, 0]
                keep = torch.from_numpy(t.action_mask.astype(bool))
                assert stats.slp[b].item() == pytest.approx(logp[keep].sum().item(), abs=1e-4)
                assert stats.v1[b].item() == pytest.approx(
                    torch.logsumexp(z[0], -1).item(), abs=1e-4
                )
