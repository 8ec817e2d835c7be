"""The hostile-completion suite (issue 37): completions a reward-hacking or malicious model
writes, graded by ``rollout.grading.graders:code_tests`` through the real sandbox (bubblewrap, not a
mock). Each scores 0, or its honest score, and leaves no process, file or directory behind.

One grading process (a fresh interpreter, with a secret in its environment) grades them all
and reports its scores, each grade's time and its own peak memory; the test then looks for
what the completions tried to leave on the host (files, a Redis key, processes)."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import time
from pathlib import Path

import redis

ADD = "def add(a, b):\n    return a + b\n"
TESTS = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0"]
TIMEOUT_S = 2.0
MEMORY_CAP_MB = 64
"""The grading process's peak resident memory (VmHWM), whatever the completions print
(measured: 19.6 MB, its imports alone 19.3 MB; the old grader reached 921 MB)."""

DRIVER = r"""
import json, os, resource, sys, time
from rollout.grading import graders, sandbox
sandbox.preflight("bwrap")
cases = json.loads(sys.stdin.read())
out = {}
T = float(os.environ["T"])
for name, (completion, tests) in cases.items():
    t0 = time.monotonic()
    run = graders.run_tests(completion, tests, timeout_s=T)
    graded = graders.code_tests(None, completion, {"tests": tests}, timeout_s=T)
    printed = (run.stdout + run.stderr).decode(errors="replace")
    out[name] = {"score": graded["score"], "seconds": (time.monotonic() - t0) / 2,
                 "report": run.report, "printed": printed}
status = open("/proc/self/status").read()
out["_vmhwm_kb"] = int(status.split("VmHWM:")[1].split()[0])
out["_alive"] = os.getpid()
print(json.dumps(out))
"""


# Each payload is written to do no harm where it escaped (a broken sandbox, or a run without
# one): it acts only when it sees itself inside the sandbox (uid 65534 under the harness as pid
# 1), writes forged lines only to pipes of the harness and of itself, forks a bounded number of
# times, writes at most 48 MB. Never run these outside the sandbox: unguarded, the forged lines
# land at offset 0 of every file any process of the user holds open.
GUARD = """
import os
SANDBOXED = os.getuid() == 65534 and os.getppid() == 1 and not os.path.exists("/proc/self")
"""


def hostile(marker: str, host_dir: Path, redis_key: str) -> dict[str, tuple[str, list[str]]]:
    """Name -> (completion, tests)."""
    forge_everywhere = (
        GUARD
        + r"""
import glob, stat
print("REVAL_PASSED 300 1")
for t in range(10):
    print(f"compiled 1\ntest {t} 1")
forged = b"REVAL_PASSED 300 1\n" + b"".join(b"x test %d 1\n" % t for t in range(10))
for path in glob.glob("/proc/self/fd/*") + (glob.glob("/proc/1/fd/*") if SANDBOXED else []):
    try:
        if stat.S_ISFIFO(os.stat(path).st_mode):
            fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
            os.write(fd, forged)
            os.close(fd)
    except OSError:
        pass
for fd in range(64) if SANDBOXED else ():  # (no /proc in the sandbox: every descriptor held)
    try:
        if stat.S_ISFIFO(os.fstat(fd).st_mode):
            os.write(fd, forged)
    except OSError:
        pass
def add(a, b):
    return a + b + 1
"""
    )
    environ = r"""
import glob
seen = ""
for path in ["/proc/1/environ", "/proc/self/environ", *glob.glob("/proc/*/environ")]:
    try:
        seen += open(path, "rb").read().decode(errors="replace")
    except OSError:
        pass
import os
seen += repr(dict(os.environ))
print(seen)
def environ():
    return seen
"""
    outside = f"""
wrote = []
for path in ["/tmp/{marker}", "{host_dir}/{marker}", "/{marker}", "/usr/{marker}"]:
    try:
        with open(path, "x") as f:
            f.write("x")
        wrote.append(path)
    except OSError:
        pass
def escaped():
    return [p for p in wrote if not p.startswith("/tmp/")]
"""
    socket = f"""
import socket
def connected():
    try:
        s = socket.create_connection(("127.0.0.1", 6379), timeout=1)
        s.sendall(b"SET {redis_key} 1\\r\\n")
        return s.recv(16).decode()
    except OSError:
        return ""
"""
    kill = (
        GUARD + "try:\n    if SANDBOXED:\n        os.kill(-1, 9)\nexcept OSError:\n    pass\n" + ADD
    )
    grandchild = (
        GUARD
        + f"""
import sys
def spawned():
    if not SANDBOXED:
        return False
    pid = os.fork()
    if pid == 0:
        os.setsid()
        os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(30)", "{marker}"])
    return pid > 0
spawned()
"""
    )
    bomb = (
        GUARD
        + """
import time
n = 0
for _ in range(100 if SANDBOXED else 0):
    try:
        if os.fork() == 0:
            time.sleep(5)
            os._exit(0)
        n += 1
    except OSError:
        break
def forks():
    return n
"""
    )
    fill = """
import errno
total = 0
for i in range(48):
    try:
        with open(f"/tmp/fill{i}", "wb") as f:
            for _ in range(16):
                f.write(b"x" * 65536)
                total += 65536
    except OSError as err:
        if err.errno != errno.EFBIG:
            break
def filled():
    return total
"""
    return {
        "correct": (f"Here:\n```python\n{ADD}```", TESTS),
        # (the guard sees the sandbox: the payloads below really kill, fork and spawn)
        "guard_sees_the_sandbox": (
            GUARD + "def inside():\n    return SANDBOXED\n",
            ["assert inside()"],
        ),
        "forged_line": (forge_everywhere, TESTS),
        "new_user_namespace": (
            "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
            "got = libc.unshare(0x10000000)\ndef unshared():\n    return got\n",
            ["assert unshared() == 0"],
        ),
        "forged_line_then_exit": ('print("REVAL_PASSED 300 1")\nimport os\nos._exit(0)\n', TESTS),
        "always_equal": (
            "class Yes:\n    def __eq__(self, other):\n        return True\n"
            "def add(a, b):\n    return Yes()\n",
            TESTS,
        ),
        "reads_environ": (
            environ,
            ["assert 'REVAL_HOSTILE_SECRET' in environ()", "assert environ().count('=') > 3"],
        ),
        "writes_outside": (outside, ["assert escaped()"]),
        "redis_socket": (socket, ["assert connected()"]),
        "kill_everything": (kill, TESTS),
        "setsid_grandchild": (grandchild, ["assert spawned()"]),
        "fork_bomb": (bomb, ["assert forks() > 0"]),
        "infinite_loop": ("while True:\n    pass\n" + ADD, TESTS),
        "prints_300_mb": (
            "import sys\nline = 'x' * (1 << 20)\nfor _ in range(300):\n"
            "    sys.stdout.write(line)\n" + ADD,
            TESTS,
        ),
        "fills_disk": (fill, ["assert filled() > 32 << 20"]),
    }


def processes_with(text: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if text in (entry / "cmdline").read_bytes().decode(errors="replace"):
                    found.append(int(entry.name))
            except OSError:
                pass
    return found


def test_hostile_completions_score_zero_or_honest_and_leave_nothing(tmp_path):
    marker = f"reval-hostile-{secrets.token_hex(6)}"
    secret = secrets.token_hex(16)
    key = f"reval-test-sandbox:{marker}"
    client = redis.Redis.from_url("redis://127.0.0.1:6379/0")
    client.delete(key)
    cases = hostile(marker, tmp_path, key)
    env = {**os.environ, "REVAL_HOSTILE_SECRET": secret, "T": str(TIMEOUT_S)}
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-c", DRIVER], input=json.dumps(cases), env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]  # the grader survived kill(-1, 9)
    out = json.loads(done.stdout)
    scores = {name: out[name]["score"] for name in cases}
    honest = ("correct", "guard_sees_the_sandbox", "kill_everything", "prints_300_mb")
    assert scores == {name: (1.0 if name in honest
                             else 0.0) for name in cases}, out  # fmt: skip
    # Every grade returned by its deadline (the infinite loop's CPU limit or the wall clock).
    for name in cases:
        assert out[name]["seconds"] < TIMEOUT_S + 1.0, (name, out[name]["seconds"])
    # The secret of the grader's environment never reached the code (nor what it printed).
    assert secret not in out["reads_environ"]["printed"]
    assert "REVAL_HOSTILE_SECRET" not in out["reads_environ"]["printed"]
    # Forged lines are printed and written to every descriptor reachable: none is a verdict.
    assert "REVAL_PASSED 300 1" in out["forged_line"]["printed"]
    verdicts = [ln for ln in out["forged_line"]["report"] if ln.startswith("test")]
    assert verdicts == ["test 0 0", "test 1 0"]
    # Nothing written on the host, nothing sent to Redis, nothing left running.
    assert not (tmp_path / marker).exists() and not Path(f"/tmp/{marker}").exists()
    assert not Path(f"/{marker}").exists() and not Path(f"/usr/{marker}").exists()
    assert client.get(key) is None
    assert processes_with(marker) == []
    assert processes_with("_hide()") == []  # (no harness: its source is in its command line)
    assert out["_vmhwm_kb"] < MEMORY_CAP_MB * 1024, out["_vmhwm_kb"]
    assert time.monotonic() - t0 < 60


def kill_a_grader_mid_answer(
    tmp_path: Path, env: dict[str, str] | None = None, mode: str = "bwrap"
) -> None:
    """Start a grading process on code that loops for ever (CPU limit 30 s), SIGKILL it as soon
    as its sandbox shows (which may be bwrap before it has armed ``--die-with-parent``: the
    window the lifeline closes), then expect every process of that sandbox gone within 10 s."""
    # (an identifier: "reval-hostile-..." = 1 was a SyntaxError, so the code never looped and its
    # sandbox lived a fraction of a second, which a busy machine's poll could miss: CI failures)
    marker = f"reval_hostile_{secrets.token_hex(6)}"
    code = f"{marker} = 1\\nwhile True:\\n    pass\\n"
    grader = (
        "from rollout.grading import graders, sandbox\n"
        f"sandbox.preflight('{mode}')\n"
        f"print(graders.run_tests('{code}', ['assert 0'], 30.0))\n"
    )
    said = tmp_path / "grader.out"  # (what the grader says if it ends before its sandbox is seen)
    with said.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-c", grader], stdout=out, stderr=out, env=env)
    try:
        deadline = time.monotonic() + 60
        while (not processes_with("_hide()") and proc.poll() is None
               and time.monotonic() < deadline):  # fmt: skip
            time.sleep(0.05)
        sandboxed = [p for p in processes_with("_hide()") if p != proc.pid]
        why = f"grader exit {proc.poll()}: {said.read_text()}"
        assert sandboxed, f"the sandbox never started ({why})"
    finally:
        proc.kill()
        proc.wait(timeout=10)
    deadline = time.monotonic() + 10
    while processes_with("_hide()") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert processes_with("_hide()") == []
    assert processes_with("_confine(") == []


def test_a_grading_process_killed_mid_answer_leaves_nothing(tmp_path):
    """The pool's deadline kills the grading process (SIGKILL) while the code still runs:
    ``--die-with-parent``, the lifeline and the pid namespace take the whole sandbox with it."""
    kill_a_grader_mid_answer(tmp_path)


def test_the_lifeline_alone_ends_a_sandbox_whose_grader_was_killed(tmp_path):
    """A bwrap that never arms ``--die-with-parent`` (a shim drops it: what a grading process
    killed in bwrap's first milliseconds meets) still leaves nothing: the harness sees its report
    channel lose its reader and ends its namespace. Before the lifeline the sandbox ran on to
    its 30 s CPU limit (CI: a harness outlived its killed grader by 38 s)."""
    real = shutil.which("bwrap")
    assert real, "bubblewrap is not installed (scripts/ensure_tools.sh installs it)"
    shim = tmp_path / "bin" / "bwrap"
    shim.parent.mkdir()
    shim.write_text(
        "#!/bin/sh\n"
        'for a; do shift; [ "$a" = --die-with-parent ] || set -- "$@" "$a"; done\n'
        f'exec {real} "$@"\n'
    )
    shim.chmod(0o755)
    env = {**os.environ, "PATH": f"{shim.parent}{os.pathsep}{os.environ['PATH']}"}
    kill_a_grader_mid_answer(tmp_path, env)


def test_unsafe_none_a_killed_grader_leaves_nothing_either(tmp_path):
    """``unsafe-none`` has no pid namespace and no ``--die-with-parent``: the lifeline kills the
    harness's session (the harness and the solution's process) when the grader dies."""
    kill_a_grader_mid_answer(tmp_path, mode="unsafe-none")
