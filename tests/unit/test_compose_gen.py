"""``reval compose`` (services/compose.py): the checked-in docker-compose.yml and
docker-compose.cpu.yml are the generator's output for their layouts (one source), every layout
pins each GPU to one service, the CPU stack runs what the GPU file runs but for the GPUs, and a
layout that does not fit the node is refused with what to change."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from services.cli import main
from services.compose import (
    CPU_LAYOUT,
    DEFAULT_LAYOUT,
    CpuLayout,
    Layout,
    compose_dict,
    compose_text,
)

ROOT = Path(__file__).resolve().parents[2]


def test_checked_in_compose_file_is_the_generators_default_layout():
    text = (ROOT / "docker-compose.yml").read_text()
    assert text == compose_text(DEFAULT_LAYOUT), (
        "docker-compose.yml differs from services/compose.py: regenerate it with `"
        + DEFAULT_LAYOUT.command()
        + " --out docker-compose.yml`"
    )
    assert yaml.safe_load(text) == compose_dict(DEFAULT_LAYOUT)


def test_checked_in_cpu_compose_file_is_the_generators_cpu_layout():
    text = (ROOT / "docker-compose.cpu.yml").read_text()
    assert text == compose_text(CPU_LAYOUT), (
        "docker-compose.cpu.yml differs from services/compose.py: regenerate it with `"
        + CPU_LAYOUT.command()
        + " --out docker-compose.cpu.yml`"
    )


GPU_ONLY = ("deploy", "shm_size")


def without_the_gpus(service: dict) -> dict:
    """A GPU file's service as the CPU stack has it: no GPU reservation, /dev/shm or datasets,
    the CPU image, the CPU preset and one learner rank."""
    out = {k: v for k, v in service.items() if k not in GPU_ONLY}
    out["volumes"] = [v for v in service.get("volumes", []) if not v.startswith("./data:")]
    if out["image"] == "reval:gpu":
        out["image"] = "reval:cpu"
        if "build" in out:
            out["build"] = compose_dict(CPU_LAYOUT)["services"]["api"]["build"]
    out["command"] = [c.replace("r1_distill_qwen_1p5b.toml", "demo.toml") for c in out["command"]]
    if "REVAL__LEARNER__WORLD_SIZE" in out.get("environment", {}):
        out["environment"] = {**out["environment"], "REVAL__LEARNER__WORLD_SIZE": "1"}
    if "REVAL__LAUNCH__WORKERS" in out.get("environment", {}):  # (the CPU stack's 3 workers)
        out["environment"] = {**out["environment"], "REVAL__LAUNCH__WORKERS": "3"}
    return out


@pytest.mark.parametrize("layout", [DEFAULT_LAYOUT, Layout(8, 4)], ids=lambda lay: lay.command())
def test_the_cpu_stack_runs_what_the_gpu_file_runs_but_for_the_gpus(layout: Layout):
    cpu = compose_dict(CpuLayout(workers=3))["services"]
    gpu = compose_dict(layout)["services"]
    assert [n for n in cpu if n.startswith("rollout-")] == ["rollout-0", "rollout-1", "rollout-2"]
    assert set(cpu) == {
        "redis",
        "api",
        "learner",
        "prometheus",
        *(f"rollout-{i}" for i in range(3)),
    }
    for name, service in cpu.items():
        assert not set(GPU_ONLY) & set(service), name  # nothing of a GPU on the CPU
        gpu_name = name if name in gpu else "rollout-0"
        assert without_the_gpus(gpu[gpu_name]) == service, name
    # The same entrypoints, health checks and restart policy; the images are variables.
    assert cpu["learner"]["command"][:2] == ["reval", "learner"]
    assert all(s["restart"] == "on-failure" for s in cpu.values())
    assert cpu["redis"]["image"].startswith("${REVAL_REDIS_IMAGE:-")


def reserved(service: dict) -> list[str]:
    (device,) = service["deploy"]["resources"]["reservations"]["devices"]
    assert "count" not in device  # `count: 1` on several services hands each the first GPU
    return list(device["device_ids"])


@pytest.mark.parametrize(
    "layout",
    [Layout(8, 4), Layout(8, 4, 1), Layout(2, 1), Layout(3, 1, 1), Layout(16, 8, 2)],
    ids=lambda lay: lay.command(),
)
def test_each_gpu_goes_to_one_service(layout: Layout):
    services = yaml.safe_load(compose_text(layout))["services"]
    pinned = {n: reserved(s) for n, s in services.items() if "deploy" in s and n != "ray-head"}
    ids = [i for gpus in pinned.values() for i in gpus]
    assert sorted(ids, key=int) == [str(i) for i in range(layout.gpus)]  # all used, none twice
    assert len(pinned["learner"]) == layout.learner_gpus
    assert services["learner"]["environment"]["REVAL__LEARNER__WORLD_SIZE"] == str(
        layout.learner_gpus
    )
    # The run's desired worker count is the file's rollout services (the API's
    # reval_api_run_workers_desired: a killed one fires RevalWorkersBelowDesired).
    rollouts = [n for n in services if n.startswith("rollout-")]
    assert services["learner"]["environment"]["REVAL__LAUNCH__WORKERS"] == str(len(rollouts))
    workers = [n for n in services if n.startswith("rollout-")]
    assert len(workers) == layout.gpus - layout.learner_gpus - layout.eval_gpus
    assert ("eval" in services) == (layout.eval_gpus > 0)
    for name in pinned:
        assert services[name]["shm_size"]  # NCCL and vLLM use /dev/shm
    # The same environment and addresses as every other layout: only the GPUs differ.
    base = yaml.safe_load(compose_text(DEFAULT_LAYOUT))["services"]
    assert services["learner"]["command"] == base["learner"]["command"]
    assert services["rollout-0"]["environment"] == base["rollout-0"]["environment"]
    assert services["learner"]["environment"]["REVAL__SYNC__BROADCAST_HOST"] == "auto"


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--gpus", "4", "--learner-gpus", "4"], "no GPU for a rollout worker"),
        (["--gpus", "4", "--learner-gpus", "0"], "the learner needs >= 1 GPU"),
        (["--gpus", "4", "--learner-gpus", "2", "--eval-gpus", "2"], "fewer learner/eval"),
        (["--cpu", "--gpus", "4"], "--cpu takes --workers, not --gpus"),
        (["--cpu", "--workers", "0"], "needs >= 1 rollout worker"),
        (["--gpus", "4", "--learner-gpus", "1", "--workers", "3"], "--workers is for --cpu"),
        ([], "give --gpus and --learner-gpus (or --cpu"),
    ],
)
def test_a_layout_that_does_not_fit_is_refused(argv, says, tmp_path, capsys):
    out = tmp_path / "compose.yml"
    assert main(["compose", *argv, "--out", str(out)]) == 2
    assert says in capsys.readouterr().err
    assert not out.exists()


def test_cli_writes_the_file(tmp_path, capsys):
    out = tmp_path / "compose.yml"
    assert main(["compose", "--gpus", "8", "--learner-gpus", "4", "--out", str(out)]) == 0
    assert out.read_text() == compose_text(Layout(8, 4))
    assert main(["compose", "--gpus", "8", "--learner-gpus", "4"]) == 0
    assert capsys.readouterr().out == compose_text(Layout(8, 4))
    assert main(["compose", "--cpu", "--workers", "3"]) == 0
    assert capsys.readouterr().out == compose_text(CpuLayout(3))
