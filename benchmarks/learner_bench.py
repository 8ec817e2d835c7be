"""Hand-run benchmark: the time of a ReVal update over a GRPO update on the same batch, in the
same run (one process, CPU, fp32), with the reference quantities cached on the records (what the
replay buffer keeps between reference resets).

    .venv/bin/python benchmarks/learner_bench.py        # figures go into docs/learner.md

Target (the learner-service issue): ReVal / GRPO at most 1.05 with cached reference quantities.
"""

from __future__ import annotations

import argparse
import statistics
import time

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


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--response", type=int, default=64)
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
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
