"""Hand-run benchmark: reval against TRL's ``GRPOTrainer`` on the same model, task and machine
(docs/peers.md). Needs the ``peers`` extra (``pip install -e '.[peers]'``, or ``make venv-peers``).

    OMP_NUM_THREADS=1 .venv-peers/bin/python benchmarks/peer_bench.py --seeds 3   # docs/peers/
    OMP_NUM_THREADS=1 .venv-peers/bin/python benchmarks/peer_bench.py --quick     # smoke run

Every run starts from the demo's model (``configs/demo.toml``: the tiny model, the character
tokenizer, the same 300 pretraining steps on the addition task's format, seeded), samples the same
prompts (32 of the 100 ``a+b=`` per round), the same reward (exact match), the same sampling
(n = 16, temperature, 4 new tokens, top-p 1) and the same generation budget (``--rounds`` rounds of
512 trajectories). The variants:

- ``TRL GRPO``: ``GRPOTrainer`` with the settings of reval's GRPO (``trl_config``; docs/peers.md
  lists each one and the few that cannot be matched);
- ``reval GRPO``: ``reval train --algo grpo`` with one update of the whole round (B = 512) per
  round, like TRL's ``num_iterations=1``, ``steps_per_generation=1``;
- ``reval ReVal K=k``: the demo's ReVal with k updates of B = 256 per round.

Success is the demo's evaluation (all 100 prompts, 4 samples each at temperature 1, the same
seeds for every variant) every ``--eval-every`` rounds. Each run is its own process (its peak RSS
is that run's); runs go one after another. Times exclude the evaluations. "Learner tokens/s" is
response tokens trained per second of update time (a round's time less its generation).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
ROUND_TRAJECTORIES = 512
"""Trajectories per generation round: the demo's 32 prompts x 16 answers."""
VARIANTS: dict[str, tuple[str, ...]] = {
    "TRL GRPO": (),
    "reval GRPO": (
        "algo.name=grpo",
        "learner.updates_per_round=1",
        "learner.first_update_fresh=true",
        "learner.batch_size=512",
    ),
    **{f"reval ReVal K={k}": (f"learner.updates_per_round={k}",) for k in (1, 2, 4, 8)},
}
"""Label -> overrides of configs/demo.toml (TRL reads the same config: ``trl_config``)."""


@dataclass
class RunResult:
    variant: str
    seed: int
    curve: list[dict[str, float]] = field(default_factory=list)
    """Per round: round, trajectories, train_s (cumulative, evaluations excluded), reward_mean,
    eval_success where evaluated."""
    learner_tokens: int = 0
    learner_s: float = 0.0
    gen_s: float = 0.0
    peak_rss_mb: float = 0.0
    wall_s: float = 0.0
    nonfinite_round: int | None = None
    """TRL: the first round after which a weight was NaN or infinite (reval skips such steps:
    its learner's ``skipped_steps``)."""


def base_overrides(args: argparse.Namespace, seed: int) -> list[str]:
    out = [
        f"seed={seed}",
        f"learner.rounds={args.rounds}",
        f"rollout.temperature={args.temperature}",
        f"eval.every={args.eval_every}",
        "metrics.plot=false",
        "metrics.progress=false",
        f"output_dir={args.runs_dir}",
    ]
    if args.pretrain_steps is not None:
        out.append(f"model.pretrain_steps={args.pretrain_steps}")
    return out


def run_reval(variant: str, seed: int, args: argparse.Namespace) -> RunResult:
    from reval.config import load_config
    from services.train import train

    slug = variant.replace(" ", "-").replace("=", "")
    cfg = load_config(
        str(ROOT / "configs" / "demo.toml"),
        [*base_overrides(args, seed), *VARIANTS[variant], f"name=peers-{slug}-s{seed}"],
    )
    res = RunResult(variant, seed)
    spent = 0.0

    def progress(rec: dict[str, Any]) -> None:
        nonlocal spent
        rnd = int(rec["round"])
        point: dict[str, float] = {"round": rnd, "trajectories": rnd * cfg.round_size}
        if rnd > 0:
            spent += float(rec["round_s"])
            res.gen_s += float(rec["gen_s"])
            res.learner_s += float(rec["round_s"]) - float(rec["gen_s"])
            # Response tokens trained: the round's tokens per trajectory x trajectories trained.
            trained = float(rec["tokens"]) / cfg.round_size * int(rec["updates"]) * cfg.batch_size
            res.learner_tokens += round(trained)
            point["reward_mean"] = float(rec["reward_mean"])
        point["train_s"] = spent
        if "eval_success" in rec:
            point["eval_success"] = float(rec["eval_success"])
        res.curve.append(point)

    train(cfg, progress)
    return res


def trl_config(cfg: Any, out_dir: Path) -> Any:
    """TRL's ``GRPOConfig`` with reval's GRPO settings (docs/peers.md, "Matched settings")."""
    from trl import GRPOConfig

    round_size = cfg.rollout.prompts_per_round * cfg.rollout.n
    return GRPOConfig(
        output_dir=str(out_dir),
        seed=cfg.seed,
        max_steps=cfg.learner.rounds,
        # One round = one generation batch = one optimizer step over all of it (reval GRPO: B =
        # the round, each group once).
        per_device_train_batch_size=round_size,
        steps_per_generation=1,
        gradient_accumulation_steps=1,
        num_generations=cfg.rollout.n,
        num_iterations=1,
        max_completion_length=cfg.rollout.max_new_tokens,
        temperature=cfg.rollout.temperature,
        top_p=cfg.rollout.top_p,
        top_k=0,
        # verl's token-mean over the mini-batch; clip 0.2 / 0.28; no KL; group-std advantages.
        loss_type="dapo",
        epsilon=cfg.algo.clip_low,
        epsilon_high=cfg.algo.clip_high,
        beta=0.0,
        scale_rewards="group",
        mask_truncated_completions=cfg.algo.mask_truncated,
        # reval's optimizer: AdamW, constant lr, no warm-up, no weight decay, clip by norm.
        learning_rate=cfg.learner.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=cfg.learner.weight_decay,
        adam_beta1=cfg.learner.adam_betas[0],
        adam_beta2=cfg.learner.adam_betas[1],
        max_grad_norm=cfg.learner.grad_clip,
        # fp32 on the CPU like reval (GRPOConfig defaults to bf16 autocast, the CPU included).
        bf16=False,
        gradient_checkpointing=False,
        use_cpu=True,
        report_to=[],
        logging_steps=10**9,
        save_strategy="no",
        disable_tqdm=True,
    )


def run_trl(seed: int, args: argparse.Namespace) -> RunResult:
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOTrainer

    from reval.config import load_config
    from rollout.collect import evaluate, score_all
    from rollout.engines import HFEngine
    from services.setup import build_policy_and_task
    from services.train import _eval_prompts

    cfg = load_config(
        str(ROOT / "configs" / "demo.toml"),
        [*base_overrides(args, seed), f"name=peers-trl-s{seed}"],
    )
    policy, task, _info = build_policy_and_task(cfg)
    by_text = {p.text: p for p in task.prompts}
    eval_prompts = _eval_prompts(task, cfg, policy.tokenizer)
    round_size = cfg.rollout.prompts_per_round * cfg.rollout.n
    res = RunResult("TRL GRPO", seed)

    def reward(prompts: list[str], completions: list[str], **_: Any) -> list[float]:
        return score_all(
            task.verifier, [(by_text[p], c) for p, c in zip(prompts, completions, strict=True)]
        )

    class Timed(GRPOTrainer):  # type: ignore[misc]
        """Times generation (and counts the trained response tokens) around TRL's own step."""

        def _generate_and_score_completions(self, inputs: Any) -> Any:
            t0 = time.perf_counter()
            out = super()._generate_and_score_completions(inputs)
            res.gen_s += time.perf_counter() - t0
            res.learner_tokens += int(out["completion_mask"].sum())
            self._round_gen_s = time.perf_counter() - t0
            return out

    def run_eval(model: Any, rnd: int) -> float:
        engine = HFEngine(model, policy.pad_id, policy.eos_id, policy.device)
        with torch.no_grad():
            done = evaluate(engine, policy.tokenizer, task, eval_prompts,
                            cfg.eval.samples_per_prompt, cfg.eval.temperature,
                            cfg.rollout.max_new_tokens, seed=cfg.seed * 1000003 + rnd)  # fmt: skip
        return done.success

    class Curve(TrainerCallback):  # type: ignore[misc]
        def __init__(self) -> None:
            self.spent = 0.0
            self.t0 = 0.0

        def on_train_begin(
            self, _args: Any, state: Any, control: Any, model: Any = None, **kw: Any
        ) -> None:
            res.curve.append({"round": 0, "trajectories": 0, "train_s": 0.0,
                              "eval_success": run_eval(model, 0)})  # fmt: skip

        def on_step_begin(self, *a: Any, **kw: Any) -> None:
            self.t0 = time.perf_counter()

        def on_step_end(
            self, _args: Any, state: Any, control: Any, model: Any = None, **kw: Any
        ) -> None:
            step_s = time.perf_counter() - self.t0
            self.spent += step_s
            res.learner_s += step_s - trainer._round_gen_s
            rnd = int(state.global_step)
            if res.nonfinite_round is None and not all(
                bool(torch.isfinite(p).all()) for p in model.parameters()
            ):
                res.nonfinite_round = rnd
            rewards = trainer._metrics["train"].get("reward") or [float("nan")]
            point = {"round": rnd, "trajectories": rnd * round_size, "train_s": self.spent,
                     "reward_mean": float(rewards[-1])}  # fmt: skip
            if rnd % cfg.eval.every == 0 or rnd == cfg.learner.rounds:
                point["eval_success"] = run_eval(model, rnd)
            res.curve.append(point)

    data = Dataset.from_list([{"prompt": p.text} for p in task.prompts])
    trainer = Timed(
        model=policy.model,
        reward_funcs=reward,
        args=trl_config(cfg, cfg.run_dir),
        train_dataset=data,
        processing_class=policy.tokenizer,
        callbacks=[Curve()],
    )
    trainer.train()
    return res


def run_one(variant: str, seed: int, args: argparse.Namespace) -> RunResult:
    t0 = time.perf_counter()
    res = run_trl(seed, args) if variant == "TRL GRPO" else run_reval(variant, seed, args)
    res.wall_s = time.perf_counter() - t0
    res.peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    return res


def first_at(run: RunResult, threshold: float) -> dict[str, float] | None:
    for p in run.curve:
        if p.get("eval_success", -1.0) >= threshold:
            return p
    return None


def _spread(values: Sequence[float], fmt: str) -> str:
    if not values:
        return "-"
    med = format(statistics.median(values), fmt)
    if len(values) == 1:
        return med
    return f"{med} [{format(min(values), fmt)}-{format(max(values), fmt)}]"


def censored_median(values: Sequence[float | None]) -> float | None:
    """Median over every seed, a run that never reached the threshold counting as above all that
    did (None: it is one of those, i.e. fewer than half the seeds reached it)."""
    order = sorted(values, key=lambda v: (v is None, v if v is not None else 0.0))
    n = len(order)
    if n == 0:
        return None
    lo, hi = order[(n - 1) // 2], order[n // 2]
    if lo is None or hi is None:
        return None
    return (lo + hi) / 2


def summarize(runs: list[RunResult], args: argparse.Namespace) -> dict[str, Any]:
    thr = args.threshold
    rows = []
    lines = [
        f"{args.rounds} rounds of 512 trajectories, seeds {sorted({r.seed for r in runs})}, "
        f"sampling temperature {args.temperature:g}; success = the demo's evaluation every "
        f"{args.eval_every} rounds; threshold {thr:g}. Median [min-max] over the seeds; times "
        "exclude the evaluations.\n",
        f"| variant | reached {thr:g} | median rounds to it (all seeds) | rounds to it "
        "| trajectories to it | seconds to it | final success | learner tokens/s | peak RSS (MB) "
        "| seconds per run |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    medians: dict[str, float | None] = {}
    for variant in VARIANTS:
        mine = [r for r in runs if r.variant == variant]
        if not mine:
            continue
        firsts = [first_at(r, thr) for r in mine]
        hits = [p for p in firsts if p is not None]
        med = censored_median([None if p is None else p["trajectories"] for p in firsts])
        medians[variant] = med
        finals = [next(p["eval_success"] for p in reversed(r.curve) if "eval_success" in p)
                  for r in mine]  # fmt: skip
        tps = [r.learner_tokens / r.learner_s for r in mine if r.learner_s > 0]
        row = {
            "variant": variant,
            "reached": f"{len(hits)}/{len(mine)}",
            "median_trajectories_all_seeds": med,
            "rounds_to_threshold": [p["round"] for p in hits],
            "trajectories_to_threshold": [p["trajectories"] for p in hits],
            "seconds_to_threshold": [p["train_s"] for p in hits],
            "final_success": finals,
            "learner_tokens_per_s": tps,
            "peak_rss_mb": [r.peak_rss_mb for r in mine],
            "wall_s": [r.wall_s for r in mine],
        }
        rows.append(row)
        lines.append(
            f"| {variant} | {row['reached']} | "
            f"{'-' if med is None else format(med / ROUND_TRAJECTORIES, 'g')} | "
            f"{_spread(row['rounds_to_threshold'], 'g')} | "
            f"{_spread(row['trajectories_to_threshold'], 'g')} | "
            f"{_spread(row['seconds_to_threshold'], '.1f')} | {_spread(finals, '.2f')} | "
            f"{_spread(tps, '.0f')} | {_spread(row['peak_rss_mb'], '.0f')} | "
            f"{_spread(row['wall_s'], '.0f')} |"
        )
    trl, ours = medians.get("TRL GRPO"), medians.get("reval GRPO")
    gap = None if not trl or ours is None else ours / trl - 1.0
    said = "not reached by both on half the seeds or more"
    if gap is not None:
        said = f"{ours:g} vs {trl:g} ({gap:+.0%})"
    lines.append(f"\nreval GRPO vs TRL GRPO, median trajectories to the threshold: {said}")
    return {"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows, "grpo_gap": gap,
            "runs": [asdict(r) for r in runs], "table": "\n".join(lines) + "\n"}  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=300, help="generation rounds per run")
    ap.add_argument("--threshold", type=float, default=0.2, help="success counted as reached")
    ap.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--pretrain-steps", type=int, help="default: configs/demo.toml's")
    ap.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "peers")
    ap.add_argument("--runs-dir", type=Path, default=ROOT / "runs" / "peers")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: 1 seed, 2 rounds, 20 pretraining steps")  # fmt: skip
    ap.add_argument("--from-results", action="store_true",
                    help="no runs: tabulate the result files in --runs-dir")  # fmt: skip
    ap.add_argument("--one", nargs=3, metavar=("VARIANT", "SEED", "RESULT"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.quick:
        args.seeds, args.rounds, args.eval_every, args.pretrain_steps = 1, 2, 1, 20
    if args.seeds < 1 or args.rounds < 1 or args.eval_every < 1:
        ap.error("--seeds, --rounds and --eval-every must be >= 1")
    if args.one:
        variant, seed, path = args.one
        Path(path).write_text(json.dumps(asdict(run_one(variant, int(seed), args))))
        return 0
    try:
        import trl  # noqa: F401
    except ImportError:
        print("peer_bench: needs the `peers` extra: pip install -e '.[peers]'", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    args.runs_dir.mkdir(parents=True, exist_ok=True)
    runs: list[RunResult] = []
    passed = sys.argv[1:] if argv is None else list(argv)
    if args.from_results:
        for path in sorted(args.runs_dir.glob("result-*.json")):
            runs.append(RunResult(**json.loads(path.read_text())))
        if not runs:
            ap.error(f"no result-*.json in {args.runs_dir}")
    for seed in range(0 if args.from_results else args.seeds):
        for variant in args.variants:
            path = args.runs_dir / f"result-{variant.replace(' ', '_')}-s{seed}.json"
            cmd = [sys.executable, __file__, *passed, "--one", variant, str(seed), str(path)]
            subprocess.run(cmd, check=True, env=os.environ.copy())
            runs.append(RunResult(**json.loads(path.read_text())))
            print(f"{variant} / seed {seed}: done in {runs[-1].wall_s:.0f} s", flush=True)
    report = summarize(runs, args)
    (args.out / "peers.json").write_text(json.dumps(report, indent=1) + "\n")
    (args.out / "peers.md").write_text(report["table"])
    from services.plot import plot_peers

    plot_peers(report["runs"], args.threshold, args.out / "peers.png")
    print(report["table"])
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    raise SystemExit(main())
