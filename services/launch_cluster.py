"""``reval launch`` on a Ray cluster of several hosts (docs/operations.md, "Many machines"):
``cluster_sync``, the weight transport a cluster needs, and ``failure_line``, what a failed
Ray task raised in one line (the driver's lines about its ranks)."""

from __future__ import annotations

import logging
from typing import Any

from reval.config import RunConfig

log = logging.getLogger("reval.launch")


def failure_line(err: BaseException) -> str:
    """What a failed Ray task raised, in one line: its cause's type and message (a
    ``RayTaskError``'s first line names only the actor and its pid)."""
    cause = getattr(err, "cause", None)
    if isinstance(cause, BaseException):
        return f"{type(cause).__name__}: {cause}".splitlines()[0]
    lines = [ln for ln in str(err).splitlines() if ln.strip()]
    return lines[-1] if lines else type(err).__name__


def cluster_sync(cfg: RunConfig) -> RunConfig:
    """A launch on a cluster (``RAY_ADDRESS``): the weights must reach workers on other nodes,
    so unless the config says otherwise the hub is announced at the learner's node address
    (``sync.broadcast_host = "auto"``: Ray's node IP) and the files are served over HTTP
    (``sync.serve_files``), so that no directory shared by the hosts is required."""
    given = cfg.sync.model_fields_set
    update: dict[str, Any] = {}
    if "broadcast_host" not in given:
        update["broadcast_host"] = "auto"
    if "serve_files" not in given:
        update["serve_files"] = True
    if not update:
        return cfg
    log.info("on a cluster: %s (set them to change it)",
             ", ".join(f"sync.{k}={v}" for k, v in update.items()))  # fmt: skip
    return cfg.model_copy(update={"sync": cfg.sync.model_copy(update=update)})
