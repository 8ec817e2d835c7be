"""``reval eval``: a checkpoint on the paper's benchmarks, avg@k as the paper reports it.

For each benchmark (``rollout/eval_sets.py``: at most ``eval.max_problems`` problems, a seeded
subsample), ``eval.samples_per_prompt`` = k answers per problem at ``eval.temperature`` and
``eval.top_p`` with the run's engine (HF, or vLLM on GPU), graded by the training verifier
(math-verify in a process pool; GPQA by option letter). avg@k = the mean over problems of the
fraction of a problem's k answers that are right. Results go to a JSON file and a table of the
same fractions, one column per benchmark named as configured, in the paper's order (aime24 aime25
amc math500 minerva olympiad gpqa), then the others and their average (avg).

The benchmark ``task`` is the run's own task (the default of ``reval eval`` for a custom task):
its ``eval.dataset`` (else ``task.dataset``) read like the training prompts (at most
``eval.max_problems``, a seeded subsample) and graded by the task's own verifier (a custom
task's reward function in its grading pool), so avg@k is the mean reward.
"""

from __future__ import annotations

import json
import logging
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from reval.answers import answer_text
from reval.config import RunConfig
from reval.trackers import ANSWER_COLUMNS, EVAL_TABLE, Table, Trackers, eval_trackers
from rollout.collect import score_all
from rollout.engines import SamplingParams
from rollout.eval_sets import BENCHMARKS, Benchmark, BenchmarkSpec, Problem, load_benchmark
from rollout.task_types import Prompt, Task

log = logging.getLogger("reval.eval")

COLUMNS = ("aime24", "aime25", "amc", "math500", "minerva", "olympiad", "gpqa")
TASK = "task"
"""The benchmark name of the run's own task (the module's docstring)."""


@dataclass
class BenchmarkResult:
    name: str
    avg_at_k: float
    k: int
    problems: int
    skipped_rows: int
    skipped_too_long: int
    """Problems over ``task.max_prompt_tokens``: skipped, never truncated."""
    per_problem: list[float]
    seconds: float
    components: dict[str, float] = field(default_factory=dict)
    """A custom reward's named components, each averaged over every answer graded (empty for
    graders without components), as ``reval train``'s rows carry them (``reward/NAME``)."""
    answers: list[tuple[str, str, float]] = field(default_factory=list)
    """Each problem's first answer: (prompt, answer, score) (the trackers' table)."""


def evaluate_benchmark(
    bench: Benchmark,
    engine: Any,
    tokenizer: Any,
    verifier: Any,
    params: SamplingParams,
    seed: int = 0,
    batch_prompts: int = 16,
    progress: Any = None,
    task_prompts: Sequence[Prompt] | None = None,
) -> BenchmarkResult:
    """avg@k of ``bench``. ``task_prompts`` (the ``task`` benchmark: one per problem): the
    verifier is the task's, graded on ``(Prompt, response)`` pairs; else on ``(gold, response)``
    pairs."""
    t0 = time.perf_counter()
    scores: list[float] = []
    answers: list[tuple[str, str, float]] = []
    drain = getattr(verifier, "drain_components", None)  # (a custom reward's components)
    if drain is not None:
        drain()  # (what it graded before this benchmark is not this benchmark's)
    for start in range(0, len(bench.problems), batch_prompts):
        chunk = bench.problems[start : start + batch_prompts]
        texts = bench.prompts[start : start + batch_prompts]
        ids = [tokenizer(t, add_special_tokens=False).input_ids for t in texts]
        samples = engine.generate(ids, params, seed=seed * 1_000_003 + start)
        pairs: list[tuple[Any, str]] = []
        reasons: list[str] = []
        for j, (problem, group) in enumerate(zip(chunk, samples, strict=True)):
            key = problem.answer if task_prompts is None else task_prompts[start + j]
            for s in group:
                pairs.append((key, answer_text(tokenizer, s.token_ids, engine.stop_ids)))
                reasons.append(s.finish_reason)
        if task_prompts is None:
            graded = [float(x) for x in verifier.score_many(pairs)]
        else:  # (the task's reward function receives each answer's finish reason)
            graded = score_all(verifier, pairs, reasons)
        k = params.n
        for j in range(len(chunk)):
            scores.append(float(np.mean(graded[j * k : (j + 1) * k])))
            answers.append((texts[j], pairs[j * k][1], float(graded[j * k])))
        if progress is not None:
            progress.update(len(chunk))
    return BenchmarkResult(
        name=bench.spec.name,
        avg_at_k=float(np.mean(scores)) if scores else 0.0,
        k=params.n,
        problems=len(scores),
        skipped_rows=bench.skipped,
        skipped_too_long=bench.too_long,
        per_problem=scores,
        seconds=time.perf_counter() - t0,
        components=dict(sorted(drain().items())) if drain is not None else {},
        answers=answers,
    )


def components_text(components: dict[str, float]) -> str:
    """``a 0.500, b 3.000``: a custom reward's named components, in a line."""
    return ", ".join(f"{k} {v:.3f}" for k, v in components.items())


def table(results: dict[str, BenchmarkResult]) -> str:
    """avg@k of each benchmark run, a fraction (3 decimals) under its name as configured (the
    paper's columns first, in its order), and their average ``avg``: the figures and keys of
    ``eval.json``."""
    cols = [c for c in COLUMNS if c in results] + [c for c in results if c not in COLUMNS]
    vals = [results[c].avg_at_k for c in cols]
    avg = float(np.mean(vals)) if vals else 0.0
    row = " | ".join(f"{v:.3f}" for v in vals)
    return f"| {' | '.join(cols)} | avg |\n|{'---|' * (len(cols) + 1)}\n| {row} | {avg:.3f} |\n"


def task_benchmark(cfg: RunConfig, tokenizer: Any) -> tuple[Benchmark, Task]:
    """The ``task`` benchmark: the run's task built on ``eval.dataset`` (else its own dataset),
    at most ``eval.max_problems`` of its prompts (a seeded subsample); the task grades it."""
    from rollout.tasks import build_task

    task_cfg = cfg.task
    if cfg.eval.dataset is not None:
        task_cfg = task_cfg.model_copy(update={"dataset": cfg.eval.dataset})
    task = build_task(task_cfg, cfg.seed, tokenizer, cfg.rollout)
    prompts = list(task.prompts)
    if len(prompts) > cfg.eval.max_problems:
        prompts = random.Random(cfg.seed).sample(prompts, cfg.eval.max_problems)
    spec = BenchmarkSpec(TASK, TASK, task_cfg.dataset or task_cfg.kind, task_cfg.split)
    problems = [Problem(p.id, p.text, p.answer) for p in prompts]
    bench = Benchmark(spec, problems, total=len(task.prompts), prompts=[p.text for p in prompts])
    task.prompts = prompts
    return bench, task


def _prepare(
    cfg: RunConfig, benchmarks: list[str], data_dir: str | None
) -> tuple[Any, Any, SamplingParams, list[Benchmark]]:
    """The engine, its tokenizer, the sampling of the evaluation and the loaded benchmarks."""
    from rollout.generators import build_engine

    unknown = [b for b in benchmarks if b not in BENCHMARKS and b != TASK]
    if unknown:
        raise ValueError(f"unknown benchmark(s) {unknown} (known: {', '.join(BENCHMARKS)}, "
                         f"{TASK}: the run's own task)")  # fmt: skip
    engine, tokenizer = build_engine(cfg, cfg.seed)
    e = cfg.eval
    params = SamplingParams(n=e.samples_per_prompt, temperature=e.temperature, top_p=e.top_p,
                            max_new_tokens=cfg.rollout.max_new_tokens)  # fmt: skip
    loaded = [
        task_benchmark(cfg, tokenizer)[0]
        if b == TASK
        else load_benchmark(
            b,
            data_dir,
            e.max_problems,
            cfg.seed,
            cfg.task.template,
            tokenizer,
            cfg.task.max_prompt_tokens,
        )
        for b in benchmarks
    ]
    return engine, tokenizer, params, loaded


def _evaluate_all(
    cfg: RunConfig, loaded: list[Benchmark], engine: Any, tokenizer: Any,
    params: SamplingParams, bar: Any = None,
) -> dict[str, BenchmarkResult]:  # fmt: skip
    """Every benchmark, graded by the training verifier (a process pool per benchmark)."""
    from rollout.grading.math_grading import MathVerify
    from rollout.grading.pool import VerifierPool

    results: dict[str, BenchmarkResult] = {}
    require_think = cfg.task.template == "r1_distill"
    for bench in loaded:
        if bench.spec.name == TASK:
            got = _evaluate_task(cfg, bench, engine, tokenizer, params, bar)
            results[TASK] = got
            log.info("%s: avg@%d %.3f over %d problems; reward components: %s", got.name,
                     got.k, got.avg_at_k, got.problems,
                     components_text(got.components) or "none")  # fmt: skip
            continue
        grader = MathVerify(require_think=require_think,
                            multiple_choice=bench.spec.multiple_choice)  # fmt: skip
        with VerifierPool(grader, workers=cfg.rollout.grading_processes(),
                          timeout=cfg.rollout.verifier_timeout_s,
                          memory_mb=cfg.rollout.grading_memory_mb) as pool:  # fmt: skip
            got = evaluate_benchmark(bench, engine, tokenizer, pool, params, cfg.seed, progress=bar)
        results[bench.spec.name] = got
        log.info("%s: avg@%d %.3f over %d problems", got.name, got.k, got.avg_at_k,
                 got.problems)  # fmt: skip
    return results


def _evaluate_task(
    cfg: RunConfig, bench: Benchmark, engine: Any, tokenizer: Any, params: SamplingParams,
    bar: Any = None,
) -> BenchmarkResult:  # fmt: skip
    """The ``task`` benchmark graded by the task's verifier (its pool closed after)."""
    _, task = task_benchmark(cfg, tokenizer)
    try:
        # (built again as ``bench`` was: the same prompts in the same order)
        return evaluate_benchmark(bench, engine, tokenizer, task.verifier, params, cfg.seed,
                                  progress=bar, task_prompts=task.prompts)  # fmt: skip
    finally:
        close = getattr(task.verifier, "close", None)
        if close is not None:
            close()


def run_eval(
    cfg: RunConfig,
    benchmarks: list[str],
    data_dir: str | None,
    out: Path,
    progress: bool = True,
) -> dict[str, Any]:
    engine, tokenizer, params, loaded = _prepare(cfg, benchmarks, data_dir)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=sum(len(b.problems) for b in loaded), desc="eval", unit="problem")
    try:
        results = _evaluate_all(cfg, loaded, engine, tokenizer, params, bar)
    finally:
        if bar is not None:
            bar.close()
    report: dict[str, Any] = {
        "checkpoint": cfg.model.name_or_path,
        "k": params.n,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "max_new_tokens": params.max_new_tokens,
        "max_problems": cfg.eval.max_problems,
        "seed": cfg.seed,
        "benchmarks": {n: r.__dict__ for n, r in results.items()},
        "avg": float(np.mean([r.avg_at_k for r in results.values()])) if results else 0.0,
        "table": table(results),
    }
    # A custom reward's named components (each benchmark's also in "benchmarks"): in the
    # report and, a line per benchmark, under the printed table.
    components = {n: r.components for n, r in results.items() if r.components}
    if components:
        report["components"] = components
        report["table"] += "".join(
            f"{n} reward components: {components_text(c)}\n" for n, c in components.items()
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    return report


class EvalMetrics:
    """``reval_eval_*``: the scores of the newest evaluated policy version."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge

        r = self.registry = CollectorRegistry()
        self.score = Gauge("reval_eval_avg_at_k", "avg@k of the newest evaluated version",
                           ["benchmark"], registry=r)  # fmt: skip
        self.average = Gauge("reval_eval_average", "Mean avg@k over the benchmarks", registry=r)
        self.version = Gauge("reval_eval_policy_version", "Policy version last evaluated",
                             registry=r)  # fmt: skip
        self.runs = Counter("reval_eval_runs", "Evaluations done", registry=r)


def _evaluate_version(
    cfg: RunConfig, loaded: Any, engine: Any, tokenizer: Any, params: Any, version: int
) -> tuple[dict[str, Any], dict[str, BenchmarkResult]]:
    """The ``eval.jsonl`` row of the weights loaded (``version``): each benchmark's avg@k, their
    mean, a custom reward's components; and each benchmark's result."""
    t0 = time.perf_counter()
    results = _evaluate_all(cfg, loaded, engine, tokenizer, params)
    scores = {n: r.avg_at_k for n, r in results.items()}
    avg = float(np.mean(list(scores.values()))) if scores else 0.0
    record = {"policy_version": version, "k": params.n, "avg": avg, "scores": scores,
              "seconds": time.perf_counter() - t0, "time": time.time()}  # fmt: skip
    components = {n: r.components for n, r in results.items() if r.components}
    if components:
        record["components"] = components
    return record, results


def _track(trackers: Trackers, record: dict[str, Any], results: dict[str, BenchmarkResult],
           rows: int) -> None:  # fmt: skip
    """One evaluation to the evaluator's trackers (``eval_trackers``) at its version: ``avg``
    and each benchmark's avg@k (``eval/NAME``) and, per benchmark, a table of its first
    ``rows`` answers (``eval/answers/NAME``)."""
    version = record["policy_version"]
    scores = {f"eval/{n}": v for n, v in record["scores"].items()}
    trackers.log_row(version, {"eval/avg": record["avg"], **scores})
    for name, result in results.items():
        table = Table(ANSWER_COLUMNS, tuple(result.answers[:rows]))
        trackers.log_table(f"{EVAL_TABLE}/{name}", version, table)


def _report(record: dict[str, Any], writer: Any, control: Any, metrics: EvalMetrics | None) -> None:
    """One evaluation said everywhere: ``eval.jsonl``, the run's event log (a Redis outage only
    warns), the ``reval_eval_*`` metrics, a log line."""
    import redis

    version, avg, scores, k = record["policy_version"], record["avg"], record["scores"], record["k"]
    writer.write(record)
    try:
        control.record("eval", {"avg": avg, "scores": scores, "k": k}, step=version)
    except (redis.ConnectionError, redis.TimeoutError) as err:
        log.warning("could not record the evaluation: %s", err)
    if metrics is not None:
        for n, v in scores.items():
            metrics.score.labels(benchmark=n).set(v)
        metrics.average.set(avg)
        metrics.version.set(version)
        metrics.runs.inc()
    log.info("eval of v%d: avg@%d %.3f %s", version, k, avg, scores)


def follow(
    cfg: RunConfig,
    benchmarks: list[str],
    data_dir: str | None,
    every: int,
    max_evals: int | None = None,
    poll_s: float = 2.0,
    metrics: EvalMetrics | None = None,
    stop: Any = None,
) -> list[dict[str, Any]]:
    """Evaluation during a run (``reval eval --follow``): whenever the learner has announced a
    version at least ``every`` steps past the last one evaluated (the first: the first one
    announced), load it and evaluate it; each result goes to ``run_dir/eval.jsonl``, the run's
    event log (``eval``, with the version as its step) and ``reval_eval_*`` metrics. Runs beside
    the learner like a rollout worker, so training never waits for it."""
    import threading

    import redis

    from reval.control import RunControl
    from reval.metrics import JsonlWriter
    from reval.redis import connect
    from reval.weights.files import UNREADABLE, run_store
    from reval.weights.http_files import FileFetcher

    if every < 1:
        raise ValueError("--every must be >= 1")
    stop = stop or threading.Event()
    client = connect(cfg.redis.url)
    store = run_store(cfg, client)
    control = RunControl(client, cfg.redis.prefix, cfg.name)
    engine, tokenizer, params, loaded = _prepare(cfg, benchmarks, data_dir)
    cfg.run_dir.mkdir(parents=True, exist_ok=True)
    writer = JsonlWriter(cfg.paths.eval_log)
    done: list[dict[str, Any]] = []
    last: int | None = None
    base: Path | None = None
    fetcher = FileFetcher()  # (the files of a learner on another host: over HTTP)
    trackers = eval_trackers(cfg)  # (runs of their own: NAME-eval)
    try:
        while not stop.is_set() and (max_evals is None or len(done) < max_evals):
            try:
                ann = store.latest()
            except (redis.ConnectionError, redis.TimeoutError):
                ann = None
            # (the newest version with a file: the files lag the broadcast a little)
            version = ann.file_version if ann is not None else None
            if (
                ann is None
                or ann.path is None
                or version is None
                or (last is not None and version < last + every)
            ):
                stop.wait(poll_s)
                continue
            try:
                if ann.base is not None and ann.base != base:  # (LoRA adapters alone: their base)
                    engine.load_weights(store.load(fetcher.local(ann.base, ann.files_url)), version)
                    base = ann.base
                tensors = store.load(fetcher.local(ann.path, ann.files_url, ann.lineage))
            except UNREADABLE:  # pruned before we read it: the next one
                stop.wait(poll_s)
                continue
            engine.load_weights(tensors, version)
            record, results = _evaluate_version(cfg, loaded, engine, tokenizer, params, version)
            _report(record, writer, control, metrics)
            _track(trackers, record, results, cfg.metrics.tracker_answers)
            done.append(record)
            last = version
    finally:
        fetcher.close()
        trackers.close()
    return done
