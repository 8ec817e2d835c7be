"""``reval experiment oneshot``: the paper's "importance of off-policy data" study at CPU scale.

One-shot tasks whose initial success rate is about 0.10 / 0.40 / 0.68 (hard / medium / easy;
``OneShotTask`` calibrates the accepted codes on the initial policy). Methods: GRPO (a fresh batch
every update) and ReVal with step = K (K updates per generation round from the FIFO buffer). Each
run stops when the exact success rate (the policy's probability of an accepted answer, no
sampling noise) reaches the threshold; its generation round is the result (censored at
``max_rounds``). All methods share one learning rate. Writes ``oneshot.json``, ``oneshot.md`` (the
table of median rounds and the GRPO / ReVal-8 ratios) and ``oneshot.png`` (success rate vs
generation round, one panel per difficulty, one line per method: the mean over seeds).
"""

from __future__ import annotations

import json
import logging
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from reval.config import RunConfig, load_config

log = logging.getLogger("reval.experiment")

DIFFICULTIES = {"hard": 0.10, "medium": 0.40, "easy": 0.68}
METHODS = ("grpo", "reval-1", "reval-2", "reval-4", "reval-8")


@dataclass
class Cell:
    difficulty: str
    method: str
    seed: int
    rounds: int | None
    """Generation rounds to the threshold (None: not within max_rounds)."""
    curve: list[float]
    seconds: float


def run_config(
    base: RunConfig, difficulty: str, method: str, seed: int, lr: float, max_rounds: int,
    threshold: float, out: Path,
) -> RunConfig:  # fmt: skip
    overrides: dict[str, Any] = {
        "name": f"{difficulty}-{method}-s{seed}",
        "seed": seed,
        "output_dir": str(out / "runs"),
    }
    cfg = base.model_copy(deep=True, update=overrides)
    cfg.task.kind = "oneshot"
    cfg.task.oneshot_base_success = DIFFICULTIES[difficulty]
    cfg.learner.rounds = max_rounds
    cfg.learner.lr = lr
    cfg.learner.stop_at_success = threshold
    cfg.eval.every = 0
    cfg.metrics.plot = False
    cfg.metrics.progress = False
    if method == "grpo":
        cfg.algo.name = "grpo"
        cfg.learner.updates_per_round = 1
        cfg.learner.first_update_fresh = True
    else:
        cfg.algo.name = "reval"
        cfg.learner.updates_per_round = int(method.split("-")[1])
    return cfg


def oneshot_study(
    out: Path,
    seeds: int = 5,
    lr: float = 1e-3,
    max_rounds: int = 100,
    threshold: float = 0.95,
    difficulties: tuple[str, ...] = tuple(DIFFICULTIES),
    methods: tuple[str, ...] = METHODS,
    config: str | None = None,
    overrides: tuple[str, ...] = (),
) -> dict[str, Any]:
    from services.train import train

    base = load_config(config or str(Path(__file__).resolve().parents[1] / "configs" /
                                     "oneshot.toml"), list(overrides))  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    cells: list[Cell] = []
    for difficulty in difficulties:
        for method in methods:
            for seed in range(seeds):
                cfg = run_config(base, difficulty, method, seed, lr, max_rounds, threshold, out)
                t0 = time.perf_counter()
                result = train(cfg)
                curve = [float(r.get("success_exact", 0.0)) for r in result.history]
                reached = curve[-1] >= threshold
                cells.append(Cell(difficulty, method, seed,
                                  result.history[-1]["round"] if reached else None, curve,
                                  time.perf_counter() - t0))  # fmt: skip
                log.info("%s %s seed %d: %s rounds", difficulty, method, seed,
                         cells[-1].rounds)  # fmt: skip
    report = summarize(cells, methods, difficulties, max_rounds, lr, threshold)
    (out / "oneshot.json").write_text(json.dumps(report, indent=2))
    (out / "oneshot.md").write_text(report["table"])
    plot(cells, methods, difficulties, out / "oneshot.png", threshold)
    return report


def _median(rounds: list[int | None], cap: int) -> float:
    """Median rounds, a run that never got there counted as beyond the cap (cap + 1)."""
    return float(statistics.median([r if r is not None else cap + 1 for r in rounds]))


def summarize(
    cells: list[Cell], methods: tuple[str, ...], difficulties: tuple[str, ...], cap: int,
    lr: float, threshold: float,
) -> dict[str, Any]:  # fmt: skip
    medians: dict[str, dict[str, float]] = {}
    for d in difficulties:
        medians[d] = {
            m: _median([c.rounds for c in cells if c.difficulty == d and c.method == m], cap)
            for m in methods
        }
    ratios = {}
    if "grpo" in methods and "reval-8" in methods:
        ratios = {d: medians[d]["grpo"] / medians[d]["reval-8"] for d in difficulties}
    lines = [f"Median generation rounds to exact success >= {threshold} (lr {lr:g} for every "
             f"method; > {cap} = not reached)\n",
             "| difficulty | " + " | ".join(methods) + " | GRPO / ReVal-8 |",
             "|---|" + "---|" * (len(methods) + 1)]  # fmt: skip
    for d in difficulties:
        vals = " | ".join(f"{medians[d][m]:g}" for m in methods)
        ratio = f"{ratios[d]:.2f}" if d in ratios else "-"
        lines.append(f"| {d} ({DIFFICULTIES[d]:.2f}) | {vals} | {ratio} |")
    avg = statistics.mean(ratios.values()) if ratios else None
    if avg is not None:
        lines.append(f"\nGRPO / ReVal-8 averaged over the difficulties: {avg:.2f} "
                     "(the paper: 3.6 / 4.1 / 5.2, average 4.3)")  # fmt: skip
    return {
        "threshold": threshold,
        "lr": lr,
        "max_rounds": cap,
        "medians": medians,
        "ratios": ratios,
        "ratio_average": avg,
        "cells": [c.__dict__ for c in cells],
        "table": "\n".join(lines) + "\n",
    }


def plot(cells: list[Cell], methods: tuple[str, ...], difficulties: tuple[str, ...],
         path: Path, threshold: float) -> None:  # fmt: skip
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(difficulties), figsize=(4.5 * len(difficulties), 3.6),
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
            ax.plot(range(n), mean, label=m)
        ax.axhline(threshold, color="grey", ls="--", lw=0.8)
        ax.set_title(f"{d} (base {DIFFICULTIES[d]:.2f})")
        ax.set_xlabel("generation round")
    axes[0][0].set_ylabel("success rate (exact)")
    axes[0][-1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
