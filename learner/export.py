"""A consolidated Hugging Face checkpoint (safetensors + config + tokenizer): what
``from_pretrained``, vLLM and ``reval eval`` load. The learner's own checkpoints are DCP
(``learner/checkpoint.py``); this is the export of one of its states."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def export_hf(model: Any, tokenizer: Any, path: Path) -> Path:
    """Write ``model`` (an unsharded ``PreTrainedModel``) and ``tokenizer`` to ``path``."""
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
