"""reval's GRPO loss and gradient equal TRL's ``GRPOTrainer._compute_loss`` on one fixed batch
(docs/peers.md, "Matched settings"): token-mean aggregation (TRL ``loss_type="dapo"``, and
``"bnpo"``, which is the same on one process without accumulation), clip 0.2 / 0.28, beta 0 (no
KL), temperature 1 (TRL scales its log-probs by the sampling temperature; reval's loss is on the
temperature-1 policy). Both sides get the same advantages: TRL computes them inside its
generation step (``(r - mean) / (std + 1e-4)`` against reval's ``+ 1e-6``, docs/peers.md).

Runs in the peers venv (``make test-peers``); tests/conftest.py collects it only where trl is.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from buffer.records import Trajectory
from learner.losses import grpo_advantages, grpo_loss
from learner.sequence import collate, policy_stats
from learner.trainer import Learner
from reval.config import load_config
from reval.policy import Policy, load_policy

pytestmark = pytest.mark.peers

GROUP = 4
"""Answers per prompt in the fixed batch."""


def _trl_trainer(policy: Policy, loss_type: str, tmp_path):  # type: ignore[no-untyped-def]
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(
        output_dir=str(tmp_path / "trl"),
        per_device_train_batch_size=GROUP,
        num_generations=GROUP,
        max_completion_length=6,
        temperature=1.0,
        beta=0.0,
        loss_type=loss_type,
        epsilon=0.2,
        epsilon_high=0.28,
        num_iterations=1,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        gradient_checkpointing=False,
        bf16=False,  # GRPOConfig defaults to bf16 autocast, on the CPU too; reval runs fp32 there
    )
    data = Dataset.from_list([{"prompt": "1+2="}] * GROUP)
    trainer = GRPOTrainer(
        model=policy.model,
        reward_funcs=lambda completions, **kw: [0.0] * len(completions),
        args=args,
        train_dataset=data,
        processing_class=policy.tokenizer,
    )
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer.train's loop otherwise
    return trainer


def _fixed_batch(policy: Policy) -> list[Trajectory]:
    """Two groups of four answers to four-character prompts (TRL passes no position ids, so
    left-padded prompts would be placed differently: equal prompt lengths keep the two forwards
    identical), responses of 2..6 tokens, some ending in EOS, mixed rewards."""
    tok = policy.tokenizer
    rng = np.random.default_rng(0)
    out = []
    for g, prompt in enumerate(("3+4=", "9+8=")):
        p_ids = np.array(tok(prompt, add_special_tokens=False).input_ids)
        for k in range(GROUP):
            n = 2 + (g * GROUP + k) % 5
            r_ids = rng.integers(3, len(tok), n)
            if k % 2 == 0:
                r_ids[-1] = policy.eos_id
            reward = float((g + k) % 3 == 0)
            out.append(
                Trajectory(
                    prompt_ids=p_ids,
                    response_ids=r_ids,
                    logprobs=np.zeros(n, dtype=np.float32),
                    reward_raw=reward,
                    reward=reward,
                    group_id=f"g{g}",
                    finish_reason="stop" if k % 2 == 0 else "length",
                )
            )
    return out


def _trl_inputs(trajs: list[Trajectory], policy: Policy) -> dict[str, torch.Tensor]:
    batch = collate(trajs, policy.pad_id, policy.eos_id)
    plen = batch.input_ids.shape[1] - batch.response_len
    adv = grpo_advantages(torch.tensor([t.reward_raw for t in trajs]), [t.group_id for t in trajs])
    return {
        "prompt_ids": batch.input_ids[:, :plen],
        "prompt_mask": batch.attention_mask[:, :plen],
        "completion_ids": batch.responses,
        "completion_mask": batch.mask.long(),
        "advantages": adv,
        "num_items_in_batch": batch.mask.sum(),
    }


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        err = float((a[name] - b[name]).abs().max())
        scale = float(b[name].abs().max())
        assert scale > 0, f"{name}: no gradient"
        assert err <= 1e-5 * scale, f"{name}: max abs diff {err:.3g} against max abs {scale:.3g}"


@pytest.fixture
def policy() -> Policy:
    cfg = load_config(None, ["model.pretrain_steps=0"])
    torch.manual_seed(0)
    return load_policy(cfg.model, seed=0)


@pytest.mark.parametrize("loss_type", ["dapo", "bnpo"])
def test_learner_grpo_update_equals_trl(policy: Policy, loss_type: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The learner's own GRPO update (advantages, micro-batches of 3, token-mean denominator over
    the whole mini-batch) against TRL on one process with num_iterations=1 (ratio 1)."""
    trajs = _fixed_batch(policy)
    trainer = _trl_trainer(policy, loss_type, tmp_path)
    model = trainer.model
    model.train()
    model.zero_grad(set_to_none=True)
    trl_loss = trainer._compute_loss(model, _trl_inputs(trajs, policy))
    trl_loss.backward()
    trl_grads = _grads(model)

    cfg = load_config(None, [
        "algo.name=grpo", "algo.tis_cap=0", "learner.updates_per_round=1",
        "learner.micro_batch_size=3",
        "learner.lr=1e-30", "learner.grad_clip=1e30",
    ])  # fmt: skip
    learner = Learner(model, cfg.learner, cfg.algo, policy.pad_id, policy.eos_id, policy.device)
    result = learner.update(trajs)
    assert result.metrics["loss"] == pytest.approx(trl_loss.item(), rel=1e-5, abs=1e-7)
    assert trl_loss.item() != 0.0
    _assert_same(_grads(model), trl_grads)


def test_clipped_grpo_loss_equals_trl(policy: Policy, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Ratios away from 1 (TRL's num_iterations > 1 case: old log-probs passed in), so both clip
    bounds bind on some tokens; verl's dual clip (3.0) does not bind at these ratios (TRL has no
    dual clip: its ``delta`` is another rule, off by default)."""
    trajs = _fixed_batch(policy)
    trainer = _trl_trainer(policy, "dapo", tmp_path)
    model = trainer.model
    model.train()
    inputs = _trl_inputs(trajs, policy)
    batch = collate(trajs, policy.pad_id, policy.eos_id)
    with torch.no_grad():
        logp = policy_stats(model, batch).logp
    gen = torch.Generator().manual_seed(1)
    noise = (0.6 * torch.randn(logp.shape, generator=gen)).clamp(-1.0, 1.0)  # ratio < e < 3
    old = (logp + noise) * batch.mask
    ratio = torch.exp(logp - old)[batch.mask.bool()]
    assert bool((ratio < 0.8).any()) and bool((ratio > 1.28).any()) and float(ratio.max()) < 3.0

    model.zero_grad(set_to_none=True)
    trl_loss = trainer._compute_loss(model, {**inputs, "old_per_token_logps": old})
    trl_loss.backward()
    trl_grads = _grads(model)

    model.zero_grad(set_to_none=True)
    stats = policy_stats(model, batch)
    out = grpo_loss(stats.logp, old, inputs["advantages"], batch.mask, clip_low=0.2,
                    clip_high=0.28, clip_ratio_c=3.0, rollout_logp=None)  # fmt: skip
    out.loss.backward()
    assert float(out.loss) == pytest.approx(trl_loss.item(), rel=1e-5, abs=1e-7)
    assert out.metrics["clipfrac"] > 0
    _assert_same(_grads(model), trl_grads)
