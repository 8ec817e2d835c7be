"""``reval train``: the whole ReVal loop in one process.

Embedded replay buffer, HF generation sharing the learner's model (so the policy version is the
learner's step), no Redis, no Ray. Per round: N answers per prompt go into the FIFO buffer, then K
updates follow, each on B trajectories (the first optionally the fresh batch), and the reference
is reset every ``ref_reset_steps`` rounds.
"""

from __future__ import annotations

import json
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from buffer import BufferMetrics, SampleTimeout, make_buffer
from buffer.records import Trajectory
from learner.trainer import Learner
from reval.config import RunConfig, dump_config
from reval.metrics import JsonlWriter, TrainMetrics
from reval.policy import Policy, load_policy
from rollout.collect import collect_round, evaluate
from rollout.engines import HFEngine, SamplingParams
from rollout.pretrain import pretrain
from rollout.tasks import OneShotTask, Prompt, Task, build_task

log = logging.getLogger("reval.train")


@dataclass
class TrainResult:
    run_dir: Path
    history: list[dict[str, Any]]
    initial_success: float
    final_success: float
    checkpoint: Path


class PromptSampler:
    """Deals prompts without replacement within an epoch, reshuffled each epoch (seeded)."""

    def __init__(self, prompts: list[Prompt], seed: int) -> None:
        self.prompts = prompts
        self.rng = random.Random(seed)
        self.order: list[int] = []
        self.epoch = 0

    def take(self, count: int) -> list[Prompt]:
        out: list[Prompt] = []
        while len(out) < count:
            if not self.order:
                self.order = list(range(len(self.prompts)))
                self.rng.shuffle(self.order)
                self.epoch += 1
            out.append(self.prompts[self.order.pop()])
        return out


def _eval_prompts(task: Task, cfg: RunConfig) -> list[Prompt]:
    prompts = list(task.prompts)
    if len(prompts) > cfg.eval.max_prompts:
        prompts = random.Random(cfg.seed + 7).sample(prompts, cfg.eval.max_prompts)
    return prompts


def build_policy_and_task(cfg: RunConfig) -> tuple[Policy, Task, dict[str, float]]:
    """Load the policy, build the task, pretrain (tiny model) and calibrate (one-shot task)."""
    torch.manual_seed(cfg.seed)
    policy = load_policy(cfg.model, seed=cfg.seed)
    task = build_task(cfg.task, seed=cfg.seed, tokenizer=policy.tokenizer)
    info: dict[str, float] = {}
    if cfg.model.pretrain_steps and cfg.model.name_or_path is None:
        info["pretrain_loss"] = pretrain(
            policy,
            task,
            cfg.model.pretrain_steps,
            cfg.model.pretrain_lr,
            cfg.model.pretrain_batch_size,
            cfg.seed,
        )
    if isinstance(task, OneShotTask):
        info["oneshot_base_success"] = task.calibrate(policy)
    return policy, task, info


def _exact_success(task: Any, policy: Any) -> Callable[[], float] | None:
    """The one-shot task's success rate computed exactly: the policy's probability of
    answering one of the accepted codes (no sampling noise decides when it crosses 0.95)."""
    from rollout.tasks import OneShotTask, code_probabilities

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


def train(cfg: RunConfig, progress: Callable[[dict[str, Any]], None] | None = None) -> TrainResult:
    """Run the configured training; ``progress`` is called with each round's record."""
    run_dir = cfg.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    for stale in ("metrics.jsonl", "curve.png"):
        (run_dir / stale).unlink(missing_ok=True)
    dump_config(cfg, run_dir / "config.json")

    policy, task, info = build_policy_and_task(cfg)
    engine = HFEngine(policy.model, policy.pad_id, policy.eos_id, policy.device)
    learner = Learner(
        policy.model, cfg.learner, cfg.algo, policy.pad_id, policy.eos_id, policy.device
    )
    metrics = TrainMetrics()
    # A fresh run: a Redis run of the same name starts empty.
    buffer = make_buffer(cfg.buffer, cfg.name, cfg.seed, BufferMetrics(metrics.registry), True)
    if cfg.metrics.prometheus_port is not None:
        port = metrics.serve(cfg.metrics.prometheus_port, cfg.metrics.addr)
        log.info("Prometheus metrics on http://127.0.0.1:%d/metrics", port)
    writer = JsonlWriter(run_dir / "metrics.jsonl") if cfg.metrics.jsonl else None
    sampler = PromptSampler(list(task.prompts), cfg.seed)
    eval_prompts = _eval_prompts(task, cfg)
    params = SamplingParams(
        n=cfg.rollout.n,
        temperature=cfg.rollout.temperature,
        top_p=cfg.rollout.top_p,
        max_new_tokens=cfg.rollout.max_new_tokens,
    )

    def run_eval(round_idx: int) -> float:
        return evaluate(
            engine,
            policy.tokenizer,
            task,
            eval_prompts,
            cfg.eval.samples_per_prompt,
            cfg.eval.temperature,
            cfg.rollout.max_new_tokens,
            seed=cfg.seed * 1000003 + round_idx,
        )

    exact = _exact_success(task, policy)
    history: list[dict[str, Any]] = []
    initial = run_eval(0)
    metrics.success.set(initial)
    record0 = {"round": 0, "eval_success": initial, "policy_version": 0, **info}
    if exact is not None:
        record0["success_exact"] = exact()
    history.append(record0)
    if writer:
        writer.write(record0)
    if progress:
        progress(record0)
    success = initial
    bsz = cfg.batch_size
    t_start = time.perf_counter()
    for rnd in range(1, cfg.learner.rounds + 1):
        t0 = time.perf_counter()
        engine.policy_version = learner.step
        result = collect_round(
            engine,
            policy.tokenizer,
            task,
            sampler.take(cfg.rollout.prompts_per_round),
            params,
            seed=cfg.seed * 7919 + rnd,
            reward_variant=cfg.algo.reward,
            group_prefix=f"r{rnd}",
            run_id=cfg.name,
            worker_id="embedded",
        )
        t_gen = time.perf_counter() - t0
        buffer.set_policy_version(learner.step)
        evicted = buffer.insert(result.trajectories)
        upd: dict[str, float] = {}
        staleness: list[int] = []
        done = 0
        for k in range(cfg.learner.updates_per_round):
            batch: list[Trajectory]
            weights = None
            if k == 0 and cfg.learner.first_update_fresh:
                batch = result.trajectories[:bsz]
                for t in batch:
                    t.use_count += 1
            else:
                buffer.set_policy_version(learner.step)
                try:
                    # Nothing else inserts in a one-process run: waiting would not help.
                    sampled = buffer.sample(bsz, timeout=0.0)
                except SampleTimeout as err:
                    log.info("round %d: update %d skipped: %s", rnd, k, err)
                    break
                batch = sampled.trajectories
                if cfg.buffer.prioritized:
                    weights = sampled.weights.tolist()
            staleness.extend(learner.step - t.policy_version for t in batch)
            out = learner.update(batch, weights)
            buffer.write_back(batch)
            if cfg.buffer.prioritized:
                buffer.update_priorities([t.traj_id for t in batch], out.delta.abs().tolist())
            done += 1
            for key, value in out.metrics.items():
                upd[key] = upd.get(key, 0.0) + value
            metrics.updates.inc(0 if out.skipped else 1)
            metrics.skipped.inc(1 if out.skipped else 0)
        upd = {key: value / max(done, 1) for key, value in upd.items()}
        if cfg.learner.ref_reset_steps and rnd % cfg.learner.ref_reset_steps == 0:
            learner.reset_reference()
        held = buffer.items()
        record: dict[str, Any] = {
            "round": rnd,
            "policy_version": learner.step,
            "reward_mean": result.reward_mean,
            "tokens": result.tokens,
            "buffer_size": len(buffer),
            "evicted": evicted,
            "updates": done,
            "use_count_mean": sum(t.use_count for t in held) / max(len(held), 1),
            "staleness_mean": sum(staleness) / max(len(staleness), 1),
            "ref_version": learner.reference.version,
            "gen_s": t_gen,
            "round_s": time.perf_counter() - t0,
            "elapsed_s": time.perf_counter() - t_start,
            **upd,
        }
        if exact is not None:
            record["success_exact"] = exact()
        if (cfg.eval.every and rnd % cfg.eval.every == 0) or rnd == cfg.learner.rounds:
            success = run_eval(rnd)
            record["eval_success"] = success
            metrics.success.set(success)
        metrics.round.set(rnd)
        metrics.version.set(learner.step)
        metrics.reward.set(result.reward_mean)
        metrics.loss.set(upd.get("loss", 0.0))
        metrics.grad_norm.set(upd.get("grad_norm", 0.0))
        metrics.trajectories.inc(len(result.trajectories))
        metrics.tokens.inc(result.tokens)
        history.append(record)
        if writer:
            writer.write(record)
        if progress:
            progress(record)
        if cfg.learner.checkpoint_every and rnd % cfg.learner.checkpoint_every == 0:
            save_checkpoint(run_dir / f"checkpoint-{rnd}", policy, learner, rnd)
        stop_at = cfg.learner.stop_at_success
        if stop_at is not None and record.get("success_exact", 0.0) >= stop_at:
            log.info("round %d: exact success %.3f >= %.2f: done", rnd,
                     record["success_exact"], stop_at)  # fmt: skip
            success = record["eval_success"] if "eval_success" in record else run_eval(rnd)
            break
    if writer:
        writer.close()
    ckpt = save_checkpoint(run_dir / "final", policy, learner, cfg.learner.rounds)
    if cfg.metrics.plot:
        from services.plot import plot_curve

        plot_curve(history, run_dir / "curve.png", title=f"{cfg.name}: {cfg.algo.name}")
    summary = {
        "initial_success": initial,
        "final_success": success,
        "rounds": history[-1]["round"],
        "success_exact": history[-1].get("success_exact"),
        "policy_version": learner.step,
        "skipped_steps": learner.skipped_steps,
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return TrainResult(run_dir, history, initial, success, ckpt)


def save_checkpoint(path: Path, policy: Policy, learner: Learner, rnd: int) -> Path:
    """A Hugging Face checkpoint (loads with ``from_pretrained``) plus the trainer state."""
    path.mkdir(parents=True, exist_ok=True)
    policy.model.save_pretrained(path)  # type: ignore[operator]
    policy.tokenizer.save_pretrained(path)
    torch.save(
        {
            "round": rnd,
            "step": learner.step,
            "ref_version": learner.reference.version,
            "optimizer": learner.optimizer.state_dict(),
            "reference": learner.reference.model.state_dict(),
        },
        path / "trainer_state.pt",
    )
    return path
