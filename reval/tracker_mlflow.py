"""The ``mlflow`` tracker (``metrics.trackers``, ``metrics.mlflow``; ``reval/trackers.py``): an
MLflow run with the resolved config as parameters (``section.field``) and as the artifact
``config.json``, and every row's fields as metrics at its step, the policy version; an
evaluation's answers as the artifact ``{name}/step-N.json``, the curve as an artifact under
``curve/``, the final summary as ``summary.json``.

It talks through ``MlflowClient`` alone (no fluent ``mlflow.start_run``: no process-wide active
run). The default store is a file store in ``{run_dir}/mlruns`` (MLflow 3 keeps file stores
behind ``MLFLOW_ALLOW_FILE_STORE``, which this sets for that default; ``mlflow-skinny`` has no
database store); ``mlflow ui --backend-store-uri runs/NAME/mlruns`` shows it. A local database
store (full ``mlflow``: ``sqlite:///runs/mlflow.db``) keeps a new experiment's artifacts beside
the database (``artifact_location``), not in the process's working directory. A server's
credentials come from the environment (``MLFLOW_TRACKING_TOKEN``...), never the config. The
run's id is kept in ``{run_dir}/trackers.json`` (``RunIds``): a resumed run continues it.

MLflow's client is synchronous (a server's request is retried for minutes when it is away), so
every call to it is made from a thread of the tracker's own: opening the run, the config and
the rows (``log_config`` and ``log_row`` only queue them, off the update's path), the run's end;
what that thread meets (the server away, the disk full) is raised by the next ``log_row``,
where the fan-out logs it, and a row that finds ``QUEUE_ROWS`` items still waiting is dropped
the same way. Names MLflow refuses (``reward/acc@1``) are logged with ``_`` for the rest.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlparse

from reval.tracker_common import flat

if TYPE_CHECKING:
    from reval.config import RunConfig
    from reval.tracker_common import RunIds, Table

PARAMS_PER_CALL = 100
"""``log_batch`` takes at most 100 parameters a call (MLflow's limit)."""
PARAM_CHARS = 6000
"""A parameter's value is cut to this many characters (MLflow's limit)."""
QUEUE_ROWS = 1000
"""Rows waiting for the sending thread at most (a server away for long: later rows dropped)."""
CLOSE_S = 30.0
"""How long ``close`` waits for the queued rows to be sent."""


def local_store(uri: str) -> str | None:
    """The local path an MLflow tracking URI writes to (a plain path, ``file:``,
    ``sqlite:///``), else None (a server: ``http(s)``, ``databricks``, a database)."""
    parsed = urlparse(uri)
    if parsed.scheme.startswith("sqlite"):  # (sqlite+pysqlite: too: MLflow's local database)
        return uri.split("///", 1)[1].split("?", 1)[0] if "///" in uri else ""
    if parsed.scheme == "file":
        return unquote(parsed.path)
    if parsed.scheme == "" or (len(parsed.scheme) == 1 and uri[1:2] == ":"):  # (C:\...)
        return uri
    return None


def artifact_location(uri: str, experiment: str) -> str | None:
    """Where a new experiment of a local database store (``sqlite:///runs/mlflow.db``) keeps
    its artifacts: ``mlartifacts/{experiment}`` beside the database (MLflow's own default is
    ``./mlruns`` under the process's working directory, outside the run's ``output_dir``).
    None for a file store (artifacts inside it) and a server (its own artifact root)."""
    store = local_store(uri)
    if not store or not urlparse(uri).scheme.startswith("sqlite"):
        return None
    return (
        Path(store).resolve().parent / "mlartifacts" / _key(experiment).replace("/", "_")
    ).as_uri()


def _key(name: str) -> str:
    """A metric or parameter name MLflow takes (letters, digits, ``_ - . / : `` and spaces; a
    custom reward's ``reward/acc@1`` would make MLflow refuse the whole row)."""
    return re.sub(r"[^/\w.\- :]", "_", name)


class MlflowTracker:
    """One MLflow run, made or (resumed) continued at start and terminated at close; every
    call to the server from the tracker's own thread (a server away costs training nothing:
    MLflow's client retries for minutes)."""

    name = "mlflow"

    def __init__(self, cfg: RunConfig, run_dir: Path, ids: RunIds) -> None:
        from mlflow.tracking import MlflowClient

        m = cfg.metrics.mlflow
        uri = m.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
        if uri is None:
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            uri = (Path(run_dir) / "mlruns").resolve().as_uri()
        self.uri = uri
        self.client = MlflowClient(tracking_uri=uri)
        self.run_id: str | None = None
        self._open_args = (cfg, ids)
        self._items: queue.Queue[tuple[str, Any] | None] = queue.Queue(maxsize=QUEUE_ROWS)
        self._error: Exception | None = None
        self._sender = threading.Thread(target=self._send, name="reval-mlflow", daemon=True)
        self._sender.start()

    def _open(self) -> str:
        """Continue the run of ``trackers.json`` (a new one if the store has lost it) or make
        one; its id kept."""
        from mlflow.exceptions import MlflowException

        cfg, ids = self._open_args
        m = cfg.metrics.mlflow
        run_id = ids.get(self.name)
        if run_id is not None:
            try:
                self.client.update_run(run_id, status="RUNNING")
            except MlflowException as err:
                if err.error_code != "RESOURCE_DOES_NOT_EXIST":
                    raise  # (a server away: not a reason to split the run in two)
                run_id = None  # (the store lost it: a new run)
        if run_id is None:
            name = m.experiment or cfg.name
            exp = self.client.get_experiment_by_name(name)
            exp_id = (
                exp.experiment_id
                if exp is not None
                else self.client.create_experiment(
                    name, artifact_location=artifact_location(self.uri, name)
                )
            )
            run = self.client.create_run(exp_id, run_name=m.run_name or cfg.name, tags=m.tags)
            run_id = run.info.run_id
            ids.keep(self.name, run_id)
        return str(run_id)

    def _send(self) -> None:
        """The thread: open the run, then send the config and the rows as they come; at the
        end (``None``) mark the run finished."""
        try:
            self.run_id = self._open()
        except Exception as err:
            self._error = err
        while (item := self._items.get()) is not None:
            if self.run_id is None:
                continue  # (the run could not be opened: said once, by the next log_row)
            kind, payload = item
            try:
                if kind == "config":
                    self._config(payload)
                elif kind == "row":
                    self.client.log_batch(self.run_id, metrics=payload)
                elif kind == "image":
                    name, path = payload
                    self.client.log_artifact(self.run_id, path, artifact_path=name)
                else:  # ("dict": an artifact's name, its JSON)
                    self.client.log_dict(self.run_id, payload[1], payload[0])
            except Exception as err:
                self._error = err
        if self.run_id is not None:
            try:
                self.client.set_terminated(self.run_id)
            except Exception as err:
                self._error = err

    def _config(self, config: Mapping[str, Any]) -> None:
        from mlflow.entities import Param

        assert self.run_id is not None
        have = self.client.get_run(self.run_id).data.params
        new = [
            Param(_key(key), str(value)[:PARAM_CHARS])
            for key, value in flat(config).items()
            if _key(key) not in have
        ]
        for start in range(0, len(new), PARAMS_PER_CALL):
            self.client.log_batch(self.run_id, params=new[start : start + PARAMS_PER_CALL])
        self.client.log_text(self.run_id, json.dumps(config, indent=2, default=str),
                             "config.json")  # fmt: skip

    def _put(self, item: tuple[str, Any], what: str) -> None:
        try:
            self._items.put_nowait(item)
        except queue.Full:
            raise RuntimeError(
                f"{QUEUE_ROWS} rows still wait for MLflow; {what} is dropped"
            ) from None

    def log_config(self, config: Mapping[str, Any]) -> None:
        """The config's fields as parameters; a resumed run's changed values (MLflow refuses
        to change a parameter) stay as first logged, and ``config.json`` is the latest."""
        self._put(("config", dict(config)), "the config")

    def log_row(self, step: int, row: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self._put(("row", [Metric(_key(k), v, now, step) for k, v in row.items()]),
                  f"the row of step {step}")  # fmt: skip
        error, self._error = self._error, None
        if error is not None:  # (what the thread met since: the fan-out logs it)
            raise error

    def log_table(self, name: str, step: int, table: Table) -> None:
        """The artifact ``{name}/step-{step:08d}.json`` (the rows as column -> value)."""
        self._put(("dict", (f"{_key(name)}/step-{step:08d}.json", table.records())),
                  f"the table {name} of step {step}")  # fmt: skip

    def log_image(self, name: str, path: Path) -> None:
        """The file as an artifact under ``name/``."""
        self._put(("image", (_key(name), str(path))), f"the image {name}")

    def log_summary(self, summary: Mapping[str, Any]) -> None:
        """The artifact ``summary.json``."""
        self._put(("dict", ("summary.json", dict(summary))), "the summary")

    def close(self) -> None:
        """The queued rows sent and the run marked finished, by the thread (``CLOSE_S`` to
        queue the end, ``CLOSE_S`` to wait for it: never longer, whatever the server does)."""
        with contextlib.suppress(queue.Full):
            self._items.put(None, timeout=CLOSE_S)
        self._sender.join(timeout=CLOSE_S)
        if self._error is not None:
            raise self._error
