"""Hand-run benchmark of the learner's update (issue 27): packed against padded micro-batches,
useful-token MFU against a plain Hugging Face step, on a GPU and on the CPU.

    .venv/bin/python benchmarks/learner_gpu_bench.py                 # CPU: ratios, docs/learner.md
    python benchmarks/learner_gpu_bench.py --gpu --out gpu.json       # one GPU: the 1.5B shape
    python benchmarks/learner_gpu_bench.py --gpu --shape 3b           # the largest that fits one
    python benchmarks/learner_gpu_bench.py --gpu --profile prof/      # + a profile of one update

On the CPU (the default without ``--gpu``):

1. Useful / computed tokens of the micro-batching on an RL-like length distribution (prompts
   uniform in 64-512 tokens, responses log-normal with median 2,000 and sigma ``--sigma``, capped
   at 8,192; 64 trajectories per update): the paper presets' padded micro-batches
   (``micro_batch_size = 8``, no token budget), padded with a 16k budget, and packed with the
   same budget (computed = what the forward runs on: padded count x (longest prompt + longest
   response), packed the sum of the lengths). At full scale, from the lengths alone.
2. Update times (a Llama-shaped model of width 128, 2 layers, vocabulary 512; ReVal, reference
   quantities cached; wall and this process's CPU time, the latter steadier on a shared machine)
   through ``Learner.update``, every length divided by ``--scale`` (a couple of minutes on two
   cores): on the RL-like lengths for the three micro-batchings (useful tokens/s), and on equal
   lengths (512 + 3,584 scaled) padded against packed with the same trajectories per
   micro-batch: the packed / padded time ratio, the configurations interleaved in one run, best
   of ``--reps`` (the machine is shared: the minimum is the least disturbed).

With ``--gpu`` (one rank, FSDP2 through ``learner.parallel.shard`` as ``reval learner`` runs it,
bf16 compute with fp32 masters, the project's model builder at a real model's shape and
vocabulary, random weights): for equal lengths (32 x (512 + 3,584)) and RL-like lengths (64
trajectories as above), the update of ReVal with the reference computed and with it cached, of
GRPO, and a plain HF step on the same tokens (the model's own loss over full logits, padded
micro-batches under the same token budget, AdamW): seconds per update (median of ``--reps``
after two warm-ups), useful tokens/s, useful-token MFU (6 N + causal attention FLOPs per useful
token, plus the reference forward where it runs, against ``--peak-tflops``) and peak memory.
Activation checkpointing as ``--checkpointing`` says (``auto``: ``learner/memory.py``'s plan,
printed). ``--attention loop`` runs packed rows through per-sequence sdpa instead of the flash
varlen kernel (``learner/sequence.py`` ``CUDA_VARLEN``); ``--compile`` compiles each decoder
layer before sharding. The same code runs on the CPU with ``--device cpu --shape tiny`` (its
smoke test: tests/unit/test_learner_gpu_bench.py).

``--lora RANK`` (GPU mode): after the full model's cases, that model freed, the ReVal update
(reference cached) of the same shape with rank-``RANK`` adapters on all linear layers
(``reval.lora.wrap`` after the memory plan, before sharding, as ``learner.parallel`` does; the
base is the reference): seconds, tokens/s, MFU on 4 N per token (the frozen base gets no weight
gradients) and peak memory, and the ratios to the full model's update (issue 41).

Targets (issue 27): packed useful / computed >= 0.97; packed no slower than padded on equal
lengths (CPU); on a GPU at the 1.5B shape with RL-like lengths, useful-token MFU >= 40% for ReVal
with a cached reference and >= 1.2x the plain HF step's throughput.
"""

from __future__ import annotations

import argparse
import functools
import gc
import time
from typing import Any

import numpy as np
import torch

from buffer.records import Trajectory
from learner.batches import micro_batches
from learner.trainer import Learner
from reval.config import AlgoConfig, LearnerConfig, TinyModelConfig
from reval.policy import build_tiny_model

PAD, EOS, VOCAB = 0, 1, 512
FULL_BUDGET = 16_384


def rl_lengths(n: int, rng: np.random.Generator, sigma: float) -> list[tuple[int, int]]:
    prompts = rng.integers(64, 513, n)
    responses = np.minimum(np.exp(np.log(2000.0) + sigma * rng.standard_normal(n)), 8192)
    return [(int(p), max(1, int(r))) for p, r in zip(prompts, responses, strict=True)]


def computed_tokens(sizes: list[tuple[int, int]], parts: list[list[int]], packed: bool) -> int:
    if packed:
        return sum(sizes[i][0] + sizes[i][1] for p in parts for i in p)
    return sum(len(p) * (max(sizes[i][0] for i in p) + max(sizes[i][1] for i in p)) for p in parts)


PLANS = {  # name: (micro_batch_size, token budget at full scale, packed)
    "padded, presets (8 per micro-batch, no budget)": (8, None, False),
    "padded, 16k budget": (64, FULL_BUDGET, False),
    "packed, 16k budget": (64, FULL_BUDGET, True),
}


def token_ratios(batches: int, batch: int, sigma: float, seed: int) -> None:
    rng = np.random.default_rng(seed)
    draws = [rl_lengths(batch, rng, sigma) for _ in range(batches)]
    print(
        f"useful / computed tokens, {batches} batches of {batch} RL-like trajectories (full scale)"
    )
    for name, (count, budget, packed) in PLANS.items():
        useful = computed = parts_n = 0
        for sizes in draws:
            parts = micro_batches(sizes, count, budget, packed)
            useful += sum(p + r for p, r in sizes)
            computed += computed_tokens(sizes, parts, packed)
            parts_n += len(parts)
        print(
            f"  {name:48s} {useful / computed:.3f}   micro-batches/update {parts_n / batches:.1f}"
        )


def trajectories(sizes: list[tuple[int, int]], seed: int, vocab: int = VOCAB) -> list[Trajectory]:
    rng = np.random.default_rng(seed)
    out = []
    for i, (p, r) in enumerate(sizes):
        resp = np.append(rng.integers(3, vocab, r - 1), EOS)
        out.append(
            Trajectory(
                prompt_ids=rng.integers(3, vocab, p),
                response_ids=resp,
                logprobs=-rng.random(r).astype(np.float32),
                reward_raw=float(i % 2),
                reward=float(i % 2),
                group_id=f"g{i // 8}",
            )
        )
    return out


def time_updates(
    model: torch.nn.Module,
    plans: dict[str, tuple[int, int | None, bool]],
    ts: list[Trajectory],
    reps: int,
) -> dict[str, tuple[float, float]]:
    """Each plan's (wall, CPU) seconds of one update, best of ``reps``."""
    learners = {
        name: Learner(
            model,
            LearnerConfig(lr=1e-7, micro_batch_size=c, max_tokens_per_micro_batch=b, packing=pk),
            AlgoConfig(name="reval"),
            PAD,
            EOS,
            torch.device("cpu"),
        )
        for name, (c, b, pk) in plans.items()
    }
    for lrn in learners.values():
        lrn.update(ts)  # warm-up; fills the reference quantities (cached from here on)
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in plans}
    for _ in range(reps):  # interleaved, so drift on a shared machine hits every plan alike
        for name, lrn in learners.items():
            t0, c0 = time.perf_counter(), time.process_time()
            lrn.update(ts)
            times[name].append((time.perf_counter() - t0, time.process_time() - c0))
    return {name: (min(w for w, _ in v), min(c for _, c in v)) for name, v in times.items()}


# -- the GPU mode ------------------------------------------------------------------------------

SHAPES = {  # name: TinyModelConfig fields + vocabulary (the real models' shapes)
    "1.5b": ({"hidden_size": 1536, "intermediate_size": 8960, "num_layers": 28, "num_heads": 12,
              "num_kv_heads": 2, "head_dim": 128}, 151_936),  # Qwen2.5-1.5B
    "3b": ({"hidden_size": 2048, "intermediate_size": 11008, "num_layers": 36, "num_heads": 16,
            "num_kv_heads": 2, "head_dim": 128}, 151_936),  # Qwen2.5-3B
    "tiny": ({"hidden_size": 64, "intermediate_size": 128, "num_layers": 2, "num_heads": 4,
              "num_kv_heads": 2, "head_dim": 16}, 512),  # the CPU smoke test
}  # fmt: skip
CASES = {  # name: (algo, reference recomputed every update)
    "ReVal, reference computed": ("reval", True),
    "ReVal, reference cached": ("reval", False),
    "GRPO": ("grpo", False),
}


def init_one_rank(device: str) -> torch.device:
    """A world of one (FSDP2 shards over it), as ``reval learner`` starts each rank."""
    import os
    import socket

    from learner.parallel import init_group

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for k, v in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0",
                 "WORLD_SIZE": "1", "LOCAL_RANK": "0"}.items():  # fmt: skip
        os.environ.setdefault(k, v)
    return init_group(device, "auto", 600)


def build(
    args: argparse.Namespace, device: torch.device, rank_lora: int = 0
) -> tuple[Any, Any, Any, Any]:
    """The run config, the sharded policy (fp32 masters), its bf16 reference and the plan;
    ``rank_lora``: the policy with rank-``rank_lora`` adapters on all linear layers (wrapped
    after the memory plan and before sharding, as ``learner.parallel`` does) and no reference
    model (the policy's base is its reference)."""
    import copy

    from torch.distributed.device_mesh import init_device_mesh

    from learner.memory import apply_plan
    from learner.parallel import shard
    from reval import lora
    from reval.config import RunConfig
    from reval.policy import compute_dtype

    fields, vocab = SHAPES[args.shape]
    longest = (512 + 8192) // args.scale
    ckpt = {"auto": "auto", "on": True, "off": False}[args.checkpointing]
    cfg = RunConfig.model_validate({
        "model": {"dtype": "bfloat16" if device.type == "cuda" else "float32",
                  "device": device.type, "gradient_checkpointing": ckpt,
                  "tiny": {**fields, "max_position_embeddings": longest + 64}},
        "task": {"max_prompt_tokens": 512 // args.scale},
        "rollout": {"max_new_tokens": 8192 // args.scale},
        "learner": {"lr": 1e-7, "micro_batch_size": 64,
                    "max_tokens_per_micro_batch": FULL_BUDGET // args.scale, "packing": "auto"},
        "algo": {"beta": 0.002},
    })  # fmt: skip
    if rank_lora:
        cfg.model.lora.rank = rank_lora
    dtype = compute_dtype(cfg.model)
    with torch.device(device):
        model = build_tiny_model(cfg.model.tiny, vocab, PAD, EOS, seed=0)
    plan = apply_plan(cfg, model, device)
    print(plan.describe())
    reference = None
    if rank_lora:
        model = lora.wrap(model, cfg.model.lora)
    else:
        reference = copy.deepcopy(model).to(dtype).requires_grad_(False).eval()
    if args.compile:  # (never with LoRA: main refuses --compile with --lora)
        for layer in model.model.layers:
            layer.compile()
    mesh = init_device_mesh(device.type, (1,))
    shard(model, mesh, dtype)
    if reference is not None:
        shard(reference, mesh, dtype, reshard_root=True)
    return cfg, model, reference, plan


def model_flops(
    model: Any, sizes: list[tuple[int, int]], reference: bool, lora: bool = False
) -> float:
    """FLOPs of one update's useful work: 6 N per token (the LM head included; the embedding
    lookup is free: N counts a tied matrix once) + causal attention, forward 2 L^2 d per layer
    and three times that with the backward; the reference forward (a third of that) where it
    runs. ``lora``: 4 N per token (the frozen base's weights get no gradient: the forward and
    the gradients of the activations)."""
    c = model.config
    n = sum(p.numel() for p in model.parameters())
    if not c.tie_word_embeddings:
        n -= model.get_input_embeddings().weight.numel()
    d = c.num_attention_heads * getattr(c, "head_dim", c.hidden_size // c.num_attention_heads)
    per = 0.0
    for p, r in sizes:
        length = p + r
        per += (4 if lora else 6) * n * length + 6 * c.num_hidden_layers * length**2 * d
    return per * (4 / 3 if reference else 1)


def hf_step(model: Any, optimizer: Any, ts: list[Trajectory], cfg: Any, device: Any) -> None:
    """A plain HF step on the same tokens: padded micro-batches under the same token budget,
    the model's own causal-LM loss over the responses (full logits), one AdamW step."""
    from learner.batches import micro_batches

    sizes = [(t.prompt_ids.size, t.response_ids.size) for t in ts]
    parts = micro_batches(sizes, cfg.learner.micro_batch_size,
                          cfg.learner.max_tokens_per_micro_batch, False)  # fmt: skip
    total = sum(r for _, r in sizes)
    for part in parts:
        rows = [np.concatenate([ts[i].prompt_ids, ts[i].response_ids]) for i in part]
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), PAD, dtype=torch.long)
        labels = torch.full((len(rows), width), -100, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for j, i in enumerate(part):
            n, p = len(rows[j]), ts[i].prompt_ids.size
            ids[j, :n] = torch.from_numpy(rows[j])
            labels[j, p:n] = ids[j, p:n]
            mask[j, :n] = 1
        out = model(input_ids=ids.to(device), attention_mask=mask.to(device),
                    labels=labels.to(device), use_cache=False)  # fmt: skip
        tokens = int((labels[:, 1:] != -100).sum())
        (out.loss * tokens / total).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def measure(run: Any, device: torch.device, reps: int) -> tuple[float, int]:
    """Median seconds of ``run()`` over ``reps`` after two warm-ups (the first updates of a
    learner allocate AdamW's state and warm the allocator and kernels), and the peak memory."""
    run()
    run()
    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        run()
        sync(device)
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else 0
    return sorted(times)[len(times) // 2], peak


def gpu_rows(args: argparse.Namespace, device: torch.device) -> list[dict[str, Any]]:
    from learner.parallel import reduce_scalar
    from reval.config import AlgoConfig
    from reval.policy import compute_dtype

    cfg, model, reference, _plan = build(args, device)
    vocab = SHAPES[args.shape][1]
    s = args.scale
    lengths = {
        "equal": [(512 // s, 3584 // s)] * 32,
        "RL-like": [(max(1, p // s), max(1, r // s))
                    for p, r in rl_lengths(64, np.random.default_rng(1), args.sigma)],
    }  # fmt: skip
    batches = {kind: trajectories(sizes, seed=2, vocab=vocab) for kind, sizes in lengths.items()}
    rows: list[dict[str, Any]] = []
    for kind, sizes in lengths.items():
        ts = batches[kind]
        useful = sum(p + r for p, r in sizes)
        for name, (algo, recompute) in CASES.items():
            learner = Learner(model, cfg.learner, AlgoConfig(name=algo, beta=0.002), PAD, EOS,
                              device, reference_model=reference, reduce=reduce_scalar,
                              compute_dtype=compute_dtype(cfg.model))  # fmt: skip

            def run(
                ts: list[Trajectory] = ts, recompute: bool = recompute, lrn: Any = learner
            ) -> None:
                if recompute:
                    for t in ts:
                        t.ref_version = -1
                lrn.update(ts)

            sec, peak = measure(run, device, args.reps)
            flops = model_flops(model, sizes, reference=recompute)
            rows.append(row(kind, name, sec, useful, flops, peak, args.peak_tflops))
            if args.profile and kind == "RL-like" and name == "ReVal, reference cached":
                profile(run, args.profile, f"{args.shape}-{kind}")
            del learner, run
            if device.type == "cuda":
                torch.cuda.empty_cache()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-7)
        step = functools.partial(hf_step, model, optimizer, ts, cfg, device)
        sec, peak = measure(step, device, args.reps)
        flops = model_flops(model, sizes, reference=False)
        rows.append(row(kind, "plain HF step", sec, useful, flops, peak, args.peak_tflops))
        del optimizer, step
    if args.lora:  # (the full model's memory freed first: the peak is the LoRA run's own)
        del model, reference
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        rows += lora_rows(args, device, lengths, batches)
    return rows


def lora_name(rank: int) -> str:
    return f"ReVal, LoRA r{rank}, reference cached"


def lora_rows(
    args: argparse.Namespace,
    device: torch.device,
    lengths: dict[str, list[tuple[int, int]]],
    batches: dict[str, list[Trajectory]],
) -> list[dict[str, Any]]:
    """``--lora RANK``: the ReVal update (reference cached) of the same shape with adapters on
    all linear layers: seconds, tokens/s, MFU on 4 N per token, peak memory."""
    from learner.parallel import reduce_scalar
    from reval.config import AlgoConfig
    from reval.policy import compute_dtype

    cfg, model, _none, _plan = build(args, device, args.lora)
    rows = []
    for kind, sizes in lengths.items():
        ts = batches[kind]
        for t in ts:  # (the reference is the adapters' base now: computed at the warm-up)
            t.ref_version = -1
        learner = Learner(model, cfg.learner, AlgoConfig(name="reval", beta=0.002), PAD, EOS,
                          device, reduce=reduce_scalar,
                          compute_dtype=compute_dtype(cfg.model))  # fmt: skip
        sec, peak = measure(functools.partial(learner.update, ts), device, args.reps)
        flops = model_flops(model, sizes, reference=False, lora=True)
        useful = sum(p + r for p, r in sizes)
        rows.append(row(kind, lora_name(args.lora), sec, useful, flops, peak, args.peak_tflops))
        del learner
    return rows


def row(kind: str, name: str, sec: float, useful: int, flops: float, peak: int,
        peak_tflops: float) -> dict[str, Any]:  # fmt: skip
    return {"lengths": kind, "update": name, "s": sec, "useful_tokens": useful,
            "tokens_per_s": useful / sec, "mfu": flops / sec / (peak_tflops * 1e12),
            "peak_gb": peak / 1e9}  # fmt: skip


def profile(run: Any, out: str, tag: str) -> None:
    """One update under ``torch.profiler``: the top kernels by device time and a trace."""
    from pathlib import Path

    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with torch_profile(activities=acts) as prof:
        run()
    Path(out).mkdir(parents=True, exist_ok=True)
    key = "cuda_time_total" if torch.cuda.is_available() else "cpu_time_total"
    (Path(out) / f"{tag}.txt").write_text(prof.key_averages().table(sort_by=key, row_limit=40))
    prof.export_chrome_trace(str(Path(out) / f"{tag}.json"))


def gpu_main(args: argparse.Namespace) -> int:
    import json
    import platform

    from learner import sequence

    sequence.CUDA_VARLEN = args.attention == "varlen"
    device = init_one_rank(args.device)
    rows = gpu_rows(args, device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()
    print(f"\n{name}, torch {torch.__version__}, shape {args.shape}, lengths / {args.scale}, "
          f"checkpointing {args.checkpointing}, attention {args.attention}")  # fmt: skip
    print(f"{'lengths':8s} {'update':34s} {'s':>8s} {'tokens/s':>10s} {'MFU':>7s} {'peak GB':>8s}")
    for r in rows:
        print(f"{r['lengths']:8s} {r['update']:34s} {r['s']:8.3f} {r['tokens_per_s']:10.0f} "
              f"{r['mfu']:7.1%} {r['peak_gb']:8.1f}")  # fmt: skip
    by = {(r["lengths"], r["update"]): r for r in rows}
    ratios = {k: by[(k, "ReVal, reference cached")]["tokens_per_s"]
              / by[(k, "plain HF step")]["tokens_per_s"] for k in ("equal", "RL-like")}  # fmt: skip
    print("ReVal (reference cached) / plain HF step, tokens/s: "
          + ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items()))  # fmt: skip
    lora_vs_full = {}
    if args.lora:
        for k in ("equal", "RL-like"):
            full, low = by[(k, "ReVal, reference cached")], by[(k, lora_name(args.lora))]
            lora_vs_full[k] = {"s": low["s"] / full["s"], "peak": low["peak_gb"] / full["peak_gb"]
                               if full["peak_gb"] else None}  # fmt: skip
        print(f"LoRA r{args.lora} / full (ReVal, reference cached): " + ", ".join(
            f"{k} update {v['s']:.2f}x" + (f", peak {v['peak']:.2f}x" if v["peak"] else "")
            for k, v in lora_vs_full.items()))  # fmt: skip
    if args.out:
        facts = {"device": name, "torch": torch.__version__, "args": vars(args), "rows": rows,
                 "ratio_vs_hf": ratios, "lora_vs_full": lora_vs_full,
                 "varlen_failed": sequence._VARLEN_FAILED}  # fmt: skip
        with open(args.out, "w") as f:
            json.dump(facts, f, indent=1)
    torch.distributed.destroy_process_group()
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--scale", type=int, default=16, help="lengths divided by this for timing")
    ap.add_argument("--sigma", type=float, default=0.8, help="log-normal sigma of the responses")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--batches", type=int, default=200, help="draws for the token ratios")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--gpu", action="store_true", help="the GPU mode (module docstring)")
    ap.add_argument("--device", default="cuda", help="--gpu: cuda, or cpu for its smoke test")
    ap.add_argument("--shape", default="1.5b", choices=sorted(SHAPES))
    ap.add_argument("--checkpointing", default="auto", choices=["auto", "on", "off"])
    ap.add_argument("--attention", default="varlen", choices=["varlen", "loop"])
    ap.add_argument("--compile", action="store_true", help="torch.compile each decoder layer")
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="H100/H200 dense bf16")
    ap.add_argument("--profile", help="--gpu: write a torch.profiler table and trace here")
    ap.add_argument("--out", help="--gpu: write the figures here as JSON")
    ap.add_argument(
        "--lora",
        type=int,
        default=0,
        metavar="RANK",
        help="--gpu: also the ReVal update with rank-RANK adapters (all linear)",
    )
    args = ap.parse_args(argv)
    if args.compile and args.lora:  # (the LoRA policy is its own reference, run without
        # gradients: its compiled layers recompile past dynamo's limit and fall back, unevenly)
        ap.error("--compile and --lora together are not measured fairly: give one of them")
    if args.gpu:
        if args.scale == 16 and args.device == "cuda":
            args.scale = 1  # full lengths on a GPU
        args.reps = args.reps if args.reps != 7 else 3
        return gpu_main(args)
    torch.set_num_threads(args.threads)
    token_ratios(args.batches, args.batch, args.sigma, seed=0)

    s = args.scale
    shape = TinyModelConfig(
        hidden_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        intermediate_size=256,
        max_position_embeddings=8192 // s + 512 // s,
    )
    model = build_tiny_model(shape, VOCAB, PAD, EOS, seed=0)
    budget = FULL_BUDGET // s
    full = rl_lengths(args.batch, np.random.default_rng(1), args.sigma)
    sizes = [(max(1, p // s), max(1, r // s)) for p, r in full]
    ts = trajectories(sizes, seed=2)
    useful = sum(p + r for p, r in sizes)
    plans = {n: (c, None if b is None else budget, pk) for n, (c, b, pk) in PLANS.items()}
    print(
        f"\nupdate time, ReVal with the reference cached, {args.batch} RL-like trajectories at "
        f"1/{s} scale ({useful} useful tokens, budget {budget}), best of {args.reps}"
    )
    rl = time_updates(model, plans, ts, args.reps)
    for name, (t, c) in rl.items():
        print(f"  {name:48s} {t:7.3f} s (CPU {c:7.3f} s)  {useful / t:8.0f} useful tokens/s")

    eq = trajectories([(512 // s, 3584 // s)] * 32, seed=3)
    n = 512 // s + 3584 // s
    eq_plans = {
        "padded (8 per micro-batch)": (8, None, False),
        "packed (8 per micro-batch)": (8, 8 * n, True),
    }
    times = time_updates(model, eq_plans, eq, args.reps)
    print(f"\nequal lengths, 32 x ({512 // s} + {3584 // s}) tokens, best of {args.reps}")
    for name, (t, c) in times.items():
        print(f"  {name:48s} {t:7.3f} s (CPU {c:7.3f} s)")
    (a, ac), (b, bc) = times.values()
    print(f"  packed / padded time: {b / a:.3f} wall, {bc / ac:.3f} CPU")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
