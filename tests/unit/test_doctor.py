"""``reval doctor`` (services/doctor.py): each check fails on the node that would break a run,
with a message that names what to change, and passes on a good one (the facts are made up,
since this machine has no GPU); without CUDA the GPU checks say "no CUDA" (a failure for a GPU
config, a skip for a CPU one); the command end to end against the test Redis and a bad URL."""

from __future__ import annotations

import dataclasses
import json
import socket
from pathlib import Path

import pytest

from reval.config import load_config
from services import doctor
from services.cli import main
from services.doctor import Facts

ROOT = Path(__file__).resolve().parents[2]
GIB = 1 << 30


def gpu_cfg(*overrides: str):
    """The R1 preset: 4 learner ranks + 4 vLLM workers, one GPU each."""
    return load_config(str(ROOT / "configs" / "r1_distill_qwen_1p5b.toml"), list(overrides),
                       environ={})  # fmt: skip


def cpu_cfg(*overrides: str):
    return load_config(str(ROOT / "configs" / "demo.toml"), list(overrides), environ={})


def node(**changes) -> Facts:
    """A good 8-GPU node."""
    good = Facts(cuda_available=True, torch_version="2.13.0", cuda_version="12.8",
                 nccl_version="2.27.5", gpu_count=8, shm_bytes=64 * GIB,
                 disk_free_bytes=2000 * GIB, disk_path="/runs", vllm_version="0.32.1")  # fmt: skip
    return dataclasses.replace(good, **changes)


def statuses(cfg, facts: Facts, redis_err: str | None = None) -> dict[str, doctor.Check]:
    return {c.name: c for c in doctor.run_checks(cfg, facts, redis_err)}


def test_a_good_gpu_node_passes_every_check():
    got = statuses(gpu_cfg("buffer.backend=redis"), node())
    assert {n: c.status for n, c in got.items()} == {
        "cuda": "ok", "nccl": "ok", "gpus": "ok", "shm": "ok", "ports": "skip", "redis": "ok",
        "vllm": "ok", "tokens": "ok", "disk": "ok", "threads": "skip", "lora": "skip",
    }  # fmt: skip


def test_a_gpu_config_without_a_token_budget_is_warned_and_still_passes(capsys):
    check = doctor.check_token_budget(gpu_cfg("learner.max_tokens_per_micro_batch=null"), node())
    assert check.status == "warn" and "learner.max_tokens_per_micro_batch" in check.message
    assert doctor.check_token_budget(gpu_cfg(), node()).status == "ok"  # the preset sets one
    assert doctor.check_token_budget(cpu_cfg(), node()).status == "skip"


def test_no_cuda_fails_the_gpu_checks_of_a_gpu_config_and_skips_them_for_a_cpu_one():
    cpu_torch = node(cuda_available=False, cuda_version=None, nccl_version=None, gpu_count=0)
    got = statuses(gpu_cfg(), cpu_torch)
    for name in ("cuda", "nccl", "gpus"):
        assert got[name].status == "fail" and "no CUDA" in got[name].message, got[name]
    assert "CPU build" in got["cuda"].message and "model.device=cpu" in got["cuda"].message
    got = statuses(cpu_cfg(), cpu_torch)
    for name in ("cuda", "nccl", "gpus"):
        assert got[name].status == "skip" and "no CUDA" in got[name].message, got[name]
    # A CUDA build that sees no GPU says so (driver, reservation).
    blind = statuses(gpu_cfg(), node(cuda_available=False, gpu_count=0))["cuda"]
    assert "sees no GPU" in blind.message and "nvidia-smi" in blind.message


def test_nccl_missing_fails():
    check = doctor.check_nccl(gpu_cfg(), node(nccl_version=None))
    assert check.status == "fail" and "torch has no NCCL" in check.message


def test_too_few_gpus_for_the_config_fails_and_names_the_fields():
    check = doctor.check_gpu_count(gpu_cfg(), node(gpu_count=4))
    assert check.status == "fail"
    assert "4 GPUs visible, the config needs 8" in check.message
    assert "learner.world_size" in check.message and "launch.workers" in check.message
    assert doctor.check_gpu_count(gpu_cfg("learner.world_size=2", "launch.workers=2"),
                                  node(gpu_count=4)).status == "ok"  # fmt: skip
    # A CUDA model with no GPUs reserved for the learner ranks (the presets' old defaults).
    check = doctor.check_gpu_count(gpu_cfg("launch.learner_gpus=0"), node())
    assert check.status == "fail" and "set launch.learner_gpus=1" in check.message


def test_small_shm_fails_with_the_docker_setting():
    check = doctor.check_shm(gpu_cfg(), node(shm_bytes=64 << 20))  # Docker's default
    assert check.status == "fail" and "0.1 GiB" in check.message
    assert "--shm-size" in check.message and "shm_size" in check.message
    assert doctor.check_shm(gpu_cfg(), node(shm_bytes=None)).status == "fail"


def test_a_port_in_use_fails_with_the_field_that_sets_it():
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        cfg = cpu_cfg(f"metrics.prometheus_port={port}")
        facts = doctor.gather(cfg)  # the real bind attempt
        assert port in facts.ports_in_use
        check = doctor.check_ports(cfg, facts)
    assert check.status == "fail"
    assert f"{port} (metrics.prometheus_port" in check.message and "free port" in check.message
    free = doctor.gather(cfg)  # released: free again
    assert doctor.check_ports(cfg, free).status == "ok"


def test_redis_unreachable_fails_with_the_setting():
    check = doctor.check_redis(cpu_cfg("buffer.backend=redis"), "ConnectionError: refused")
    assert check.status == "fail" and "redis.url" in check.message
    assert doctor.check_redis(cpu_cfg(), "x").status == "skip"  # the memory backend


@pytest.mark.parametrize(
    ("version", "status", "says"),
    [
        (None, "fail", "vLLM is not installed"),
        ("0.31.2", "fail", "not supported"),  # the adapter's own gate (rollout/vllm_engine.py)
        ("0.33.0", "fail", "not supported"),
        ("0.32.1", "ok", "vLLM 0.32.1"),
    ],
)
def test_vllm_version_uses_the_engines_gate(version, status, says):
    check = doctor.check_vllm(gpu_cfg(), node(vllm_version=version))
    assert check.status == status and says in check.message, check
    assert doctor.check_vllm(cpu_cfg(), node(vllm_version=None)).status == "skip"


def test_disk_for_checkpoints(tmp_path):
    # Hub ids: sized from their names (two checkpoints of 14 bytes a parameter in bf16: fp32
    # masters and AdamW moments, the bf16 reference; 16 in fp32).
    r1 = gpu_cfg()
    assert r1.model.dtype == "bfloat16"
    assert doctor.checkpoint_bytes(r1) == int(1.5e9) * 14
    assert doctor.checkpoint_bytes(gpu_cfg("model.dtype=float32")) == int(1.5e9) * 16
    check = doctor.check_disk(r1, node(disk_free_bytes=20 * GIB))
    assert check.status == "fail" and "output_dir" in check.message
    assert doctor.check_disk(r1, node(disk_free_bytes=40 * GIB)).status == "ok"
    # A local checkpoint: sized from its weight files (bf16: 2 bytes a parameter).
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 1000)
    local = gpu_cfg(f"model.name_or_path={tmp_path}")
    assert doctor.checkpoint_bytes(local) == 500 * 14


def test_cli_passes_against_the_test_redis(redis_url, capsys):
    rc = main(["doctor", "--set", "buffer.backend=redis", "--set", f"redis.url={redis_url}",
               "--json"])  # fmt: skip
    checks = {c["name"]: c for c in map(json.loads, capsys.readouterr().out.splitlines())}
    assert rc == 0, checks
    assert checks["redis"]["status"] == "ok"
    if checks["cuda"]["status"] != "ok":  # this machine: a CPU config skips the GPU checks
        assert checks["cuda"]["status"] == "skip" and "no CUDA" in checks["cuda"]["message"]


def test_cli_fails_clearly_on_a_bad_redis_url(capsys):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rc = main(["doctor", "--set", "buffer.backend=redis", "--set",
               f"redis.url=redis://127.0.0.1:{port}/0"])  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 1
    assert f"fail  redis  cannot reach Redis at redis://127.0.0.1:{port}/0" in out
    assert "set redis.url" in out and "1 failed: redis" in out
