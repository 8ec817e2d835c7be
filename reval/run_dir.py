"""The layout of a run's directory (``output_dir/name``): every file a run writes, named once.

``RunConfig.paths`` gives a run's; docs/architecture.md §6 lists who writes what. Torch-free, so
the REST API and the CLI read it without importing the learner.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

LATEST = "latest"
"""The file in a checkpoints directory that names its newest complete checkpoint."""


def latest_in(checkpoints: Path) -> Path | None:
    """The newest complete checkpoint under ``checkpoints`` (the one its ``latest`` file
    names), or None when there is none."""
    latest = checkpoints / LATEST
    if not latest.is_file():
        return None
    return checkpoints / latest.read_text().strip()


def checkpoint_step(name: str) -> int:
    """The policy version of a checkpoint by its directory's name (``step-00000042``: 42;
    ``learner/checkpoint.py`` names them). ValueError for another name."""
    return int(name.removeprefix("step-"))


@dataclass(frozen=True)
class RunDir:
    """The files of one run."""

    root: Path

    @property
    def config(self) -> Path:
        """The resolved config, secrets redacted (``reval train``, ``reval learner`` rank 0)."""
        return self.root / "config.json"

    @property
    def request_config(self) -> Path:
        """The config the REST API received for a run it launches."""
        return self.root / "config.request.json"

    @property
    def launch_log(self) -> Path:
        """The output of a ``reval launch`` the REST API started."""
        return self.root / "launch.log"

    @property
    def checkpoints(self) -> Path:
        """``step-XXXXXXXX/`` checkpoints and the ``latest`` file (``learner/checkpoint.py``)."""
        return self.root / "checkpoints"

    def latest_checkpoint(self) -> Path | None:
        """The newest complete checkpoint, None before the first."""
        return latest_in(self.checkpoints)

    def has_checkpoint(self) -> bool:
        """Whether a complete checkpoint is there to resume from."""
        return (self.checkpoints / LATEST).is_file()

    @property
    def weights(self) -> Path:
        """The announced weight files, unless ``sync.weights_dir`` puts them elsewhere."""
        return self.root / "weights"

    @property
    def spool(self) -> Path:
        """A rollout worker's unsent records, kept when it stopped with Redis away or the ring
        corrupt (one ``<time>-<n>.spool`` file per chunk); the next worker started on this run
        directory sends them first (``buffer/redis_producer.py``)."""
        return self.root / "spool"

    def learner_stopped(self, parent: int) -> Path:
        """``.learner-<parent>.stopped``: rank 0 of the ranks that ``reval learner`` (pid
        ``parent``) spawned writes it when it stopped the run with its one line (a corrupt ring,
        a taken port), so the other ranks and the parent exit without a traceback of the
        collective its exit broke; the parent deletes it (``learner/ranks.py``)."""
        return self.root / f".learner-{parent}.stopped"

    def export(self, step: int) -> Path:
        """A Hugging Face export asked for at optimizer step ``step``."""
        return self.root / "exports" / f"step-{step:08d}"

    @property
    def final(self) -> Path:
        """The Hugging Face export written when the run finishes."""
        return self.root / "final"

    @property
    def initial(self) -> Path:
        """The pretrained tiny model every learner rank starts from."""
        return self.root / "initial"

    @property
    def metrics(self) -> Path:
        """``reval train``: one JSON line per round."""
        return self.root / "metrics.jsonl"

    @property
    def curve(self) -> Path:
        """``reval train``: the success curve."""
        return self.root / "curve.png"

    @property
    def summary(self) -> Path:
        """``reval train``: the run's summary."""
        return self.root / "summary.json"

    @property
    def learner_log(self) -> Path:
        """``reval learner`` rank 0: one JSON line per update."""
        return self.root / "learner.jsonl"

    @property
    def learner_state(self) -> Path:
        """``reval learner``: the final state, for the parent that spawned the ranks."""
        return self.root / "learner_state.json"

    @property
    def eval_log(self) -> Path:
        """``reval eval --follow``: one JSON line per evaluated checkpoint."""
        return self.root / "eval.jsonl"

    @property
    def eval_summary(self) -> Path:
        """``reval eval``: the scores of one evaluation."""
        return self.root / "eval.json"
