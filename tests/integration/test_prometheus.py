"""A real Prometheus server (Debian's package) on loopback scrapes a running CPU run
(`reval train` with its metrics endpoint) and the test reads the metrics back through
Prometheus's query API, with the project's recording rules loaded."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def query(port: int, expr: str) -> list[dict]:
    r = httpx.get(f"http://127.0.0.1:{port}/api/v1/query", params={"query": expr}, timeout=5)
    r.raise_for_status()
    body = r.json()
    assert body["status"] == "success", body
    return list(body["data"]["result"])


@pytest.mark.timeout(300)
def test_prometheus_scrapes_a_running_run(tmp_path):
    prometheus = shutil.which("prometheus")
    if prometheus is None:
        pytest.fail("prometheus is not installed (`make test` runs scripts/ensure_tools.sh)")
    run_port, prom_port = free_port(), free_port()
    rules = (ROOT / "deploy" / "prometheus" / "rules.yml").read_text()
    (tmp_path / "rules.yml").write_text(rules)
    (tmp_path / "prometheus.yml").write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        "rule_files: [rules.yml]\n"
        "scrape_configs:\n"
        "  - job_name: reval-learner\n"
        f"    static_configs: [{{targets: ['127.0.0.1:{run_port}']}}]\n"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "train", "--no-progress",
         "--set", f"output_dir={tmp_path}", "--set", "learner.rounds=100000",
         "--set", "eval.every=0", "--set", "model.pretrain_steps=20",
         "--set", f"metrics.prometheus_port={run_port}"],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=(tmp_path / "train.log").open("w"), env=env,
    )  # fmt: skip
    prom = subprocess.Popen(
        [prometheus, f"--config.file={tmp_path / 'prometheus.yml'}",
         f"--storage.tsdb.path={tmp_path / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{prom_port}"],
        stdout=subprocess.DEVNULL, stderr=(tmp_path / "prometheus.log").open("w"),
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 180
        rounds: list[dict] = []
        while True:
            assert run.poll() is None, (tmp_path / "train.log").read_text()[-2000:]
            assert prom.poll() is None, (tmp_path / "prometheus.log").read_text()[-2000:]
            try:
                rounds = query(prom_port, 'reval_train_round{job="reval-learner"}')
            except httpx.HTTPError:
                rounds = []
            if rounds and float(rounds[0]["value"][1]) >= 3:
                break
            assert time.monotonic() < deadline, "Prometheus never saw 3 rounds"
            time.sleep(1)
        assert query(prom_port, 'up{job="reval-learner"}')[0]["value"][1] == "1"
        updates = query(prom_port, "reval_learner_updates_total")
        assert float(updates[0]["value"][1]) > 0
        # A recording rule of deploy/prometheus/rules.yml evaluates over the scraped series.
        deadline = time.monotonic() + 60
        while not query(prom_port, "reval:learner_updates_per_second"):
            assert time.monotonic() < deadline, "the recording rule never produced a value"
            time.sleep(1)
        fill = query(prom_port, "reval:buffer_fill_ratio")
        assert fill and 0 < float(fill[0]["value"][1]) <= 1
    finally:
        for p in (run, prom):
            p.send_signal(signal.SIGTERM)
        for p in (run, prom):
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
