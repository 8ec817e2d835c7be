"""``reval runs ...``: the REST API's client side (``services/api/``). The API's address from
``--url`` or ``REVAL_API_URL`` (default http://127.0.0.1:8080), the token from
``REVAL_API_TOKEN``. Prints the JSON the API answers; exits 1 with the API's message on an error.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from typing import Any

ACTIONS = ("pause", "resume", "stop", "checkpoint", "export", "start")
DEFAULT_URL = "http://127.0.0.1:8080"


def default_url() -> str:
    return os.environ.get("REVAL_API_URL", DEFAULT_URL)


def add_parser(sub: Any) -> None:
    r = sub.add_parser("runs", help="control runs through the REST API (reval serve)")
    r.add_argument("--url", default=default_url(), help="the API (default: REVAL_API_URL or "
                   f"{DEFAULT_URL})")  # fmt: skip
    r.add_argument("--verbose", action="store_true", help="log every HTTP request")
    cmds = r.add_subparsers(dest="runs_command", required=True)
    cmds.add_parser("list", help="every run the API manages")
    g = cmds.add_parser("get", help="a run's phase, step, buffer, workers, metrics")
    g.add_argument("name")
    c = cmds.add_parser("create", help="create and start a run from a config")
    c.add_argument("--config", help="TOML config (default: configs/demo.toml)")
    c.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    c.add_argument("--workers", type=int)
    c.add_argument("--no-start", action="store_true", help="only register it")
    c.add_argument(
        "--resume",
        action="store_true",
        help="continue from the checkpoints in its run directory (from `reval train` or "
        "another API): without it such a run is refused (409)",
    )
    for action in ACTIONS:
        a = cmds.add_parser(action, help=f"{action} a run")
        a.add_argument("name")
    s = cmds.add_parser("scale", help="set the number of rollout workers")
    s.add_argument("name")
    s.add_argument("workers", type=int)
    h = cmds.add_parser("set", help="change hyperparameters live, e.g. beta=0.05 lr=1e-6")
    h.add_argument("name")
    h.add_argument("values", nargs="+", metavar="KEY=VALUE")
    e = cmds.add_parser("events", help="a run's event log")
    e.add_argument("name")
    e.add_argument("--after", default="-")
    e.add_argument("--count", type=int, default=100)


def _number(text: str) -> float | int:
    try:
        return int(text)
    except ValueError:
        return float(text)


def resume_command(args: argparse.Namespace) -> str:
    """The ``reval runs create`` that was run, with ``--resume``."""
    cmd = ["reval", "runs"]
    if args.url != default_url():
        cmd += ["--url", args.url]
    cmd.append("create")
    if args.config:
        cmd += ["--config", args.config]
    for item in args.overrides:
        cmd += ["--set", item]
    if args.workers is not None:
        cmd += ["--workers", str(args.workers)]
    if args.no_start:
        cmd.append("--no-start")
    return shlex.join([*cmd, "--resume"])


def run(args: argparse.Namespace) -> int:
    import logging

    import httpx

    if not args.verbose:  # (httpx logs each request at INFO, and the CLI logs INFO)
        logging.getLogger("httpx").setLevel(logging.WARNING)
    headers = {}
    token = os.environ.get("REVAL_API_TOKEN")
    if token:
        headers["Authorization"] = f"Bearer {token}"
    url = args.url.rstrip("/")
    cmd = args.runs_command
    method, path, body, params = "GET", "/v1/runs", None, None
    if cmd == "get":
        path = f"/v1/runs/{args.name}"
    elif cmd == "create":
        from reval.config import ConfigError, load_config

        try:
            cfg = load_config(args.config, args.overrides)
        except ConfigError as err:
            from services.errors import fail

            return fail("runs", err)
        method = "POST"
        body = {"config": cfg.model_dump(mode="json"), "start": not args.no_start}
        if args.resume:
            body["resume"] = True
        if args.workers is not None:
            body["workers"] = args.workers
    elif cmd in ACTIONS:
        method, path = "POST", f"/v1/runs/{args.name}/{cmd}"
    elif cmd == "scale":
        method, path, body = "POST", f"/v1/runs/{args.name}/scale", {"workers": args.workers}
    elif cmd == "set":
        values: dict[str, Any] = {}
        for item in args.values:
            key, sep, text = item.partition("=")
            if not sep:
                print(f"reval runs set: {item!r} is not KEY=VALUE", file=sys.stderr)
                return 2
            try:
                values[key] = _number(text)
            except ValueError:
                print(f"reval runs set: {key}: {text!r} is not a number", file=sys.stderr)
                return 2
        method, path, body = "PATCH", f"/v1/runs/{args.name}/hparams", values
    elif cmd == "events":
        path, params = f"/v1/runs/{args.name}/events", {"after": args.after, "count": args.count}
    try:
        resp = httpx.request(method, url + path, json=body, params=params, headers=headers,
                             timeout=30)  # fmt: skip
    except httpx.HTTPError as err:
        print(f"reval runs: cannot reach the API at {url}: {err}", file=sys.stderr)
        return 1
    try:
        payload = resp.json()
    except ValueError:
        payload = resp.text
    if resp.status_code >= 400:
        detail = payload.get("detail", payload) if isinstance(payload, dict) else payload
        hint = ""
        if cmd == "create" and resp.status_code == 409 and "--resume" in str(detail):
            hint = f"; to continue it: {resume_command(args)}"
        print(f"reval runs: {resp.status_code}: {json.dumps(detail)}{hint}", file=sys.stderr)
        return 1
    print(json.dumps(payload, indent=2))
    return 0
