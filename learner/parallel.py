"""The learner's process group, device and sharding: the same code on CPU (gloo) and on GPUs.

- ``rank_device``: each rank's device, a pure function of the environment and the GPU count:
  ``LOCAL_RANK`` (torchrun, ``reval learner``'s spawned ranks) picks the GPU; without it (a Ray
  actor sees only its own GPU) ``RANK`` modulo the visible GPUs. ``init_group`` makes it the
  current CUDA device (``torch.cuda.set_device``) before anything allocates, so the ranks of a
  node never all land on ``cuda:0``.
- ``backend_for``: a device-aware process group. On GPUs ``"cpu:gloo,cuda:nccl"``: the CUDA
  tensors (FSDP's all-gathers and reduce-scatters) go over NCCL and the CPU ones over gloo (the
  metrics' float64 ``reduce``, the stop flags, ``broadcast_object_list`` of the batches, which
  torch sends over the group's CPU backend when it has one: ``distributed_c10d.py``
  ``_get_object_coll_device``), where NCCL alone refuses CPU tensors. On CPU ``"cpu:gloo"``,
  through the same parsing.
- ``shard``: FSDP2 ``fully_shard`` per decoder layer, then the root, with a
  ``MixedPrecisionPolicy`` when the compute dtype is not fp32: the sharded (master) parameters
  and the optimizer state stay fp32, the all-gathered ones and the compute are bf16, and the
  gradients are reduced in fp32 (``param_dtype=bf16, reduce_dtype=fp32``, as torchtitan does).
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import socket
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from reval import lora
from reval.config import RunConfig
from reval.nccl import apply_nccl_env

log = logging.getLogger("reval.learner")


def rank_device(env: Mapping[str, str], cuda_count: int, want: str = "auto") -> torch.device:
    """This rank's device. ``want``: ``model.device`` (``cpu``, ``cuda``, ``auto``)."""
    if want == "cpu" or (want == "auto" and cuda_count == 0):
        return torch.device("cpu")
    if cuda_count == 0:
        raise RuntimeError("model.device=cuda but no CUDA device is visible to this rank")
    if "LOCAL_RANK" in env:
        local = int(env["LOCAL_RANK"])
        if not 0 <= local < cuda_count:
            raise RuntimeError(
                f"LOCAL_RANK={local} but this process sees {cuda_count} GPU(s) "
                f"(CUDA_VISIBLE_DEVICES={env.get('CUDA_VISIBLE_DEVICES', 'unset')}): start at most "
                "as many ranks per node as it has GPUs (torchrun --nproc-per-node, "
                "learner.world_size)"
            )
        return torch.device("cuda", local)
    return torch.device("cuda", int(env.get("RANK", "0")) % cuda_count)


def backend_for(device: torch.device, choice: str = "auto") -> str:
    """The process group's backend string. ``choice``: ``sync.backend`` (``auto``, ``gloo``,
    ``nccl``); the CPU tensors always have gloo."""
    if device.type == "cpu":
        if choice == "nccl":
            raise ValueError("sync.backend=nccl needs the learner on CUDA (model.device)")
        return "cpu:gloo"
    if choice == "gloo":
        return "gloo"  # (gloo for the CUDA tensors too, as asked)
    return "cpu:gloo,cuda:nccl"


def init_group(device_choice: str, backend_choice: str, timeout_s: float) -> torch.device:
    """Join the default process group on this rank's device (the rendezvous at
    ``MASTER_ADDR:MASTER_PORT``, through ``process_group_store``); returns the device."""
    device = rank_device(os.environ, torch.cuda.device_count(), device_choice)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # before anything allocates on a GPU
    apply_nccl_env()  # (read when the NCCL group is constructed)
    backend, timeout = backend_for(device, backend_choice), dt.timedelta(seconds=timeout_s)
    store = process_group_store(timeout)
    if store is None:  # (torchrun: its agent hosts the store)
        dist.init_process_group(backend, timeout=timeout)
    else:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    return device


_LISTENERS: list[socket.socket] = []
"""Sockets handed to a TCPStore (``master_listen_fd``): kept open as long as the process."""


def process_group_store(timeout: dt.timedelta) -> dist.TCPStore | None:
    """The learner ranks' TCPStore, listening on ``MASTER_ADDR`` only: torch's own (``env://``)
    listens on every interface whatever ``MASTER_ADDR`` says, so rank 0 binds a socket there
    and hands it over (``master_listen_fd``); the other ranks connect. None under torchrun,
    whose agent hosts the store (``TORCHELASTIC_USE_AGENT_STORE``)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true":
        return None
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    world = int(os.environ["WORLD_SIZE"])
    if int(os.environ["RANK"]) != 0:
        return dist.TCPStore(addr, port, world, is_master=False, timeout=timeout)
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    listener = socket.create_server((addr, port), family=family, backlog=512)
    _LISTENERS.append(listener)
    return dist.TCPStore(
        addr, port, world, is_master=True, timeout=timeout, wait_for_workers=False,
        master_listen_fd=listener.fileno(),
    )  # fmt: skip


def reduce_scalar(x: float, op: str) -> float:
    """``x`` summed (``op="sum"``) or maxed over the ranks: a CPU float64 tensor (gloo)."""
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    return float(t.item())


def mixed_precision(compute_dtype: torch.dtype) -> MixedPrecisionPolicy:
    """FSDP2's policy for a compute dtype: none for fp32; else gather and compute in it and
    reduce the gradients in fp32 (the master parameters and the optimizer stay fp32)."""
    if compute_dtype == torch.float32:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)


def shard(
    model: nn.Module, mesh: Any, compute_dtype: torch.dtype, reshard_root: bool = False
) -> nn.Module:
    """``fully_shard`` each decoder layer, then the root (``reshard_root``: the frozen reference
    only runs forward, so the root frees its gathered weights after each)."""
    mp = mixed_precision(compute_dtype)
    base = lora.base_model(model)  # (under LoRA: the adapters' layers are the base's)
    layers = getattr(getattr(base, "model", None), "layers", None)
    if layers is not None:
        for layer in layers:
            fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(
        model, mesh=mesh, mp_policy=mp, reshard_after_forward=True if reshard_root else None
    )
    return model


def _meta_copy(config: Any, dtype: torch.dtype) -> nn.Module:
    """A model of ``config``'s shape with no storage (the meta device)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model: nn.Module = AutoModelForCausalLM.from_config(config)
    return model.to(dtype)


@torch.no_grad()
def build_models(cfg: RunConfig, device: torch.device) -> tuple[Any, nn.Module, nn.Module]:
    """The tokenizer, the policy and its frozen reference, sharded over the default group.

    Only rank 0 loads the weights (on its CPU, fp32: the masters); the other ranks build the
    model on the meta device, every rank shards it (``shard`` moves each layer's shards to the
    device: no rank ever holds the full model there), and rank 0's tensors are broadcast into
    the shards (``set_model_state_dict(broadcast_from_rank0=True)``). The reference is built
    the same way in the compute dtype (bf16 on GPUs: it never trains) and filled shard to shard
    from the policy. Non-persistent buffers (rotary frequencies) are broadcast from rank 0.

    Under LoRA (``model.lora``) each rank wraps the model with peft before sharding (rank 0's
    initial adapters are the ones broadcast) and there is no reference model: the third value
    is the adapters' ``AdapterSnapshot`` (``learner/reference.py``)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    from learner.memory import apply_plan
    from learner.reference import AdapterSnapshot
    from reval.policy import compute_dtype, enable_checkpointing, load_policy

    rank = dist.get_rank()
    dtype = compute_dtype(cfg.model)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    adapters = cfg.model.lora if cfg.model.lora.enabled else None
    torch.manual_seed(cfg.seed)
    full: dict[str, torch.Tensor] = {}
    box: list[Any] = [None]
    if rank == 0:
        policy = load_policy(cfg.model.model_copy(update={"device": "cpu"}), cfg.seed)
        model = policy.model
        plan = apply_plan(cfg, model, device, dist.get_world_size())
        log.info(plan.describe())
        if adapters is not None:  # (rank 0's adapters, initialised here, reach every rank)
            model = lora.wrap(model, adapters)
            log.info(lora.trainable_summary(model))
        full = {k: v.clone() for k, v in model.state_dict().items()}
        buffers = {k: v.clone() for k, v in model.named_buffers()}
        box = [(policy.tokenizer, policy.model.config, plan.checkpointing)]
    dist.broadcast_object_list(box, src=0)
    tokenizer, config, checkpointing = box[0]  # rank 0's plan: every rank the same
    if rank != 0:
        model = _meta_copy(config, torch.float32)
        if checkpointing:
            enable_checkpointing(model)  # type: ignore[arg-type]
        if adapters is not None:
            model = lora.wrap(model, adapters)
    reference = None if adapters is not None else _meta_copy(config, dtype)
    shard(model, mesh, dtype)
    model.to_empty(device=device)
    if reference is not None:
        shard(reference, mesh, dtype, reshard_root=True)
        reference.to_empty(device=device)
    opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, full, options=opts)
    del full
    for name, buf in model.named_buffers():
        if rank == 0:
            buf.copy_(buffers[name])
        dist.broadcast(buf, src=0)
    model.train()
    if reference is None:  # LoRA: the reference is the policy's own base, then a snapshot
        return tokenizer, model, AdapterSnapshot(model)
    for dst, src in zip(reference.parameters(), model.parameters(), strict=True):
        dst.copy_(src)
    for dst, src in zip(reference.buffers(), model.buffers(), strict=True):
        dst.copy_(src)
    reference.eval().requires_grad_(False)
    return tokenizer, model, reference
