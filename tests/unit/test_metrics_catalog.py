"""The metrics every process exports, against their docs, promtool, the alert rules and the
Grafana dashboard."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from services.metrics_catalog import catalog, expositions, markdown, series_names

ROOT = Path(__file__).resolve().parents[2]
METRIC = re.compile(r"\b(reval_[a-z0-9_]+)")


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.fail("promtool is not installed (Debian: apt-get install prometheus; "
                    "`make test` runs scripts/ensure_tools.sh)")  # fmt: skip
    return path


def test_docs_list_exactly_what_the_processes_export():
    docs = (ROOT / "docs" / "metrics.md").read_text()
    assert markdown() in docs, "docs/metrics.md is stale: python -m services.metrics_catalog"


def test_the_issue_s_metrics_are_there():
    names = {m.name for m in catalog()}
    for needed in (
        "reval_learner_batch_success_rate", "reval_learner_batch_reward_mean",
        "reval_learner_loss", "reval_learner_delta_abs_mean", "reval_learner_v1_mean",
        "reval_learner_v1_ref_mean", "reval_learner_kl_estimate", "reval_learner_grad_norm",
        "reval_learner_step_seconds", "reval_buffer_size", "reval_buffer_inserts",
        "reval_buffer_samples", "reval_buffer_staleness", "reval_buffer_reuse_count",
        "reval_rollout_tokens_per_second", "reval_learner_sync_seconds",
        "reval_learner_sync_bytes", "reval_rollout_policy_version", "reval_api_requests",
    ):  # fmt: skip
        assert needed in names, needed
    assert all(m.name.startswith("reval_") for m in catalog())


def test_promtool_accepts_every_exposition():
    tool = promtool()
    for process, text in expositions().items():
        done = subprocess.run([tool, "check", "metrics"], input=text, capture_output=True)
        assert done.returncode == 0, (process, done.stdout, done.stderr)


def test_prometheus_config_and_rules_are_valid():
    tool = promtool()
    deploy = ROOT / "deploy" / "prometheus"
    for args in (["check", "config", str(deploy / "prometheus.yml")],
                 ["check", "rules", str(deploy / "rules.yml")]):  # fmt: skip
        done = subprocess.run([tool, *args], capture_output=True, text=True)
        assert done.returncode == 0, done.stdout + done.stderr


def queries() -> dict[str, str]:
    out = {}
    rules = yaml.safe_load((ROOT / "deploy" / "prometheus" / "rules.yml").read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            out[f"rule {rule.get('record') or rule.get('alert')}"] = rule["expr"]
    dash = json.loads((ROOT / "deploy" / "grafana" / "dashboards" / "reval.json").read_text())
    for panel in dash["panels"]:
        for target in panel["targets"]:
            out[f"panel {panel['title']} {target['refId']}"] = target["expr"]
    return out


def test_every_queried_metric_is_exported():
    exported = series_names()
    found = 0
    for where, expr in queries().items():
        for name in METRIC.findall(expr):
            found += 1
            assert name in exported, f"{where}: {name} is not exported by any process"
    assert found > 30


def test_a_made_up_metric_would_be_caught():
    assert "reval_learner_made_up_total" not in series_names()
    assert "reval_learner_updates_total" in series_names()


def test_dashboard_uses_the_provisioned_datasource():
    dash = json.loads((ROOT / "deploy" / "grafana" / "dashboards" / "reval.json").read_text())
    ds = yaml.safe_load(
        (
            ROOT / "deploy" / "grafana" / "provisioning" / "datasources" / "prometheus.yml"
        ).read_text()
    )
    uid = ds["datasources"][0]["uid"]
    assert {p["datasource"]["uid"] for p in dash["panels"]} == {uid}
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
