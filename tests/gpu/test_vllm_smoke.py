"""The GPU smoke run with vLLM: one learner rank (NCCL group, FSDP2, bf16 compute on fp32
masters, the token budget) and one vLLM engine on the same GPU, on a random model of
Qwen2.5-0.5B's shape, 20 updates: generate with vLLM, update the learner on what it generated,
hand the weights to vLLM (``VLLMEngine.load_weights``: the file path the workers take), and
compare.

It asserts that every loss is finite, that vLLM's weights after each sync equal the learner's
(checksums of all parameters in bf16, summed in float64: vLLM fuses q/k/v and gate/up and pads
the vocabulary with zero rows, which leave the sums unchanged), that the fp32 masters move at
lr 1e-6, the time per update (steady: the second half is no slower than the first), and the
peak learner memory against ``memory_budget`` (test_learner_gpu.py). Needs CUDA and vLLM 0.32
(``pip install 'reval[gpu]'``); skipped without either, collected everywhere.

Beyond test_learner_gpu.py, a GPU shows here what no CPU test can: vLLM's GPU worker taking the
learner's weights in place (CUDA graphs and the fused layouts of the GPU model runner), the two
sharing one device's memory under ``rollout.vllm_gpu_memory_utilization``, and behaviour
log-probs from vLLM's bf16 kernels feeding the learner. Not covered: two learner ranks (needs two
GPUs), the NCCL broadcast hub (two processes on two devices)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
import torch

from tests.gpu.test_learner_gpu import QWEN_05B, ROOT, UPDATES, memory_budget, settings

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

_RUN = r"""
import json, sys, tempfile, time
from pathlib import Path
import numpy as np, torch, torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from buffer.records import Trajectory
from learner.parallel import build_models, init_group, reduce_scalar
from learner.trainer import Learner
from reval.config import load_config
from reval.policy import compute_dtype
from rollout.engines import SamplingParams
from rollout.vllm_engine import VLLMEngine
from rollout.generators import tiny_checkpoint

out, sets, updates = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
cfg = load_config(overrides=sets, environ={})
device = init_group(cfg.model.device, cfg.sync.backend, 300)
tok, model, ref = build_models(cfg, device)
learner = Learner(model, cfg.learner, cfg.algo, tok.pad_token_id, tok.eos_token_id, device,
                  reference_model=ref, reduce=reduce_scalar, compute_dtype=compute_dtype(cfg.model))
tmp = tempfile.TemporaryDirectory()
path, tok_dir = tiny_checkpoint(cfg, cfg.seed, Path(tmp.name))
engine = VLLMEngine(path, seed=0, dtype=cfg.model.dtype, tokenizer=tok_dir,
                    gpu_memory_utilization=0.3, max_model_len=1024)
opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
dtype = compute_dtype(cfg.model)

def learner_sums():
    sd = get_model_state_dict(model, options=opts)
    seen, s1, s2 = set(), 0.0, 0.0
    for name, t in sd.items():
        if name == "lm_head.weight" and "model.embed_tokens.weight" in sd:
            continue  # tied
        x = t.to(dtype).double()
        s1 += float(x.sum()); s2 += float((x * x).sum())
    return sd, s1, s2

def vllm_sums(worker):
    s1 = s2 = 0.0
    for name, p in worker.get_model().named_parameters():
        x = p.detach().double()
        s1 += float(x.sum()); s2 += float((x * x).sum())
    return s1, s2

first = {n: p.detach().to_local().float().clone() for n, p in model.named_parameters()}
rng = np.random.default_rng(0)
facts = {"losses": [], "times": [], "sums": []}
torch.cuda.reset_peak_memory_stats()
for step in range(updates):
    prompts = [list(rng.integers(3, 50, 16)) for _ in range(8)]
    samples = engine.generate(prompts, SamplingParams(n=4, max_new_tokens=256), seed=step)
    trajs = []
    for i, (p, group) in enumerate(zip(prompts, samples)):
        for j, s in enumerate(group):
            r = float(len(s.token_ids) % 2)
            trajs.append(Trajectory(prompt_ids=np.asarray(p), response_ids=s.token_ids,
                logprobs=s.logprobs, reward_raw=r, reward=r, prompt_id=f"p{i}",
                group_id=f"s{step}g{i}", policy_version=step, traj_id=f"s{step}t{i}.{j}"))
    torch.cuda.synchronize(); t0 = time.perf_counter()
    res = learner.update(trajs)
    torch.cuda.synchronize(); facts["times"].append(time.perf_counter() - t0)
    facts["losses"].append(res.metrics["loss"])
    sd, a1, a2 = learner_sums()
    engine.load_weights(sd.items(), step + 1)
    (b1, b2), = engine.llm.collective_rpc(vllm_sums)
    facts["sums"].append([a1, a2, b1, b2])
facts["peak"] = torch.cuda.max_memory_allocated()
facts["n_params"] = sum(p.numel() for p in model.parameters())
moved = total = 0
for n, p in model.named_parameters():
    d = p.detach().to_local().float() - first[n]
    moved += int((d != 0).sum()); total += d.numel()
facts["moved_fraction"] = moved / total
Path(out).write_text(json.dumps(facts))
engine.close()
dist.destroy_process_group()
"""


@pytest.mark.timeout(900)
def test_learner_and_vllm_20_updates(tmp_path):
    pytest.importorskip("vllm")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "facts.json"
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0",
           "WORLD_SIZE": "1", "LOCAL_RANK": "0", "PYTHONPATH": path}  # fmt: skip
    sets = settings({"model.tiny.max_position_embeddings": 1024})
    subprocess.run([sys.executable, "-c", _RUN, str(out), json.dumps(sets), str(UPDATES)],
                   cwd=ROOT, env=env, check=True, timeout=880)  # fmt: skip
    facts = json.loads(out.read_text())
    print(json.dumps({k: v for k, v in facts.items() if k != "sums"}))
    assert all(abs(x) < float("inf") for x in facts["losses"])
    for a1, a2, b1, b2 in facts["sums"]:  # the weights arrived, every version
        assert b1 == pytest.approx(a1, rel=1e-6, abs=1e-3)
        assert b2 == pytest.approx(a2, rel=1e-6)
    assert facts["moved_fraction"] > 0.9
    sh = {k.split(".")[-1]: v for k, v in QWEN_05B.items()}
    budget = memory_budget(
        facts["n_params"], sh["hidden_size"], sh["num_layers"], sh["intermediate_size"]
    )
    assert facts["peak"] <= budget, (facts["peak"], budget)
    times = facts["times"]
    late, early = sorted(times[UPDATES // 2 :]), sorted(times[1 : UPDATES // 2])
    assert late[len(late) // 2] <= 1.5 * early[len(early) // 2], times
