"""The FSDP2 learner (2 gloo ranks, each on its share of the batch) takes the same step as one
process on the whole batch: for the value losses (equal shares) and for GRPO's token mean over
uneven groups dealt whole to the ranks (unequal shares, so unequal micro-batch counts), with every
advantage equal to the one-process one; the sharded reference resets to the policy."""

from __future__ import annotations

import datetime as dt
import os
import socket
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from learner.batches import split_shares
from learner.losses import grpo_advantages
from learner.parallel import reduce_scalar, shard
from learner.trainer import Learner
from reval.config import AlgoConfig, LearnerConfig, ModelConfig
from reval.policy import load_policy
from tests.conftest import make_traj

GROUP_SIZES = (4, 4, 3, 1)
"""GRPO's groups: uneven, so the whole-group shares are 7 and 5 (4 and 3 micro-batches of 2)."""


def batch(n: int = 8, uneven: bool = False):
    out = []
    groups = [g for g, size in enumerate(GROUP_SIZES) for _ in range(size)] if uneven else None
    for i in range(len(groups) if groups else n):
        t = make_traj(i, reward=float(i % 2 or i == 4), plen=3 + i % 3, rlen=2 + i % 4)
        t.group_id = f"g{groups[i] if groups else i // 4}"
        out.append(t)
    return out


def learner_for(model, algo: str, **kw) -> Learner:
    cfg = LearnerConfig(lr=1e-2, micro_batch_size=2, grad_clip=1e9)
    return Learner(model, cfg, AlgoConfig(name=algo, beta=0.1), 0, 1, torch.device("cpu"), **kw)


def single_process_step(algo: str) -> dict[str, torch.Tensor]:
    # One thread, as in the ranks: Adam's first step moves a weight by about lr * sign(grad),
    # so a gradient element near zero that two threads' reduction order rounds to the other
    # sign moves by 2 * lr apart (seen at 2 threads after log-probs became chunked).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        policy = load_policy(ModelConfig(device="cpu"), seed=0)
        learner = learner_for(policy.model, algo)
        learner.update(batch(uneven=algo == "grpo"))
        return {k: v.detach().clone() for k, v in policy.model.state_dict().items()}
    finally:
        torch.set_num_threads(threads)


def _rank(rank: int, world: int, port: int, algo: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=dt.timedelta(seconds=60))
    try:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
        )
        from torch.distributed.device_mesh import init_device_mesh

        torch.set_num_threads(1)
        torch.manual_seed(0)
        mesh = init_device_mesh("cpu", (world,))
        f32 = torch.float32
        model = shard(load_policy(ModelConfig(device="cpu"), seed=0).model, mesh, f32)
        ref = load_policy(ModelConfig(device="cpu"), seed=0).model
        ref = shard(ref, mesh, f32, reshard_root=True)
        learner = learner_for(model, algo, reference_model=ref, reduce=reduce_scalar)
        shares = split_shares(batch(uneven=algo == "grpo"), world, whole_groups=algo == "grpo")
        if rank == 1 and algo != "grpo":
            # Uneven stale counts (rank 1's share comes with cached reference quantities, rank
            # 0's does not): the reference's forwards must stay in step across the ranks.
            from learner.sequence import make_batch, policy_stats, use_varlen_attention

            plain = load_policy(ModelConfig(device="cpu"), seed=0).model
            if learner.packed:  # (computed in the layout the learner's own reference uses:
                use_varlen_attention(plain)  # another layout rounds them differently)
            layout = make_batch(shares[1], 0, 1, learner.packed, learner.share_prompts)
            with torch.no_grad():
                stats = policy_stats(plain, layout)
            for t, slp, v1 in zip(shares[1], stats.slp.tolist(), stats.v1.tolist(), strict=True):
                t.ref_logprob_sum, t.ref_value, t.ref_version = slp, v1, 0
        res = learner.update(shares[rank])
        advantages = [None] * world if rank == 0 else None
        mine = dict(zip([t.traj_id for t in shares[rank]], res.delta.tolist(), strict=True))
        dist.gather_object(mine, advantages, dst=0)
        learner.reset_reference()
        full = get_model_state_dict(
            model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        ref_full = get_model_state_dict(
            ref, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        if rank == 0:
            merged = {k: v for part in advantages for k, v in part.items()}
            sizes = [len(x) for x in shares]
            torch.save({"model": full, "ref": ref_full, "adv": merged, "sizes": sizes}, out)
        dist.barrier()  # nobody tears down gloo while a peer may still talk to it
    finally:
        dist.destroy_process_group()
    # Leave without the interpreter's teardown: gloo threads destroyed there have aborted the
    # process once in CI ("terminate called without an active exception") after all was done.
    os._exit(0)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("algo", ["reval", "grpo"])
def test_two_ranks_take_the_single_process_step(algo):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "state.pt")
        mp.start_processes(_rank, args=(2, port, algo, out), nprocs=2, start_method="spawn")
        got = torch.load(out)
    want = single_process_step(algo)
    if algo == "grpo":
        assert got["sizes"] == [7, 5]
        whole = batch(uneven=True)
        adv = grpo_advantages(
            torch.tensor([t.reward_raw for t in whole]), [t.group_id for t in whole]
        )
        assert got["adv"] == pytest.approx(
            {t.traj_id: a for t, a in zip(whole, adv.tolist(), strict=True)}, abs=1e-6
        )
    moved = 0.0
    initial = load_policy(ModelConfig(device="cpu"), seed=0).model.state_dict()
    for name, w in want.items():
        if name not in got["model"]:
            continue  # a tied alias
        torch.testing.assert_close(got["model"][name], w, rtol=1e-4, atol=1e-5, msg=name)
        torch.testing.assert_close(got["ref"][name], w, rtol=1e-4, atol=1e-5, msg=name)
        moved += float((w - initial[name]).abs().sum())
    assert moved > 0  # the step did something


def test_shares_keep_groups_together():
    whole = list(reversed(batch(uneven=True)))
    shares = split_shares(whole, 2, whole_groups=True)
    assert sorted(len(s) for s in shares) == [5, 7]
    assert not {t.group_id for t in shares[0]} & {t.group_id for t in shares[1]}
    assert sorted(t.traj_id for s in shares for t in s) == sorted(t.traj_id for t in whole)
    with pytest.raises(ValueError, match="groups cannot give each"):
        split_shares(batch(8), 3, whole_groups=True)  # two groups, three ranks


def test_value_shares_are_equal_and_contiguous():
    shares = split_shares(batch(8), 2, whole_groups=False)
    assert [[t.traj_id for t in s] for s in shares] == [
        [f"t{i}" for i in r] for r in (range(4), range(4, 8))
    ]
    with pytest.raises(ValueError, match="equal shares"):
        split_shares(batch(8), 3, whole_groups=False)
