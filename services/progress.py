"""The progress bar of ``reval train``."""

from __future__ import annotations

from typing import Any

from tqdm import tqdm

from reval.config import RunConfig
from services.train import Prepared, TrainResult, train


def run_with_progress(cfg: RunConfig, prepared: Prepared | None = None) -> TrainResult:
    """``train`` (of the run ``prepare`` built, when given) with a bar unless
    ``metrics.progress`` is off."""
    if not cfg.metrics.progress:
        return train(cfg, prepared=prepared)
    bar = tqdm(total=cfg.learner.rounds, desc=cfg.name, unit="round", dynamic_ncols=True)
    last_eval = [float("nan")]

    def on_round(rec: dict[str, Any]) -> None:
        if rec.get("eval_success") is not None:
            last_eval[0] = rec["eval_success"]
        if rec["round"] == 0:
            bar.set_postfix(success=f"{last_eval[0]:.2f}")
            return
        bar.update(1)
        bar.set_postfix(
            success=f"{last_eval[0]:.2f}",
            reward=f"{rec.get('reward_mean', 0):.2f}",
            loss=f"{rec.get('loss', 0):.3g}",
        )

    try:
        return train(cfg, progress=on_round, prepared=prepared)
    finally:
        bar.close()
