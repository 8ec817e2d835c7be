"""``reval experiment oneshot``: the paper's "importance of off-policy data" study at CPU scale.

One-shot tasks whose initial success rate is about 0.10 / 0.40 / 0.68 (hard / medium / easy;
``OneShotTask`` calibrates the accepted codes on the initial policy). Methods: GRPO (a fresh batch
every update) and ReVal with step = K (K updates per generation round from the FIFO buffer). Each
run stops when the exact success rate (the policy's probability of an accepted answer, no
sampling noise) reaches the threshold; its generation round is the result (censored at
``max_rounds``).

The study has four phases; the selection phases use their own seeds (100, 101, ...), never the
seeds of the reported runs (0, 1, ...):

1. **beta**: ReVal's beta is chosen from ``beta_grid`` on the selection seeds (the ReVal methods
   with K >= 4 at the shared learning rate; the smallest mean of the per-cell median rounds).
2. **shared learning rate**: every method at ``lr`` with that beta, ``seeds`` seeds per cell: the
   paper's comparison (``oneshot.md``, ``oneshot.png``).
3. **tuning**: each method's own learning rate from ``lr_grid`` on the selection seeds (the
   smallest mean over the difficulties of the median rounds).
4. **tuned**: every method at its own learning rate on the reported seeds (``oneshot-tuned.png``).

Writes ``oneshot.json`` (every run's curve, the selection scores, both tables) and ``oneshot.md``.
Runs go to a pool of ``workers`` processes (one torch thread each).
"""

from __future__ import annotations

import json
import logging
import math
import multiprocessing as mp
import os
import signal
import statistics
import tempfile
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from reval.config import RunConfig, load_config
from reval.procs import follow_parent

log = logging.getLogger("reval.experiment")

DIFFICULTIES = {"hard": 0.10, "medium": 0.40, "easy": 0.68}
METHODS = ("grpo", "reval-1", "reval-2", "reval-4", "reval-8")
SELECT_SEED0 = 100
"""The selection phases' first seed: far from the reported seeds 0, 1, ..."""


@dataclass
class Cell:
    difficulty: str
    method: str
    seed: int
    lr: float
    beta: float
    rounds: int | None
    """Generation rounds to the threshold (None: not within max_rounds)."""
    curve: list[float]
    seconds: float
    """The whole run: model set-up, pretraining, calibration and the RL loop."""
    loop_s: float = 0.0
    """The RL loop's generation and updates only (the rounds' ``round_s``)."""
    gen_s: float = 0.0
    """Of which generation."""


def steps_of(method: str) -> int:
    """Learner updates per generation round: 1 for GRPO, K for ReVal step = K."""
    return 1 if method == "grpo" else int(method.split("-")[1])


def run_config(
    base: RunConfig, difficulty: str, method: str, seed: int, lr: float, max_rounds: int,
    threshold: float, out: Path, beta: float | None = None,
) -> RunConfig:  # fmt: skip
    overrides: dict[str, Any] = {
        "name": f"{difficulty}-{method}-s{seed}-lr{lr:g}" + (f"-b{beta:g}" if beta else ""),
        "seed": seed,
        "output_dir": str(out),
    }
    cfg = base.model_copy(deep=True, update=overrides)
    cfg.task.kind = "oneshot"
    cfg.task.oneshot_base_success = DIFFICULTIES[difficulty]
    cfg.learner.rounds = max_rounds
    cfg.learner.lr = lr
    cfg.learner.stop_at_success = threshold
    cfg.learner.checkpoint_every = 0
    cfg.eval.every = 0
    cfg.metrics.plot = False
    cfg.metrics.progress = False
    if beta is not None:
        cfg.algo.beta = beta
    if method == "grpo":
        cfg.algo.name = "grpo"
        cfg.learner.updates_per_round = 1
        cfg.learner.first_update_fresh = True
    else:
        cfg.algo.name = "reval"
        cfg.learner.updates_per_round = steps_of(method)
    return cfg


@dataclass(frozen=True)
class Job:
    difficulty: str
    method: str
    seed: int
    lr: float
    beta: float


def _run_job(base_json: str, job: Job, max_rounds: int, threshold: float) -> Cell:
    """One run, in a pool worker or in this process: its run directory is thrown away."""
    from services.train import train

    base = RunConfig.model_validate_json(base_json)
    with tempfile.TemporaryDirectory(prefix="reval-oneshot-") as tmp:
        cfg = run_config(base, job.difficulty, job.method, job.seed, job.lr, max_rounds,
                         threshold, Path(tmp), job.beta)  # fmt: skip
        t0 = time.perf_counter()
        result = train(cfg)
        seconds = time.perf_counter() - t0
    curve = [float(r.get("success_exact", 0.0)) for r in result.history]
    reached = bool(curve) and curve[-1] >= threshold
    rounds = int(result.history[-1]["round"]) if reached else None
    loop_s = sum(float(r.get("round_s", 0.0)) for r in result.history)
    gen_s = sum(float(r.get("gen_s", 0.0)) for r in result.history)
    return Cell(job.difficulty, job.method, job.seed, job.lr, job.beta, rounds, curve, seconds,
                loop_s, gen_s)  # fmt: skip


def _worker_init(parent: int) -> None:
    import torch

    # A killed ``reval experiment`` left its pool's workers running through the whole queue.
    follow_parent(parent, signal.SIGKILL, what="experiment worker")

    torch.set_num_threads(1)
    logging.getLogger().setLevel(logging.WARNING)


def worker_pool(workers: int) -> ProcessPoolExecutor:
    """The pool the runs go to: spawned processes of one torch thread each, which end with this
    process (a killed ``reval experiment`` left them running through the whole queue)."""
    return ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn"),
                               initializer=_worker_init, initargs=(os.getpid(),))  # fmt: skip


class Runner:
    """Runs jobs once each (a job asked for twice is served from the cache), in parallel."""

    def __init__(self, base: RunConfig, max_rounds: int, threshold: float, workers: int) -> None:
        self.base_json = base.model_dump_json()
        self.max_rounds = max_rounds
        self.threshold = threshold
        self.workers = max(1, workers)
        self.done: dict[Job, Cell] = {}

    def run(self, jobs: Iterable[Job]) -> list[Cell]:
        jobs = list(dict.fromkeys(jobs))
        todo = [j for j in jobs if j not in self.done]
        if self.workers == 1 or len(todo) <= 1:
            for job in todo:
                self._record(job, _run_job(self.base_json, job, self.max_rounds, self.threshold))
        else:
            from concurrent.futures import as_completed

            with worker_pool(min(self.workers, len(todo))) as pool:
                futures = {pool.submit(_run_job, self.base_json, job, self.max_rounds,
                                       self.threshold): job for job in todo}  # fmt: skip
                for fut in as_completed(futures):
                    self._record(futures[fut], fut.result())
        return [self.done[j] for j in jobs]

    def _record(self, job: Job, cell: Cell) -> None:
        self.done[job] = cell
        log.info("%s %s seed %d lr %g beta %g: %s rounds (%.1f s)", job.difficulty, job.method,
                 job.seed, job.lr, job.beta, cell.rounds, cell.seconds)  # fmt: skip


def _median(rounds: Sequence[int | None], cap: int) -> float:
    """Median rounds, a run that never got there counted as beyond the cap (cap + 1)."""
    return float(statistics.median([r if r is not None else cap + 1 for r in rounds]))


def medians(cells: Sequence[Cell], cap: int) -> dict[str, dict[str, float]]:
    """difficulty -> method -> median rounds over the cells' seeds."""
    groups: dict[tuple[str, str], list[int | None]] = {}
    for c in cells:
        groups.setdefault((c.difficulty, c.method), []).append(c.rounds)
    out: dict[str, dict[str, float]] = {}
    for (d, m), rounds in groups.items():
        out.setdefault(d, {})[m] = _median(rounds, cap)
    return out


def choose(scores: dict[float, float]) -> float:
    """The value with the smallest score; a tie goes to the smaller value."""
    return min(sorted(scores), key=lambda v: (scores[v], v))


def select_beta(cells: Sequence[Cell], cap: int) -> tuple[float, dict[float, float]]:
    """beta -> the mean over (difficulty, method) of the median rounds; the best beta."""
    scores: dict[float, float] = {}
    for beta in sorted({c.beta for c in cells}):
        med = medians([c for c in cells if c.beta == beta], cap)
        scores[beta] = statistics.mean(v for row in med.values() for v in row.values())
    return choose(scores), scores


def select_lr(
    cells: Sequence[Cell], cap: int
) -> tuple[dict[str, float], dict[str, dict[float, float]]]:
    """Per method: lr -> the mean over the difficulties of the median rounds; the best lr."""
    scores: dict[str, dict[float, float]] = {}
    for method in dict.fromkeys(c.method for c in cells):
        for lr in sorted({c.lr for c in cells if c.method == method}):
            med = medians([c for c in cells if c.method == method and c.lr == lr], cap)
            scores.setdefault(method, {})[lr] = statistics.mean(row[method] for row in med.values())
    return {m: choose(s) for m, s in scores.items()}, scores


def oneshot_study(
    out: Path,
    seeds: int = 5,
    lr: float = 1e-3,
    max_rounds: int = 200,
    threshold: float = 0.95,
    difficulties: tuple[str, ...] = tuple(DIFFICULTIES),
    methods: tuple[str, ...] = METHODS,
    config: str | None = None,
    overrides: tuple[str, ...] = (),
    beta_grid: tuple[float, ...] = (0.03, 0.1, 0.3),
    lr_grid: tuple[float, ...] = (1e-3, 2e-3, 3e-3, 1e-2),
    select_seeds: int = 3,
    workers: int = 2,
) -> dict[str, Any]:
    base = load_config(config or str(Path(__file__).resolve().parents[1] / "configs" /
                                     "oneshot.toml"), list(overrides))  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    runner = Runner(base, max_rounds, threshold, workers)
    sel = range(SELECT_SEED0, SELECT_SEED0 + select_seeds)
    main = range(seeds)
    reval = [m for m in methods if m != "grpo"]
    report: dict[str, Any] = {"threshold": threshold, "max_rounds": max_rounds, "lr": lr,
                              "seeds": list(main), "selection_seeds": list(sel)}  # fmt: skip

    # 1. beta on the selection seeds (ReVal with K >= 4, or whichever ReVal methods were asked).
    beta = base.algo.beta
    if len(beta_grid) > 1 and reval:
        sel_methods = [m for m in reval if steps_of(m) >= 4] or reval
        cells = runner.run(Job(d, m, s, lr, b) for b in beta_grid for d in difficulties
                           for m in sel_methods for s in sel)  # fmt: skip
        beta, scores = select_beta(cells, max_rounds)
        report["beta_selection"] = {"methods": sel_methods, "scores": scores, "chosen": beta}
    elif beta_grid:
        beta = beta_grid[0]
    report["beta"] = beta

    # 2. the paper's comparison: one shared learning rate.
    shared = runner.run(Job(d, m, s, lr, beta) for d in difficulties for m in methods for s in main)
    report["shared"] = summarize(shared, methods, difficulties, max_rounds,
                                 {m: lr for m in methods}, threshold)  # fmt: skip
    plot(shared, methods, difficulties, out / "oneshot.png", threshold,
         f"one shared learning rate ({lr:g}), beta {beta:g}")  # fmt: skip

    # 3-4. each method at its own learning rate, tuned on the selection seeds.
    if lr_grid:
        cells = runner.run(Job(d, m, s, x, beta) for x in lr_grid for d in difficulties
                           for m in methods for s in sel)  # fmt: skip
        lrs, scores = select_lr(cells, max_rounds)
        report["lr_selection"] = {"scores": scores, "chosen": lrs}
        tuned = runner.run(Job(d, m, s, lrs[m], beta) for d in difficulties for m in methods
                           for s in main)  # fmt: skip
        report["tuned"] = summarize(tuned, methods, difficulties, max_rounds, lrs, threshold)
        plot(tuned, methods, difficulties, out / "oneshot-tuned.png", threshold,
             "each method at its own tuned learning rate", lrs)  # fmt: skip

    report["seconds"] = time.perf_counter() - t0
    report["cells"] = [{**asdict(c), "curve": [round(x, 4) for x in c.curve]}
                       for c in runner.done.values()]  # fmt: skip
    report["table"] = render(report)
    (out / "oneshot.json").write_text(json.dumps(report))
    (out / "oneshot.md").write_text(report["table"])
    return report


def summarize(
    cells: list[Cell], methods: Sequence[str], difficulties: Sequence[str], cap: int,
    lrs: dict[str, float], threshold: float,
) -> dict[str, Any]:  # fmt: skip
    med = medians(cells, cap)
    ratios = {}
    if "grpo" in methods and "reval-8" in methods:
        ratios = {d: med[d]["grpo"] / med[d]["reval-8"] for d in difficulties}
    updates = {d: {m: med[d][m] * steps_of(m) for m in methods} for d in difficulties}

    def per_cell(f: Any) -> dict[str, dict[str, Any]]:
        return {d: {m: f([c for c in cells if c.difficulty == d and c.method == m])
                    for m in methods} for d in difficulties}  # fmt: skip

    seconds = per_cell(lambda cs: statistics.median(c.loop_s for c in cs))
    gen_share = per_cell(lambda cs: sum(c.gen_s for c in cs) / max(sum(c.loop_s for c in cs), 1e-9))
    reached = per_cell(lambda cs: f"{sum(c.rounds is not None for c in cs)}/{len(cs)}")
    censored = sum(c.rounds is None for c in cells)
    return {
        "lr": lrs,
        "medians": {d: {m: med[d][m] for m in methods} for d in difficulties},
        "median_updates": updates,
        "median_seconds": seconds,
        "generation_share": gen_share,
        "reached": reached,
        "ratios": ratios,
        "ratio_average": statistics.mean(ratios.values()) if ratios else None,
        "not_reached": censored,
        "threshold": threshold,
    }


def _table(s: dict[str, Any], methods: Sequence[str], cap: int, key: str, fmt: str) -> list[str]:
    """One row per difficulty; a GRPO / ReVal-8 column where both ran (not for shares)."""
    ratio_col = key != "generation_share" and "grpo" in methods and "reval-8" in methods
    head = " | ".join(methods) + (" | GRPO / ReVal-8 |" if ratio_col else " |")
    lines = ["| difficulty | " + head, "|---|" + "---|" * (len(methods) + int(ratio_col))]
    for d, row in s[key].items():
        if key == "medians":
            vals = " | ".join(f"{row[m]:g} ({s['reached'][d][m]})" for m in methods)
        else:
            vals = " | ".join(format(row[m], fmt) for m in methods)
        ratio = ""
        if ratio_col:
            ratio = f" {row['grpo'] / row['reval-8']:.2f} |" if row["reval-8"] else " - |"
        lines.append(f"| {d} ({DIFFICULTIES[d]:.2f}) | {vals} |{ratio}")
    return lines


def render(report: dict[str, Any]) -> str:
    cap, thr = report["max_rounds"], report["threshold"]
    shared = report["shared"]
    methods = list(next(iter(shared["medians"].values())))
    lines = [f"# One-shot study: generation rounds to exact success >= {thr}\n",
             f"Seeds {report['seeds'][0]}..{report['seeds'][-1]} per cell; beta and the tuned "
             f"learning rates chosen on seeds {report['selection_seeds'][0]}.."
             f"{report['selection_seeds'][-1]}. {cap + 1} = not reached within {cap} rounds. "
             f"{report['seconds'] / 60:.1f} minutes in all.\n"]  # fmt: skip
    if "beta_selection" in report:
        b = report["beta_selection"]
        lines.append(f"beta chosen on the selection seeds ({', '.join(b['methods'])}; mean of "
                     "the median rounds): " + ", ".join(f"{float(k):g}: {v:.1f}" for k, v in
                                                        b["scores"].items())
                     + f" -> **{b['chosen']:g}**\n")  # fmt: skip
    lines.append(f"## One shared learning rate ({report['lr']:g}), beta {report['beta']:g}\n")
    lines.append("Median generation rounds (runs that reached the threshold / runs):\n")
    lines += _table(shared, methods, cap, "medians", "g")
    if shared["ratio_average"] is not None:
        lines.append(f"\nGRPO / ReVal-8 averaged over the difficulties: "
                     f"**{shared['ratio_average']:.2f}** (the paper: 3.6 / 4.1 / 5.2, average "
                     "4.3)\n")  # fmt: skip
    lines.append("Median learner updates (rounds x K):\n")
    lines += _table(shared, methods, cap, "median_updates", "g")
    lines.append("\nMedian seconds of the RL loop to the threshold (generation and updates, no "
                 "set-up; one thread per run, two runs at a time on the 2-core VM):\n")  # fmt: skip
    lines += _table(shared, methods, cap, "median_seconds", ".2f")
    lines.append("\nShare of the loop spent generating:\n")
    lines += _table(shared, methods, cap, "generation_share", ".2f")
    if "tuned" in report:
        t, sel = report["tuned"], report["lr_selection"]
        lines.append("\n## Each method at its own learning rate (tuned on the selection seeds)\n")
        lines.append("| method | " + " | ".join(f"lr {float(x):g}" for x in
                                                next(iter(sel["scores"].values())))
                     + " | chosen |")  # fmt: skip
        lines.append("|---|" + "---|" * (len(next(iter(sel["scores"].values()))) + 1))
        for m, sc in sel["scores"].items():
            lines.append(f"| {m} | " + " | ".join(f"{v:.1f}" for v in sc.values())
                         + f" | {sel['chosen'][m]:g} |")  # fmt: skip
        lines.append("\n(mean over the difficulties of the median rounds on the selection seeds)\n")
        lines += _table(t, methods, cap, "medians", "g")
        if t["ratio_average"] is not None:
            lines.append(f"\nGRPO / ReVal-8 at tuned learning rates, averaged: "
                         f"**{t['ratio_average']:.2f}**\n")  # fmt: skip
        lines.append("Median seconds of the RL loop to the threshold:\n")
        lines += _table(t, methods, cap, "median_seconds", ".2f")
    return "\n".join(lines) + "\n"


def plot(cells: list[Cell], methods: Sequence[str], difficulties: Sequence[str], path: Path,
         threshold: float, title: str, lrs: dict[str, float] | None = None) -> None:  # fmt: skip
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(difficulties), figsize=(4.5 * len(difficulties), 3.8),
                             squeeze=False, sharey=True)  # fmt: skip
    for ax, d in zip(axes[0], difficulties, strict=True):
        for m in methods:
            curves = [c.curve for c in cells if c.difficulty == d and c.method == m]
            if not curves:
                continue
            n = max(len(c) for c in curves)
            # A run that stopped at the threshold stays there.
            padded = [c + [c[-1]] * (n - len(c)) for c in curves]
            mean = [statistics.mean(col) for col in zip(*padded, strict=True)]
            ax.plot(range(n), mean, label=f"{m} (lr {lrs[m]:g})" if lrs else m)
        ax.axhline(threshold, color="grey", ls="--", lw=0.8)
        ax.set_title(f"{d} (base {DIFFICULTIES[d]:.2f})")
        ax.set_xlabel("generation round")
    axes[0][0].set_ylabel("success rate (exact, mean over seeds)")
    axes[0][-1].legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_floats(text: str) -> tuple[float, ...]:
    """'1e-3,3e-3' -> (0.001, 0.003); an empty string -> (); a bad value raises ValueError."""
    vals = tuple(float(x) for x in text.split(",") if x.strip())
    if any(not math.isfinite(v) or v <= 0 for v in vals):
        raise ValueError(f"values must be positive and finite: {text!r}")
    return vals
