"""Docs that run (issue 38): every command in the ```bash blocks of README.md and
docs/operations.md is one the project has. Each ``reval ...`` parses with reval's own parser
(``services/cli.py``; nothing runs), each ``make TARGET`` is a target of the Makefile, each script
named by path exists, and each ``docker compose`` / ``docker-compose`` line names a compose file
that exists (or that a ``reval compose --out FILE`` of the same block writes) and says which
Compose it needs (Compose v2 is ``docker compose``, v1, Debian's ``docker-compose`` that the
project's scripts install, is ``docker-compose``): ``docker compose -f docker-compose.cpu.yml
up -d`` failed on a machine with only v1, and nothing said so."""

from __future__ import annotations

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
