"""What ends an answer and what of it is graded: one stop set per tokenizer, one answer text.

Both engines stop on the same tokens (``HFEngine`` and ``VLLMEngine`` take the set this module
builds; vLLM as ``SamplingParams(stop_token_ids=...)``), and every place that grades an answer
(the lockstep round, the streaming worker, multi-turn environments, ``reval eval``) turns its
tokens into text with ``answer_text``. The stop set of a tokenizer is, in this order:

- its EOS (``tokenizer.eos_token_id``);
- the model's generation config's ``eos_token_id`` (an int or a list; a checkpoint's
  ``generation_config.json``; Qwen2.5-Instruct lists ``<|im_end|>`` and ``<|endoftext|>``);
- the chat template's end of turn: the special token the template writes right after an
  assistant message's content (Qwen's ``<|im_end|>``, Llama 3's ``<|eot_id|>``, Gemma's
  ``<end_of_turn>``), found by rendering a two-message conversation. A template that does not
  render such a conversation, or writes no special token there, adds nothing.

The answer text is the answer's tokens up to (not including) the first stop token, decoded with
every special token kept: ``\\boxed{4<unk>7}`` is graded as written, never as ``\\boxed{47}``.
Torch-free.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

_PROBE = "reval-probe-7f3a"
"""An assistant message's content when rendering the chat template (text no template holds)."""


def _ids(value: Any) -> list[int]:
    """An ``eos_token_id`` as a list: None, an int or a list of ints."""
    if value is None:
        return []
    if isinstance(value, int | str) or not isinstance(value, Iterable):
        return [int(value)]
    return [int(v) for v in value]


def end_of_turn_id(tokenizer: Any) -> int | None:
    """The special token the chat template writes right after an assistant message's content
    (None: no template, it does not render a user-assistant exchange, or no special token
    follows the content)."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": _PROBE}]
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False)
    except Exception:  # (a template may refuse any conversation it does not expect)
        return None
    if not isinstance(text, str) or _PROBE not in text:
        return None
    after = text[text.rindex(_PROBE) + len(_PROBE) :].lstrip()
    specials = set(getattr(tokenizer, "all_special_tokens", ()) or ())
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    specials |= {str(t) for t in added.values() if getattr(t, "special", False)}
    for token in sorted(specials, key=len, reverse=True):  # (the longest that fits)
        if token and after.startswith(token):
            tid = tokenizer.convert_tokens_to_ids(token)
            return None if tid is None else int(tid)
    return None


def stop_token_ids(tokenizer: Any, generation_eos: Any = None) -> tuple[int, ...]:
    """The stop set (the module's docstring): EOS, then ``generation_eos`` (a generation
    config's ``eos_token_id``: None, an int or a list), then the chat template's end of turn;
    each id once, in that order. ValueError when the set is empty (no EOS anywhere)."""
    out: list[int] = []
    for tid in (*_ids(getattr(tokenizer, "eos_token_id", None)), *_ids(generation_eos),
                *_ids(end_of_turn_id(tokenizer))):  # fmt: skip
        if tid not in out:
            out.append(tid)
    if not out:
        raise ValueError("the tokenizer has no EOS token and the model declares none")
    return tuple(out)


def generation_eos_ids(source: str | Path) -> list[int]:
    """``eos_token_id`` of a checkpoint's generation config (a local directory's
    ``generation_config.json``, or a hub id's through transformers); [] when it has none."""
    path = Path(source)
    if path.is_dir():
        config = path / "generation_config.json"
        if not config.is_file():
            return []
        try:
            return _ids(json.loads(config.read_text()).get("eos_token_id"))
        except (ValueError, OSError, TypeError):
            return []
    try:
        from transformers import GenerationConfig

        return _ids(GenerationConfig.from_pretrained(str(source)).eos_token_id)
    except Exception:  # (no generation config, or no network: the tokenizer's EOS stands)
        return []


def cut_at_stop(token_ids: Sequence[int] | Any, stop_ids: Iterable[int]) -> list[int]:
    """The answer's tokens before the first stop token."""
    stops = set(int(t) for t in stop_ids)
    out: list[int] = []
    for t in token_ids:
        t = int(t)
        if t in stops:
            break
        out.append(t)
    return out


def answer_text(tokenizer: Any, token_ids: Sequence[int] | Any, stop_ids: Iterable[int]) -> str:
    """The text that is graded: the tokens before the first stop token, decoded with every
    special token kept (``skip_special_tokens=False``)."""
    text: str = tokenizer.decode(cut_at_stop(token_ids, stop_ids), skip_special_tokens=False)
    return text
