"""Hand-run benchmark: does the service reuse each trajectory K times on the defaults?

    .venv/bin/python benchmarks/service_reuse_bench.py --seeds 0 1 2 --updates 400
    .venv/bin/python benchmarks/service_reuse_bench.py --compare /tmp/demo_seeds   # + one-process

For each seed, the run is made as docs/api.md says: ``reval serve`` (a process, on a free port,
under a key prefix and an output directory of its own), then ``reval runs create --config
configs/demo.toml --set buffer.backend=redis --workers 2`` (the API starts ``reval launch``: a
learner and two HF rollout workers on a local Ray). Once the learner has made ``--updates``
updates the run is stopped and, from its ``learner.jsonl``, the bench reports:

- the realised samples per insert (``buffer_sampled / buffer_inserted``) against the configured
  ratio (``RunConfig.samples_per_insert``),
- the share of evicted trajectories that were evicted never used,
- the batch success rate over the last 100 updates, and how many updates old the fresh batches
  among them were (``fresh_staleness``),

and, with ``--compare DIR`` (``reval train`` runs of the same config, one ``DIR/demo-s<seed>``
each), the one-process loop's batch success rate over the same updates (its rounds make
``updates_per_round`` updates each). ``--set KEY=VALUE`` adds overrides to the runs' config
(e.g. ``buffer.generate_ahead=640``). Figures go into docs/rollout.md, "Reuse by default".
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import redis

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from reval.config import load_config  # noqa: E402
from reval.metrics import read_jsonl  # noqa: E402

WINDOW = 100
"""Updates the success rate is averaged over (the last of the run)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def reval(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "services.cli", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip


def get_run(url: str, name: str, env: dict[str, str]) -> dict[str, Any]:
    import httpx

    r = httpx.get(f"{url}/v1/runs/{name}", timeout=10,
                  headers={"Authorization": f"Bearer {env['REVAL_API_TOKEN']}"})  # fmt: skip
    r.raise_for_status()
    return dict(r.json())


def service_run(
    seed: int, updates: int, workers: int, redis_url: str, out: Path, sets: list[str]
) -> dict[str, Any]:
    prefix = f"reval-bench-{uuid.uuid4().hex[:8]}:"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "REVAL_API_TOKEN": uuid.uuid4().hex + uuid.uuid4().hex,
           "RAY_USAGE_STATS_ENABLED": "0", "REVAL_API_URL": url}  # fmt: skip
    log = (out / f"serve-s{seed}.log").open("wb")
    api = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "serve", "--port", str(port), "--redis-url",
         redis_url, "--key-prefix", prefix, "--output-dir", str(out)],
        cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    name = f"demo-s{seed}"
    pid = None
    t0 = time.monotonic()
    try:
        deadline = time.monotonic() + 60
        while reval("runs", "--url", url, "list", env=env).returncode != 0:
            assert api.poll() is None and time.monotonic() < deadline, "reval serve never answered"
            time.sleep(0.5)
        made = reval("runs", "--url", url, "create", "--config", "configs/demo.toml",
                     "--set", "buffer.backend=redis", "--set", f"name={name}",
                     "--set", f"seed={seed}", *[x for kv in sets for x in ("--set", kv)],
                     "--workers", str(workers), env=env)  # fmt: skip
        assert made.returncode == 0, made.stderr + made.stdout
        pid = json.loads(made.stdout)["pid"]
        rows: list[dict[str, Any]] = []
        while len(rows) < updates:
            time.sleep(5)
            run = get_run(url, name, env)
            assert run["phase"] in ("starting", "running"), run
            path = out / name / "learner.jsonl"
            rows = read_jsonl(path) if path.exists() else []
        elapsed = time.monotonic() - t0
        reval("runs", "--url", url, "stop", name, env=env)
        deadline = time.monotonic() + 180
        while get_run(url, name, env)["phase"] not in ("stopped", "done", "failed"):
            if time.monotonic() > deadline:
                break
            time.sleep(2)
    finally:
        if pid:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGINT)
        api.send_signal(signal.SIGTERM)
        api.wait(30)
        client = redis.Redis.from_url(redis_url)
        keys = list(client.scan_iter(f"{prefix}*", count=1000))
        for i in range(0, len(keys), 500):
            client.delete(*keys[i : i + 500])
    cfg = load_config(ROOT / "configs" / "demo.toml", environ={})
    last = rows[updates - 1]
    window = rows[updates - WINDOW : updates]
    fresh = [r for r in window if r.get("fresh")]
    return {
        "seed": seed,
        "updates": updates,
        "seconds": round(elapsed, 1),
        "configured_samples_per_insert": cfg.samples_per_insert,
        "realised_samples_per_insert": round(last["buffer_sampled"] / last["buffer_inserted"], 3),
        "evicted": last["buffer_evicted"],
        "evicted_unused_share": round(
            last["buffer_evicted_unused"] / max(last["buffer_evicted"], 1), 4
        ),
        "batch_success": round(sum(r["batch_success_rate"] for r in window) / len(window), 3),
        "fresh_staleness": round(sum(r["staleness_mean"] for r in fresh) / max(len(fresh), 1), 1),
    }


def one_process(run_dir: Path, updates: int, per_round: int) -> float | None:
    """The one-process loop's batch success over the same updates (``metrics.jsonl`` rows are
    rounds of ``per_round`` updates, each with its updates' mean)."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return None
    rows = [r for r in read_jsonl(path) if "batch_success_rate" in r]
    lo, hi = (updates - WINDOW) // per_round, updates // per_round
    window = rows[lo:hi]
    return round(sum(r["batch_success_rate"] for r in window) / len(window), 3) if window else None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--updates", type=int, default=400)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    p.add_argument("--compare", help="directory of `reval train` runs named demo-s<seed>")
    p.add_argument("--out", help="where the runs go (default: a temporary directory)")
    p.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="another override of the runs' config (e.g. buffer.generate_ahead=640)",
    )
    args = p.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="reval-reuse-"))
    out.mkdir(parents=True, exist_ok=True)
    per_round = load_config(ROOT / "configs" / "demo.toml", environ={}).learner.updates_per_round
    for seed in args.seeds:
        res = service_run(seed, args.updates, args.workers, args.redis_url, out, args.sets)
        if args.compare:
            res["one_process_batch_success"] = one_process(
                Path(args.compare) / f"demo-s{seed}", args.updates, per_round
            )
        print(json.dumps(res), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
