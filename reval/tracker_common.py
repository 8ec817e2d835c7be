"""What the experiment trackers (``reval/trackers.py``, ``reval/tracker_wandb.py``,
``reval/tracker_mlflow.py``) share: ``RunIds``, the ids of a run's tracker runs kept in the run
directory (a resumed run continues them), ``flat``, a nested config as ``section.field``
hyperparameters, and ``Table``, the rows a tracker logs as a table (an evaluation's answers)."""

from __future__ import annotations

import html
import json
import logging
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("reval.trackers")

IDS_FILE = "trackers.json"
"""The tracker runs' ids, in the run directory (``RunIds``)."""


class RunIds:
    """The ids of a run's tracker runs, ``{run_dir}/trackers.json`` (``{"wandb": "1x2y3z"}``):
    read when the run resumes, so that its trackers continue their runs; a fresh start drops
    them (the file goes). Written at once when a tracker keeps an id (a crash keeps it too)."""

    def __init__(self, run_dir: Path, resume: bool, role: str = "") -> None:
        """``role``: ``eval`` for ``reval eval --follow``'s runs (``trackers-eval.json``)."""
        self.path = Path(run_dir) / (f"trackers-{role}.json" if role else IDS_FILE)
        self.role = role
        self.resume = resume
        """Whether the run continues (its trackers continue their runs)."""
        self.ids: dict[str, str] = {}
        if not resume:
            self.path.unlink(missing_ok=True)
        elif self.path.is_file():
            try:
                loaded = json.loads(self.path.read_text(encoding="utf-8"))
            except ValueError as err:
                log.warning("%s unreadable (%s): the trackers start new runs", self.path, err)
            else:
                self.ids = {str(k): str(v) for k, v in loaded.items()}

    def get(self, name: str) -> str | None:
        """The id of tracker ``name``'s run to continue (None: start a new one)."""
        return self.ids.get(name)

    def keep(self, name: str, run_id: str) -> None:
        self.ids[name] = run_id
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.ids, indent=2) + "\n", encoding="utf-8")
        os.replace(tmp, self.path)


def flat(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested config as ``section.field`` hyperparameters: numbers, text and booleans as
    they are, anything else (None, lists) as its JSON text."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, Mapping):
            out.update(flat(value, f"{prefix}{key}."))
        elif isinstance(value, (bool, int, float, str)):
            out[f"{prefix}{key}"] = value
        else:
            out[f"{prefix}{key}"] = json.dumps(value, default=str)
    return out


@dataclass(frozen=True)
class Table:
    """Rows of values under ``columns`` (an evaluation's: prompt, answer, score)."""

    columns: tuple[str, ...]
    rows: tuple[tuple[str | float, ...], ...]

    def markdown(self) -> str:
        """The table in Markdown (TensorBoard's text). A cell is model output: its HTML and its
        Markdown punctuation are escaped (shown, never rendered: no image a viewer's browser
        fetches); a line break (``\\n``, ``\\r``) is ``<br>``."""

        def cell(v: str | float) -> str:
            text = html.escape(str(v).replace("\r\n", "\n").replace("\r", "\n"), quote=False)
            text = re.sub(r"([\\`*_{}\[\]()#+!|~-])", r"\\\1", text)  # (Markdown: shown)
            return text.replace("\n", "<br>")

        head = "| " + " | ".join(self.columns) + " |"
        rule = "|" + "---|" * len(self.columns)
        return "\n".join([head, rule, *("| " + " | ".join(map(cell, r)) + " |" for r in self.rows)])

    def records(self) -> list[dict[str, str | float]]:
        """The rows as column -> value mappings (a JSON file's)."""
        return [dict(zip(self.columns, r, strict=True)) for r in self.rows]
