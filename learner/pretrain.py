"""A short next-token pretraining of the tiny model on task-shaped text.

It makes the random model a smooth language model of the answer *format* (prompt, a few answer
characters, EOS) without teaching it which answer is right, so RL starts from near chance. The
text comes from the caller (a task's ``pretrain_texts``, ``services/setup.py``), so this training
loop sits with the learner and knows no task.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable

import torch
from torch import nn

from reval.policy import Policy
from reval.threads import tick

log = logging.getLogger("reval.pretrain")

TextSource = Callable[[random.Random, int], list[str]]
"""``(rng, count) -> count texts``: a task's ``pretrain_texts``."""

REPORTS = 10
"""Progress lines of a pretraining: one at each tenth of its steps (and one at the start)."""


def pretrain(
    policy: Policy, texts: TextSource, steps: int, lr: float, batch_size: int, seed: int
) -> float:
    """Train ``steps`` AdamW steps of next-token loss on ``texts(rng, batch_size)`` each; returns
    the final loss. Deterministic in ``seed`` (and in what ``texts`` draws from the rng). Logs
    a line when it starts and at each tenth of its steps (the step, the loss, the time so far):
    the demo's takes a minute or more."""
    if steps <= 0:
        return float("nan")
    log.info("pretraining the tiny model on the task's answer format: %d steps of %d texts",
             steps, batch_size)  # fmt: skip
    t0 = time.monotonic()
    rng = random.Random(seed)
    tok = policy.tokenizer
    model: nn.Module = policy.model
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    loss_value = float("nan")
    for done in range(1, steps + 1):
        t_step = time.perf_counter()
        batch = texts(rng, batch_size)
        rows = [[*tok(t, add_special_tokens=False).input_ids, policy.eos_id] for t in batch]
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), policy.pad_id, dtype=torch.long)
        labels = torch.full((len(rows), width), -100, dtype=torch.long)
        attn = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):  # right-padded: positions start at 0 for every row
            ids[i, : len(r)] = torch.tensor(r)
            labels[i, : len(r)] = torch.tensor(r)
            attn[i, : len(r)] = 1
        ids, labels, attn = ids.to(policy.device), labels.to(policy.device), attn.to(policy.device)
        out = model(input_ids=ids, attention_mask=attn, labels=labels, use_cache=False)
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        opt.step()
        loss_value = float(out.loss.item())
        tick(time.perf_counter() - t_step, "pretraining step")  # (the thread tuner)
        if done * REPORTS // steps > (done - 1) * REPORTS // steps:  # (a tenth crossed)
            log.info("pretraining: step %d/%d (%d%%), loss %.3f, %.0f s", done, steps,
                     100 * done // steps, loss_value, time.monotonic() - t0)  # fmt: skip
    # The last step's gradients go: a model's worth of memory, and under LoRA (the base frozen
    # after this) they stayed on the base and counted in every update's grad norm.
    opt.zero_grad(set_to_none=True)
    return loss_value
