"""Pure loss functions over tensors (docs/algorithm.md §2).

Shapes: ``B`` trajectories, ``T`` response positions. Every function returns a ``LossOutput``:
the scalar loss to backpropagate, the per-trajectory residual (for priorities and logging) and
float metrics. ``denom`` lets a micro-batch contribute its share of a larger mini-batch: with
``denom`` = the mini-batch's B (or its token count for GRPO), summing the micro-batch losses gives
exactly the mini-batch loss, so accumulated gradients equal the full-batch gradient.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor

ValueLoss = Literal["reval", "tbrm", "regression"]

# GRPO constants (verl v0.5.0 core_algos.compute_policy_loss).
LOG_RATIO_CLAMP = 20.0  # exp() of a log-ratio beyond +-20 overflows in fp16/bf16; verl clamps here
GRPO_STD_EPS = 1e-6  # verl's epsilon in (r - mean) / (std + eps)


@dataclass
class LossOutput:
    loss: Tensor
    """Scalar to backpropagate (this micro-batch's share of the mini-batch loss)."""
    delta: Tensor
    """[B] detached per-trajectory residual (value losses) or mean advantage (GRPO)."""
    metrics: dict[str, float] = field(default_factory=dict)


def bellman_residual(
    kind: ValueLoss,
    slp: Tensor,
    v1: Tensor,
    slp_ref: Tensor,
    v1_ref: Tensor,
    reward: Tensor,
    beta: float,
) -> Tensor:
    """The trajectory-level soft Bellman residual Δ, shape [B].

    Args:
        slp: [B] ``sum_t m_t log pi_theta(y_t | ...)`` (fp32, with grad); ``m`` is 1 on the
            model's own tokens only (a multi-turn episode's environment tokens are context, not
            actions: the soft-Bellman chain telescopes over the actions, docs/tasks.md).
        v1: [B] ``V_theta(s1) = logsumexp`` of the logits that predict the first response token.
        slp_ref, v1_ref: [B] the same under the frozen reference (no grad).
        reward: [B] transformed reward.
        beta: KL strength.

    ReVal: ``Δ = (V1 - V1_ref) + (slp - slp_ref) - r/β``; TBRM: ``Δ = V1 + (slp - slp_ref) - r/β``;
    regression (App. E): ``Δ = (slp - slp_ref) - r/β`` (pass the group-normalized reward).
    """
    if beta <= 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    log_ratio = slp - slp_ref
    target = reward.to(slp.dtype) / beta
    if kind == "reval":
        return (v1 - v1_ref) + log_ratio - target
    if kind == "tbrm":
        return v1 + log_ratio - target
    if kind == "regression":
        return log_ratio - target
    raise ValueError(f"unknown value loss {kind!r}")


def value_loss(
    kind: ValueLoss,
    slp: Tensor,
    v1: Tensor,
    slp_ref: Tensor,
    v1_ref: Tensor,
    reward: Tensor,
    beta: float,
    denom: float | None = None,
    weights: Tensor | None = None,
) -> LossOutput:
    """``L = mean_b Δ_b²`` (per trajectory: no token mean, no length normalization, no clipping
    of Δ, no detach of V1). ``denom`` defaults to B. ``weights`` (prioritized replay's importance
    weights) scale each trajectory's term: ``sum_b w_b Δ_b² / denom``."""
    delta = bellman_residual(kind, slp, v1, slp_ref, v1_ref, reward, beta)
    n = float(delta.shape[0]) if denom is None else float(denom)
    sq = delta.pow(2)
    if weights is not None:
        sq = sq * weights.to(sq.dtype)
    loss = sq.sum() / n
    d = delta.detach()
    metrics = {
        "delta_abs_mean": d.abs().mean().item(),
        "delta_mean": d.mean().item(),
        "log_ratio_mean": (slp - slp_ref).detach().mean().item(),
        "v1_minus_ref_mean": (v1 - v1_ref).detach().mean().item(),
        "v1_mean": v1.detach().mean().item(),
        "v1_ref_mean": v1_ref.detach().mean().item(),
    }
    return LossOutput(loss=loss, delta=d, metrics=metrics)


def grpo_advantages(rewards: Tensor, groups: Sequence[Hashable]) -> Tensor:
    """GRPO outcome advantage ``(r - mean_G) / (std_G + 1e-6)`` with the unbiased std; a singleton
    group gets mean 0 and std 1 (verl v0.5.0 ``compute_grpo_outcome_advantage``). Shape [B]."""
    if rewards.shape[0] != len(groups):
        raise ValueError(f"{rewards.shape[0]} rewards but {len(groups)} group ids")
    index: dict[Hashable, list[int]] = {}
    for i, g in enumerate(groups):
        index.setdefault(g, []).append(i)
    r = rewards.float()
    out = torch.empty_like(r)
    for rows in index.values():
        sel = torch.tensor(rows, dtype=torch.long)
        vals = r[sel]
        if len(rows) == 1:
            mean, std = torch.tensor(0.0), torch.tensor(1.0)
        else:
            mean, std = vals.mean(), vals.std()
        out[sel] = (vals - mean) / (std + GRPO_STD_EPS)
    return out


def grpo_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    clip_ratio_c: float = 3.0,
    rollout_logp: Tensor | None = None,
    tis_cap: float = 2.0,
    denom: float | None = None,
) -> LossOutput:
    """GRPO policy loss, verl v0.5.0 ``compute_policy_loss`` with token-mean aggregation, plus the
    truncated importance-sampling correction (verl commit b8dc5377c).

    Args:
        logp: [B, T] current log-probs (with grad).
        old_logp: [B, T] log-probs of the policy that the ratio is taken against (no grad).
        advantages: [B] per-trajectory advantage, broadcast over tokens.
        mask: [B, T] response mask: 1 on the model's tokens (0 on padding, after EOS and on
            a multi-turn episode's environment tokens).
        rollout_logp: [B, T] the generator's log-probs; with ``tis_cap > 0`` every token's loss is
            multiplied by ``min(exp(old_logp - rollout_logp), tis_cap)`` (a constant).
        denom: token count of the mini-batch (default: this batch's ``mask.sum()``).
    """
    m = mask.to(logp.dtype)
    adv = advantages.to(logp.dtype)[:, None]
    neg_kl = torch.clamp(logp - old_logp.detach(), -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(neg_kl)
    pg1 = -adv * ratio
    pg2 = -adv * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    clipped = torch.maximum(pg1, pg2)
    dual = torch.minimum(-adv * clip_ratio_c, clipped)
    pg = torch.where(adv < 0, dual, clipped)
    if tis_cap > 0 and rollout_logp is not None:
        weight = torch.exp(old_logp.detach() - rollout_logp.detach()).clamp(max=tis_cap)
        pg = pg * weight
    n = float(m.sum().item()) if denom is None else float(denom)
    loss = (pg * m).sum() / max(n, 1.0)
    with torch.no_grad():
        ntok = m.sum().clamp(min=1.0)
        metrics = {
            "clipfrac": ((pg2 > pg1).to(m.dtype) * m).sum().item() / ntok.item(),
            "ppo_kl": ((-neg_kl) * m).sum().item() / ntok.item(),
            "ratio_mean": (ratio * m).sum().item() / ntok.item(),
        }
    return LossOutput(loss=loss, delta=advantages.detach().float(), metrics=metrics)
