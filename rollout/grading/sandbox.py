"""The one sandbox seam: every piece of model-written code runs through ``run`` (today:
``rollout.grading.graders:code_tests``; an environment or tool that executes model code must too).

Which graders need it: ``math_boxed``, ``exact_match`` and ``regex_format`` never execute model
text (they compare strings, or parse LaTeX with math-verify), and the calculator environment
evaluates arithmetic with ``ast`` without ``eval`` (``rollout/calculator.py``): none of them
runs here. ``http_reward`` sends the text elsewhere.

What ``run`` does (``mode="bwrap"``, the default, ``rollout.sandbox``): a trusted Python program
(the caller's harness) runs under bubblewrap with every namespace unshared (no network: a new
network namespace where 127.0.0.1 refuses; its own pid namespace, where the harness is pid 1,
so ``kill(-1, 9)`` cannot reach it; its own user namespace, uid/gid 65534 inside, no
capabilities; the model code's seccomp filter refuses it any further namespace: bwrap's
``--disable-userns`` writes ``/proc/sys/user/max_user_namespaces``, read-only in a container),
``--die-with-parent``, ``--new-session``, an empty
environment (bwrap itself is started with none: its ``/proc/<pid>/environ`` would otherwise
hold the grader's), read-only binds of ``/usr``, ``/lib``, ``/lib64`` (the C library) and the
interpreter's ``sys.base_prefix`` (its standard library; never a venv's site-packages, the repo
or the home directory) and nothing else of the host, a read-only root, a ``/tmp`` tmpfs of
``Limits.tmpfs_mb`` that is the working directory and the only place it can write, a minimal
``/dev`` and no ``/proc`` at all: nothing inside needs it, nothing there can be read, and in a
container a new procfs cannot be mounted under Docker's masked paths (``Can't mount proc``)
unless ``--security-opt systempaths=unconfined``, which compose files cannot give. Nothing is
written on the host: no temporary directory.

The harness confines the process that runs model code with ``CONFINE`` before that code runs:
rlimits (CPU seconds, address space, file size, open files, processes, no core files) and a
seccomp filter that refuses ``fork``/``vfork``/``clone`` of a new process (threads stay
allowed): model code gets no child processes at all. (As root outside, the kernel never
enforces ``RLIMIT_NPROC``, even through a user namespace: the filter is what bounds a fork
bomb.) The harness gets the report channel, a pipe's write end, which only it holds (it makes
itself non-dumpable, so its ``/proc`` entries, memory and descriptors are closed to the model
code, which runs under the same uid), and a nonce on stdin; the caller trusts only lines of that
channel that start with the nonce, never stdout or stderr.

The caller reads stdout and stderr of everything inside (capped at ``Limits.output_bytes``
each; the rest is read and dropped, so printing 300 MB costs the grader nothing) and the
report channel (capped too) until the wall deadline ``Limits.wall_s``; then bwrap is
SIGKILLed, which (pid namespace, ``--die-with-parent``) takes everything inside with it, and
every wait after it has a timeout. The rule for the grading pool: the sandbox's deadline plus
``MARGIN_S`` must fit in ``rollout.verifier_timeout_s``, the deadline after which the pool
kills the grading process (``check_deadline``), so the sandbox always finishes and cleans up
first; and if the pool kills the grading process anyway, ``--die-with-parent`` still ends the
sandbox, and so does the lifeline ``run`` starts before every harness (``LIFELINE``: once the
report channel has no reader, the harness ends itself, and with it, pid 1, the namespace), which
also covers the milliseconds before bwrap arms ``--die-with-parent``.

``preflight(mode)`` is called once when grading starts (the worker or ``reval train``, and each
grading process): where bubblewrap cannot run (not installed, or user namespaces refused) it
raises ``SandboxUnavailable``, one line saying why. ``mode="unsafe-none"`` is the operator's
explicit choice to run model code with no sandbox (rlimits and the seccomp filter only, as the
grader's own user, in a temporary directory): it logs a warning at every preflight and each
result says ``unsafe`` (``Outcome.unsafe``; ``code_tests`` counts it as the ``unsafe``
component). Never a silent downgrade.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

log = logging.getLogger("reval.sandbox")

MODES = ("bwrap", "unsafe-none")
MARGIN_S = 1.0
"""What the sandbox's start, kill and clean-up may take beyond its deadline, within the pool's."""

_mode = "bwrap"


class SandboxUnavailable(ValueError):
    """Model code cannot be run safely here (one line saying why). A ValueError, as a config
    that cannot work here is: the commands print it as their one-line failure."""


@dataclass(frozen=True)
class Limits:
    """What model code may use. ``wall_s``: the deadline of the whole run (bwrap's start
    included); ``cpu_s``: CPU seconds of the model code's process; ``memory_mb``: its address
    space; ``file_mb``: the largest file it may write; ``open_files``; ``tmpfs_mb``: the size of
    its ``/tmp`` (bwrap mode); ``output_bytes``: what is kept of stdout, stderr and the report
    channel each."""

    wall_s: float = 3.0
    cpu_s: int = 3
    memory_mb: int = 512
    file_mb: int = 1
    open_files: int = 64
    tmpfs_mb: int = 16
    output_bytes: int = 64 * 1024


@dataclass(frozen=True)
class Outcome:
    """What came out of one run: ``report`` (the report channel's lines that carried the nonce,
    without it), ``stdout``/``stderr`` (capped; for people, never for scores), ``returncode``
    (None when killed at the deadline), ``timed_out`` and ``unsafe`` (run with no sandbox)."""

    report: list[str]
    stdout: bytes
    stderr: bytes
    returncode: int | None
    timed_out: bool
    unsafe: bool


CONFINE = r'''
def _confine(cpu_s, memory_mb, file_mb, open_files):
    """Rlimits, then a seccomp filter: no new process (fork, vfork, clone without
    CLONE_THREAD; clone3 answers ENOSYS so threads fall back to clone) and no new namespace
    (unshare, setns: EPERM). Fails closed."""
    import ctypes, os, platform, resource, struct
    R = resource
    for what, value in ((R.RLIMIT_CPU, cpu_s), (R.RLIMIT_AS, memory_mb << 20),
                        (R.RLIMIT_FSIZE, file_mb << 20), (R.RLIMIT_NOFILE, open_files),
                        (R.RLIMIT_NPROC, 0), (R.RLIMIT_CORE, 0)):
        R.setrlimit(what, (value, value))
    arches = {"x86_64": (0xC000003E, (57, 58, 272, 308), 56),
              "aarch64": (0xC00000B7, (97, 268), 220)}
    audit, forks, clone = arches[platform.machine()]
    ALLOW, KILL = 0x7FFF0000, 0x80000000
    EPERM, ENOSYS = 0x00050000 | 1, 0x00050000 | 38
    ins = [(0x20, 0, 0, 4), (0x15, 1, 0, audit), (0x06, 0, 0, KILL), (0x20, 0, 0, 0),
           (0x35, 0, 1, 0x40000000), (0x06, 0, 0, EPERM)]
    for nr in forks:
        ins += [(0x15, 0, 1, nr), (0x06, 0, 0, EPERM)]
    ins += [(0x15, 0, 1, 435), (0x06, 0, 0, ENOSYS), (0x15, 0, 3, clone), (0x20, 0, 0, 16),
            (0x45, 1, 0, 0x10000), (0x06, 0, 0, EPERM), (0x06, 0, 0, ALLOW)]
    prog = b"".join(struct.pack("HBBI", *i) for i in ins)
    buf = ctypes.create_string_buffer(prog)
    fprog = struct.pack("HxxxxxxP", len(ins), ctypes.addressof(buf))
    libc = ctypes.CDLL(None, use_errno=True)
    fbuf = ctypes.create_string_buffer(fprog)
    libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong,
                           ctypes.c_ulong]
    if libc.prctl(38, 1, 0, 0, 0) or libc.prctl(22, 2, ctypes.addressof(fbuf), 0, 0):
        raise OSError(ctypes.get_errno(), "seccomp")
'''
"""Source of ``_confine(cpu_s, memory_mb, file_mb, open_files)``, for a harness to run in the
process that will run model code, before it does (it raises rather than run unconfined)."""

HIDE = r'''
def _hide():
    """This process non-dumpable: its memory, descriptors and /proc entries closed to others of
    its uid (the model code)."""
    import ctypes
    if ctypes.CDLL(None).prctl(4, 0, 0, 0, 0):
        raise OSError("prctl(PR_SET_DUMPABLE)")
'''
"""Source of ``_hide()``, which a harness calls first."""

LIFELINE = r'''
def _lifeline(fd):
    """A thread that ends everything here once the caller is gone: the report channel's write
    end (``fd``) polls POLLERR when its only reader, the grading process, has died (its
    descriptor is closed to every other process). pid 1's exit ends its namespace; the
    ``killpg`` is for ``unsafe-none``, where the harness leads its own session."""
    import os, select, signal, threading
    def watch():
        p = select.poll()
        p.register(fd, 0)
        while not p.poll():
            pass
        try:
            os.killpg(0, signal.SIGKILL)
        finally:
            os._exit(70)
    threading.Thread(target=watch, daemon=True).start()
'''
"""Source of ``_lifeline(fd)``, which ``run`` puts before every harness: ``--die-with-parent``
alone leaves a window (bwrap arms it some milliseconds after it starts, so a grading process
killed in between would leave a sandbox running to its CPU limit, or forever if it sleeps)."""


def set_mode(mode: str) -> None:
    """This process's sandbox mode (``rollout.sandbox``), as ``preflight`` sets it."""
    global _mode
    if mode not in MODES:
        raise ValueError(f"rollout.sandbox: {mode!r} is not one of {', '.join(MODES)}")
    _mode = mode


def mode() -> str:
    return _mode


def check_deadline(wall_s: float, pool_timeout_s: float, field: str) -> None:
    """The rule: ``wall_s`` + ``MARGIN_S`` <= the grading pool's per-answer deadline, so the
    sandbox finishes and cleans up before the pool kills the grading process. A ValueError
    naming ``field`` otherwise."""
    if wall_s + MARGIN_S > pool_timeout_s:
        raise ValueError(
            f"{field} ({wall_s:g} s) must be at most rollout.verifier_timeout_s "
            f"({pool_timeout_s:g} s) - {MARGIN_S:g} s: the sandbox must end before the grading "
            "pool kills the grading process"
        )


def preflight(sandbox: str | None = None) -> None:
    """Called once when grading starts: sets the mode; in ``bwrap`` mode raises
    ``SandboxUnavailable`` (one line) unless a sandboxed ``true`` runs; in ``unsafe-none`` mode
    logs a warning (every time: every run)."""
    set_mode(sandbox or _mode)
    if _mode == "unsafe-none":
        log.warning(
            "rollout.sandbox = unsafe-none: model-written code runs with NO sandbox (rlimits and "
            "a no-fork filter only, as this process's user, with the host's files and network)"
        )
        return
    _probe()


@functools.lru_cache(maxsize=1)
def _probe() -> None:
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise SandboxUnavailable(
            "code grading needs bubblewrap (`bwrap`, Debian's bubblewrap) on PATH to sandbox "
            "model code; install it, or set rollout.sandbox = 'unsafe-none' to run it unsandboxed"
        )
    try:
        done = subprocess.run(
            [*_bwrap_argv(bwrap, Limits()), "-c", "pass"],
            env={},
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired) as err:
        raise SandboxUnavailable(f"bubblewrap cannot run here ({err})") from None
    if done.returncode != 0:
        why = done.stderr.decode(errors="replace").strip().splitlines()
        raise SandboxUnavailable(
            f"bubblewrap cannot run here ({why[-1] if why else f'exit {done.returncode}'}): "
            "it needs user namespaces (in a container: see docker-compose.yml's workers); or "
            "set rollout.sandbox = 'unsafe-none' to run model code unsandboxed"
        )


def _interpreter() -> tuple[str, str]:
    """The interpreter to run inside and the prefix to bind (the standard library's)."""
    prefix = os.path.realpath(sys.base_prefix)
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    return os.path.join(prefix, "bin", version), prefix


def _bwrap_argv(bwrap: str, limits: Limits) -> list[str]:
    python, prefix = _interpreter()
    argv = [
        bwrap,
        "--unshare-all",
        "--unshare-user",
        "--die-with-parent",
        "--new-session",
        "--as-pid-1",
        "--clearenv",
        "--uid",
        "65534",
        "--gid",
        "65534",
    ]
    for path in ("/usr", "/lib", "/lib64", "/lib32"):
        if os.path.isdir(path):
            argv += ["--ro-bind", path, path]
    if not prefix.startswith("/usr/"):
        argv += ["--ro-bind", prefix, prefix]
    argv += [
        "--size",
        str(limits.tmpfs_mb << 20),
        "--tmpfs",
        "/tmp",
        "--chdir",
        "/tmp",
        "--dev",
        "/dev",
        "--remount-ro",
        "/",
        "--",
        python,
        "-I",
        "-S",
        "-X",
        "utf8",
    ]
    return argv


def run(harness: str, payload: bytes, limits: Limits) -> Outcome:
    """``harness`` (trusted Python source) run in the sandbox of this process's mode. Its stdin
    carries one line, ``NONCE FD``, then ``payload``: it reports on descriptor ``FD`` (the
    module's docstring), each line starting with ``NONCE``. Returns by ``limits.wall_s`` (plus
    the clean-up's few milliseconds), leaving no process and no file behind."""
    nonce = secrets.token_hex(16)
    unsafe = _mode == "unsafe-none"
    with contextlib.ExitStack() as stack:
        if unsafe:
            tmp = tempfile.TemporaryDirectory(prefix="reval-unsafe-")
            cwd: str | None = stack.enter_context(tmp)
            argv = [sys.executable, "-I", "-S", "-X", "utf8"]
        else:
            _probe()
            cwd, argv = None, _bwrap_argv(shutil.which("bwrap") or "bwrap", limits)
        read_end, write_end = os.pipe()
        try:
            tethered = f"{LIFELINE}\n_lifeline({write_end})\n{harness}"
            proc = subprocess.Popen(
                [*argv, "-c", tethered],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env={},
                cwd=cwd,
                start_new_session=True,
                pass_fds=(write_end,),
            )
        except BaseException:
            os.close(read_end)
            raise
        finally:
            os.close(write_end)
        head = f"{nonce} {write_end}\n".encode()
        return _collect(proc, read_end, nonce, head + payload, limits, unsafe)


def _collect(proc: subprocess.Popen[bytes], report_fd: int, nonce: str, data: bytes,
             limits: Limits, unsafe: bool) -> Outcome:  # fmt: skip
    """Feed ``data`` to stdin; read stdout, stderr and the report channel, each kept up to the
    cap and drained past it, until all three close or the deadline passes; then kill."""
    deadline = time.monotonic() + limits.wall_s
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    out, err, stdin = proc.stdout.fileno(), proc.stderr.fileno(), proc.stdin.fileno()
    kept = {out: bytearray(), err: bytearray(), report_fd: bytearray()}
    sel = selectors.DefaultSelector()
    for fd in (*kept, stdin):
        os.set_blocking(fd, False)
        sel.register(fd, selectors.EVENT_WRITE if fd == stdin else selectors.EVENT_READ)
    todo = memoryview(data)
    timed_out = False
    try:
        while any(fd in sel.get_map() for fd in kept):
            left = deadline - time.monotonic()
            if left <= 0:
                timed_out = True
                break
            for key, _ in sel.select(timeout=left):
                if key.fd == stdin:
                    try:
                        todo = todo[os.write(stdin, todo[:65536]) :]
                    except BlockingIOError:
                        continue
                    except OSError:  # (the harness is gone, or closed its stdin)
                        todo = todo[:0]
                    if not todo:
                        sel.unregister(stdin)
                        proc.stdin.close()
                    continue
                try:
                    chunk = os.read(key.fd, 65536)
                except BlockingIOError:
                    continue
                if not chunk:
                    sel.unregister(key.fd)
                    continue
                buf = kept[key.fd]
                if len(buf) < limits.output_bytes:
                    buf += chunk[: limits.output_bytes - len(buf)]
    finally:
        sel.close()
        _kill(proc, unsafe)
        for f in (proc.stdin, proc.stdout, proc.stderr):
            with contextlib.suppress(OSError):
                f.close()
        os.close(report_fd)
    lines = bytes(kept[report_fd]).decode(errors="replace").splitlines()
    report = [ln[len(nonce) + 1 :] for ln in lines if ln.startswith(nonce + " ")]
    return Outcome(report, bytes(kept[out]), bytes(kept[err]),
                   None if timed_out else proc.returncode, timed_out, unsafe)  # fmt: skip


def _kill(proc: subprocess.Popen[bytes], unsafe: bool) -> None:
    """bwrap (and so everything in its pid namespace) or, unsafe, the harness's session, killed
    and reaped, every wait bounded."""
    with contextlib.suppress(OSError):
        if unsafe:
            os.killpg(proc.pid, signal.SIGKILL)  # (model code cannot fork: this is all of it)
        elif proc.poll() is None:
            proc.kill()
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        log.error("sandbox process %d did not end 5 s after SIGKILL", proc.pid)
