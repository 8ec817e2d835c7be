"""``make gpu-check``: every GPU figure the project owes, in one run of at most 8 minutes on a
machine with one GPU and no network, written to one JSON (docs/learner.md, "make gpu-check").

    ../shared/tools/gpu_wheels.sh pytest-timeout       # here, beforehand: fills .whl/
    python3 benchmarks/gpu_check.py --out $OUT/gpu_check.json          # on the GPU machine
    .venv/bin/python benchmarks/gpu_check.py --device cpu              # the dry run (CI)
    .venv/bin/python benchmarks/gpu_tables.py runs/gpu_check/gpu_check.json --write docs/learner.md

What it does, in order (each step a process of its own, with its own timeout inside the whole
budget; a step that fails or runs out of time is recorded and the next one still runs):

1. ``install``: the modules the steps import that the machine lacks (a CUDA image has torch,
   transformers, numpy and pytest, not pydantic, redis, math-verify, pytest-timeout) are
   installed from the wheels in ``.whl/`` with ``pip install --no-index --no-deps --target
   SITE`` (``--site``, default /tmp/site), which then goes on the steps' ``PYTHONPATH`` (with the
   repository's root). Nothing missing: nothing installed.
2. ``learner``: ``benchmarks/learner_gpu_bench.py --gpu`` at the 1.5B shape, varlen attention,
   RL-like and equal lengths at full scale, median of ``--reps 1`` after its two warm-ups (what
   fits the budget): useful-token MFU and the ratio to a plain HF step; then, the full model
   freed, the same update with rank-32 LoRA adapters (``--lora 32``): time and peak memory
   against the full model's (issue 41).
3. ``sync``: ``benchmarks/sync_bench.py --gpu`` at the Qwen2.5-1.5B and 7B shapes, 3 reps after
   1 warm-up: ``WeightSender.send`` against the gather-and-pack floor; and the 1.5B shape's
   rank-32 adapters published alone (``--lora 32``): their bytes and send against the full.
4. ``gpu-tests``: ``pytest -m gpu tests/gpu`` (a JUnit XML beside the logs gives each test's
   outcome), less ``test_publish_gpu.py`` unless ``--all-tests``: the sync step measures what it
   asserts (and the 7B shape), and the 8 minutes have no room for both. Without pytest-timeout
   (the project's ``addopts`` name its ``--timeout``), it runs with ``-o addopts=`` and the step
   says so.

Each step's limit (``TIMEOUT_S``) is an estimate: none of this has run on a GPU yet.

``--device cpu`` (the dry run, CI): the same steps on the CPU at the smallest shapes the
benchmarks offer (``learner_gpu_bench.py --device cpu --shape tiny --scale 128 --lora 8``,
``sync_bench.py --device cpu --sizes 50MB --lora 8``, one rep) and the gpu tests collected only
(``--collect-only``: they import); ``OMP_NUM_THREADS=1`` unless set (on a shared 2-core machine
torch's default threads spin: 14 s against 75 s for the learner step here); 45 s here with a
load average of 11.

Exit status 0 when every step (and the install) ended with 0, else 1. The JSON (``--out``,
default ``runs/gpu_check/gpu_check.json``; each step's log and the benchmarks' own JSON beside
it) is rewritten after every step, so a run cut short still leaves what it measured. Format 1::

    {"format": 1, "mode": "gpu" | "dry-run",
     "command": "python benchmarks/gpu_check.py ..." (this run's arguments),
     "date": "2026-11-28T03:30:00+00:00" (UTC, the start), "seconds": total, "budget_s": 465,
     "env": {"python", "torch", "cuda" (torch.version.cuda, null on a CPU build),
             "cuda_available", "device" (torch.cuda.get_device_name, or "cpu"),
             "device_memory_gb", "transformers", "error" (when the probe failed)},
     "install": {"missing": [modules], "command": str | null (null: nothing installed), "rc",
                 "seconds", "still_missing": [modules], "tail" / "note" (pip's output / why
                 nothing was installed, when there is one)},
     "steps": [{"name": "learner" | "sync" | "gpu-tests", "title", "command" (shell form),
                "rc" (124 after a timeout; null when not run), "seconds", "timeout_s",
                "timed_out", "log" (file name beside the JSON), "tail" (the log's last 2,000
                characters), "note" (what the step changed, or why it did not run, or null),
                "figures"}],
     "ok": every rc 0, the install's included}

``figures``: for ``learner`` and ``sync`` the benchmark's own JSON (``--out``; their docstrings),
or null when it wrote none; for ``gpu-tests`` ``{"passed", "failed", "errors", "skipped",
"cases": [{"id", "outcome", "s", "message"}]}`` from the JUnit XML, in the dry run
``{"collected": n, "cases": [{"id", "outcome": "collected"}]}``. ``benchmarks/gpu_tables.py``
turns it into docs/learner.md's tables (issue 41's LoRA targets judged with the sync step's).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
FORMAT = 1
TAIL_CHARS = 2000
MIN_STEP_S = 5.0
"""A step with less than this left of the budget is not started (recorded as not run)."""
NEEDED = (
    "pydantic",
    "redis",
    "math_verify",
    "pytest_timeout",
    "msgpack",
    "safetensors",
    "transformers",
    "numpy",
    "pytest",
)
"""Modules the steps import (torch aside); the first four are what ``.whl/`` carries."""
OPTIONAL = ("pytest_timeout",)
"""Missing after the install, these fail nothing: without pytest-timeout the tests run with
``-o addopts=`` (the project's addopts name its ``--timeout``); the step's note says so."""
BUDGET_S = {"gpu": 465.0, "dry-run": 110.0}
"""The whole run's seconds: 8 minutes less a margin on a GPU; well under 2 minutes for CI."""
LORA_RANK = 32
"""The LoRA rank of the learner and sync steps' adapter rows (issue 41's targets are at rank 32
on the 1.5B shape)."""
TIMEOUT_S = {
    "gpu": {"learner": 250.0, "sync": 130.0, "gpu-tests": 85.0},
    "dry-run": {"learner": 75.0, "sync": 40.0, "gpu-tests": 40.0},
}
"""Each step's own limit (``--timeout NAME=S`` overrides), further capped by what is left. The
GPU figures are estimates, never measured: issue 27's H200 run took 5-8 s per 1.5B update, and the
learner step runs 24 updates; the sync step writes a 15 GB file per 7B version."""
PUBLISH_TEST = (
    "tests/gpu/test_publish_gpu.py::test_send_at_the_1_5b_shape_costs_at_most_1_5x_the_floor"
)
"""Left out of the GPU run's tests unless ``--all-tests``: the sync step measures the same thing
(1.5B, send against the floor) and more, and the budget has no room for both."""

PROBE = """
import importlib.metadata as md, json, platform
out = {"python": platform.python_version()}
try:
    import torch
    out.update(torch=torch.__version__, cuda=torch.version.cuda,
               cuda_available=torch.cuda.is_available(), device="cpu", device_memory_gb=None)
    if out["cuda_available"]:
        p = torch.cuda.get_device_properties(0)
        out.update(device=p.name, device_memory_gb=round(p.total_memory / 1e9, 1))
    out["transformers"] = md.version("transformers")
except Exception as e:  # (recorded: the steps will say more)
    out["error"] = repr(e)
print(json.dumps(out))
"""


@dataclass
class Step:
    """One process of the run: ``argv`` from the repository's root; ``figures`` reads what it
    measured from its output file and its log (or returns None)."""

    name: str
    title: str
    argv: list[str]
    timeout_s: float
    figures: Any = None  # (Callable[[Path], dict | None], given the log)
    note: str | None = None


def _json_file(path: Path) -> Any:
    def read(log: Path) -> Any:
        return json.loads(path.read_text()) if path.exists() else None

    return read


def junit_figures(path: Path) -> Any:
    """Counts and each case's outcome from pytest's JUnit XML (None when there is none)."""

    def read(log: Path) -> Any:
        if not path.exists():
            return None
        cases = []
        for case in ET.parse(path).getroot().iter("testcase"):
            outcome, message = "passed", None
            for child in case:
                if child.tag in ("failure", "error", "skipped"):
                    outcome = {"failure": "failed", "error": "errors"}.get(child.tag, child.tag)
                    message = (child.get("message") or "")[:300]
                    break
            cid = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
            cases.append(
                {
                    "id": cid,
                    "outcome": outcome,
                    "s": float(case.get("time") or 0),
                    "message": message,
                }
            )
        counts = {
            k: sum(c["outcome"] == k for c in cases)
            for k in ("passed", "failed", "errors", "skipped")
        }
        return {**counts, "cases": cases}

    return read


def collected_figures(log: Path) -> Any:
    """The node ids ``pytest --collect-only -q`` printed, and their count."""
    text = log.read_text(errors="replace") if log.exists() else ""
    ids = [ln.strip() for ln in text.splitlines() if re.match(r"^tests/\S+::\S+", ln.strip())]
    m = re.search(r"(\d+) tests? collected", text)
    if m is None:
        return None
    return {"collected": int(m.group(1)), "cases": [{"id": i, "outcome": "collected"} for i in ids]}


def plan(
    mode: str, logdir: Path, python: str, timeouts: dict[str, float], all_tests: bool = False
) -> list[Step]:
    """The steps of ``mode`` ("gpu" or "dry-run"), their files in ``logdir``."""
    dry = mode == "dry-run"
    learner_json, sync_json, junit = (
        logdir / n for n in ("learner.json", "sync.json", "gpu-tests.xml")
    )
    learner = [python, "benchmarks/learner_gpu_bench.py", "--gpu", "--attention", "varlen"]
    learner += ["--reps", "1", "--out", str(learner_json)]
    learner += (
        ["--device", "cpu", "--shape", "tiny", "--scale", "128", "--lora", "8"]
        if dry
        else ["--shape", "1.5b", "--lora", str(LORA_RANK)]
    )
    sync = [python, "benchmarks/sync_bench.py", "--gpu", "--out", str(sync_json)]
    sync += (
        ["--device", "cpu", "--sizes", "50MB", "--reps", "1", "--warmup", "1", "--lora", "8",
         "--lora-sizes", "50MB"]
        if dry
        else ["--sizes", "qwen2.5-1.5b,qwen2.5-7b", "--reps", "3", "--warmup", "1", "--lora",
              str(LORA_RANK), "--lora-sizes", "qwen2.5-1.5b"]
    )  # fmt: skip
    tests = [python, "-m", "pytest", "-m", "gpu", "-p", "no:cacheprovider"]
    note = None
    if dry:
        tests += ["--collect-only", "-q", "tests/gpu"]
    else:
        tests += ["-q", "-s", "-rfEs", "--junitxml", str(junit), "tests/gpu"]
        if not all_tests:
            tests += ["--deselect", PUBLISH_TEST]
            note = "test_publish_gpu left out: the sync step measures it (--all-tests runs it)"
    return [
        Step(
            "learner",
            "useful-token MFU, benchmarks/learner_gpu_bench.py --gpu",
            learner,
            timeouts["learner"],
            _json_file(learner_json),
        ),
        Step(
            "sync",
            "send against the gather-and-pack floor, benchmarks/sync_bench.py --gpu",
            sync,
            timeouts["sync"],
            _json_file(sync_json),
        ),
        Step(
            "gpu-tests",
            "pytest -m gpu tests/gpu",
            tests,
            timeouts["gpu-tests"],
            collected_figures if dry else junit_figures(junit),
            note,
        ),
    ]


def shell_form(argv: list[str], logdir: Path) -> str:
    """``argv`` as one would type it: the interpreter as ``python``, files as ``DIR/name``."""
    shown = ["python", *argv[1:]] if argv and argv[0] == sys.executable else argv
    return shlex.join(a.replace(str(logdir), "DIR") for a in shown)


def run_step(step: Step, logdir: Path, env: dict[str, str], left_s: float) -> dict[str, Any]:
    """Runs ``step`` (a process group of its own, ended with it on timeout) and says how it
    went: the record of the module docstring."""
    log = logdir / f"{step.name}.log"
    rec: dict[str, Any] = {
        "name": step.name,
        "title": step.title,
        "command": shell_form(step.argv, logdir),
        "rc": None,
        "seconds": 0.0,
        "timeout_s": None,
        "timed_out": False,
        "log": log.name,
        "tail": "",
        "note": step.note,
        "figures": None,
    }
    timeout = min(step.timeout_s, left_s)
    if timeout < MIN_STEP_S:
        rec["note"] = f"{max(left_s, 0):.0f} s of the budget left, under {MIN_STEP_S:g} s"
        return rec
    rec["timeout_s"] = round(timeout, 1)
    t0 = time.monotonic()
    with log.open("w") as out:
        proc = subprocess.Popen(
            step.argv,
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            rec["rc"] = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rec["timed_out"], rec["rc"] = True, 124
            _end_group(proc)
    rec["seconds"] = round(time.monotonic() - t0, 2)
    text = log.read_text(errors="replace")
    rec["tail"] = text[-TAIL_CHARS:]
    if step.figures is not None:
        try:
            rec["figures"] = step.figures(log)
        except Exception as e:  # (a half-written file: the step failed anyway)
            rec["note"] = f"{rec['note'] + '; ' if rec['note'] else ''}figures unreadable: {e!r}"
    return rec


def _end_group(proc: subprocess.Popen[Any]) -> None:
    """SIGTERM to the process group this script started for the step, SIGKILL after 10 s."""
    for sig, wait_s in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 30.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def probe(python: str, env: dict[str, str], code: str, timeout_s: float = 120.0) -> Any:
    run = subprocess.run(
        [python, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s
    )
    if run.returncode != 0:
        return {"error": (run.stdout + run.stderr)[-TAIL_CHARS:]}
    return json.loads(run.stdout.strip().splitlines()[-1])


def missing_modules(python: str, env: dict[str, str]) -> list[str]:
    code = (
        "import importlib.util as u, json; "
        f"print(json.dumps([m for m in {list(NEEDED)!r} if u.find_spec(m) is None]))"
    )
    got = probe(python, env, code)
    return got if isinstance(got, list) else list(NEEDED)


def install(python: str, env: dict[str, str], site: Path, wheels: Path) -> dict[str, Any]:
    """The install step: wheels from ``wheels`` into ``site`` when a module is missing."""
    missing = missing_modules(python, env)
    rec: dict[str, Any] = {
        "missing": missing,
        "command": None,
        "rc": None,
        "seconds": 0.0,
        "still_missing": missing,
    }
    files = sorted(str(p) for p in wheels.glob("*.whl"))
    if not missing or not files:
        rec["rc"] = int(any(m not in OPTIONAL for m in missing))
        if missing:
            rec["note"] = f"no wheels in {wheels}: run ../shared/tools/gpu_wheels.sh pytest-timeout"
        return rec
    pip = ["-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target"]
    rec["command"] = f"python {' '.join(pip)} {site} {wheels.name}/*.whl"
    t0 = time.monotonic()
    run = subprocess.run([python, *pip, str(site), *files], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    rec["seconds"] = round(time.monotonic() - t0, 2)
    rec["still_missing"] = still = missing_modules(python, env)
    rec["rc"] = run.returncode or int(any(m not in OPTIONAL for m in still))
    rec["tail"] = (run.stdout + run.stderr)[-TAIL_CHARS:]
    return rec


def step_env(site: Path, dry: bool) -> dict[str, str]:
    env = dict(os.environ)
    paths = [str(ROOT), str(site), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    if dry:
        env.setdefault("OMP_NUM_THREADS", "1")
    return env


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--device",
        default="cuda",
        choices=["cuda", "cpu"],
        help="cpu: the dry run (smallest shapes, tests collected only)",
    )
    ap.add_argument(
        "--out",
        default="runs/gpu_check/gpu_check.json",
        help="the JSON; logs and the benchmarks' JSON go beside it",
    )
    ap.add_argument("--budget-s", type=float, default=None, help="the whole run (465 / 110)")
    ap.add_argument(
        "--timeout",
        action="append",
        default=[],
        metavar="STEP=S",
        help="one step's limit: learner, sync, gpu-tests",
    )
    ap.add_argument("--steps", default=None, help="a subset, comma-separated (default all)")
    ap.add_argument("--site", default="/tmp/site", help="where the carried wheels go")
    ap.add_argument("--wheels", default=".whl", help="the carried wheels (gpu_wheels.sh)")
    ap.add_argument("--all-tests", action="store_true", help="GPU: test_publish_gpu too")
    args = ap.parse_args(argv)
    mode = "dry-run" if args.device == "cpu" else "gpu"
    t_start, started = time.monotonic(), dt.datetime.now(dt.UTC)
    budget = args.budget_s or BUDGET_S[mode]
    timeouts = dict(TIMEOUT_S[mode])
    for item in args.timeout:
        name, _, secs = item.partition("=")
        if name not in timeouts:
            ap.error(f"--timeout {item}: no step {name!r} ({', '.join(timeouts)})")
        timeouts[name] = float(secs)
    out = Path(args.out).resolve()
    logdir = out.parent
    logdir.mkdir(parents=True, exist_ok=True)
    site, python = Path(args.site), sys.executable
    env = step_env(site, mode == "dry-run")
    report: dict[str, Any] = {
        "format": FORMAT,
        "mode": mode,
        "command": shlex.join(["python", "benchmarks/gpu_check.py", *(argv or sys.argv[1:])]),
        "date": started.isoformat(timespec="seconds"),
        "seconds": 0.0,
        "budget_s": budget,
        "env": {},
        "install": {},
        "steps": [],
        "ok": False,
    }

    def save() -> None:
        report["seconds"] = round(time.monotonic() - t_start, 2)
        report["ok"] = report["install"].get("rc") == 0 and all(
            s["rc"] == 0 for s in report["steps"]
        )
        out.write_text(json.dumps(report, indent=1))

    report["install"] = install(python, env, site, (ROOT / args.wheels))
    report["env"] = probe(python, env, PROBE)
    save()
    steps = plan(mode, logdir, python, timeouts, args.all_tests)
    if args.steps:
        wanted = args.steps.split(",")
        unknown = set(wanted) - {s.name for s in steps}
        if unknown:
            ap.error(f"--steps: no step {sorted(unknown)}")
        steps = [s for s in steps if s.name in wanted]
    if mode == "gpu" and "pytest_timeout" in report["install"]["still_missing"]:
        for s in steps:
            if s.name == "gpu-tests":
                s.argv[3:3] = ["-o", "addopts="]
                s.note = "; ".join(filter(None, [s.note, "no pytest-timeout: -o addopts="]))
    for step in steps:
        print(f"gpu-check: {step.name}: {shell_form(step.argv, logdir)}", flush=True)
        rec = run_step(step, logdir, env, budget - (time.monotonic() - t_start))
        report["steps"].append(rec)
        save()
        print(
            f"gpu-check: {step.name}: rc {rec['rc']} in {rec['seconds']:.1f} s"
            + (f" ({rec['note']})" if rec["note"] else ""),
            flush=True,
        )
    save()
    print(f"gpu-check: {'ok' if report['ok'] else 'FAILED'} in {report['seconds']:.1f} s: {out}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
