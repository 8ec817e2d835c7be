"""Hand-run benchmark of a rollout worker's two costs on this machine: generation (the HF engine,
the demo's tiny model) and grading (the demo's exact-match verifier, and math-verify in the
process pool on the same number of answers), with the share of a worker's time grading takes.

    .venv/bin/python benchmarks/rollout_bench.py            # figures go into docs/rollout.md

Target (the rollout issue): grading is never more than 5% of a worker's time at the demo's
settings (32 prompts x 16 answers, at most 4 new tokens).
"""

from __future__ import annotations

import argparse
import os
import random
import time

import torch

from reval.config import load_config
from reval.policy import load_policy
from rollout.collect import collect_round, encode_prompts, score_all
from rollout.engines import HFEngine, SamplingParams
from rollout.tasks import build_task


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--pool-workers", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    cfg = load_config("configs/demo.toml", environ={})
    policy = load_policy(cfg.model, cfg.seed)
    policy.model.eval()
    engine = HFEngine(policy.model, policy.pad_id, policy.eos_id, policy.device)
    task = build_task(cfg.task, cfg.seed, policy.tokenizer)
    rng = random.Random(0)
    prompts = list(task.prompts)
    params = SamplingParams(
        n=cfg.rollout.n,
        temperature=cfg.rollout.temperature,
        max_new_tokens=cfg.rollout.max_new_tokens,
    )
    print(f"# Rollout worker costs (demo settings: {cfg.rollout.prompts_per_round} prompts x "
          f"{cfg.rollout.n} answers, max {cfg.rollout.max_new_tokens} new tokens)\n")  # fmt: skip
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, {torch.get_num_threads()} threads\n")

    # Generation throughput at the demo's length and at a longer one.
    print("| max new tokens | answers | tokens | seconds | tokens/s |")
    print("|---|---|---|---|---|")
    for max_new in (cfg.rollout.max_new_tokens, 64):
        p = SamplingParams(n=cfg.rollout.n, temperature=1.0, max_new_tokens=max_new)
        ids = encode_prompts(policy.tokenizer, rng.sample(prompts, cfg.rollout.prompts_per_round))
        for w in range(2):  # warm-up (first calls at a new shape are slow)
            engine.generate(ids, p, seed=w)
        t0 = time.perf_counter()
        tokens = answers = 0
        for k in range(args.rounds):
            out = engine.generate(ids, p, seed=k + 1)
            tokens += sum(s.token_ids.size for g in out for s in g)
            answers += sum(len(g) for g in out)
        dt = time.perf_counter() - t0
        print(f"| {max_new} | {answers} | {tokens} | {dt:.2f} | {tokens / dt:,.0f} |")

    # Grading share of whole rounds (what a worker does per batch).
    gen_s = verify_s = 0.0
    texts = []
    for k in range(args.rounds):
        chosen = rng.sample(prompts, cfg.rollout.prompts_per_round)
        t0 = time.perf_counter()
        res = collect_round(
            engine, policy.tokenizer, task, chosen, params, seed=100 + k,
            reward_variant=cfg.algo.reward, group_prefix=f"b{k}",
        )  # fmt: skip
        gen_s += time.perf_counter() - t0 - res.verify_s
        verify_s += res.verify_s
        by_id = {p.id: p for p in chosen}
        texts += [
            (by_id[t.prompt_id], "\\boxed{" + policy.tokenizer.decode(t.response_ids) + "}")
            for t in res.trajectories
        ]  # what math-verify would grade: this model's answers, boxed
    print("\n| verifier | answers/round | grading s/round | generation s/round | grading share |")
    print("|---|---|---|---|---|")
    per = cfg.rollout.prompts_per_round * cfg.rollout.n
    g, v = gen_s / args.rounds, verify_s / args.rounds
    print(f"| exact match (the demo's) | {per} | {v:.4f} | {g:.3f} | {v / (g + v):.1%} |")
    try:
        from rollout.grading.pool import VerifierPool
    except ImportError as err:  # pragma: no cover - math-verify is a dependency
        print(f"math-verify pool not measured: {err}")
        return 0

    class Pooled:
        def __init__(self, pool: VerifierPool) -> None:
            self.pool = pool

        def score_many(self, pairs: list) -> list[float]:
            return self.pool.score_many([(p.answer, r) for p, r in pairs])

    with VerifierPool(workers=args.pool_workers) as pool:
        pool.wait_ready()
        batch = texts[:per]
        score_all(Pooled(pool), batch)  # warm-up: sympy imports in the workers
        t0 = time.perf_counter()
        for _ in range(args.rounds):
            score_all(Pooled(pool), batch)
        pv = (time.perf_counter() - t0) / args.rounds
    print(
        f"| math-verify, pool of {args.pool_workers} (this model's answers, boxed) | {per} | "
        f"{pv:.4f} | "
        f"{g:.3f} | {pv / (g + pv):.1%} |"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
