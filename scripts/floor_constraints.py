"""The lowest versions pyproject.toml allows, as a pip constraints file (the floors lane,
`make test-floors`): every `name>=X` of the dependencies and the dev extra becomes `name==X`.

torch is the exception: the lane installs the CPU wheel torch==2.13.0 first, as `make venv`
does (a CPU machine never pulls a CUDA build), so its floor is checked by reading, not by this
lane (docs/operations.md). Usage: python3 scripts/floor_constraints.py > constraints.txt
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TORCH = "torch==2.13.0"  # the CPU wheel of the Makefile; not the floor
FLOOR = re.compile(r"^\s*([A-Za-z0-9_.-]+)(\[[^\]]*\])?\s*>=\s*([0-9][0-9A-Za-z.]*)\s*(,.*)?$")


def constraints(pyproject: Path = ROOT / "pyproject.toml") -> list[str]:
    project = tomllib.loads(pyproject.read_text())["project"]
    reqs = [*project["dependencies"], *project["optional-dependencies"]["dev"]]
    out = []
    for req in reqs:
        m = FLOOR.match(req)
        if m is None:
            raise SystemExit(f"floor_constraints: {req!r} has no `>=` floor; give it one")
        name, version = m.group(1), m.group(3)
        out.append(TORCH if name == "torch" else f"{name}=={version}")
    return out


if __name__ == "__main__":
    sys.stdout.write("\n".join(constraints()) + "\n")
