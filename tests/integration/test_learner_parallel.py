"""The learner's start-up on 2 gloo ranks through the code a GPU run takes (learner/parallel.py):
the device-aware group (``init_group``), the CPU-tensor collectives on it (the float64 reduce,
``broadcast_object_list``), the models built on meta and filled from rank 0 (``build_models``:
the policy equals rank 0's load, sharded, fp32 masters; the reference sharded, in the compute
dtype, equal to the policy), and a bf16-compute update at lr 1e-6 that moves the fp32 masters."""

from __future__ import annotations

import os
import socket
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from reval.config import load_config
from reval.policy import load_policy
from tests.conftest import make_traj


def _cfg(dtype: str):
    ckpt = dtype == "bfloat16"  # (and FSDP2 with non-reentrant activation checkpointing)
    return load_config(
        overrides=["model.device=cpu", f"model.dtype={dtype}", "learner.lr=1e-6",
                   f"model.gradient_checkpointing={str(ckpt).lower()}"],
        environ={},
    )  # fmt: skip


def _rank(rank: int, world: int, port: int, dtype: str, out: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
    )  # fmt: skip
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.tensor import DTensor

    from learner.parallel import build_models, init_group, reduce_scalar
    from learner.trainer import Learner

    torch.set_num_threads(1)
    cfg = _cfg(dtype)
    device = init_group(cfg.model.device, cfg.sync.backend, 60)
    try:
        facts: dict = {"device": str(device), "backend": str(dist.get_backend_config())}
        facts["sum"] = reduce_scalar(0.5 + rank, "sum")
        box = [{"from": rank}]
        dist.broadcast_object_list(box, src=0)
        facts["object"] = box[0]
        tok, model, ref = build_models(cfg, device)
        facts["pad"] = tok.pad_token_id
        facts["policy_dtypes"] = sorted({str(p.dtype) for p in model.parameters()})
        facts["ref_dtypes"] = sorted({str(p.dtype) for p in ref.parameters()})
        facts["sharded"] = all(isinstance(p, DTensor) for p in model.parameters())
        facts["ref_sharded"] = all(isinstance(p, DTensor) for p in ref.parameters())
        ckpt = bool(getattr(model.model, "gradient_checkpointing", False))
        facts["ckpt"] = reduce_scalar(float(ckpt), "sum")  # ranks with checkpointing on
        facts["tied"] = model.lm_head.weight is model.model.embed_tokens.weight
        facts["ref_frozen"] = not any(p.requires_grad for p in ref.parameters())
        facts["local_numel"] = sum(p.to_local().numel() for p in model.parameters())
        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        before = get_model_state_dict(model, options=opts)
        ref_full = get_model_state_dict(ref, options=opts)
        learner = Learner(
            model, cfg.learner, cfg.algo, tok.pad_token_id, tok.eos_token_id, device,
            reference_model=ref, reduce=reduce_scalar,
            compute_dtype=getattr(torch, dtype),
        )  # fmt: skip
        trajs = [make_traj(i, reward=float(i % 2)) for i in range(4)]
        res = learner.update(trajs[rank * 2 : rank * 2 + 2])
        after = get_model_state_dict(model, options=opts)
        facts["finite"] = bool(torch.isfinite(res.delta).all())
        if rank == 0:
            torch.save({"facts": facts, "before": before, "after": after, "ref": ref_full}, out)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    os._exit(0)  # (see test_fsdp_learner.py: no gloo teardown at interpreter exit)


def _run(dtype: str) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "state.pt")
        mp.start_processes(_rank, args=(2, port, dtype, out), nprocs=2, start_method="spawn")
        return torch.load(out)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_two_ranks_start_sharded_from_rank0(dtype):
    got = _run(dtype)
    facts = got["facts"]
    assert facts["device"] == "cpu"
    assert "gloo" in facts["backend"]
    assert facts["sum"] == 2.0  # 0.5 + 1.5: a float64 CPU all-reduce on the group
    assert facts["object"] == {"from": 0}
    assert facts["sharded"] and facts["ref_sharded"] and facts["ref_frozen"]
    assert facts["ckpt"] == (2.0 if dtype == "bfloat16" else 0.0)  # meta-built rank 1 too
    assert facts["tied"]  # the tied LM head survives the meta build
    assert facts["policy_dtypes"] == ["torch.float32"]  # fp32 masters whatever model.dtype is
    assert facts["ref_dtypes"] == [str(getattr(torch, dtype))]  # the reference: compute dtype
    assert facts["finite"]
    want = load_policy(_cfg(dtype).model, seed=_cfg(dtype).seed).model.state_dict()
    total = sum(v.numel() for k, v in want.items() if k in got["before"])
    assert facts["local_numel"] < 0.6 * total  # each rank holds about half
    moved = 0
    for name, w in want.items():
        if name not in got["before"]:
            continue  # a tied alias
        assert torch.equal(got["before"][name], w), name  # rank 0's weights on every shard
        assert torch.equal(got["ref"][name], w.to(getattr(torch, dtype))), name
        moved += int((got["after"][name] != got["before"][name]).sum())
    # lr 1e-6 on fp32 masters: the update is not rounded away (in bf16 storage it would be).
    assert moved > 0.5 * total


def test_bf16_storage_would_round_an_lr_1e6_update_away():
    """Why the masters are fp32: the same step size on bf16 weights of order 1 is lost."""
    w = torch.rand(10_000) + 0.5
    step = torch.full_like(w, 1e-6)
    assert int(((w.bfloat16() - step.bfloat16()) != w.bfloat16()).sum()) == 0
    assert int(((w - step) != w).sum()) > 9_000
