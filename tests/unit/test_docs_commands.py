"""Docs that run (issue 38): every command in the ```bash blocks of README.md and
docs/operations.md is one the project has. Each ``reval ...`` parses with reval's own parser
(``services/cli.py``; nothing runs), each ``make TARGET`` is a target of the Makefile, each script
named by path exists, and each ``docker compose`` / ``docker-compose`` line names a compose file
that exists (or that a ``reval compose --out FILE`` of the same block writes) and says which
Compose it needs (Compose v2 is ``docker compose``, v1, Debian's ``docker-compose`` that the
project's scripts install, is ``docker-compose``): ``docker compose -f docker-compose.cpu.yml
up -d`` failed on a machine with only v1, and nothing said so.

The commands in the prose too: each inline `` `reval ...` ``, `` `make ...` ``, `` `docker
compose ...` `` or `` `docker-compose ...` `` of README.md and docs/*.md (a span may wrap onto
the next line). Such a span often names a command rather than spelling all of it (`` `reval
runs` ``, `` `reval learner --config X [--nproc N]` ``), so a ``reval`` one is checked for its
subcommands and flags (each a name reval's parser has; ``a/b`` alternatives each), not parsed
whole; one that quotes an output line (`` `reval train: stopped by ...` ``) is not a command. A
compose span says which Compose in its paragraph (a heading's: its section): ``v2`` or ``v1``."""

from __future__ import annotations

import argparse
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

from services.cli_args import build_parser

ROOT = Path(__file__).resolve().parents[2]
DOCS = ("README.md", "docs/operations.md")
SEPARATORS = {";", "&&", "||", "|", "&", "(", ")"}
COMPOSE = {"docker compose": "Compose v2", "docker-compose": "Compose v1"}


@dataclass
class Command:
    doc: str
    block: int
    words: list[str]
    comment: str
    """The line's own comment."""
    block_comments: str
    """Every comment of its block."""

    def __str__(self) -> str:
        return f"{self.doc} (block {self.block}): {shlex.join(self.words)}"


def split_line(line: str) -> tuple[list[list[str]], str]:
    """The commands of a shell line (split at ``;``, ``&&``, ``|``, ``&``; leading ``VAR=value``
    assignments and ``sudo`` dropped) and its comment."""
    code, _, comment = _cut_comment(line)
    lexer = shlex.shlex(code, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    commands: list[list[str]] = [[]]
    for word in lexer:
        if word in SEPARATORS:
            commands.append([])
        else:
            commands[-1].append(word)
    out = []
    for words in commands:
        while words and (re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0]) or words[0] == "sudo"):
            words = words[1:]
        if words:
            out.append(words)
    return out, comment


def _cut_comment(line: str) -> tuple[str, str, str]:
    """``code # comment``: a ``#`` at the start or after a blank, outside quotes."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i], "#", line[i + 1 :]
    return line, "", ""


def commands(doc: str) -> list[Command]:
    text = (ROOT / doc).read_text()
    out = []
    for n, block in enumerate(re.findall(r"```bash\n(.*?)```", text, flags=re.S)):
        lines = block.replace("\\\n", " ").splitlines()
        parsed = [split_line(line) for line in lines]
        comments = " ".join(c for _, c in parsed)
        for cmds, comment in parsed:
            out.extend(Command(doc, n, words, comment, comments) for words in cmds)
    return out


INLINE_START = re.compile(r"^(reval |make |docker compose\b|docker-compose )")
OUTPUT_LINE = re.compile(r"^reval [\w-]+:")
"""``reval train: stopped by ...``: a line reval prints, quoted."""


@dataclass
class Inline:
    doc: str
    line: int
    code: str
    context: str
    """Its paragraph (a heading's: the heading's section)."""

    def __str__(self) -> str:
        return f"{self.doc}:{self.line}: `{self.code}`"


def inline_docs() -> list[str]:
    return ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]


def _context(text: str, prose: str, at: int) -> str:
    """The paragraph of ``text`` around offset ``at``; for a heading, its whole section, to the
    next heading of ``prose`` (``text`` with its fenced blocks blanked: no ``#`` comments)."""
    start = max(text.rfind("\n\n", 0, at), 0)
    end = text.find("\n\n", at)
    para = text[start : len(text) if end < 0 else end]
    if not para.strip().startswith("#"):
        return para
    body = text.find("\n", at) + 1
    following = re.search(r"^#{1,6} ", prose[body:], flags=re.M)
    return text[start:] if following is None else text[start : body + following.start()]


def inline_commands(doc: str) -> list[Inline]:
    """The inline code spans of ``doc`` that are commands (``INLINE_START``), fenced blocks
    left out (``commands`` reads those)."""
    text = (ROOT / doc).read_text()
    prose = re.sub(r"```.*?```", lambda m: re.sub(r"[^\n]", " ", m.group(0)), text, flags=re.S)
    out = []
    for m in re.finditer(r"`([^`]+)`", prose):
        code = " ".join(m.group(1).split())
        if "\n\n" in m.group(1) or not INLINE_START.match(code) or OUTPUT_LINE.match(code):
            continue
        line = text.count("\n", 0, m.start()) + 1
        out.append(Inline(doc, line, code, _context(text, prose, m.start())))
    return out


def all_inline() -> list[Inline]:
    return [c for doc in inline_docs() for c in inline_commands(doc)]


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def reval_mention_problem(words: list[str]) -> str | None:
    """What is wrong with ``reval WORDS...`` named in prose (None: nothing): a subcommand reval
    does not have, or a flag its (sub)command does not take. Placeholders (``N``, ``R``), ``...``
    and ``[optional]`` brackets are fine."""
    parser = build_parser()
    rest = [w.strip("[]") for w in words[1:]]
    while rest and rest[0] != "..." and not rest[0].startswith("-") and _subcommands(parser):
        names = [n for n in rest.pop(0).split("/") if n]
        choices = _subcommands(parser)
        unknown = [n for n in names if n not in choices]
        if unknown or not names:
            return f"no subcommand {unknown} (has {sorted(choices)})"
        parser = choices[names[0]]
    for word in rest:
        if word.startswith("--") or re.match(r"^-[A-Za-z]$", word):
            for flag in (f.partition("=")[0] for f in word.split("/") if f):
                if flag not in parser._option_string_actions:
                    return f"{parser.prog} has no flag {flag}"
    return None


def all_commands() -> list[Command]:
    return [c for doc in DOCS for c in commands(doc)]


def makefile_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return {m for line in text.splitlines()
            for m in re.findall(r"^([A-Za-z0-9_.-]+)\s*:(?!=)", line)}  # fmt: skip


def compose_file(words: list[str]) -> str:
    """The file a compose command names (``-f FILE``; docker-compose.yml without)."""
    for i, w in enumerate(words):
        if w in ("-f", "--file") and i + 1 < len(words):
            return words[i + 1]
        if w.startswith("--file="):
            return w.split("=", 1)[1]
    return "docker-compose.yml"


def test_the_docs_have_commands_of_each_kind():
    found = all_commands()
    kinds = {c.words[0] for c in found}
    assert {"reval", "make", "docker", "docker-compose"} <= kinds, kinds


@pytest.mark.parametrize("doc", DOCS)
def test_every_reval_command_parses_with_reval_s_parser(doc):
    for c in commands(doc):
        if c.words[0] != "reval":
            continue
        words = [w for w in c.words[1:] if w != "..."]  # (an elision: "the rest as before")
        try:
            build_parser().parse_args(words)
        except SystemExit:
            pytest.fail(f"{c}: reval's parser refuses it")


def test_every_make_target_exists():
    targets = makefile_targets()
    assert {"demo", "test"} <= targets
    for c in all_commands():
        if c.words[0] == "make":
            for target in (w for w in c.words[1:] if "=" not in w and not w.startswith("-")):
                assert target in targets, f"{c}: no target {target!r} in the Makefile"


def test_every_script_named_by_path_exists():
    for c in all_commands():
        head = c.words[0]
        if "/" in head and not head.startswith(("/", "http")):
            assert (ROOT / head).exists(), f"{c}: {head} does not exist"


def test_every_compose_command_names_a_file_and_says_which_compose():
    for doc in DOCS:
        found = commands(doc)
        for c in found:
            v2 = c.words[:2] == ["docker", "compose"]
            if not (v2 or c.words[0] == "docker-compose"):
                continue
            name = compose_file(c.words)
            written = any(
                x.block == c.block and x.words[:2] == ["reval", "compose"] and name in x.words
                for x in found
            )
            assert (ROOT / name).exists() or written, f"{c}: {name} does not exist"
            needs = COMPOSE["docker compose" if v2 else "docker-compose"]
            assert needs in c.comment or needs in c.block_comments, (
                f"{c}: say which Compose it needs ({needs}), on the line or in its block"
            )


def test_each_compose_file_the_docs_name_passes_compose_v1_s_check():
    """The files the docs start work with Compose v1 as well as v2 (``docker-compose config``
    resolves them; the Docker lane runs ``docker-compose up`` on the CPU file)."""
    import shutil
    import subprocess

    tool = shutil.which("docker-compose")
    if tool is None:
        pytest.fail("docker-compose is not installed (`make test` runs scripts/ensure_tools.sh)")
    names = {compose_file(c.words) for c in all_commands()
             if c.words[:2] == ["docker", "compose"] or c.words[0] == "docker-compose"}  # fmt: skip
    env = {"PATH": "/usr/bin:/bin", "REVAL_API_TOKEN": "x" * 24, "REDIS_PASSWORD": "y" * 24,
           "GRAFANA_ADMIN_PASSWORD": "z" * 12}  # fmt: skip
    checked = 0
    for name in sorted(names):
        if (ROOT / name).exists():
            done = subprocess.run([tool, "-f", name, "config", "-q"], cwd=ROOT, env=env,
                                  capture_output=True, text=True, timeout=60)  # fmt: skip
            assert done.returncode == 0, (name, done.stderr)
            checked += 1
    assert checked >= 1


def test_the_prose_has_inline_commands_of_each_kind():
    found = all_inline()
    heads = {" ".join(c.code.split()[:2]) if c.code.startswith("docker ") else c.code.split()[0]
             for c in found}  # fmt: skip
    assert {"reval", "make", "docker compose", "docker-compose"} <= heads, heads
    assert any(c.doc == "README.md" for c in found) and len(found) > 100


def test_the_inline_check_finds_what_is_wrong():
    assert reval_mention_problem(["reval", "runs", "get/set/", "R"]) is None
    assert reval_mention_problem(["reval", "serve", "--ray", "[--replicas", "N]"]) is None
    assert reval_mention_problem(["reval", "launch", "--add/--remove"]) is None
    assert "no subcommand" in str(reval_mention_problem(["reval", "trian"]))
    assert "no subcommand" in str(reval_mention_problem(["reval", "runs", "get/sett"]))
    assert "no flag --metrics-prot" in str(
        reval_mention_problem(["reval", "rollout", "--metrics-prot", "9400"])
    )
    assert "no flag --follow" in str(reval_mention_problem(["reval", "train", "--follow"]))
    found = [c.code for c in all_inline()]
    assert not any(OUTPUT_LINE.match(c) for c in found)  # (quoted output lines are left out)


@pytest.mark.parametrize("doc", inline_docs())
def test_every_inline_reval_command_names_real_subcommands_and_flags(doc):
    wrong = []
    for c in inline_commands(doc):
        for words, _ in [(w, None) for w in split_line(c.code)[0]]:
            if words[0] == "reval":
                problem = reval_mention_problem(words)
                if problem is not None:
                    wrong.append(f"{c}: {problem}")
    assert not wrong, "\n".join(wrong)


def test_every_inline_make_target_exists():
    targets = makefile_targets()
    wrong = []
    for c in all_inline():
        for words in split_line(c.code)[0]:
            if words[0] == "make":
                bad = [w for w in words[1:] if "=" not in w and not w.startswith("-")
                       and w not in targets]  # fmt: skip
                wrong += [f"{c}: no target {t!r} in the Makefile" for t in bad]
    assert not wrong, "\n".join(wrong)


def test_every_inline_compose_command_names_a_file_and_says_which_compose():
    wrong = []
    for doc in inline_docs():
        written = {w for x in commands(doc) if x.words[:2] == ["reval", "compose"]
                   for w in x.words}  # fmt: skip
        for c in inline_commands(doc):
            for words in split_line(c.code)[0]:
                v2 = words[:2] == ["docker", "compose"]
                if not (v2 or words[0] == "docker-compose"):
                    continue
                name = compose_file(words)
                placeholder = re.match(r"^[A-Z][A-Z0-9_]*$", name)  # (-f FILE)
                if not (ROOT / name).exists() and name not in written and not placeholder:
                    wrong.append(f"{c}: {name} does not exist")
                if not re.search(r"\bv2\b" if v2 else r"\bv1\b", c.context):
                    needs = COMPOSE["docker compose" if v2 else "docker-compose"]
                    wrong.append(f"{c}: say which Compose it needs ({needs}) in its paragraph")
    assert not wrong, "\n".join(wrong)
