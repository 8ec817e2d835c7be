"""A metrics port already taken is one line naming the port and the setting that moves it, exit
status 2, before the command's long work: ``reval train`` before its set-up and pretraining,
``reval launch`` before Ray starts, ``reval eval --follow`` before it follows (as ``reval
learner`` and ``reval rollout``: tests/integration/test_redis_outage.py)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
QUICK_S = 30.0
"""The command's own start (Python, the config) on a busy 2-core machine; the work the check
comes before takes minutes (pretraining, a local Ray)."""


@pytest.fixture
def held_port() -> Iterator[int]:
    """A port on 127.0.0.1 that another socket holds (listening) for the test."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        yield held.getsockname()[1]


def run_cli(args: list[str], env: dict[str, str] | None = None) -> tuple[int, str, str, float]:
    """``reval ARGS`` in its own session: (exit status, stdout, stderr, seconds). A command
    still running after 90 s (it went on to its long work) is killed with its process group and
    fails the test."""
    t0 = time.monotonic()
    p = subprocess.Popen([sys.executable, "-m", "services.cli", *args], cwd=ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env={**os.environ, **(env or {})}, start_new_session=True)  # fmt: skip
    try:
        out, err = p.communicate(timeout=90)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        pytest.fail(f"still running after 90 s: {out[-2000:]}\n{err[-2000:]}")
    return p.returncode, out, err, time.monotonic() - t0


def assert_one_line(command: str, port: int, setting: str, result: tuple) -> None:
    rc, out, err, took = result
    assert "Traceback" not in err, err[-3000:]
    said = [line for line in (out + err).splitlines() if line.strip()]
    assert len(said) == 1, out[-2000:] + err[-2000:]
    assert said[0].startswith(f"reval {command}: "), said
    assert f"127.0.0.1:{port} " in said[0] and setting in said[0], said
    assert rc == 2
    assert took < QUICK_S, took


def test_train_says_a_taken_port_before_pretraining(tmp_path, held_port):
    result = run_cli(["train", "--set", f"output_dir={tmp_path}", "--set",
                      f"metrics.prometheus_port={held_port}", "--set",
                      "metrics.addr=127.0.0.1", "--no-progress"])  # fmt: skip
    assert_one_line("train", held_port, "--set metrics.prometheus_port=", result)
    assert not list(tmp_path.iterdir())  # no run directory, nothing pretrained


def test_launch_says_a_taken_port_before_ray_starts(tmp_path, held_port):
    # RAY_ADDRESS: a Ray that is not there, so a launch that went on would not start one here
    # (it would wait to join it, and the test fails on its output or its time).
    result = run_cli(["launch", "--set", f"output_dir={tmp_path}", "--set",
                      "buffer.backend=redis", "--set", f"launch.metrics_port={held_port}",
                      "--set", "metrics.addr=127.0.0.1"],
                     env={"RAY_ADDRESS": "127.0.0.1:1"})  # fmt: skip
    assert_one_line("launch", held_port, "--set launch.metrics_port=", result)


def test_eval_follow_says_a_taken_port(tmp_path, held_port):
    result = run_cli(["eval", "--follow", "--metrics-port", str(held_port), "--set",
                      f"output_dir={tmp_path}", "--set", "buffer.backend=redis", "--set",
                      "metrics.addr=127.0.0.1", "--set", "redis.url=redis://127.0.0.1:1/0",
                      "--max-evals", "1"])  # fmt: skip
    assert_one_line("eval", held_port, "--metrics-port ", result)


def test_a_free_port_is_not_refused(held_port):
    from services.cli import port_refused

    assert port_refused("train", None, "127.0.0.1", "x") is None
    assert port_refused("train", 0, "127.0.0.1", "x") is None  # (0: any free)
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    assert port_refused("train", port, "127.0.0.1", "x") is None
    assert port_refused("train", held_port, "127.0.0.1", "x") == 2
