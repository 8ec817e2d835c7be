"""The checkpoint of ``reval make-model`` (byte-level BPE tokenizer, Qwen's special tokens,
chat template) in the vLLM engine adapter, loaded from its path as a hub checkpoint is: vLLM's
tokenizer is the checkpoint's (ids, chat template, EOS ``<|im_end|>``, a distinct pad), its
behaviour log-probs equal HF's teacher-forced ones (the conformance suite's check), and
generation stops on ``<|im_end|>``.

The shape is make-model's default (``model.tiny``: heads of 32, vLLM's smallest on the CPU), the
one configs/cpu_math.toml's measured runs start from.
Marked ``vllm``: the vLLM lane runs it (``make test-vllm``). One engine for the module.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from reval.config import TinyModelConfig
from rollout.engines import SamplingParams
from rollout.math_task import format_prompt, read_rows
from rollout.vllm_engine import VLLMEngine
from rollout.word_problems import write_dataset
from services.make_model import make_model
from tests.integration.test_engine_conformance import assert_matches_reference, finish_reasons

pytestmark = pytest.mark.vllm

KINDS = ("decimal", "expression", "fraction")


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    """A checkpoint briefly pretrained on the answer format (so it ends answers with EOS), and
    held-out problems."""
    root = tmp_path_factory.mktemp("real_model")
    write_dataset(root / "data", per_kind=30, seed=0, kinds=KINDS)
    make_model(root / "model", root / "data" / "train.jsonl", TinyModelConfig(), template="plain",
               pretrain_steps=60)  # fmt: skip
    problems = [str(r["problem"]) for r in read_rows(str(root / "data" / "test.jsonl"))]
    return root / "model", problems


@pytest.fixture(scope="module")
def tokenizer(made: tuple[Path, list[str]]) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(made[0])


@pytest.fixture(scope="module")
def engine(made: tuple[Path, list[str]]) -> Iterator[VLLMEngine]:
    eng = VLLMEngine(str(made[0]), seed=0, dtype="float32", deterministic=True)
    yield eng
    eng.close()


def prompts(tok: PreTrainedTokenizerBase, problems: list[str], k: int = 6) -> list[list[int]]:
    texts = [format_prompt(p, "plain", tok) for p in problems[:k]]
    return [tok(t, add_special_tokens=False).input_ids for t in texts]


def test_vllm_uses_the_checkpoints_tokenizer(
    engine: VLLMEngine, tokenizer: PreTrainedTokenizerBase, made: tuple[Path, list[str]]
) -> None:
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    pad = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert engine.eos_id == tokenizer.eos_token_id == eos
    assert engine.pad_id == tokenizer.pad_token_id == pad != eos
    vtok = engine.tokenizer
    text = made[1][0] + " \\boxed{\\frac{3}{4}} <|im_end|>"
    assert vtok.encode(text, add_special_tokens=False) == tokenizer.encode(
        text, add_special_tokens=False
    )
    messages = [{"role": "user", "content": made[1][0]}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert "<|im_start|>assistant\n" in rendered
    assert vtok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == (
        rendered
    )


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (1.3, 0.8)])
def test_logprobs_match_teacher_forced(
    engine: VLLMEngine,
    tokenizer: PreTrainedTokenizerBase,
    made: tuple[Path, list[str]],
    temperature: float,
    top_p: float,
) -> None:
    model = AutoModelForCausalLM.from_pretrained(made[0], dtype=torch.float32).eval()
    ids = prompts(tokenizer, made[1])
    params = SamplingParams(n=4, temperature=temperature, top_p=top_p, max_new_tokens=24)
    out = engine.generate(ids, params, seed=5)
    assert_matches_reference(model, ids, out, temperature, top_p)


def test_generation_stops_on_im_end(
    engine: VLLMEngine, tokenizer: PreTrainedTokenizerBase, made: tuple[Path, list[str]]
) -> None:
    out = engine.generate(prompts(tokenizer, made[1]), SamplingParams(n=8, max_new_tokens=24), 3)
    reasons = finish_reasons(out, engine.eos_id, 24)
    stopped = [s.token_ids for samples in out for s in samples if s.finish_reason == "stop"]
    assert all(tokenizer.decode(ids.tolist()).endswith("<|im_end|>") for ids in stopped)
    assert reasons["stop"] > 0, reasons  # the format-pretrained model ends its answers
