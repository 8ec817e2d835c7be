"""``reval ablate NAME``: the paper's ablations at CPU scale, on the demo task (a tiny model learns
single-digit addition, ``configs/demo.toml``). Each ablation runs a few variants of the demo for a
few seeds with ``reval train``'s loop and writes ``NAME.json`` (every run's curves),
``NAME.md`` (a table) and ``NAME.png`` (success and the ablation's own metric against the round).

| name | variants | its metric |
|---|---|---|
| beta | beta 0.01 / 0.1 / 1 (a decade apart around the demo's 0.1) | KL to the reference |
| reset | reference reset never / every 25 / 50 / 100 rounds | KL to the reference |
| reward | 0/1, group-mean-normalized, +-1 | mean abs(delta) |
| variants | ReVal, TBRM, the regression variant | pre-clip grad norm |
| n1 | N = 1 answer per prompt: ReVal (K = 4) vs GRPO | KL to the reference |
| rounds | GRPO vs ReVal K = 1 / 2 / 4: rounds and seconds to a success threshold | seconds |

"KL to the reference" is the batch mean of ``log pi(y|x) - log pi_ref(y|x)`` over the trajectories
each update used: an estimate of KL(pi || pi_ref) on near-on-policy data (it is not logged for
GRPO, which has no reference). Success is the demo's evaluation (all 100 prompts, 4 samples each,
temperature 1) every ``eval.every`` rounds.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger("reval.ablate")

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Ablation:
    title: str
    variants: tuple[tuple[str, tuple[str, ...]], ...]
    """(label, config overrides) per variant."""
    metric: str
    """The per-round record key plotted beside success."""
    metric_label: str
    base: tuple[str, ...] = ()
    """Overrides every variant shares."""
    rounds: int = 200
    threshold: float = 0.5
    """Success at which 'rounds to threshold' is counted."""


GRPO = ("algo.name=grpo", "learner.updates_per_round=1", "learner.first_update_fresh=true")
ABLATIONS: dict[str, Ablation] = {
    "beta": Ablation(
        "beta sweep (a decade apart)",
        tuple((f"beta {b:g}", (f"algo.beta={b}",)) for b in (0.01, 0.1, 1.0)),
        "log_ratio_mean",
        "KL to the reference (mean log ratio)",
        base=("learner.ref_reset_steps=0",),
    ),
    "reset": Ablation(
        "reference reset period",
        (
            ("never", ("learner.ref_reset_steps=0",)),
            *((f"every {r}", (f"learner.ref_reset_steps={r}",)) for r in (25, 50, 100)),
        ),
        "log_ratio_mean",
        "KL to the reference (mean log ratio)",
    ),
    "reward": Ablation(
        "reward variants",
        tuple(
            (label, (f"algo.reward={r}",))
            for label, r in (("0/1", "binary"), ("r - mean", "group_mean"), ("+-1", "plus_minus"))
        ),
        "delta_abs_mean",
        "mean abs(delta)",
    ),
    "variants": Ablation(
        "ReVal vs TBRM vs regression",
        tuple((a, (f"algo.name={a}",)) for a in ("reval", "tbrm", "regression")),
        "grad_norm",
        "pre-clip grad norm",
    ),
    "n1": Ablation(
        "N = 1 (one answer per prompt): ReVal vs GRPO",
        (("ReVal K=4", ()), ("GRPO", GRPO)),
        "log_ratio_mean",
        "KL to the reference (mean log ratio)",
        base=(
            "rollout.n=1",
            "rollout.prompts_per_round=128",
            "learner.batch_size=128",
            "learner.micro_batch_size=128",
            "algo.reward=binary",
        ),
        rounds=300,
        threshold=0.3,
    ),
    "rounds": Ablation(
        "generation rounds and time to the threshold: GRPO vs ReVal step K",
        (
            ("GRPO", GRPO),
            *((f"ReVal K={k}", (f"learner.updates_per_round={k}",)) for k in (1, 2, 4)),
        ),
        "elapsed_s",
        "seconds since the start",
        base=("eval.every=10",),
        rounds=250,
    ),
}


@dataclass
class Run:
    variant: str
    seed: int
    curve: list[dict[str, float]] = field(default_factory=list)
    """Per round: round, eval_success (where evaluated), the metric, elapsed_s."""
    seconds: float = 0.0


def _first_at(run: Run, threshold: float) -> tuple[int | None, float | None]:
    for r in run.curve:
        if r.get("eval_success", -1.0) >= threshold:
            return int(r["round"]), float(r["elapsed_s"])
    return None, None


def run_ablation(
    name: str, out: Path, seeds: int = 2, rounds: int | None = None,
    overrides: tuple[str, ...] = (), runs_dir: Path = ROOT / "runs" / "ablate",
) -> dict[str, Any]:  # fmt: skip
    """Run every variant for ``seeds`` seeds (run directories under ``runs_dir``, checkpoints
    included) and write NAME.json, NAME.md and NAME.png into ``out``."""
    from reval.config import load_config
    from services.train import train

    ab = ABLATIONS[name]
    n_rounds = rounds or ab.rounds
    out.mkdir(parents=True, exist_ok=True)
    runs: list[Run] = []
    for label, variant in ab.variants:
        for seed in range(seeds):
            slug = label.replace(" ", "_").replace("/", "-").replace("=", "").replace("+", "pm")
            cfg = load_config(
                str(ROOT / "configs" / "demo.toml"),
                [
                    *ab.base,
                    *variant,
                    *overrides,
                    f"seed={seed}",
                    f"learner.rounds={n_rounds}",
                    f"name=ablate-{name}-{slug}-s{seed}",
                    f"output_dir={runs_dir}",
                    "metrics.plot=false",
                    "metrics.progress=false",
                ],
            )
            t0 = time.perf_counter()
            result = train(cfg)
            keep = ("round", "eval_success", ab.metric, "elapsed_s")
            curve = [{k: float(r[k]) for k in keep if k in r} for r in result.history]
            runs.append(Run(label, seed, curve, time.perf_counter() - t0))
            log.info("%s / %s / seed %d: final success %s", name, label, seed,
                     result.final_success)  # fmt: skip
    report = summarize(name, runs, n_rounds)
    (out / f"{name}.json").write_text(json.dumps(report, indent=1))
    (out / f"{name}.md").write_text(report["table"])
    plot(name, runs, out / f"{name}.png")
    return report


def summarize(name: str, runs: list[Run], n_rounds: int) -> dict[str, Any]:
    ab = ABLATIONS[name]
    rows = []
    for label, _ in ab.variants:
        mine = [r for r in runs if r.variant == label]
        finals = [next(p["eval_success"] for p in reversed(r.curve) if "eval_success" in p)
                  for r in mine]  # fmt: skip
        tail = [p[ab.metric] for r in mine for p in r.curve[-max(1, len(r.curve) // 5):]
                if ab.metric in p]  # fmt: skip
        values = [p[ab.metric] for r in mine for p in r.curve if ab.metric in p]
        reached = [_first_at(r, ab.threshold) for r in mine]
        rounds_to = [x for x, _ in reached if x is not None]
        secs_to = [s for _, s in reached if s is not None]
        rows.append(
            {
                "variant": label,
                "final_success": statistics.mean(finals),
                "final_success_per_seed": finals,
                "metric_last_fifth": statistics.mean(tail) if tail else None,
                "metric_max": max(values, default=None),
                "reached": f"{len(rounds_to)}/{len(mine)}",
                "rounds_to_threshold": statistics.median(rounds_to) if rounds_to else None,
                "seconds_to_threshold": statistics.median(secs_to) if secs_to else None,
                "seconds": statistics.mean(r.seconds for r in mine),
            }
        )

    def f(x: float | None, fmt: str = ".3f") -> str:
        return "-" if x is None else format(x, fmt)

    lines = [
        f"{ab.title}: {n_rounds} rounds, seeds {sorted({r.seed for r in runs})}; success = the "
        f"demo's evaluation; threshold {ab.threshold:g}\n",
        f"| variant | final success (mean) | per seed | {ab.metric_label}, last fifth (mean) "
        f"| max | reached | rounds to {ab.threshold:g} (median) | seconds to it "
        "| seconds per run |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        per = " / ".join(f"{x:.2f}" for x in row["final_success_per_seed"])
        lines.append(
            f"| {row['variant']} | {row['final_success']:.3f} | {per} | "
            f"{f(row['metric_last_fifth'])} | {f(row['metric_max'])} | {row['reached']} | "
            f"{f(row['rounds_to_threshold'], 'g')} | {f(row['seconds_to_threshold'], '.1f')} | "
            f"{row['seconds']:.1f} |"
        )
    return {"name": name, "title": ab.title, "rounds": n_rounds, "threshold": ab.threshold,
            "metric": ab.metric, "rows": rows, "runs": [asdict(r) for r in runs],
            "table": "\n".join(lines) + "\n"}  # fmt: skip


def plot(name: str, runs: list[Run], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ab = ABLATIONS[name]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.6))
    for i, (label, _) in enumerate(ab.variants):
        color = f"C{i}"
        for k, r in enumerate(run for run in runs if run.variant == label):
            ev = [p for p in r.curve if "eval_success" in p]
            a1.plot([p["round"] for p in ev], [p["eval_success"] for p in ev], color=color,
                    alpha=0.85, label=label if k == 0 else None)  # fmt: skip
            pts = [p for p in r.curve if ab.metric in p]
            x = [p["round"] for p in pts]
            a2.plot(x, [p[ab.metric] for p in pts], color=color, alpha=0.6, lw=0.8,
                    label=label if k == 0 else None)  # fmt: skip
    a1.axhline(ab.threshold, color="grey", ls="--", lw=0.7)
    a1.set_xlabel("generation round")
    a1.set_ylabel("success (all prompts)")
    a1.set_title(ab.title, fontsize=9)
    a1.legend(fontsize=7)
    a2.set_xlabel("generation round")
    a2.set_ylabel(ab.metric_label)
    if ab.metric == "grad_norm":
        a2.set_yscale("log")
    a2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def add_parser(sub: Any) -> None:
    ab = sub.add_parser("ablate", help="the paper's ablations at CPU scale (docs/ablations.md)")
    ab.add_argument("name", choices=[*ABLATIONS, "all"], help="which ablation")
    ab.add_argument("--seeds", type=int, default=2, help="seeds per variant")
    ab.add_argument("--rounds", type=int, help="rounds per run (default: the ablation's)")
    ab.add_argument("--out", default="docs/ablations", help="where the JSON, table and PNG go")
    ab.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a field of configs/demo.toml for every run (repeatable)",
    )


def main(args: argparse.Namespace) -> int:
    import sys

    from reval.config import ConfigError

    if args.seeds < 1 or (args.rounds is not None and args.rounds < 1):
        print("reval ablate: --seeds and --rounds must be >= 1", file=sys.stderr)
        return 2
    names = list(ABLATIONS) if args.name == "all" else [args.name]
    try:
        for name in names:
            report = run_ablation(name, Path(args.out), args.seeds, args.rounds,
                                  tuple(args.overrides))  # fmt: skip
            print(report["table"])
    except ConfigError as err:
        print(f"reval ablate: {err}", file=sys.stderr)
        return 2
    return 0
