"""``reval compose``: the compose file for one GPU node's layout.

Every GPU service is pinned to its own GPUs with ``device_ids`` (``count: 1`` on several services
gives each of them the first GPU, and ``--scale`` cannot hand replicas different GPUs): the
learner gets GPUs ``0 .. L-1`` and runs one FSDP2 rank on each, every rollout worker is its own
service (``rollout-0``, ``rollout-1``, ...) on one GPU, and the evaluation (profile ``eval``) on
the last ``--eval-gpus``. The GPU services get ``shm_size`` (NCCL between the learner's ranks and
vLLM's worker processes use /dev/shm, which Docker caps at 64 MB). The checked-in
docker-compose.yml is this generator's output for :data:`DEFAULT_LAYOUT`
(``tests/unit/test_compose_gen.py`` holds them equal); a node with other GPUs writes its own:
``reval compose --gpus 8 --learner-gpus 4 --out docker-compose.gpu8.yml`` (at the repository
root: the file's paths are relative to it).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

CONFIG = "/app/configs/${REVAL_CONFIG:-r1_distill_qwen_1p5b.toml}"
# NCCL (the learner's ranks, the weight broadcast) and vLLM's worker processes share memory
# through /dev/shm; Docker's default of 64 MB fails their first large collective.
SHM_SIZE = "16gb"
LEARNER_METRICS_PORT = 9400
ROLLOUT_METRICS_PORT = 9401
EVAL_METRICS_PORT = 9402
# Prometheus finds the rollout workers through this DNS name (deploy/prometheus/prometheus.yml):
# every rollout-N service answers to it.
ROLLOUT_ALIAS = "rollout"


@dataclass(frozen=True)
class Layout:
    """How one node's GPUs are split: the learner's first, then one per rollout worker, then
    the evaluation's."""

    gpus: int
    learner_gpus: int
    eval_gpus: int = 0

    def __post_init__(self) -> None:
        if self.learner_gpus < 1:
            raise ValueError(f"--learner-gpus {self.learner_gpus}: the learner needs >= 1 GPU")
        if self.eval_gpus < 0:
            raise ValueError(f"--eval-gpus {self.eval_gpus}: give 0 (no eval service) or more")
        if self.rollout_gpus < 1:
            raise ValueError(
                f"--gpus {self.gpus} leaves no GPU for a rollout worker after "
                f"--learner-gpus {self.learner_gpus} and --eval-gpus {self.eval_gpus}: "
                "give more --gpus or fewer learner/eval GPUs"
            )

    @property
    def rollout_gpus(self) -> int:
        return self.gpus - self.learner_gpus - self.eval_gpus

    def learner_ids(self) -> list[int]:
        return list(range(self.learner_gpus))

    def rollout_ids(self) -> list[int]:
        return list(range(self.learner_gpus, self.learner_gpus + self.rollout_gpus))

    def eval_ids(self) -> list[int]:
        return list(range(self.gpus - self.eval_gpus, self.gpus))

    def command(self) -> str:
        """The ``reval compose`` line that writes this layout."""
        line = f"reval compose --gpus {self.gpus} --learner-gpus {self.learner_gpus}"
        return line + (f" --eval-gpus {self.eval_gpus}" if self.eval_gpus else "")


# The checked-in docker-compose.yml: the learner on GPU 0, one rollout worker on GPU 1, the
# evaluation (profile eval) on GPU 2.
DEFAULT_LAYOUT = Layout(gpus=3, learner_gpus=1, eval_gpus=1)

REDIS_URL = "redis://:${REDIS_PASSWORD}@redis:6379/0"
"""Every service's Redis, with the password Redis requires (deploy/redis.conf: protected mode;
the password is given to redis-server with --requirepass)."""

REVAL_ENV = {
    "REVAL__BUFFER__BACKEND": "redis",
    "REVAL__BUFFER__REDIS_URL": REDIS_URL,
    "REVAL__BUFFER__KEY_PREFIX": "reval:",
    "REVAL__NAME": "${REVAL_RUN:-run}",
    "REVAL__OUTPUT_DIR": "/runs",
    "REVAL__SYNC__WEIGHTS_DIR": "/runs/weights",
    "REVAL__METRICS__ADDR": "0.0.0.0",
    "HF_HOME": "/runs/hf",
}
# The run directories (checkpoints, weights files, hf cache) and local datasets, read-only
# (docs/reproduce-paper.md).
GPU_VOLUMES = ["runs:/runs", "./data:/data:ro"]
REDIS_HEALTHY = {"redis": {"condition": "service_healthy"}}


def _gpus(ids: list[int] | None) -> dict[str, Any]:
    """A device reservation: these GPUs (``None``: all of them, for the Ray head)."""
    device: dict[str, Any] = {"driver": "nvidia"}
    if ids is None:
        device["count"] = "all"
    else:
        device["device_ids"] = [str(i) for i in ids]
    device["capabilities"] = ["gpu"]
    return {"resources": {"reservations": {"devices": [device]}}}


def _health(
    test: list[str], interval: str, timeout: str, retries: int, start_period: str | None = None
) -> dict[str, Any]:
    out: dict[str, Any] = {
        "test": test,
        "interval": interval,
        "timeout": timeout,
        "retries": retries,
    }
    if start_period:
        out["start_period"] = start_period
    return out


def _http_health(port: int) -> list[str]:
    url = f"http://127.0.0.1:{port}"
    probe = f"import urllib.request; urllib.request.urlopen('{url}/healthz', timeout=3)"
    return ["CMD", "python", "-c", probe]


def _rollout(gpu: int) -> dict[str, Any]:
    return {
        "image": "reval:gpu",
        "command": [
            "reval",
            "rollout",
            "--config",
            CONFIG,
            "--metrics-port",
            str(ROLLOUT_METRICS_PORT),
        ],
        "environment": dict(REVAL_ENV),
        "shm_size": SHM_SIZE,
        "volumes": list(GPU_VOLUMES),
        "networks": {"default": {"aliases": [ROLLOUT_ALIAS]}},
        "depends_on": {**REDIS_HEALTHY, "learner": {"condition": "service_started"}},
        "healthcheck": _health(_http_health(ROLLOUT_METRICS_PORT), "15s", "5s", 20, "600s"),
        "deploy": _gpus([gpu]),
    }


def compose_dict(layout: Layout) -> dict[str, Any]:
    """The compose file of ``layout`` as data."""
    services: dict[str, Any] = {
        "redis": {
            "image": "redis:7.2",
            "command": [
                "redis-server",
                "/usr/local/etc/redis/redis.conf",
                "--requirepass",
                "${REDIS_PASSWORD:?set REDIS_PASSWORD to a random secret (openssl rand -hex 24)}",
            ],
            "environment": {"REDISCLI_AUTH": "${REDIS_PASSWORD}"},  # (the health check's)
            "volumes": [
                "./deploy/redis.conf:/usr/local/etc/redis/redis.conf:ro",
                "redis-data:/data",
            ],
            "ports": ["127.0.0.1:6379:6379"],
            "healthcheck": _health(["CMD", "redis-cli", "ping"], "5s", "3s", 10),
        },
        "api": {
            "image": "reval:cpu",
            "build": {"context": ".", "dockerfile": "deploy/docker/Dockerfile.cpu"},
            "command": [
                "reval",
                "serve",
                "--host",
                "0.0.0.0",
                "--port",
                "8080",
                "--redis-url",
                REDIS_URL,
                "--output-dir",
                "/runs",
            ],
            "environment": {
                "REVAL_API_TOKEN": "${REVAL_API_TOKEN:?set REVAL_API_TOKEN to a secret of 16+ "
                "characters}",
                "RAY_ADDRESS": "${REVAL_RAY_ADDRESS:-}",
            },
            "ports": ["127.0.0.1:8080:8080"],
            "volumes": ["runs:/runs"],
            "depends_on": dict(REDIS_HEALTHY),
            "healthcheck": _health(
                [
                    "CMD",
                    "python",
                    "-c",
                    "import urllib.request; "
                    "urllib.request.urlopen('http://127.0.0.1:8080/readyz', timeout=3)",
                ],
                "10s",
                "5s",
                6,
            ),
        },
        # --resume-if-any: a restarted container continues from the run's latest checkpoint.
        "learner": {
            "image": "reval:gpu",
            "build": {"context": ".", "dockerfile": "deploy/docker/Dockerfile.gpu"},
            "command": [
                "reval",
                "learner",
                "--config",
                CONFIG,
                "--resume-if-any",
                "--set",
                f"metrics.prometheus_port={LEARNER_METRICS_PORT}",
            ],
            "environment": {
                **REVAL_ENV,
                "REVAL__LEARNER__WORLD_SIZE": str(layout.learner_gpus),
                "REVAL__SYNC__BROADCAST_HOST": "auto",
            },
            "shm_size": SHM_SIZE,
            "volumes": list(GPU_VOLUMES),
            "depends_on": dict(REDIS_HEALTHY),
            "healthcheck": _health(_http_health(LEARNER_METRICS_PORT), "15s", "5s", 20, "600s"),
            "deploy": _gpus(layout.learner_ids()),
        },
    }
    for i, gpu in enumerate(layout.rollout_ids()):
        services[f"rollout-{i}"] = _rollout(gpu)
    if layout.eval_gpus:
        # The paper's evaluation while it trains: avg@16 on its seven benchmarks every 10 steps
        # (docker compose --profile eval up -d eval); benchmark files in ./data/benchmarks.
        services["eval"] = {
            "profiles": ["eval"],
            "image": "reval:gpu",
            "command": [
                "reval",
                "eval",
                "--config",
                CONFIG,
                "--follow",
                "--every",
                "10",
                "--benchmarks",
                "aime24,aime25,amc,math500,minerva,olympiad,gpqa",
                "--data",
                "/data/benchmarks",
                "--metrics-port",
                str(EVAL_METRICS_PORT),
            ],
            "environment": dict(REVAL_ENV),
            "shm_size": SHM_SIZE,
            "volumes": list(GPU_VOLUMES),
            "depends_on": {**REDIS_HEALTHY, "learner": {"condition": "service_started"}},
            "deploy": _gpus(layout.eval_ids()),
        }
    # The Ray head for runs created over REST (`reval runs create` -> `reval launch` on it),
    # instead of the learner and rollout services: all the node's GPUs.
    services["ray-head"] = {
        "profiles": ["ray"],
        "image": "reval:gpu",
        "command": [
            "ray",
            "start",
            "--head",
            "--port=6380",
            "--dashboard-host=0.0.0.0",
            "--disable-usage-stats",
            "--block",
        ],
        "shm_size": SHM_SIZE,
        "volumes": ["runs:/runs"],
        "depends_on": dict(REDIS_HEALTHY),
        "healthcheck": _health(
            ["CMD", "ray", "health-check", "--address", "127.0.0.1:6380"], "15s", "10s", 10
        ),
        "deploy": _gpus(None),
    }
    services["prometheus"] = {
        "image": "prom/prometheus:v2.53.0",
        "command": [
            "--config.file=/etc/prometheus/prometheus.yml",
            "--storage.tsdb.path=/prometheus",
        ],
        "volumes": ["./deploy/prometheus:/etc/prometheus:ro", "prometheus-data:/prometheus"],
        "ports": ["127.0.0.1:9090:9090"],
        "healthcheck": _health(
            ["CMD", "wget", "-qO-", "http://127.0.0.1:9090/-/ready"], "10s", "5s", 10
        ),
    }
    services["grafana"] = {
        "image": "grafana/grafana:11.1.0",
        "environment": {
            "GF_SECURITY_ADMIN_PASSWORD": "${GRAFANA_ADMIN_PASSWORD:?set GRAFANA_ADMIN_PASSWORD}",
            "GF_AUTH_ANONYMOUS_ENABLED": "false",
        },
        "volumes": [
            "./deploy/grafana/provisioning:/etc/grafana/provisioning:ro",
            "./deploy/grafana/dashboards:/var/lib/grafana/dashboards:ro",
        ],
        "ports": ["127.0.0.1:3000:3000"],
        "depends_on": {"prometheus": {"condition": "service_healthy"}},
    }
    return {
        "services": services,
        "volumes": {"redis-data": None, "runs": None, "prometheus-data": None},
    }


class _Dumper(yaml.SafeDumper):
    """Block style, with short lists of plain values (ports, volumes) on one line; no anchors."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def _list(dumper: yaml.SafeDumper, data: list[Any]) -> yaml.Node:
    flat = all(isinstance(x, str) for x in data) and sum(len(x) + 4 for x in data) < 64
    return dumper.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=flat)


def _none(dumper: yaml.SafeDumper, _data: None) -> yaml.Node:
    return dumper.represent_scalar("tag:yaml.org,2002:null", "")


_Dumper.add_representer(list, _list)
_Dumper.add_representer(type(None), _none)


def compose_text(layout: Layout) -> str:
    """The compose file of ``layout``, with a header that says what it holds."""
    learner = ",".join(map(str, layout.learner_ids()))
    rollout = ", ".join(f"rollout-{i} on {g}" for i, g in enumerate(layout.rollout_ids()))
    evals = ",".join(map(str, layout.eval_ids()))
    header = [
        f"# Generated by `{layout.command()}`",
        "# (services/compose.py): edit the generator, not this file. reval on one GPU node:",
        "#   export REVAL_API_TOKEN=$(openssl rand -hex 24) REDIS_PASSWORD=$(openssl rand -hex 24)",
        "#   export GRAFANA_ADMIN_PASSWORD=...",
        "#   reval doctor --config configs/${REVAL_CONFIG:-r1_distill_qwen_1p5b.toml}  # preflight",
        "#   docker compose up -d --build   # redis, api, learner, rollout workers, prometheus, "
        "grafana",
        f"# GPUs: learner on {learner} (an FSDP2 rank per GPU), {rollout}"
        + (f", eval (--profile eval) {evals}." if layout.eval_gpus else "."),
        "# Another layout: reval compose --gpus N --learner-gpus L [--eval-gpus E] --out FILE, at",
        "# the repository root. REVAL_CONFIG picks the preset, REVAL_RUN the run's name; runs",
        "# created over REST go to the Ray head of the `ray` profile with",
        "# REVAL_RAY_ADDRESS=ray-head:6380. The API on 127.0.0.1:8080, Grafana on",
        "# 127.0.0.1:3000, Prometheus on 127.0.0.1:9090. With sync.broadcast on, the learner",
        "# announces its weight hub at its container's address (REVAL__SYNC__BROADCAST_HOST=auto).",
        "# tests/e2e/test_compose.py starts these services' commands as local processes.",
    ]
    body = yaml.dump(
        compose_dict(layout), Dumper=_Dumper, sort_keys=False, width=100, default_flow_style=False
    )
    lines: list[str] = []
    for line in body.splitlines():
        top = not line.startswith(" ")
        service = line.startswith("  ") and not line.startswith("   ") and line.endswith(":")
        if lines and (top or service) and lines[-1] != "services:":
            lines.append("")
        lines.append(line)
    return "\n".join(header + lines) + "\n"


def add_parser(sub: Any) -> None:
    c = sub.add_parser(
        "compose",
        help="write the compose file for this node's GPUs (device_ids pinned per service)",
    )
    c.add_argument("--gpus", type=int, required=True, help="GPUs on the node")
    c.add_argument(
        "--learner-gpus",
        type=int,
        required=True,
        help="GPUs of the learner (one FSDP2 rank each); the rest run one rollout worker each",
    )
    c.add_argument(
        "--eval-gpus",
        type=int,
        default=0,
        help="GPUs of the `eval` profile's service, the last ones (0: no eval service)",
    )
    c.add_argument(
        "--out",
        default="-",
        help="where to write it (default: stdout); at the "
        "repository root, since its paths are relative to the file",
    )


def main(args: argparse.Namespace) -> int:
    try:
        layout = Layout(args.gpus, args.learner_gpus, args.eval_gpus)
    except ValueError as err:
        print(f"reval compose: {err}", file=sys.stderr)
        return 2
    text = compose_text(layout)
    if args.out == "-":
        sys.stdout.write(text)
    else:
        Path(args.out).write_text(text)
        print(f"wrote {args.out}: {layout.command()}", file=sys.stderr)
    return 0
