"""The ``wandb`` tracker (``metrics.trackers``, ``metrics.wandb``; ``reval/trackers.py``): a
Weights & Biases run with the resolved config and every row at its step, the policy version;
an evaluation's answers as a ``wandb.Table``, the curve as a ``wandb.Image``, the final summary
in the run's summary.

The key is W&B's own business: ``WANDB_API_KEY`` from the environment (or ``wandb login``),
never in the config, so nothing secret reaches the run directory. The W&B run's files go under
``{run_dir}/wandb``; its id is kept in ``{run_dir}/trackers.json`` (``RunIds``), and a resumed
run continues that W&B run (``resume="allow"``: made anew if the server lost it). W&B's own
console capture and system statistics are off: the rows are what reval logs, and the training
output stays the process's own.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from reval.config import RunConfig
    from reval.tracker_common import RunIds, Table


TIMEOUT_S = 30.0
"""How long W&B may take to start its run, and to finish it at close."""


class WandbTracker:
    """One W&B run (``wandb.init`` here: the library is imported only when named)."""

    name = "wandb"

    def __init__(self, cfg: RunConfig, run_dir: Path, ids: RunIds) -> None:
        import wandb

        w = cfg.metrics.wandb
        run_id = ids.get(self.name) or secrets.token_hex(4)  # (W&B's own id shape: [a-z0-9]{8})
        ids.keep(self.name, run_id)  # (before the start: a run killed while starting resumes it)
        self.run = wandb.init(
            project=w.project or os.environ.get("WANDB_PROJECT") or cfg.name,
            entity=w.entity,
            name=w.run_name or cfg.name,
            tags=w.tags or None,
            mode=w.mode,
            dir=str(run_dir),
            id=run_id,
            resume="allow",
            settings=wandb.Settings(
                console="off",
                x_disable_stats=True,
                silent=True,
                init_timeout=TIMEOUT_S,  # (no network: W&B's 90 s default held the start)
                finish_timeout=TIMEOUT_S,  # (0, W&B's default, waits for the upload forever)
                reinit="create_new",  # (a second run in one process is its own, not the last)
            ),
        )

    def log_config(self, config: Mapping[str, Any]) -> None:
        """The config as W&B's (nested sections stay nested); a resumed run's changes (more
        rounds, say) replace the values."""
        self.run.config.update(dict(config), allow_val_change=True)  # type: ignore[no-untyped-call]

    def log_row(self, step: int, row: Mapping[str, float]) -> None:
        self.run.log(dict(row), step=step)

    def log_table(self, name: str, step: int, table: Table) -> None:
        """A ``wandb.Table`` at ``step`` (beside that step's row)."""
        import wandb

        data = [list(r) for r in table.rows]
        self.run.log({name: wandb.Table(columns=list(table.columns), data=data)}, step=step)

    def log_image(self, name: str, path: Path) -> None:
        """A ``wandb.Image`` of the file, at the run's last step."""
        import wandb

        self.run.log({name: wandb.Image(str(path))})

    def log_summary(self, summary: Mapping[str, Any]) -> None:
        """Into the run's summary (W&B's table of runs shows it)."""
        self.run.summary.update(dict(summary))

    def close(self) -> None:
        self.run.finish()
