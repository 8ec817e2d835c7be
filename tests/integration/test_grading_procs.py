"""Nothing left running by the grading processes (issue 38): a custom reward that forks leaves no
process behind when the pool closes, when its grading process is replaced after a deadline, and
when the pool's owner exits, even by SIGKILL; an answer whose grading allocates 4 GiB fails at
once and counts as ``memory``, not ``timeout``, without drawing the machine's memory down."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from rollout.grading.custom import RewardFunction
from rollout.grading.pool import VerifierPool
from rollout.grading.process import ERROR_REASONS

ROOT = Path(__file__).resolve().parents[2]

REWARDS = """
import os
import time

def forky(prompt, completion, metadata):
    # Four children that sleep on (a user's reward that starts helpers and returns).
    pids = []
    for _ in range(4):
        pid = os.fork()
        if pid == 0:
            time.sleep(600)
            os._exit(0)
        pids.append(pid)
    with open(metadata["pidfile"], "a") as f:
        f.write(" ".join(map(str, pids)) + "\\n")
    if metadata.get("hang"):
        time.sleep(600)
    return 1.0

def greedy(prompt, completion, metadata):
    block = bytearray(4 << 30)  # 4 GiB, written
    block[::4096] = b"x" * len(block[::4096])
    return 1.0
"""


@pytest.fixture()
def rewards(tmp_path: Path) -> Path:
    path = tmp_path / "procs_rewards.py"
    path.write_text(REWARDS)
    return path


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for its reaper counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _gone(pids: list[int], within_s: float = 5.0) -> list[int]:
    """The pids still running after ``within_s``."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.05)
    return [p for p in pids if _alive(p)]


def _pids(pidfile: Path) -> list[int]:
    return [int(p) for p in pidfile.read_text().split()]


def _item(pidfile: Path, **meta: object) -> tuple[object, ...]:
    return ("p", "c", {"pidfile": str(pidfile), **meta}, "stop")


def test_forked_children_end_when_the_pool_closes(rewards: Path, tmp_path: Path) -> None:
    pidfile = tmp_path / "pids"
    pool = VerifierPool(RewardFunction(f"{rewards}:forky"), workers=1, timeout=20)
    try:
        assert pool.score_many([_item(pidfile)]) == [1.0]
        children = _pids(pidfile)
        assert len(children) == 4 and all(_alive(p) for p in children)
    finally:
        pool.close()
    assert _gone(children) == []


def test_forked_children_end_when_their_grading_process_is_replaced(
    rewards: Path, tmp_path: Path
) -> None:
    pidfile = tmp_path / "pids"
    with VerifierPool(RewardFunction(f"{rewards}:forky"), workers=1, timeout=1.5) as pool:
        assert pool.score_many([_item(pidfile, hang=True)]) == [0.0]  # deadline: killed
        assert pool.metrics.error_count("timeout") == 1
        children = _pids(pidfile)
        assert len(children) == 4
        assert _gone(children) == []  # while the pool goes on


OWNER = """
import os, signal, sys, time
from rollout.grading.custom import RewardFunction
from rollout.grading.pool import VerifierPool
if __name__ == "__main__":
    spec, pidfile, how = sys.argv[1:]
    pool = VerifierPool(RewardFunction(spec), workers=2, timeout=20)
    assert pool.wait_ready(60)
    item = ("p", "c", {"pidfile": pidfile}, "stop")
    assert pool.score_many([item, item]) == [1.0, 1.0]
    from multiprocessing import resource_tracker
    print(*pool.worker_pids, resource_tracker._resource_tracker._pid, flush=True)
    if how == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    sys.exit(0)  # (the pool's exit handler closes it)
"""


@pytest.mark.parametrize("how", ["exit", "sigkill"])
def test_nothing_outlives_the_pools_owner(rewards: Path, tmp_path: Path, how: str) -> None:
    """The owner, a real process, exits (or is SIGKILLed): its grading processes, their guards,
    the 8 children the reward forked and multiprocessing's resource tracker (which the children
    held alive) are all gone."""
    pidfile = tmp_path / "pids"
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(OWNER), f"{rewards}:forky", str(pidfile), how],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    expected = -signal.SIGKILL if how == "sigkill" else 0
    assert proc.returncode == expected, proc.stderr
    *graders, tracker = [int(p) for p in proc.stdout.split()]
    children = _pids(pidfile)
    assert len(graders) == 2 and len(children) == 8
    assert _gone([*graders, *children, tracker]) == []


def _available_mb() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no MemAvailable in /proc/meminfo")


def test_a_grading_process_over_its_memory_cap_counts_as_memory(rewards: Path) -> None:
    assert "memory" in ERROR_REASONS
    with VerifierPool(RewardFunction(f"{rewards}:greedy"), workers=1, timeout=30,
                      memory_mb=1024) as pool:  # fmt: skip
        assert pool.wait_ready(60)
        before = _available_mb()
        t0 = time.monotonic()
        graded = pool.grade_many([("p", "c", {}, "stop")])
        took = time.monotonic() - t0
        after = _available_mb()
        assert graded[0].score == 0.0 and graded[0].reason == "memory", graded
        assert pool.metrics.error_count("memory") == 1
        assert pool.metrics.error_count("timeout") == 0
        assert took < 5.0  # failed at once, not after the deadline
        assert before - after < 500  # the 4 GiB were never drawn
        # The grading process lives on and grades the next answer.
        assert pool.grade_many([("p", "c", {}, "stop")])[0].reason == "memory"


SANDBOXED = """
import os, sys, threading, time
from rollout.grading.custom import RewardFunction
from rollout.grading.pool import VerifierPool
if __name__ == "__main__":
    grader = RewardFunction("rollout.grading.graders:code_tests", {"timeout_s": 9.0}, timeout=10.0)
    pool = VerifierPool(grader, workers=1, timeout=10.0)
    assert pool.wait_ready(60)
    print(*pool.worker_pids, flush=True)
    item = ("p", "import time\\ntime.sleep(60)", {"tests": ["assert True"]}, "stop")
    threading.Thread(target=pool.score_many, args=([item],), daemon=True).start()
    time.sleep(60)
"""


def _descendants(root: int) -> list[int]:
    """Every process below ``root`` (read from /proc)."""
    parents: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    parents[int(name)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
                continue
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        kids = [p for p, pp in parents.items() if pp == pid]
        out += kids
        todo += kids
    return out


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except FileNotFoundError:
        return ""


def test_model_code_in_the_sandbox_ends_with_the_pools_owner(tmp_path: Path) -> None:
    """Model-written code (``rollout.grading.graders:code_tests``: bubblewrap) running when the
    pool's owner is SIGKILLed: the sandbox and everything in it are gone within seconds, well before
    its own 9 s deadline."""
    owner = subprocess.Popen([sys.executable, "-c", textwrap.dedent(SANDBOXED)], cwd=ROOT,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert owner.stdout is not None
        grader = int(owner.stdout.readline())
        deadline = time.monotonic() + 20
        below: list[int] = []
        while not any("bwrap" in _cmdline(p) for p in below):
            assert time.monotonic() < deadline, "no sandbox started"
            time.sleep(0.05)
            below = _descendants(grader)
        time.sleep(0.5)  # the model's code is running inside
        below = _descendants(grader)
        assert len(below) >= 3  # (its group's guard, bwrap, the harness and the code)
        os.kill(owner.pid, signal.SIGKILL)
        owner.wait(10)
        assert _gone([grader, *below], within_s=3.0) == []
    finally:
        if owner.poll() is None:
            owner.kill()
        owner.communicate()
