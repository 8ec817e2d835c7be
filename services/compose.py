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

``reval compose --cpu`` writes the CPU stack (docker-compose.cpu.yml: Redis, the API, a learner
on the CPU, ``--workers`` HF rollout workers, Prometheus; no Grafana) from the same pieces: the
same commands, environment, volumes, health checks, restart policy and network as the GPU
file, which only adds the GPU reservations, ``shm_size``, the datasets' mount and the GPU
preset. tests/docker/test_stack.py runs the CPU file under Docker.
The images (and the host ports) are variables with the official images as defaults, so that the
registry-free stand-ins of scripts/make_images.sh can take their place.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

GPU_PRESET = "r1_distill_qwen_1p5b.toml"
CPU_PRESET = "demo.toml"
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


@dataclass(frozen=True)
class CpuLayout:
    """The CPU stack: the learner (one rank) and ``workers`` HF rollout workers on the CPU."""

    workers: int = 2

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ValueError(f"--workers {self.workers}: the CPU stack needs >= 1 rollout worker")

    def command(self) -> str:
        """The ``reval compose`` line that writes this layout."""
        return f"reval compose --cpu --workers {self.workers}"


# The checked-in docker-compose.cpu.yml.
CPU_LAYOUT = CpuLayout(workers=2)

# The checked-in docker-compose.yml: the learner on GPU 0, one rollout worker on GPU 1, the
# evaluation (profile eval) on GPU 2.
DEFAULT_LAYOUT = Layout(gpus=3, learner_gpus=1, eval_gpus=1)

REDIS_URL = "redis://:${REDIS_PASSWORD}@redis:6379/0"
"""Every service's Redis, with the password Redis requires (deploy/redis.conf: protected mode;
the password is given to redis-server with --requirepass)."""

# The images: the official ones by default; scripts/make_images.sh's stand-ins through these.
REDIS_IMAGE = "${REVAL_REDIS_IMAGE:-redis:7.2}"
PROMETHEUS_IMAGE = "${REVAL_PROMETHEUS_IMAGE:-prom/prometheus:v2.53.0}"
GRAFANA_IMAGE = "${REVAL_GRAFANA_IMAGE:-grafana/grafana:11.1.0}"
CPU_BUILD = {
    "context": ".",
    "dockerfile": "deploy/docker/Dockerfile.cpu",
    "args": {"BASE_IMAGE": "${REVAL_BASE_IMAGE:-python:3.11-slim}"},
}
GPU_BUILD = {"context": ".", "dockerfile": "deploy/docker/Dockerfile.gpu"}
# A container that dies is started again (the learner resumes from its latest checkpoint); one
# that `docker compose stop` stopped, or that exited cleanly after `reval runs stop`, stays down.
RESTART = "on-failure"
LEARNER_STOP_GRACE = "120s"
"""How long ``docker stop`` lets the learner finish its update and write its checkpoint."""

REVAL_ENV = {
    "REVAL__BUFFER__BACKEND": "redis",
    "REVAL__REDIS__URL": REDIS_URL,
    "REVAL__REDIS__PREFIX": "reval:",
    "REVAL__NAME": "${REVAL_RUN:-run}",
    "REVAL__OUTPUT_DIR": "/runs",
    "REVAL__SYNC__WEIGHTS_DIR": "/runs/weights",
    "REVAL__METRICS__ADDR": "0.0.0.0",
    "HF_HOME": "/runs/hf",
}
# The run directories (checkpoints, weights files, hf cache) and local datasets, read-only
# (docs/reproduce-paper.md).
GPU_VOLUMES = ["runs:/runs", "./data:/data:ro"]
CPU_VOLUMES = ["runs:/runs"]
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


def _port(var: str, port: int) -> str:
    """A port published on loopback only, ``var`` choosing the host's side."""
    return f"127.0.0.1:${{{var}:-{port}}}:{port}"


def _http_health(port: int) -> list[str]:
    url = f"http://127.0.0.1:{port}"
    probe = f"import urllib.request; urllib.request.urlopen('{url}/healthz', timeout=3)"
    return ["CMD", "python", "-c", probe]


def _config(layout: Layout | CpuLayout) -> str:
    preset = CPU_PRESET if isinstance(layout, CpuLayout) else GPU_PRESET
    return f"/app/configs/${{REVAL_CONFIG:-{preset}}}"


def _on_node(
    service: dict[str, Any], layout: Layout | CpuLayout, gpus: list[int]
) -> dict[str, Any]:
    """``service`` (a learner, worker or evaluation) with what its node adds: on a GPU node its
    GPUs, /dev/shm and the datasets; on the CPU, nothing."""
    if isinstance(layout, CpuLayout):
        return {**service, "volumes": list(CPU_VOLUMES)}
    return {**service, "shm_size": SHM_SIZE, "volumes": list(GPU_VOLUMES), "deploy": _gpus(gpus)}


SANDBOX_SECURITY_OPT = ("seccomp=unconfined", "apparmor=unconfined")
"""What a rollout worker needs for bubblewrap (rollout/grading/sandbox.py, the sandbox model-written
code runs in): Docker's default seccomp and AppArmor profiles refuse the user namespace and the
mounts bwrap makes. (The sandbox mounts no /proc: under Docker's masked paths a new one needs
``systempaths=unconfined``, which ``docker run`` takes but the engine refuses from a compose file.)
No capability, not privileged: the sandbox itself holds the model code."""
SANDBOX_NOTE = [
    "# Rollout workers run model-written code under bubblewrap (rollout/grading/sandbox.py):",
    "# they get security_opt seccomp and apparmor unconfined (Docker's defaults refuse the user",
    "# namespace and the mounts bwrap makes); no capability, not privileged.",
]


def _rollout(layout: Layout | CpuLayout, gpu: int) -> dict[str, Any]:
    service = {
        "image": "reval:cpu" if isinstance(layout, CpuLayout) else "reval:gpu",
        "command": [
            "reval",
            "rollout",
            "--config",
            _config(layout),
            "--metrics-port",
            str(ROLLOUT_METRICS_PORT),
        ],
        "environment": dict(REVAL_ENV),
        "restart": RESTART,
        "networks": {"default": {"aliases": [ROLLOUT_ALIAS]}},
        "depends_on": {**REDIS_HEALTHY, "learner": {"condition": "service_started"}},
        "healthcheck": _health(_http_health(ROLLOUT_METRICS_PORT), "15s", "5s", 20, "600s"),
        "security_opt": list(SANDBOX_SECURITY_OPT),
    }
    return _on_node(service, layout, [gpu])


def _redis() -> dict[str, Any]:
    """The run's Redis: password required, its AOF on a volume."""
    return {
        "image": REDIS_IMAGE,
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
        "ports": [_port("REVAL_REDIS_PORT", 6379)],
        "restart": RESTART,
        "healthcheck": _health(["CMD", "redis-cli", "ping"], "5s", "3s", 10),
    }


def _api() -> dict[str, Any]:
    """The REST API (``reval serve``), on port 8080."""
    return {
        "image": "reval:cpu",
        "build": CPU_BUILD,
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
            # Prometheus scrapes /metrics from its own container (the API binds 0.0.0.0,
            # where reads and /metrics need the token unless opened): metrics only.
            "--open-metrics",
        ],
        "environment": {
            "REVAL_API_TOKEN": "${REVAL_API_TOKEN:?set REVAL_API_TOKEN to a secret of 16+ "
            "characters}",
            "RAY_ADDRESS": "${REVAL_RAY_ADDRESS:-}",
        },
        "ports": [_port("REVAL_API_PORT", 8080)],
        "volumes": ["runs:/runs"],
        "restart": RESTART,
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
    }


def _learner(layout: Layout | CpuLayout) -> dict[str, Any]:
    """The learner: ``reval learner --resume-if-any`` (a restarted container continues from the
    run's latest checkpoint), on the layout's learner GPUs."""
    cpu = isinstance(layout, CpuLayout)
    learner = {
        "image": "reval:cpu" if cpu else "reval:gpu",
        "build": CPU_BUILD if cpu else GPU_BUILD,
        "command": [
            "reval",
            "learner",
            "--config",
            _config(layout),
            "--resume-if-any",
            "--set",
            f"metrics.prometheus_port={LEARNER_METRICS_PORT}",
        ],
        "environment": {
            **REVAL_ENV,
            "REVAL__LEARNER__WORLD_SIZE": "1" if cpu else str(layout.learner_gpus),
            "REVAL__SYNC__BROADCAST_HOST": "auto",
            # The rollout services of this file: the run's desired worker count (the API's
            # reval_api_run_workers_desired, the RevalWorkersBelowDesired alert).
            "REVAL__LAUNCH__WORKERS": str(layout.workers if cpu else layout.rollout_gpus),
        },
        "restart": RESTART,
        # `docker stop` sends SIGTERM, then SIGKILL after this: time for the update in hand and
        # the checkpoint (the learner then exits 143; a stopped container is not restarted).
        "stop_grace_period": LEARNER_STOP_GRACE,
        "depends_on": dict(REDIS_HEALTHY),
        "healthcheck": _health(_http_health(LEARNER_METRICS_PORT), "15s", "5s", 20, "600s"),
    }
    return _on_node(learner, layout, [] if cpu else layout.learner_ids())


def _core(layout: Layout | CpuLayout) -> dict[str, Any]:
    """Redis, the API and the learner: the services every stack has."""
    return {"redis": _redis(), "api": _api(), "learner": _learner(layout)}


def _gpu_only(layout: Layout) -> dict[str, Any]:
    """The evaluation (profile ``eval``) and the Ray head (profile ``ray``) of a GPU node."""
    services: dict[str, Any] = {}
    if layout.eval_gpus:
        # The paper's evaluation while it trains: avg@16 on its seven benchmarks every 10 steps
        # (docker compose --profile eval up -d eval); benchmark files in ./data/benchmarks.
        evaluation = {
            "profiles": ["eval"],
            "image": "reval:gpu",
            "command": [
                "reval",
                "eval",
                "--config",
                _config(layout),
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
            "restart": RESTART,
            "depends_on": {**REDIS_HEALTHY, "learner": {"condition": "service_started"}},
        }
        services["eval"] = _on_node(evaluation, layout, layout.eval_ids())
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
    return services


def _monitoring(layout: Layout | CpuLayout) -> dict[str, Any]:
    """Prometheus, and Grafana on a GPU node (the CPU stack has none: Debian has no Grafana
    package for scripts/make_images.sh to stand in for its image, and its required admin
    password would be one more secret for the one command)."""
    grafana = {
        "image": GRAFANA_IMAGE,
        "environment": {
            "GF_SECURITY_ADMIN_PASSWORD": "${GRAFANA_ADMIN_PASSWORD:?set GRAFANA_ADMIN_PASSWORD}",
            "GF_AUTH_ANONYMOUS_ENABLED": "false",
        },
        "volumes": [
            "./deploy/grafana/provisioning:/etc/grafana/provisioning:ro",
            "./deploy/grafana/dashboards:/var/lib/grafana/dashboards:ro",
        ],
        "ports": [_port("REVAL_GRAFANA_PORT", 3000)],
        "restart": RESTART,
        "depends_on": {"prometheus": {"condition": "service_healthy"}},
    }
    prometheus = {
        "image": PROMETHEUS_IMAGE,
        "command": [
            "--config.file=/etc/prometheus/prometheus.yml",
            "--storage.tsdb.path=/prometheus",
        ],
        "volumes": ["./deploy/prometheus:/etc/prometheus:ro", "prometheus-data:/prometheus"],
        "ports": [_port("REVAL_PROMETHEUS_PORT", 9090)],
        "restart": RESTART,
        "healthcheck": _health(
            ["CMD", "wget", "-qO-", "http://127.0.0.1:9090/-/ready"], "10s", "5s", 10
        ),
    }
    if isinstance(layout, CpuLayout):
        return {"prometheus": prometheus}
    return {"prometheus": prometheus, "grafana": grafana}


def compose_dict(layout: Layout | CpuLayout) -> dict[str, Any]:
    """The compose file of ``layout`` as data."""
    services = _core(layout)
    if isinstance(layout, CpuLayout):
        for i in range(layout.workers):
            services[f"rollout-{i}"] = _rollout(layout, -1)
    else:
        for i, gpu in enumerate(layout.rollout_ids()):
            services[f"rollout-{i}"] = _rollout(layout, gpu)
        services |= _gpu_only(layout)
    services |= _monitoring(layout)
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


def _header(layout: Layout | CpuLayout) -> list[str]:
    """What the file holds and how to start it."""
    if isinstance(layout, CpuLayout):
        return [
            f"# Generated by `{layout.command()}`",
            "# (services/compose.py): edit the generator, not this file. reval on the CPU, one",
            '# command (docs/operations.md, "The CPU stack"):',
            "#   export REVAL_API_TOKEN=$(openssl rand -hex 24) "
            "REDIS_PASSWORD=$(openssl rand -hex 24)",
            "#   docker compose -f docker-compose.cpu.yml up -d --build   # Compose v2; or v1",
            "#   docker-compose -f docker-compose.cpu.yml up -d --build   # (Debian's 1.29)",
            f"# redis, api, learner and rollout-0 .. rollout-{layout.workers - 1} (HF on the CPU)",
            "# train configs/${REVAL_CONFIG:-demo.toml}; watch it with `reval runs get run` (the",
            "# API on 127.0.0.1:8080) and Prometheus on 127.0.0.1:9090 (no Grafana here). Without",
            "# a registry: scripts/make_images.sh, then the REVAL_*_IMAGE variables it prints.",
            "# More workers: reval compose --cpu --workers N --out FILE, at the repository root.",
            "# tests/docker/test_stack.py runs this file under Docker (make test-docker).",
            *SANDBOX_NOTE,
        ]
    learner = ",".join(map(str, layout.learner_ids()))
    rollout = ", ".join(f"rollout-{i} on {g}" for i, g in enumerate(layout.rollout_ids()))
    evals = ",".join(map(str, layout.eval_ids()))
    return [
        f"# Generated by `{layout.command()}`",
        "# (services/compose.py): edit the generator, not this file. reval on one GPU node:",
        "#   export REVAL_API_TOKEN=$(openssl rand -hex 24) REDIS_PASSWORD=$(openssl rand -hex 24)",
        "#   export GRAFANA_ADMIN_PASSWORD=...",
        "#   reval doctor --config configs/${REVAL_CONFIG:-r1_distill_qwen_1p5b.toml}  # preflight",
        "#   docker compose up -d --build   # redis, api, learner, rollout workers, prometheus, "
        "grafana",
        "#   (Compose v2; with v1, Debian's docker-compose 1.29: docker-compose up -d --build)",
        f"# GPUs: learner on {learner} (an FSDP2 rank per GPU), {rollout}"
        + (f", eval (--profile eval) {evals}." if layout.eval_gpus else "."),
        "# Another layout: reval compose --gpus N --learner-gpus L [--eval-gpus E] --out FILE, at",
        "# the repository root. REVAL_CONFIG picks the preset, REVAL_RUN the run's name; runs",
        "# created over REST go to the Ray head of the `ray` profile with",
        "# REVAL_RAY_ADDRESS=ray-head:6380. The API on 127.0.0.1:8080, Grafana on",
        "# 127.0.0.1:3000, Prometheus on 127.0.0.1:9090. With sync.broadcast on, the learner",
        "# announces its weight hub at its container's address (REVAL__SYNC__BROADCAST_HOST=auto).",
        "# Everything but the GPUs is what docker-compose.cpu.yml runs under Docker in",
        "# tests/docker/test_stack.py; tests/e2e/test_compose.py starts the commands locally.",
        *SANDBOX_NOTE,
    ]


def compose_text(layout: Layout | CpuLayout) -> str:
    """The compose file of ``layout``, with a header that says what it holds."""
    header = _header(layout)
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
        help="write the compose file for this node's GPUs (device_ids pinned per service), "
        "or with --cpu the CPU stack's",
    )
    c.add_argument("--gpus", type=int, help="GPUs on the node")
    c.add_argument(
        "--learner-gpus",
        type=int,
        help="GPUs of the learner (one FSDP2 rank each); the rest run one rollout worker each",
    )
    c.add_argument(
        "--eval-gpus",
        type=int,
        default=0,
        help="GPUs of the `eval` profile's service, the last ones (0: no eval service)",
    )
    c.add_argument(
        "--cpu",
        action="store_true",
        help="the CPU stack instead: everything on the CPU (docker-compose.cpu.yml)",
    )
    c.add_argument(
        "--workers",
        type=int,
        default=CPU_LAYOUT.workers,
        help=f"--cpu: HF rollout workers, one service each (default {CPU_LAYOUT.workers})",
    )
    c.add_argument(
        "--out",
        default="-",
        help="where to write it (default: stdout); at the "
        "repository root, since its paths are relative to the file",
    )


def _layout(args: argparse.Namespace) -> Layout | CpuLayout:
    if args.cpu:
        if args.gpus is not None or args.learner_gpus is not None or args.eval_gpus:
            raise ValueError("--cpu takes --workers, not --gpus/--learner-gpus/--eval-gpus")
        return CpuLayout(args.workers)
    if args.gpus is None or args.learner_gpus is None:
        raise ValueError("give --gpus and --learner-gpus (or --cpu for the CPU stack)")
    if args.workers != CPU_LAYOUT.workers:
        raise ValueError("--workers is for --cpu: on a GPU node each worker has its own GPU")
    return Layout(args.gpus, args.learner_gpus, args.eval_gpus)


def main(args: argparse.Namespace) -> int:
    try:
        layout = _layout(args)
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
