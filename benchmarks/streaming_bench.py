"""Hand-run benchmark: the streaming vLLM worker against the lockstep one, on the CPU build of vLLM
(the vLLM lane's venv), in the same run on the same engine.

    .venv-vllm/bin/python benchmarks/streaming_bench.py [--prompts 96] [--batch 16] [--n 4]
        [--median 24] [--sigma 1.0] [--max-tokens 384] [--update-s 2.0] [--grade-ms 5]
        [--modes lockstep,keep,recompute,finish,lockstep] [--json out.json]

Answer lengths are long-tailed: each prompt's ``max_tokens`` is drawn log-normal (median
``--median``, ``--sigma``, capped at ``--max-tokens``) from a fixed seed, the same for every mode;
the tests' tiny random model almost never samples EOS, so an answer runs to its prompt's
``max_tokens``. Lockstep is the ``rollout.streaming = false`` worker's loop: submit ``--batch``
prompts (``--n`` answers each), step until the batch's longest answer is done, then grade the
batch and look for weights. Streaming is ``rollout/streaming.py``'s ``Streamer`` with
``max_inflight = batch * n`` (the same engine load). Both grade each group with ``--grade-ms`` of
work (a sleep, standing for the grading pool); both see a new weight version announced every
``--update-s`` seconds (the checkpoint's weights again, read from a file by the vLLM worker).

Reported per mode: answer tokens/s, the engine's idle share (wall time with no request in it:
grading and loads in lockstep) and its mean occupancy (time-weighted share of the slots in use
during steps), and the delay from a weight announcement to the end of the first engine step under
it (its first sampled tokens). Figures go into docs/rollout.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


class Announcer:
    """The learner: a new version every ``period`` s from the first ``peek``; ``load`` reads
    the checkpoint's file into the engine as that version."""

    def __init__(self, engine: object, path: Path, period: float) -> None:
        self.engine = engine
        self.path = path
        self.period = period
        self.version: int = engine.policy_version  # type: ignore[attr-defined]
        self.at: dict[int, float] = {}
        self.loads: list[tuple[int, float, float]] = []
        self.next: float | None = None

    def peek(self) -> int:
        now = time.monotonic()
        if self.next is None:
            self.next = now + self.period
        while now >= self.next:
            self.version += 1
            self.at[self.version] = self.next
            self.next += self.period
        return self.version

    def load(self) -> int | None:
        v = self.version
        if v == self.engine.policy_version:  # type: ignore[attr-defined]
            return None
        t0 = time.monotonic()
        assert self.engine.receiver.load_file(self.path, v)  # type: ignore[attr-defined]
        self.loads.append((v, t0, time.monotonic()))
        return v


class StepClock:
    """Wraps ``engine.step``: each step's end time and its requests running."""

    def __init__(self, engine: object) -> None:
        self.engine = engine
        self.ends: list[float] = []
        self.busy = 0.0
        self.occupied = 0.0
        self.original = engine.step  # type: ignore[attr-defined]

    def install(self, slots: int, n: int) -> None:
        def step() -> list:
            t0 = time.monotonic()
            running = self.engine.running()  # type: ignore[attr-defined]
            out = self.original()
            t1 = time.monotonic()
            self.ends.append(t1)
            self.busy += t1 - t0
            self.occupied += (t1 - t0) * min(1.0, running / slots)
            return out

        self.engine.step = step  # type: ignore[attr-defined]

    def remove(self) -> None:
        del self.engine.step  # type: ignore[attr-defined]


def delays(ann: Announcer, ends: list[float]) -> list[float]:
    """Per version loaded: announcement -> end of the first step after its load."""
    out = []
    for v, _, t1 in ann.loads:
        after = [e for e in ends if e > t1]
        if after:
            out.append(after[0] - ann.at[v])
    return out


def run_lockstep(engine, tok, prompts, lengths, args, ann):  # type: ignore[no-untyped-def]
    from rollout.engines import SamplingParams

    clock = StepClock(engine)
    clock.install(args.batch * args.n, args.n)
    tokens, t0 = 0, time.monotonic()
    idle = 0.0
    try:
        for start in range(0, len(prompts), args.batch):
            ann.peek()
            t_idle = time.monotonic()
            ann.load()  # between batches
            for i in range(start, min(start + args.batch, len(prompts))):
                ids = tok(prompts[i].text, add_special_tokens=False).input_ids
                sp = SamplingParams(n=args.n, max_new_tokens=int(lengths[i]))
                engine.submit(f"L{i}", ids, sp, i)
            idle += time.monotonic() - t_idle
            done = []
            while engine.running():
                done += engine.step()
            t_idle = time.monotonic()
            for f in done:  # grading after the whole batch
                tokens += sum(int(s.token_ids.size) for s in f.samples)
                time.sleep(args.grade_ms / 1e3)
            idle += time.monotonic() - t_idle
    finally:
        clock.remove()
    wall = time.monotonic() - t0
    return report("lockstep", tokens, wall, idle, clock, ann)


def run_streaming(engine, tok, prompts, lengths, args, ann, mode):  # type: ignore[no-untyped-def]
    from rollout.engines import SamplingParams
    from rollout.streaming import Streamer

    by_text = {p.text: int(m) for p, m in zip(prompts, lengths, strict=True)}
    tokens = [0]

    def grade(group) -> None:  # type: ignore[no-untyped-def]
        tokens[0] += sum(int(s.token_ids.size) for s in group.samples)
        time.sleep(args.grade_ms / 1e3)

    clock = StepClock(engine)
    clock.install(args.batch * args.n, args.n)
    s = Streamer(engine, tok, lambda p: SamplingParams(n=args.n, max_new_tokens=by_text[p.text]),
                 grade, n=args.n, max_inflight=args.batch * args.n, inflight=mode, weights=ann,
                 key_prefix=mode)  # fmt: skip
    left = list(prompts)
    t0 = time.monotonic()
    try:
        stats = s.run(lambda k: [left.pop(0) for _ in range(min(k, len(left)))],
                      max_groups=len(prompts))  # fmt: skip
    finally:
        clock.remove()
    engine.inflight = "keep"
    wall = time.monotonic() - t0
    return report(mode, tokens[0], wall, stats.idle_s, clock, ann)


def report(mode, tokens, wall, idle, clock, ann):  # type: ignore[no-untyped-def]
    d = delays(ann, clock.ends)
    row = {
        "mode": mode,
        "tokens": tokens,
        "wall_s": round(wall, 2),
        "tokens_per_s": round(tokens / wall, 1),
        "idle_share": round(idle / wall, 3),
        "occupancy": round(clock.occupied / max(clock.busy, 1e-9), 3),
        "loads": len(ann.loads),
        "load_s_mean": round(float(np.mean([b - a for _, a, b in ann.loads])), 3)
        if ann.loads
        else None,
        "delay_s_mean": round(float(np.mean(d)), 3) if d else None,
        "delay_s_max": round(float(np.max(d)), 3) if d else None,
        "step_s_mean": round(clock.busy / max(len(clock.ends), 1), 4),
    }
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=96)
    p.add_argument("--batch", type=int, default=16, help="prompts per lockstep batch")
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--median", type=float, default=24.0)
    p.add_argument("--sigma", type=float, default=1.0)
    p.add_argument("--max-tokens", type=int, default=384)
    p.add_argument("--update-s", type=float, default=2.0)
    p.add_argument("--grade-ms", type=float, default=5.0)
    p.add_argument("--modes", default="lockstep,keep,recompute,finish,lockstep")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    from reval.config import TinyModelConfig
    from reval.policy import build_char_tokenizer, build_tiny_model
    from reval.weights.files import save_tensors
    from rollout.tasks import Prompt
    from rollout.vllm_engine import VLLMEngine, streaming_engine_kwargs

    shape = TinyModelConfig(hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2,
                            head_dim=64, intermediate_size=512,
                            max_position_embeddings=args.max_tokens + 64)  # fmt: skip
    tok = build_char_tokenizer()
    rng = np.random.default_rng(0)
    lengths = np.clip(np.rint(args.median * np.exp(args.sigma * rng.standard_normal(args.prompts))),
                      1, args.max_tokens).astype(int)  # fmt: skip
    prompts = [Prompt(id=f"p{i}", text=f"{i}*{i % 7}=", answer="") for i in range(args.prompts)]
    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_model(shape, len(tok), tok.pad_token_id, tok.eos_token_id, seed=0)
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        weights = Path(tmp) / "v.safetensors"
        named = [(k, v) for k, v in model.state_dict().items() if k != "lm_head.weight"]
        save_tensors(named, weights, 0)
        del model
        torch.set_num_threads(1)
        t0 = time.monotonic()
        engine = VLLMEngine(tmp, seed=0, dtype="float32", max_model_len=args.max_tokens + 64,
                            kv_cache_memory_bytes=256 << 20, max_num_seqs=args.batch * args.n,
                            **streaming_engine_kwargs("keep"))  # fmt: skip
        print(json.dumps({"engine_start_s": round(time.monotonic() - t0, 1),
                          "lengths": {"median": float(np.median(lengths)), "p90":
                                      float(np.percentile(lengths, 90)), "max": int(lengths.max()),
                                      "mean": float(lengths.mean())}}), flush=True)  # fmt: skip
        rows = []
        try:
            for mode in args.modes.split(","):
                ann = Announcer(engine, weights, args.update_s)
                if mode == "lockstep":
                    rows.append(run_lockstep(engine, tok, prompts, lengths, args, ann))
                else:
                    rows.append(run_streaming(engine, tok, prompts, lengths, args, ann, mode))
        finally:
            engine.close()
    # Against the mean of the lockstep runs (run it first and last: the machine's load drifts).
    base = [r["tokens_per_s"] for r in rows if r["mode"] == "lockstep"]
    if base:
        for r in rows:
            r["speedup"] = round(r["tokens_per_s"] / float(np.mean(base)), 2)
        print(json.dumps([(r["mode"], r["speedup"]) for r in rows]), flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)},
                                         "rows": rows}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
