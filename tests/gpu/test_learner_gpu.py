"""The GPU smoke suite (``make gpu-smoke``: ``pytest -m gpu tests/gpu``): the learner's start-up
and updates on one CUDA device through the code ``reval learner`` runs, and, when vLLM is
installed, one vLLM engine taking the learner's weights (``test_vllm_smoke.py``). Skipped without
CUDA; collected everywhere.

What a GPU shows here that the CPU tests (tests/unit/test_learner_parallel_units.py,
tests/integration/test_learner_parallel.py, which run the same functions on gloo) cannot:
- NCCL really refuses CPU tensors and the device-aware group (``cpu:gloo,cuda:nccl``) routes the
  float64 reduce and ``broadcast_object_list`` to gloo while FSDP's collectives take NCCL;
- ``torch.cuda.set_device(LOCAL_RANK)`` took effect before the first allocation;
- FSDP2's ``MixedPrecisionPolicy`` on CUDA kernels: bf16 all-gathers and compute, fp32 reduce
  and masters, so an lr of 1e-6 moves the parameters (bf16 storage would round it away);
- the peak device memory of a 0.5B-shaped model's update against the budget below, and the
  chunked log-probs' peak against the plain [B, T, V] one at Qwen's vocabulary (CUDA's allocator
  counts exactly what the CPU's RSS only approximates);
- the time per update on a real device.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

ROOT = Path(__file__).resolve().parents[2]
QWEN_05B = {
    "model.tiny.hidden_size": 896,
    "model.tiny.intermediate_size": 4864,
    "model.tiny.num_layers": 24,
    "model.tiny.num_heads": 14,
    "model.tiny.head_dim": 64,
    "model.tiny.num_kv_heads": 2,
    "model.tiny.max_position_embeddings": 2048,
}
"""Qwen2.5-0.5B's shape (the project's character vocabulary instead of its 152k tokens)."""
UPDATES = 20
MAX_TOKENS = 4096
"""``learner.max_tokens_per_micro_batch`` of the smoke runs."""


def settings(extra: dict[str, object] | None = None) -> list[str]:
    base: dict[str, object] = {
        **QWEN_05B,
        "model.device": "cuda",
        "model.dtype": "bfloat16",
        "learner.lr": 1e-6,
        "learner.micro_batch_size": 16,
        "learner.max_tokens_per_micro_batch": MAX_TOKENS,
        "learner.updates_per_round": 1,
        "algo.beta": 0.02,
    }
    base.update(extra or {})
    return [f"{k}={v}" for k, v in base.items()]


def memory_budget(n_params: int, hidden: int, layers: int, intermediate: int) -> int:
    """Bytes an update may hold on one rank (world 1): fp32 masters, their grads and AdamW's two
    moments (16 B/param), the bf16 all-gathered parameters and their grads (4 B/param), the bf16
    reference and its gathered copy (4 B/param); activations of one micro-batch of
    ``MAX_TOKENS`` tokens in bf16: per layer about 34 x hidden + 6 x intermediate values a token
    (the attention block's and the MLP's saved inputs and outputs), and one log-prob chunk's fp32
    logits over a vocabulary of a few hundred (negligible here). 25% slack for the allocator."""
    static = 24 * n_params
    acts = MAX_TOKENS * layers * (34 * hidden + 6 * intermediate) * 2
    return int(1.25 * (static + acts))


_RANK = r"""
import json, os, sys, time
import torch, torch.distributed as dist
from learner.parallel import build_models, init_group, reduce_scalar
from learner.trainer import Learner
from reval.config import load_config
from reval.policy import compute_dtype
from tests.conftest import make_traj

out, sets = sys.argv[1], json.loads(sys.argv[2])
cfg = load_config(overrides=sets, environ={})
device = init_group(cfg.model.device, cfg.sync.backend, 120)
facts = {"device": str(device), "current": torch.cuda.current_device(),
         "backend": str(dist.get_backend_config())}
facts["reduce"] = reduce_scalar(0.25, "sum")  # float64 CPU tensor: NCCL alone refuses it
box = [{"rank": dist.get_rank()}]
dist.broadcast_object_list(box, src=0)
facts["object"] = box[0]
t = torch.ones(4, device=device)
dist.all_reduce(t)
facts["cuda_reduce"] = t.tolist()
torch.cuda.reset_peak_memory_stats()
tok, model, ref = build_models(cfg, device)
facts["start_peak"] = torch.cuda.max_memory_allocated()
facts["n_params"] = sum(p.numel() for p in model.parameters())
facts["master_dtypes"] = sorted({str(p.dtype) for p in model.parameters()})
facts["ref_dtypes"] = sorted({str(p.dtype) for p in ref.parameters()})
learner = Learner(model, cfg.learner, cfg.algo, tok.pad_token_id, tok.eos_token_id, device,
                  reference_model=ref, reduce=reduce_scalar, compute_dtype=compute_dtype(cfg.model))
first = {n: p.detach().to_local().float().clone() for n, p in model.named_parameters()}
trajs = [make_traj(i, reward=float(i % 2), plen=64, rlen=448) for i in range(32)]
losses, times = [], []
torch.cuda.reset_peak_memory_stats()
for step in range(int(sys.argv[3])):
    for tr in trajs:
        tr.ref_version = -1
    torch.cuda.synchronize(); t0 = time.perf_counter()
    res = learner.update(trajs)
    torch.cuda.synchronize(); times.append(time.perf_counter() - t0)
    losses.append(res.metrics["loss"])
facts["peak"] = torch.cuda.max_memory_allocated()
facts["losses"], facts["times"] = losses, times
moved = total = 0
for n, p in model.named_parameters():
    d = p.detach().to_local().float() - first[n]
    moved += int((d != 0).sum()); total += d.numel()
facts["moved_fraction"] = moved / total
facts["steps"] = learner.step
Path = __import__("pathlib").Path
Path(out).write_text(json.dumps(facts))
dist.destroy_process_group()
"""


def _run_rank(tmp_path: Path, sets: list[str], updates: int) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "facts.json"
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0",
           "WORLD_SIZE": "1", "LOCAL_RANK": "0", "PYTHONPATH": path}  # fmt: skip
    subprocess.run([sys.executable, "-c", _RANK, str(out), json.dumps(sets), str(updates)],
                   cwd=ROOT, env=env, check=True, timeout=900)  # fmt: skip
    return json.loads(out.read_text())


@pytest.mark.timeout(900)
def test_learner_rank_on_cuda_bf16_masters_memory_and_time(tmp_path):
    facts = _run_rank(tmp_path, settings(), UPDATES)
    print(json.dumps({k: v for k, v in facts.items() if k != "losses"}))
    assert facts["device"] == "cuda:0" and facts["current"] == 0
    assert "cuda:nccl" in facts["backend"] and "cpu:gloo" in facts["backend"]
    assert facts["reduce"] == 0.25 and facts["object"] == {"rank": 0}
    assert facts["cuda_reduce"] == [1.0] * 4
    assert facts["master_dtypes"] == ["torch.float32"]
    assert facts["ref_dtypes"] == ["torch.bfloat16"]
    assert all(map(lambda x: x == x and abs(x) < float("inf"), facts["losses"]))
    assert facts["steps"] == UPDATES  # no step skipped for a non-finite norm
    assert facts["moved_fraction"] > 0.9  # lr 1e-6 moves the fp32 masters
    sh = {k.split(".")[-1]: v for k, v in QWEN_05B.items()}
    budget = memory_budget(
        facts["n_params"], sh["hidden_size"], sh["num_layers"], sh["intermediate_size"]
    )
    assert facts["peak"] <= budget, (facts["peak"], budget)
    times = facts["times"]
    late, early = sorted(times[UPDATES // 2 :]), sorted(times[1 : UPDATES // 2])
    # steady: the second half's median update is no slower than the first's (no growth)
    assert late[len(late) // 2] <= 1.5 * early[len(early) // 2], times


@pytest.mark.timeout(300)
def test_chunked_logprobs_peak_memory_at_qwen_vocabulary():
    """[B, T, V] = 4 x 2048 x 151936: 5 GB of fp32 logits; the chunked path holds one chunk's."""
    import torch.nn.functional as F

    from learner.sequence import chunked_logp_lse

    dev = torch.device("cuda")
    b, t, h, v = 4, 2048, 896, 151936

    def peak(fn) -> int:
        torch.manual_seed(0)
        hid = torch.randn(b, t, h, device=dev, dtype=torch.bfloat16, requires_grad=True)
        w = torch.randn(v, h, device=dev, dtype=torch.bfloat16, requires_grad=True)
        y = torch.randint(0, v, (b, t), device=dev)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn(hid, w, y).sum().backward()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base

    def plain(hid, w, y):
        return F.log_softmax(F.linear(hid, w).float(), -1).gather(-1, y[..., None])[..., 0]

    def chunked(hid, w, y):
        return chunked_logp_lse(hid, w, None, y)[..., 0]

    p, c = peak(plain), peak(chunked)
    print(json.dumps({"plain_bytes": p, "chunked_bytes": c, "ratio": c / p}))
    assert c < 0.3 * p, (c, p)  # (H100, torch 2.11: 3.4 GB against 15.0 GB, 0.23)


@pytest.mark.timeout(300)
def test_packed_rows_through_flash_varlen_match_padded_ones_in_bf16():
    """``VARLEN_SDPA`` on CUDA runs a packed row through torch's flash varlen kernel
    (``learner/sequence.py`` ``CUDA_VARLEN``): the same per-token log-probs as padded rows
    (bf16 tolerance), and the kernel was taken (no fallback)."""
    from learner import sequence
    from learner.sequence import make_batch, policy_stats, use_varlen_attention
    from reval.config import TinyModelConfig
    from reval.policy import build_tiny_model
    from tests.conftest import make_traj

    dev = torch.device("cuda")
    shape = TinyModelConfig(
        hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=64,
        intermediate_size=512, max_position_embeddings=1024,
    )  # fmt: skip
    model = build_tiny_model(shape, 64, 0, 1, seed=0).to(dev)
    trajs = [make_traj(i, plen=8 + 5 * i, rlen=40 + 17 * i) for i in range(6)]
    padded = policy_stats(model, make_batch(trajs, 0, 1, False).to(dev), torch.bfloat16).logp
    use_varlen_attention(model)
    sequence._VARLEN_FAILED.clear()
    packed = policy_stats(model, make_batch(trajs, 0, 1, True).to(dev), torch.bfloat16).logp
    assert sequence._VARLEN_FAILED == []
    for i, t in enumerate(trajs):
        n = t.response_ids.size
        torch.testing.assert_close(packed[i, :n].float(), padded[i, :n].float(), atol=3e-2, rtol=0)
