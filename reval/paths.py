"""Local paths versus hub names, checked before any heavy import (no torch).

``model.name_or_path``, ``task.dataset``, ``eval.dataset`` and ``reval eval --checkpoint`` take a
local path or a hub name. A name that can only be a local path (``looks_local``) is checked here:
a missing one is one line at once (``ModelNotFound``, ``DatasetNotFound``) naming the field, the
path, the nearest existing one and what to do, never a minute of hub retries and a traceback.

``task.reward`` names a function by import path (``package.module:function``) or by file
(``path/to/file.py:function``), loaded by ``reval.plugins.load_object`` (``load_reward``: the config
check here and the grading processes, ``rollout/grading/custom.py``); ``check_reward`` refuses, in
one line naming the field, a path that does not import, a missing or uncallable name, or a function
that cannot be called with the task's arguments.
"""

from __future__ import annotations

import contextlib
import difflib
import inspect
import os
import shutil
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path, PureWindowsPath
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from reval.config import RunConfig

DATA_SUFFIXES = (".jsonl", ".json", ".parquet")
"""The local dataset files read without the ``datasets`` package."""
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
"""A checkpoint directory's tokenizer: at least one of these (``save_pretrained`` writes them)."""


class ModelNotFound(FileNotFoundError, ValueError):
    """A model path that cannot be loaded, in one line naming the field (``field``), the path
    (``path``) and what to do. A FileNotFoundError, and a ValueError as the invalid config value
    it is (callers that catch either report it)."""

    def __init__(self, message: str, path: str = "", field: str = "") -> None:
        super().__init__(message)
        self.path, self.field = path, field


class DatasetNotFound(FileNotFoundError, ValueError):
    """A local dataset file that does not exist, in one line naming the field and the path (a
    FileNotFoundError, and a ValueError as the invalid config value it is)."""


def looks_local(name: str, local_roots: Sequence[str] = ()) -> bool:
    """Whether ``name`` can only mean a local path: it exists; it is absolute or starts with
    ``.`` or ``~``; it has a backslash, a drive, two or more ``/`` or a trailing one; or its
    first component is a directory here (``runs/x`` when ``runs/`` exists) or one of
    ``local_roots`` (the run's ``output_dir``: ``runs/x`` on a fresh clone too). Anything else
    is a hub name (``NAME`` or ``ORG/NAME``)."""
    if os.path.lexists(os.path.expanduser(name)):
        return True
    if name.startswith(("/", ".", "~")) or "\\" in name or PureWindowsPath(name).drive:
        return True
    if name.count("/") > 1 or name.endswith("/"):
        return True
    first, sep, _ = name.partition("/")
    roots = {os.path.normpath(r) for r in local_roots}
    return bool(sep) and (os.path.isdir(first) or first in roots)


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


def _hint(path: Path, fits: Callable[[Path], bool]) -> str:
    near = nearest_existing(path)
    return f" (did you mean {str(near)!r}?)" if near is not None and fits(near) else ""


def _is_checkpoint(path: Path) -> bool:
    return (path / "config.json").is_file()


def check_model(
    name_or_path: str, field: str = "model.name_or_path", local_roots: Sequence[str] = ()
) -> str:
    """What to hand ``from_pretrained``: a local checkpoint directory (``config.json`` and a
    tokenizer) or a hub id. A local-looking path that is no checkpoint is a ``ModelNotFound``
    (``local_roots``: see ``looks_local``)."""
    if not looks_local(name_or_path, local_roots):
        return name_or_path
    path = Path(name_or_path).expanduser()
    if _is_checkpoint(path) and any((path / f).is_file() for f in TOKENIZER_FILES):
        return str(path)
    if _is_checkpoint(path):
        why = f"has no tokenizer (none of {', '.join(TOKENIZER_FILES)})"
    elif path.is_dir():
        why = "is not a checkpoint (no config.json)"
    elif path.exists():
        why = "is not a directory"
    else:
        why = f"does not exist{_hint(path, _is_checkpoint)}"
    raise ModelNotFound(
        f"{field}: the local checkpoint directory {name_or_path!r} {why}; make it first "
        f"(`reval make-model {name_or_path} --data TRAIN.jsonl`, docs/demo.md, or a run's "
        "final/ export) or name a hub id ORG/NAME",
        name_or_path,
        field,
    )


def _is_data_file(path: Path) -> bool:
    return path.is_file() and path.suffix in DATA_SUFFIXES


def check_dataset(source: str, field: str = "task.dataset") -> Path | None:
    """The local ``.jsonl``/``.json``/``.parquet`` file ``source`` names, or None for what the
    ``datasets`` package reads (a hub name, a local dataset directory). A local-looking source
    (``looks_local``, or one with such a suffix) that does not exist is a ``DatasetNotFound``;
    a file of another kind a ValueError."""
    path = Path(source).expanduser()
    if _is_data_file(path):
        return path
    if path.is_file():
        raise ValueError(f"{field}: {source!r} is not a .jsonl, .json or .parquet file")
    if path.is_dir() or not (looks_local(source) or path.suffix in DATA_SUFFIXES):
        return None
    raise DatasetNotFound(
        f"{field}: the file {source!r} does not exist{_hint(path, _is_data_file)}; a local "
        ".jsonl/.json/.parquet file was expected (`reval make-data DIR` writes one)"
    )


class RewardNotFound(ValueError):
    """A ``task.reward`` that cannot be loaded or called, in one line naming the field."""


def reward_file(spec: str) -> str | None:
    """The file of a ``path/to/file.py:function`` spec (a reward's, an environment's); None for
    ``module:function`` and for what is no import path (a built-in environment's name)."""
    from reval.plugins import split_spec

    try:
        module = split_spec(spec)[0]
    except ValueError:
        return None
    return module if module.endswith(".py") else None


def load_reward(spec: str, field: str = "task.reward") -> Callable[..., Any]:
    """The callable a reward spec names, by ``reval.plugins.load_callable`` (the one loader of
    user code; a file is imported once per process), a missing file with the nearest existing
    one. Raises ``RewardNotFound``."""
    from reval.plugins import load_callable

    path = reward_file(spec)
    if path is not None and not Path(path).expanduser().is_file():
        raise RewardNotFound(
            f"{field}: the file {path!r} does not exist{_hint(Path(path), Path.is_file)}"
        )
    try:
        target: Callable[..., Any] = load_callable(spec, field)
    except ValueError as err:
        raise RewardNotFound(str(err)) from None
    return target


def check_reward(spec: str, args: Mapping[str, Any], field: str = "task.reward") -> None:
    """``spec`` loads (``load_reward``) and its function takes the task's call: ``(prompt,
    completion, metadata, **args)``, or lists of each when it is batched (``batched = True``).
    Raises ``RewardNotFound``."""
    fn = load_reward(spec, field)
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # (a builtin without a signature: called as it is)
        return
    batched = getattr(fn, "batched", False) is True
    try:
        sig.bind(*(([], [], []) if batched else ("", "", {})), **args)
    except TypeError as err:
        raise RewardNotFound(f"{field}: {spec} cannot be called as f(prompt, completion, "
                             f"metadata, **task.reward_args): {err}") from None  # fmt: skip


def check_environment(cfg: RunConfig) -> None:
    """``task.environment``, when an import path, imports and names a callable (a ValueError
    naming the field otherwise); a built-in name needs nothing."""
    from reval.config import BUILTIN_ENVIRONMENTS
    from reval.plugins import load_callable

    spec = cfg.task.environment
    if spec is not None and spec not in BUILTIN_ENVIRONMENTS:
        load_callable(spec, "task.environment")


ISOLATED_CHECK_S = 30.0
"""How long the REST API's throw-away import check may take (``check_isolated``)."""


def check_isolated(
    spec: str,
    field: str,
    reward_args: Mapping[str, Any] | None = None,
    own_names_only: bool = False,
    timeout_s: float = ISOLATED_CHECK_S,
) -> None:
    """``check_reward`` (with ``reward_args``) or, without them, ``load_callable`` of ``spec``,
    run in a throw-away Python process: an environment of ``PATH``, ``PYTHONPATH`` (the project)
    and a locale only (no secret), no input or output, ``timeout_s`` at most, killed with its
    process group after. ``own_names_only`` (a ``module:*`` listing): the name must be in the
    module's ``__all__``, or without one defined by the module, not imported into it. Raises
    ``PluginRefused`` with one generic line that never repeats what the import raised or
    printed (no probe of what is installed)."""
    import json
    import signal
    import subprocess
    import sys

    from reval.plugins import PluginRefused, split_spec

    module, name = split_spec(spec)
    root = str(Path(__file__).resolve().parent.parent)
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": root,
           "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1"}  # fmt: skip
    read_fd, write_fd = os.pipe()
    request = {"spec": spec, "field": field, "args": reward_args, "own": own_names_only,
               "fd": write_fd}  # fmt: skip
    try:
        proc = subprocess.Popen(
            [sys.executable, "-c", "from reval.paths import _isolated_check; _isolated_check()"],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            env=env, pass_fds=(write_fd,), start_new_session=True,
        )  # fmt: skip
    finally:
        os.close(write_fd)
    raw = b""
    try:
        assert proc.stdin is not None
        with contextlib.suppress(OSError):  # (a child that died at once: "crashed" below)
            proc.stdin.write(json.dumps(request).encode())
            proc.stdin.close()
        proc.wait(timeout_s)
        os.set_blocking(read_fd, False)  # (a descendant may hold the pipe open: never wait)
        with contextlib.suppress(OSError):
            raw = os.read(read_fd, 4096)
    except subprocess.TimeoutExpired:
        raise PluginRefused(
            f"{field}: {spec!r} could not be checked within {timeout_s:g} s"
        ) from None
    finally:
        os.close(read_fd)
        with contextlib.suppress(OSError):
            os.killpg(proc.pid, signal.SIGKILL)  # (whatever it started goes with it)
        proc.wait()
    try:
        why, detail = json.loads(raw)
    except ValueError:
        why, detail = "crashed", ""
    messages = {
        "ok": None,
        "import": f"{field}: {module!r} cannot be imported here",
        "missing": f"{field}: {module!r} has no {name!r}",
        "foreign": f"{field}: {name!r} is not defined by {module!r} itself",
        "uncallable": f"{field}: {spec!r} is not callable",
        "signature": f"{field}: {spec} cannot be called as f(prompt, completion, metadata, "
        f"**task.reward_args): {detail}",
        "crashed": f"{field}: {spec!r} could not be checked (the check exited)",
    }
    message = messages.get(why, messages["crashed"])
    if message is not None:
        raise PluginRefused(message)


def _isolated_check() -> None:
    """The child of ``check_isolated``: its request on stdin, one ``[why, detail]`` JSON to
    the descriptor it names (where the imported code does not write by accident), where
    ``detail`` is ours, never the imported code's text."""
    import importlib
    import json
    import sys

    from reval.plugins import split_spec

    request = json.loads(sys.stdin.read())
    spec, field, args = request["spec"], request["field"], request["args"]
    fd = int(request["fd"])
    os.set_inheritable(fd, False)
    module_name, name = split_spec(spec)
    why, detail = "ok", ""
    try:
        if module_name.endswith(".py"):
            from reval.plugins import _import_file

            module = _import_file(Path(module_name).expanduser())
        else:
            module = importlib.import_module(module_name)
    except BaseException:  # (anything: its text stays here)
        why = "import"
    else:
        target = getattr(module, name, None) if hasattr(module, name) else None
        if not hasattr(module, name):
            why = "missing"
        elif request["own"] and not _exported(module, name, target):
            why = "foreign"
        elif not callable(target):
            why = "uncallable"
        elif args is not None:
            try:
                check_reward(spec, args, field)
            except RewardNotFound as err:
                why, detail = "signature", str(err).rpartition("): ")[2][:200]
    os.write(fd, json.dumps([why, detail]).encode())
    os._exit(0)  # (no atexit of the imported code runs)


def _exported(module: Any, name: str, target: Any) -> bool:
    """Whether ``module`` offers ``name`` as its own: in its ``__all__`` when it has one, else
    defined by it (not imported into it)."""
    exported = getattr(module, "__all__", None)
    if isinstance(exported, list | tuple):
        return name in exported
    return bool(getattr(target, "__module__", None) == module.__name__)


def check_run_paths(
    cfg: RunConfig, model_field: str = "model.name_or_path", held_out: bool = False
) -> None:
    """Every local path a run reads, checked before torch is imported: ``model.name_or_path``
    (named ``model_field``: ``--checkpoint`` for ``reval eval``), ``task.dataset`` of a math or
    custom task and, with ``held_out`` (``reval train``, which evaluates on it), its
    ``eval.dataset``; a custom task's ``task.reward`` (``check_reward``); ``task.environment``
    (``check_environment``). Raises
    ``ModelNotFound``, ``DatasetNotFound``, ``RewardNotFound`` or a ValueError, each one line
    naming the field."""
    if cfg.model.name_or_path is not None:
        check_model(cfg.model.name_or_path, model_field, local_roots=(cfg.output_dir,))
    if cfg.task.reward is not None:
        check_reward(cfg.task.reward, cfg.task.reward_args)
    check_environment(cfg)
    if cfg.task.kind in ("math", "custom"):
        sources = [("task.dataset", cfg.task.dataset)]
        if held_out:
            sources.append(("eval.dataset", cfg.eval.dataset))
        for field, source in sources:
            if source is not None:
                check_dataset(source, field)


def human_bytes(n: float) -> str:
    """A size in the largest binary unit that keeps it at 1 or more: ``512 B``, ``12.3 KiB``,
    ``4.0 MiB``, ``1.25 GiB`` (a small disk's free space is not ``0.00 GiB``)."""
    if n < 1024:
        return f"{int(n)} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024
        if n < 1024 or unit == "TiB":
            return f"{n:.2f} {unit}" if n < 10 else f"{n:.1f} {unit}"
    raise AssertionError("unreachable")


def free_space(path: str | Path) -> str:
    """Free space on the file system that holds ``path`` (its nearest existing ancestor), for
    the one-line message of a write that failed (``12.3 MiB free on DIR``)."""
    path = Path(path)
    for p in (path, *path.parents):
        try:
            free = shutil.disk_usage(p).free
        except OSError:
            continue
        return f"{human_bytes(free)} free on {p}"
    return "free space unknown"


def last_line(err: BaseException) -> str:
    """The last line of an error, at most 300 characters (libraries wrap tracebacks in their
    messages)."""
    lines = [ln.strip() for ln in str(err).strip().splitlines() if ln.strip()]
    return lines[-1][:300] if lines else type(err).__name__
