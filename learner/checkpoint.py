"""The learner's checkpoint, one format for every way of running it: torch distributed checkpoint
(DCP) of the policy, the frozen reference and the optimizer, plus ``reval_state.json`` (step,
updates, reference version, ...). A LoRA policy's holds its adapters and the fingerprint of its
base, not the base (``_policy_options``). A sharded learner saves and loads its shards in
parallel; a one-process run (``reval train``) writes the same layout without a process group.

``{run_dir}/checkpoints/step-{step:08d}/`` with ``latest`` naming the newest. A checkpoint is
written as ``step-{step:08d}.partial`` and renamed once complete, so a save cut short (a full or
read-only disk, a kill) never leaves a ``step-*`` directory behind: a failed save removes its
partial directory and raises ``CheckpointWriteError``, one line naming the path and the free
space; partial directories of a killed save go at the next save. With ``keep``, a save then
deletes all but the newest ``keep`` complete checkpoints. A consolidated
Hugging Face checkpoint (what ``from_pretrained`` and vLLM load) is an export, not a checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.optim import Optimizer

from reval import lora
from reval.paths import free_space, last_line
from reval.run_dir import LATEST, latest_in

STATE_FILE = "reval_state.json"
LORA_BASE = "lora_base"
"""A LoRA policy's checkpoint: the fingerprint of the base its adapters were trained on."""
PARTIAL = ".partial"


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (disk full, read-only, gone); nothing of it is left."""


def _state_dict(model: nn.Module, reference: nn.Module, optimizer: Optimizer) -> dict[str, Any]:
    policy = get_model_state_dict(model, options=_policy_options(model))
    if lora.is_lora(model):  # (also not a tied alias of a frozen weight, which the option keeps)
        trained = {n for n, p in model.named_parameters() if p.requires_grad}
        policy = {k: v for k, v in policy.items() if k in trained}
    sd = {
        "model": policy,
        "reference": get_model_state_dict(reference),
        "optim": get_optimizer_state_dict(model, optimizer),
    }
    if lora.is_lora(model):
        sd[LORA_BASE] = base_fingerprint(model)
    return sd


def _policy_options(model: nn.Module) -> StateDictOptions | None:
    """A LoRA policy's checkpoint holds its adapters, not its frozen base (a 7B base is 28 GB
    of fp32 per checkpoint; the adapters megabytes): the base comes back from ``model`` as the
    config builds it, checked against the fingerprint saved beside the adapters."""
    if not lora.is_lora(model):
        return None
    return StateDictOptions(ignore_frozen_params=True, strict=False)


def base_fingerprint(model: nn.Module) -> Tensor:
    """``[sum, sum of squares]`` in float64 of a LoRA policy's frozen parameters (its base),
    over every rank's shard: the same for the same base whatever the world size, up to the
    order of the additions."""
    from torch.distributed.tensor import DTensor

    total: Tensor | None = None
    for p in model.parameters():
        if p.requires_grad:
            continue
        t = (p.to_local() if isinstance(p, DTensor) else p).detach().double()
        part = torch.stack([t.sum(), (t * t).sum()])
        total = part if total is None else total + part
    assert total is not None, "a LoRA policy without frozen parameters"
    if _distributed():
        dist.all_reduce(total)
    return total.cpu()


def _check_base(saved: Tensor, model: nn.Module, path: Path) -> None:
    now = base_fingerprint(model)
    if not torch.allclose(saved, now, rtol=1e-6, atol=0.0):
        raise ValueError(
            f"checkpoint {path} holds LoRA adapters trained on another base than the model this "
            "config builds (model.name_or_path, or the seed of a tiny model, changed): resume "
            "with the run's own model, or start a new run"
        )


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def save_checkpoint(
    ckpt_dir: Path,
    model: nn.Module,
    reference: nn.Module,
    optimizer: Optimizer,
    meta: dict[str, Any],
    keep: int = 0,
) -> Path:
    """Save step ``meta["step"]``; every rank calls it. Returns the checkpoint's directory;
    CheckpointWriteError (on every rank, nothing left on disk) when it cannot be written.
    ``keep``: then delete all but the newest ``keep`` checkpoints (``prune``; 0: none)."""
    path = ckpt_dir / f"step-{int(meta['step']):08d}"
    partial = path.with_name(path.name + PARTIAL)
    lead = not _distributed() or dist.get_rank() == 0
    sd = _state_dict(model, reference, optimizer)
    error: BaseException | None = None
    try:
        if lead:
            ckpt_dir.mkdir(parents=True, exist_ok=True)
            for old in ckpt_dir.glob(f"step-*{PARTIAL}"):  # a killed save's
                shutil.rmtree(old, ignore_errors=True)
        if _distributed():
            dist.barrier()
        dcp.save(sd, checkpoint_id=str(partial), no_dist=not _distributed())
        if lead:
            (partial / STATE_FILE).write_text(json.dumps({**meta, "time": time.time()}))
            if path.exists():  # (the same step again: a learner resumed from before it)
                shutil.rmtree(path)
            os.replace(partial, path)
            latest = ckpt_dir / f"{LATEST}{PARTIAL}"
            latest.write_text(path.name)
            os.replace(latest, ckpt_dir / LATEST)
            prune(ckpt_dir, keep, path)
    except (OSError, RuntimeError, CheckpointException) as err:
        error = err
    if lead and error is not None:
        shutil.rmtree(partial, ignore_errors=True)
    reason = None if error is None else last_line(error)
    if _distributed():  # every rank learns whether rank 0's part (the rename) failed
        box = [reason]
        dist.broadcast_object_list(box, src=0)
        reason = box[0] or reason
        dist.barrier()
    if reason is not None:
        raise CheckpointWriteError(
            f"could not write checkpoint {path} ({free_space(ckpt_dir)}): {reason}"
        ) from None
    return path


def prune(ckpt_dir: Path, keep: int, newest: Path) -> list[Path]:
    """Delete all but the ``keep`` newest complete checkpoints under ``ckpt_dir``, newest by the
    time each was written; ``newest`` (the one just written, which ``latest`` names) always
    stays, even beside later steps of an earlier run. The deleted; none when ``keep`` is 0."""
    if keep < 1:
        return []
    others = [p for p in ckpt_dir.glob("step-*")
              if p.is_dir() and not p.name.endswith(PARTIAL) and p != newest]  # fmt: skip
    others.sort(key=lambda p: p.stat().st_mtime)
    gone = others[: max(0, len(others) - (keep - 1))]
    for old in gone:
        shutil.rmtree(old, ignore_errors=True)
    return gone


latest_checkpoint = latest_in
"""The newest complete checkpoint under a checkpoints directory (``reval/run_dir.py``)."""


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
    if LORA_BASE in sd:
        _check_base(sd[LORA_BASE], model, path)
    got = set_model_state_dict(model, sd["model"], options=_policy_options(model))
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    if missing := sorted(trained & set(got.missing_keys)):  # (only the frozen base may be)
        raise ValueError(f"checkpoint {path} lacks trained parameters: {missing[:3]}")
    set_model_state_dict(reference, sd["reference"])
    set_optimizer_state_dict(model, optimizer, sd["optim"])
    return path, json.loads((path / STATE_FILE).read_text())


class Stateful(Protocol):
    """A part of the learner whose counters a checkpoint keeps (``Learner``, ``UpdateStep``,
    ``BatchSource``): flat, distinct keys, so every part's lands in one ``reval_state.json``."""

    def state_dict(self) -> dict[str, int]: ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...


@dataclass
class Checkpointer:
    """The one checkpointer of both loops (``reval train``, ``reval learner``'s ranks): the
    policy, the reference and AdamW through DCP, and the ``state_dict`` of each part in the
    checkpoint's ``reval_state.json`` (one format: ``step``, ``skipped_steps``, ``ref_version``,
    ``updates``, ``ref_resets``, ``source_drawn``, plus what the caller adds, e.g. ``round``)."""

    ckpt_dir: Path
    model: nn.Module
    reference: nn.Module
    optimizer: Optimizer
    parts: Sequence[Stateful]
    keep: int = 0
    """Keep the newest this many checkpoints (``prune``; 0: every one)."""

    def meta(self, **extra: Any) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for part in self.parts:
            out.update(part.state_dict())
        return {**out, **extra}

    def save(self, **extra: Any) -> Path:
        """A checkpoint now; every rank calls it (``save_checkpoint``)."""
        return save_checkpoint(
            self.ckpt_dir, self.model, self.reference, self.optimizer, self.meta(**extra),
            self.keep,
        )  # fmt: skip

    def load(self) -> tuple[Path, dict[str, Any]]:
        """The latest checkpoint into the modules, the optimizer and every part; its path and
        metadata. FileNotFoundError when there is none."""
        path, meta = load_checkpoint(self.ckpt_dir, self.model, self.reference, self.optimizer)
        for part in self.parts:
            part.load_state_dict(meta)
        return path, meta
