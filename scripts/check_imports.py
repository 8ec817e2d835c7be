"""The floors rule of docs/architecture.md §1, checked: every import of the project's packages
(those inside functions too) points down, and no modules import each other in a circle.

    python3 scripts/check_imports.py          # prints each problem; exit 1 when there is any

Floors, top to bottom: ``services``; ``rollout`` and ``learner`` side by side (neither imports
the other); ``buffer``; ``reval``. ``make lint`` and tests/unit/test_import_floors.py run it.
"""

from __future__ import annotations

import ast
import graphlib
import sys
from pathlib import Path

PACKAGES = ("reval", "buffer", "rollout", "learner", "services")
MAY_IMPORT = {
    "services": {"services", "rollout", "learner", "buffer", "reval"},
    "rollout": {"rollout", "buffer", "reval"},
    "learner": {"learner", "buffer", "reval"},
    "buffer": {"buffer", "reval"},
    "reval": {"reval"},
}


def modules(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every .py of the packages."""
    found = {}
    for pkg in PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            found[".".join(p for p in parts if p != "__init__")] = path
    return found


def imported(name: str, path: Path, node: ast.AST) -> list[str]:
    """The dotted names an import statement of module ``name`` refers to."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = node.module or ""
    if node.level:  # relative: from the module's package, one level up per extra dot
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        package = package[: len(package) - node.level + 1]
        base = ".".join([*package, base] if base else package)
    return [f"{base}.{a.name}" for a in node.names]  # (``graph`` maps a non-module to its module)


def graph(root: Path) -> dict[str, set[str]]:
    """Module -> the project modules it imports."""
    mods = modules(root)

    def owner(dotted: str) -> str | None:  # the longest project module the name falls in
        while dotted and dotted not in mods:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    edges: dict[str, set[str]] = {}
    for name, path in mods.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            for dotted in imported(name, path, node):
                target = owner(dotted)
                if target is not None and target != name:
                    targets.add(target)
        edges[name] = targets
    return edges


def problems(root: Path) -> list[str]:
    edges = graph(root)
    found = [
        f"wrong way: {src} -> {dst}"
        for src, dsts in sorted(edges.items())
        for dst in sorted(dsts)
        if dst.split(".")[0] not in MAY_IMPORT[src.split(".")[0]]
    ]
    remaining = dict(edges)
    while True:  # report every circle, one at a time, by cutting an edge of each
        try:
            graphlib.TopologicalSorter(remaining).prepare()
            break
        except graphlib.CycleError as err:
            cycle = err.args[1]
            found.append("circle: " + " -> ".join(cycle))
            remaining[cycle[-1]] = remaining[cycle[-1]] - {cycle[-2]}
    return found


def main() -> int:
    root = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).resolve().parents[1])
    found = problems(root)
    for line in found:
        print(line)
    print(f"{len(modules(root))} modules, {len(found)} problems")
    return 1 if found else 0


if __name__ == "__main__":
    raise SystemExit(main())
