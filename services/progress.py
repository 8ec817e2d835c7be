"""The progress bar of ``reval train``, and its rounds' times for the thread tuner."""

from __future__ import annotations

from typing import Any

from tqdm import tqdm

from reval.config import RunConfig
from reval.threads import tick
from services.stop import StopSignals
from services.train import Prepared, TrainResult, train


def run_with_progress(
    cfg: RunConfig,
    prepared: Prepared | None = None,
    resume: bool = False,
    signals: StopSignals | None = None,
) -> TrainResult:
    """``train`` (of the run ``prepare`` built, when given; ``resume`` and ``signals`` as
    ``train`` takes them) with a bar unless ``metrics.progress`` is off; each round's time
    goes to the thread tuner (``reval.threads.tick``). The bar starts with
    the first record (the warm-start evaluation's, or a resumed run's first round), so the
    set-up's lines before it are not broken by it."""
    bars: list[Any] = []
    last_eval = [float("nan")]

    def on_round(rec: dict[str, Any]) -> None:
        if "round_s" in rec:  # (the thread tuner, reval/threads.py: a round is its unit)
            tick(rec["round_s"], "round")
        if not cfg.metrics.progress:
            return
        if not bars:
            done = max(rec["round"] - 1, 0)
            bars.append(tqdm(total=cfg.learner.rounds, initial=done, desc=cfg.name,
                             unit="round", dynamic_ncols=True))  # fmt: skip
        bar = bars[0]
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
        return train(cfg, progress=on_round, prepared=prepared, resume=resume, signals=signals)
    finally:
        for bar in bars:
            bar.close()
