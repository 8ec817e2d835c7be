"""The JSON of ``benchmarks/gpu_check.py`` (its docstring: format 1) as docs/learner.md's tables:
the machine and the command, each step's outcome, publishing against the floor, the learner's
useful-token MFU, the gpu tests, and the targets of issues 27, 39 and 41 met or not (judged on a
GPU run only).

    .venv/bin/python benchmarks/gpu_tables.py runs/gpu_check/gpu_check.json          # markdown
    .venv/bin/python benchmarks/gpu_tables.py gpu_check.json --write docs/learner.md  # in place

``--write`` replaces what lies between the ``<!-- gpu-check:begin -->`` and
``<!-- gpu-check:end -->`` lines of the file, and nothing else.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

BEGIN, END = "<!-- gpu-check:begin -->", "<!-- gpu-check:end -->"
SEND_OVER_FLOOR = 1.5
"""Publishing's target (issue 39): send at most 1.5x the gather-and-pack floor, every shape..."""
SEND_7B_S = 0.5
"""...and at most 0.5 s at the 7B shape."""
MFU_TARGET = 0.40
HF_RATIO_TARGET = 1.2
"""The learner's targets (issue 27): on RL-like lengths, ReVal with the reference cached at >=
40% useful-token MFU and >= 1.2x a plain HF step's useful tokens/s."""
LORA_BYTES = 0.02
LORA_SPEEDUP = 20.0
"""LoRA's publishing targets (issue 41): the adapters' bytes under 2% of the full weights' at the
1.5B shape, their send at least 20x faster than the full weights'."""
MIB = 1 << 20


def _cell(x: Any) -> str:
    return " ".join(str(x).split()).replace("|", "\\|")


def _table(head: list[str], rows: list[list[Any]]) -> list[str]:
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(_cell(c) for c in r) + " |" for r in rows]
    return out


def _verdict(ok: bool) -> str:
    return "met" if ok else "**not met**"


def _step(report: dict[str, Any], name: str) -> dict[str, Any] | None:
    return next((s for s in report["steps"] if s["name"] == name), None)


def header(report: dict[str, Any]) -> list[str]:
    env = report.get("env", {})
    dev = env.get("device", "?")
    if env.get("device_memory_gb"):
        dev += f" ({env['device_memory_gb']:g} GB)"
    cuda = f"CUDA {env['cuda']}" if env.get("cuda") else "no CUDA"
    lines = [
        f"Run by `{report['command']}` on {dev}, torch {env.get('torch', '?')} ({cuda}), "
        f"transformers {env.get('transformers', '?')}, Python {env.get('python', '?')}, "
        f"{report['date']}: {report['seconds']:.0f} s of a {report['budget_s']:.0f} s budget, "
        + ("every step ended with 0." if report["ok"] else "**not every step ended with 0**."),
    ]
    if report["mode"] == "dry-run":
        lines[0] += (
            " A dry run on the CPU (`--device cpu`): the smallest shapes, the gpu tests collected"
            " only; it shows the path runs, not a GPU's speed, and the targets are not judged."
        )
    if env.get("error"):
        lines.append(f"The environment probe failed: `{_cell(env['error'][-300:])}`.")
    inst = report.get("install", {})
    if inst.get("command"):
        lines.append(
            f"Installed from the carried wheels ({', '.join(inst['missing'])} missing): "
            f"`{inst['command']}`, rc {inst['rc']}"
            + (
                f", still missing {', '.join(inst['still_missing'])}."
                if inst["still_missing"]
                else "."
            )
        )
    elif inst.get("still_missing"):
        lines.append(f"Missing and not installed: {', '.join(inst['still_missing'])}.")
    return lines


def steps_table(report: dict[str, Any]) -> list[str]:
    rows = []
    for s in report["steps"]:
        rc = (
            "not run"
            if s["rc"] is None
            else f"{s['rc']}" + (" (timed out)" if s["timed_out"] else "")
        )
        limit = f"{s['timeout_s']:.0f}" if s["timeout_s"] else "-"
        rows.append(
            [s["name"], f"`{s['command']}`", rc, f"{s['seconds']:.1f}", limit, s["note"] or ""]
        )
    return _table(["step", "command", "rc", "s", "limit s", "note"], rows)


def sync_tables(report: dict[str, Any], judge: bool) -> list[str]:
    step = _step(report, "sync")
    if step is None:
        return []
    out = ["", f"**Publishing**: {step['title']}.", ""]
    figs = step["figures"]
    if not figs:
        return [*out, _no_figures(step)]
    rows, targets = [], []
    for r in figs["results"]:
        m, pk = r["median_s"], r["peak_extra_bytes"]
        adapters = bool(r.get("lora"))
        rows.append(
            [
                f"{r['model']}, LoRA r{r['lora']} adapters" if adapters else r["model"],
                f"{r['nbytes'] / 1e9:.4f}" if adapters else f"{r['nbytes'] / 1e9:.2f}",
                r["buckets"],
                f"{m['send']:.4f}",
                f"{m['send_returns']:.4f}",
                f"{m['floor']:.4f}",
                f"{r['ratio_send_to_floor']:.2f}",
                f"{m['gather']:.4f}",
                f"{pk['send'] / MIB:,.0f} / {pk['floor'] / MIB:,.0f}",
            ]
        )
        if adapters:  # (judged below against the full publish of the same model)
            continue
        ok = r["ratio_send_to_floor"] <= SEND_OVER_FLOOR
        what = f"{r['model']}: send <= {SEND_OVER_FLOOR}x the floor"
        if "7b" in r["model"].lower():
            ok = ok and m["send"] <= SEND_7B_S
            what += f" and <= {SEND_7B_S} s"
        targets.append(
            f"- {what}: {_verdict(ok)} ({r['ratio_send_to_floor']:.2f}x, {m['send']:.3f} s)"
        )
    out += _table(
        [
            "model",
            "GB sent",
            "buckets",
            "send s",
            "send returns s",
            "floor s",
            "send / floor",
            "gathers only s",
            "peak extra MiB send / floor",
        ],
        rows,
    )
    out += ["", f"Median of {figs['reps']}, {figs['bucket_mb']:g} MB buckets, files on, no wire."]
    for model, v in figs.get("lora_vs_full", {}).items():
        out.append(f"{model}, LoRA rank {v['rank']}: the adapters are {v['bytes_ratio']:.2%} of "
                   f"the full bytes; their send {v['speedup']:.1f}x faster.")  # fmt: skip
        ok = v["bytes_ratio"] < LORA_BYTES and v["speedup"] >= LORA_SPEEDUP
        targets.append(
            f"- {model}, LoRA rank {v['rank']}: adapters under {LORA_BYTES:.0%} of the full "
            f"bytes and their send >= {LORA_SPEEDUP:g}x faster: {_verdict(ok)} "
            f"({v['bytes_ratio']:.2%}, {v['speedup']:.1f}x)"
        )
    return out + (["", "Targets:", *targets] if judge else [])


def learner_tables(report: dict[str, Any], judge: bool) -> list[str]:
    step = _step(report, "learner")
    if step is None:
        return []
    out = ["", f"**The learner's update**: {step['title']}.", ""]
    figs = step["figures"]
    if not figs:
        return [*out, _no_figures(step)]
    a = figs["args"]
    rows = [
        [
            r["lengths"],
            r["update"],
            f"{r['s']:.3f}",
            f"{r['tokens_per_s']:,.0f}",
            f"{r['mfu']:.1%}",
            f"{r['peak_gb']:.1f}",
        ]
        for r in figs["rows"]
    ]
    out += _table(["lengths", "update", "s", "useful tokens/s", "useful MFU", "peak GB"], rows)
    ratios = ", ".join(f"{k} {v:.2f}x" for k, v in figs["ratio_vs_hf"].items())
    varlen = (
        "flash varlen"
        if not figs.get("varlen_failed")
        else f"flash varlen refused, per-sequence sdpa: {figs['varlen_failed'][0]}"
    )
    out += [
        "",
        f"Shape {a['shape']}, lengths / {a['scale']}, attention {a['attention']} "
        f"({_cell(varlen)}), checkpointing {a['checkpointing']}, median of {a['reps']} after "
        f"two warm-ups, MFU against {a['peak_tflops']:g} TFLOP/s. ReVal (reference cached) / "
        f"plain HF step, useful tokens/s: {ratios}.",
    ]
    for k, v in figs.get("lora_vs_full", {}).items():  # (measured, not judged: no target)
        peak = f", its peak memory {v['peak']:.2f}x" if v.get("peak") else ""
        out.append(f"LoRA against the full model (ReVal, reference cached), {k}: the update "
                   f"takes {v['s']:.2f}x the time{peak}.")  # fmt: skip
    if judge:
        by = {(r["lengths"], r["update"]): r for r in figs["rows"]}
        mfu = by[("RL-like", "ReVal, reference cached")]["mfu"]
        hf = figs["ratio_vs_hf"]["RL-like"]
        out += [
            "",
            "Targets:",
            f"- RL-like, ReVal with the reference cached, useful MFU >= {MFU_TARGET:.0%}: "
            f"{_verdict(mfu >= MFU_TARGET)} ({mfu:.1%})",
            f"- the same, >= {HF_RATIO_TARGET}x the plain HF step: "
            f"{_verdict(hf >= HF_RATIO_TARGET)} ({hf:.2f}x)",
        ]
    return out


def tests_tables(report: dict[str, Any]) -> list[str]:
    step = _step(report, "gpu-tests")
    if step is None:
        return []
    out = ["", f"**The gpu tests**: {step['title']}.", ""]
    figs = step["figures"]
    if not figs:
        return [*out, _no_figures(step)]
    if "collected" in figs:
        return [
            *out,
            f"{figs['collected']} collected (`--collect-only`, not run): "
            + ", ".join(f"`{c['id']}`" for c in figs["cases"])
            + ".",
        ]
    counts = ", ".join(f"{figs[k]} {k}" for k in ("passed", "failed", "errors", "skipped"))
    rows = [
        [f"`{c['id']}`", c["outcome"], f"{c['s']:.1f}", (c["message"] or "")[:160]]
        for c in figs["cases"]
    ]
    return [*out, counts + ".", "", *_table(["test", "outcome", "s", "message"], rows)]


def _no_figures(step: dict[str, Any]) -> str:
    """What a step that left no figures says: why not, and its log's last line."""
    if step["rc"] is None:
        return f"Not run: {step['note']}."
    lines = [ln for ln in step.get("tail", "").splitlines() if ln.strip()]
    last = lines[-1][-300:] if lines else "(empty)"
    timed_out = ", timed out" if step["timed_out"] else ""
    return f"No figures (rc {step['rc']}{timed_out}); the log's last line: `{_cell(last)}`."


def render(report: dict[str, Any]) -> str:
    """The markdown of ``report`` (gpu_check's JSON, format 1)."""
    if report.get("format") != 1:
        raise ValueError(f"gpu_check JSON format {report.get('format')!r}, this reads 1")
    judge = report["mode"] == "gpu"
    lines = [*header(report), "", *steps_table(report)]
    lines += learner_tables(report, judge) + sync_tables(report, judge) + tests_tables(report)
    return "\n".join(lines) + "\n"


def replace_section(text: str, body: str) -> str:
    """``text`` with what lies between the BEGIN and END lines replaced by ``body``."""
    if text.count(BEGIN) != 1 or text.count(END) != 1 or text.index(BEGIN) > text.index(END):
        raise ValueError(f"expected one {BEGIN} line, then one {END} line")
    head, rest = text.split(BEGIN)
    _, tail = rest.split(END)
    return f"{head}{BEGIN}\n{body.rstrip()}\n{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("json", help="gpu_check.py's JSON")
    ap.add_argument("--write", metavar="MD", help="replace the marked section of this file")
    args = ap.parse_args(argv)
    body = render(json.loads(Path(args.json).read_text()))
    if not args.write:
        sys.stdout.write(body)
        return 0
    path = Path(args.write)
    path.write_text(replace_section(path.read_text(), body))
    print(f"wrote the gpu-check section of {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
