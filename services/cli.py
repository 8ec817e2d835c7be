"""The ``reval`` command line. Thin: parse, build the config, hand off."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from reval.config import ENV_PREFIX, ConfigError, RunConfig, load_config
from services.cli_args import ALGO_OVERRIDES, build_parser
from services.errors import fail

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


def _resume_command(args: argparse.Namespace) -> str:
    """The command line that continues this ``reval train``: its own, with ``--resume``."""
    import shlex

    argv: list[str] = [a for a in args.argv if a not in ("--overwrite", "--resume")]
    return shlex.join(["reval", *argv, "--resume"])


def _checkpoint_at(path: Path) -> str:
    """``round R, step S`` of a checkpoint directory (its ``reval_state.json``)."""
    try:
        state = json.loads((path / "reval_state.json").read_text())
        return f"round {state.get('round', '?')}, step {state.get('step', '?')}"
    except (OSError, ValueError):
        return path.name


def _train_refusal(cfg: RunConfig, args: argparse.Namespace) -> tuple[str | None, str | None]:
    """What ``reval train`` refuses to do in ``cfg.run_dir`` (one line), else None; and, when
    the directory holds another run that ``--overwrite`` replaces, why it is another run."""
    problem = another_run(cfg)
    latest = cfg.paths.latest_checkpoint()
    stopped = latest is not None and not cfg.paths.summary.is_file()
    refusal = None
    if args.resume and args.overwrite:
        refusal = "--resume continues the run, --overwrite replaces it: give one of them"
    elif problem is not None and args.resume:
        refusal = (f"--resume: {cfg.run_dir} holds another run: {problem}; resume it with the "
                   "config it ran with")  # fmt: skip
    elif problem is not None and not args.overwrite:
        refusal = (f"{cfg.run_dir} holds another run: {problem}; give this one a new name "
                   f"(--set name={cfg.name}-2) or replace it (--overwrite)")  # fmt: skip
    elif args.resume and latest is None:
        refusal = (f"--resume: no checkpoint under {cfg.paths.checkpoints}; start the run "
                   "without --resume")  # fmt: skip
    elif stopped and latest is not None and not args.resume and not args.overwrite:
        at, again = _checkpoint_at(latest), _resume_command(args)
        refusal = (f"{cfg.run_dir} holds a stopped run (checkpoint at {at}): continue it "
                   f"({again}) or start it over (--overwrite)")  # fmt: skip
    return refusal, problem


def port_refused(command: str, port: int | None, addr: str, setting: str) -> int | None:
    """One line naming ``addr:port`` and ``setting`` (what moves it), exit status 2, when the
    metrics port cannot be bound: checked before the command's long work (set-up, pretraining,
    Ray), not found minutes later as a traceback. None: it is free, or nothing is served."""
    if not port:
        return None
    from reval.ops_http import PortTaken, check_port

    try:
        check_port(port, addr)
    except PortTaken as err:
        why = os.strerror(err.errno) if err.errno else "cannot be bound"
        return fail(command, f"cannot serve metrics and health on {addr}:{port} ({why}): "
                    f"another process holds the port; stop it, or pick a free one with "
                    f"{setting}<port> (0: any free)")  # fmt: skip
    return None


def _train(cfg: RunConfig, args: argparse.Namespace) -> int:
    """``reval train``: refuse another run's directory (or a stopped run's, without
    ``--resume`` or ``--overwrite``), say what it starts at once (before torch is imported),
    check the model path, build the run (one line for what is wrong), then train. Ctrl-C and
    SIGTERM stop it after the round in hand with a checkpoint (``StopSignals``): one line,
    exit status 130 or 143."""
    if args.no_progress:
        cfg.metrics.progress = False
    refusal, problem = _train_refusal(cfg, args)
    if refusal is not None:
        return fail("train", refusal)
    port = cfg.metrics.prometheus_port
    refused = port_refused("train", port, cfg.metrics.addr, "--set metrics.prometheus_port=")
    if refused is not None:
        return refused
    latest = cfg.paths.latest_checkpoint()
    if args.resume and latest is not None:
        doing = f"resuming from {latest} ({_checkpoint_at(latest)}); setting up (model, task)"
    elif args.overwrite and (problem is not None or latest is not None):
        doing = "replacing the run there; setting up (model, task, pretraining)"
    elif latest is not None:
        doing = ("starting over (the finished run there is replaced); setting up (model, task, "
                 "pretraining)")  # fmt: skip
    else:
        doing = "setting up (model, task, pretraining)"
    print(f"reval train: run {cfg.name} -> {cfg.run_dir}; {doing}...", flush=True)
    from services.stop import Stopped, StopSignals, signal_name

    signals = StopSignals().install()
    try:
        try:
            check_paths(cfg, held_out=True)
            from reval.threads import apply, budget

            apply(budget("train"))  # before torch's first work (OMP_NUM_THREADS wins)
            from services.train import prepare

            prepared = prepare(cfg, args.resume)
        except SET_UP_ERRORS as err:
            return fail("train", err)
        if args.overwrite and (problem is not None or latest is not None):
            import shutil  # --overwrite: nothing of the other (or stopped) run stays

            shutil.rmtree(cfg.run_dir)
        from services.progress import run_with_progress

        result = run_with_progress(cfg, prepared, args.resume, signals)
    except Stopped as stop:
        kept = f"the checkpoint {latest} is as it was" if args.resume else "nothing to keep yet"
        print(f"reval train: stopped by {stop} during set-up: {kept}", flush=True)
        return 128 + stop.signum
    finally:
        signals.restore()
    if result.stopped_by is not None:
        name = signal_name(result.stopped_by)
        print(f"reval train: stopped by {name} after round {result.round} (step {result.step}): "
              f"checkpoint {result.checkpoint}; continue with: {_resume_command(args)}",
              flush=True)  # fmt: skip
        return 128 + result.stopped_by
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

    from reval.signals import off_main
    from services.evaluate import EvalMetrics, follow

    if cfg.buffer.backend != "redis":
        print("reval eval --follow: needs buffer.backend=redis (the run's Redis)", file=sys.stderr)
        return 2
    refused = port_refused("eval", args.metrics_port, cfg.metrics.addr, "--metrics-port ")
    if refused is not None:
        return refused
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, off_main(lambda _s: stop.set()))  # (reval/signals.py: why)
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
    refused = refuse_another_run(cfg, "launch", args.resume) or port_refused(
        "launch", cfg.launch.metrics_port, cfg.metrics.addr, "--set launch.metrics_port="
    )
    if refused is not None:
        return refused
    try:
        check_paths(cfg)
    except SET_UP_ERRORS as err:
        return fail("launch", err)
    ray_at = os.environ.get("RAY_ADDRESS") or "a local Ray"
    print(f"reval launch: run {cfg.name} -> {cfg.run_dir}; starting {ray_at}, the learner "
          f"({cfg.learner.world_size} rank(s){', resuming' if args.resume else ''}) and "
          f"{cfg.launch.workers} rollout worker(s)...", flush=True)  # fmt: skip
    return launch.launch(cfg, resume=args.resume)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # (the line that resumes a run)
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


def begin_starting(
    cfg: RunConfig, begin: Callable[[RunConfig], object], poll_s: float = 1.0
) -> threading.Thread:
    """Begin the run's ``starting`` status (``begin``: ``StartingStatus.begin``) once the run's
    lease is free (``RunLease.live_holder``), from a thread: a second learner that the lease
    will refuse never writes ``starting`` over a live learner's phase. While a holder that may
    be alive has it, it looks again every ``poll_s`` (a holder on this host is gone once its pid
    is; one on another host that died frees the lease within ``learner.lease_s``); a holder
    that started after this call is this start's own learner (no beat then); Redis away: it
    looks again."""
    import time

    import redis

    from reval.control import RunLease
    from reval.redis import connect

    lease = RunLease(connect(cfg.redis.url), cfg.redis.prefix, cfg.name, cfg.learner.lease_s)
    since = time.time()

    def wait_then_begin() -> None:
        while True:
            try:
                holder = lease.live_holder()
            except redis.RedisError:  # (Redis away: look again)
                holder = {}
            if holder is None:
                begin(cfg)
                return
            started = holder.get("started")
            if isinstance(started, (int, float)) and started >= since:
                return  # (this start's own learner holds it: its status is its own)
            time.sleep(poll_s)

    thread = threading.Thread(target=wait_then_begin, name="reval-starting-wait", daemon=True)
    thread.start()
    return thread


def _learner(cfg: RunConfig, args: argparse.Namespace) -> int:
    """``reval learner``: while it sets up (the tiny model's pretraining) the run's status says
    ``starting`` and Ctrl-C or SIGTERM end it with one line (nothing to keep yet,
    ``StopSignals``); then its ranks train, and Ctrl-C or SIGTERM stop them with a checkpoint
    and one line. Exit status 130 or 143 either way."""
    if cfg.buffer.backend != "redis":
        return fail("learner", "the learner service needs buffer.backend=redis")
    if args.verbose:
        cfg.metrics.log_every = 1
    resume = args.resume or (args.resume_if_any and has_checkpoint(cfg))
    refused = None if args.export else refuse_another_run(cfg, "learner", resume)
    if refused is not None:
        return refused
    try:
        check_paths(cfg)
        from buffer.redis_layout import RingCorrupt
        from learner.ranks import StartingStatus
        from learner.ranks import main as learner_main
        from reval.ops_http import PortTaken
        from services.setup import prepare_learner
        from services.stop import Stopped, StopSignals

        if not args.export:
            begin_starting(cfg, StartingStatus.begin)  # (it ends itself once rank 0 reports)
            signals = StopSignals().install()  # (the ranks' parent forwards them afterwards)
            try:
                cfg = prepare_learner(cfg, resume)
            finally:
                signals.restore()
    except SET_UP_ERRORS as err:
        return fail("learner", err)
    except Stopped as stop:
        print(f"reval learner: stopped by {stop} while setting up: nothing to keep yet",
              file=sys.stderr, flush=True)  # fmt: skip
        return 128 + stop.signum
    try:
        return learner_main(cfg, resume=resume, nproc=args.nproc, export=args.export)
    except (FileNotFoundError, ValueError) as err:  # no checkpoint to resume, a bad config
        return fail("learner", err)
    except (PortTaken, RingCorrupt) as err:  # its port taken; under torchrun, a corrupt ring
        return fail("learner", err)


def _rollout(cfg: RunConfig, args: argparse.Namespace) -> int:
    if cfg.buffer.backend != "redis":
        return fail("rollout", "a rollout worker needs buffer.backend=redis (the replay service)")
    try:
        check_paths(cfg)
        from buffer.redis_layout import RingCorrupt
        from reval.ops_http import PortTaken
        from rollout.worker import main as rollout_main
    except SET_UP_ERRORS as err:
        return fail("rollout", err)
    try:
        return rollout_main(cfg, args.worker_id, args.max_batches, args.metrics_port)
    except (FileNotFoundError, ValueError, TimeoutError) as err:  # a config, model, dataset or
        return fail("rollout", err)  # a run it cannot work with
    except (PortTaken, RingCorrupt) as err:  # one line each (unsent records: the run's spool/)
        return fail("rollout", err)


if __name__ == "__main__":
    raise SystemExit(main())
