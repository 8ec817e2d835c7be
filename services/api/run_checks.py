"""What a POSTed run config may ask of this API, checked before the run is registered (each
defect a 422 in FastAPI's own shape, ``invalid``, naming the field): it writes only under the
API's ``output_dir`` and reads local models, datasets and reward files only under its
``models_dir`` (``confine``); it names a built-in loss only, and installed code only from the
API's plugin list, each checked in a throw-away process; an ``http_reward``'s URL and token
are checked as the run's grading processes will check them (``check_user_code``). Used by
``RunService.run_config`` (``services/api/runs.py``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from fastapi import HTTPException

from reval.config import ApiConfig, RunConfig
from reval.tracker_mlflow import local_store


def invalid(loc: list[str], msg: str) -> HTTPException:
    """A 422 in FastAPI's own shape, for one field of the request."""
    return HTTPException(422, [{"loc": loc, "msg": msg, "type": "value_error"}])


def _under(path: str | Path, root: str | Path) -> bool:
    """Whether ``path`` is ``root`` or lies below it, symbolic links and ``..`` resolved (as
    the run, started from this process's directory, would resolve them)."""
    real, base = os.path.realpath(path), os.path.realpath(root)
    return real == base or real.startswith(base.rstrip(os.sep) + os.sep)


def _hub_id(name: str) -> bool:
    """``NAME`` or ``ORG/NAME`` that is not also a path here (``from_pretrained`` prefers a
    local directory of that name)."""
    return (
        not name.startswith(("/", ".", "~", "\\"))
        and name.count("/") <= 1
        and not os.path.lexists(name)
    )


def confine(run: RunConfig, api: ApiConfig) -> None:
    """A POSTed config writes only under the API's ``output_dir`` (its run, weight files,
    TensorBoard events and a local MLflow store) and reads local models and datasets only
    under its ``models_dir``; a 422 naming the field otherwise."""
    problems: list[tuple[list[str], str]] = []
    m = run.metrics
    store = local_store(m.mlflow.tracking_uri) if m.mlflow.tracking_uri else None
    for loc, value in ((["output_dir"], run.output_dir),
                       (["sync", "weights_dir"], run.sync.weights_dir),
                       (["metrics", "tensorboard_dir"], m.tensorboard_dir),
                       (["metrics", "mlflow", "tracking_uri"], store)):  # fmt: skip
        if value is not None and not _under(value, api.output_dir):
            problems.append((loc, f"must lie under the API's output_dir {api.output_dir!r}"))
    from reval.paths import reward_file

    reward = run.task.reward and reward_file(run.task.reward)  # (a module name: installed code)
    env = run.task.environment and reward_file(run.task.environment)  # (the same forms)
    for loc, value in ((["model", "name_or_path"], run.model.name_or_path),
                       (["task", "dataset"], run.task.dataset),
                       (["task", "reward"], reward or None),
                       (["task", "environment"], env or None)):  # fmt: skip
        if value is None or _hub_id(value):
            continue
        if api.models_dir is None:
            problems.append((loc, "must be a hub id (ORG/NAME): this API has no models_dir "
                             "for local paths"))  # fmt: skip
        elif not _under(value, api.models_dir):
            problems.append((loc, "must be a hub id (ORG/NAME) or a path under the API's "
                             f"models_dir {api.models_dir!r}"))  # fmt: skip
    if problems:
        raise HTTPException(422, [{"loc": ["body", "config", *loc], "msg": msg,
                                   "type": "value_error"} for loc, msg in problems])  # fmt: skip


def check_user_code(run_cfg: RunConfig, api: ApiConfig, env: dict[str, str]) -> None:
    """``algo.name``: a built-in loss only. ``task.reward`` and ``task.environment``: a file
    under ``models_dir`` (``confine`` has checked where it lies), or installed code on the
    API's list (``reval.plugins.listed``: the
    built-in graders and ``api.plugins``), by a plain name (no dotted path); each then checked
    by ``reval.paths.check_isolated`` in a throw-away process (this process imports nothing a
    client names). ``http_reward``'s URL and ``token_env`` are checked as the grading processes will
    check them (``rollout.grading.http_guard``). 422s, in lines that repeat nothing an import
    said."""
    from reval.config import BUILTIN_ALGORITHMS, BUILTIN_ENVIRONMENTS
    from reval.paths import check_isolated, reward_file
    from reval.plugins import BUILTIN_PLUGINS, PluginRefused, canonical_spec, listed, split_spec

    if run_cfg.algo.name not in BUILTIN_ALGORITHMS:  # (a loss is learner code: never over REST)
        raise invalid(["body", "config", "algo", "name"],
                      f"algo.name: a loss of your own ({run_cfg.algo.name}) is not taken over "
                      f"REST; the built-in ones are {', '.join(BUILTIN_ALGORITHMS)}")  # fmt: skip
    task = run_cfg.task
    for field, spec in (("reward", task.reward), ("environment", task.environment)):
        if spec is None or (field == "environment" and spec in BUILTIN_ENVIRONMENTS):
            continue
        loc = ["body", "config", "task", field]
        module, name = split_spec(spec)
        if "." in name:
            raise invalid(loc, f"task.{field}: name a top-level function (module:name); a "
                          "dotted path is not taken over REST")  # fmt: skip
        how = None
        if reward_file(spec) is None:
            how = listed(spec, [*BUILTIN_PLUGINS, *api.plugins])
            if how is None:
                raise invalid(loc, f"task.{field}: {module}:{name} is not on this API's "
                              "plugin list: the built-in graders (rollout.grading.graders:NAME), "
                              "what the operator lists (api.plugins, reval serve --plugin), "
                              "or a file.py:name under its models_dir")  # fmt: skip
        args = task.reward_args if field == "reward" else None
        try:
            check_isolated(spec, f"task.{field}", args, own_names_only=how == "module")
        except PluginRefused as err:
            raise invalid(loc, str(err)) from None
    if task.reward is not None and canonical_spec(task.reward) == HTTP_REWARD:
        _check_http_reward(task.reward_args, env)


HTTP_REWARD = "rollout.grading.graders:http_reward"


def _check_http_reward(args: dict[str, Any], env: dict[str, str]) -> None:
    """``reward_args.url`` and ``token_env`` as the run's grading processes will check them
    (the same functions, the environment the run will have)."""
    from rollout.grading.http_guard import RewardUrlRefused, check_target, check_token_env

    try:
        check_token_env(args.get("token_env"), env)
        check_target(args.get("url"), env)  # type: ignore[arg-type]
    except RewardUrlRefused as err:
        raise invalid(["body", "config", "task", "reward_args", err.field], str(err)) from None
