"""The learner: one update = the configured loss over B trajectories in micro-batches, AdamW,
grad clip with the pre-clip norm logged, non-finite steps skipped."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from buffer.records import Trajectory
from learner.algorithms import Algorithm, LossInputs, MiniBatch, build_algorithm
from learner.batches import AUTO_PACK_BELOW, layout
from learner.reference import ReferencePolicy
from learner.sequence import (
    can_share_prompts,
    make_batch,
    policy_stats,
    resolve_packing,
    use_varlen_attention,
)
from reval.config import AlgoConfig, LearnerConfig


class UpdateMemoryError(RuntimeError):
    """An update that ran out of memory on its batch, raised by every rank together (they
    agree before the optimizer step, ``Learner.update``): no rank stepped; the batch is to be
    quarantined and training goes on with the next."""


def is_memory_error(err: BaseException) -> bool:
    """A failed allocation: ``torch.OutOfMemoryError`` (CUDA, MPS), a MemoryError, or a
    RuntimeError saying so ("out of memory", the CPU allocator's "can't allocate memory",
    "failed to allocate")."""
    if isinstance(err, (torch.OutOfMemoryError, MemoryError)):
        return True
    text = str(err).lower()
    return isinstance(err, RuntimeError) and any(
        s in text for s in ("out of memory", "can't allocate memory", "failed to allocate")
    )


@dataclass
class UpdateResult:
    metrics: dict[str, float]
    delta: torch.Tensor
    """[B] per-trajectory residual (priorities for prioritized replay)."""
    skipped: bool = False


@dataclass
class Learner:
    model: nn.Module
    learner_cfg: LearnerConfig
    algo: AlgoConfig
    pad_id: int
    eos_id: int
    device: torch.device
    step: int = 0
    """Optimizer steps taken (skipped ones excluded)."""
    skipped_steps: int = 0
    reference_model: nn.Module | None = None
    """A ready reference copy (the learner service passes an FSDP-sharded one)."""
    reduce: Callable[[float, str], float] | None = None
    """Distributed learner: ``reduce(x, "sum" | "max")`` over the ranks (GRPO's token count, the
    reference's micro-batch count). None in one process. Each rank updates on an equal share of
    the batch; FSDP averages the gradients over ranks, so the value losses' per-share mean is the
    batch mean, and GRPO's token mean divides by the batch's tokens over the world size."""
    compute_dtype: torch.dtype = torch.float32
    """``model.dtype``: the forward and backward run in it (``compute_context``); the
    parameters and AdamW's state stay in their own dtype (fp32 masters)."""
    packed: bool = field(init=False)
    """Whether micro-batches may be packed (``learner.packing`` resolved against the model)."""
    auto_pack: float | None = field(init=False)
    """``learner.packing = "auto"``: each share packed only when its padded micro-batches
    would compute less than this share of useful tokens (``batches.AUTO_PACK_BELOW``)."""
    share_prompts: bool = field(init=False)
    """Whether each distinct prefix of a micro-batch is computed once (``sequence.share_prompts``:
    a CPU learner whose model can pack)."""
    reference: ReferencePolicy = field(init=False)
    optimizer: torch.optim.Optimizer = field(init=False)
    algorithm: Algorithm = field(init=False)
    """``algo.name``'s loss (``learner/algorithms``: built-in, or the user's by import path)."""
    old_logp: dict[str, np.ndarray] = field(init=False, default_factory=dict)
    """GRPO: per-token log-probs of the policy before a round's first update, by ``traj_id``
    (``remember_old_logp``); the ratio of a later update of the round is taken against them."""

    def __post_init__(self) -> None:
        self.algorithm = build_algorithm(self.algo)
        if bool(self.algorithm.on_policy) != self.algo.on_policy:
            its = "on" if self.algorithm.on_policy else "off"
            raise ValueError(f"algo.name={self.algo.name} is {its}-policy, but algo.policy says "
                             f"{self.algo.policy}")  # fmt: skip
        self.model.train()
        self.packed = resolve_packing(self.learner_cfg.packing, self.model)
        auto = self.learner_cfg.packing == "auto"
        below = AUTO_PACK_BELOW["cuda" if self.device.type == "cuda" else "cpu"]
        self.auto_pack = below if auto else None
        if self.packed:
            use_varlen_attention(self.model)
        self.share_prompts = self.packed and can_share_prompts(self.model, self.device)
        sync = None
        if self.reduce is not None:
            reduce = self.reduce

            def sync(n: int) -> int:
                return int(reduce(float(n), "max"))

        self.reference = ReferencePolicy(
            self.model,
            self.pad_id,
            self.eos_id,
            self.learner_cfg.micro_batch_size,
            model=self.reference_model,
            sync_chunks=sync,
            max_tokens=self.learner_cfg.max_tokens_per_micro_batch,
            dtype=self.compute_dtype,
            packed=self.packed,
            auto_pack=self.auto_pack,
            share=self.share_prompts,
        )
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad],  # (LoRA: the adapters)
            lr=self.learner_cfg.lr,
            betas=self.learner_cfg.adam_betas,
            weight_decay=self.learner_cfg.weight_decay,
            # one kernel for every parameter (torchtitan's default too): on the CPU, where torch
            # would loop over the tensors one op at a time, 0.3x the step's time at the demo's
            # 28 tensors (the same update up to rounding)
            fused=True,
        )

    def _layout(self, trajectories: Sequence[Trajectory]) -> tuple[bool, list[list[int]]]:
        """(packed, micro-batches) of a share (``batches.layout``)."""
        sizes = [(t.prompt_ids.size, t.response_ids.size) for t in trajectories]
        cfg = self.learner_cfg
        return layout(sizes, cfg.micro_batch_size, cfg.max_tokens_per_micro_batch, self.packed,
                      self.auto_pack)  # fmt: skip

    @property
    def uses_reference(self) -> bool:
        """The off-policy losses compare with the frozen reference (cached with each record)."""
        return not self.algorithm.on_policy

    def state_dict(self) -> dict[str, int]:
        """The learner's counters, for a checkpoint's ``reval_state.json`` (its weights and
        AdamW's state go through DCP: ``learner/checkpoint.py``)."""
        return {"step": self.step, "skipped_steps": self.skipped_steps,
                "ref_version": self.reference.version}  # fmt: skip

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.step = int(state["step"])
        self.skipped_steps = int(state["skipped_steps"])
        self.reference.version = int(state["ref_version"])

    def reset_reference(self) -> None:
        self.reference.reset(self.model)

    @torch.no_grad()
    def remember_old_logp(self, trajectories: Sequence[Trajectory]) -> None:
        """GRPO with several updates per generation round: record each trajectory's per-token
        log-probs under the current weights, before the round's first update (verl's
        ``compute_log_prob`` before its mini-batches, TRL's ``old_per_token_logps`` with
        ``steps_per_generation > 1``). Every later update of the round takes its PPO ratio
        against them, so the clip binds against the policy that generated the round. Without
        it (one update per batch, the service) the old log-probs are the update's own (ratio 1)
        and the off-policy part is the TIS weight's. Replaces the previous round's record."""
        self.old_logp = {}
        packed, parts = self._layout(trajectories)
        for part in parts:
            chunk = [trajectories[i] for i in part]
            batch = make_batch(chunk, self.pad_id, self.eos_id, packed, self.share_prompts)
            batch = batch.to(self.device)
            logp = policy_stats(self.model, batch, self.compute_dtype).logp.float().cpu()
            for i, t in enumerate(chunk):
                self.old_logp[t.traj_id] = logp[i, : t.response_ids.size].numpy().copy()

    def _old_logp(self, chunk: Sequence[Trajectory], logp: torch.Tensor) -> torch.Tensor:
        """[B, T] old log-probs of a GRPO micro-batch: the remembered ones where there are
        (each used by one update), this update's own elsewhere."""
        old = logp.detach().clone()
        for i, t in enumerate(chunk):
            kept = self.old_logp.pop(t.traj_id, None)
            if kept is not None:
                old[i, : kept.size] = torch.from_numpy(kept).to(old.device, old.dtype)
        return old

    def update(
        self, trajectories: Sequence[Trajectory], weights: Sequence[float] | None = None
    ) -> UpdateResult:
        """One optimizer step on ``trajectories`` (the mini-batch); ``weights``: per-trajectory
        importance weights of prioritized replay (value losses only)."""
        if not trajectories:
            raise ValueError("update needs at least one trajectory")
        if weights is not None and len(weights) != len(trajectories):
            raise ValueError(f"{len(weights)} weights for {len(trajectories)} trajectories")
        if weights is not None and self.algorithm.on_policy:
            raise ValueError(f"importance weights apply to the value losses, not {self.algo.name}")
        w_all = None if weights is None else torch.as_tensor(list(weights), dtype=torch.float32)
        keep = None
        if self.algo.mask_truncated:  # responses cut at max_new_tokens leave the loss
            keep = torch.tensor([t.finish_reason != "length" for t in trajectories]).float()
        failed: str | None = None
        try:
            totals, loss_total, delta = self._forward_backward(trajectories, w_all, keep)
        except Exception as err:  # (the traceback's tensors go with ``err`` here)
            if not is_memory_error(err):
                raise
            failed = f"{type(err).__name__}: {err}"
            totals, loss_total, delta = {}, 0.0, torch.zeros(len(trajectories))
        # The ranks agree before any of them steps: one that ran out of memory makes every rank
        # raise (and none step), so all of them go on to the next batch in step.
        lost = float(failed is not None)
        if self.reduce is not None:
            lost = self.reduce(lost, "max")
        if lost:
            self.optimizer.zero_grad(set_to_none=True)
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            raise UpdateMemoryError(
                f"the update ran out of memory on its batch ({failed or 'on another rank'})"
            )
        # (the trainable ones: a frozen parameter's gradient, if something left one, is not this
        # update's; requires_grad is the same on every rank, so they all join the norm's reduce)
        params = [p for p in self.model.parameters() if p.requires_grad and p.grad is not None]
        norm = float(torch.nn.utils.clip_grad_norm_(params, self.learner_cfg.grad_clip))
        skipped = not math.isfinite(norm)
        if skipped:
            self.optimizer.zero_grad(set_to_none=True)
            self.skipped_steps += 1
        else:
            self.optimizer.step()
            self.step += 1
        metrics = {"loss": loss_total, "grad_norm": norm, "skipped": float(skipped), **totals}
        return UpdateResult(metrics=metrics, delta=delta, skipped=skipped)

    def _forward_backward(
        self,
        trajectories: Sequence[Trajectory],
        w_all: torch.Tensor | None,
        keep: torch.Tensor | None,
    ) -> tuple[dict[str, float], float, torch.Tensor]:
        """The reference quantities, then the loss's gradients over the micro-batches: (the
        loss's terms, the loss, the per-trajectory residuals)."""
        if self.uses_reference:
            self.reference.fill(trajectories, self.device)
        self.optimizer.zero_grad(set_to_none=True)
        bsz = len(trajectories)
        packed, parts = self._layout(trajectories)
        chunks = [[trajectories[i] for i in part] for part in parts]
        batches = [make_batch(c, self.pad_id, self.eos_id, packed, self.share_prompts)
                   for c in chunks]  # fmt: skip
        self.algorithm.begin(MiniBatch(trajectories, batches, w_all, keep, self.reduce))
        extra = 0
        if self.reduce is not None:
            # Shares of whole groups may differ in size (GRPO): a rank with fewer micro-batches
            # runs idle ones (zero loss) after its own so the FSDP collectives stay in step.
            extra = int(self.reduce(float(len(chunks)), "max")) - len(chunks)
        totals: dict[str, float] = {}
        loss_total = 0.0
        delta = torch.zeros(bsz)
        for part, chunk, cpu_batch in zip(parts, chunks, batches, strict=True):
            rows = torch.tensor(part)
            batch = cpu_batch.to(self.device)
            stats = policy_stats(self.model, batch, self.compute_dtype)
            out = self.algorithm.loss(
                LossInputs(stats, batch, chunk, rows,
                           functools.partial(self._old_logp, chunk, stats.logp))
            )  # fmt: skip
            out.loss.backward()
            loss_total += float(out.loss.item())
            for k, v in out.metrics.items():
                totals[k] = totals.get(k, 0.0) + v * len(chunk) / bsz
            delta[rows] = out.delta.detach().float().cpu()
        if extra > 0:
            idle = batches[0].to(self.device)
            for _ in range(extra):
                (policy_stats(self.model, idle, self.compute_dtype).slp.sum() * 0.0).backward()
        return totals, loss_total, delta
