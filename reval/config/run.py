"""The whole run's config: ``RunConfig`` (every section, and the rules across them), read from
a TOML file plus ``REVAL__SECTION__FIELD`` environment variables and ``--set`` overrides, with
the deprecated ``buffer.redis_url``/``buffer.key_prefix`` moved to the ``redis`` section; the
error lines that name each bad field and where its value came from; the redacted dump written
to a run directory."""

from __future__ import annotations

import contextlib
import difflib
import json
import math
import os
import re
import sys
import sysconfig
import tomllib
import warnings
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field, ValidationError, model_validator

from reval.config.base import ConfigError, _Section
from reval.config.launch import LaunchConfig, MetricsConfig, RedisConfig, SyncConfig
from reval.config.task import EvalConfig, ModelConfig, RolloutConfig, TaskConfig
from reval.config.training import AlgoConfig, BufferConfig, LearnerConfig
from reval.run_dir import RunDir

ENV_PREFIX = "REVAL__"


def _data_roots() -> list[Path]:
    """Where an install may have put its data files: the environment's prefix, the scheme's
    ``data`` path, and ``pip install --user``'s base."""
    roots = [Path(sys.prefix), Path(sysconfig.get_path("data"))]
    with contextlib.suppress(KeyError):  # (no user scheme on this platform)
        roots.append(Path(sysconfig.get_path("data", sysconfig.get_preferred_scheme("user"))))
    return list(dict.fromkeys(roots))


def _config_dir(module: Path | None = None, roots: Iterable[Path] | None = None) -> Path:
    """``configs/`` of the checkout reval runs from (``configs/`` beside a ``pyproject.toml``,
    not a stray ``site-packages/configs`` another package left), else the copy an install put
    in ``share/reval/configs`` (pyproject.toml's data-files) under one of ``_data_roots``."""
    root = (module or Path(__file__)).resolve().parents[2]
    if (root / "configs").is_dir() and (root / "pyproject.toml").is_file():
        return root / "configs"
    for data in _data_roots() if roots is None else roots:
        installed = data / "share" / "reval" / "configs"
        if installed.is_dir():
            return installed
    return root / "configs"  # (none: load_config's error then names this path)


CONFIG_DIR = _config_dir()
DEFAULT_CONFIG = CONFIG_DIR / "demo.toml"


DEPRECATED_REDIS = {"redis_url": "url", "key_prefix": "prefix"}
"""``buffer.<old name>`` -> ``redis.<name>``: the names before the ``redis`` section, still
read (with a deprecation message)."""


def move_deprecated(data: Mapping[str, Any]) -> dict[str, Any]:
    """``data`` (a raw config mapping) with ``buffer.redis_url`` and ``buffer.key_prefix`` moved
    to ``redis.url`` and ``redis.prefix``, with a FutureWarning for each one found. ConfigError
    when a field is given under both names with different values."""
    out = dict(data)
    buffer = out.get("buffer")
    if not isinstance(buffer, Mapping) or not any(k in buffer for k in DEPRECATED_REDIS):
        return out
    buffer = out["buffer"] = dict(buffer)
    section = out.get("redis")
    redis = out["redis"] = dict(section) if isinstance(section, Mapping) else {}
    for old, new in DEPRECATED_REDIS.items():
        if old not in buffer:
            continue
        value = buffer.pop(old)
        if new in redis and redis[new] != value:
            raise ConfigError(
                f"buffer.{old} (deprecated) and redis.{new} are both set, to different values: "
                f"keep redis.{new}"
            )
        redis[new] = value
        warnings.warn(
            f"buffer.{old} is deprecated: it is now redis.{new} (--set redis.{new}=..., "
            f"{ENV_PREFIX}REDIS__{new.upper()})",
            FutureWarning,
            stacklevel=2,
        )
    return out


class RunConfig(_Section):
    """A whole run: every part reads its own section."""

    name: str = Field("demo", pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
    """Run name; the run directory is ``output_dir/name`` and it is part of every Redis key of
    the run: letters, digits, ``.``, ``_``, ``-`` (no path separators, no braces)."""
    seed: int = 0
    """Seed of every random choice: the same seed gives the same curve."""
    output_dir: str = "runs"
    """Where run directories go."""
    model: ModelConfig = Field(default_factory=ModelConfig)
    task: TaskConfig = Field(default_factory=TaskConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    buffer: BufferConfig = Field(default_factory=BufferConfig)
    learner: LearnerConfig = Field(default_factory=LearnerConfig)
    algo: AlgoConfig = Field(default_factory=AlgoConfig)
    sync: SyncConfig = Field(default_factory=SyncConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    launch: LaunchConfig = Field(default_factory=LaunchConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    redis: RedisConfig = Field(default_factory=RedisConfig)

    @model_validator(mode="before")
    @classmethod
    def _deprecated_names(cls, data: Any) -> Any:
        return move_deprecated(data) if isinstance(data, Mapping) else data

    @property
    def round_size(self) -> int:
        """Trajectories generated per round."""
        return self.rollout.prompts_per_round * self.rollout.n

    @property
    def batch_size(self) -> int:
        """B: trajectories per update."""
        return self.learner.batch_size or self.round_size

    @property
    def samples_per_insert(self) -> float:
        """K of the replay limiter: ``buffer.samples_per_insert`` when set, else what the update
        schedule implies, ``updates_per_round * batch_size / round_size`` (1 for GRPO, which takes
        every trajectory once). Derived when asked, so a config changed after validation (a
        study's copy with another K) follows."""
        if self.buffer.samples_per_insert is not None:
            return self.buffer.samples_per_insert
        if self.algo.on_policy:
            return 1.0
        return self.learner.updates_per_round * self.batch_size / self.round_size

    @property
    def fresh_updates(self) -> int:
        """Updates of a round that take never-used trajectories (``learner.first_update_fresh``):
        as many as one round fills, at most ``updates_per_round``; every one for GRPO."""
        if self.algo.on_policy:
            return self.learner.updates_per_round
        if not self.learner.first_update_fresh:
            return 0
        return min(self.learner.updates_per_round, self.round_size // self.batch_size)

    def generate_ahead(self, samples_per_insert: float | None = None) -> int | None:
        """Samples the learner may owe before rollout workers wait (``buffer.generate_ahead``):
        when unset, one learner round, ``samples_per_insert * round_size``, or what its first
        batch needs held if that is more (with the K in force, ``samples_per_insert``, when a
        live change gave another); None when ``"off"``."""
        ahead = self.buffer.generate_ahead
        if ahead == "off":
            return None
        if ahead is None:
            k = self.samples_per_insert if samples_per_insert is None else samples_per_insert
            return math.ceil(k * max(self.round_size, self._first_sample_needs))
        return ahead

    @property
    def _first_sample_needs(self) -> int:
        """Trajectories the learner needs held before its first batch."""
        return max(self.batch_size, self.buffer.min_size_to_sample)

    @property
    def run_dir(self) -> Path:
        return Path(self.output_dir) / self.name

    @property
    def paths(self) -> RunDir:
        """The run directory's files (``reval/run_dir.py``)."""
        return RunDir(self.run_dir)

    @model_validator(mode="after")
    def _consistent(self) -> RunConfig:
        if self.batch_size > self.buffer.capacity:
            raise ValueError(
                f"learner.batch_size ({self.batch_size}) exceeds buffer.capacity "
                f"({self.buffer.capacity}): cannot sample without replacement"
            )
        if self.buffer.min_size_to_sample > self.buffer.capacity:
            raise ValueError(
                f"buffer.min_size_to_sample ({self.buffer.min_size_to_sample}) exceeds "
                f"buffer.capacity ({self.buffer.capacity}): sampling would wait forever"
            )
        if self.learner.first_update_fresh and self.batch_size > self.round_size:
            raise ValueError(
                f"learner.batch_size ({self.batch_size}) exceeds one round "
                f"({self.round_size} = rollout.prompts_per_round * rollout.n) while "
                "learner.first_update_fresh is set"
            )
        ahead = self.buffer.generate_ahead
        if isinstance(ahead, int) and ahead < self.samples_per_insert * self._first_sample_needs:
            need = self._first_sample_needs
            raise ValueError(
                f"buffer.generate_ahead ({ahead}) stops the workers before the learner can draw "
                f"its first batch: it needs {need} trajectories held (learner.batch_size, "
                f"buffer.min_size_to_sample), samples_per_insert x {need} = "
                f"{self.samples_per_insert * need:g} samples ahead; raise it, or leave it unset"
            )
        if self.algo.overlong_penalty_tokens >= self.rollout.max_new_tokens:
            raise ValueError(
                f"algo.overlong_penalty_tokens ({self.algo.overlong_penalty_tokens}) must be "
                f"below rollout.max_new_tokens ({self.rollout.max_new_tokens}): DAPO's penalty "
                "starts that many tokens before the limit"
            )
        if self.algo.on_policy and self.buffer.prioritized:
            raise ValueError(
                "buffer.prioritized needs a value loss (algo.name reval, tbrm or regression): "
                "grpo has no Bellman residual to prioritize by"
            )
        if self.algo.on_policy and self.batch_size // self.rollout.n < self.learner.world_size:
            raise ValueError(
                f"algo.name=grpo: a batch of {self.batch_size} holds "
                f"{self.batch_size // self.rollout.n} groups of rollout.n = {self.rollout.n}, "
                f"fewer than learner.world_size ({self.learner.world_size}): each rank needs "
                "whole groups"
            )
        if self.algo.on_policy and (
            self.learner.updates_per_round != 1 or not self.learner.first_update_fresh
        ):
            raise ValueError(
                "algo.name=grpo is on-policy: it needs learner.updates_per_round=1 and "
                "learner.first_update_fresh=true (use --algo grpo, which sets both)"
            )
        return self


# ---------------------------------------------------------------------------------------------
# Loading

Origins = dict[str, str]
"""Where each dotted key's value came from (``learner.lr`` -> ``configs/x.toml``, ``the
environment variable REVAL__LEARNER__LR`` or ``--set``), for the error messages."""


def _parse_value(text: str) -> Any:
    """A CLI/env override value: JSON when it parses (numbers, booleans, null, lists), else str."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _set_path(tree: dict[str, Any], dotted: str, value: Any, origin: str = "--set") -> None:
    keys = [k for k in dotted.split(".") if k]
    if not keys:
        raise ConfigError(f"empty override key {dotted!r} (from {origin})")
    node = tree
    for key in keys[:-1]:
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {dotted!r} (from {origin}): {key!r} is not a section")
        node = child
    node[keys[-1]] = value


def _set_items(items: Iterable[str]) -> list[tuple[str, Any, str]]:
    """``--set`` items as (dotted key, value, origin)."""
    out = []
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"override {item!r} is not of the form section.field=value")
        out.append((key.strip(), _parse_value(value.strip()), "--set"))
    return out


def _env_items(environ: Mapping[str, str] | None) -> list[tuple[str, Any, str]]:
    """``REVAL__SECTION__FIELD=value`` variables as (dotted key, value, origin)."""
    environ = os.environ if environ is None else environ
    return [
        (name[len(ENV_PREFIX) :].lower().replace("__", "."), _parse_value(value),
         f"the environment variable {name}")
        for name, value in environ.items()
        if name.startswith(ENV_PREFIX) and len(name) > len(ENV_PREFIX)
    ]  # fmt: skip


def _tree(items: Iterable[tuple[str, Any, str]]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for dotted, value, origin in items:
        _set_path(tree, dotted, value, origin)
    return tree


def parse_overrides(items: Iterable[str]) -> dict[str, Any]:
    """``["learner.lr=1e-3", ...]`` -> a nested dict of overrides."""
    return _tree(_set_items(items))


def env_overrides(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Overrides from ``REVAL__SECTION__FIELD=value`` environment variables."""
    return _tree(_env_items(environ))


def _merge(base: dict[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def _leaves(tree: Mapping[str, Any], prefix: str = "") -> Iterable[str]:
    """The dotted keys of a nested mapping's values (an empty section is a leaf)."""
    for key, value in tree.items():
        if isinstance(value, Mapping) and value:
            yield from _leaves(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}"


def _section(loc: tuple[str, ...]) -> type[BaseModel] | None:
    """The section model at ``loc`` (``()``: RunConfig), None when ``loc`` is no section."""
    model: type[BaseModel] = RunConfig
    for part in loc:
        field = model.model_fields.get(part)
        kind = field.annotation if field is not None else None
        if not (isinstance(kind, type) and issubclass(kind, BaseModel)):
            return None
        model = kind
    return model


def _all_keys(loc: tuple[str, ...] = ()) -> list[str]:
    """Every dotted key of the tree below section ``loc``, sections included."""
    section = _section(loc)
    if section is None:
        return []
    return [k for f in section.model_fields for k in (".".join((*loc, f)), *_all_keys((*loc, f)))]


def _initials(name: str) -> str | None:
    return "".join(w[0] for w in name.split("_") if w) if "_" in name else None


def did_you_mean(dotted: str) -> list[str]:
    """The valid keys closest to an unknown one: in its section, a field whose initials it is
    (``learning_rate`` -> ``lr``) or a close spelling (difflib); else a field of that name or
    close to it anywhere in the tree (``learner.beta`` -> ``algo.beta``). At most two."""
    *parent, name = dotted.split(".")
    section = _section(tuple(parent))
    fields = list(section.model_fields) if section is not None else []
    near = [f for f in fields if name in (f, _initials(f)) or f == _initials(name)]
    near += difflib.get_close_matches(name, fields, n=2, cutoff=0.6)
    found = [".".join((*parent, f)) for f in dict.fromkeys(near)]
    if not found:
        keys = _all_keys()
        found = [k for k in keys if k.rsplit(".", 1)[-1] == name]
        found = found or difflib.get_close_matches(dotted, keys, n=2, cutoff=0.75)
    return found[:2]


def _origin(dotted: str, origins: Mapping[str, str]) -> str | None:
    """Where ``dotted`` (or the key above it, or the keys below it) came from."""
    parts = dotted.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in origins:
            return origins[".".join(parts[:n])]
    below = dict.fromkeys(o for k, o in origins.items() if k.startswith(dotted + "."))
    return ", ".join(below) or None


def _shown(value: Any) -> str:
    text = redact_url(value) if isinstance(value, str) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _error_line(error: Any, origins: Mapping[str, str]) -> str:
    """One self-contained line for one pydantic error: the key, what is wrong, where it came
    from and, for an unknown key, the closest valid ones."""
    dotted = ".".join(str(p) for p in error["loc"])
    why = str(error["msg"]).removeprefix("Value error, ")
    if not dotted:
        return why  # a rule across sections: the message names the fields
    origin = _origin(dotted, origins)
    if error["type"] == "extra_forbidden":
        line = f"{dotted}: unknown key" + (f" (from {origin})" if origin else "")
        hints = did_you_mean(dotted)
        return line + (f"; did you mean {' or '.join(hints)}?" if hints else "")
    if origin is None:
        return f"{dotted}: {why}"
    if isinstance(error.get("input"), Mapping):
        return f"{dotted}: {why} (from {origin})"
    return f"{dotted}: {why} (got {_shown(error.get('input'))} from {origin})"


def build_config(data: Mapping[str, Any], origins: Mapping[str, str] | None = None) -> RunConfig:
    """Validate a nested mapping into a RunConfig, raising ConfigError naming the fields: one
    line per bad field, with where its value came from when ``origins`` says."""
    try:
        return RunConfig.model_validate(dict(data))
    except ValidationError as err:
        lines = [_error_line(e, origins or {}) for e in err.errors()]
        raise ConfigError("\n".join(dict.fromkeys(lines))) from None


def _read_file(path: Path) -> dict[str, Any]:
    if not path.is_file():
        near = difflib.get_close_matches(path.name, _names(path.parent), n=1, cutoff=0.6)
        hint = f" (did you mean {str(path.parent / near[0])!r}?)" if near else ""
        raise ConfigError(f"config file not found: {path}{hint}")
    if path.suffix == ".json":
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise ConfigError(f"{path}: not valid JSON: {err}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: a config is a JSON object")
        return data
    try:
        return tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{path}: not valid TOML: {err}") from None


def _names(directory: Path) -> list[str]:
    try:
        return [p.name for p in directory.iterdir()]
    except OSError:
        return []


def load_config(
    path: str | Path | None = None,
    overrides: Iterable[str] = (),
    environ: Mapping[str, str] | None = None,
) -> RunConfig:
    """Load TOML ``path`` (default: the demo preset; a ``.json`` file is read as JSON, as the
    REST API writes a run's config), then env overrides, then ``--set`` ones. A bad key or value
    is a ConfigError saying where it came from (the file, the variable, ``--set``)."""
    path = Path(path) if path is not None else DEFAULT_CONFIG
    data = move_deprecated(_read_file(path))
    origins: Origins = dict.fromkeys(_leaves(data), str(path))
    for items in (_env_items(environ), _set_items(overrides)):
        for dotted, value, origin in items:
            leaf = _tree([(_renamed(dotted), value, origin)])
            origins.update(dict.fromkeys(_leaves(leaf), origin))
        # Each source's old names move first, so a later source overrides an earlier one
        # whichever name each used (a config.json's redis.url, the environment's old name).
        data = _merge(data, move_deprecated(_tree(items)))
    return build_config(data, origins)


def _renamed(dotted: str) -> str:
    """A dotted key under its current name (``buffer.redis_url`` -> ``redis.url``)."""
    section, _, name = dotted.partition(".")
    if section == "buffer" and name in DEPRECATED_REDIS:
        return f"redis.{DEPRECATED_REDIS[name]}"
    return dotted


REDACTED = "***"


def redact_url(url: str) -> str:
    """``url`` with its secrets replaced by ``***``: the password of the user part (a Redis
    URL's: ``redis://:pw@host/0`` -> ``redis://:***@host/0``; all of it when there is no colon)
    and a ``password=`` query parameter (``unix://`` sockets)."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    auth, at, host = rest.rpartition("@")
    if at:
        user, colon, _ = auth.partition(":")
        rest = f"{user}:{REDACTED}@{host}" if colon else f"{REDACTED}@{host}"
    rest = re.sub(r"([?&]password=)[^&]*", rf"\g<1>{REDACTED}", rest)
    return f"{scheme}://{rest}"


def public_dump(cfg: RunConfig) -> dict[str, Any]:
    """The resolved config (every field, defaults and derived values included) as JSON data,
    with its secrets redacted (``redis.url``'s password, ``metrics.mlflow.tracking_uri``'s):
    what is written to disk and shown. Reloading it needs the secret again
    (``REVAL__REDIS__URL`` or ``--set``)."""
    data = cfg.model_dump(mode="json")
    data["buffer"]["samples_per_insert"] = cfg.samples_per_insert
    data["redis"]["url"] = redact_url(cfg.redis.url)
    if cfg.metrics.mlflow.tracking_uri:  # (a server's user and password may be in it)
        data["metrics"]["mlflow"]["tracking_uri"] = redact_url(cfg.metrics.mlflow.tracking_uri)
    return data


def dump_config(cfg: RunConfig, path: str | Path) -> None:
    """Write ``public_dump(cfg)``: the resolved config, secrets redacted."""
    Path(path).write_text(json.dumps(public_dump(cfg), indent=2) + "\n")
