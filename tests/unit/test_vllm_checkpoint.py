"""The vLLM worker's set-up that needs no vLLM: the release gate, the engine seed per worker,
and what a vLLM rollout worker starts from when the run has no checkpoint (``model.name_or_path``
unset): the tiny model saved as one, and the character tokenizer saved apart from it so that it
reloads as itself. (The engine itself runs in the vLLM lane: tests marked ``vllm``.)"""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from reval.config import load_config
from reval.policy import build_char_tokenizer
from rollout.generators import engine_seed, tiny_checkpoint
from rollout.vllm_engine import check_vllm_version

TEXTS = ["Code? ", " a b ", "3+4=", "What is 12 + 30?\n"]


def test_the_tokenizer_reloads_as_itself(tmp_path: Path) -> None:
    cfg = load_config(environ={})  # the demo's model, as `reval rollout --engine vllm` saves it
    model_dir, tok_dir = tiny_checkpoint(cfg, 0, tmp_path)
    assert (Path(model_dir) / "config.json").is_file()
    assert not (Path(tok_dir) / "config.json").exists()
    char = build_char_tokenizer()
    loaded = AutoTokenizer.from_pretrained(tok_dir)
    for text in TEXTS:
        ids = char(text, add_special_tokens=False).input_ids
        assert loaded(text, add_special_tokens=False).input_ids == ids, text
        assert loaded.decode(ids) == text
    assert (loaded.eos_token_id, loaded.pad_token_id) == (char.eos_token_id, char.pad_token_id)
    # Beside the model's config.json as well: the model type (Llama) no longer picks a tokenizer
    # class of its own on transformers 5 (beside a Qwen2 config it picked Qwen2's, which drops
    # spaces), and transformers 4.56, the floor (make test-floors), keeps the saved class.
    char.save_pretrained(model_dir)
    beside = AutoTokenizer.from_pretrained(model_dir)
    assert beside(" a b ", add_special_tokens=False).input_ids == char(" a b ").input_ids


def test_a_head_size_vllm_cannot_run_is_refused_with_the_fix(tmp_path: Path) -> None:
    cfg = load_config(overrides=["model.tiny.head_dim=null"], environ={})  # 64 / 4 heads = 16
    with pytest.raises(ValueError, match=r"head size is 16.*model.tiny.head_dim=32"):
        tiny_checkpoint(cfg, 0, tmp_path)
    assert not any(tmp_path.iterdir())  # refused before anything is written


def test_each_worker_samples_from_its_own_stream() -> None:
    seeds = {engine_seed(0, f"w{i}") for i in range(100)}
    assert len(seeds) == 100 and all(0 <= s < 2**31 for s in seeds)
    assert engine_seed(0, "w0") == engine_seed(0, "w0") != engine_seed(1, "w0")


@pytest.mark.parametrize("version", ["0.32.0", "0.32.3", "0.32.1+cpu"])
def test_the_supported_release_line_passes_the_gate(version: str) -> None:
    check_vllm_version(version)


@pytest.mark.parametrize("version", ["0.10.2", "0.31.0", "0.33.0", "1.32.0", "dev"])
def test_other_vllm_releases_are_refused_clearly(version: str) -> None:
    with pytest.raises(ImportError, match=r"not supported: reval runs on the vLLM 0\.32 release"):
        check_vllm_version(version)
