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
    ax2.set_yscale("log")
    ax2.set_ylabel("loss")
    ax2.set_xlabel("round")
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return Path(path)
