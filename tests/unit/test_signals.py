"""Honest signals (issue 38): each buffer metric is exported only by the role that owns it (a
rollout worker exported the learner's ``reval_buffer_samples_per_insert`` as 0, so the plain
query returned 0, 0 and 2.45), and an alert fires when fewer rollout workers run than the run
wants (``promtool test rules`` on deploy/prometheus/rules.yml)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import textwrap
from pathlib import Path

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from buffer.metrics import ROLES, BufferMetrics
from services.metrics_catalog import catalog

ROOT = Path(__file__).resolve().parents[2]
RUN_WIDE = ("reval_buffer_samples_per_insert", "reval_buffer_evicted_unused_ratio")


def exported(registry: CollectorRegistry) -> set[str]:
    return {family.name for family in registry.collect()}


def test_a_worker_exports_no_learner_owned_buffer_metric():
    processes: dict[str, set[str]] = {}
    for m in catalog():
        processes.setdefault(m.name, set()).add(m.process)
    for name in RUN_WIDE:  # the ring's run-wide figures: the learner's (and one-process train's)
        assert processes[name] == {"learner", "train"}, name
    for name in ("reval_buffer_samples", "reval_buffer_staleness", "reval_buffer_reuse_count",
                 "reval_buffer_sample_latency_seconds", "reval_buffer_dropped_stale"):  # fmt: skip
        assert "rollout" not in processes[name], name  # only a consumer samples
    for name in ("reval_buffer_inserts", "reval_buffer_spool_records",
                 "reval_buffer_spool_dropped"):  # fmt: skip
        assert "learner" not in processes[name], name  # only a producer inserts and spools


def test_a_role_s_unowned_metrics_still_take_updates_but_are_not_scraped():
    worker = BufferMetrics(role="producer")
    worker.samples_per_insert.set(0)  # (the ring's code may update what the role does not own)
    worker.inserts.inc(3)
    names = exported(worker.registry)
    assert "reval_buffer_inserts" in names and "reval_buffer_samples_per_insert" not in names
    learner = BufferMetrics(role="consumer")
    learner.samples_per_insert.set(2.45)
    assert "reval_buffer_samples_per_insert" in exported(learner.registry)
    assert "reval_buffer_spool_records" not in exported(learner.registry)
    assert len(exported(BufferMetrics().registry)) == len(ROLES["both"])  # train: every one
    with pytest.raises(ValueError, match="role 'worker'"):
        BufferMetrics(role="worker")


RULES_TEST = """
rule_files:
  - {rules}
evaluation_interval: 1m
tests:
  - interval: 1m
    input_series:
      # run a: a compose stack of 2 workers, one docker-killed at minute 3 (not restarted)
      - series: 'reval_api_run_workers{{job="reval-api", instance="api:8080", run="a"}}'
        values: '2 2 2 1 1 1 1 1 1 1 1 1 1'
      - series: 'reval_api_run_workers_desired{{job="reval-api", instance="api:8080", run="a"}}'
        values: '2 2 2 2 2 2 2 2 2 2 2 2 2'
      # run b: scaled from 2 to 3, the third worker up 2 minutes later (no alert)
      - series: 'reval_api_run_workers{{job="reval-api", instance="api:8080", run="b"}}'
        values: '2 2 2 2 2 3 3 3 3 3 3 3 3'
      - series: 'reval_api_run_workers_desired{{job="reval-api", instance="api:8080", run="b"}}'
        values: '2 2 2 3 3 3 3 3 3 3 3 3 3'
    alert_rule_test:
      - eval_time: 6m
        alertname: RevalWorkersBelowDesired
        exp_alerts: []
      - eval_time: 10m
        alertname: RevalWorkersBelowDesired
        exp_alerts:
          - exp_labels: {{severity: warning, job: reval-api, instance: "api:8080", run: a}}
            exp_annotations:
              summary: {summary}
"""
SUMMARY = ("Run a: 1 rollout workers generate, fewer than desired, for 5 minutes (one died and "
           "was not restarted: docker compose ps, reval runs get)")  # fmt: skip


def test_an_alert_fires_when_fewer_workers_run_than_desired(tmp_path):
    tool = shutil.which("promtool")
    if tool is None:
        pytest.fail("promtool is not installed (`make test` runs scripts/ensure_tools.sh)")
    rules = ROOT / "deploy" / "prometheus" / "rules.yml"
    case = tmp_path / "workers_below_desired.yml"
    case.write_text(textwrap.dedent(RULES_TEST).format(rules=rules, summary=json.dumps(SUMMARY)))
    done = subprocess.run([tool, "test", "rules", str(case)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


class _Tokenizer:
    def __call__(self, text: str, add_special_tokens: bool = False):
        return type("Enc", (), {"input_ids": [1, 2]})()

    def decode(self, tokens, skip_special_tokens: bool = True) -> str:
        return "right" if list(tokens) == [7] else "wrong"


class _Engine:
    """Every problem: one right answer of two."""

    stop_ids = (0,)

    def generate(self, prompts, params, seed):
        from rollout.engines import Sample

        ids = [np.array([7, 0], np.int32), np.array([8, 0], np.int32)]
        return [[Sample(t, np.zeros(2, np.float32), "stop") for t in ids] for _ in prompts]


class _ComponentVerifier:
    """Grades as a custom reward's pool does: a score, and named components kept for
    ``drain_components`` (rollout/grading/pool.py: PooledVerifier)."""

    def __init__(self) -> None:
        self.kept: list[dict[str, float]] = [{"stale": 9.0}]  # (graded before the benchmark)

    def score_many(self, pairs):
        out = []
        for _, response in pairs:
            right = float(response == "right")
            self.kept.append({"right": right, "length": float(len(response))})
            out.append(right)
        return out

    def drain_components(self) -> dict[str, float]:
        got, self.kept = self.kept, []
        names = {k for c in got for k in c}
        return {k: float(np.mean([c[k] for c in got if k in c])) for k in names}


def test_reval_eval_reports_a_custom_reward_s_components(tmp_path, monkeypatch):
    import services.evaluate as ev
    from rollout.engines import SamplingParams
    from rollout.eval_sets import BENCHMARKS, Benchmark, Problem

    bench = Benchmark(BENCHMARKS["math500"], [Problem(f"p{i}", "q", "a") for i in range(3)],
                      prompts=["q"] * 3)  # fmt: skip
    monkeypatch.setattr(ev, "answer_text", lambda tok, ids, stops: tok.decode(list(ids[:1])))
    res = ev.evaluate_benchmark(bench, _Engine(), _Tokenizer(), _ComponentVerifier(),
                                SamplingParams(n=2))  # fmt: skip
    assert res.avg_at_k == 0.5
    assert res.components == {"length": 5.0, "right": 0.5}  # (not the stale one)
    # The report (eval.json) and the printed table carry them.
    from reval.config import RunConfig

    monkeypatch.setattr(ev, "_prepare", lambda *a: (None, None, SamplingParams(n=2), [bench]))
    monkeypatch.setattr(ev, "_evaluate_all", lambda *a: {"task": res})
    report = ev.run_eval(RunConfig(), ["task"], None, tmp_path / "eval.json", progress=False)
    assert report["components"] == {"task": {"length": 5.0, "right": 0.5}}
    assert report["benchmarks"]["task"]["components"] == {"length": 5.0, "right": 0.5}
    assert "task reward components: length 5.000, right 0.500" in report["table"]


def test_sizes_are_in_human_units():
    from reval.paths import human_bytes

    assert [human_bytes(n) for n in (0, 512, 1536, 12 << 20, int(1.25 * 2**30), 3 << 40)] == [
        "0 B", "512 B", "1.50 KiB", "12.0 MiB", "1.25 GiB", "3.00 TiB"
    ]  # fmt: skip


def test_a_full_weights_disk_is_one_line_a_minute_and_says_what_goes_on(
    tmp_path, redis_url, redis_prefix, caplog
):
    """63 versions refused in a row were 63 lines saying "the broadcast goes on" with broadcast
    off and "0.00 GiB free": now one line saying what goes on, then a line a minute with the
    count, then one when files are written again."""
    import logging

    import redis
    import torch

    from reval.ratelog import RateLog
    from reval.weights.files import WeightStore
    from reval.weights.sender import WeightSender

    blocker = tmp_path / "blocker"  # a file where the weights directory's parent should be
    blocker.write_text("")
    store = WeightStore(redis.Redis.from_url(redis_url), redis_prefix, "wd", blocker / "w")
    sender = WeightSender(0, torch.float32, "cpu", 64 << 10, store)  # (no hub: no broadcast)
    assert sender.files is not None and sender.files.broadcast is False
    now = [0.0]
    sender.files.ratelog = RateLog(logging.getLogger("reval.weights"), 60.0, lambda: now[0])
    model = torch.nn.Linear(16, 4)
    caplog.set_level(logging.INFO, logger="reval.weights")

    def send(version: int) -> list[str]:
        caplog.clear()
        sender.send(model, version)
        assert sender.files is not None and sender.files.wait(10)
        return [r.getMessage() for r in caplog.records if r.name == "reval.weights"]

    first = send(1)
    assert len(first) == 1 and first[0].startswith(f"could not write weights {blocker / 'w'}")
    assert re.search(r"\(\d+(\.\d+)? (B|KiB|MiB|GiB|TiB) free on ", first[0]), first[0]
    assert "the broadcast is off (sync.broadcast): no worker gets a newer version" in first[0]
    assert "the broadcast goes on" not in first[0]
    quiet = [line for v in range(2, 64) for line in send(v)]
    assert quiet == []  # 62 more failures within the minute: held back
    now[0] = 61.0
    (later,) = send(64)
    assert "v00000064" in later and "(and 62 more like it since the last line)" in later
    blocker.unlink()  # space again
    (back,) = send(65)
    assert back.startswith("weights v65: written to") and "again" in back
    assert (blocker / "w" / "v00000065.safetensors").exists()
