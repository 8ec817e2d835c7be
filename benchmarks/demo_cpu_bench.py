"""Hand-run benchmark: the CPU time of the demo's rounds (``configs/demo.toml``, one thread) at
another commit and at this working tree, in one run, interleaved, with the success each reached.

    .venv/bin/python benchmarks/demo_cpu_bench.py --base HEAD~3 --rounds 60 --pairs 2
    .venv/bin/python benchmarks/demo_cpu_bench.py --base <commit> --rounds 600 --seeds 0 1 2 3 4

``--base`` is checked out into a temporary git worktree (``--base-dir``: an existing checkout
instead). Each run is a child process with ``OMP_NUM_THREADS=1`` that imports the code of its
tree (the current directory first on ``sys.path``; the child prints where ``learner`` came from)
and reports its process CPU time (user + system, ``time.process_time``): the set-up (the tiny
model's format pretraining, building the run), the rounds (generation, insert, updates, the
evaluations every ``eval.every`` rounds), and the whole process (``resource``, imports and
export included). CPU time, not wall-clock: on a shared machine a neighbour stretches the
wall-clock, much less the CPU time of a single thread (it still moves it, by cache and memory
contention: hence the interleaving, base then head then base, and the medians).

Children of the two trees run the same config and seed: their ``metrics.jsonl`` are compared
round by round (``--compare``: the largest relative difference of each numeric field over the
rounds both ran) and their final evaluation success is printed side by side.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

CHILD = r"""
import json, resource, sys, time
t0 = time.process_time()
import torch
torch.set_num_threads(1)
import learner
from reval.config import load_config
from services.train import EmbeddedRun, prepare
args = json.loads(sys.argv[1])
cfg = load_config(None, args["overrides"])
t1 = time.process_time()
prep = prepare(cfg)
run = EmbeddedRun.build(cfg, prep, None, False)
initial = run.start()
t2 = time.process_time()
success = initial
for rnd in range(1, cfg.learner.rounds + 1):
    rec = run.round(rnd)
    success = rec.get("eval_success", success)
t3 = time.process_time()
run.close()
ru = resource.getrusage(resource.RUSAGE_SELF)
print("RESULT " + json.dumps({
    "code": learner.__file__, "imports_s": t1 - t0, "setup_s": t2 - t1, "rounds_s": t3 - t2,
    "process_s": ru.ru_utime + ru.ru_stime, "initial": initial, "final": success,
    "rounds": cfg.learner.rounds, "threads": torch.get_num_threads(),
}))
"""


def run_child(tree: Path, out: Path, name: str, seed: int, rounds: int, every: int) -> dict:
    overrides = [
        f"output_dir={out}", f"name={name}", f"seed={seed}", f"learner.rounds={rounds}",
        f"eval.every={every}", "metrics.plot=false", "metrics.progress=false",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
           "PYTHONPATH": str(tree)}  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps({"overrides": overrides})],
        cwd=tree, env=env, capture_output=True, text=True, check=False,
    )  # fmt: skip
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"child in {tree} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    result = json.loads(lines[-1][len("RESULT ") :])
    if not result["code"].startswith(str(tree)):
        raise RuntimeError(f"child in {tree} imported {result['code']}")
    result["metrics"] = str(out / name / "metrics.jsonl")
    return result


TOLERANCE = 1e-4
"""A relative difference above this is a round that differs (float rounding alone moves the
first rounds' losses by about 1e-6)."""


def compare(a: Path, b: Path) -> tuple[dict[str, float], int | None]:
    """The largest relative difference of each numeric field of two metrics.jsonl, over the
    rounds both have (times left out), and the first round with one above ``TOLERANCE``."""
    rows_a = [json.loads(x) for x in a.read_text().splitlines()]
    rows_b = [json.loads(x) for x in b.read_text().splitlines()]
    worst: dict[str, float] = {}
    first: int | None = None
    for ra, rb in zip(rows_a, rows_b, strict=False):
        if first is None and worst and max(worst.values()) > TOLERANCE:
            first = int(ra["round"]) - 1
        for key, va in ra.items():
            vb = rb.get(key)
            if key.endswith("_s") or not isinstance(va, (int, float)) or isinstance(va, bool):
                continue
            if not isinstance(vb, (int, float)):
                worst[key] = math.inf
                continue
            diff = abs(va - vb) / max(abs(va), abs(vb), 1e-12)
            worst[key] = max(worst.get(key, 0.0), diff)
    if first is None and worst and max(worst.values()) > TOLERANCE:
        first = int(rows_a[min(len(rows_a), len(rows_b)) - 1]["round"])
    return worst, first


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default=None, help="commit to compare against (a git worktree)")
    ap.add_argument("--base-dir", type=Path, default=None, help="an existing checkout instead")
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--every", type=int, default=25, help="eval.every (the demo's 25)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--pairs", type=int, default=1, help="base/head runs per seed")
    ap.add_argument("--compare", action="store_true", help="metrics.jsonl of base and head")
    ap.add_argument("--out", type=Path, default=None, help="the JSON of every run")
    args = ap.parse_args()
    if (args.base is None) == (args.base_dir is None):
        ap.error("give one of --base or --base-dir")
    with tempfile.TemporaryDirectory(prefix="demo-cpu-bench-") as tmp:
        tmp_path = Path(tmp)
        base = args.base_dir
        if base is None:
            base = tmp_path / "base"
            subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q",
                            str(base), args.base], check=True)  # fmt: skip
        try:
            runs = _runs(args, base.resolve(), tmp_path)
        finally:
            if args.base_dir is None:
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force",
                                str(base)], check=False)  # fmt: skip
    if args.out is not None:
        args.out.write_text(json.dumps(runs, indent=2) + "\n")
    return 0


def _runs(args: argparse.Namespace, base: Path, tmp: Path) -> list[dict[str, Any]]:
    runs: list[dict[str, Any]] = []
    for seed in args.seeds:
        for pair in range(args.pairs):
            order = [("base", base), ("head", ROOT)]
            if pair % 2:
                order.reverse()
            for label, tree in order:
                r = run_child(tree, tmp / label, f"s{seed}p{pair}", seed, args.rounds, args.every)
                r.update(tree=label, seed=seed, pair=pair)
                runs.append(r)
                print(f"seed {seed} pair {pair} {label}: rounds {r['rounds_s']:.1f} s CPU "
                      f"({r['rounds_s'] / args.rounds * 1000:.0f} ms/round), set-up "
                      f"{r['setup_s']:.1f} s, process {r['process_s']:.1f} s; success "
                      f"{r['initial']:.3f} -> {r['final']:.4f}", flush=True)  # fmt: skip
            if args.compare:
                a, b = (Path(x["metrics"]) for x in runs[-2:])
                worst, first = compare(a, b)
                shown = ", ".join(f"{k} {v:.1e}" for k, v in sorted(worst.items()) if v > 0)
                print(f"  metrics.jsonl base vs head, largest relative difference: "
                      f"{shown or 'none (equal)'}; first round beyond {TOLERANCE:g}: "
                      f"{first}", flush=True)  # fmt: skip
                runs[-1]["differs_from_round"] = first
    for label in ("base", "head"):
        mine = [r for r in runs if r["tree"] == label]
        per = statistics.median(r["rounds_s"] / r["rounds"] for r in mine)
        proc = statistics.median(r["process_s"] for r in mine)
        finals = {r["seed"]: r["final"] for r in mine}
        print(f"{label}: median {per * 1000:.0f} ms CPU a round, {proc:.1f} s CPU a process; "
              f"final success by seed {finals}")  # fmt: skip
    b = statistics.median(r["rounds_s"] for r in runs if r["tree"] == "base")
    h = statistics.median(r["rounds_s"] for r in runs if r["tree"] == "head")
    print(f"head / base, rounds' CPU time: {h / b:.3f}")
    return runs


if __name__ == "__main__":
    raise SystemExit(main())
