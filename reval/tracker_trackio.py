"""The ``trackio`` tracker (``metrics.trackers``, ``metrics.trackio``; ``reval/trackers.py``): a
Trackio run with the resolved config and every row at its step, the policy version; an
evaluation's answers as a ``trackio.Table``, the curve as a ``trackio.Image``, the final
summary as a table (``summary``).

Trackio keeps its projects in its own local store (``TRACKIO_DIR``, default
``~/.cache/huggingface/trackio``, where ``trackio show`` looks), or a Hugging Face Space
(``metrics.trackio.space_id``; the token from ``HF_TOKEN`` or ``hf auth login``, never the
config). A run is known by its name: the name is kept in ``{run_dir}/trackers.json``
(``RunIds``) and a resumed run continues the latest run of that name; a fresh start makes a new
run (Trackio allows two of one name). The run starts at ``log_config`` (Trackio takes the config
at ``init``); Trackio's own CPU and GPU sampling is off, and what it prints goes to this
module's log at debug level. Trackio renames the fields it reserves (``step``, ``time``...) to
``__step`` and so on: done here, so that it does not warn on every row.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from reval.config import RunConfig
    from reval.tracker_common import RunIds, Table

log = logging.getLogger("reval.trackers")

RESERVED = ("project", "run", "timestamp", "step", "time", "metrics")
"""Field names Trackio keeps for itself (``trackio.utils.RESERVED_KEYS``): logged as ``__name``."""


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Trackio's prints (where the dashboard is, "run finished") to the debug log."""
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            yield
    finally:
        if out.getvalue().strip():
            log.debug("trackio: %s", out.getvalue().strip())


class TrackioTracker:
    """One Trackio run (``trackio.init`` at ``log_config``: the library is imported only when
    named)."""

    name = "trackio"

    def __init__(self, cfg: RunConfig, run_dir: Path, ids: RunIds) -> None:
        t = cfg.metrics.trackio
        self.project = t.project or cfg.name
        kept = ids.get(self.name)
        self.run_name = kept or t.run_name or cfg.name
        self.resume = "allow" if kept else "never"
        self.space_id = t.space_id
        ids.keep(self.name, self.run_name)
        self.run: Any = None

    def _start(self, config: Mapping[str, Any] | None) -> Any:
        import trackio

        with _quiet():
            self.run = trackio.init(
                project=self.project, name=self.run_name, space_id=self.space_id,
                config=dict(config) if config is not None else None, resume=self.resume,
                embed=False, auto_log_cpu=False, auto_log_gpu=False,
            )  # fmt: skip
        return self.run

    def log_config(self, config: Mapping[str, Any]) -> None:
        if self.run is None:
            self._start(config)

    def log_row(self, step: int, row: Mapping[str, float]) -> None:
        run = self.run if self.run is not None else self._start(None)
        run.log({f"__{k}" if k in RESERVED else k: v for k, v in row.items()}, step=step)

    def log_table(self, name: str, step: int, table: Table) -> None:
        """A ``trackio.Table`` at ``step``."""
        import trackio

        run = self.run if self.run is not None else self._start(None)
        data = [list(r) for r in table.rows]
        run.log({name: trackio.Table(columns=list(table.columns), data=data)}, step=step)

    def log_image(self, name: str, path: Path) -> None:
        """A ``trackio.Image`` of the file."""
        import trackio

        run = self.run if self.run is not None else self._start(None)
        run.log({name: trackio.Image(str(path))})

    def log_summary(self, summary: Mapping[str, Any]) -> None:
        """A table of its fields (``summary``: field, value; Trackio keeps no run summary)."""
        import trackio

        run = self.run if self.run is not None else self._start(None)
        data = [[k, json.dumps(v) if isinstance(v, (list, dict)) else v]
                for k, v in summary.items()]  # fmt: skip
        run.log({"summary": trackio.Table(columns=["field", "value"], data=data)})

    def close(self) -> None:
        if self.run is not None:
            with _quiet():
                self.run.finish()
            self.run = None
