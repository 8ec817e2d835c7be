"""The decoupled service end to end on CPU: real Redis, a 2-rank FSDP2 learner (`reval learner`)
and rollout workers (`reval rollout`) as separate processes, the demo's addition task.

The default run checks the mechanics: policy versions advance and reach the workers, staleness is
reported, a worker killed with SIGKILL does not stop the run, a worker that joins mid-run
generates with current weights from its first batch, the learner killed with SIGKILL resumes
from its last checkpoint with the buffer intact. The `slow` test runs long enough for the reward
to rise."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis
import torch

from buffer.redis_ring import RedisRing
from reval.metrics import read_jsonl
from reval.weights.files import WeightStore

ROOT = Path(__file__).resolve().parents[2]


def common(tmp_path: Path, url: str, prefix: str, *extra: str) -> list[str]:
    return [
        "buffer.backend=redis",
        f"redis.url={url}",
        f"redis.prefix={prefix}",
        f"output_dir={tmp_path}",
        "name=e2e",
        "buffer.capacity=2048",
        "buffer.samples_per_insert=1.0",
        "buffer.min_size_to_sample=128",
        "buffer.sample_timeout_s=120",
        "learner.batch_size=64",
        "learner.micro_batch_size=64",
        "learner.first_update_fresh=false",
        "learner.ref_reset_steps=10",
        "rollout.worker_prompts=4",
        "rollout.heartbeat_s=1",
        "rollout.weights_poll_s=0.2",
        "model.pretrain_steps=100",
        "sync.timeout_s=10",
        "metrics.progress=false",
        *extra,
    ]


def start(role: str, sets: list[str], *args: str) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "services.cli", role]
    for s in sets:
        cmd += ["--set", s]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # Logs go to a file: a pipe nobody reads fills up and blocks the process.
    log_dir = Path(next(s.split("=", 1)[1] for s in sets if s.startswith("output_dir=")))
    name = "-".join([role, *[a for a in args if not a.startswith("-")]])
    log_file = (log_dir / f"{name}-{time.monotonic_ns()}.log").open("w")
    return subprocess.Popen(
        [*cmd, *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=log_file,
        text=True,
        env=env,
        start_new_session=True,  # SIGKILL of the group takes the learner's ranks too
    )


def logs(tmp_path: Path, role: str) -> str:
    return "\n".join(p.read_text()[-3000:] for p in sorted(tmp_path.glob(f"{role}*.log")))


def version(store: WeightStore) -> int:
    ann = store.latest()
    return -1 if ann is None else ann.version


def file_version(store: WeightStore) -> int:
    """The newest version with a file (it may lag the announced one: written in the
    background)."""
    ann = store.latest()
    return -1 if ann is None or ann.file_version is None else ann.file_version


def wait_until(cond, timeout: float, procs=()) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        for p in procs:
            if p.poll() is not None:
                raise AssertionError(f"process exited early: {p.returncode}")
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


@pytest.mark.parametrize("broadcast", [False, True], ids=["files", "broadcast"])
def test_service_end_to_end(tmp_path, redis_url, redis_prefix, broadcast):
    sets = common(
        tmp_path, redis_url, redis_prefix, "learner.max_steps=60", f"sync.broadcast={broadcast}"
    )
    learner = start("learner", [*sets, "learner.checkpoint_every=10"], "--nproc", "2")
    workers = {k: start("rollout", sets, "--worker-id", k) for k in ("w0", "w1")}
    client = redis.Redis.from_url(redis_url)
    store = WeightStore(client, redis_prefix, "e2e", tmp_path / "e2e" / "weights")
    ring = RedisRing("e2e", 2048, url=redis_url, key_prefix=redis_prefix)
    procs = [learner, *workers.values()]
    try:
        wait_until(lambda: version(store) >= 8, 240, procs)
        if not broadcast:  # an export on demand while the learner runs (SIGUSR1)
            learner.send_signal(signal.SIGUSR1)
            exports = tmp_path / "e2e" / "exports"
            wait_until(lambda: any(exports.glob("step-*/config.json")), 120, procs)
        os.killpg(workers["w1"].pid, signal.SIGKILL)  # a worker dies; the run goes on
        workers["w1"].wait(10)
        joined_at = file_version(store)
        workers["w2"] = start("rollout", sets, "--worker-id", "w2")  # a newcomer
        wait_until(lambda: version(store) >= 22, 240, [learner, workers["w0"]])
        # The learner dies; the workers go on generating with the weights they have.
        os.killpg(learner.pid, signal.SIGKILL)
        learner.wait(10)
        killed_at = version(store)
        inserted_before = ring.stats().inserted
        ckpt = (tmp_path / "e2e" / "checkpoints" / "latest").read_text().strip()
        resumed_from = int(ckpt.split("-")[1])
        assert 10 <= resumed_from <= killed_at
        learner = start("learner", sets, "--nproc", "2", "--resume")
        out, _ = learner.communicate(timeout=300)
        assert learner.returncode == 0, logs(tmp_path, "learner")
        state = json.loads(out.strip().splitlines()[-1])
        assert state["updates"] == 60 and state["step"] <= 60
    finally:
        for p in workers.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        outs = {k: p.communicate(timeout=60)[0] for k, p in workers.items()}
        if learner.poll() is None:
            os.killpg(learner.pid, signal.SIGKILL)
    assert workers["w0"].returncode == 0 and workers["w2"].returncode == 0
    w0 = json.loads(outs["w0"].strip().splitlines()[-1])
    w2 = json.loads(outs["w2"].strip().splitlines()[-1])
    assert len(w0["versions"]) > 5  # the workers took new weights as they came
    assert min(w2["versions"]) >= joined_at  # the newcomer started from current weights
    assert ring.stats().inserted >= inserted_before  # nothing generated was lost
    rows = read_jsonl(tmp_path / "e2e" / "learner.jsonl")
    updates = [r["update"] for r in rows]
    assert updates[-1] == 60
    # The resumed learner continued from its checkpoint, not from zero.
    restart = next(i for i in range(1, len(updates)) if updates[i] <= updates[i - 1])
    assert updates[restart] == resumed_from + 1
    assert any(r["staleness_mean"] > 0 for r in rows)  # off-policy: staleness reported
    assert max(r["workers"] for r in rows) >= 2
    assert all(t.policy_version <= 60 for t in ring.items())
    if broadcast:  # updates reached the workers over the broadcast, not only through files
        assert max(r["broadcast_to"] for r in rows) >= 2
    final = tmp_path / "e2e" / "final"
    assert (final / "config.json").is_file() and any(final.glob("*.safetensors"))
    if not broadcast:
        # The latest checkpoint as a Hugging Face checkpoint, on demand, without training.
        export = start("learner", sets, "--nproc", "2", "--export")
        out, _ = export.communicate(timeout=300)
        assert export.returncode == 0, logs(tmp_path, "learner")
        done = json.loads(out.strip().splitlines()[-1])
        assert done["step"] == 60 and done["export"].endswith("exports/step-00000060")
        from transformers import AutoModelForCausalLM

        exported = AutoModelForCausalLM.from_pretrained(done["export"])
        final_model = AutoModelForCausalLM.from_pretrained(final)
        for (n, a), (_, b) in zip(
            exported.state_dict().items(), final_model.state_dict().items(), strict=True
        ):
            assert torch.equal(a, b), n  # the same weights as the end of the run


@pytest.mark.slow
def test_service_learns(tmp_path, redis_url, redis_prefix):
    """The shortened demo's amount of learning (600 updates of 256, K=4 through the limiter,
    the demo's reference reset) through the service: the reward rises (measured here: the mean
    batch reward of updates 1-100 was 0.053, of 501-600 0.269)."""
    sets = common(
        tmp_path,
        redis_url,
        redis_prefix,
        "learner.max_steps=600",
        "learner.batch_size=256",
        "learner.micro_batch_size=128",
        "learner.ref_reset_steps=200",
        "buffer.samples_per_insert=4",
        "buffer.min_size_to_sample=512",
        "model.pretrain_steps=300",
        "rollout.worker_prompts=16",
    )
    learner = start("learner", sets, "--nproc", "2")
    workers = [start("rollout", sets, "--worker-id", f"w{k}") for k in range(2)]
    try:
        learner.communicate(timeout=1800)
        assert learner.returncode == 0, logs(tmp_path, "learner")
    finally:
        for p in workers:
            p.send_signal(signal.SIGTERM)
        for p in workers:
            p.wait(60)
    rows = read_jsonl(tmp_path / "e2e" / "learner.jsonl")
    first = sum(r["batch_reward_mean"] for r in rows[:100]) / 100
    last = sum(r["batch_reward_mean"] for r in rows[-100:]) / 100
    assert last > first + 0.05, (first, last)
