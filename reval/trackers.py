"""Experiment trackers: the rows of ``metrics.jsonl`` (``reval train``) and ``learner.jsonl``
(the learner's rank 0) also sent where users watch their runs (issue 42): TensorBoard (here),
W&B (``reval/tracker_wandb.py``), MLflow (``reval/tracker_mlflow.py``) and Trackio
(``reval/tracker_trackio.py``).

``Tracker`` is the seam: ``log_config`` (the resolved config, once), ``log_row`` (a row's
numeric fields at its step, the policy version), ``close``. ``build_trackers`` makes the
configured ones (``metrics.trackers``) behind ``Trackers``, a fan-out that never raises into
training: a tracker's failure (a full disk, a bad key) is logged on one line, then at most once
a minute per tracker (``reval/ratelog.py``), and the run goes on. A tracker's library is
imported only when it is named; one named but not installed is refused at config load with
its install line (``reval/config/launch.py``: ``check_trackers``).

A tracker that keeps a run of its own (W&B, MLflow, Trackio) keeps that run's id in
``{run_dir}/trackers.json`` (``RunIds``): a resumed run continues the same tracker run, a
fresh start begins new ones.
"""

from __future__ import annotations

import json
import logging
import math
import struct
import subprocess
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from reval.config.launch import require_installed
from reval.ratelog import RateLog
from reval.run_dir import checkpoint_step, latest_in
from reval.tracker_common import RunIds, Table, flat

if TYPE_CHECKING:
    from reval.config import RunConfig

log = logging.getLogger("reval.trackers")

FLUSH_S = 10
"""TensorBoard's writer flushes its event file at least this often (its default is 120 s:
a live ``tensorboard --logdir`` would lag two minutes behind the run)."""


EVAL_TABLE = "eval/answers"
"""The name of an evaluation's table of answers (``Table``; ``reval eval --follow``'s:
``eval/answers/BENCHMARK``)."""
ANSWER_COLUMNS = ("prompt", "answer", "score")
"""The columns of a table of answers (each prompt's first; ``metrics.tracker_answers``)."""
CURVE = "curve"
"""The name of the learning curve's image."""


class Tracker(Protocol):
    """One experiment tracker."""

    name: str

    def log_config(self, config: Mapping[str, Any]) -> None:
        """The run's resolved config (``public_dump``: secrets redacted), once at the start."""

    def log_row(self, step: int, row: Mapping[str, float]) -> None:
        """One row's numeric fields, under their own names, at ``step`` (the policy version)."""

    def log_table(self, name: str, step: int, table: Table) -> None:
        """A table at ``step``: an evaluation's answers (``EVAL_TABLE``), one row an answer."""

    def log_image(self, name: str, path: Path) -> None:
        """A PNG file under ``name``: the learning curve (``curve.png``) at the run's end."""

    def log_summary(self, summary: Mapping[str, Any]) -> None:
        """The run's final summary (``summary.json``'s fields; the learner's final state), at
        the end."""

    def close(self) -> None:
        """Write out what is held and release the tracker's files or connections."""


class TensorBoardTracker:
    """TensorBoard event files (``torch.utils.tensorboard.SummaryWriter``, which writes from a
    thread of its own): the config as text (tag ``config``) and as hyperparameters, every
    numeric field of a row as a scalar of the same name at the row's step."""

    name = "tensorboard"

    def __init__(self, log_dir: str | Path, purge_step: int | None = None) -> None:
        """``purge_step``: a resumed run's first step; what its log directory holds at that
        step or later (a crashed run's rows past its checkpoint) is hidden from TensorBoard."""
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(log_dir), flush_secs=FLUSH_S,
                                    purge_step=purge_step)  # fmt: skip

    def log_config(self, config: Mapping[str, Any]) -> None:
        from torch.utils.tensorboard.summary import hparams

        text = json.dumps(config, indent=2, default=str)
        # (indented four spaces: a code block in TensorBoard's markdown)
        self.writer.add_text("config", "\n".join("    " + ln for ln in text.splitlines()), 0)
        exp, ssi, sei = hparams(flat(config), {})  # type: ignore[no-untyped-call]
        file_writer = self.writer.file_writer
        assert file_writer is not None  # (made by SummaryWriter's __init__)
        for summary in (exp, ssi, sei):
            file_writer.add_summary(summary)

    def log_row(self, step: int, row: Mapping[str, float]) -> None:
        """One event holding every field (``add_scalar`` per field cost 13x the CPU: 2.1 ms a
        row of the demo's 31 fields against 0.16 ms; ``benchmarks/tracker_bench.py``)."""
        from tensorboard.compat.proto.summary_pb2 import Summary

        values = [Summary.Value(tag=k, simple_value=float(v)) for k, v in row.items()]
        file_writer = self.writer.file_writer
        assert file_writer is not None
        file_writer.add_summary(Summary(value=values), step)

    def log_table(self, name: str, step: int, table: Table) -> None:
        """As Markdown text (TensorBoard's Text tab)."""
        self.writer.add_text(name, table.markdown(), step)

    def log_image(self, name: str, path: Path) -> None:
        """The PNG as it is (TensorBoard's Images tab), at step 0."""
        from tensorboard.compat.proto.summary_pb2 import Summary

        data = Path(path).read_bytes()
        width, height = png_size(data)
        image = Summary.Image(height=height, width=width, colorspace=4, encoded_image_string=data)
        file_writer = self.writer.file_writer
        assert file_writer is not None
        file_writer.add_summary(Summary(value=[Summary.Value(tag=name, image=image)]), 0)

    def log_summary(self, summary: Mapping[str, Any]) -> None:
        """As JSON text (tag ``summary``)."""
        self.writer.add_text("summary", "    " + json.dumps(dict(summary), default=str), 0)

    def close(self) -> None:
        self.writer.close()


def png_size(data: bytes) -> tuple[int, int]:
    """A PNG's width and height (its IHDR chunk); ValueError for what is not a PNG."""
    if data[:8] != b"\x89PNG\r\n\x1a\n" or data[12:16] != b"IHDR":
        raise ValueError("not a PNG file")
    width, height = struct.unpack(">II", data[16:24])
    return int(width), int(height)


def numeric(row: Mapping[str, Any]) -> dict[str, float]:
    """A row's fields that a tracker logs: the finite numbers (not booleans; what
    ``metrics.jsonl`` writes as null is left out too)."""
    return {
        k: float(v)
        for k, v in row.items()
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    }


class Trackers:
    """The configured trackers as one (empty: does nothing). No call raises: a tracker's
    failure is logged (one line, then at most one per ``every_s`` per tracker) and the others,
    and training, go on."""

    def __init__(self, trackers: list[Tracker], every_s: float = 60.0) -> None:
        self.trackers = trackers
        self._lines = RateLog(log, every_s)

    def __bool__(self) -> bool:
        return bool(self.trackers)

    def _each(self, what: str, call: Callable[[Tracker], None]) -> None:
        for tracker in self.trackers:
            try:
                call(tracker)
            except Exception as err:
                self._lines.warning(
                    f"tracker:{tracker.name}",
                    "tracker %s failed (%s: %s: %s); training goes on without it",
                    tracker.name, what, type(err).__name__, err,
                )  # fmt: skip

    def log_config(self, config: Mapping[str, Any]) -> None:
        self._each("log_config", lambda t: t.log_config(config))

    def log_row(self, step: int, row: Mapping[str, Any]) -> None:
        """``row``'s finite numeric fields (``numeric``) at ``step``."""
        if self.trackers:
            values = numeric(row)
            self._each("log_row", lambda t: t.log_row(step, values))

    def log_table(self, name: str, step: int, table: Table) -> None:
        if table.rows:
            self._each("log_table", lambda t: t.log_table(name, step, table))

    def log_image(self, name: str, path: Path) -> None:
        if Path(path).is_file():
            self._each("log_image", lambda t: t.log_image(name, path))

    def log_summary(self, summary: Mapping[str, Any]) -> None:
        self._each("log_summary", lambda t: t.log_summary(summary))

    def close(self) -> None:
        self._each("close", lambda t: t.close())


def git_revision() -> str | None:
    """``git rev-parse HEAD`` of the checkout reval runs from (None: an installed package, no
    git, or not a repository)."""
    root = Path(__file__).resolve().parent.parent
    if not (root / ".git").exists():
        return None
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"],
                             capture_output=True, text=True, timeout=10, check=True)  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def _tensorboard(cfg: RunConfig, run_dir: Path, ids: RunIds) -> Tracker:
    """A fresh start begins an empty default directory (``{run_dir}/tensorboard``: the earlier
    run's events go, as its ``metrics.jsonl`` does); a resumed run hides what the stopped one
    logged past its checkpoint (those rounds run again)."""
    default = run_dir / "tensorboard"
    log_dir = Path(cfg.metrics.tensorboard_dir or default)
    if not ids.resume and log_dir == default:  # (its own event files: eval/ is the evaluator's)
        for old in log_dir.glob("events.out.tfevents.*"):
            old.unlink(missing_ok=True)
    # (an evaluator's rows stand whatever the learner does: none hidden)
    latest = latest_in(run_dir / "checkpoints") if ids.resume and not ids.role else None
    purge = checkpoint_step(latest.name) + 1 if latest is not None else None
    return TensorBoardTracker(log_dir, purge_step=purge)


def _wandb(cfg: RunConfig, run_dir: Path, ids: RunIds) -> Tracker:
    from reval.tracker_wandb import WandbTracker

    return WandbTracker(cfg, run_dir, ids)


def _mlflow(cfg: RunConfig, run_dir: Path, ids: RunIds) -> Tracker:
    from reval.tracker_mlflow import MlflowTracker

    return MlflowTracker(cfg, run_dir, ids)


def _trackio(cfg: RunConfig, run_dir: Path, ids: RunIds) -> Tracker:
    from reval.tracker_trackio import TrackioTracker

    return TrackioTracker(cfg, run_dir, ids)


FACTORIES: dict[str, Callable[[RunConfig, Path, RunIds], Tracker]] = {
    "tensorboard": _tensorboard,
    "wandb": _wandb,
    "mlflow": _mlflow,
    "trackio": _trackio,
}
"""How each tracker is made from the run's config, directory and kept ids (tests put theirs
here)."""


def build_trackers(cfg: RunConfig, run_dir: Path, resume: bool = False, role: str = "") -> Trackers:
    """The trackers of ``metrics.trackers``, each given the resolved config (secrets
    redacted) and the git revision (``git_revision``, as ``git_revision``). ``resume``: the
    trackers continue the runs of ``{run_dir}/trackers.json`` (else they start new ones). A
    tracker not installed raises ValueError with its install line (the config's own check,
    again where the run starts); one that fails to start is logged and left out."""
    from reval.config import public_dump

    require_installed(cfg.metrics.trackers)
    ids = RunIds(run_dir, resume, role)
    made: list[Tracker] = []
    for name in cfg.metrics.trackers:
        try:
            made.append(FACTORIES[name](cfg, run_dir, ids))
        except Exception as err:
            log.warning("tracker %s could not start (%s: %s); training goes on without it",
                        name, type(err).__name__, err)  # fmt: skip
    trackers = Trackers(made)
    if trackers:
        trackers.log_config({**public_dump(cfg), "git_revision": git_revision()})
    return trackers


def eval_trackers(cfg: RunConfig) -> Trackers:
    """The trackers of ``reval eval --follow`` beside a run: runs of their own beside the
    learner's (one W&B run takes one writer), named ``{run name}-eval``, in the same project,
    experiment and store: TensorBoard's ``{tensorboard dir}/eval`` (its own line in
    TensorBoard's list of runs), the W&B, MLflow and Trackio runs ``NAME-eval``; their ids kept
    in ``{run_dir}/trackers-eval.json``, so that a restarted evaluator continues them."""
    m = cfg.metrics

    def named(section: Any) -> Any:
        return section.model_copy(update={"run_name": f"{section.run_name or cfg.name}-eval"})

    base = Path(m.tensorboard_dir or cfg.run_dir / "tensorboard")
    metrics = m.model_copy(
        update={"tensorboard_dir": str(base / "eval"), "wandb": named(m.wandb),
                "mlflow": named(m.mlflow), "trackio": named(m.trackio)}
    )  # fmt: skip
    return build_trackers(cfg.model_copy(update={"metrics": metrics}), cfg.run_dir, resume=True,
                          role="eval")  # fmt: skip
