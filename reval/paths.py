"""Local paths versus hub names, and the existing path nearest a mistyped one (no torch).

``model.name_or_path``, ``task.dataset`` and ``reval eval --checkpoint`` take either a local path
or a hub name. A name that can only be a local path is checked here, before ``from_pretrained``
or ``datasets`` sees it: a missing one is a one-line error at once, not a minute of hub retries.
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path, PureWindowsPath


def looks_local(name: str) -> bool:
    """Whether ``name`` can only mean a local path: it exists; it is absolute or starts with
    ``.`` or ``~``; it has a backslash, a drive, two or more ``/`` or a trailing one; or its
    first component is a directory here (``runs/x`` when ``runs/`` exists). Anything else is a
    hub name (``NAME`` or ``ORG/NAME``)."""
    if os.path.lexists(os.path.expanduser(name)):
        return True
    if name.startswith(("/", ".", "~")) or "\\" in name or PureWindowsPath(name).drive:
        return True
    if name.count("/") > 1 or name.endswith("/"):
        return True
    first, sep, _ = name.partition("/")
    return bool(sep) and os.path.isdir(first)


def nearest_existing(path: str | Path) -> Path | None:
    """The existing path nearest ``path``: each missing component replaced by its closest
    sibling (difflib), ``runs/wordmath-dat/train.jsonl`` -> ``runs/wordmath-data/train.jsonl``;
    None when ``path`` exists or some component has no close sibling."""
    path = Path(path).expanduser()
    here = Path(path.anchor) if path.is_absolute() else Path()
    changed = False
    for part in path.parts[1:] if path.is_absolute() else path.parts:
        if part not in (".", "..") and not (here / part).exists():
            try:
                names = [child.name for child in here.iterdir()]
            except OSError:
                return None
            near = difflib.get_close_matches(part, names, n=1, cutoff=0.6)
            if not near:
                return None
            part, changed = near[0], True
        here = here / part
    return here if changed and here.exists() else None


def missing_hint(path: str | Path) -> str:
    """`` (did you mean 'X'?)`` for the nearest existing path, or nothing."""
    near = nearest_existing(path)
    return f" (did you mean {str(near)!r}?)" if near is not None else ""
