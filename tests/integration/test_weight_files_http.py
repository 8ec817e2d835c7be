"""Weights without a shared disk (issue 43, ``sync.serve_files``): the learner runs in a process
whose weights directory is a filesystem of its own (a tmpfs that bubblewrap mounts for it alone;
the same network), so the paths it announces name files this host cannot see, as on another
machine. A worker (an HF engine of another seed, its subscriber) gets every version from the
learner's file server, a late joiner its first one too, and ends on the learner's weights."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import redis
import torch

from reval.policy import load_policy
from reval.weights.receiver import build_subscriber
from rollout.generators import build_engine
from tests.integration.test_weight_sync import config

ROOT = Path(__file__).resolve().parents[2]

LEARNER = """
import json, sys, torch, redis
from reval.config import load_config
from reval.policy import load_policy
from reval.weights.sender import build_sender
cfg = load_config(overrides=json.loads(sys.argv[1]), environ={})
model = load_policy(cfg.model, 0).model
sender = build_sender(cfg, redis.Redis.from_url(cfg.redis.url), 0, "cpu", torch.float32)
print(sender.files_url, flush=True)
for line in sys.stdin:
    version = int(line)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * version)
    sender.send(model, version)
    assert sender.files.wait(60)
    print(version, flush=True)
sender.close()
"""


def _expected(cfg, versions: int) -> dict[str, torch.Tensor]:
    model = load_policy(cfg.model, 0).model
    with torch.no_grad():
        for version in range(1, versions + 1):
            for p in model.parameters():
                p.add_(0.01 * version)
    return dict(model.named_parameters())


def test_workers_without_the_learners_disk_get_every_version_over_http(
    tmp_path, redis_url, redis_prefix
):
    disk = tmp_path / "learner-disk"  # (the learner's own filesystem: empty seen from here)
    disk.mkdir()
    overrides = ["sync.serve_files=true", f"sync.weights_dir={disk / 'weights'}"]
    cfg = config(tmp_path, redis_url, redis_prefix, *overrides)
    args = ["redis.url=" + redis_url, f"redis.prefix={redis_prefix}", f"output_dir={tmp_path}",
            "name=ws", "buffer.backend=redis", *overrides]  # fmt: skip
    learner = subprocess.Popen(
        ["bwrap", "--dev-bind", "/", "/", "--tmpfs", str(disk), "--",
         sys.executable, "-c", LEARNER, json.dumps(args)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT,
    )  # fmt: skip
    assert learner.stdin is not None and learner.stdout is not None
    client = redis.Redis.from_url(redis_url)
    subs = []
    try:
        url = learner.stdout.readline().strip()
        assert url.startswith("http://127.0.0.1:"), url
        engine, _ = build_engine(cfg, seed=7)
        sub = build_subscriber(cfg, client, "w0")
        subs.append(sub)
        for version in (1, 2, 3):
            learner.stdin.write(f"{version}\n")
            learner.stdin.flush()
            assert learner.stdout.readline().strip() == str(version)
            ann = sub.store.latest()
            assert ann is not None and ann.files_url == url and ann.file_version == version
            assert not ann.path.exists()  # (the learner's disk: not this host's)
            assert sub.update(engine.receiver) == version
            assert sub.fetcher.fetched == version
        want = _expected(cfg, 3)
        for name, p in engine.model.named_parameters():  # type: ignore[attr-defined]
            torch.testing.assert_close(p, want[name], rtol=0, atol=0)
        late_engine, _ = build_engine(cfg, seed=9)  # a late joiner: the newest file at once
        late = build_subscriber(cfg, client, "w1")
        subs.append(late)
        assert late.update(late_engine.receiver) == 3 and late.fetcher.fetched == 1
        for name, p in late_engine.model.named_parameters():  # type: ignore[attr-defined]
            torch.testing.assert_close(p, want[name], rtol=0, atol=0)
    finally:
        for sub in subs:
            sub.close()
        learner.stdin.close()
        learner.wait(timeout=60)
    assert learner.returncode == 0
