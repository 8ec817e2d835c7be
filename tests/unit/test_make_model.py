"""The real-shaped local checkpoint (``reval make-model``) and the generated word problems
(``reval make-data``): they load through the code path used for hub checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from reval.config import ModelConfig, TinyModelConfig
from reval.policy import load_policy
from rollout.eval_sets import load_benchmark
from rollout.math_task import format_prompt, read_rows
from rollout.word_problems import KINDS, generate, split
from services.cli import main as cli
from services.make_model import make_model

PROBLEM = "Ana has 3 apples and gets 4 more. How many apples does Ana have now?"
SUFFIX = " Let's think step by step and output the final answer within \\boxed{}."


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("made")
    assert cli(["make-data", str(root / "data"), "--per-kind", "40"]) == 0
    model = root / "model"
    make_model(model, root / "data" / "train.jsonl", TinyModelConfig(), vocab_size=512, seed=0)
    return root / "data", model


def test_loads_like_a_hub_checkpoint(made: tuple[Path, Path]) -> None:
    _, path = made
    tok = AutoTokenizer.from_pretrained(path)
    # the class its tokenizer_config.json names, as for a Qwen hub checkpoint (Qwen2TokenizerFast
    # on transformers 4)
    assert type(tok).__name__ in ("Qwen2Tokenizer", "Qwen2TokenizerFast")
    model = AutoModelForCausalLM.from_pretrained(path)
    # Llama's architecture: HF and vLLM both read its head size from the config (docs/demo.md)
    assert model.config.model_type == "llama" and model.config.attention_bias
    assert model.config.head_dim == TinyModelConfig().head_size == 32
    assert model.config.vocab_size == len(tok) <= 512
    ids = tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    assert ids == [len(tok) - 3, len(tok) - 2, len(tok) - 1]
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    assert tok.pad_token_id != tok.eos_token_id
    assert model.config.eos_token_id == tok.eos_token_id
    assert model.config.pad_token_id == tok.pad_token_id
    policy = load_policy(ModelConfig(name_or_path=str(path), device="cpu"))  # reval's own path
    assert type(policy.tokenizer) is type(tok)
    assert (policy.pad_id, policy.eos_id) == (tok.pad_token_id, tok.eos_token_id)
    assert policy.tokenizer.padding_side == "left"  # generation pads on the left


@pytest.mark.parametrize(
    "text",
    [
        PROBLEM,
        "\\boxed{\\frac{1}{2}} and \\boxed{-4}, \\boxed{3.5}, \\boxed{x+7}",
        "  two  spaces\nnew line\ttab",
        "unseen words: café, naïve, 東京 ✓",  # bytes outside the corpus
        "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
    ],
)
def test_token_ids_round_trip(made: tuple[Path, Path], text: str) -> None:
    _, path = made
    tok = AutoTokenizer.from_pretrained(path)
    ids = tok(text, add_special_tokens=False).input_ids
    assert tok.decode(ids) == text
    again = AutoTokenizer.from_pretrained(path)  # a second load: the same ids
    assert again(text, add_special_tokens=False).input_ids == ids


def test_special_tokens_are_single_ids(made: tuple[Path, Path]) -> None:
    _, path = made
    tok = AutoTokenizer.from_pretrained(path)
    ids = tok("<|im_start|>user\n", add_special_tokens=False).input_ids
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>")
    assert tok.decode(ids, skip_special_tokens=True) == "user\n"


def test_chat_templates(made: tuple[Path, Path]) -> None:
    """The paper's three templates through the checkpoint's chat template (literal strings)."""
    _, path = made
    tok = AutoTokenizer.from_pretrained(path)
    assert format_prompt(PROBLEM, "plain", tok) == PROBLEM
    assert format_prompt(PROBLEM, "qwen_math", tok) == (
        "<|im_start|>system\n"
        "Please reason step by step, and put your final answer within \\boxed{}.<|im_end|>\n"
        "<|im_start|>user\n" + PROBLEM + SUFFIX + "<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert format_prompt(PROBLEM, "r1_distill", tok) == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\n" + PROBLEM + SUFFIX + "<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n"
    )


def test_word_problems_schema_split_and_grading(made: tuple[Path, Path]) -> None:
    from rollout.grading.math_grading import MathVerify

    data, _ = made
    train = list(read_rows(str(data / "train.jsonl")))
    test = list(read_rows(str(data / "test.jsonl")))
    assert {r["kind"] for r in train} == {r["kind"] for r in test} == set(KINDS)
    assert not {r["problem"] for r in train} & {r["problem"] for r in test}
    for row in train + test:
        assert set(row) == {"problem", "answer", "solution", "kind"}
    answers = {r["kind"]: r["answer"] for r in test}
    assert int(answers["negative"]) < 0
    assert answers["fraction"].startswith("\\frac{")
    assert "." in answers["decimal"] and "x" in answers["expression"]
    grader = MathVerify()
    for row in test[:40]:  # each worked solution's boxed answer is right, in math-verify's eyes
        assert grader.grade(row["answer"], row["solution"]) == 1.0
    bench = load_benchmark("wordmath", data / "benchmarks", max_problems=1000)
    assert [p.answer for p in bench.problems] == [r["answer"] for r in test]


def test_generation_is_seeded_and_refuses_unknown_kinds() -> None:
    assert generate(10, seed=3) == generate(10, seed=3)
    assert generate(10, seed=3) != generate(10, seed=4)
    train, test = split(generate(10, seed=3), 0.2, seed=3)
    assert len(test) == 5 * 2 and len(train) == 5 * 8
    with pytest.raises(ValueError, match="unknown kinds"):
        generate(10, kinds=("integer", "calculus"))
    with pytest.raises(FileNotFoundError, match="generated locally"):
        load_benchmark("wordmath", None)


def test_make_model_cli_refuses_missing_data(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert cli(["make-model", str(tmp_path / "m"), "--data", str(tmp_path / "nope.jsonl")]) == 2
    assert "no such file" in capsys.readouterr().err
    assert not (tmp_path / "m").exists()


def test_make_model_pretrains_the_format(tmp_path: Path) -> None:
    data = tmp_path / "data"
    assert cli(["make-data", str(data), "--per-kind", "20"]) == 0
    info = make_model(tmp_path / "m", data / "train.jsonl", TinyModelConfig(), 512, 0,
                      "qwen_math", pretrain_steps=3, pretrain_batch_size=4)  # fmt: skip
    saved = json.loads((tmp_path / "m" / "make_model.json").read_text())
    assert saved == info and info["pretrain_steps"] == 3
    assert info["pretrain_loss"] == info["pretrain_loss"]  # a number, not nan


def test_format_pretraining_teaches_the_shape_not_the_answer() -> None:
    import random

    from rollout.grading.math_grading import last_boxed_answer
    from rollout.math_task import MathTask, answer_shape

    rows = generate(6, seed=1)  # (30 problems: every pairing is graded by math-verify first)
    task = MathTask.from_rows(rows)
    try:
        gold = {p.text: p for p in task.prompts}
        rng = random.Random(0)
        texts = [t for _ in range(4) for t in task.pretrain_texts(rng, 64)]
        pairs = []
        for text in texts:
            problem, _, _ = text.rpartition(" \\boxed{")
            answer = last_boxed_answer(text)
            assert answer is not None
            pairs.append((gold[problem], text[len(problem) :]))
        shaped = sum(answer_shape(last_boxed_answer(r) or "") == answer_shape(p.answer)
                     for p, r in pairs)  # fmt: skip
        assert shaped >= len(pairs) / 2  # the format: mostly an answer of the same shape
        # never a right one: another problem's answer that the task's grader marks wrong
        assert not any(r == f" \\boxed{{{p.answer}}}" for p, r in pairs)
        assert sum(task.verifier.score_many(pairs)) == 0  # type: ignore[attr-defined]
    finally:
        task.verifier.close()  # type: ignore[attr-defined]
