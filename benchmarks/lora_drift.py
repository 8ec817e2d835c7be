"""Hand-run benchmark: how much of a LoRA policy's move a merged bf16 publish loses
(``model.lora.publish = "merged"``, docs/learner.md "LoRA").

The learner computes ``W x + s B (A x)`` in bf16 from fp32 masters; a merged publish sends
``bf16(W + s B A)`` (summed in fp32, rounded once), and an update smaller than half of ``W``'s
rounding step vanishes in it. This measures it on a random model of the Qwen2 family (the
layout of the presets; small enough for the CPU) with rank-``r`` adapters on every linear
layer whose ``B`` has grown to a given size (as training grows it from zero): for each size, the
mean absolute log-prob move of the adapted policy from the base, as the learner computes it,
and the share of that move the merged bf16 weights keep (``kept``; the adapters published alone
keep it all), on random token sequences.

    .venv/bin/python benchmarks/lora_drift.py --rank 32 --hidden 512 --layers 4
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from reval import lora
from reval.config import LoraConfig
from reval.weights.sender import merged_layers


def build(hidden: int, layers: int, vocab: int, seed: int) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(hidden_size=hidden, intermediate_size=hidden * 3, num_hidden_layers=layers,
                      num_attention_heads=hidden // 64, num_key_value_heads=max(1, hidden // 256),
                      vocab_size=vocab, tie_word_embeddings=True,
                      max_position_embeddings=256)  # fmt: skip
    return Qwen2ForCausalLM(cfg).eval()


def logp(model: torch.nn.Module, ids: torch.Tensor, bf16: bool = True) -> torch.Tensor:
    """Per-token log-probs of ``ids``, computed in bf16 (autocast, as the learner does) or in
    fp32 (the reference)."""
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        logits = model(ids).logits.float()
    return logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0]


def merged_copy(policy: torch.nn.Module, fresh: torch.nn.Module) -> torch.nn.Module:
    """``fresh`` (the base's shape) holding ``bf16(W + s B A)`` of every adapted layer, the sum
    in fp32 (``lora.merged_weight``, what the sender publishes), the rest the base's, in bf16."""
    layers = merged_layers(policy)
    own = dict(policy.named_parameters())
    with torch.no_grad():
        for name, p in fresh.named_parameters():
            layer = layers.get(name)
            src = next(t for n, t in own.items() if lora.base_name(n) == name)
            value = (lora.merged_weight(layer, src, lambda t: t, torch.bfloat16)
                     if layer is not None else src.to(torch.bfloat16))  # fmt: skip
            p.copy_(value.float())
    return fresh


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--seqs", type=int, default=16)
    ap.add_argument("--length", type=int, default=128)
    ap.add_argument("--sizes", default="1e-5,1e-4,1e-3,1e-2", help="std of B's entries")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    base = build(args.hidden, args.layers, args.vocab, 0)
    ids = torch.randint(
        0, args.vocab, (args.seqs, args.length), generator=torch.Generator().manual_seed(1)
    )
    policy = lora.wrap(build(args.hidden, args.layers, args.vocab, 0), LoraConfig(rank=args.rank))
    rows = []
    for size in (float(s) for s in args.sizes.split(",")):
        g = torch.Generator().manual_seed(2)
        with torch.no_grad():
            for name, p in lora.adapter_parameters(policy):
                if ".lora_B." in name:
                    p.copy_(torch.randn(p.shape, generator=g) * size)
        truth = logp(policy, ids, bf16=False)  # (fp32: what the adapters mean)
        moved = (truth - logp(base, ids, bf16=False)).abs().mean().item()
        learner = (logp(policy, ids) - truth).abs().mean().item()
        merged_lp = logp(merged_copy(policy, build(args.hidden, args.layers, args.vocab, 0)), ids)
        merged = (merged_lp - truth).abs().mean().item()
        rows.append({"b_std": size, "moved": moved, "learner_err": learner, "merged_err": merged})
    print(f"# Merged bf16 publish against the learner's bf16 forward: Qwen2 shape, hidden "
          f"{args.hidden}, {args.layers} layers, rank {args.rank} on every linear layer, "
          f"{args.seqs} x {args.length} random tokens; mean absolute log-prob differences "
          "from the adapted policy computed in fp32\n")  # fmt: skip
    print("| B std | the policy's move from the base (fp32) | learner, bf16 (adapters apart) | "
          "merged weights, bf16 |")  # fmt: skip
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['b_std']:g} | {r['moved']:.2e} | {r['learner_err']:.2e} | "
              f"{r['merged_err']:.2e} |")  # fmt: skip
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
