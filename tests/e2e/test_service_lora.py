"""LoRA through the service (issue 41): a 2-rank FSDP2 learner (`reval learner`) training
adapters, two rollout workers on the merged weights it publishes, a reference reset (the
adapters' snapshot), the export (a merged checkpoint and a PEFT adapter directory), on CPU."""

from __future__ import annotations

import json
import signal

import pytest
import redis
import torch

from reval.metrics import read_jsonl
from reval.weights.files import WeightStore
from tests.e2e.test_service import common, logs, start, version, wait_until


@pytest.mark.slow  # (84 s here; tests/integration/test_lora_parallel.py runs the ranks in 16)
@pytest.mark.timeout(900)
def test_lora_service_publishes_merged_weights_and_exports_both(tmp_path, redis_url, redis_prefix):
    sets = common(tmp_path, redis_url, redis_prefix, "learner.max_steps=24",
                  "model.lora.rank=8", "learner.checkpoint_every=12")  # fmt: skip
    learner = start("learner", sets, "--nproc", "2")
    workers = {k: start("rollout", sets, "--worker-id", k) for k in ("w0", "w1")}
    store = WeightStore(redis.Redis.from_url(redis_url), redis_prefix, "e2e",
                        tmp_path / "e2e" / "weights")  # fmt: skip
    try:
        wait_until(lambda: version(store) >= 4, 300, [learner, *workers.values()])
        out, _ = learner.communicate(timeout=600)
        assert learner.returncode == 0, logs(tmp_path, "learner")
    finally:
        for p in workers.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        outs = {k: p.communicate(timeout=60)[0] for k, p in workers.items()}
    assert "LoRA: " in logs(tmp_path, "learner")  # the trainable share, said once
    for k in ("w0", "w1"):
        got = json.loads(outs[k].strip().splitlines()[-1])
        assert len(got["versions"]) > 2, k  # both workers loaded merged versions as they came
    rows = read_jsonl(tmp_path / "e2e" / "learner.jsonl")
    assert rows[-1]["update"] == 24
    # The last weights file holds the base's names, merged: the export's merged checkpoint.
    export = start("learner", sets, "--nproc", "2", "--export")
    out, _ = export.communicate(timeout=300)
    assert export.returncode == 0, logs(tmp_path, "learner")
    done = json.loads(out.strip().splitlines()[-1])
    from pathlib import Path

    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    path = Path(done["export"])
    merged = AutoModelForCausalLM.from_pretrained(path)
    assert not any("lora" in n or "base_layer" in n for n in merged.state_dict())
    ann = store.latest()
    assert ann is not None and ann.file_version == 24 and ann.path is not None
    published = load_file(ann.path)
    assert published and not any("lora" in n or "base_layer" in n for n in published)
    weights = dict(merged.named_parameters())
    for name, t in published.items():
        assert torch.allclose(t, weights[name], atol=1e-6), name  # merged alike, both ways
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "e2e" / "initial")
    ids = torch.tensor([[5, 9, 12, 7, 3, 20, 1]])
    adapted = PeftModel.from_pretrained(base, path / "adapter").eval()
    with torch.no_grad():
        a = adapted(ids).logits.log_softmax(-1)
        m = merged.eval()(ids).logits.log_softmax(-1)
        b = AutoModelForCausalLM.from_pretrained(tmp_path / "e2e" / "initial")(ids).logits
    assert torch.allclose(a, m, atol=1e-4)  # the adapter on its base is the merged model
    assert not torch.allclose(b.log_softmax(-1), m, atol=1e-4)  # and the adapters did train
