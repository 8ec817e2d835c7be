"""The learning-curve PNG of a run: success rate (eval and training samples) and loss by round."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def plot_curve(history: Sequence[dict[str, Any]], path: str | Path, title: str = "") -> Path:
    rounds = [h["round"] for h in history if h.get("reward_mean") is not None]
    reward = [h["reward_mean"] for h in history if h.get("reward_mean") is not None]
    loss = [h["loss"] for h in history if h.get("loss") is not None]
    ev = [(h["round"], h["eval_success"]) for h in history if h.get("eval_success") is not None]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    ax1.plot(rounds, reward, color="tab:blue", alpha=0.5, label="success, training samples")
    if ev:
        ax1.plot(
            *zip(*ev, strict=True), "o-", color="tab:green", label="success, all prompts (eval)"
        )
    ax1.set_ylim(-0.02, 1.02)
    ax1.set_ylabel("success rate")
    ax1.grid(alpha=0.3)
    ax1.set_title(title)
    ax2.plot(rounds[: len(loss)], loss, color="tab:red")
    resets = [
        b["round"]
        for a, b in pairwise(history)
        if b.get("ref_version", 0) != a.get("ref_version", 0)
    ]
    for i, r in enumerate(resets):
        for ax in (ax1, ax2):
            ax.axvline(
                r,
                color="gray",
                ls="--",
                lw=0.8,
                label="reference reset" if ax is ax1 and i == 0 else None,
            )
    ax1.legend(loc="lower right")
    # Log scale for the value losses (a square, > 0); GRPO's surrogate and an all-zero start
    # (every reward 0, theta = ref) are not positive, and a log axis would warn and hide them.
    ax2.set_yscale("log" if loss and all(v > 0 for v in loss) else "symlog")
    ax2.set_ylabel("loss")
    ax2.set_xlabel("round")
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return Path(path)


def plot_peers(runs: Sequence[dict[str, Any]], threshold: float, path: str | Path) -> Path:
    """benchmarks/peer_bench.py's figure: evaluated success against trajectories generated and
    against training seconds (evaluations excluded), one colour per variant, one line per seed."""
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    variants = list(dict.fromkeys(r["variant"] for r in runs))
    for i, variant in enumerate(variants):
        for k, run in enumerate(r for r in runs if r["variant"] == variant):
            ev = [p for p in run["curve"] if "eval_success" in p]
            label = variant if k == 0 else None
            ys = [p["eval_success"] for p in ev]
            a1.plot([p["trajectories"] for p in ev], ys, color=f"C{i}", alpha=0.8, label=label)
            a2.plot([p["train_s"] for p in ev], ys, color=f"C{i}", alpha=0.8, label=label)
    for ax, xlabel in ((a1, "trajectories generated"), (a2, "training seconds (no evaluation)")):
        ax.axhline(threshold, color="gray", ls="--", lw=0.8)
        ax.set_ylim(-0.02, 1.02)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("success, all prompts (eval)")
        ax.grid(alpha=0.3)
    a1.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return Path(path)
