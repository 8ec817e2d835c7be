"""Hand-run benchmark: the time of a ReVal update over a GRPO update on the same batch, in the
same run (one process, CPU, fp32), with the reference quantities cached on the records (what the
replay buffer keeps between reference resets).

    .venv/bin/python benchmarks/learner_bench.py        # figures go into docs/learner.md

Target (the learner-service issue): ReVal / GRPO at most 1.05 with cached reference quantities.

**LoRA (``--lora RANK``).** A ReVal update of the full model against the same model with rank
``RANK`` adapters on all linear layers (``reval.lora.wrap``), each in a process of its own
(fresh memory): the update's median time, the process's peak resident memory over what the
model alone took (the learner: optimizer state, gradients, the reference, activations), and the
learner's state counted tensor by tensor (``learner/memory.py``'s terms, issue 41):

    .venv/bin/python benchmarks/learner_bench.py --lora 32
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import resource
import statistics
import time
from typing import Any

import numpy as np
import torch

from buffer.records import Trajectory
from learner.trainer import Learner
from reval.config import AlgoConfig, LearnerConfig, ModelConfig, TinyModelConfig
from reval.policy import load_policy


def make_batch(b: int, prompt: int, response: int, vocab: int, seed: int) -> list[Trajectory]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(b):
        t = Trajectory(
            prompt_ids=rng.integers(3, vocab, prompt),
            response_ids=np.append(rng.integers(3, vocab, response - 1), 1),
            logprobs=-rng.random(response).astype(np.float32),
            reward_raw=float(i % 2),
            reward=float(i % 2),
            group_id=f"g{i // 8}",
        )
        out.append(t)
    return out


LORA_SHAPE = TinyModelConfig(
    hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=2, head_dim=64,
    intermediate_size=1536, max_position_embeddings=256,
)  # fmt: skip
"""The ``--lora`` model: 24M parameters (Qwen2's layout), big enough that state, not
Python, sets the memory."""


def _state_bytes(learner: Learner) -> dict[str, int]:
    """The learner's state by kind, counted from its tensors."""
    model = learner.model
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    grads = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters()
                if p.grad is not None)  # fmt: skip
    optim = sum(t.numel() * t.element_size() for st in learner.optimizer.state.values()
                for t in st.values() if torch.is_tensor(t))  # fmt: skip
    held = learner.reference.model  # (a frozen copy of the model, or the adapters' snapshot)
    ref = sum(t.numel() * t.element_size() for t in (*held.parameters(), *held.buffers()))
    return {"params": params, "grads": grads, "optimizer": optim, "reference": ref}


def _lora_mode(rank: int, args: argparse.Namespace, q: Any) -> None:
    """One mode in a process of its own: the full model (``rank`` 0) or its adapters."""
    from reval import lora
    from reval.config import LoraConfig

    torch.set_num_threads(args.threads)
    policy = load_policy(ModelConfig(device="cpu", tiny=LORA_SHAPE), seed=0)
    model = lora.wrap(policy.model, LoraConfig(rank=rank)) if rank else policy.model
    base_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    learner = Learner(model, LearnerConfig(lr=1e-5, micro_batch_size=16), AlgoConfig(name="reval"),
                      policy.pad_id, policy.eos_id, torch.device("cpu"))  # fmt: skip
    batch = make_batch(args.batch, 32, args.response, policy.model.config.vocab_size, 0)
    learner.reference.fill(batch, torch.device("cpu"))  # (cached, as in the buffer)
    learner.update(batch)  # (warm-up)
    times = []
    for _ in range(args.reps):
        t0 = time.perf_counter()
        learner.update(batch)
        times.append(time.perf_counter() - t0)
    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    peak_mb = (peak_kb - base_kb) / 1024
    q.put({"rank": rank, "update_s": statistics.median(times), "peak_mb": peak_mb,
           "trainable": trainable, "state": _state_bytes(learner)})  # fmt: skip


def lora_main(args: argparse.Namespace) -> int:
    ctx = mp.get_context("spawn")
    rows = []
    for rank in (0, args.lora):
        q = ctx.Queue()
        p = ctx.Process(target=_lora_mode, args=(rank, args, q))
        p.start()
        rows.append(q.get(timeout=1800))
        p.join()
    full = rows[0]
    print(
        f"# ReVal update, full model against rank-{args.lora} LoRA (all linear layers), "
        f"B={args.batch}, {args.response}-token responses, {args.threads} thread(s), median "
        f"of {args.reps}; peak: the process's resident memory over the model's alone\n"
    )
    print("| mode | trainable | update s | peak MB | state MB | params MB | grads MB | "
          "optimizer MB | reference MB |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        st = {k: v / 1e6 for k, v in r["state"].items()}
        name = f"LoRA r={r['rank']}" if r["rank"] else "full"
        print(f"| {name} | {r['trainable']:,} | {r['update_s']:.3f} | {r['peak_mb']:.0f} | "
              f"{sum(st.values()):.1f} | {st['params']:.1f} | {st['grads']:.1f} | "
              f"{st['optimizer']:.1f} | {st['reference']:.1f} |")  # fmt: skip
    lo = rows[1]
    state = {r["rank"]: sum(r["state"].values()) for r in rows}
    print(f"\nLoRA / full: update time {lo['update_s'] / full['update_s']:.2f}, peak memory "
          f"{lo['peak_mb'] / full['peak_mb']:.2f}, learner state "
          f"{state[args.lora] / state[0]:.2f}")  # fmt: skip
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--response", type=int, default=64)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument(
        "--lora",
        type=int,
        default=0,
        metavar="RANK",
        help="the full model's update against rank-RANK adapters'",
    )
    ap.add_argument("--threads", type=int, default=1, help="--lora: torch threads per mode")
    args = ap.parse_args()
    if args.lora:
        return lora_main(args)
    shape = TinyModelConfig(hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=64,
                            intermediate_size=512, max_position_embeddings=256)  # fmt: skip
    cfg = ModelConfig(device="cpu", tiny=shape)
    policy = load_policy(cfg, seed=0)
    vocab = policy.model.config.vocab_size
    lcfg = LearnerConfig(lr=1e-6, micro_batch_size=32)
    learners = {
        name: Learner(
            policy.model,
            lcfg,
            AlgoConfig(name=name),
            policy.pad_id,
            policy.eos_id,
            torch.device("cpu"),
        )
        for name in ("reval", "grpo")
    }
    batch = make_batch(args.batch, 32, args.response, vocab, 0)
    learners["reval"].reference.fill(batch, torch.device("cpu"))  # cached, as in the buffer
    times: dict[str, list[float]] = {"reval": [], "grpo": []}
    for name in ("reval", "grpo"):  # warm-up
        learners[name].update(batch)
    for _ in range(args.reps):
        for name in ("reval", "grpo"):
            t0 = time.perf_counter()
            learners[name].update(batch)
            times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"# ReVal vs GRPO update, B={args.batch}, {args.response}-token responses, "
          f"{sum(p.numel() for p in policy.model.parameters()) / 1e6:.1f}M params, "
          f"median of {args.reps}\n")  # fmt: skip
    print("| loss | update s | ratio to GRPO |")
    print("|---|---|---|")
    for k in ("grpo", "reval"):
        print(f"| {k} | {med[k]:.3f} | {med[k] / med['grpo']:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
