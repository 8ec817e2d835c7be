"""Hand-run benchmark: packed against padded micro-batches (issue 27), CPU, fp32, one process.

    .venv/bin/python benchmarks/learner_pack_bench.py        # figures go into docs/learner.md

1. Useful / computed tokens of the micro-batching on an RL-like length distribution (prompts
   uniform in 64-512 tokens, responses log-normal with median 2,000 and sigma ``--sigma``, capped
   at 8,192; 64 trajectories per update): the paper presets' padded micro-batches
   (``micro_batch_size = 8``, no token budget), padded with a 16k budget, and packed with the
   same budget (computed = what the forward runs on: padded count x (longest prompt + longest
   response), packed the sum of the lengths). At full scale, from the lengths alone.
2. Update times (a Llama-shaped model of width 128, 2 layers, vocabulary 512; ReVal, reference
   quantities cached; wall and this process's CPU time, the
   latter steadier on a shared machine) through ``Learner.update`` with a tiny
   model, every length divided by ``--scale`` (so it runs in a couple of minutes on two cores):
   on the RL-like lengths for the three micro-batchings (useful tokens/s), and on equal lengths
   (512 + 3,584 scaled) padded against packed with the same trajectories per micro-batch: the
   packed / padded time ratio, the configurations interleaved in one run, best of ``--reps``
   (the machine is shared: the minimum is the least disturbed).

Targets: packed useful / computed >= 0.97; packed no slower than padded on equal lengths.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from buffer.records import Trajectory
from learner.batches import micro_batches
from learner.trainer import Learner
from reval.config import AlgoConfig, LearnerConfig, TinyModelConfig
from reval.policy import build_tiny_model

PAD, EOS, VOCAB = 0, 1, 512
FULL_BUDGET = 16_384


def rl_lengths(n: int, rng: np.random.Generator, sigma: float) -> list[tuple[int, int]]:
    prompts = rng.integers(64, 513, n)
    responses = np.minimum(np.exp(np.log(2000.0) + sigma * rng.standard_normal(n)), 8192)
    return [(int(p), max(1, int(r))) for p, r in zip(prompts, responses, strict=True)]


def computed_tokens(sizes: list[tuple[int, int]], parts: list[list[int]], packed: bool) -> int:
    if packed:
        return sum(sizes[i][0] + sizes[i][1] for p in parts for i in p)
    return sum(len(p) * (max(sizes[i][0] for i in p) + max(sizes[i][1] for i in p)) for p in parts)


PLANS = {  # name: (micro_batch_size, token budget at full scale, packed)
    "padded, presets (8 per micro-batch, no budget)": (8, None, False),
    "padded, 16k budget": (64, FULL_BUDGET, False),
    "packed, 16k budget": (64, FULL_BUDGET, True),
}


def token_ratios(batches: int, batch: int, sigma: float, seed: int) -> None:
    rng = np.random.default_rng(seed)
    draws = [rl_lengths(batch, rng, sigma) for _ in range(batches)]
    print(
        f"useful / computed tokens, {batches} batches of {batch} RL-like trajectories (full scale)"
    )
    for name, (count, budget, packed) in PLANS.items():
        useful = computed = parts_n = 0
        for sizes in draws:
            parts = micro_batches(sizes, count, budget, packed)
            useful += sum(p + r for p, r in sizes)
            computed += computed_tokens(sizes, parts, packed)
            parts_n += len(parts)
        print(
            f"  {name:48s} {useful / computed:.3f}   micro-batches/update {parts_n / batches:.1f}"
        )


def trajectories(sizes: list[tuple[int, int]], seed: int) -> list[Trajectory]:
    rng = np.random.default_rng(seed)
    out = []
    for i, (p, r) in enumerate(sizes):
        resp = np.append(rng.integers(3, VOCAB, r - 1), EOS)
        out.append(
            Trajectory(
                prompt_ids=rng.integers(3, VOCAB, p),
                response_ids=resp,
                logprobs=-rng.random(r).astype(np.float32),
                reward_raw=float(i % 2),
                reward=float(i % 2),
                group_id=f"g{i // 8}",
            )
        )
    return out


def time_updates(
    model: torch.nn.Module,
    plans: dict[str, tuple[int, int | None, bool]],
    ts: list[Trajectory],
    reps: int,
) -> dict[str, tuple[float, float]]:
    """Each plan's (wall, CPU) seconds of one update, best of ``reps``."""
    learners = {
        name: Learner(
            model,
            LearnerConfig(lr=1e-7, micro_batch_size=c, max_tokens_per_micro_batch=b, packing=pk),
            AlgoConfig(name="reval"),
            PAD,
            EOS,
            torch.device("cpu"),
        )
        for name, (c, b, pk) in plans.items()
    }
    for lrn in learners.values():
        lrn.update(ts)  # warm-up; fills the reference quantities (cached from here on)
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in plans}
    for _ in range(reps):  # interleaved, so drift on a shared machine hits every plan alike
        for name, lrn in learners.items():
            t0, c0 = time.perf_counter(), time.process_time()
            lrn.update(ts)
            times[name].append((time.perf_counter() - t0, time.process_time() - c0))
    return {name: (min(w for w, _ in v), min(c for _, c in v)) for name, v in times.items()}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--scale", type=int, default=16, help="lengths divided by this for timing")
    ap.add_argument("--sigma", type=float, default=0.8, help="log-normal sigma of the responses")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--batches", type=int, default=200, help="draws for the token ratios")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    token_ratios(args.batches, args.batch, args.sigma, seed=0)

    s = args.scale
    shape = TinyModelConfig(
        hidden_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        intermediate_size=256,
        max_position_embeddings=8192 // s + 512 // s,
    )
    model = build_tiny_model(shape, VOCAB, PAD, EOS, seed=0)
    budget = FULL_BUDGET // s
    full = rl_lengths(args.batch, np.random.default_rng(1), args.sigma)
    sizes = [(max(1, p // s), max(1, r // s)) for p, r in full]
    ts = trajectories(sizes, seed=2)
    useful = sum(p + r for p, r in sizes)
    plans = {n: (c, None if b is None else budget, pk) for n, (c, b, pk) in PLANS.items()}
    print(
        f"\nupdate time, ReVal with the reference cached, {args.batch} RL-like trajectories at "
        f"1/{s} scale ({useful} useful tokens, budget {budget}), best of {args.reps}"
    )
    rl = time_updates(model, plans, ts, args.reps)
    for name, (t, c) in rl.items():
        print(f"  {name:48s} {t:7.3f} s (CPU {c:7.3f} s)  {useful / t:8.0f} useful tokens/s")

    eq = trajectories([(512 // s, 3584 // s)] * 32, seed=3)
    n = 512 // s + 3584 // s
    eq_plans = {
        "padded (8 per micro-batch)": (8, None, False),
        "packed (8 per micro-batch)": (8, 8 * n, True),
    }
    times = time_updates(model, eq_plans, eq, args.reps)
    print(f"\nequal lengths, 32 x ({512 // s} + {3584 // s}) tokens, best of {args.reps}")
    for name, (t, c) in times.items():
        print(f"  {name:48s} {t:7.3f} s (CPU {c:7.3f} s)")
    (a, ac), (b, bc) = times.values()
    print(f"  packed / padded time: {b / a:.3f} wall, {bc / ac:.3f} CPU")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
