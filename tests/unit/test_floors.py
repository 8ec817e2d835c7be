"""scripts/floor_constraints.py: the floors lane (`make test-floors`) pins every dependency of
pyproject.toml to its floor, except torch, which stays the Makefile's CPU wheel."""

from __future__ import annotations

import importlib.util
import re
import tomllib
from pathlib import Path

import pytest
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "floor_constraints.py"
spec = importlib.util.spec_from_file_location("floor_constraints", SCRIPT)
assert spec is not None and spec.loader is not None
floors = importlib.util.module_from_spec(spec)
spec.loader.exec_module(floors)


def test_every_dependency_is_pinned_to_its_floor():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = [*project["dependencies"], *project["optional-dependencies"]["dev"]]
    pins = dict(line.split("==") for line in floors.constraints())
    assert len(pins) == len(declared)
    for req in declared:
        name = re.sub(r"\[.*\]", "", req.split(">=")[0]).strip()
        floor = req.split(">=")[1].split(",")[0].strip()
        assert pins[name] == (pins["torch"] if name == "torch" else floor), req
    # torch: the CPU wheel the Makefile installs first, never a CUDA build.
    assert f"torch=={pins['torch']}" in (ROOT / "Makefile").read_text()
    assert Version(pins["transformers"]) >= Version("4.56")  # from_pretrained(dtype=...)


def test_a_dependency_without_a_floor_is_refused(tmp_path):
    text = (ROOT / "pyproject.toml").read_text().replace('"numpy>=1.26"', '"numpy"')
    (tmp_path / "pyproject.toml").write_text(text)
    with pytest.raises(SystemExit, match="'numpy' has no `>=` floor"):
        floors.constraints(tmp_path / "pyproject.toml")
