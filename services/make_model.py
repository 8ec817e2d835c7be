"""``reval make-data`` and ``reval make-model``: a real-shaped local checkpoint and its data.

``make-data OUT`` writes the generated word-problem set (``rollout/word_problems.py``):
``OUT/train.jsonl``, ``OUT/test.jsonl`` and ``OUT/benchmarks/wordmath.jsonl``.

``make-model OUT --data TRAIN.jsonl`` writes a Hugging Face checkpoint that loads from its path
exactly as a hub checkpoint does (``AutoTokenizer`` / ``AutoModelForCausalLM.from_pretrained``,
and vLLM): random weights of ``model.tiny``'s shape (seeded; Llama's architecture with Qwen2's
attention biases) and a byte-level BPE tokenizer trained with ``tokenizers`` on the project's own
corpus (the data's problems and worked solutions, and the prompt templates' text), with Qwen's
special tokens, a distinct pad token and a Qwen2.5-style chat template (``reval/policy.py``).
With ``--pretrain-steps`` the model is then pretrained on the answer *format* of the data under
the given prompt template (each problem followed by another problem's boxed answer: the right
shape, not the right answer), so RL starts from a model that answers in the format, at about
chance.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

log = logging.getLogger("reval.make_model")


def add_parser(sub: Any) -> None:
    d = sub.add_parser("make-data", help="write the generated word-problem set (train/test)")
    d.add_argument("out", help="output directory")
    d.add_argument("--per-kind", type=int, default=200, help="problems per kind (at most)")
    d.add_argument("--kinds", default="integer,negative,fraction,decimal,expression")
    d.add_argument("--test-fraction", type=float, default=0.2, help="held out per kind")
    d.add_argument("--seed", type=int, default=0)
    m = sub.add_parser("make-model", help="write a real-shaped local checkpoint (BPE, Qwen chat)")
    m.add_argument("out", help="output directory (a Hugging Face checkpoint)")
    m.add_argument("--data", required=True, help="DeepScaleR-format JSONL: corpus and format")
    m.add_argument("--vocab-size", type=int, default=1024, help="BPE vocabulary, at most")
    m.add_argument("--template", default="qwen_math", choices=["plain", "r1_distill", "qwen_math"])
    m.add_argument("--pretrain-steps", type=int, default=0, help="format pretraining steps")
    m.add_argument("--pretrain-lr", type=float, default=3e-3)
    m.add_argument("--pretrain-batch-size", type=int, default=32)
    m.add_argument("--seed", type=int, default=0)
    m.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="the model's shape, e.g. --set model.tiny.hidden_size=128 (repeatable)",
    )


def main(args: argparse.Namespace) -> int:
    if args.command == "make-data":
        from rollout.word_problems import write_dataset

        try:
            counts = write_dataset(
                args.out, args.per_kind, args.seed, tuple(args.kinds.split(",")),
                args.test_fraction,
            )  # fmt: skip
        except ValueError as err:
            print(f"reval make-data: {err}", file=sys.stderr)
            return 2
        print(json.dumps({"out": args.out, **counts}))
        return 0
    from reval.config import ConfigError, build_config, parse_overrides

    try:
        cfg = build_config(parse_overrides(args.overrides))
        info = make_model(
            args.out, args.data, cfg.model.tiny, args.vocab_size, args.seed, args.template,
            args.pretrain_steps, args.pretrain_lr, args.pretrain_batch_size,
        )  # fmt: skip
    except (ConfigError, ValueError, FileNotFoundError) as err:
        print(f"reval make-model: {err}", file=sys.stderr)
        return 2
    print(json.dumps(info))
    return 0


def corpus_texts(rows: list[dict[str, Any]]) -> list[str]:
    """The tokenizer's corpus: problems, worked solutions and the templates' fixed text."""
    from reval.policy import DEFAULT_SYSTEM
    from rollout.math_task import QWEN_MATH_SYSTEM, USER_SUFFIX

    texts = [f"{r.get('problem', '')}\n{r.get('solution', '')}" for r in rows]
    fixed = [QWEN_MATH_SYSTEM, DEFAULT_SYSTEM, USER_SUFFIX, "system\n", "user\n", "assistant\n"]
    return texts + fixed * max(1, len(rows) // 10)


def make_model(
    out: str | Path,
    data: str | Path,
    shape: Any,
    vocab_size: int = 1024,
    seed: int = 0,
    template: str = "qwen_math",
    pretrain_steps: int = 0,
    pretrain_lr: float = 3e-3,
    pretrain_batch_size: int = 32,
) -> dict[str, Any]:
    """Build, optionally pretrain on the format, and save the checkpoint; returns what was made."""
    import torch

    from learner.pretrain import pretrain
    from reval.policy import Policy, build_bpe_tokenizer, build_tiny_model
    from rollout.math_task import MathTask, read_rows

    if not Path(data).is_file():
        raise FileNotFoundError(f"--data {data}: no such file")
    rows = [dict(r) for r in read_rows(str(data))]
    out = Path(out)
    tokenizer = build_bpe_tokenizer(corpus_texts(rows), out, vocab_size)  # written to out
    model = build_tiny_model(
        shape, len(tokenizer), int(tokenizer.pad_token_id), int(tokenizer.eos_token_id), seed
    )
    info: dict[str, Any] = {
        "out": str(out),
        "vocab_size": len(tokenizer),
        "parameters": sum(p.numel() for p in model.parameters()),
        "template": template,
        "seed": seed,
    }
    if pretrain_steps > 0:
        policy = Policy(model, tokenizer, torch.device("cpu"))
        task = MathTask.from_rows(rows, template, tokenizer)
        info["pretrain_steps"] = pretrain_steps
        try:  # (the pairings are graded by the task's math-verify pool first)
            info["pretrain_loss"] = pretrain(
                policy, task.pretrain_texts, pretrain_steps, pretrain_lr, pretrain_batch_size, seed
            )
        finally:
            task.verifier.close()  # type: ignore[attr-defined]
    model.save_pretrained(out)
    (out / "make_model.json").write_text(json.dumps(info, indent=2) + "\n")
    log.info("checkpoint written: %s", json.dumps(info))
    return info
