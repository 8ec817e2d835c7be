"""Hand-run benchmark: the decoupled service against the one-process loop on the same config.

    .venv/bin/python benchmarks/overlap_bench.py            # figures go into docs/learner.md

1. ``reval train`` (one process: generate a round, then K updates, in turn) on the demo config.
2. The service on the same config: ``reval learner`` (N ranks) and W ``reval rollout`` workers as
   separate processes, real Redis, the limiter at the same reuse (``samples_per_insert`` = K B /
   round size).

Both are measured over a steady-state window (after a warm-up), from their own logs: trajectories
generated per second, updates per second, the machine's CPU busy fraction over the window (from
``/proc/stat``, all cores, so Redis and everything else count too), and for the service the
fraction of time the learner waited for data and the workers waited for weights.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import redis

ROOT = Path(__file__).resolve().parents[1]


def cpu_times() -> tuple[float, float]:
    """(busy, total) jiffies over all cores."""
    parts = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    vals = [float(x) for x in parts[:8]]
    idle = vals[3] + vals[4]  # idle + iowait
    return sum(vals) - idle, sum(vals)


def rows(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            break  # a line being written
    return out


def wait_rows(path: Path, n: int, proc: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while len(rows(path)) < n:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args} exited with {proc.returncode}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path}: fewer than {n} rows after {timeout} s")
        time.sleep(0.05)


def cli(
    role: str, sets: list[str], *extra: str, log: Path, threads: int | None = 1
) -> subprocess.Popen[bytes]:
    """``threads``: OMP_NUM_THREADS of the process (None: torch's default, all cores)."""
    cmd = [sys.executable, "-m", "services.cli", role]
    for s in sets:
        cmd += ["--set", s]
    return subprocess.Popen(
        [*cmd, *extra],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=log.open("w"),
        env={k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
        | ({"OMP_NUM_THREADS": str(threads)} if threads else {}),
        start_new_session=True,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="redis://127.0.0.1:6379/0")
    ap.add_argument("--warm", type=int, default=10, help="rounds / updates before the window")
    ap.add_argument("--rounds", type=int, default=60, help="one-process rounds in the window")
    ap.add_argument("--updates", type=int, default=200, help="service updates in the window")
    ap.add_argument("--nproc", type=int, default=1, help="learner ranks of the service")
    ap.add_argument("--workers", type=int, default=1, help="rollout workers of the service")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args()

    # The demo's config: rounds of 32 prompts x 16 answers, K = 4 updates of B = 256.
    prompts, n, k, b = 32, 16, 4, 256
    base = ["eval.every=0", "metrics.plot=false", "model.pretrain_steps=300"]
    spi = k * b / (prompts * n)
    out = Path(tempfile.mkdtemp(prefix="overlap-"))

    # 1. One process.
    sets = [*base, f"output_dir={out}", "name=one", f"learner.rounds={args.warm + args.rounds + 5}",
            "metrics.progress=false"]  # fmt: skip
    proc = cli("train", sets, log=out / "train.log", threads=None)  # all cores, one process
    path = out / "one" / "metrics.jsonl"
    wait_rows(path, args.warm, proc, 900)
    t0, c0, n0 = time.monotonic(), cpu_times(), len(rows(path))
    wait_rows(path, n0 + args.rounds, proc, 900)
    t1, c1, n1 = time.monotonic(), cpu_times(), len(rows(path))
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    one = {
        "seconds": t1 - t0,
        "trajectories_per_s": (n1 - n0) * prompts * n / (t1 - t0),
        "updates_per_s": (n1 - n0) * k / (t1 - t0),
        "cpu_busy": (c1[0] - c0[0]) / max(c1[1] - c0[1], 1e-9),
    }

    # 2. The service.
    prefix = f"reval-bench:{uuid.uuid4().hex[:8]}:"
    client = redis.Redis.from_url(args.url)
    sets = [
        *base,
        f"output_dir={out}",
        "name=svc",
        "buffer.backend=redis",
        f"redis.url={args.url}",
        f"redis.prefix={prefix}",
        f"buffer.samples_per_insert={spi}",
        f"buffer.min_size_to_sample={2 * b}",
        "buffer.sample_timeout_s=600",
        f"learner.max_steps={args.warm + args.updates + 1000}",
        "learner.first_update_fresh=false",
        f"rollout.worker_prompts={prompts}",
        "rollout.weights_poll_s=0.2",
    ]
    from buffer.redis_ring import RedisRing

    ring = RedisRing("svc", 2560, url=args.url, key_prefix=prefix)
    learner = cli("learner", sets, "--nproc", str(args.nproc), log=out / "learner.log")
    workers = [
        cli("rollout", sets, "--worker-id", f"bench-{i}", log=out / f"rollout-{i}.log")
        for i in range(args.workers)
    ]
    lpath = out / "svc" / "learner.jsonl"
    try:
        wait_rows(lpath, args.warm, learner, 900)
        t0, c0, r0, i0 = time.monotonic(), cpu_times(), len(rows(lpath)), ring.stats().inserted
        wait_rows(lpath, r0 + args.updates, learner, 900)
        t1, c1, r1, i1 = time.monotonic(), cpu_times(), len(rows(lpath)), ring.stats().inserted
    finally:
        for w in workers:
            w.send_signal(signal.SIGTERM)
        summaries = []
        for w in workers:
            so, _ = w.communicate(timeout=120)
            lines = so.decode().strip().splitlines()
            if lines:
                summaries.append(json.loads(lines[-1]))
        if learner.poll() is None:
            os.killpg(learner.pid, signal.SIGKILL)
        learner.wait()
        keys = list(client.scan_iter(f"{prefix}*", count=1000))
        for i in range(0, len(keys), 500):
            client.delete(*keys[i : i + 500])
    window = rows(lpath)[r0:r1]
    wait = sum(r["wait_data_s"] for r in window)
    svc = {
        "seconds": t1 - t0,
        "trajectories_per_s": (i1 - i0) / (t1 - t0),
        "updates_per_s": (r1 - r0) / (t1 - t0),
        "cpu_busy": (c1[0] - c0[0]) / max(c1[1] - c0[1], 1e-9),
        "learner_wait_data": wait / (t1 - t0),
        "staleness_mean": sum(r["staleness_mean"] for r in window) / max(len(window), 1),
        "workers": [
            {
                "weight_wait_s": s["weight_wait_s"],
                "elapsed_s": s["elapsed_s"],
                "busy_fraction": s["busy_s"] / max(s["elapsed_s"], 1e-9),
            }
            for s in summaries
        ],
    }
    result = {
        "config": {"prompts": prompts, "n": n, "K": k, "B": b, "samples_per_insert": spi,
                   "nproc": args.nproc, "workers": args.workers, "cpus": os.cpu_count()},
        "one_process": one,
        "service": svc,
        "ratio_trajectories": svc["trajectories_per_s"] / one["trajectories_per_s"],
        "ratio_updates": svc["updates_per_s"] / one["updates_per_s"],
    }  # fmt: skip
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
