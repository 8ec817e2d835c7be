"""docs/algorithm.md §6 properties and §7 test vectors, on CPU in float64."""

from __future__ import annotations

import math

import pytest
import torch

from learner.losses import (
    bellman_residual,
    grpo_advantages,
    grpo_loss,
    value_loss,
)
from learner.sequence import eos_mask, sequence_stats

KINDS = ("reval", "tbrm", "regression")


@pytest.fixture(autouse=True)
def _float64():
    """These tests compute in float64; restore the default for the rest of the session."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


def stats64(z: torch.Tensor, y: torch.Tensor, m: torch.Tensor):
    """sequence_stats upcasts to fp32; the vector tests want fp64, so mirror its maths there."""
    logp = z.log_softmax(-1).gather(-1, y[..., None])[..., 0] * m
    return logp.sum(-1), torch.logsumexp(z[:, 0], -1)


def loss_of(kind, z, zref, y, m, r, beta):
    slp, v1 = stats64(z, y, m)
    with torch.no_grad():
        slp_ref, v1_ref = stats64(zref, y, m)
    if kind == "regression":
        v1 = torch.zeros_like(v1)
        v1_ref = torch.zeros_like(v1_ref)
    return value_loss(kind, slp, v1, slp_ref, v1_ref, r, beta)


def closed_form_grad(kind, z, y, m, delta):
    """docs/algorithm.md §3: dL/dz at logit level."""
    bsz = z.shape[0]
    p = z.softmax(-1)
    onehot = torch.nn.functional.one_hot(y, z.shape[-1]).to(z.dtype)
    g = (2.0 / bsz) * delta[:, None, None] * m[..., None] * (onehot - p)
    if kind in ("reval", "tbrm"):
        g[:, 0, :] = (2.0 / bsz) * delta[:, None] * onehot[:, 0, :] * m[:, 0, None]
    return g


# -- §7 vectors -------------------------------------------------------------------------------

V1_Z = torch.tensor([[[2.0, 1, 0, -1], [0.5, 0.5, 0, 0], [1, 0, 0, 3]]], dtype=torch.float64)
V1_Y = torch.tensor([[0, 1, 3]])


def test_v1_calibrated_init_vs_tbrm():
    m = torch.ones(1, 3)
    r = torch.zeros(1)
    for kind, want_l in (("reval", 0.0), ("regression", 0.0), ("tbrm", 5.954526)):
        z = V1_Z.clone().requires_grad_(True)
        out = loss_of(kind, z, V1_Z, V1_Y, m, r, 0.1)
        out.loss.backward()
        assert out.loss.item() == pytest.approx(want_l, abs=1e-6)
        gmax = z.grad.abs().max().item()
        if kind == "tbrm":
            assert out.delta.item() == pytest.approx(2.440190, abs=1e-6)
            assert gmax == pytest.approx(4.880379, abs=1e-6)
        else:
            assert gmax == 0.0


V2_Z = torch.tensor([[[1.5, 0.5, 0, -0.5], [0, 2, 0, 0], [9.0, -3, 1, 4]]], dtype=torch.float64)
V2_REF = torch.tensor([[[1.0, 1, 0, -1], [0, 1, 0.5, 0], [-2.0, 5, 0, 1]]], dtype=torch.float64)
V2_Y = torch.tensor([[0, 1, 2]])
V2_M = torch.tensor([[1.0, 1, 0]], dtype=torch.float64)


def test_v2_values_and_gradients():
    r = torch.ones(1)
    slp, v1 = stats64(V2_Z, V2_Y, V2_M)
    slp_ref, v1_ref = stats64(V2_REF, V2_Y, V2_M)
    assert v1.item() == pytest.approx(2.046006, abs=1e-6)
    assert v1_ref.item() == pytest.approx(1.917576, abs=1e-6)
    assert slp.item() == pytest.approx(-0.886759, abs=1e-6)
    assert slp_ref.item() == pytest.approx(-1.768705, abs=1e-6)
    want = {
        "reval": (-0.989624, 0.979356),
        "tbrm": (0.927952, 0.861094),
        "regression": (-1.118055, 1.250046),
    }
    for kind, (d, l) in want.items():
        z = V2_Z.clone().requires_grad_(True)
        out = loss_of(kind, z, V2_REF, V2_Y, V2_M, r, 0.5)
        assert out.delta.item() == pytest.approx(d, abs=1e-6)
        assert out.loss.item() == pytest.approx(l, abs=1e-6)
        out.loss.backward()
        if kind == "reval":
            assert z.grad[0, 0].tolist() == pytest.approx([-1.979248, 0, 0, 0], abs=1e-6)
            assert z.grad[0, 1].tolist() == pytest.approx(
                [0.190513, -0.571538, 0.190513, 0.190513], abs=1e-6
            )
            assert z.grad[0, 2].abs().max().item() == 0.0


# -- §6 properties ----------------------------------------------------------------------------


def random_case(seed, bsz=4, t=5, v=7):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(bsz, t, v, generator=g) * 2
    zref = z + 0.5 * torch.randn(bsz, t, v, generator=g)
    y = torch.randint(0, v, (bsz, t), generator=g)
    lens = torch.randint(1, t + 1, (bsz,), generator=g)
    m = (torch.arange(t)[None] < lens[:, None]).to(z.dtype)
    r = torch.randint(0, 2, (bsz,), generator=g).to(z.dtype)
    return z, zref, y, m, r


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_autograd_matches_closed_form_and_finite_differences(kind, seed):
    z, zref, y, m, r = random_case(seed)
    zz = z.clone().requires_grad_(True)
    out = loss_of(kind, zz, zref, y, m, r, 0.3)
    out.loss.backward()
    want = closed_form_grad(kind, z, y, m, out.delta)
    torch.testing.assert_close(zz.grad, want, atol=1e-10, rtol=1e-8)
    # central finite differences on a handful of coordinates
    eps = 1e-6
    g = torch.Generator().manual_seed(seed + 100)
    for _ in range(12):
        idx = tuple(int(torch.randint(0, s, (1,), generator=g)) for s in z.shape)
        zp, zm = z.clone(), z.clone()
        zp[idx] += eps
        zm[idx] -= eps
        fd = loss_of(kind, zp, zref, y, m, r, 0.3).loss - loss_of(kind, zm, zref, y, m, r, 0.3).loss
        assert (fd / (2 * eps)).item() == pytest.approx(zz.grad[idx].item(), abs=1e-6)


def test_calibrated_init_random_and_tbrm_not():
    z, _, y, m, _ = random_case(3)
    r = torch.zeros(z.shape[0])
    for kind in ("reval", "regression"):
        zz = z.clone().requires_grad_(True)
        out = loss_of(kind, zz, z, y, m, r, 0.1)
        out.loss.backward()
        assert out.loss.item() == 0.0
        assert zz.grad.abs().max().item() == 0.0
    zz = z.clone().requires_grad_(True)
    out = loss_of("tbrm", zz, z, y, m, r, 0.1)
    out.loss.backward()
    _, vref = stats64(z, y, m)
    torch.testing.assert_close(out.delta, vref)
    assert out.loss.item() == pytest.approx((vref**2).mean().item())
    assert zz.grad.abs().max().item() > 0


@pytest.mark.parametrize("kind", KINDS)
def test_positionwise_invariances(kind):
    z, zref, y, m, r = random_case(4)
    base = loss_of(kind, z, zref, y, m, r, 0.2)
    # adding c at a position t >= 1 leaves L unchanged
    z2 = z.clone()
    z2[:, 2, :] += 3.7
    assert loss_of(kind, z2, zref, y, m, r, 0.2).loss.item() == pytest.approx(base.loss.item())
    # adding c at position 0 shifts delta by c (ReVal/TBRM) or 0 (regression)
    z3 = z.clone()
    z3[:, 0, :] += 1.25
    shift = loss_of(kind, z3, zref, y, m, r, 0.2).delta - base.delta
    want = 0.0 if kind == "regression" else 1.25
    torch.testing.assert_close(shift, torch.full_like(shift, want))
    # logits and tokens at masked positions do not matter
    z4, y4 = z.clone(), y.clone()
    z4[m == 0] = torch.randn(int((m == 0).sum()), z.shape[-1]) * 10
    y4[m == 0] = 0
    assert loss_of(kind, z4, zref, y4, m, r, 0.2).loss.item() == pytest.approx(base.loss.item())


def test_first_token_identity():
    z, zref, y, m, r = random_case(5)
    m[:, 0] = 1
    out = loss_of("reval", z, zref, y, m, r, 0.4)
    q = z[:, 0].gather(-1, y[:, :1])[:, 0]
    qref = zref[:, 0].gather(-1, y[:, :1])[:, 0]
    lp = z.log_softmax(-1).gather(-1, y[..., None])[..., 0]
    lpr = zref.log_softmax(-1).gather(-1, y[..., None])[..., 0]
    rest = ((lp - lpr) * m)[:, 1:].sum(-1)
    torch.testing.assert_close(out.delta, (q - qref) + rest - r / 0.4)


def test_reset_gives_minus_r_over_beta():
    z, _, y, m, r = random_case(6)
    out = loss_of("reval", z, z, y, m, r, 0.25)
    torch.testing.assert_close(out.delta, -r / 0.25)


def test_shared_prompt_rows_have_identical_v1():
    z, _, y, m, _ = random_case(7)
    z[1, 0] = z[0, 0]
    _, v1 = stats64(z, y, m)
    assert v1[0].item() == v1[1].item()
    # and in fp32 through the production function
    st = sequence_stats(z.float(), y, m.float())
    assert st.v1[0].item() == st.v1[1].item()


def test_reward_offsets():
    z, zref, y, m, r = random_case(8)
    beta = 0.5
    d01 = loss_of("reval", z, zref, y, m, r, beta).delta
    pm = 2 * r - 1
    dpm = loss_of("reval", z, zref, y, m, pm, beta).delta
    torch.testing.assert_close(dpm - d01, -(pm - r) / beta)


def test_microbatch_split_gives_same_gradient():
    z, zref, y, m, r = random_case(9, bsz=6)
    full = z.clone().requires_grad_(True)
    loss_of("reval", full, zref, y, m, r, 0.3).loss.backward()
    acc = z.clone().requires_grad_(True)
    for sl in (slice(0, 1), slice(1, 4), slice(4, 6)):
        slp, v1 = stats64(acc[sl], y[sl], m[sl])
        slp_ref, v1_ref = stats64(zref[sl], y[sl], m[sl])
        value_loss("reval", slp, v1, slp_ref, v1_ref, r[sl], 0.3, denom=6).loss.backward()
    torch.testing.assert_close(acc.grad, full.grad, atol=1e-12, rtol=1e-10)


def test_eos_mask_keeps_first_eos_only():
    y = torch.tensor([[5, 1, 7, 1], [1, 3, 3, 3], [4, 4, 4, 4]])
    assert eos_mask(y, eos_id=1).tolist() == [[1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 1]]


def test_bellman_residual_rejects_bad_beta_and_kind():
    x = torch.zeros(2)
    with pytest.raises(ValueError, match="beta"):
        bellman_residual("reval", x, x, x, x, x, 0.0)
    with pytest.raises(ValueError, match="unknown"):
        bellman_residual("dqn", x, x, x, x, x, 1.0)  # type: ignore[arg-type]


# -- GRPO -------------------------------------------------------------------------------------


def test_grpo_advantages():
    a = grpo_advantages(torch.tensor([1.0, 0, 1, 1]), ["g"] * 4)
    assert a.tolist() == pytest.approx([0.5, -1.5, 0.5, 0.5], abs=1e-5)
    single = grpo_advantages(torch.tensor([1.0, 0.0]), ["a", "b"])
    assert single.tolist() == pytest.approx([1.0, 0.0], abs=1e-5)  # mean 0, std 1


def grpo_reference(logp, old, adv, m, cl, ch, c):
    """The textbook per-token clipped objective, written out element by element."""
    total, n = 0.0, 0.0
    for b in range(len(logp)):
        for t in range(len(logp[0])):
            if m[b][t] == 0:
                continue
            ratio = math.exp(max(-20.0, min(20.0, logp[b][t] - old[b][t])))
            a = adv[b]
            loss = max(-a * ratio, -a * min(max(ratio, 1 - cl), 1 + ch))
            if a < 0:
                loss = min(loss, -a * c)
            total += loss
            n += 1
    return total / n


def test_grpo_matches_elementwise_reference_and_tis_off():
    g = torch.Generator().manual_seed(11)
    logp = -torch.rand(4, 6, generator=g) * 3
    old = logp + 0.4 * torch.randn(4, 6, generator=g)
    adv = torch.tensor([0.5, -1.5, 0.5, 0.5])
    m = torch.ones(4, 6)
    m[1, 4:] = 0
    out = grpo_loss(logp, old, adv, m, rollout_logp=old - 0.3, tis_cap=0.0)
    want = grpo_reference(logp.tolist(), old.tolist(), adv.tolist(), m.tolist(), 0.2, 0.28, 3.0)
    assert out.loss.item() == pytest.approx(want, rel=1e-9)
    # TIS: a uniform weight exp(0.3) under the cap scales the loss by exactly that
    tis = grpo_loss(logp, old, adv, m, rollout_logp=old - 0.3, tis_cap=2.0)
    assert tis.loss.item() == pytest.approx(want * math.exp(0.3), rel=1e-9)
    capped = grpo_loss(logp, old, adv, m, rollout_logp=old - 5.0, tis_cap=2.0)
    assert capped.loss.item() == pytest.approx(want * 2.0, rel=1e-9)


def test_grpo_ratio_above_clip_with_positive_advantage_has_no_gradient():
    old = torch.log(torch.full((1, 3), 0.1))
    logp = (old + torch.tensor([[math.log(1.5), 0.0, math.log(0.5)]])).requires_grad_(True)
    grpo_loss(logp, old, torch.tensor([1.0]), torch.ones(1, 3), tis_cap=0.0).loss.backward()
    assert logp.grad[0, 0].item() == 0.0  # ratio 1.5 > 1.28, A > 0: clipped
    assert logp.grad[0, 1].item() < 0  # ratio 1: pushes log-prob up
    assert logp.grad[0, 2].item() < 0  # ratio 0.5 < 0.8 with A > 0: not clipped (max picks it)
