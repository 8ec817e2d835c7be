"""scripts/check_imports.py: the floors of docs/architecture.md hold in this tree, and the check
finds an import that points up, one between rollout and learner, one inside a function, a
relative one and a circle in a made-up tree."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location(
    "check_imports", ROOT / "scripts" / "check_imports.py"
)
assert spec is not None and spec.loader is not None
check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(check)


def test_the_project_keeps_its_floors():
    assert check.problems(ROOT) == []


def write(root: Path, files: dict[str, str]) -> None:
    for pkg in check.PACKAGES:
        (root / pkg).mkdir(exist_ok=True)
        (root / pkg / "__init__.py").touch()
    for name, text in files.items():
        (root / name).write_text(text)


def test_it_finds_wrong_ways_and_circles(tmp_path):
    write(tmp_path, {
        "reval/base.py": "def f():\n    from buffer import ring\n",  # up, inside a function
        "buffer/ring.py": "from reval import base\n",
        "learner/a.py": "import rollout.b\n",  # sideways
        "rollout/b.py": "from . import c\n",  # relative, part of a circle
        "rollout/c.py": "from rollout.b import x\n",
        "services/top.py": "from learner import a\nfrom rollout import b\n",  # fine
    })  # fmt: skip
    found = check.problems(tmp_path)
    assert "wrong way: reval.base -> buffer.ring" in found
    assert "wrong way: learner.a -> rollout.b" in found
    assert not any(p.startswith("wrong way: services") for p in found)
    circles = sorted(p for p in found if p.startswith("circle"))
    assert len(circles) == 2, found  # reval.base <-> buffer.ring, rollout.b <-> rollout.c
    assert any("rollout.b" in c and "rollout.c" in c for c in circles)
    assert any("reval.base" in c and "buffer.ring" in c for c in circles)
