"""Hand-run benchmark of the thread budget (issue 39, ``reval/threads.py``): the demo's round time
at the defaults (the budget and its tuner) against ``OMP_NUM_THREADS=1`` and against the budget
held fixed (``OMP_NUM_THREADS`` = the CPUs given: what torch did before), with and without a busy
neighbour process on the machine.

    .venv/bin/python benchmarks/thread_bench.py --rounds 60 --reps 2
    .venv/bin/python benchmarks/thread_bench.py --rounds 60 --no-neighbour
    .venv/bin/python benchmarks/thread_bench.py --rounds 30 --no-fixed   # quicker
    .venv/bin/python benchmarks/thread_bench.py --service 120            # learner + 2 workers

Each run is ``reval train`` of configs/demo.toml for ``--rounds`` rounds (``--pretrain`` steps of
format pretraining, not timed: the rounds' ``round_s`` in metrics.jsonl are), in its own output
directory; the settings are interleaved, ``--reps`` times each, so the machine's other work falls
on all of them alike. The neighbour is one process spinning on a core for the whole run (as a
second job on the machine would). Prints, per setting, the median round time and the total of
the rounds, and the ratio of the defaults to ``OMP_NUM_THREADS=1`` (target: at most 1.3).

``--service SECONDS``: instead, the service as compose or a user by hand runs it on one machine
(``reval learner`` and two ``reval rollout`` processes on the Redis of ``--redis``, under a key
prefix of their own, the demo config with the redis buffer), for each setting; the learner's
updates in the ``SECONDS`` after its first one (its learner.jsonl) are counted. "Fixed at the
budget" is what each process took before the budget (torch's default, all the CPUs).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SPIN = "while True: pass"


def cpus() -> int:
    return len(os.sched_getaffinity(0))


def one_run(out: Path, omp: str | None, rounds: int, pretrain: int, seed: int) -> list[float]:
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    if omp is not None:
        env["OMP_NUM_THREADS"] = omp
    sets = [f"output_dir={out}", f"learner.rounds={rounds}", f"model.pretrain_steps={pretrain}",
            f"seed={seed}", "metrics.progress=false"]  # fmt: skip
    cmd = [sys.executable, "-m", "services.cli", "train", "--config", "configs/demo.toml"]
    for s in sets:
        cmd += ["--set", s]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise SystemExit(f"{cmd}: exit {done.returncode}\n{done.stderr[-3000:]}")
    rows = [json.loads(ln) for ln in (out / "demo" / "metrics.jsonl").read_text().splitlines()]
    return [float(r["round_s"]) for r in rows if "round_s" in r]


def service_run(out: Path, omp: str | None, seconds: float, pretrain: int, redis_url: str,
                seed: int) -> int:  # fmt: skip
    """Updates the learner made in ``seconds`` after its first, beside two workers."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    if omp is not None:
        env["OMP_NUM_THREADS"] = omp
    prefix = f"reval-thread-bench:{os.getpid()}:{out.name}:"
    sets = [f"output_dir={out}", "name=svc", "buffer.backend=redis", f"redis.url={redis_url}",
            f"redis.prefix={prefix}", f"model.pretrain_steps={pretrain}", f"seed={seed}",
            "metrics.progress=false", "learner.checkpoint_every=0",
            "learner.max_steps=100000"]  # fmt: skip
    base = [sys.executable, "-m", "services.cli"]
    config = ["--config", "configs/demo.toml", *[a for s in sets for a in ("--set", s)]]
    out.mkdir(parents=True, exist_ok=True)
    logs = [(out / f"{name}.log").open("w") for name in ("learner", "w0", "w1")]
    procs = [subprocess.Popen([*base, "learner", "--nproc", "1", *config], cwd=ROOT, env=env,
                              stdout=logs[0], stderr=logs[0], start_new_session=True)]  # fmt: skip
    for i in (1, 2):
        procs.append(subprocess.Popen([*base, "rollout", *config, "--worker-id", f"w{i}"],
                                      cwd=ROOT, env=env, stdout=logs[i], stderr=logs[i],
                                      start_new_session=True))  # fmt: skip
    jsonl = out / "svc" / "learner.jsonl"
    try:
        deadline = time.monotonic() + 1800
        while not (jsonl.is_file() and jsonl.read_text().strip()):
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                raise SystemExit(f"the service did not start: see {out}/*.log")
            time.sleep(0.5)
        first = len(jsonl.read_text().splitlines())
        time.sleep(seconds)
        return len(jsonl.read_text().splitlines()) - first
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        import redis

        client = redis.Redis.from_url(redis_url)
        keys = list(client.scan_iter(match=prefix + "*"))
        if keys:
            client.delete(*keys)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--pretrain", type=int, default=300)
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-neighbour", action="store_true", help="no busy process beside")
    ap.add_argument(
        "--no-fixed",
        action="store_true",
        help="leave out the budget held fixed (beside a neighbour: 8-30x slower)",
    )
    ap.add_argument(
        "--service",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="count a service run's updates in SECONDS instead",
    )
    ap.add_argument("--redis", default="redis://127.0.0.1:6379/0")
    args = ap.parse_args()
    settings = {"defaults (budget + tuner)": None, "OMP_NUM_THREADS=1": "1"}
    if not args.no_fixed:
        settings[f"fixed at the budget (OMP_NUM_THREADS={cpus()})"] = str(cpus())
    times: dict[str, list[float]] = {k: [] for k in settings}
    neighbour = None
    if not args.no_neighbour:
        neighbour = subprocess.Popen([sys.executable, "-c", SPIN])
    t0 = time.monotonic()
    if args.service:
        updates: dict[str, list[int]] = {k: [] for k in settings}
        with tempfile.TemporaryDirectory(prefix="reval-thread-bench-") as tmp:
            for rep in range(args.reps):
                for i, (name, omp) in enumerate(settings.items()):
                    out = Path(tmp) / f"{rep}-{i}"
                    updates[name].append(service_run(out, omp, args.service, args.pretrain,
                                                     args.redis, args.seed))  # fmt: skip
        print(f"# learner + 2 workers, {args.service:g} s after the first update, x {args.reps}, "
              f"{cpus()} CPUs, load average {os.getloadavg()[0]:.1f}")  # fmt: skip
        print("| setting | updates per minute |")
        print("|---|---|")
        for name, ns in updates.items():
            print(f"| {name} | {60 * sum(ns) / (args.service * len(ns)):.1f} |")
        return
    try:
        with tempfile.TemporaryDirectory(prefix="reval-thread-bench-") as tmp:
            for rep in range(args.reps):
                for i, (name, omp) in enumerate(settings.items()):
                    out = Path(tmp) / f"{rep}-{i}"
                    times[name] += one_run(out, omp, args.rounds, args.pretrain, args.seed)
    finally:
        if neighbour is not None:
            neighbour.kill()
    load = os.getloadavg()[0]
    print(f"# {args.rounds} rounds x {args.reps}, {cpus()} CPUs given, neighbour: "
          f"{'no' if neighbour is None else 'one spinning process'}, load average {load:.1f}, "
          f"{time.monotonic() - t0:.0f} s in all")  # fmt: skip
    print("| setting | median round (s) | rounds' total (s) |")
    print("|---|---|---|")
    for name, ts in times.items():
        print(f"| {name} | {statistics.median(ts):.3f} | {sum(ts):.1f} |")
    base, ours = times["OMP_NUM_THREADS=1"], times["defaults (budget + tuner)"]
    median = statistics.median(ours) / statistics.median(base)
    print(f"defaults / OMP_NUM_THREADS=1: median {median:.2f}x, total {sum(ours) / sum(base):.2f}x "
          "(target: at most 1.3x)")  # fmt: skip


if __name__ == "__main__":
    main()
