"""docs/architecture.md names only what exists (issue 40: "a map that matches").

Every name the page puts in backticks that points into the repo is checked: a path whose first
part is one of the repo's folders (``rollout/worker.py``, ``services/api/``, ``configs/*.toml``),
a bare file name (``worker.py``; in the module table under its package's row, under a heading that
names a folder, else at the repo's root), a dotted name under a package (``reval.retry``,
``reval.answers.answer_text``, ``rollout.grading.graders:code_tests``: the module, and the name in
its source) or a config field (``rollout.max_inflight``, ``sync.every``). Every Redis key pattern
on the page is one that ``reval/redis.py`` builds, the builder its key table names exists, and
every key ``reval/redis.py`` builds is in that table. Every module of the five packages is on the
page (its own name, or its folder's: ``reval/weights/``). Every run-directory path of the page's
run-directory table is named in ``reval/run_dir.py``. No network, no Redis, no git: the page,
the tree and two torch-free imports.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import BaseModel

from reval import redis as keys
from reval.config import ApiConfig, RunConfig

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "architecture.md"
LIBRARY = ("reval", "buffer", "rollout", "learner", "services")
"""The floors: every module of these is on the page (its name, or its folder's)."""
PACKAGES = ("reval", "buffer", "rollout", "learner", "services", "benchmarks", "scripts", "tests")
"""The first parts of a dotted name that make it a module's (``python -m`` runs these)."""
FOLDERS = (*PACKAGES, "configs", "deploy", "docs")
"""The repo's folders: a path in backticks that starts with one of these must exist. (Others,
``runs/NAME/``, a TCPStore's ``ticket/<n>``, are not the repo's.)"""
REPO_FILE = re.compile(r"^[\w.-]+\.(py|sh|toml|yml|yaml|conf|md|cfg)$")
"""A bare name of a file the repo holds (``worker.py``, ``rules.yml``)."""
RUN_FILE = re.compile(r"\.(json|jsonl|png|log|safetensors|spool|stopped|partial)$")
"""A name ending like a file a run writes (``metrics.jsonl``, ``eval.json``): not a dotted name."""
DOTTED = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)+$")
KEY = re.compile(r"^P(\{R\}|api):")
PLACEHOLDERS = re.compile(r"<[^>]*>(?:-<[^>]*>)*")
"""``<start>``, ``<n>-<sha1[:12]>``: one variable part of a key."""


def config_sections() -> dict[str, type[BaseModel]]:
    sections: dict[str, type[BaseModel]] = {"api": ApiConfig}
    for name, info in RunConfig.model_fields.items():
        if isinstance(info.annotation, type) and issubclass(info.annotation, BaseModel):
            sections[name] = info.annotation
    return sections


SECTIONS = config_sections()
DOTTED_ROOTS = {*PACKAGES, *SECTIONS}


@dataclass
class Found:
    """What the page says, sorted by kind."""

    paths: list[tuple[str, str | None]] = field(default_factory=list)
    """(name, the folder it is relative to, or None: the repo's root)."""
    dotted: list[str] = field(default_factory=list)
    keys: list[str] = field(default_factory=list)
    """Every Redis key pattern on the page (outside code blocks)."""
    table_keys: list[tuple[str, list[str]]] = field(default_factory=list)
    """The key table's rows: (pattern, the builder names in its first cell)."""
    run_paths: list[str] = field(default_factory=list)


def spans(text: str) -> list[str]:
    return re.findall(r"`([^`\n]+)`", text)


def cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def rows(text: str) -> Iterator[tuple[str, str | None, str | None]]:
    """Each line outside code blocks as (line, the folder its names are relative to, the first
    cell of its table's header, or None outside a table). A table's folder is its last
    ``**pkg/**`` row's, else the heading's: the first folder the heading names in backticks."""
    fenced = False
    heading: str | None = None
    table: str | None = None
    header: str | None = None
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
            continue
        if fenced:
            continue
        if line.startswith("#"):
            heading = next((s for s in spans(line) if s.endswith("/")), None)
        if not line.startswith("|"):
            table = header = None
            yield line, heading, None
            continue
        first = cells(line)[0]
        if header is None:
            header = first
        bold = re.fullmatch(r"\*\*([\w/]+/)\*\*", first)
        if bold:
            table = bold.group(1)
        yield line, table or heading, header


def parse(text: str) -> Found:
    found = Found()
    for line, where, header in rows(text):
        row = [line] if header is None else cells(line)
        for i, cell in enumerate(row):
            first = header is not None and i == 0
            if first and header == "path":  # (the run directory's table)
                found.run_paths += spans(cell)
                continue
            for span in spans(cell):
                if KEY.match(span):
                    found.keys.append(span)
                    if first and header is not None and header.startswith("key"):
                        builders = [n for s in spans(cell) if not KEY.match(s) for n in names(s)]
                        found.table_keys.append((span, builders))
                    continue
                for word in span.split():
                    # A name is its folder's in a table's first cell; a bare one in prose
                    # under a heading that names a folder is too; elsewhere, the root's.
                    bare = "/" not in word.rstrip("/")
                    relative = where if first or (bare and header is None) else None
                    classify(word, relative, found)
    return found


def names(span: str) -> list[str]:
    """The builder names of a key row's ``(ring_keys().meta)``, ``.chunk(start)``, ..."""
    return re.findall(r"(?:^|\.)([A-Za-z_]\w*)", span)


def classify(word: str, where: str | None, found: Found) -> None:
    word = word.strip(".,;()")
    if not word or word.startswith(("-", "/", "$")) or "{" in word or "<" in word:
        return
    if ":" in word:  # a spec, package.module:name (a path's spec is the user's, not ours)
        module, _, _ = word.rpartition(":")
        if DOTTED.match(module) and module.split(".")[0] in PACKAGES:
            found.dotted.append(word)
        return
    if "/" in word:
        if word.split("/")[0] in FOLDERS:
            found.paths.append((word, None))
        elif where and (word.endswith("/") or REPO_FILE.match(word.rsplit("/", 1)[1])):
            found.paths.append((word, where))  # (``api/``, ``api/app.py`` in its package's rows)
        return
    if REPO_FILE.match(word):
        found.paths.append((word, where))
    elif DOTTED.match(word) and not RUN_FILE.search(word) and word.split(".")[0] in DOTTED_ROOTS:
        found.dotted.append(word)


def path_problem(name: str, where: str | None) -> str | None:
    full = (where or "") + name
    if any(c in full for c in "*?["):
        return None if any(ROOT.glob(full)) else f"`{name}`: nothing matches {full}"
    target = ROOT / full
    ok = target.is_dir() if full.endswith("/") else target.is_file()
    return None if ok else f"`{name}`: no {full}"


def module_of(parts: list[str]) -> tuple[Path, list[str]] | None:
    """The longest prefix of ``parts`` that is a module (its source) and the names after it."""
    for n in range(len(parts), 0, -1):
        base = ROOT.joinpath(*parts[:n])
        for source in (base.with_suffix(".py"), base / "__init__.py"):
            if source.is_file():
                return source, parts[n:]
    return None


def config_field(parts: list[str]) -> bool:
    model: type[BaseModel] | None = SECTIONS.get(parts[0])
    for part in parts[1:]:
        if model is None or part not in model.model_fields:
            return False
        sub = model.model_fields[part].annotation
        model = sub if isinstance(sub, type) and issubclass(sub, BaseModel) else None
    return len(parts) > 1


def dotted_problem(word: str) -> str | None:
    module, _, attribute = word.partition(":")
    parts = module.split(".")
    found = module_of(parts)
    if found is not None:
        source, rest = found
        rest += attribute.split(".") if attribute else []
        text = source.read_text(encoding="utf-8")
        missing = [r for r in rest if not re.search(rf"\b{re.escape(r)}\b", text)]
        if not missing:
            return None
    if not attribute and config_field(parts):
        return None
    return f"`{word}`: no such module, name in a module, or config field"


def built_keys() -> set[str]:
    """Every key pattern ``reval/redis.py`` builds, its variable parts as ``*``."""
    built = set()
    for name, fn in vars(keys).items():
        if name.startswith("_") or name in ("connect", "ring_keys") or not inspect.isfunction(fn):
            continue
        if fn.__module__ != keys.__name__:
            continue
        args = {
            p: {"prefix": "P", "run": "R"}.get(p, f"<{p}>")
            for p in inspect.signature(fn).parameters
        }
        built.add(fn(**args))
    ring = keys.ring_keys("P", "R")
    for name, key in ring._asdict().items():
        built.add(key + "<start>" if name == "rec" else key)
    built.add(ring.stage + "<id>")
    return {PLACEHOLDERS.sub("*", k) for k in built}


def key_problems(found: Found) -> list[str]:
    built = built_keys()
    out = [f"`{k}`: reval/redis.py builds no such key" for k in found.keys
           if PLACEHOLDERS.sub("*", k) not in built]  # fmt: skip
    known = set(vars(keys)) | set(keys.RingKeys._fields) | set(dir(keys.RingKeys))
    for key, builders in found.table_keys:
        out += [f"`{key}`: its builder `{b}` is not in reval/redis.py" for b in builders
                if b not in known]  # fmt: skip
    listed = {PLACEHOLDERS.sub("*", k) for k, _ in found.table_keys}
    if found.table_keys:
        out += [
            f"`{k}`: built in reval/redis.py, not in the key table" for k in sorted(built - listed)
        ]
    return out


def run_path_problems(found: Found) -> list[str]:
    source = (ROOT / "reval" / "run_dir.py").read_text(encoding="utf-8")
    out = []
    for path in found.run_paths:
        first = path.split("/")[0]
        pieces = [p for p in re.split(r"<[^>]*>|X{4,}", first) if len(p) >= 2]
        if not pieces or any(p not in source for p in pieces):
            out.append(f"`{path}`: not a path of reval/run_dir.py")
    return out


def unmapped(found: Found) -> list[str]:
    """The library's modules the page leaves out: each is named, or its folder is."""
    named = {(where or "") + name for name, where in found.paths}
    out = []
    for package in LIBRARY:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            folders = {rel[: i + 1] for i, c in enumerate(rel) if c == "/"} - {f"{package}/"}
            if path.name != "__init__.py" and rel not in named and not folders & named:
                out.append(f"`{rel}`: a module the page does not name")
    return out


def problems(text: str) -> list[str]:
    found = parse(text)
    out = [p for name, where in found.paths if (p := path_problem(name, where))]
    out += [p for word in found.dotted if (p := dotted_problem(word))]
    return out + key_problems(found) + run_path_problems(found) + unmapped(found)


def test_the_page_names_only_what_exists() -> None:
    found = problems(PAGE.read_text(encoding="utf-8"))
    assert not found, (
        "docs/architecture.md does not match the code (fix the name, or map the new module, key "
        "or file there):\n" + "\n".join(found)
    )


def test_the_page_is_read_whole() -> None:
    """The check sees the page's modules, keys and run files (a parser that found nothing
    would pass any page)."""
    found = parse(PAGE.read_text(encoding="utf-8"))
    named = {(where or "") + name for name, where in found.paths}
    for name in ("reval/retry.py", "reval/threads.py", "rollout/streaming.py", "services/api/"):
        assert name in named, name
    assert len(found.table_keys) >= 15
    assert {"config.json", "learner.jsonl"} <= set(found.run_paths)
    assert "rollout.max_inflight" in found.dotted


MADE_UP = """\
# A page

| module | what it holds |
|---|---|
| **rollout/** | |
| `worker.py` | real |
| `nowhere.py` | made up |
| **services/** | |
| `api/` | real |

`rollout/streaming.py`, `rollout/verify.py`, `reval.retry`, `reval.nowhere`,
`reval.retry.no_such`, `rollout.max_inflight`, `rollout.no_such_field`,
`rollout.grading.graders:no_such`, `scripts/`, `deploy/no/`.

| key (`reval/redis.py`) | type |
|---|---|
| `P{R}:control` (`control_key`) | hash |
| `P{R}:nowhere` (`nowhere_key`) | hash |

| path | written by |
|---|---|
| `config.json` | real |
| `nowhere.json` | made up |
"""


def test_the_check_names_what_does_not_exist() -> None:
    named = {line.split("`")[1] for line in problems(MADE_UP)}
    made_up = {"nowhere.py", "rollout/verify.py", "reval.nowhere", "reval.retry.no_such",
               "rollout.no_such_field", "rollout.grading.graders:no_such", "deploy/no/",
               "P{R}:nowhere", "nowhere.json"}  # fmt: skip
    assert made_up <= named
    assert "P{R}:status" in named  # (built in reval/redis.py, left out of the made-up table)
    assert "rollout/dealer.py" in named  # (a module the made-up page leaves out)
    assert "services/api/app.py" not in named  # (its folder is named)
    real = {"worker.py", "api/", "rollout/streaming.py", "reval.retry", "rollout.max_inflight",
            "scripts/", "P{R}:control", "config.json"}  # fmt: skip
    assert not real & named
