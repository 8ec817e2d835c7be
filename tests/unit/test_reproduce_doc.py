"""docs/reproduce-paper.md is a tested artifact: every `reval` command in its shell blocks parses
with the real CLI, and the configs it names load."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from reval.config import load_config
from services.cli_args import build_parser

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "reproduce-paper.md"


def commands(text: str) -> list[list[str]]:
    """The `reval ...` command lines of the ```bash blocks (continuations joined, comments
    and `export`/`docker` lines left out)."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        joined = block.replace("\\\n", " ")
        for line in joined.splitlines():
            words = shlex.split(line, comments=True)
            if words and words[0] == "reval":
                out.append(words)
    return out


def test_every_reval_command_of_the_guide_parses_and_its_config_loads():
    found = commands(DOC.read_text())
    assert {w[1] for w in found} >= {"runs", "eval"}, found
    for words in found:
        args = build_parser().parse_args(words[1:])
        if getattr(args, "config", None):
            load_config(str(ROOT / args.config), args.overrides, environ={})


def test_the_guide_uses_the_presets_of_the_compose_file():
    text = DOC.read_text()
    for preset in ("r1_distill_qwen_1p5b.toml", "qwen25_math_7b.toml"):
        assert f"REVAL_CONFIG={preset}" in text
        cfg = load_config(str(ROOT / "configs" / preset), [], environ={})
        assert cfg.learner.rounds == 650 and cfg.rollout.engine == "vllm"
    assert "--profile eval" in text


def test_the_learner_estimate_follows_from_its_own_figures():
    """The worked estimate of seconds per update: its FLOPs and times are recomputed from the
    table's N, L, d and tokens (6N + 6·L·d·T to train, 2 x (2N + 2·L·d·T) for the recompute and
    the reference, 4 H100s at 989 TFLOPS and the stated MFU), so an edit cannot leave them
    inconsistent; and it says that it is an estimate."""
    text = DOC.read_text()
    rows = {
        line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:4]]
        for line in text.splitlines()
        if line.startswith("  | ")
    }
    mfu = float(re.search(r"at (\d+)% MFU", text).group(1)) / 100
    assert "a worked estimate" in text and "not a measurement" in text
    for col in (0, 1):
        n, layers, width = re.match(r"([\d.e]+) \((\d+), (\d+)\)", rows["N (L, d)"][col]).groups()
        big_n, L, d = float(n), int(layers), int(width)
        t = float(rows["tokens per trajectory (prompt + answer)"][col].split("=")[-1]
                  .replace(",", ""))  # fmt: skip
        per_token = 6 * big_n + 6 * L * d * t + 2 * (2 * big_n + 2 * L * d * t)
        flops = per_token * 1024 * t
        assert float(rows["FLOPs per update"][col]) == pytest.approx(flops, rel=0.02)
        secs = flops / (4 * 989e12 * mfu)
        row = next(v for k, v in rows.items() if k.startswith("seconds per update"))
        assert float(row[col].strip("~ s")) == pytest.approx(secs, rel=0.03)
        hours = float(rows["1,300 updates (650 iterations x K = 2)"][col].strip("~ h"))
        assert hours == pytest.approx(1300 * secs / 3600, rel=0.05)
