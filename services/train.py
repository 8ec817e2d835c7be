"""``reval train``: the whole ReVal loop in one process.

The embedded replay buffer + in-process HF generation sharing the learner's model (so the policy
version is the learner's step) + the learner's one update step (``learner/step.py``, the same as
``reval learner``'s), with no Redis and no Ray. Per round: N answers per prompt go into the FIFO
buffer, then the batch source (``learner/batches.py``) hands out the round's updates: K of B
trajectories for the value losses (the first on the fresh batch), the round's whole groups once
each for GRPO. Checkpoints are the learner's (DCP, ``learner/checkpoint.py``); the result is a
Hugging Face export in ``run_dir/final``.

A stop (Ctrl-C, SIGTERM: ``StopSignals``) ends the round in hand, writes a checkpoint and ends
the run without its export; ``train(..., resume=True)`` continues from the latest checkpoint:
the policy, the reference, AdamW, the counters (step, updates, reference version, the batch
schedule), the prompt deal and the round number carry on, ``metrics.jsonl`` is appended to. The
embedded buffer lived in the stopped process's memory: it starts empty (the Redis one is kept).
"""

from __future__ import annotations

import json
import logging
import random
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from buffer import BufferMetrics, SampleTimeout, make_buffer
from learner.batches import BatchSource
from learner.checkpoint import Checkpointer
from learner.export import export_hf
from learner.memory import apply_plan
from learner.step import UpdateMetrics, UpdateStep
from learner.trainer import Learner
from reval import lora
from reval.config import RunConfig, TaskConfig, dump_config
from reval.metrics import JsonlWriter, TrainMetrics, read_jsonl
from reval.policy import Policy, compute_dtype
from reval.trackers import ANSWER_COLUMNS, CURVE, EVAL_TABLE, Table, Trackers, build_trackers
from rollout.collect import Truncation, collect_round, evaluate
from rollout.dealer import PromptDealer
from rollout.engines import HFEngine, SamplingParams
from rollout.environment import EpisodeRunner
from rollout.math_task import read_rows
from rollout.tasks import Prompt, Task, apply_task_setup, task_setup
from services.setup import build_policy_and_task, exact_success
from services.stop import StopSignals

log = logging.getLogger("reval.train")

LEAK_SUSPECT = 0.5
"""Success before RL above this, on a tiny model pretrained by reval, is warned about."""


@dataclass
class TrainResult:
    run_dir: Path
    history: list[dict[str, Any]]
    initial_success: float
    final_success: float
    checkpoint: Path
    """The Hugging Face export (``final/``); of a stopped run, its last learner checkpoint."""
    stopped_by: int | None = None
    """The signal that stopped the run before its last round (None: it finished)."""
    round: int = 0
    """The last round run."""
    step: int = 0
    """The learner's optimizer step at the end."""


def _eval_prompts(task: Task, cfg: RunConfig, tokenizer: Any) -> list[Prompt]:
    """The prompts of the periodic evaluation: ``eval.dataset``'s held-out rows (read and
    templated like the training prompts), else the task's own; at most ``eval.max_prompts``."""
    prompts = list(task.prompts)
    if cfg.eval.dataset is not None:
        if cfg.task.kind not in ("math", "custom"):
            raise ValueError("eval.dataset needs task.kind=math or custom (a dataset task)")
        held = cfg.task.model_copy(update={"dataset": cfg.eval.dataset})
        prompts = held_out_prompts(held, tokenizer)
    if len(prompts) > cfg.eval.max_prompts:
        prompts = random.Random(cfg.seed + 7).sample(prompts, cfg.eval.max_prompts)
    return prompts


def held_out_prompts(cfg: TaskConfig, tokenizer: Any) -> list[Prompt]:
    """The prompts of the dataset task ``cfg`` (its ``dataset`` is ``eval.dataset``), read by
    the task's own reader, graded by the training task's verifier."""
    if cfg.kind == "custom":
        from rollout.custom_task import read_prompts

        rows = read_rows(str(cfg.dataset), cfg.split, "eval.dataset")
        return read_prompts(rows, cfg.prompt_field, tokenizer, cfg.max_prompt_tokens,
                            f"eval.dataset {cfg.dataset!r}")[0]  # fmt: skip
    from rollout.math_task import MathTask

    return MathTask.from_config(cfg, tokenizer, field="eval.dataset").prompts


@dataclass
class Prepared:
    """What a run is built from before its first round: the policy, the task (pretrained and
    calibrated), the evaluation's prompts and the metrics they report on."""

    metrics: TrainMetrics
    policy: Policy
    task: Task
    info: dict[str, float]
    eval_prompts: list[Prompt]


def prepare(cfg: RunConfig, resume: bool = False) -> Prepared:
    """Build the run (load the model, build the task and its evaluation prompts): what is wrong
    with the config's model, dataset or task raises here (OSError, FileNotFoundError,
    ValueError), before anything is written to the run directory. ``resume``: no pretraining of
    the tiny model (the checkpoint holds the weights; a one-shot task's calibration too)."""
    metrics = TrainMetrics()
    if resume and cfg.model.pretrain_steps:
        cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"pretrain_steps": 0})})
    policy, task, info = build_policy_and_task(cfg, metrics.registry)
    log.info(apply_plan(cfg, policy.model, policy.device).describe())
    eval_prompts = _eval_prompts(task, cfg, policy.tokenizer)
    return Prepared(metrics, policy, task, info, eval_prompts)


def train(
    cfg: RunConfig,
    progress: Callable[[dict[str, Any]], None] | None = None,
    prepared: Prepared | None = None,
    resume: bool = False,
    signals: StopSignals | None = None,
) -> TrainResult:
    """Run the configured training; ``progress`` is called with each round's record.
    ``prepared``: the run built by ``prepare`` (default: built here). ``resume``: continue from
    the latest checkpoint (FileNotFoundError when there is none). ``signals``: a stop they
    caught ends the run after the round in hand, with a checkpoint (``TrainResult.stopped_by``).
    """
    run = EmbeddedRun.build(cfg, prepared or prepare(cfg, resume), progress, resume)
    try:
        initial = run.resume() if resume else run.start()
        success = run.last_success(initial)
        if signals is not None:
            signals.rounds = True
        for rnd in range(run.last_round + 1, cfg.learner.rounds + 1):
            if rnd == 1:
                log.info("round 1 of %d: %d prompts x %d answers, then %d update(s)",
                         cfg.learner.rounds, cfg.rollout.prompts_per_round, cfg.rollout.n,
                         run.updates_per_round)  # fmt: skip
            record = run.round(rnd)
            if signals is not None and signals.signum is not None:
                return run.stop(initial, signals.signum)
            if "eval_success" in record:
                success = record["eval_success"]
            stop_at = cfg.learner.stop_at_success
            if stop_at is not None and record.get("success_exact", 0.0) >= stop_at:
                log.info("round %d: exact success %.3f >= %.2f: done", rnd,
                         record["success_exact"], stop_at)  # fmt: skip
                success = record["eval_success"] if "eval_success" in record else run.evaluate(rnd)
                break
        return run.finish(initial, success)
    except BaseException:  # (the trackers' and the metrics file's last rows kept; runs closed)
        run.close()
        raise


@dataclass
class EmbeddedRun:
    """The parts of a one-process run (``build``), run round by round: ``start`` evaluates the
    initial policy, ``round`` generates, inserts and updates, ``finish`` checkpoints, exports
    and summarises."""

    cfg: RunConfig
    prepared: Prepared
    progress: Callable[[dict[str, Any]], None] | None
    engine: HFEngine
    learner: Learner
    buffer: Any
    buffer_metrics: BufferMetrics
    source: BatchSource
    step: UpdateStep
    checkpointer: Checkpointer
    writer: JsonlWriter | None
    dealer: PromptDealer
    episodes: EpisodeRunner | None
    params: SamplingParams
    history: list[dict[str, Any]] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    """What the run warned about (``summary.json``)."""
    t_start: float = field(default_factory=time.perf_counter)
    last_round: int = 0
    """The last round run (by this process or, resumed, by the stopped one)."""
    last_checkpoint: float = field(default_factory=time.monotonic)
    """When the last checkpoint was written (``learner.checkpoint_every_s``)."""
    saved_round: int | None = None
    """The round of the last checkpoint written or loaded."""
    trackers: Trackers = field(default_factory=lambda: Trackers([]))
    """``metrics.trackers``: every row of ``metrics.jsonl`` at its policy version."""
    closed: bool = False

    @classmethod
    def build(
        cls,
        cfg: RunConfig,
        prepared: Prepared,
        progress: Callable[[dict[str, Any]], None] | None = None,
        resume: bool = False,
    ) -> EmbeddedRun:
        """The run's directory, learner, buffer, batch source, update step, checkpointer, prompt
        deal and sampling. A fresh start starts the directory afresh (what an earlier run of the
        same config left there goes: its checkpoints, metrics, curve and summary) and a Redis
        buffer of the same name empty; ``resume`` keeps them (``resume`` loads the checkpoint)."""
        metrics, policy, task = prepared.metrics, prepared.policy, prepared.task
        cfg.run_dir.mkdir(parents=True, exist_ok=True)
        if not resume:
            for stale in (cfg.paths.metrics, cfg.paths.curve, cfg.paths.summary):
                stale.unlink(missing_ok=True)
            shutil.rmtree(cfg.paths.checkpoints, ignore_errors=True)
        dump_config(cfg, cfg.paths.config)
        if cfg.model.lora.enabled:  # (after the set-up: pretraining trains the whole model)
            policy.model = lora.wrap(policy.model, cfg.model.lora)  # type: ignore[assignment]
            log.info(lora.trainable_summary(policy.model))
        engine = HFEngine(policy.model, policy.pad_id, policy.eos_id, policy.device,
                          stop_ids=policy.stop_ids)  # fmt: skip
        learner = Learner(policy.model, cfg.learner, cfg.algo, policy.pad_id, policy.eos_id,
                          policy.device, compute_dtype=compute_dtype(cfg.model))  # fmt: skip
        buffer_metrics = BufferMetrics(metrics.registry)
        buffer = make_buffer(
            cfg.buffer, cfg.name, cfg.seed, buffer_metrics, not resume,
            samples_per_insert=cfg.samples_per_insert, redis=cfg.redis,
        )  # fmt: skip
        source = BatchSource.from_config(buffer, cfg)
        step = UpdateStep(learner, cfg, buffer, UpdateMetrics(metrics.registry))
        checkpointer = Checkpointer(
            cfg.paths.checkpoints, learner.model, learner.reference.model, learner.optimizer,
            [learner, step, source], cfg.learner.keep_checkpoints,
        )  # fmt: skip
        if cfg.metrics.prometheus_port is not None:
            port = metrics.serve(cfg.metrics.prometheus_port, cfg.metrics.addr)
            log.info("Prometheus metrics on http://127.0.0.1:%d/metrics", port)
        r = cfg.rollout
        return cls(
            cfg, prepared, progress, engine, learner, buffer, buffer_metrics, source, step,
            checkpointer, JsonlWriter(cfg.paths.metrics) if cfg.metrics.jsonl else None,
            PromptDealer(None, "", cfg.name, list(task.prompts), seed=cfg.seed),
            EpisodeRunner.from_config(cfg.task),  # (task.environment: multi-turn episodes)
            SamplingParams(n=r.n, temperature=r.temperature, top_p=r.top_p,
                           max_new_tokens=r.max_new_tokens),
            trackers=build_trackers(cfg, cfg.run_dir, resume),
        )  # fmt: skip

    @property
    def drain(self) -> Callable[[], dict[str, float]] | None:
        """A custom reward's named components, averaged since the last call."""
        return getattr(self.prepared.task.verifier, "drain_components", None)

    @property
    def exact(self) -> Callable[[], float] | None:
        return exact_success(self.prepared.task, self.prepared.policy)

    def evaluate(self, round_idx: int) -> float:
        cfg, p = self.cfg, self.prepared
        done = evaluate(
            self.engine, p.policy.tokenizer, p.task, p.eval_prompts, cfg.eval.samples_per_prompt,
            cfg.eval.temperature, cfg.rollout.max_new_tokens, seed=cfg.seed * 1000003 + round_idx,
            episodes=self.episodes,
        )  # fmt: skip
        if self.drain is not None:  # (the rows' components are the training answers')
            self.drain()
        answers = tuple(done.answers[: cfg.metrics.tracker_answers])
        self.trackers.log_table(EVAL_TABLE, self.learner.step, Table(ANSWER_COLUMNS, answers))
        return done.success

    def emit(self, record: dict[str, Any]) -> None:
        self.history.append(record)
        if self.writer:
            self.writer.write(record)
        self.trackers.log_row(int(record["policy_version"]), record)
        if self.progress:
            self.progress(record)

    def start(self) -> float:
        """The initial policy's success (before any RL step), as round 0's record; a warning
        when reval's own format pretraining of the tiny model left it suspiciously high."""
        log.info("evaluating the initial policy: %d prompts x %d samples",
                 len(self.prepared.eval_prompts), self.cfg.eval.samples_per_prompt)  # fmt: skip
        initial = self.evaluate(0)
        log.info("success before RL: %.3f", initial)
        self.prepared.metrics.success.set(initial)
        record0 = {"round": 0, "eval_success": initial, "policy_version": 0, **self.prepared.info}
        self.warn_if_leaks(initial)
        if self.exact is not None:
            record0["success_exact"] = self.exact()
        self.emit(record0)
        return initial

    def resume(self) -> float:
        """Continue the stopped run: its latest checkpoint into the learner and the counters,
        the prompt deal on from where it was, a one-shot task's calibration as it was, the
        history of ``metrics.jsonl`` (rows past the checkpoint, of a run killed after it, are
        dropped: those rounds run again). The success before RL, as the run measured it."""
        cfg = self.cfg
        path, meta = self.checkpointer.load()
        self.last_round = int(meta.get("round", 0))
        self.saved_round = self.last_round
        dealt = int(meta.get("prompts_dealt", self.last_round * cfg.rollout.prompts_per_round))
        if dealt:
            self.dealer.take(dealt)
        if meta.get("task_setup"):
            apply_task_setup(self.prepared.task, meta["task_setup"])
        rows = read_jsonl(cfg.paths.metrics) if cfg.paths.metrics.is_file() else []
        self.history = [r for r in rows if int(r.get("round", 0)) <= self.last_round]
        if len(self.history) < len(rows) and self.writer is not None:
            self.writer.close()
            cfg.paths.metrics.write_text("".join(json.dumps(r) + "\n" for r in self.history))
            self.writer = JsonlWriter(cfg.paths.metrics)
        if self.history:
            self.t_start -= float(self.history[-1].get("elapsed_s", 0.0))
        kept = "kept (Redis)" if cfg.buffer.backend == "redis" else "empty (it was in memory)"
        log.info("resumed from %s: round %d, step %d; the replay buffer starts %s; %s rows of "
                 "metrics.jsonl kept", path, self.last_round, self.learner.step, kept,
                 len(self.history))  # fmt: skip
        initial = next((r["eval_success"] for r in self.history if r.get("round") == 0
                        and "eval_success" in r), float("nan"))  # fmt: skip
        self.warn_if_leaks(initial)
        return float(initial)

    def last_success(self, default: float) -> float:
        """The last evaluation's success in the history, else ``default``."""
        return next((r["eval_success"] for r in reversed(self.history)
                     if "eval_success" in r), default)  # fmt: skip

    def save(self) -> Path:
        """A checkpoint now, with what ``resume`` needs beyond the learner's own counters: the
        round, the prompts dealt, a one-shot task's calibration."""
        setup = task_setup(self.prepared.task)
        path = self.checkpointer.save(
            round=self.last_round,
            prompts_dealt=self.last_round * self.cfg.rollout.prompts_per_round,
            **({"task_setup": setup} if setup is not None else {}),
        )
        self.last_checkpoint = time.monotonic()
        self.saved_round = self.last_round
        return path

    def checkpoint_due(self, rnd: int) -> bool:
        """Every ``learner.checkpoint_every`` rounds or ``checkpoint_every_s`` seconds since the
        last, whichever comes first."""
        lc = self.cfg.learner
        by_count = bool(lc.checkpoint_every) and rnd % lc.checkpoint_every == 0
        by_time = bool(lc.checkpoint_every_s) and (
            time.monotonic() - self.last_checkpoint >= lc.checkpoint_every_s
        )
        return by_count or by_time

    def warn_if_leaks(self, initial: float) -> None:
        """The warning (logged, and kept for ``summary.json``) when ``warm_start_leaks``."""
        if self.warm_start_leaks(initial):
            self.warnings.append(
                f"success before RL is {initial:.3f} after reval's format pretraining of the tiny "
                f"model ({self.cfg.model.pretrain_steps} steps): the warm start may leak answers "
                "(docs/tasks.md, the format pretraining)"
            )
            log.warning(self.warnings[-1])

    def warm_start_leaks(self, success: float) -> bool:
        """Success before RL above ``LEAK_SUSPECT`` on a tiny model that reval pretrained: a
        model that has read only the answer format answers at about chance."""
        model = self.cfg.model
        pretrained = model.name_or_path is None and model.pretrain_steps > 0
        return pretrained and self.cfg.task.kind != "oneshot" and success > LEAK_SUSPECT

    @property
    def updates_per_round(self) -> int:
        if self.cfg.algo.on_policy:  # every whole group of the round once
            return -(-self.cfg.round_size // self.cfg.batch_size)
        return self.cfg.learner.updates_per_round

    def round(self, rnd: int) -> dict[str, Any]:
        """Generate the round's answers, insert them, run its updates; its record."""
        cfg, p, learner, buffer = self.cfg, self.prepared, self.learner, self.buffer
        t0 = time.perf_counter()
        self.engine.policy_version = learner.step
        result = collect_round(
            self.engine, p.policy.tokenizer, p.task,
            [prompt for _, prompt in self.dealer.take(cfg.rollout.prompts_per_round)],
            self.params, seed=cfg.seed * 7919 + rnd, reward_variant=cfg.algo.reward,
            group_prefix=f"r{rnd}", run_id=cfg.name, worker_id="embedded",
            episodes=self.episodes,
            truncation=Truncation.from_config(cfg.algo, self.params.max_new_tokens),
        )  # fmt: skip
        t_gen = time.perf_counter() - t0
        buffer.set_policy_version(learner.step)
        evicted = buffer.insert(result.trajectories)
        if cfg.algo.on_policy and self.updates_per_round > 1:  # later ones clip against it
            learner.remember_old_logp(result.trajectories)
        upd, done = self.updates(rnd)
        held = buffer.items()
        stats = buffer.stats()
        self.buffer_metrics.observe_stats(stats)
        record: dict[str, Any] = {
            "round": rnd,
            "policy_version": learner.step,
            "reward_mean": result.reward_mean,
            "tokens": result.tokens,
            **({} if self.episodes is None else result.episode_stats()),
            "buffer_size": len(buffer),
            "evicted": evicted,
            "buffer_evicted_unused": stats.evicted_unused,
            "buffer_reuse": stats.reuse,
            "updates": done,
            **upd,
            "use_count_mean": sum(t.use_count for t in held) / max(len(held), 1),
            "ref_version": learner.reference.version,
            "gen_s": t_gen,
            "round_s": time.perf_counter() - t0,
            "elapsed_s": time.perf_counter() - self.t_start,
        }
        if self.drain is not None:  # (the round means of a custom reward's named components)
            record.update({f"reward/{name}": v for name, v in sorted(self.drain().items())})
        if self.exact is not None:
            record["success_exact"] = self.exact()
        m = p.metrics
        if (cfg.eval.every and rnd % cfg.eval.every == 0) or rnd == cfg.learner.rounds:
            record["eval_success"] = self.evaluate(rnd)
            m.success.set(record["eval_success"])
        m.round.set(rnd)
        m.reward.set(result.reward_mean)
        m.trajectories.inc(len(result.trajectories))
        m.tokens.inc(result.tokens)
        self.emit(record)
        self.last_round = rnd
        if self.checkpoint_due(rnd):
            self.save()
        return record

    def updates(self, rnd: int) -> tuple[dict[str, float], int]:
        """The round's updates: the means of their numeric metrics, and how many ran."""
        upd: dict[str, float] = {}
        done = 0
        for k in range(self.updates_per_round):
            self.buffer.set_policy_version(self.learner.step)
            try:
                # Nothing else inserts in a one-process run: waiting would not help.
                batch = self.source.next(timeout=0.0)
            except SampleTimeout as err:
                log.info("round %d: update %d skipped: %s", rnd, k, err)
                break
            rec = self.step(batch.trajectories, batch.weights.tolist(), batch)
            done += 1
            for key, value in rec.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    upd[key] = upd.get(key, 0.0) + float(value)
        upd = {key: value / max(done, 1) for key, value in upd.items()}
        for key in ("update", "policy_version", "ref_version", "batch_size"):
            upd.pop(key, None)
        return upd, done

    def close(self) -> None:
        """The metrics file, the trackers and the task's grading pool (a math task's); once."""
        if self.closed:
            return
        self.closed = True
        if self.writer:
            self.writer.close()
        self.trackers.close()
        close_verifier = getattr(self.prepared.task.verifier, "close", None)
        if close_verifier is not None:
            close_verifier()

    def stop(self, initial: float, signum: int) -> TrainResult:
        """Stopped by ``signum`` after a round: a checkpoint (the latest, unless this round's
        was just written), no export, no summary (a run without one is unfinished)."""
        latest = self.cfg.paths.latest_checkpoint()
        if latest is None or self.saved_round != self.last_round:
            latest = self.save()
        self.close()  # (after the checkpoint: a tracker's close may wait on its network)
        success = self.last_success(initial)
        return TrainResult(self.cfg.run_dir, self.history, initial, success, latest, signum,
                           self.last_round, self.learner.step)  # fmt: skip

    def finish(self, initial: float, success: float) -> TrainResult:
        """The last checkpoint, the Hugging Face export, the curve and the summary."""
        cfg, p, history = self.cfg, self.prepared, self.history
        first = history[0] if history else {}
        self.save()
        if cfg.metrics.plot:
            from services.plot import plot_curve

            plot_curve(history, cfg.paths.curve, title=f"{cfg.name}: {cfg.algo.name}")
        summary = {
            "success_before_rl": initial,
            "final_success": success,
            "rounds": self.last_round,
            "success_exact": history[-1].get("success_exact") if history else None,
            "policy_version": self.learner.step,
            "skipped_steps": self.learner.skipped_steps,
            "pretrain_steps": cfg.model.pretrain_steps if cfg.model.name_or_path is None else 0,
            **{k: first[k] for k in ("pretrain_prompts_unpaired",) if k in first},
            "warnings": self.warnings,
        }
        cfg.paths.summary.write_text(json.dumps(summary, indent=2) + "\n")
        if cfg.metrics.plot:
            self.trackers.log_image(CURVE, cfg.paths.curve)
        self.trackers.log_summary(summary)
        self.close()  # (after the checkpoint: a tracker's close may wait on its network)
        with _no_library_progress_bar():  # (transformers' bar of its one shard)
            ckpt = export_hf(p.policy.model, p.policy.tokenizer, cfg.paths.final)
        return TrainResult(cfg.run_dir, history, initial, success, ckpt, None, self.last_round,
                           self.learner.step)  # fmt: skip


@contextmanager
def _no_library_progress_bar() -> Iterator[None]:
    """transformers' (and the hub's) progress bars off for a while, then as they were."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()
