"""``reval doctor``: a preflight for the node a run is about to start on.

It checks what a long GPU run otherwise finds out hours in: CUDA and NCCL, that the node has the
GPUs the config reserves, shared memory for NCCL and vLLM, that the ports the run binds are free,
that the replay service's Redis answers, the vLLM release (the adapter's own gate,
``rollout.vllm_engine.check_vllm_version``), that a GPU run has a token budget (a warning: it
runs without one, padded), free disk for checkpoints, the thread budget of each role
(``reval/threads.py``), and with ``model.lora`` the learner's memory against full
fine-tuning. Every failing or warning check says what to change; the exit status is 1 when
any check failed.

The checks are pure functions of :class:`Facts` (what the node has), which :func:`gather` reads
from the machine; tests hand them made-up facts.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import socket
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from learner.memory import ModelShape, adapter_params, state_bytes
from reval.config import ConfigError, RunConfig, load_config
from reval.threads import ThreadBudget, budget, machine_cpus

SHM_MIN_BYTES = 1 << 30
"""Below this /dev/shm NCCL's shared-memory transport and vLLM's worker processes fail their
first large transfer (Docker's default is 64 MB; ``reval compose`` sets ``shm_size``)."""
CHECKPOINTS_KEPT = 2
"""Free disk asked for: room for this many checkpoints (the one being written and the last)."""


def checkpoint_bytes_per_param(cfg: RunConfig) -> int:
    """A learner checkpoint holds the fp32 master weights and AdamW's two fp32 moments (12 bytes
    a parameter) and the frozen reference in the compute dtype (``model.dtype``: 2 bytes in
    bf16/fp16, 4 in fp32): 14 bytes a parameter for the GPU presets, about 21 GB for a 1.5B
    model and 98 GB for a 7B one."""
    return 12 + (4 if cfg.model.dtype == "float32" else 2)


UNKNOWN_CHECKPOINT_BYTES = 100 << 30
"""Checkpoint size assumed when the model's weights are not on this disk to measure and its
name does not say its size."""

Status = Literal["ok", "warn", "fail", "skip"]
"""``warn``: the run works but wastes the node (it does not fail the doctor)."""


@dataclass
class Check:
    name: str
    status: Status
    message: str


@dataclass
class Facts:
    """What the node has (read by :func:`gather`; made up in tests)."""

    cuda_available: bool
    torch_version: str
    cuda_version: str | None
    """``torch.version.cuda``: None for a CPU build of torch."""
    nccl_version: str | None
    gpu_count: int
    shm_bytes: int | None
    """Size of /dev/shm (None: there is none)."""
    disk_free_bytes: int
    disk_path: str
    vllm_version: str | None
    """None: vLLM is not installed."""
    ports_in_use: dict[int, str] = field(default_factory=dict)
    """Port -> the error binding it gave (only ports that could not be bound)."""
    threads: list[ThreadBudget] = field(default_factory=list)
    """The thread budget of each role on this node (:func:`thread_budgets`)."""
    model_shape: ModelShape | None = None
    """The policy's shape, when its ``config.json`` is on this disk (:func:`model_shape`)."""


def needs_gpu(cfg: RunConfig) -> bool:
    """Whether the config runs on GPUs (a CPU run skips the GPU checks)."""
    lc = cfg.launch
    return cfg.model.device == "cuda" or lc.learner_gpus > 0 or lc.rollout_gpus > 0


def gpus_needed(cfg: RunConfig) -> int:
    """GPUs the run reserves on this node: a learner rank per GPU (at least one each when the
    model is on CUDA) and ``launch.rollout_gpus`` per rollout worker."""
    lc = cfg.launch
    per_rank = lc.learner_gpus or (1.0 if cfg.model.device == "cuda" else 0.0)
    return math.ceil(cfg.learner.world_size * per_rank + lc.workers * lc.rollout_gpus)


def ports(cfg: RunConfig) -> dict[int, str]:
    """The fixed ports the run's processes bind on this node, with the field that sets each."""
    out: dict[int, str] = {}
    if cfg.metrics.prometheus_port:
        out[cfg.metrics.prometheus_port] = "metrics.prometheus_port"
    if cfg.sync.broadcast and cfg.sync.broadcast_port:
        out[cfg.sync.broadcast_port] = "sync.broadcast_port"
    if cfg.launch.metrics_port:
        out[cfg.launch.metrics_port] = "launch.metrics_port"
    return out


def checkpoint_bytes(cfg: RunConfig) -> int:
    """One learner checkpoint's size (``checkpoint_bytes_per_param``), the parameters counted
    from the model's local weight files (2 bytes each in bf16/fp16, 4 in fp32), else read from a
    hub id's name (``…-1.5B``)."""
    path = cfg.model.name_or_path
    if path is None:
        return 1 << 30  # a tiny model the project builds itself
    files = list(Path(path).glob("*.safetensors")) if Path(path).is_dir() else []
    if not files:  # a hub id: its size from its name (…-1.5B, …-7B), if it says
        named = re.findall(r"(?<![0-9.])([0-9]+(?:\.[0-9]+)?)[Bb](?![A-Za-z0-9])", Path(path).name)
        if named:
            return int(float(named[-1]) * 1e9) * checkpoint_bytes_per_param(cfg)
        return UNKNOWN_CHECKPOINT_BYTES
    stored = sum(f.stat().st_size for f in files)
    bytes_per_param = 4 if cfg.model.dtype == "float32" else 2
    return stored // bytes_per_param * checkpoint_bytes_per_param(cfg)


def _gb(n: float) -> str:
    return f"{n / (1 << 30):.1f} GiB"


# -- the checks --------------------------------------------------------------------------------


def check_cuda(cfg: RunConfig, f: Facts) -> Check:
    if f.cuda_available:
        return Check("cuda", "ok", f"torch {f.torch_version}, CUDA {f.cuda_version}")
    why = (
        f"torch {f.torch_version} is a CPU build (torch.version.cuda is None)"
        if f.cuda_version is None
        else f"torch {f.torch_version} (CUDA {f.cuda_version}) sees no GPU"
    )
    if not needs_gpu(cfg):
        return Check("cuda", "skip", f"no CUDA: {why}; the config runs on the CPU")
    return Check(
        "cuda",
        "fail",
        f"no CUDA: {why}. Install a CUDA build of torch (the reval:gpu image has one), check "
        "the NVIDIA driver (nvidia-smi) and the container's GPU reservation, or run on the CPU "
        "with model.device=cpu and launch.learner_gpus=launch.rollout_gpus=0",
    )


def check_nccl(cfg: RunConfig, f: Facts) -> Check:
    if not f.cuda_available:
        status: Status = "fail" if needs_gpu(cfg) else "skip"
        return Check("nccl", status, "no CUDA: NCCL needs a GPU (see the cuda check)")
    if f.nccl_version is None:
        return Check(
            "nccl",
            "fail",
            "torch has no NCCL: the learner's ranks and the weight broadcast need it; install "
            "the CUDA build of torch from pytorch.org (the reval:gpu image)",
        )
    return Check("nccl", "ok", f"NCCL {f.nccl_version}")


def check_gpu_count(cfg: RunConfig, f: Facts) -> Check:
    need = gpus_needed(cfg)
    how = (
        f"learner.world_size {cfg.learner.world_size} x launch.learner_gpus "
        f"{cfg.launch.learner_gpus} + launch.workers {cfg.launch.workers} x "
        f"launch.rollout_gpus {cfg.launch.rollout_gpus}"
    )
    if not f.cuda_available:
        status: Status = "fail" if needs_gpu(cfg) else "skip"
        return Check("gpus", status, f"no CUDA: 0 GPUs visible, the config needs {need} ({how})")
    if cfg.model.device == "cuda" and cfg.launch.learner_gpus == 0:
        return Check(
            "gpus",
            "fail",
            "model.device=cuda but launch.learner_gpus=0: `reval launch` would give the learner "
            "ranks no GPU; set launch.learner_gpus=1 (and launch.rollout_gpus=1 for vLLM workers)",
        )
    if f.gpu_count < need:
        return Check(
            "gpus",
            "fail",
            f"{f.gpu_count} GPUs visible, the config needs {need} ({how}): lower "
            "learner.world_size or launch.workers, or check CUDA_VISIBLE_DEVICES",
        )
    return Check("gpus", "ok", f"{f.gpu_count} GPUs visible, the config needs {need} ({how})")


def check_shm(cfg: RunConfig, f: Facts) -> Check:
    if f.shm_bytes is None:
        return Check("shm", "fail", "no /dev/shm: NCCL and vLLM need shared memory")
    if f.shm_bytes < SHM_MIN_BYTES:
        return Check(
            "shm",
            "fail",
            f"/dev/shm is {_gb(f.shm_bytes)}, below {_gb(SHM_MIN_BYTES)}: NCCL and vLLM fail "
            "their first large transfer. Give the container more (docker run --shm-size=16g, "
            "compose shm_size: 16gb as `reval compose` writes, or ipc: host)",
        )
    return Check("shm", "ok", f"/dev/shm {_gb(f.shm_bytes)}")


def check_ports(cfg: RunConfig, f: Facts) -> Check:
    wanted = ports(cfg)
    if not wanted:
        return Check("ports", "skip", "the config binds no fixed port")
    busy = [f"{p} ({wanted[p]}: {f.ports_in_use[p]})" for p in wanted if p in f.ports_in_use]
    if busy:
        return Check(
            "ports",
            "fail",
            f"in use: {', '.join(busy)}. Stop what holds it (ss -ltnp) or set that field to a "
            "free port",
        )
    return Check("ports", "ok", "free: " + ", ".join(f"{p} ({n})" for p, n in wanted.items()))


def check_redis(cfg: RunConfig, error: str | None) -> Check:
    if cfg.buffer.backend != "redis":
        return Check("redis", "skip", "buffer.backend=memory: no Redis")
    url = cfg.redis.url
    if error is not None:
        return Check(
            "redis",
            "fail",
            f"cannot reach Redis at {url}: {error}. Start it (docker compose up -d redis, or "
            "scripts/ensure_redis.sh) or set redis.url (REVAL__REDIS__URL; the old way, to set "
            "buffer.redis_url, still works but is deprecated)",
        )
    return Check("redis", "ok", f"{url} answers PING")


def check_vllm(cfg: RunConfig, f: Facts) -> Check:
    if cfg.rollout.engine != "vllm":
        return Check("vllm", "skip", "rollout.engine=hf: no vLLM")
    if f.vllm_version is None:
        return Check(
            "vllm",
            "fail",
            "rollout.engine=vllm but vLLM is not installed: pip install 'reval[gpu]' (the "
            "reval:gpu image), make venv-vllm on the CPU, or set rollout.engine=hf",
        )
    from rollout.vllm_engine import check_vllm_version

    try:
        check_vllm_version(f.vllm_version)
    except ImportError as err:
        return Check("vllm", "fail", str(err))
    return Check("vllm", "ok", f"vLLM {f.vllm_version}")


def check_token_budget(cfg: RunConfig, f: Facts) -> Check:
    """A GPU run without a token budget pads every micro-batch to its longest answer: on RL
    lengths (answers log-normal around 2k tokens, up to 8k) that computes 2.2x the useful tokens
    (``benchmarks/learner_gpu_bench.py``; docs/learner.md "Packed sequences")."""
    if not needs_gpu(cfg):
        return Check("tokens", "skip", "a CPU run: padding costs little at its lengths")
    budget = cfg.learner.max_tokens_per_micro_batch
    if budget is None:
        return Check(
            "tokens",
            "warn",
            f"learner.max_tokens_per_micro_batch is unset: micro-batches of "
            f"{cfg.learner.micro_batch_size} are padded to their longest answer (about 2.2x the "
            "useful tokens on RL lengths); set it, e.g. 16384 as the GPU presets do, and "
            "micro-batches are packed to it",
        )
    return Check("tokens", "ok", f"{budget} tokens per micro-batch, packing={cfg.learner.packing}")


def check_disk(cfg: RunConfig, f: Facts) -> Check:
    need = CHECKPOINTS_KEPT * checkpoint_bytes(cfg)
    if f.disk_free_bytes < need:
        return Check(
            "disk",
            "fail",
            f"{_gb(f.disk_free_bytes)} free at {f.disk_path}, the run's checkpoints want "
            f"{_gb(need)} ({CHECKPOINTS_KEPT} of ~{_gb(need / CHECKPOINTS_KEPT)}): free space, "
            "or set output_dir on a larger disk",
        )
    return Check("disk", "ok", f"{_gb(f.disk_free_bytes)} free at {f.disk_path} (want {_gb(need)})")


def model_shape(cfg: RunConfig) -> ModelShape | None:
    """The shape of a local checkpoint (its ``config.json``), its parameters counted from it
    (embeddings, the decoder layers' linear layers and norms); None without one."""
    path = cfg.model.name_or_path
    config = Path(path) / "config.json" if path else None
    if config is None or not config.is_file():
        return None
    try:
        c = json.loads(config.read_text())
        c.setdefault("num_key_value_heads", c.get("num_attention_heads"))
        shape = ModelShape.of(argparse.Namespace(**c), 0)
        vocab = int(c["vocab_size"])
    except (OSError, ValueError, KeyError, AttributeError, TypeError):
        return None  # (another layout, e.g. a multimodal config's text_config: no figures)
    layer = sum(i * o for i, o in shape.linears().values()) + 2 * shape.hidden
    embed = vocab * shape.hidden * (1 if c.get("tie_word_embeddings") else 2)
    params = embed + shape.layers * layer + shape.hidden
    return ModelShape(params, shape.layers, shape.hidden, shape.intermediate, shape.heads,
                      shape.kv_heads, shape.head_dim)  # fmt: skip


def check_lora(cfg: RunConfig, f: Facts) -> Check:
    """What the learner's state needs per rank with LoRA against full fine-tuning
    (``learner.memory.state_bytes``: no reference model, AdamW over the adapters only)."""
    lora = cfg.model.lora
    if not lora.enabled:
        return Check("lora", "skip", "model.lora.rank = 0: full fine-tuning")
    if f.model_shape is None:
        return Check("lora", "skip", f"rank {lora.rank}: the model's config.json is not on this "
                     "disk (a hub id or the tiny model): no memory figures")  # fmt: skip
    shape, world = f.model_shape, cfg.learner.world_size
    full = state_bytes(cfg.model_copy(update={"model": cfg.model.model_copy(
        update={"lora": lora.model_copy(update={"rank": 0})})}), shape, world)  # fmt: skip
    state = _gb(state_bytes(cfg, shape, world))
    return Check("lora", "ok", (
        f"rank {lora.rank}: {adapter_params(shape, lora):,} adapter parameters of "
        f"{shape.params:,}; learner state {state} per rank against {_gb(full)} for full "
        "fine-tuning (no reference model, AdamW over the adapters)"))  # fmt: skip


# -- the machine -------------------------------------------------------------------------------


def thread_budgets(cfg: RunConfig) -> list[ThreadBudget]:
    """What each role's process would use on this node: ``reval train``, a learner rank (the
    ranks split the CPUs) and a rollout worker started by hand or by compose, and the same two
    under ``reval launch`` (Ray actors of ``launch.learner_cpus`` and ``launch.rollout_cpus``; with
    ``"auto"``, the split of a local Ray on this machine, or of a cluster at ``RAY_ADDRESS``)."""
    cores = None if os.environ.get("RAY_ADDRESS") else machine_cpus()
    learner, rollout = cfg.launch.cpus(cfg.learner.world_size, cores)
    return [
        budget("train"),
        budget("learner rank", share=cfg.learner.world_size),
        budget("worker"),
        budget("learner rank (reval launch)", ray_num_cpus=learner),
        budget("worker (reval launch)", ray_num_cpus=rollout),
    ]


def check_threads(cfg: RunConfig, f: Facts) -> Check:
    """The thread budget of each role (information: it never fails)."""
    if not f.threads:
        return Check("threads", "skip", "no budget read")
    tuned = "; within it each process keeps the fastest count (reval/threads.py)"
    return Check("threads", "ok", "; ".join(f"{b.role}: {b.describe()}" for b in f.threads)
                 + tuned)  # fmt: skip


def _existing(path: Path) -> Path:
    path = path.resolve()
    while not path.exists():
        path = path.parent
    return path


def _port_error(port: int, addr: str) -> str | None:
    with socket.socket() as s:
        try:
            s.bind((addr, port))
        except OSError as err:
            return err.strerror or str(err)
    return None


def gather(cfg: RunConfig) -> Facts:
    """Read the facts the checks need from this machine."""
    import torch

    cuda = torch.cuda.is_available()
    nccl = None
    if cuda and torch.distributed.is_nccl_available():
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
    try:
        shm: int | None = shutil.disk_usage("/dev/shm").total
    except OSError:
        shm = None
    disk = _existing(Path(cfg.output_dir))
    try:
        from importlib.metadata import PackageNotFoundError, version

        vllm: str | None = version("vllm")
    except PackageNotFoundError:
        vllm = None
    busy = {p: e for p in ports(cfg) if (e := _port_error(p, cfg.metrics.addr)) is not None}
    return Facts(
        cuda_available=cuda,
        torch_version=torch.__version__,
        cuda_version=torch.version.cuda,
        nccl_version=nccl,
        gpu_count=torch.cuda.device_count() if cuda else 0,
        shm_bytes=shm,
        disk_free_bytes=shutil.disk_usage(disk).free,
        disk_path=str(disk),
        vllm_version=vllm,
        ports_in_use=busy,
        threads=thread_budgets(cfg),
        model_shape=model_shape(cfg),
    )


def redis_error(cfg: RunConfig, timeout_s: float = 3.0) -> str | None:
    """Why Redis at ``redis.url`` does not answer PING (None: it does)."""
    if cfg.buffer.backend != "redis":
        return None
    import redis

    from reval.redis import connect

    try:
        client = connect(cfg.redis.url, timeout_s=timeout_s, connect_timeout_s=timeout_s)
        client.ping()
        client.close()
    except (redis.RedisError, ValueError, OSError) as err:
        return f"{type(err).__name__}: {str(err).rstrip('.')}"
    return None


def run_checks(cfg: RunConfig, facts: Facts, redis_err: str | None) -> list[Check]:
    return [
        check_cuda(cfg, facts),
        check_nccl(cfg, facts),
        check_gpu_count(cfg, facts),
        check_shm(cfg, facts),
        check_ports(cfg, facts),
        check_redis(cfg, redis_err),
        check_vllm(cfg, facts),
        check_token_budget(cfg, facts),
        check_disk(cfg, facts),
        check_threads(cfg, facts),
        check_lora(cfg, facts),
    ]


def add_parser(sub: Any) -> None:
    d = sub.add_parser("doctor", help="preflight this node for a run: CUDA, NCCL, GPUs, shared "
                       "memory, ports, Redis, vLLM, disk")  # fmt: skip
    d.add_argument("--config", help="TOML config (default: configs/demo.toml)")
    d.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a field (repeatable), e.g. redis.url=...")  # fmt: skip
    d.add_argument("--json", action="store_true", help="one JSON object per check")


def main(args: argparse.Namespace) -> int:
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as err:
        print(f"reval doctor: {err}", file=sys.stderr)
        return 2
    checks = run_checks(cfg, gather(cfg), redis_error(cfg))
    for c in checks:
        if args.json:
            print(json.dumps(asdict(c)))
        else:
            print(f"{c.status:<4}  {c.name:<5}  {c.message}")
    failed = [c.name for c in checks if c.status == "fail"]
    warned = [c.name for c in checks if c.status == "warn"]
    if not args.json:
        said = f"{len(failed)} failed: {', '.join(failed)}" if failed else "all checks passed"
        print(said + (f" ({len(warned)} warned: {', '.join(warned)})" if warned else ""))
    return 1 if failed else 0
