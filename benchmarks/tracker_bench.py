"""Hand-run benchmark: what an experiment tracker costs the demo (issue 42's "at most 3%").

Runs ``reval train`` (the demo's config, ``learner.rounds`` rounds) as child processes with and
without ``metrics.trackers`` set, interleaved (off, on, on, off, ...: a neighbour's load falls
on both), and reports each run's wall-clock and CPU time (the whole process: the tracker's
import and its last flush counted) and the medians' ratios.

    .venv/bin/python benchmarks/tracker_bench.py --tracker tensorboard --rounds 600 --pairs 1
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def one(tracker: str | None, rounds: int, out: Path) -> tuple[float, float]:
    """(wall-clock s, CPU s) of one ``reval train`` child."""
    sets = [f"learner.rounds={rounds}", f"output_dir={out}", "metrics.progress=false",
            "--overwrite"]  # fmt: skip
    cmd = [sys.executable, "-m", "services.cli", "train"]
    for s in sets[:-1]:
        cmd += ["--set", s]
    cmd.append(sets[-1])
    if tracker:
        cmd += ["--set", f'metrics.trackers=["{tracker}"]']
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL, env=env)  # fmt: skip
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tracker", default="tensorboard")
    ap.add_argument("--rounds", type=int, default=600)
    ap.add_argument("--pairs", type=int, default=1)
    args = ap.parse_args()
    got: dict[str, list[tuple[float, float]]] = {"off": [], "on": []}
    with tempfile.TemporaryDirectory(prefix="reval-tracker-bench-") as tmp:
        for k in range(args.pairs):
            order = ("off", "on") if k % 2 == 0 else ("on", "off")
            for which in order:
                tracker = args.tracker if which == "on" else None
                got[which].append(one(tracker, args.rounds, Path(tmp) / which))
    wall = {k: statistics.median(w for w, _ in v) for k, v in got.items()}
    cpu = {k: statistics.median(c for _, c in v) for k, v in got.items()}
    print(f"# reval train, the demo's config, {args.rounds} rounds, one thread, {args.pairs} "
          f"pair(s) interleaved: without trackers and with {args.tracker}\n")  # fmt: skip
    print("| | wall-clock s (whole process) | CPU s |")
    print("|---|---|---|")
    for k in ("off", "on"):
        print(f"| {args.tracker if k == 'on' else 'no tracker'} | {wall[k]:.1f} | {cpu[k]:.1f} |")
    print(f"\nwith / without: wall-clock {wall['on'] / wall['off']:.3f}, "
          f"CPU {cpu['on'] / cpu['off']:.3f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
