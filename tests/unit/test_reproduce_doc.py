"""docs/reproduce-paper.md is a tested artifact: every `reval` command in its shell blocks parses
with the real CLI, and the configs it names load."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from reval.config import load_config
from services.cli import _parser

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
        args = _parser().parse_args(words[1:])
        if getattr(args, "config", None):
            load_config(str(ROOT / args.config), args.overrides, environ={})


def test_the_guide_uses_the_presets_of_the_compose_file():
    text = DOC.read_text()
    for preset in ("r1_distill_qwen_1p5b.toml", "qwen25_math_7b.toml"):
        assert f"REVAL_CONFIG={preset}" in text
        cfg = load_config(str(ROOT / "configs" / preset), [], environ={})
        assert cfg.learner.rounds == 650 and cfg.rollout.engine == "vllm"
    assert "--profile eval" in text
