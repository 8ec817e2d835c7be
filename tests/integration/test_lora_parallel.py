"""LoRA on 2 gloo ranks through the code a GPU run takes (``learner/parallel.py``, issue 41):
each rank wraps the model with peft before FSDP2 shards it, rank 0's adapters reach every
rank, the reference is the adapters' snapshot (no second model), the first update's losses equal
the full model's on the same shares (B starts at zero), and only the adapters move."""

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
from tests.conftest import make_traj


def _cfg(dtype: str, rank: int):
    return load_config(
        overrides=["model.device=cpu", f"model.dtype={dtype}", "learner.lr=1e-3",
                   f"model.lora.rank={rank}", "model.gradient_checkpointing=false"],
        environ={},
    )  # fmt: skip


def _rank(rank: int, world: int, port: int, dtype: str, tmp: str) -> None:
    _rank_env(rank, world, port)
    out = str(Path(tmp) / "state.pt")
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.tensor import DTensor

    from learner.parallel import build_models, init_group, reduce_scalar
    from learner.reference import AdapterSnapshot
    from learner.trainer import Learner
    from reval.lora import is_adapter

    torch.set_num_threads(1)
    device = init_group("cpu", "auto", 60)
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    facts: dict = {}
    try:
        for lora_rank in (0, 8):
            cfg = _cfg(dtype, lora_rank)
            tok, model, ref = build_models(cfg, device)
            learner = Learner(
                model, cfg.learner, cfg.algo, tok.pad_token_id, tok.eos_token_id, device,
                reference_model=ref, reduce=reduce_scalar, compute_dtype=getattr(torch, dtype),
            )  # fmt: skip
            before = get_model_state_dict(model, options=opts)
            share = [make_traj(i, reward=float(i % 2)) for i in (2 * rank, 2 * rank + 1)]
            res = learner.update(share)
            after = get_model_state_dict(model, options=opts)
            facts[lora_rank] = {
                "loss": res.metrics["loss"],
                "sharded": all(isinstance(p, DTensor) for p in model.parameters()),
                "ref_snapshot": isinstance(ref, AdapterSnapshot),
                "ref_numel": sum(p.numel() for p in ref.parameters()),
                "trainable": sorted(n for n, p in model.named_parameters() if p.requires_grad),
                "optimized": sum(len(g["params"]) for g in learner.optimizer.param_groups),
                "moved": sorted(k for k in before if not torch.equal(before[k], after[k])),
                "adapter_keys": sorted(k for k in before if is_adapter(k)),
                "before": before if rank == 0 else None,
            }
        if rank == 0:
            torch.save(facts, out)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    os._exit(0)  # (see test_fsdp_learner.py: no gloo teardown at interpreter exit)


def _rank_env(rank: int, world: int, port: int) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
    )  # fmt: skip


def _run(fn, arg: str = "") -> dict:
    """``fn(rank, 2, port, arg, tmp)`` on 2 spawned ranks; what rank 0 saved in tmp/state.pt."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(fn, args=(2, port, arg, tmp), nprocs=2, start_method="spawn")
        return torch.load(str(Path(tmp) / "state.pt"), weights_only=False)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_lora_on_two_ranks_starts_as_the_full_model_and_moves_only_adapters(dtype):
    got = _run(_rank, dtype)
    full, lora = got[0], got[8]
    assert lora["sharded"] and lora["ref_snapshot"] and not full["ref_snapshot"]
    # The first update's loss on rank 0's share: the adapters' B is zero, so the same model.
    tol = 1e-6 if dtype == "float32" else 1e-2
    assert lora["loss"] == pytest.approx(full["loss"], rel=tol, abs=tol)
    # Only the adapters train, are optimized and move; every base weight stays bit for bit.
    assert lora["trainable"] and all(".lora_" in n for n in lora["trainable"])
    assert lora["optimized"] == len(lora["trainable"])
    assert lora["moved"] and set(lora["moved"]) <= set(lora["adapter_keys"])
    assert any(".lora_B." in k for k in lora["moved"])  # B left zero: the update reached it
    # The reference is the adapters' size, not a model.
    base_numel = sum(v.numel() for k, v in full["before"].items())
    assert lora["ref_numel"] < 0.25 * base_numel
    # Rank 0's base weights are the full model's, under peft's names.
    from reval.lora import base_name

    base = {base_name(k): v for k, v in lora["before"].items() if ".lora_" not in k}
    for name, w in full["before"].items():
        assert torch.equal(base[name], w), name


def _resume_rank(rank: int, world: int, port: int, _: str, tmp: str) -> None:
    _rank_env(rank, world, port)
    ckpt, out = str(Path(tmp) / "ckpt"), str(Path(tmp) / "state.pt")
    from learner.checkpoint import Checkpointer
    from learner.parallel import build_models, init_group, reduce_scalar
    from learner.trainer import Learner
    from reval import lora

    torch.set_num_threads(1)
    device = init_group("cpu", "auto", 60)

    def learner(seed: int) -> tuple[Learner, Checkpointer]:
        cfg = _cfg("float32", 8).model_copy(update={"seed": seed})
        tok, model, ref = build_models(cfg, device)
        lrn = Learner(model, cfg.learner, cfg.algo, tok.pad_token_id, tok.eos_token_id, device,
                      reference_model=ref, reduce=reduce_scalar)  # fmt: skip
        return lrn, Checkpointer(Path(ckpt), model, ref, lrn.optimizer, [lrn])

    def share(k: int) -> list:
        return [make_traj(10 * k + i, reward=float(i % 2)) for i in (2 * rank, 2 * rank + 1)]

    try:
        first, saver = learner(0)
        first.update(share(0))
        first.reset_reference()  # (the snapshot now holds trained adapters)
        first.update(share(1))
        saver.save()
        want = first.update(share(2)).metrics["loss"]
        second, loader = learner(0)  # the same base (a checkpoint holds the adapters only)
        with torch.no_grad():  # other adapters: whatever the load misses shows
            for _, p in lora.adapter_parameters(second.model):
                p.add_(torch.randn_like(p))
        loader.load()
        got = second.update(share(2)).metrics["loss"]
        if rank == 0:
            torch.save({"want": want, "got": got, "ref": second.reference.version}, out)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    os._exit(0)


@pytest.mark.timeout(300)
def test_lora_on_two_ranks_resumes_from_a_checkpoint_bit_for_bit():
    got = _run(_resume_rank)
    assert got["ref"] == 1  # the reset's snapshot came back
    assert got["got"] == got["want"]  # the next update's loss, exactly
