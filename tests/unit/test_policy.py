"""The policy factory: a saved tiny model loads back through the real-checkpoint path with the
same tokenizer (what `reval learner`'s set-up, the exports and `reval eval` rely on)."""

from __future__ import annotations

from reval.config import ModelConfig
from reval.policy import load_policy


def test_saved_char_tokenizer_loads_back_unchanged(tmp_path):
    built = load_policy(ModelConfig(device="cpu"))
    built.model.save_pretrained(tmp_path)
    built.tokenizer.save_pretrained(tmp_path)
    loaded = load_policy(ModelConfig(name_or_path=str(tmp_path), device="cpu"))
    # Beside a Qwen2 config, AutoTokenizer picked Qwen2Tokenizer, which dropped the spaces.
    for text in ("3+4= 7", "Answer: \\boxed{1 2}\n"):
        want = built.tokenizer(text, add_special_tokens=False).input_ids
        assert loaded.tokenizer(text, add_special_tokens=False).input_ids == want, text
        assert loaded.tokenizer.decode(want) == text
    assert (loaded.pad_id, loaded.eos_id) == (built.pad_id, built.eos_id)
    assert loaded.tokenizer.padding_side == "left"
