"""The real model and data path through the service with vLLM workers (the vLLM lane): Redis,
`reval learner` and two `reval rollout --engine vllm` workers on configs/cpu_math.toml, with a
checkpoint from `reval make-model` (BPE tokenizer, chat template, EOS `<|im_end|>`) and the
generated word problems, weights by broadcast into the vLLM workers.

Mechanics only (a few updates; learning is tests/integration/test_cpu_math.py's slow test): both
workers feed the learner, every record ends in the checkpoint's EOS or is cut at
`rollout.max_new_tokens`, and every record's policy version and behaviour log-probs come from the
weights that generated it (HF teacher-forced under that version's published weights).
The checkpoint has make-model's default shape (heads of 32, which vLLM's CPU attention takes)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from buffer.redis_ring import RedisRing
from reval.config import load_config
from reval.metrics import read_jsonl
from reval.policy import load_policy
from tests.e2e.test_service_cpu_math import make_task
from tests.e2e.test_service_vllm import (
    TOL,
    keep_versions,
    logprob_error,
    start,
    stop_all,
    worker_summaries,
)

pytestmark = pytest.mark.vllm

CONFIG = "configs/cpu_math.toml"
STEPS = 6
MAX_NEW = 12
"""configs/cpu_math.toml's rollout.max_new_tokens."""


@pytest.mark.timeout(600)
def test_cpu_math_through_the_service_with_vllm_workers(
    tmp_path: Path, redis_url: str, redis_prefix: str
) -> None:
    # 150 format-pretraining steps: some rewards are 1, so the updates change the weights (with
    # 20, every reward was 0 and every version the same weights).
    data, model = make_task(tmp_path, "--pretrain-steps", "150")
    sets = [
        "buffer.backend=redis", f"redis.url={redis_url}",
        f"redis.prefix={redis_prefix}", f"output_dir={tmp_path}", "name=cmv",
        f"model.name_or_path={model}", f"task.dataset={data / 'train.jsonl'}",
        "buffer.capacity=256", "buffer.samples_per_insert=1.0", "buffer.min_size_to_sample=64",
        "buffer.sample_timeout_s=300", "learner.batch_size=64", "learner.micro_batch_size=64",
        f"learner.max_steps={STEPS}", "rollout.worker_prompts=4", "rollout.heartbeat_s=1",
        "rollout.weights_poll_s=0.2", "sync.broadcast=true", "sync.broadcast_host=127.0.0.1",
        "sync.timeout_s=30", "metrics.progress=false",
        "rollout.inflight_updates=finish",  # (streaming: one version per record, checked below)
    ]  # fmt: skip
    run_dir = tmp_path / "cmv"
    stop, kept = threading.Event(), tmp_path / "kept"
    keeper = threading.Thread(target=keep_versions, args=(run_dir / "weights", kept, stop))
    keeper.start()
    learner = start(tmp_path, "learner", sets, "--nproc", "1", config=CONFIG)
    workers = {w: start(tmp_path, "rollout", sets, "--engine", "vllm", "--worker-id", w,
                        config=CONFIG) for w in ("v0", "v1")}  # fmt: skip
    try:
        learner.wait(timeout=500)
        logs = "\n".join(p.read_text()[-3000:] for p in tmp_path.glob("*.log"))
        assert learner.returncode == 0, logs
        records = RedisRing("cmv", 256, url=redis_url, key_prefix=redis_prefix).items()
    finally:
        stop.set()
        keeper.join()
        stop_all(workers.values(), learner)
    for summary in worker_summaries(tmp_path, "vllm", workers).values():
        assert summary["trajectories"] > 0, summary
    rows = read_jsonl(run_dir / "learner.jsonl")
    assert rows[-1]["update"] == STEPS and max(r["workers"] for r in rows) >= 2
    assert max(r["broadcast_to"] for r in rows) == 2  # both vLLM workers joined the hub

    tok = AutoTokenizer.from_pretrained(model)
    assert tok.eos_token_id == tok.convert_tokens_to_ids("<|im_end|>") != tok.pad_token_id
    cfg = load_config(CONFIG, sets)
    hf = load_policy(cfg.model, 0).model.eval()
    assert records and {t.worker_id for t in records} <= {"v0", "v1"}
    discriminated = 0
    for t in records:
        assert t.reward_raw in (0.0, 1.0) and t.finish_reason in ("stop", "length")
        ids = t.response_ids.tolist()
        if t.finish_reason == "stop":  # ends with the checkpoint's EOS (not its pad token)
            assert ids[-1] == tok.eos_token_id and tok.eos_token_id not in ids[:-1]
        else:  # cut at rollout.max_new_tokens, recorded unpadded
            assert len(ids) == MAX_NEW and tok.eos_token_id not in ids
        own = kept / f"v{t.policy_version:08d}.safetensors"
        assert own.is_file(), t.policy_version
        err = logprob_error(hf, own, t)
        assert err < TOL, (t.policy_version, err)
        before = kept / f"v{t.policy_version - 1:08d}.safetensors"
        if before.is_file() and logprob_error(hf, before, t) > 10 * TOL:
            discriminated += 1
    assert max(t.policy_version for t in records) > 0  # records from weights the learner sent
    assert discriminated > 0  # the check tells neighbouring versions apart
