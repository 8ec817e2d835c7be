"""Weights from the learner into a real vLLM engine in one hop (issue 15), on the CPU lane.

The learner (a process of its own, holding the model) runs the ``BroadcastHub`` (gloo); each
vLLM worker process runs a ``LocalReceiver`` (a ``BroadcastReceiver`` thread) inside the worker
extension and hands what it received to vLLM's in-place reload; this process reaches it only
through ``engine.receiver`` (``VLLMReceiver``). This test process plays the rollout process: it
holds the ``VLLMEngine`` and never a copy of the weights (its RSS does not grow by the model's
size while the vLLM worker's does). The vLLM engine joins late, another worker is killed
mid-sync: the learner's failed collective ends within its timeout (re-forming the group without
the dead member waits at most two, as ``BroadcastHub._form`` says) and the survivor ends on the
newest version.

The model is ~230 MB of float32 (``build_tiny_model``, 4 layers of width 1024) so that a copy would
show in the RSS. Correctness without a reference model in this process: all-zero weights give
exactly the uniform log-prob -log(V), and the checkpoint's own weights give back the samples
the engine drew before any update (per-request seeds).
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from rollout.engines import SamplingParams
from rollout.vllm_engine import VLLMEngine

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 5.0
"""The hub's collective timeout (``sync.timeout_s``)."""
PROMPTS = [[5, 6, 7, 8], [9, 10, 11]]
PARAMS = SamplingParams(n=2, temperature=1.0, max_new_tokens=8)

BUILD = """
import sys
from reval.config import TinyModelConfig
from reval.policy import build_char_tokenizer, build_tiny_model
tok = build_char_tokenizer()
shape = TinyModelConfig(hidden_size=1024, num_layers=4, num_heads=16, num_kv_heads=4, head_dim=64,
                        intermediate_size=4096, max_position_embeddings=256)
model = build_tiny_model(shape, len(tok), tok.pad_token_id, tok.eos_token_id, seed=0)
model.save_pretrained(sys.argv[1])
tok.save_pretrained(sys.argv[1])
print(sum(p.numel() * p.element_size() for p in model.parameters()), model.config.vocab_size)
"""

LEARNER = """
import os, signal, sys, time, torch
from safetensors.torch import load_file
from reval.weights.collective import BroadcastHub
orig = load_file(os.path.join(sys.argv[1], "model.safetensors"))
weights = {"orig": orig, "zero": {k: torch.zeros_like(v) for k, v in orig.items()}}
hub = BroadcastHub(0, host="127.0.0.1", timeout_s=float(sys.argv[2]), bucket_bytes=8 << 20)
print(f"{hub.port}/{hub.secret}", flush=True)
for line in sys.stdin:
    cmd, *args = line.split()
    if cmd == "tickets":
        print(int(hub.store.add("tickets", 0)), flush=True)
        continue
    version, which, kill = int(args[0]), args[1], int(args[2]) if len(args) > 2 else 0
    get, n = hub.pool.get, [0]
    def killing_get(*a, **k):  # SIGKILL a member's process group a few buckets into the sync
        n[0] += 1
        if n[0] == 3 and kill:
            os.killpg(kill, signal.SIGKILL)
        return get(*a, **k)
    hub.pool.get = killing_get
    t0 = time.monotonic()
    got = hub.sync(weights[which].items(), version)
    hub.pool.get = get
    print(got, time.monotonic() - t0, flush=True)
"""

DOOMED = """
import sys, time
from reval.weights.collective import BroadcastReceiver
port, secret = sys.argv[1].split("/")
r = BroadcastReceiver("127.0.0.1", int(port), "doomed", secret, timeout_s=float(sys.argv[2]))
print("joined", flush=True)
time.sleep(600)
"""
"""Another rollout worker's receiver (as an HF worker runs it), killed mid-sync. (A whole vLLM
engine there costs a minute of start-up on 2 cores and shows the hub nothing more: to the hub a
member is a gloo peer whose connection resets.)"""


class Learner:
    """The learner's side in a process of its own: the hub, the model, nothing else."""

    def __init__(self, checkpoint: Path) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", LEARNER, str(checkpoint), str(TIMEOUT_S)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )
        self.address = f"gloo://127.0.0.1:{self._read().strip()}"  # (port/secret)

    def _read(self) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, "the learner process died"
        return line

    def _ask(self, line: str) -> list[str]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return self._read().split()

    def tickets(self) -> int:
        return int(self._ask("tickets")[0])

    def sync(self, version: int, which: str, kill_group: int = 0) -> tuple[int, float]:
        """Broadcast ``which`` ("orig", "zero") as ``version``: (receivers, seconds)."""
        receivers, seconds = self._ask(f"sync {version} {which} {kill_group}")
        return int(receivers), float(seconds)

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait(10)


def wait_until(cond: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def rss(pid: int) -> int:
    import psutil  # (a vLLM dependency; the main venv only collects this module)

    return int(psutil.Process(pid).memory_info().rss)


def descendants_rss(pid: int, exclude: set[int]) -> int:
    """RSS of ``pid``'s descendants, leaving out the trees rooted at ``exclude``."""
    import psutil

    total = 0
    for child in psutil.Process(pid).children():
        if child.pid in exclude:
            continue
        with contextlib.suppress(psutil.NoSuchProcess):
            total += child.memory_info().rss + descendants_rss(child.pid, exclude)
    return total


def ready(engine: VLLMEngine) -> int | None:
    """The version every vLLM worker received and has not loaded yet (None: none, or the workers
    disagree), as ``VLLMReceiver.take`` sees it: the workers' ``reval_state``."""
    versions = {v for v, _ in engine.llm.collective_rpc("reval_state")}
    return versions.pop() if len(versions) == 1 else None


def assert_uniform(engine: VLLMEngine, vocab: int) -> None:
    for samples in engine.generate(PROMPTS, PARAMS, seed=3):
        for s in samples:
            np.testing.assert_allclose(s.logprobs, -math.log(vocab), rtol=1e-5)


def same_samples(a: list, b: list) -> bool:  # type: ignore[type-arg]
    return all(
        np.array_equal(x.token_ids, y.token_ids) and np.allclose(x.logprobs, y.logprobs, atol=1e-5)
        for ra, rb in zip(a, b, strict=True)
        for x, y in zip(ra, rb, strict=True)
    )


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int, int]:
    """(directory, bytes of the weights, vocabulary size), built in a process of its own so
    that this process never holds the model."""
    path = tmp_path_factory.mktemp("qwen2_230mb")
    out = subprocess.run(
        [sys.executable, "-c", BUILD, str(path)],
        check=True,
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    nbytes, vocab = out.stdout.split()[-2:]
    return path, int(nbytes), int(vocab)


@pytest.fixture(scope="module")
def engine(checkpoint: tuple[Path, int, int]) -> Iterator[VLLMEngine]:
    eng = VLLMEngine(
        str(checkpoint[0]), seed=0, dtype="float32", max_model_len=256, deterministic=True
    )
    yield eng
    eng.close()


@pytest.mark.timeout(600)
def test_one_hop_late_joiner_and_a_worker_killed_mid_sync(
    engine: VLLMEngine, checkpoint: tuple[Path, int, int], tmp_path: Path
) -> None:
    path, nbytes, vocab = checkpoint
    assert nbytes > 200 << 20
    before = engine.generate(PROMPTS, PARAMS, seed=3)
    learner = Learner(path)
    port = learner.address.rpartition(":")[2]  # (port/secret)
    doomed = subprocess.Popen(
        [sys.executable, "-c", DOOMED, port, str(TIMEOUT_S)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        start_new_session=True,  # a process group of its own, killed as a whole
    )
    try:
        assert doomed.stdout is not None and doomed.stdout.readline().strip() == "joined"
        wait_until(lambda: learner.tickets() == 1, 60, "the doomed worker never joined")
        assert learner.sync(1, "orig")[0] == 1  # the first member gets v1

        # A late joiner: this vLLM engine. It gets the next version, through a new group.
        receiver = engine.receiver
        assert receiver.join(learner.address, "late", TIMEOUT_S)
        wait_until(lambda: learner.tickets() == 2, 60, "the late joiner never joined")
        assert receiver.received() == 0 and receiver.take(None) is None  # (v1 was before it)
        me, others = os.getpid(), {learner.proc.pid, doomed.pid}
        rss_me, rss_workers = rss(me), descendants_rss(me, others)  # (vLLM's processes)
        assert learner.sync(2, "zero")[0] == 2
        wait_until(lambda: ready(engine) == 2, 60, "v2 never arrived")
        assert receiver.received() == 1
        assert receiver.take(newer_than=0) == 2 and engine.policy_version == 2
        grown_me, grown_workers = rss(me) - rss_me, descendants_rss(me, others) - rss_workers
        # The weights went to the vLLM worker (received there, and loaded), not through here.
        assert grown_me < nbytes // 8, (grown_me, nbytes)
        assert grown_workers > nbytes // 2, (grown_workers, nbytes)
        assert_uniform(engine, vocab)

        # The other member dies a few buckets into v3: the learner waits at most its timeout,
        # and v4 re-forms the group without it.
        receivers, seconds = learner.sync(3, "orig", kill_group=doomed.pid)
        assert receivers == 0 and seconds < TIMEOUT_S + 3, (receivers, seconds)
        doomed.wait(30)
        receivers, seconds = learner.sync(4, "orig")
        assert receivers == 1 and seconds < 2 * TIMEOUT_S + 3, (receivers, seconds)
        wait_until(lambda: ready(engine) == 4, 60, "v4 never arrived")
        assert receiver.take(newer_than=2) == 4 and engine.policy_version == 4
        assert same_samples(before, engine.generate(PROMPTS, PARAMS, seed=3))
    finally:
        engine.receiver.leave()
        if doomed.poll() is None:
            os.killpg(doomed.pid, signal.SIGKILL)
            doomed.wait(30)
        learner.close()
