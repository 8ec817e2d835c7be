"""Set-up above the learner: what a run does before its first update, where the task is known.

The learner trains whatever policy it is given; the tiny model's pretraining on the task's
answer format and the one-shot task's calibration on the initial policy need the task (in
``rollout/``), so they happen here, one floor up. ``reval train`` does them in its own process;
``reval learner`` and ``reval launch`` do them before the ranks start: the pretrained model is
saved as a Hugging Face checkpoint (``run_dir/initial``) that rank 0 loads, and the calibration
is shared with the workers in Redis.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch
from prometheus_client import CollectorRegistry

from learner.pretrain import pretrain
from reval.config import RunConfig
from reval.policy import Policy, load_policy
from rollout.tasks import OneShotTask, Task, build_task, code_probabilities, task_setup

log = logging.getLogger("reval.setup")


def build_policy_and_task(
    cfg: RunConfig, registry: CollectorRegistry | None = None
) -> tuple[Policy, Task, dict[str, float]]:
    """Load the policy, build the task, pretrain (tiny model) and calibrate (one-shot task).
    The task's metrics (a math task's grading and skipped rows) go on ``registry``. A line says
    when the model and the task are ready (the commands say at once that they set up; a model
    or dataset they cannot use is then one line, with nothing before it), then the
    pretraining's progress."""
    t0 = time.monotonic()
    torch.manual_seed(cfg.seed)
    policy = load_policy(cfg.model, seed=cfg.seed)
    task = build_task(cfg.task, cfg.seed, policy.tokenizer, cfg.rollout, registry)
    log.info("set-up: %s and the %s task (%d prompts) ready in %.0f s",
             cfg.model.name_or_path or "the tiny model", cfg.task.kind, len(task.prompts),
             time.monotonic() - t0)  # fmt: skip
    info: dict[str, float] = {}
    if cfg.model.pretrain_steps and cfg.model.name_or_path is None:
        info["pretrain_loss"] = pretrain(
            policy,
            task.pretrain_texts,
            cfg.model.pretrain_steps,
            cfg.model.pretrain_lr,
            cfg.model.pretrain_batch_size,
            cfg.seed,
        )
        warm = getattr(task, "warm_start", None)  # (a dataset task's graded pairings)
        if warm is not None and warm.built:
            info["pretrain_prompts_unpaired"] = float(warm.unpaired)
    if isinstance(task, OneShotTask):
        info["oneshot_base_success"] = task.calibrate(policy)
    return policy, task, info


def exact_success(task: Task, policy: Policy) -> Callable[[], float] | None:
    """The one-shot task's success rate computed exactly: the policy's probability of
    answering one of the accepted codes (no sampling noise decides when it crosses 0.95)."""
    if not isinstance(task, OneShotTask):
        return None
    accepted = sorted(task.verifier.accepted)

    def exact() -> float:
        was = policy.model.training
        policy.model.eval()
        try:
            probs = code_probabilities(policy, task.prompts[0].text, accepted)
        finally:
            policy.model.train(was)
        return float(sum(probs.values()))

    return exact


def initial_dir(cfg: RunConfig) -> Path:
    return cfg.paths.initial


def prepare_learner(cfg: RunConfig, resume: bool) -> RunConfig:
    """Before the learner ranks start (once, in the process that starts them; under torchrun in
    rank 0's): pretrain the tiny model and save it as ``run_dir/initial``, calibrate the one-shot
    task and share it in Redis. Returns the config the ranks run with: the model loads from
    ``run_dir/initial`` (rank 0 broadcasts its weights to the others before sharding). A resumed
    run keeps what its first start prepared (its checkpoint holds the weights)."""
    if os.environ.get("RANK", "0") != "0":
        return cfg
    tiny = cfg.model.name_or_path is None
    needs_pretrain = tiny and cfg.model.pretrain_steps > 0
    needs_task = cfg.task.kind == "oneshot"
    path = initial_dir(cfg)
    ready = (path / "config.json").is_file()
    if resume and (ready or not needs_pretrain):
        resumed = _from_initial(cfg) if ready else cfg
        if needs_task:
            _share_task(resumed, None, resume=True)
        return resumed
    if not (needs_pretrain or needs_task):
        return cfg
    policy, task, info = build_policy_and_task(cfg)
    close = getattr(task.verifier, "close", None)
    if close is not None:  # (the pretraining's grading pool: the ranks and workers grade)
        close()
    if needs_pretrain:
        path.mkdir(parents=True, exist_ok=True)
        policy.model.save_pretrained(path)  # type: ignore[operator]
        policy.tokenizer.save_pretrained(path)
        log.info("pretrained the tiny model (loss %.3f): %s", info["pretrain_loss"], path)
    if needs_task:
        _share_task(cfg, task, resume=False)
        log.info("one-shot task calibrated: base success %.3f, shared with the workers",
                 info["oneshot_base_success"])  # fmt: skip
    return _from_initial(cfg) if needs_pretrain else cfg


def _from_initial(cfg: RunConfig) -> RunConfig:
    model = cfg.model.model_copy(
        update={"name_or_path": str(initial_dir(cfg)), "pretrain_steps": 0}
    )
    return cfg.model_copy(update={"model": model})


def _share_task(cfg: RunConfig, task: Task | None, resume: bool) -> None:
    """The calibrated task's setup in Redis for the workers (a resumed run keeps the one the
    workers already use; one that has none calibrates now)."""

    from reval.redis import connect, task_key

    client = connect(cfg.redis.url)
    try:
        key = task_key(cfg.redis.prefix, cfg.name)
        if resume and client.exists(key):
            return
        if task is None:
            _policy, task, _info = build_policy_and_task(cfg)
        client.set(key, json.dumps(task_setup(task)))
    finally:
        client.close()
