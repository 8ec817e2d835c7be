"""The policy model and tokenizer factory.

Real checkpoints (a local directory or a hub id) load through the ordinary ``from_pretrained``
path. With no checkpoint, a tiny random-initialized Llama-architecture model (Qwen2's biased
attention projections, a head size of its own) is built from the config,
with a character-level tokenizer that the project builds itself (no download anywhere).
``build_bpe_tokenizer`` makes the tokenizer of a real-shaped local checkpoint (``reval
make-model``): byte-level BPE with Qwen2's pre-tokenizer, Qwen's special tokens and a Qwen2.5-style
chat template, saved as a ``Qwen2Tokenizer`` that ``AutoTokenizer`` loads like a hub one.
"""

from __future__ import annotations

import contextlib
import json
import string
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    trainers,
)
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)
from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

from reval.answers import stop_token_ids
from reval.config import ModelConfig, TinyModelConfig
from reval.paths import ModelNotFound, check_model

PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"
# Every printable ASCII character is one token; enough for the built-in tasks and for boxed math.
CHARSET = string.digits + string.ascii_letters + string.punctuation + " \n"


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level tokenizer: ids 0..2 are pad/eos/unk, then one id per character."""
    vocab = {PAD: 0, EOS: 1, UNK: 2}
    for ch in CHARSET:
        vocab.setdefault(ch, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=PAD, eos_token=EOS, unk_token=UNK
    )
    fast.padding_side = "left"
    return fast


ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
QWEN_SPECIALS = (ENDOFTEXT, IM_START, IM_END)
"""Qwen's special tokens, in Qwen's order after the learned vocabulary. As in Qwen2.5-Instruct,
``<|im_end|>`` is the EOS and ``<|endoftext|>`` the pad token (distinct)."""
DEFAULT_SYSTEM = "You are a helpful assistant."

QWEN_CHAT_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>system\\n" + DEFAULT_SYSTEM + "<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if not (message['role'] == 'system' and loop.first) %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
"""Qwen2.5-Instruct's chat template without tool calls: a default system message, each turn
``<|im_start|>role\\n...<|im_end|>\\n``, the generation prompt ``<|im_start|>assistant\\n``."""


def build_bpe_tokenizer(
    texts: list[str], out: str | Path, vocab_size: int = 1024
) -> PreTrainedTokenizerBase:
    """Train a byte-level BPE tokenizer on ``texts``, write it to ``out`` as a hub checkpoint's
    tokenizer (``tokenizer.json`` + a ``tokenizer_config.json`` naming ``Qwen2Tokenizer``, as
    Qwen2.5's does) and load it back through ``AutoTokenizer``. The normalizer, pre-tokenizer and
    decoder are Qwen2's (the ones ``Qwen2Tokenizer`` builds), so the copy loads as written on
    transformers 4 (``Qwen2TokenizerFast`` from the file) and 5. Every byte is a token (any text
    round-trips); Qwen's special tokens follow the learned vocabulary (at most ``vocab_size``
    tokens in all)."""
    bpe = Tokenizer(
        models.BPE(unk_token=None, continuing_subword_prefix="", end_of_word_suffix="",
                   fuse_unk=False, byte_fallback=False)
    )  # fmt: skip
    bpe.normalizer = normalizers.NFC()
    bpe.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])  # fmt: skip
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(QWEN_SPECIALS),
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(texts, trainer)
    bpe.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in QWEN_SPECIALS])
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    bpe.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "eos_token": IM_END,
        "pad_token": ENDOFTEXT,
        "bos_token": None,
        "unk_token": None,
        "additional_special_tokens": [IM_START, IM_END],
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "errors": "replace",
        "split_special_tokens": False,
        "model_max_length": 32768,
        "chat_template": QWEN_CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return _load_tokenizer(str(out))


def build_tiny_model(
    shape: TinyModelConfig, vocab_size: int, pad_id: int, eos_id: int, seed: int
) -> LlamaForCausalLM:
    """A random-initialized causal LM of the given shape (deterministic in ``seed``): Llama's
    architecture, which HF and vLLM both build with ``head_dim`` as given (vLLM's Qwen2 derives
    it from the hidden size), with biased projections in attention like Qwen2's."""
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads,
        head_dim=shape.head_size,
        attention_bias=True,
        max_position_embeddings=shape.max_position_embeddings,
        tie_word_embeddings=True,
        pad_token_id=pad_id,
        eos_token_id=eos_id,
        bos_token_id=None,
    )
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = LlamaForCausalLM(config)
    finally:
        torch.random.set_rng_state(state)
    return model


def resolve_device(choice: str) -> torch.device:
    if choice == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if choice == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("model.device=cuda but no CUDA device is available")
    return torch.device(choice)


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class Policy:
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    device: torch.device

    @property
    def pad_id(self) -> int:
        return int(self.tokenizer.pad_token_id)  # type: ignore[arg-type]

    @property
    def eos_id(self) -> int:
        return int(self.tokenizer.eos_token_id)  # type: ignore[arg-type]

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """What ends an answer (``reval.answers.stop_token_ids``): EOS, the model's generation
        config's EOS list, the chat template's end of turn."""
        gen = getattr(self.model, "generation_config", None)
        return stop_token_ids(self.tokenizer, getattr(gen, "eos_token_id", None))


_GENERIC_TOKENIZERS = ("TokenizersBackend", "PreTrainedTokenizerFast")
"""``tokenizer_class`` of a tokenizer saved from a ``tokenizers`` object (the project's own char
tokenizer): it loads as written. ``AutoTokenizer`` would pick the class of the model's type
(``Qwen2Tokenizer`` beside a Qwen2 config), whose own pre-tokenizer drops spaces."""


def _load_tokenizer(path: str) -> PreTrainedTokenizerBase:
    config = Path(path) / "tokenizer_config.json"
    if config.is_file():
        with contextlib.suppress(ValueError, OSError):
            if json.loads(config.read_text()).get("tokenizer_class") in _GENERIC_TOKENIZERS:
                fast = PreTrainedTokenizerFast.from_pretrained(path, padding_side="left")
                return fast
    tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(path, padding_side="left")
    return tokenizer


def model_source(name_or_path: str, field: str = "model.name_or_path") -> str:
    """``name_or_path`` checked before transformers sees it (``reval.paths.check_model``): a
    local checkpoint directory, or a hub id. A local-looking path that is not a checkpoint is a
    ``ModelNotFound`` at once (from_pretrained would spend a minute retrying the hub, then report
    a malformed or unknown repo id)."""
    return check_model(name_or_path, field)


def compute_dtype(cfg: ModelConfig) -> torch.dtype:
    """``model.dtype``: what the learner computes in and the generators hold their weights in;
    the policy's parameters (the learner's masters) are fp32 whatever it is."""
    return _DTYPES[cfg.dtype]


def enable_checkpointing(model: PreTrainedModel) -> None:
    """Activation checkpointing, non-reentrant: the reentrant variant does not compose with
    FSDP2 (it reruns the forward outside autograd's view of the sharded parameters) and warns
    on every step in recent torch."""
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def load_policy(cfg: ModelConfig, seed: int = 0) -> Policy:
    """Build or load the policy model (fp32 parameters: ``compute_dtype``) and its tokenizer
    on the configured device."""
    device = resolve_device(cfg.device)
    if cfg.name_or_path is None:
        tokenizer: PreTrainedTokenizerBase = build_char_tokenizer()
        model: PreTrainedModel = build_tiny_model(
            cfg.tiny,
            vocab_size=len(tokenizer),
            pad_id=int(tokenizer.pad_token_id),  # type: ignore[arg-type]
            eos_id=int(tokenizer.eos_token_id),  # type: ignore[arg-type]
            seed=seed,
        )
    else:
        source = model_source(cfg.name_or_path)
        try:
            tokenizer = _load_tokenizer(source)
            model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
        except OSError as err:  # a hub id: not found, gated, or no network (one line, not a trace)
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise ModelNotFound(
                f"model.name_or_path: {source!r} could not be loaded: {first}",
                source,
                "model.name_or_path",
            ) from err
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
    if cfg.gradient_checkpointing is True:  # "auto": the learner decides (learner/memory.py)
        enable_checkpointing(model)
    model.to(device)
    return Policy(model=model, tokenizer=tokenizer, device=device)
