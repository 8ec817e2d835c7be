"""User code named in the config by import path: ``package.module:name`` (an importable module)
or ``path/to/file.py:name`` (a file anywhere, imported under a name of its own). Torch-free, so
the config can check at load time that what a field names imports, before any work starts."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
import warnings
from pathlib import Path
from typing import Any


def split_spec(spec: str, noun: str = "name", wildcard: bool = False) -> tuple[str, str]:
    """(module or file, attribute path) of ``spec``, the one parser of the form (a config's
    ``task.reward`` and ``task.environment``, the API's allowlist); ValueError when it is not
    of either form, in words naming what the field holds (``noun``: ``'package.module:noun'``).
    ``wildcard``: ``module:*`` is a form too (an allowlist's entry). A module that moved
    (``MOVED_MODULES``) comes back as its new path, with a FutureWarning."""
    module, colon, name = spec.strip().rpartition(":")
    named = bool(name) and all(p.isidentifier() for p in name.split("."))
    if not colon or not module or not (named or (wildcard and name == "*")):
        raise ValueError(f"{spec!r} is not 'package.module:{noun}' or 'path/to/file.py:{noun}'")
    return _moved(module, name), name


MOVED_MODULES = {"rollout.graders": "rollout.grading.graders"}
"""Modules a spec may still name by an old path: old -> where the module is now (the built-in
graders moved into ``rollout/grading/`` in issue 40; old configs and requests keep working)."""


def _moved(module: str, name: str) -> str:
    """``module``, or where it moved (``MOVED_MODULES``) with a FutureWarning in one line."""
    new = MOVED_MODULES.get(module)
    if new is None:
        return module
    warnings.warn(
        f"{module}:{name} is deprecated: the module is now {new} (write {new}:{name})",
        FutureWarning,
        stacklevel=3,
    )
    return new


def canonical_spec(spec: str, noun: str = "name") -> str:
    """``spec`` as ``module:name`` spelled the current way (a moved module's new path, with
    ``split_spec``'s warning; ``noun`` as there): what to compare a spec with."""
    module, name = split_spec(spec, noun)
    return f"{module}:{name}"


def load_object(spec: str) -> Any:
    """The object ``spec`` names, its module imported (a file once per path: a second load
    returns the same module). ValueError, in one line, when the module or the file cannot be
    imported (whatever it raised) or has no such name."""
    module_name, name = split_spec(spec)
    try:
        if module_name.endswith(".py"):
            module = _import_file(Path(module_name).expanduser())
        else:
            module = importlib.import_module(module_name)
    except ValueError:
        raise
    except Exception as err:  # a user's module may raise anything while it imports
        raise ValueError(
            f"cannot import {module_name!r}: {type(err).__name__}: {err}".splitlines()[0]
        ) from None
    obj: Any = module
    for part in name.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{module_name!r} has no {name!r}")
        obj = getattr(obj, part)
    return obj


def _import_file(path: Path) -> Any:
    path = path.resolve()
    if not path.is_file():
        raise ValueError(f"no file {str(path)!r}")
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:12]
    name = f"reval_user_{path.stem}_{digest}"
    if name in sys.modules:
        return sys.modules[name]
    found = importlib.util.spec_from_file_location(name, path)
    if found is None or found.loader is None:
        raise ValueError(f"cannot import {str(path)!r} as a Python file")
    module = importlib.util.module_from_spec(found)
    sys.modules[name] = module  # (dataclasses and pickling look a module up by its name)
    try:
        found.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def load_callable(spec: str, field: str) -> Any:
    """The callable ``spec`` names (``load_object``); ValueError, one line naming ``field``,
    when it cannot be loaded or is not callable."""
    try:
        target = load_object(spec)
    except ValueError as err:
        raise ValueError(f"{field}: {err}") from None
    if not callable(target):
        raise ValueError(f"{field}: {spec!r} is a {type(target).__name__}, not callable")
    return target


BUILTIN_PLUGINS = tuple(
    f"rollout.grading.graders:{name}"
    for name in ("math_boxed", "exact_match", "regex_format", "code_tests", "http_reward")
)
"""What a REST client may always name by module (``task.reward``): the built-in graders (the
table of ``rollout/grading/graders.py``, by name: that module's helpers are not rewards). The API's
``api.plugins`` adds to it; ``reval train`` and the CLI need no list."""


class PluginRefused(ValueError):
    """A spec the REST API will not import, in one line that repeats nothing the import said."""


def listed(spec: str, allowlist: tuple[str, ...] | list[str]) -> str | None:
    """How ``spec`` (``module:name``) is on ``allowlist`` (entries ``module:name`` or
    ``module:*``): ``"name"`` (named), ``"module"`` (by ``*``: a name of the module's
    ``__all__``, or without one a public name the module defines itself, checked when
    imported), or None (not on it; also for a dotted or private name under ``*``). Never
    imports anything."""
    module, name = split_spec(spec)
    found = None
    for entry in allowlist:
        m, n = split_spec(entry, wildcard=True)
        if m != module:
            continue
        if n == name:
            return "name"
        if n == "*" and "." not in name and not name.startswith("_"):
            found = "module"
    return found
