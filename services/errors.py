"""How a ``reval`` command reports an error it expected (a bad config, path, model, dataset or
request): one line on stderr, ``reval COMMAND: message``, and exit status 2, never a traceback."""

from __future__ import annotations

import sys


def one_line(err: BaseException | str) -> str:
    """An error's message on one line: a head ending in a colon and indented lines under it
    (``invalid config:``, ``a: x``, ``b: y``) become ``invalid config: a: x; b: y``."""
    parts = [line.strip() for line in str(err).splitlines() if line.strip()]
    if not parts:
        return type(err).__name__ if isinstance(err, BaseException) else ""
    head, rest = parts[0], parts[1:]
    if rest and head.endswith(":"):
        return f"{head} {'; '.join(rest)}"
    return "; ".join(parts)


def fail(command: str, err: BaseException | str) -> int:
    """``reval COMMAND: message`` on one line of stderr; exit status 2."""
    print(f"reval {command}: {one_line(err)}", file=sys.stderr)
    return 2
