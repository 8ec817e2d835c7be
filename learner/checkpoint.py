"""The learner's checkpoint, one format for every way of running it: torch distributed checkpoint
(DCP) of the policy, the frozen reference and the optimizer, plus ``reval_state.json`` (step,
updates, reference version, ...). A sharded learner saves and loads its shards in parallel; a
one-process run (``reval train``) writes the same layout without a process group.

``{run_dir}/checkpoints/step-{step:08d}/`` with ``latest`` naming the newest. A consolidated
Hugging Face checkpoint (what ``from_pretrained`` and vLLM load) is an export, not a checkpoint.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.optim import Optimizer

STATE_FILE = "reval_state.json"


def _state_dict(model: nn.Module, reference: nn.Module, optimizer: Optimizer) -> dict[str, Any]:
    return {
        "model": get_model_state_dict(model),
        "reference": get_model_state_dict(reference),
        "optim": get_optimizer_state_dict(model, optimizer),
    }


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def save_checkpoint(
    ckpt_dir: Path,
    model: nn.Module,
    reference: nn.Module,
    optimizer: Optimizer,
    meta: dict[str, Any],
) -> Path:
    """Save step ``meta["step"]``; every rank calls it. Returns the checkpoint's directory."""
    path = ckpt_dir / f"step-{int(meta['step']):08d}"
    sd = _state_dict(model, reference, optimizer)
    dcp.save(sd, checkpoint_id=str(path), no_dist=not _distributed())
    if not _distributed() or dist.get_rank() == 0:
        (path / STATE_FILE).write_text(json.dumps({**meta, "time": time.time()}))
        (ckpt_dir / "latest").write_text(path.name)
    if _distributed():
        dist.barrier()
    return path


def latest_checkpoint(ckpt_dir: Path) -> Path | None:
    latest = ckpt_dir / "latest"
    if not latest.is_file():
        return None
    return ckpt_dir / latest.read_text().strip()


def load_checkpoint(
    ckpt_dir: Path, model: nn.Module, reference: nn.Module, optimizer: Optimizer
) -> tuple[Path, dict[str, Any]]:
    """Load the latest checkpoint into the (sharded) modules and optimizer; returns its path and
    its ``reval_state.json``. FileNotFoundError when there is none."""
    path = latest_checkpoint(ckpt_dir)
    if path is None:
        raise FileNotFoundError(f"no checkpoint under {ckpt_dir}")
    sd = _state_dict(model, reference, optimizer)
    dcp.load(sd, checkpoint_id=str(path), no_dist=not _distributed())
    set_model_state_dict(model, sd["model"])
    set_model_state_dict(reference, sd["reference"])
    set_optimizer_state_dict(model, optimizer, sd["optim"])
    return path, json.loads((path / STATE_FILE).read_text())
