"""The real model and data path through the service: real Redis, `reval learner` and two
`reval rollout` workers on the preset configs/cpu_math.toml with a checkpoint from
`reval make-model` (BPE tokenizer, Qwen chat) and the generated word problems, graded by math-verify
in each worker's pool. Mechanics only (a few updates); learning is the slow test of
tests/integration/test_cpu_math.py."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from buffer.redis_ring import RedisRing
from reval.metrics import read_jsonl
from tests.e2e.test_service import logs, start

ROOT = Path(__file__).resolve().parents[2]


def make_task(tmp_path: Path, *make_model_args: str) -> tuple[Path, Path]:
    """`reval make-data` (30 problems of each of the preset's kinds) and `reval make-model` on
    its training file, as a user would run them: (data directory, model directory)."""
    data, model = tmp_path / "data", tmp_path / "model"
    for args in (["make-data", str(data), "--per-kind", "30", "--kinds",
                  "decimal,expression,fraction"],
                 ["make-model", str(model), "--data", str(data / "train.jsonl"), "--template",
                  "plain", *make_model_args]):  # fmt: skip
        done = subprocess.run([sys.executable, "-m", "services.cli", *args], cwd=ROOT,
                              capture_output=True, text=True, timeout=300)  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
    return data, model


@pytest.mark.timeout(900)
def test_cpu_math_through_the_service(tmp_path: Path, redis_url: str, redis_prefix: str) -> None:
    data, model = make_task(tmp_path, "--pretrain-steps", "20")
    sets = [
        "buffer.backend=redis", f"redis.url={redis_url}",
        f"redis.prefix={redis_prefix}", f"output_dir={tmp_path}", "name=cm",
        f"model.name_or_path={model}", f"task.dataset={data / 'train.jsonl'}",
        "buffer.capacity=1024", "buffer.samples_per_insert=1.0", "buffer.min_size_to_sample=64",
        "buffer.sample_timeout_s=120", "learner.batch_size=64", "learner.micro_batch_size=64",
        "learner.max_steps=6", "rollout.worker_prompts=4", "rollout.heartbeat_s=1",
        "rollout.weights_poll_s=0.2", "sync.timeout_s=10", "metrics.progress=false",
    ]  # fmt: skip
    config = [f"--config={ROOT / 'configs' / 'cpu_math.toml'}"]  # (one arg: start() names logs)
    learner = start("learner", sets, *config, "--nproc", "1")
    workers = [start("rollout", sets, *config, "--worker-id", f"w{k}") for k in range(2)]
    try:
        learner.communicate(timeout=600)
        assert learner.returncode == 0, logs(tmp_path, "learner")
    finally:
        for p in workers:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        outs = [p.communicate(timeout=60)[0] for p in workers]
    assert all(p.returncode == 0 for p in workers), logs(tmp_path, "rollout")
    assert all(json.loads(o.strip().splitlines()[-1])["trajectories"] > 0 for o in outs)
    rows = read_jsonl(tmp_path / "cm" / "learner.jsonl")
    assert rows[-1]["update"] == 6 and max(r["workers"] for r in rows) >= 2
    tok = AutoTokenizer.from_pretrained(model)
    items = RedisRing("cm", 1024, url=redis_url, key_prefix=redis_prefix).items()
    assert items
    for t in items:
        assert t.reward_raw in (0.0, 1.0) and t.finish_reason in ("stop", "length")
        if t.finish_reason == "stop":  # ends with the checkpoint's EOS (not its pad token)
            assert int(t.response_ids[-1]) == tok.eos_token_id != tok.pad_token_id
        else:  # cut at rollout.max_new_tokens, recorded unpadded
            assert t.response_ids.size == 12
