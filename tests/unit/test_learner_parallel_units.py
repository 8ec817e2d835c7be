"""The learner's GPU-facing choices as pure functions and CPU-checkable numerics: each rank's
device, the process group's backend string, the NCCL error-handling environment, the token
budget of micro-batches, the chunked log-probs (same values and gradients as the plain ones, at
a fraction of the peak memory), fp32 masters with bf16 compute at lr 1e-6, and non-reentrant
gradient checkpointing."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from learner import sequence as seq
from learner.batches import micro_batches
from learner.parallel import backend_for, mixed_precision, rank_device
from learner.sequence import chunked_logp_lse, sequence_stats
from reval.config import AlgoConfig, LearnerConfig, ModelConfig
from reval.nccl import NCCL_ENV, apply_nccl_env
from reval.policy import load_policy
from tests.conftest import make_traj

CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)


@pytest.mark.parametrize(
    ("env", "count", "want", "device"),
    [
        ({}, 0, "auto", "cpu"),
        ({"LOCAL_RANK": "3"}, 8, "cpu", "cpu"),
        ({"LOCAL_RANK": "3", "RANK": "11"}, 8, "auto", "cuda:3"),  # torchrun: the local rank
        ({"RANK": "5"}, 8, "cuda", "cuda:5"),
        ({"RANK": "5"}, 1, "auto", "cuda:0"),  # a Ray actor sees its one GPU
        ({}, 2, "auto", "cuda:0"),
    ],
)
def test_each_rank_gets_its_own_device(env, count, want, device):
    assert rank_device(env, count, want) == torch.device(device)


def test_device_errors_say_what_to_change():
    with pytest.raises(RuntimeError, match="no CUDA device"):
        rank_device({}, 0, "cuda")
    with pytest.raises(RuntimeError, match="LOCAL_RANK=2 but this process sees 2 GPU"):
        rank_device({"LOCAL_RANK": "2"}, 2, "auto")


def test_the_group_has_gloo_for_cpu_tensors_beside_nccl():
    assert backend_for(CUDA) == "cpu:gloo,cuda:nccl"
    assert backend_for(CUDA, "nccl") == "cpu:gloo,cuda:nccl"
    assert backend_for(CUDA, "gloo") == "gloo"
    assert backend_for(CPU) == "cpu:gloo"
    with pytest.raises(ValueError, match="needs the learner on CUDA"):
        backend_for(CPU, "nccl")


def test_nccl_timeouts_raise_instead_of_ending_the_process(monkeypatch):
    monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", raising=False)
    apply_nccl_env()
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2"  # CleanUpOnly, not TearDown
    assert NCCL_ENV == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    apply_nccl_env()
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"  # the operator's choice stays


def test_mixed_precision_policy_keeps_fp32_masters_and_reduction():
    mp = mixed_precision(torch.bfloat16)
    assert (mp.param_dtype, mp.reduce_dtype) == (torch.bfloat16, torch.float32)
    assert mixed_precision(torch.float32).param_dtype is None


# -- the token budget ----------------------------------------------------------------------


def test_micro_batches_never_exceed_the_token_budget():
    gen = torch.Generator().manual_seed(0)
    sizes = [(int(p), int(r)) for p, r in torch.randint(1, 200, (300, 2), generator=gen)]
    for budget in (400, 1000, 5000):
        parts = micro_batches(sizes, 16, budget)
        assert sorted(i for part in parts for i in part) == list(range(len(sizes)))
        for part in parts:
            assert len(part) <= 16
            padded = len(part) * (max(sizes[i][0] for i in part) + max(sizes[i][1] for i in part))
            assert padded <= budget
        # bucketed by length: far fewer padded tokens than the arrival order's micro-batches
        plain = micro_batches(sizes, len(parts[0]), None)
        assert len(parts) <= 2 * len(plain)
    assert micro_batches(sizes[:5], 2) == [[0, 1], [2, 3], [4]]  # no budget: order kept
    with pytest.raises(ValueError, match=r"exceeds learner\.max_tokens_per_micro_batch=100"):
        micro_batches([(60, 50)], 4, 100)


def test_the_learner_step_is_the_same_under_a_token_budget():
    """Bucketed micro-batches reorder the trajectories; the update (and each trajectory's
    residual, written back by id) is the same as without a budget."""
    from learner.trainer import Learner

    trajs = [make_traj(i, reward=float(i % 2), plen=2 + i % 5, rlen=2 + (7 * i) % 9)
             for i in range(12)]  # fmt: skip
    out = {}
    for budget in (None, 40):
        torch.manual_seed(0)
        policy = load_policy(ModelConfig(device="cpu"), seed=0)
        lc = LearnerConfig(lr=1e-2, micro_batch_size=4, max_tokens_per_micro_batch=budget)
        learner = Learner(policy.model, lc, AlgoConfig(beta=0.1), 0, 1, CPU)
        res = learner.update([t for t in trajs])
        grads = {k: p.grad.clone() for k, p in policy.model.named_parameters()}
        out[budget] = (res.delta, grads)  # (Adam's first step is ~lr * sign: compare grads)
        for t in trajs:
            t.ref_version = -1  # (recompute the reference quantities in the next run)
    torch.testing.assert_close(out[40][0], out[None][0], rtol=1e-5, atol=1e-5)
    for name, g in out[None][1].items():
        torch.testing.assert_close(out[40][1][name], g, rtol=1e-4, atol=1e-6, msg=name)


# -- chunked log-probs ---------------------------------------------------------------------


@pytest.mark.parametrize("recompute_above", [0, seq.RECOMPUTE_LOGITS_ABOVE])
def test_chunked_logprobs_equal_the_plain_ones_with_equal_gradients(monkeypatch, recompute_above):
    """Recomputed in the backward pass (every chunk above 0 values) or kept (the default at this
    size): the same values and gradients."""
    monkeypatch.setattr(seq, "RECOMPUTE_LOGITS_ABOVE", recompute_above)
    gen = torch.Generator().manual_seed(0)
    b, t, h, v = 3, 37, 16, 101
    hid = torch.randn(b, t, h, generator=gen, requires_grad=True)
    w = torch.randn(v, h, generator=gen, requires_grad=True)
    y = torch.randint(0, v, (b, t), generator=gen)
    m = (torch.rand(b, t, generator=gen) > 0.2).float()
    plain = F.log_softmax(F.linear(hid, w), -1).gather(-1, y[..., None])[..., 0]
    lse0 = torch.logsumexp(F.linear(hid[:, 0], w), -1)
    got = chunked_logp_lse(hid, w, None, y, chunk=8)  # 5 chunks, the last a partial one
    torch.testing.assert_close(got[..., 0], plain, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got[:, 0, 1], lse0, rtol=1e-6, atol=1e-6)
    st = sequence_stats(F.linear(hid, w), y, m)
    torch.testing.assert_close(got[..., 0] * m, st.logp, rtol=1e-6, atol=1e-6)
    weights = torch.randn(b, t, generator=gen)
    g_plain = torch.autograd.grad((plain * weights).sum() + lse0.sum(), (hid, w))
    g_chunk = torch.autograd.grad((got[..., 0] * weights).sum() + got[:, 0, 1].sum(), (hid, w))
    for a, c in zip(g_plain, g_chunk, strict=True):
        torch.testing.assert_close(c, a, rtol=1e-5, atol=1e-6)


_PEAK = r"""
import json, sys, torch, torch.nn.functional as F
from learner.sequence import chunked_logp_lse

def hwm_kb():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))

torch.manual_seed(0)
b, t, h, v = 4, 512, 32, 32000
hid = torch.randn(b, t, h, requires_grad=True)
w = torch.randn(v, h, requires_grad=True)
y = torch.randint(0, v, (b, t))
# The peak RSS from here on (ru_maxrss is not: a child forked from a large pytest process
# starts with the parent's, and grew by 0 in the full suite).
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
before = hwm_kb()
if sys.argv[1] == "plain":
    out = F.log_softmax(F.linear(hid, w).float(), -1).gather(-1, y[..., None])[..., 0]
else:
    out = chunked_logp_lse(hid, w, None, y, chunk=64)[..., 0]
out.sum().backward()
peak = hwm_kb()
print(json.dumps({"kb": peak - before}))
"""


def _peak_kb(mode: str) -> int:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    # Large blocks through mmap (returned to the system when freed), so that the peak RSS is
    # the peak of live memory rather than of glibc's heap, which keeps what it once held.
    path = os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path,
           "MALLOC_MMAP_THRESHOLD_": "65536"}  # fmt: skip
    res = subprocess.run([sys.executable, "-c", _PEAK, mode], env=env, capture_output=True,
                         text=True, check=True, timeout=300)  # fmt: skip
    return int(json.loads(res.stdout.strip().splitlines()[-1])["kb"])


@pytest.mark.timeout(600)
def test_chunked_logprobs_take_a_fraction_of_the_peak_memory():
    """[B, T, V] = 4 x 512 x 32000 fp32 logits are 262 MB; the plain forward + backward holds
    several of them (777 MB of peak RSS growth measured), the chunked one a chunk's at a time
    plus what does not depend on V (250 MB measured; 64 positions here). Peak RSS from the
    measurement's start (``VmHWM`` after ``clear_refs``), in a process of its own."""
    plain, chunked = _peak_kb("plain"), _peak_kb("chunked")
    assert chunked < 0.5 * plain, (chunked, plain)


@pytest.mark.parametrize(("recompute_above", "calls"), [(0, 10), (10**9, 5)])
def test_only_large_logits_are_recomputed_in_the_backward(monkeypatch, recompute_above, calls):
    """A chunk's head runs again in the backward pass only above ``RECOMPUTE_LOGITS_ABOVE``
    values (5 chunks here: 5 calls forward, 5 more if recomputed)."""
    monkeypatch.setattr(seq, "RECOMPUTE_LOGITS_ABOVE", recompute_above)
    real, seen = seq._head_chunk, []
    monkeypatch.setattr(seq, "_head_chunk", lambda *a: seen.append(1) or real(*a))
    hid = torch.randn(2, 37, 8, requires_grad=True)
    w = torch.randn(50, 8, requires_grad=True)
    chunked_logp_lse(hid, w, None, torch.randint(0, 50, (2, 37)), chunk=8)[..., 0].sum().backward()
    assert len(seen) == calls
    assert hid.grad is not None and w.grad is not None


# -- precision and checkpointing -------------------------------------------------------------


def test_bf16_compute_moves_fp32_masters_at_lr_1e6_like_fp32():
    """One process (``reval train``): ``model.dtype=bfloat16`` computes in bf16 under autocast
    and keeps fp32 parameters and AdamW state; at lr 1e-6 the parameters move, by the fp32
    step's amount within bf16 compute error."""
    from learner.trainer import Learner

    trajs = [make_traj(i, reward=float(i % 2)) for i in range(8)]
    start = load_policy(ModelConfig(device="cpu"), seed=0).model.state_dict()
    moved, grads = {}, {}
    for dtype in (torch.float32, torch.bfloat16):
        policy = load_policy(ModelConfig(device="cpu", dtype=str(dtype)[6:]), seed=0)
        assert {p.dtype for p in policy.model.parameters()} == {torch.float32}
        learner = Learner(policy.model, LearnerConfig(lr=1e-6, micro_batch_size=4),
                          AlgoConfig(beta=0.1), 0, 1, CPU, compute_dtype=dtype)  # fmt: skip
        for t in trajs:
            t.ref_version = -1
        learner.update(trajs)
        state = learner.optimizer.state[next(iter(policy.model.parameters()))]
        assert state["exp_avg"].dtype == torch.float32
        moved[dtype] = torch.cat(
            [(v - start[k]).flatten() for k, v in policy.model.state_dict().items()]
        )
        grads[dtype] = torch.cat([p.grad.flatten() for p in policy.model.parameters()])
    d32, d16 = moved[torch.float32], moved[torch.bfloat16]
    assert float((d16 != 0).float().mean()) > 0.9  # the masters moved (bf16 storage: ~0)
    # Adam's first step is lr * sign(grad): the bf16-compute step is the fp32 one except where
    # bf16 rounding flips the sign of a near-zero gradient (a key bias's is zero in exact maths).
    assert float(((d16 - d32).abs() <= 1e-7).float().mean()) > 0.9
    g32, g16 = grads[torch.float32], grads[torch.bfloat16]
    assert float((g16 - g32).norm() / g32.norm()) < 0.05  # bf16 compute error (about 1%)


def test_gradient_checkpointing_is_asked_non_reentrant():
    """Explicitly: transformers 4.x defaults to the reentrant variant (5.x no longer does)."""
    from reval.policy import enable_checkpointing

    class Model:
        def gradient_checkpointing_enable(self, **kw):
            self.kw = kw

    model = Model()
    enable_checkpointing(model)  # type: ignore[arg-type]
    assert model.kw == {"gradient_checkpointing_kwargs": {"use_reentrant": False}}


def test_gradient_checkpointing_is_non_reentrant():
    policy = load_policy(ModelConfig(device="cpu", gradient_checkpointing=True), seed=0)
    model = policy.model
    assert model.is_gradient_checkpointing
    layer = model.model.layers[0]
    fn = layer._gradient_checkpointing_func
    assert fn.keywords.get("use_reentrant") is False
