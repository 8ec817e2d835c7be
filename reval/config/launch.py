"""The config sections of how a run's processes are placed, connected and watched: weight
transport (``sync``), ``reval launch``'s Ray resources (``launch``), what is recorded
(``metrics``), the run's Redis (``redis``); and ``ApiConfig``, the config of ``reval serve``
(not part of a run's)."""

from __future__ import annotations

import importlib.util
import math
import os
from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal, get_origin

from pydantic import BaseModel, ConfigDict, Field, field_validator

from reval.config.base import _Section


class SyncConfig(_Section):
    """Weight transport from the learner to the generators."""

    every: int = Field(1, ge=1)
    """Push weights after every this many updates."""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """torch.distributed backend: gloo on CPU, NCCL on GPU (``auto`` chooses)."""
    bucket_mb: float = Field(64.0, gt=0)
    """Size of the packed buckets a broadcast sends; never one round trip per tensor."""
    timeout_s: float = Field(60.0, gt=0)
    """Timeout of every collective; a dead worker never blocks the learner longer than this."""
    weights_dir: str | None = None
    """Shared directory of the file transport of weights (default: ``{run_dir}/weights``)."""
    broadcast: bool = False
    """Also broadcast every version over torch.distributed (gloo; packed buckets) to the workers
    that joined the learner's hub: faster than the shared directory, which stays the fallback
    and what newcomers read first."""
    broadcast_host: str = "127.0.0.1"
    """Address the workers reach the learner's hub at (announced in Redis, with the run's
    secret that joining needs). ``auto``: the learner's own address as other hosts see it (its Ray
    node's IP under Ray, else its host name resolved, as torch.distributed does): for workers in
    other containers or on other nodes (docker-compose.yml, deploy/k8s)."""
    broadcast_bind: str | None = None
    """Address the hub listens on (its store and its gloo sockets). Unset: the address of
    ``broadcast_host`` (loopback by default; with ``auto`` the learner's own address, where
    the workers of other containers or nodes reach it), never every interface unless set to
    ``0.0.0.0``."""
    broadcast_port: int = Field(0, ge=0, le=65535)
    """Port of the hub (0: any free port; it is announced in Redis)."""
    serve_files: bool = False
    """Also serve the weight files over HTTP from the learner (rank 0), at the address of
    ``sync.broadcast_host`` (announced in Redis with the run's secret): workers on hosts that do
    not share ``sync.weights_dir`` fetch each version's file (a late joiner its first) into a
    directory of their own (``reval/weights/http_files.py``). A shared directory stays an
    option: a file a worker's host sees is read where it is."""
    files_port: int = Field(0, ge=0, le=65535)
    """Port of the file server (0: any free port; it is announced in Redis)."""


class LaunchConfig(_Section):
    """``reval launch``: the whole run on Ray (a local Ray, or the cluster at ``RAY_ADDRESS``)."""

    workers: int = Field(2, ge=0)
    """Rollout workers to start (``reval launch --add/--remove`` change it during the run)."""
    learner_cpus: Annotated[float, Field(gt=0)] | Literal["auto"] = "auto"
    """CPUs reserved for each learner rank (a Ray actor's ``num_cpus``: its thread budget,
    ``reval/threads.py``). ``"auto"``: on a local Ray, an even share of the machine's CPUs
    between the learner's ranks and the workers ``reval launch`` starts (see ``cpus``); on a
    cluster, 1."""
    learner_gpus: float = Field(0.0, ge=0)
    """GPUs reserved for each learner rank (1 on a GPU node)."""
    rollout_cpus: Annotated[float, Field(gt=0)] | Literal["auto"] = "auto"
    """CPUs reserved for each rollout worker. ``"auto"``: on a local Ray, what the learner's
    ranks leave of the machine's CPUs, shared evenly between the workers (see ``cpus``); on a
    cluster, 1."""
    rollout_gpus: float = Field(0.0, ge=0)
    """GPUs reserved for each rollout worker (1 for a vLLM worker on a GPU node)."""
    learner_resources: dict[str, Annotated[float, Field(gt=0)]] = Field(default_factory=dict)
    """Ray custom resources each learner rank takes (``{learner_host = 1}``: the ranks go only
    to nodes started with ``ray start --resources='{"learner_host": 8}'``; docs/operations.md,
    "Many machines")."""
    rollout_resources: dict[str, Annotated[float, Field(gt=0)]] = Field(default_factory=dict)
    """Ray custom resources each rollout worker takes (``{rollout_host = 1}``: workers only on
    the nodes that offer it)."""
    placement: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    """Placement-group strategy of the learner ranks (PACK keeps them on one node if it can)."""
    replace_dead_workers: bool = True
    """Start a new rollout worker in place of one that died (not of one removed on purpose)."""
    max_learner_restarts: int = Field(3, ge=0)
    """Restarts of the learner (all ranks, from the latest checkpoint) after a rank died."""
    namespace: str = "reval"
    """Ray namespace of the run's named control actor (``reval launch --add`` finds it there)."""
    local_cpus: int | None = Field(None, ge=1)
    """Logical CPUs of a local Ray (default: enough for the learner and the workers, at least
    the machine's cores); ignored when joining an existing cluster."""
    stop_timeout_s: float = Field(60.0, gt=0)
    """How long stopping waits for workers to drain and the learner to checkpoint."""
    metrics_port: int | None = Field(None, ge=0, le=65535)
    """The driver's ``/metrics``, ``/healthz``, ``/readyz`` (at ``metrics.addr``; None: off)."""

    def cpus(self, world_size: int, cores: int | None) -> tuple[float, float]:
        """``(learner rank, rollout worker)`` CPUs, ``learner_cpus`` and ``rollout_cpus`` with
        ``"auto"`` resolved for a local Ray on a machine of ``cores`` CPUs (``local_cpus`` if
        set): both ``"auto"``, an even share between the ``world_size`` ranks and the
        ``workers``; one set, the other role shares what it leaves; whole CPUs, at least 1 (on
        a machine with fewer CPUs than processes, 1 each: the thread tuner copes). ``cores``
        None (a cluster, whose nodes are not known here): 1 each."""
        if cores is None:
            learner = 1.0 if self.learner_cpus == "auto" else float(self.learner_cpus)
            return learner, 1.0 if self.rollout_cpus == "auto" else float(self.rollout_cpus)
        cores = self.local_cpus or cores
        rollout = None if self.rollout_cpus == "auto" else float(self.rollout_cpus)
        if self.learner_cpus != "auto":
            learner = float(self.learner_cpus)
        elif rollout is not None:  # the ranks share what the workers leave
            learner = float(max(1, math.floor((cores - self.workers * rollout) / world_size)))
        else:
            learner = float(max(1, cores // (world_size + self.workers)))
        if rollout is not None:
            return learner, rollout
        left = cores - world_size * learner
        return learner, float(max(1, int(left // self.workers) if self.workers else int(left)))

    def local_ray_cpus(self, world_size: int, cores: int) -> int:
        """The logical CPUs of the local Ray ``reval launch`` starts: ``local_cpus``, else
        enough for the learner ranks and the workers with two to spare, at least ``cores``."""
        learner, rollout = self.cpus(world_size, cores)
        need = world_size * learner + (self.workers + 2) * rollout
        return self.local_cpus or max(int(need + 0.999), cores)

    def local_ray_room(self, world_size: int, cores: int) -> int:
        """How many rollout workers (CPUs only) that local Ray has room for beside the learner."""
        learner, rollout = self.cpus(world_size, cores)
        free = self.local_ray_cpus(world_size, cores) - world_size * learner
        return max(0, int(free / rollout + 1e-9))


TRACKERS = {
    "tensorboard": "tensorboard",
    "wandb": "wandb",
    "mlflow": "mlflow",
    "trackio": "trackio",
}
"""The experiment trackers that exist (``reval/trackers.py``), each with the module it needs
(installed by the extra ``reval[name]``)."""


def check_trackers(names: list[str]) -> list[str]:
    """``names`` without repeats, or ValueError (one line) naming a tracker that is unknown
    or not installed (with its install line)."""
    out: list[str] = []
    for name in names:
        if name not in TRACKERS:
            raise ValueError(f"unknown tracker {name!r}; known: {', '.join(TRACKERS)}")
        if name not in out:
            out.append(name)
    require_installed(out)
    return out


def require_installed(names: list[str]) -> None:
    """ValueError with the install line when a named tracker's library is not importable
    (looked up, not imported: the config stays light)."""
    for name in names:
        if importlib.util.find_spec(TRACKERS[name]) is None:
            raise ValueError(
                f"the {name} tracker needs {TRACKERS[name]}, which is not installed: "
                f"pip install 'reval[{name}]'"
            )


class WandbConfig(_Section):
    """The ``wandb`` tracker (Weights & Biases). The key is ``WANDB_API_KEY`` from the
    environment (or ``wandb login``'s), never the config: nothing secret is written to the run
    directory. The run's W&B id is kept in ``{run_dir}/trackers.json``: a resumed run continues
    the same W&B run."""

    project: str | None = None
    """W&B project (None: ``WANDB_PROJECT``, else the run's ``name``)."""
    entity: str | None = None
    """W&B entity, the user or team that owns the project (None: ``WANDB_ENTITY``, else the
    key's default entity)."""
    run_name: str | None = None
    """The W&B run's display name (None: the run's ``name``)."""
    tags: list[str] = Field(default_factory=list)
    """Tags of the W&B run."""
    mode: Literal["online", "offline"] | None = None
    """``offline``: write the run under ``{run_dir}/wandb`` only (``wandb sync`` uploads it
    later); ``online``: also stream it to the server. None: ``WANDB_MODE``, else online."""


class MlflowConfig(_Section):
    """The ``mlflow`` tracker. Credentials of a remote server come from the environment
    (``MLFLOW_TRACKING_TOKEN``, ``MLFLOW_TRACKING_USERNAME``/``PASSWORD``), never the config.
    The run's MLflow id is kept in ``{run_dir}/trackers.json``: a resumed run continues the
    same MLflow run."""

    tracking_uri: str | None = None
    """Where runs are recorded (``http://host:5000``, ``file:///path``, ``sqlite:///db``).
    None: ``MLFLOW_TRACKING_URI``, else a file store in ``{run_dir}/mlruns``."""
    experiment: str | None = None
    """The MLflow experiment (made if missing; None: the run's ``name``)."""
    run_name: str | None = None
    """The MLflow run's name (None: the run's ``name``)."""
    tags: dict[str, str] = Field(default_factory=dict)
    """Tags of the MLflow run."""


class TrackioConfig(_Section):
    """The ``trackio`` tracker. Its runs go to Trackio's local store (``TRACKIO_DIR``, default
    ``~/.cache/huggingface/trackio``; ``trackio show``) or a Hugging Face Space (the token from
    the environment, never the config). The run's name is kept in ``{run_dir}/trackers.json``:
    a resumed run continues the same Trackio run."""

    project: str | None = None
    """The Trackio project (None: the run's ``name``)."""
    run_name: str | None = None
    """The Trackio run's name (None: the run's ``name``)."""
    space_id: str | None = None
    """A Hugging Face Space to log to (``user/space``; None: the local store only)."""


class MetricsConfig(_Section):
    """What the run records."""

    jsonl: bool = True
    """Write one JSON line of metrics per round into ``metrics.jsonl`` in the run directory."""
    plot: bool = True
    """Draw the learning curve ``curve.png`` at the end of the run."""
    progress: bool = True
    """Show a progress bar (round, success rate, loss)."""
    prometheus_port: int | None = Field(None, ge=0, le=65535)
    """Serve Prometheus metrics (and ``/healthz``, ``/readyz``) on this port (``None``: off)."""
    addr: str = "127.0.0.1"
    """Address of that endpoint (``0.0.0.0`` in a container, for Prometheus to scrape)."""
    log_every: int = Field(10, ge=0)
    """``reval learner``: a log line every this many updates (step, loss, batch reward, the wait
    for data, updates and trajectories per second since the last line; 0: none; ``--verbose``:
    every update)."""
    trackers: list[str] = Field(default_factory=list)
    """Experiment trackers that also get every row of ``metrics.jsonl`` (``reval train``) or
    ``learner.jsonl`` (the learner's rank 0) at its step, the policy version, the resolved
    config, ``reval train``'s evaluation answers, curve and summary, and the learner's final
    state: ``tensorboard``, ``wandb``, ``mlflow``, ``trackio`` (each
    ``pip install 'reval[NAME]'``; docs/metrics.md, "Trackers")."""
    tracker_answers: int = Field(default=16, ge=0)
    """How many of an evaluation's answers (each prompt's first: prompt, answer, score) go to
    the trackers as a table (``eval/answers``) at the evaluation's step; 0: none."""
    tensorboard_dir: str | None = None
    """Where the ``tensorboard`` tracker writes its event files (default:
    ``{run_dir}/tensorboard``)."""
    wandb: WandbConfig = Field(default_factory=WandbConfig)
    """The ``wandb`` tracker's project, entity, run name, tags and mode."""
    mlflow: MlflowConfig = Field(default_factory=MlflowConfig)
    """The ``mlflow`` tracker's tracking URI, experiment, run name and tags."""
    trackio: TrackioConfig = Field(default_factory=TrackioConfig)
    """The ``trackio`` tracker's project, run name and Space."""

    @field_validator("trackers")
    @classmethod
    def _known_trackers(cls, value: list[str]) -> list[str]:
        return check_trackers(value)


class RedisConfig(_Section):
    """The run's Redis: the replay service, the control channel, the weights announcement, the
    worker registry (every key: ``reval/redis.py``)."""

    url: str = "redis://127.0.0.1:6379/0"
    """Where Redis lives (``redis://[user:password@]host:port/db``, ``rediss://`` for TLS). The
    password is redacted wherever the config is written."""
    prefix: str = "reval:"
    """Every key of a run is ``{prefix}{{run}}:...``, the run's name in braces (a Redis Cluster
    hash tag: one slot per run); runs are isolated (docs/architecture.md)."""
    outage_s: float = Field(600.0, gt=0)
    """How long every process (learner, workers) rides out Redis being unreachable or refusing
    writes (MISCONF: its disk is full, OOM, READONLY) before it gives up: it logs once when it
    starts waiting and once when Redis is back; workers keep their batches in the spool."""


class ApiConfig(BaseModel):
    """``reval serve``: the REST control plane (not part of a run's config: it serves many)."""

    model_config = ConfigDict(extra="forbid")

    host: str = "127.0.0.1"
    """Listen address; loopback unless set (``0.0.0.0`` in a container)."""
    port: int = Field(8080, ge=0, le=65535)
    redis_url: str = "redis://127.0.0.1:6379/0"
    """The replay service's Redis: the API keeps its state there (it may restart any time).
    Password and TLS go in the URL (``rediss://:password@host:6380/0``)."""
    key_prefix: str = "reval:"
    """Key prefix of the runs this API manages (their ``redis.prefix``)."""
    output_dir: str = "runs"
    """Run directories of the runs it starts. A POSTed config's ``output_dir`` and
    ``sync.weights_dir`` must lie under it (a run writes, and resumes by unpickling, there)."""
    models_dir: str | None = None
    """The directory a POSTed config may read local files from: model checkpoints
    (``model.name_or_path``), datasets (``task.dataset``) and reward or environment files
    (``task.reward``/``task.environment`` = ``file.py:name``); anything else must be a hub id
    (``NAME`` or ``ORG/NAME``). None: hub ids only. ``--models-dir``,
    ``REVAL_API__MODELS_DIR``."""
    plugins: list[str] = Field(default_factory=list)
    """Installed code a POSTed ``task.reward`` or ``task.environment`` may name by module,
    beyond the built-in graders (``reval.plugins.BUILTIN_PLUGINS``) and environments:
    ``pkg.mod:name``, or ``pkg.mod:*`` for the names of the module's ``__all__`` (without one,
    the public names it defines itself). Nothing else is imported over REST
    (``reval train`` and the CLI take any import path). ``--plugin`` (repeatable),
    ``REVAL_API__PLUGINS`` (comma-separated)."""

    token_env: str = "REVAL_API_TOKEN"
    """Environment variable holding the bearer token of mutating requests."""
    dev: bool = False
    """Development mode: allows an empty or default token (never in production)."""
    auth_reads: bool | None = None
    """Require the token on read endpoints (``GET /v1/runs...``, ``/docs``,
    ``/openapi.json``). None: yes whenever ``host`` is not a loopback address."""
    open_metrics: bool | None = None
    """``/metrics`` without the token. None: open on a loopback ``host``, token-guarded
    otherwise (a Prometheus in another container needs ``--open-metrics``, or the token)."""
    pass_env: list[str] = Field(default_factory=list)
    """Environment variables the runs it launches inherit beyond the built-in list
    (``services/api/runs.py: run_env``); ``NAME`` or ``PREFIX*``. Its own token never."""
    max_body_bytes: int = Field(1 << 20, ge=1024)
    """Largest request body accepted (413 beyond)."""
    ray_address: str | None = None
    """Where launched runs go (``RAY_ADDRESS`` of their ``reval launch``); None: a local Ray
    per run."""

    ENV: ClassVar[str] = "REVAL_API__"
    """``REVAL_API__<FIELD>`` sets a field (``ApiConfig.load``); lists are comma-separated."""

    def loopback(self) -> bool:
        """Whether ``host`` is a loopback address (only this machine can connect)."""
        import ipaddress

        if self.host.lower() == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host.strip("[]")).is_loopback
        except ValueError:
            return False  # a host name: it may resolve to anything

    def reads_need_token(self) -> bool:
        return self.auth_reads if self.auth_reads is not None else not self.loopback()

    def metrics_need_token(self) -> bool:
        return not self.open_metrics if self.open_metrics is not None else not self.loopback()

    @classmethod
    def load(cls, given: Mapping[str, Any], env: Mapping[str, str] | None = None) -> ApiConfig:
        """The config of ``reval serve``: ``given`` (its flags; None: not given) over
        ``REVAL_API__<FIELD>`` variables over the defaults. Raises pydantic's ValidationError."""
        env = os.environ if env is None else env
        fields: dict[str, Any] = {}
        for name, field in cls.model_fields.items():
            raw = env.get(cls.ENV + name.upper())
            if raw is None:
                continue
            listed = get_origin(field.annotation) is list
            fields[name] = [p.strip() for p in raw.split(",") if p.strip()] if listed else raw
        fields.update({k: v for k, v in given.items() if v is not None})
        return cls(**fields)

    @field_validator("plugins")
    @classmethod
    def _plugin_entries(cls, value: list[str]) -> list[str]:
        from reval.plugins import split_spec

        for entry in value:
            split_spec(entry, wildcard=True)  # (a malformed entry: said at start, not per request)
        return [e.strip() for e in value]
