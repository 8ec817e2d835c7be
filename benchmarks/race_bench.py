"""Hand-run benchmark: ReVal against GRPO in wall-clock, with generation as costly as on a GPU node.

    .venv/bin/python benchmarks/race_bench.py --seeds 0 1 2 --out /tmp/race   # the full table
    .venv/bin/python benchmarks/race_bench.py --table /tmp/race/race.json     # its table again

For each seed and each regime (``cpu``: as this machine runs it; ``gpu``: generation slowed to a
GPU node's share of a step), four runs of the demo (configs/demo.toml, its K and learning rate):

- ``service ReVal`` and ``service GRPO`` (``--set algo.name=grpo --set
  learner.updates_per_round=1``, what ``--algo grpo`` sets): the service as docs/api.md
  starts it (``reval serve``, then ``reval runs create ... --set buffer.backend=redis --workers
  2``: a learner and two HF rollout workers on a local Ray; ``benchmarks/service_reuse_bench.py``'s
  way, its helpers imported),
- ``sync ReVal`` and ``sync GRPO`` (``--algo grpo``): ``reval train``, the one-process loop.

Each run stops when the success of its freshly generated answers (the sampling temperature's,
over the last ``WINDOW_SAMPLES`` generated) reaches ``--threshold``, or after ``--max-samples``
generated answers. The learner's periodic evaluation is off (``eval.every=0``) in every run: the
service's learner has none, and the race is on what the runs generate.

**The cost model (a simulation).** On a GPU node the peers measure generation at 60-90% of a
synchronous RL step (OpenRLHF's README: about 80% of RLHF training time goes to generating samples;
its paper, arXiv:2405.11143: over 90% with long chains of thought). Here the tiny model makes it
nearly free. The bench wraps ``HFEngine.generate`` in every process it starts (a ``sitecustomize``
module on ``PYTHONPATH``, written to the output directory; reval's engine is ``hf`` or ``vllm``,
with no registry a benchmark could add an engine to, and ``reval train`` builds its ``HFEngine``
directly): after each call it sleeps ``token_s`` seconds per generated token. ``token_s`` is
calibrated once, from the first ``sync ReVal`` run in the ``cpu`` regime (its rounds' ``gen_s``,
``round_s`` and ``tokens``, medians over the rounds after the first two), so that in the
synchronous loop generation is ``--gen-share`` (0.7) of a round:
``token_s = (share / (1 - share) * update_s - gen_s) / tokens``. A sleeping worker leaves the
CPU to the learner, as a worker on its own GPU would. Every process's charged tokens go to
``charges.log`` and the report says how many were charged to the workers.

Results: ``OUT/race.json`` (each run as it ends, so an interrupted table keeps what ran) and the
markdown table on stdout (``--table`` rebuilds it from a JSON). Threads: ``OMP_NUM_THREADS=1``
unless set (docs/operations.md: a 2-core machine's threads spin at every barrier otherwise).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

GEN_SHARE = 0.7
"""Generation's share of a synchronous step on a GPU node (the peers: 60-90%; OpenRLHF ~80%)."""
WINDOW_SAMPLES = 2048
"""Generated answers the success is averaged over: four rounds of the demo (32 prompts x 16
each). One round's success swings by +-0.05 with the prompts it drew (a GRPO service run at
0.12 passed 0.2 over two batches of 256), so one round would end a run on noise."""
THRESHOLD = 0.2
"""Success of the generated answers (at the demo's sampling temperature, 1.3) to reach."""
MAX_SAMPLES = 250 * 512
"""Generated answers after which a run stops unreached (250 demo rounds)."""
WARMUP_ROUNDS = 2
"""Rounds of the calibration run left out (the first updates are slower)."""
VARIANTS = ("service ReVal", "service GRPO", "sync ReVal", "sync GRPO")

SITECUSTOMIZE = '''\
"""race_bench's cost model: HFEngine.generate sleeps REVAL_RACE_TOKEN_S per generated token."""
import importlib.abc
import importlib.machinery
import os
import sys
import time

_TOKEN_S = float(os.environ.get("REVAL_RACE_TOKEN_S") or 0.0)
_LOG = os.environ.get("REVAL_RACE_LOG")


def _patch(cls):
    generate = cls.generate

    def generate_at_gpu_cost(self, prompts, params, seed):
        t0 = time.perf_counter()
        out = generate(self, prompts, params, seed)
        spent = time.perf_counter() - t0
        tokens = sum(len(s.token_ids) for group in out for s in group)
        delay = _TOKEN_S * tokens
        if delay > 0:
            time.sleep(delay)
        if _LOG:
            with open(_LOG, "a") as fh:
                fh.write(f"{os.getpid()} {tokens} {spent:.4f} {delay:.4f}\\n")
        return out

    cls.generate = generate_at_gpu_cost


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "rollout.engines":
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _patch(module.HFEngine)

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _Finder())
'''


@dataclass
class Calibration:
    """Medians over the calibration run's rounds (the one-process loop, no delay)."""

    update_s: float
    """A round's updates (``round_s - gen_s``: K updates and the buffer's insert)."""
    gen_s: float
    """A round's generation (and grading) as measured."""
    tokens: float
    """Tokens generated per round."""
    share: float = GEN_SHARE

    @property
    def token_s(self) -> float:
        return delay_per_token(self.update_s, self.gen_s, self.tokens, self.share)


def delay_per_token(
    update_s: float, gen_s: float, tokens: float, share: float = GEN_SHARE
) -> float:
    """Seconds to sleep per generated token so that a synchronous round's generation (``gen_s``
    measured, plus the delay) is ``share`` of the round: generation = share / (1 - share) x the
    updates. 0 when generation already costs that much."""
    if not 0.0 <= share < 1.0:
        raise ValueError(f"share must be in [0, 1), got {share}")
    if tokens <= 0 or update_s < 0 or gen_s < 0:
        raise ValueError(f"need tokens > 0 and times >= 0 (got {tokens}, {update_s}, {gen_s})")
    return max(0.0, share / (1.0 - share) * update_s - gen_s) / tokens


def calibrate(rows: Sequence[dict[str, Any]], share: float = GEN_SHARE) -> Calibration:
    """The cost model from a ``reval train`` run's ``metrics.jsonl`` rows (rounds with ``gen_s``,
    ``round_s`` and ``tokens``), the first ``WARMUP_ROUNDS`` rounds left out."""
    rounds = [r for r in rows if {"gen_s", "round_s", "tokens"} <= r.keys()]
    rounds = rounds[WARMUP_ROUNDS:] or rounds
    if not rounds:
        raise ValueError("no round with gen_s, round_s and tokens to calibrate from")
    return Calibration(
        update_s=statistics.median(r["round_s"] - r["gen_s"] for r in rounds),
        gen_s=statistics.median(r["gen_s"] for r in rounds),
        tokens=statistics.median(r["tokens"] for r in rounds),
        share=share,
    )


@dataclass
class Point:
    seconds: float
    """Wall-clock since the run's command started."""
    samples: int
    """Answers generated by then."""
    success: float
    """Success of the last ``WINDOW_SAMPLES`` generated answers."""


def sync_points(
    rows: Sequence[dict[str, Any]], round_size: int, window: int = WINDOW_SAMPLES
) -> list[Point]:
    """``reval train``'s rounds (``metrics.jsonl`` rows with ``reward_mean``, the binary reward's
    success rate over the round's answers, and ``_t``, when the bench saw the row) as points; the
    window is ``window // round_size`` rounds."""
    rounds = [r for r in rows if "reward_mean" in r and r.get("round", 0) >= 1]
    k = max(1, window // round_size)
    out = []
    for i, r in enumerate(rounds):
        window = rounds[max(0, i + 1 - k) : i + 1]
        out.append(Point(r["_t"], int(r["round"]) * round_size,
                         sum(w["reward_mean"] for w in window) / len(window)))  # fmt: skip
    return out


def service_points(rows: Sequence[dict[str, Any]], window: int = WINDOW_SAMPLES) -> list[Point]:
    """The service learner's updates (``learner.jsonl``) on fresh batches as points: the batch's
    ``batch_success_rate`` (answers just generated), ``buffer_inserted`` (answers generated so
    far) and ``_t``. The window holds the last ``window // batch_size`` fresh batches. An
    update log without ``fresh`` (every batch fresh, on-policy) counts every row."""
    fresh = [r for r in rows if r.get("fresh", 1) and "batch_success_rate" in r]
    out = []
    for i, r in enumerate(fresh):
        k = max(1, window // max(int(r.get("batch_size", window)), 1))
        last = fresh[max(0, i + 1 - k) : i + 1]
        out.append(Point(r["_t"], int(r["buffer_inserted"]),
                         sum(w["batch_success_rate"] for w in last) / len(last)))  # fmt: skip
    return out


def first_reaching(points: Sequence[Point], threshold: float) -> Point | None:
    """The first point whose windowed success is at least ``threshold``; None if none is."""
    return next((p for p in points if p.success >= threshold), None)


# --- running ---------------------------------------------------------------------------------


def race_env(out: Path, token_s: float, tag: str) -> dict[str, str]:
    site = out / "site"
    site.mkdir(parents=True, exist_ok=True)
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONPATH"] = os.pathsep.join(
        [str(site), str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    )
    env["REVAL_RACE_TOKEN_S"] = repr(token_s)
    env["REVAL_RACE_LOG"] = str(out / f"charges-{tag}.log")
    return env


def follow(path: Path, alive: Callable[[], bool], done: Callable[[list[dict[str, Any]]], bool],
           t0: float, limit_s: float) -> list[dict[str, Any]]:  # fmt: skip
    """Poll a JSONL log each second, stamping each new row with ``_t`` (seconds since ``t0``)
    until ``done(rows)``, the process ends, or ``limit_s``."""
    from reval.metrics import read_jsonl

    rows: list[dict[str, Any]] = []
    while True:
        now = time.monotonic() - t0
        new = read_jsonl(path)[len(rows) :] if path.exists() else []
        rows += [{**r, "_t": round(now, 2)} for r in new]
        if done(rows) or not alive() or now > limit_s:
            return rows
        time.sleep(1.0)


def charges(out: Path, tag: str) -> dict[str, Any]:
    path = out / f"charges-{tag}.log"
    lines = [ln.split() for ln in path.read_text().splitlines()] if path.exists() else []
    return {"processes": len({ln[0] for ln in lines}), "calls": len(lines),
            "tokens": sum(int(ln[1]) for ln in lines),
            "generate_s": round(sum(float(ln[2]) for ln in lines), 1),
            "delay_s": round(sum(float(ln[3]) for ln in lines), 1)}  # fmt: skip


def sync_run(seed: int, grpo: bool, env: dict[str, str], out: Path, args: argparse.Namespace,
             round_size: int, tag: str) -> tuple[list[dict[str, Any]], list[Point]]:  # fmt: skip
    name = f"race-{tag}"
    rounds = math.ceil(args.max_samples / round_size)
    cmd = [sys.executable, "-m", "services.cli", "train", "--config", "configs/demo.toml",
           "--set", f"name={name}", "--set", f"output_dir={out}", "--set", f"seed={seed}",
           "--set", "eval.every=0", "--set", f"learner.rounds={rounds}", "--no-progress",
           "--overwrite", *(["--algo", "grpo"] if grpo else [])]  # fmt: skip
    log = (out / f"{tag}.log").open("wb")
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)  # fmt: skip
    try:
        rows = follow(out / name / "metrics.jsonl", lambda: proc.poll() is None,
                      lambda rows: first_reaching(sync_points(rows, round_size),
                                                  args.threshold) is not None,
                      t0, args.run_limit_s)  # fmt: skip
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    if proc.returncode not in (0, 130, -2) and not rows:
        raise RuntimeError(f"{tag}: reval train exited {proc.returncode} (see {out}/{tag}.log)")
    return rows, sync_points(rows, round_size)


def service_run(seed: int, grpo: bool, env: dict[str, str], out: Path, args: argparse.Namespace,
                tag: str) -> tuple[list[dict[str, Any]], list[Point]]:  # fmt: skip
    """As ``service_reuse_bench.service_run`` starts and stops a run (its helpers), polling the
    learner's log until the threshold or the cap instead of a number of updates."""
    import redis
    from service_reuse_bench import free_port, get_run, reval

    prefix = f"reval-race-{uuid.uuid4().hex[:8]}:"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**env, "REVAL_API_TOKEN": uuid.uuid4().hex + uuid.uuid4().hex, "REVAL_API_URL": url}
    log = (out / f"{tag}-serve.log").open("wb")
    t0 = time.monotonic()
    api = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "serve", "--port", str(port), "--redis-url",
         args.redis_url, "--key-prefix", prefix, "--output-dir", str(out),
         "--pass-env", "REVAL_RACE_*"],
        cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    name = f"race-{tag}"
    pid = None
    rows: list[dict[str, Any]] = []
    try:
        deadline = time.monotonic() + 60
        while reval("runs", "--url", url, "list", env=env).returncode != 0:
            assert api.poll() is None and time.monotonic() < deadline, "reval serve never answered"
            time.sleep(0.5)
        made = reval("runs", "--url", url, "create", "--config", "configs/demo.toml",
                     "--set", "buffer.backend=redis", "--set", f"name={name}",
                     "--set", f"seed={seed}", "--set", "eval.every=0",
                     *(["--set", "algo.name=grpo", "--set", "learner.updates_per_round=1"]
                       if grpo else []),
                     "--workers", str(args.workers), env=env)  # fmt: skip
        assert made.returncode == 0, made.stderr + made.stdout
        pid = json.loads(made.stdout)["pid"]

        def done(rows: list[dict[str, Any]]) -> bool:
            if rows and rows[-1].get("buffer_inserted", 0) >= args.max_samples:
                return True
            return first_reaching(service_points(rows), args.threshold) is not None

        def alive() -> bool:
            return get_run(url, name, env)["phase"] in ("starting", "running")

        rows = follow(out / name / "learner.jsonl", alive, done, t0, args.run_limit_s)
        reval("runs", "--url", url, "stop", name, env=env)
        deadline = time.monotonic() + 120
        while get_run(url, name, env)["phase"] not in ("stopped", "done", "failed"):
            if time.monotonic() > deadline:
                break
            time.sleep(2)
    finally:
        if pid:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGINT)
            deadline = time.monotonic() + 60  # its last writes land before the keys go
            with contextlib.suppress(ProcessLookupError):
                while time.monotonic() < deadline:
                    os.killpg(pid, 0)
                    time.sleep(1)
        api.send_signal(signal.SIGTERM)
        api.wait(30)
        client = redis.Redis.from_url(args.redis_url)
        keys = list(client.scan_iter(f"{prefix}*", count=1000))
        for i in range(0, len(keys), 500):
            client.delete(*keys[i : i + 500])
    return rows, service_points(rows)


def summarize_run(
    variant: str,
    regime: str,
    seed: int,
    rows: list[dict[str, Any]],
    points: list[Point],
    threshold: float,
    charged: dict[str, Any],
) -> dict[str, Any]:
    hit = first_reaching(points, threshold)
    first = points[0] if points else None
    res: dict[str, Any] = {
        "variant": variant, "regime": regime, "seed": seed, "threshold": threshold,
        "reached": hit is not None,
        "samples_to_threshold": hit.samples if hit else None,
        "seconds_to_threshold": hit.seconds if hit else None,
        "first_point_s": first.seconds if first else None,
        "last": asdict(points[-1]) if points else None,
        "charged": charged,
        "curve": [[p.seconds, p.samples, round(p.success, 4)] for p in points],
    }  # fmt: skip
    gen = [r["gen_s"] for r in rows if "gen_s" in r]
    rnd = [r["round_s"] for r in rows if "round_s" in r]
    if gen and rnd:  # the one-process loop: generation's realised share of a round
        res["generation_share"] = round(sum(gen) / sum(rnd), 3)
    return res


def censored_median(values: Sequence[float | None]) -> float | None:
    """The median with unreached runs (None) counted as the slowest; None when half or more
    did not reach."""
    if not values:
        return None
    ordered = sorted(values, key=lambda v: (v is None, v or 0.0))
    n = len(ordered)
    mid = ordered[(n - 1) // 2 : n // 2 + 1]
    if any(v is None for v in mid):
        return None
    return float(sum(v for v in mid if v is not None) / len(mid))


def table(results: Sequence[dict[str, Any]]) -> str:
    """The markdown table: per regime and variant, runs that reached, median samples and seconds
    to the threshold (unreached runs counted as slowest), and ReVal's speed-up over GRPO."""
    lines = ["| regime | variant | reached | samples to it (median) | seconds to it (median) "
             "| of which after the first update (median) | per seed: seconds (samples) "
             "| first row of the log at (s, median) |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for regime in ("gpu", "cpu"):
        for variant in VARIANTS:
            runs = sorted((r for r in results if r["regime"] == regime
                           and r["variant"] == variant), key=lambda r: r["seed"])  # fmt: skip
            if not runs:
                continue
            secs = censored_median([r["seconds_to_threshold"] for r in runs])
            after = censored_median([r["seconds_to_threshold"] - (r["first_point_s"] or 0.0)
                                     if r["reached"] else None for r in runs])  # fmt: skip
            samples = censored_median([r["samples_to_threshold"] for r in runs])
            per = " / ".join(
                f"s{r['seed']}: {r['seconds_to_threshold']:.0f} ({r['samples_to_threshold']})"
                if r["reached"] else
                f"s{r['seed']}: not in {r['last']['seconds']:.0f} ({r['last']['samples']}; "
                f"{r['last']['success']:.2f})" if r["last"] else f"s{r['seed']}: no data"
                for r in runs
            )  # fmt: skip
            first = statistics.median(r["first_point_s"] or 0.0 for r in runs)
            lines.append(
                f"| {regime} | {variant} | {sum(r['reached'] for r in runs)}/{len(runs)} | "
                f"{'-' if samples is None else f'{samples:.0f}'} | "
                f"{'-' if secs is None else f'{secs:.0f}'} | "
                f"{'-' if after is None else f'{after:.0f}'} | {per} | {first:.0f} |"
            )
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--regimes", nargs="+", default=["cpu", "gpu"], choices=["cpu", "gpu"])
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--threshold", type=float, default=THRESHOLD)
    p.add_argument("--max-samples", type=int, default=MAX_SAMPLES)
    p.add_argument("--gen-share", type=float, default=GEN_SHARE)
    p.add_argument("--token-s", type=float, help="the cost model's seconds per token (skip the "
                   "calibration: e.g. a previous race.json's)")  # fmt: skip
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--run-limit-s", type=float, default=1200.0, help="a run's wall-clock cap")
    p.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    p.add_argument("--out", help="where the runs and race.json go (default: a temporary dir)")
    p.add_argument("--table", help="print the table of this race.json and exit")
    args = p.parse_args()
    if args.table:
        print(table(json.loads(Path(args.table).read_text())["runs"]))
        return 0

    from reval.config import load_config

    out = Path(args.out or tempfile.mkdtemp(prefix="reval-race-"))
    out.mkdir(parents=True, exist_ok=True)
    round_size = load_config(ROOT / "configs" / "demo.toml", environ={}).round_size
    report: dict[str, Any] = {"command": " ".join(sys.argv), "threshold": args.threshold,
                              "max_samples": args.max_samples, "gen_share": args.gen_share,
                              "window_samples": WINDOW_SAMPLES, "cpus": os.cpu_count(),
                              "calibration": None, "token_s": args.token_s, "runs": []}  # fmt: skip
    save = out / "race.json"
    for seed in args.seeds:
        for regime in sorted(args.regimes):  # cpu first: its sync ReVal run calibrates
            order = [v for v in ("sync ReVal", *VARIANTS) if v in args.variants]
            for variant in dict.fromkeys(order):
                if regime == "gpu" and report["token_s"] is None:
                    raise SystemExit("the gpu regime needs --token-s or a cpu sync ReVal run first")
                token_s = report["token_s"] if regime == "gpu" else 0.0
                tag = f"{regime}-{variant.replace(' ', '-').lower()}-s{seed}"
                env = race_env(out, token_s, tag)
                grpo = variant.endswith("GRPO")
                print(f"{time.strftime('%H:%M:%S')} {tag} (token_s={token_s:.2e})", flush=True)
                if variant.startswith("sync"):
                    rows, points = sync_run(seed, grpo, env, out, args, round_size, tag)
                else:
                    rows, points = service_run(seed, grpo, env, out, args, tag)
                res = summarize_run(variant, regime, seed, rows, points, args.threshold,
                                    charges(out, tag))  # fmt: skip
                if report["token_s"] is None and regime == "cpu" and variant == "sync ReVal":
                    cal = calibrate(rows, args.gen_share)
                    report["calibration"] = {**asdict(cal), "token_s": cal.token_s}
                    report["token_s"] = cal.token_s
                report["runs"].append(res)
                save.write_text(json.dumps(report, indent=1))
                print(json.dumps({k: v for k, v in res.items() if k != "curve"}), flush=True)
    print(table(report["runs"]))
    print(f"(JSON: {save})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
