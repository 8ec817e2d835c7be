"""benchmarks/sync_bench.py ``--lora``: bytes per publish of the adapters and of the full weights,
computed on the meta device, against counts by hand."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]

TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=100, tie_word_embeddings=True)  # fmt: skip


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    """benchmarks/sync_bench.py as a module (benchmarks/ is not a package)."""
    spec = importlib.util.spec_from_file_location(
        "sync_bench", ROOT / "benchmarks" / "sync_bench.py"
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["sync_bench"] = mod
    spec.loader.exec_module(mod)
    return mod


def by_hand(shape: dict[str, Any], rank: int) -> tuple[int, int]:
    """(full, adapter) parameters of a Qwen2 model: q/k/v with biases, o and the MLP without,
    two norms per layer and a final one; adapters ``rank * (in + out)`` on every linear layer of
    the decoder (not the output head)."""
    h, i, n = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    kv = h // shape["num_attention_heads"] * shape["num_key_value_heads"]
    heads = 1 if shape["tie_word_embeddings"] else 2
    layer = (h * h + h) + 2 * (h * kv + kv) + h * h + 3 * h * i + 2 * h
    full = heads * shape["vocab_size"] * h + n * layer + h
    adapter = n * rank * (2 * h + 2 * (h + kv) + 2 * h + 3 * (h + i))
    return full, adapter


def test_tiny_counted_by_hand(bench: ModuleType) -> None:
    # embed 100*64 = 6400; a layer: q 64*64+64 = 4160, k and v 64*32+32 = 2080 each,
    # o 4096, gate/up/down 64*96 = 6144 each, norms 128: 30976; final norm 64.
    full = 6400 + 2 * 30976 + 64
    # rank 8: q 8*(64+64) = 1024, k and v 8*(64+32) = 768, o 1024, gate/up/down 8*(64+96) = 1280
    adapter = 2 * (1024 + 768 + 768 + 1024 + 3 * 1280)
    got = bench.lora_bytes(TINY, 8)
    assert (got["full_bytes"], got["adapter_bytes"]) == (2 * full, 2 * adapter)  # bf16
    assert got["ratio"] == pytest.approx(adapter / full)
    assert by_hand(TINY, 8) == (full, adapter)
    untied = bench.lora_bytes({**TINY, "tie_word_embeddings": False}, 8)  # lm_head: no adapter
    assert (untied["full_bytes"], untied["adapter_bytes"]) == (2 * (full + 6400), 2 * adapter)


@pytest.mark.parametrize("name", ["qwen2.5-1.5b", "qwen2.5-7b"])
def test_real_shapes_counted_by_hand(bench: ModuleType, name: str) -> None:
    shape = bench.QWEN_SHAPES[name]
    full, adapter = by_hand(shape, 32)
    got = bench.lora_bytes(shape, 32)
    assert (got["full_bytes"], got["adapter_bytes"]) == (2 * full, 2 * adapter)
    if name == "qwen2.5-1.5b":
        assert adapter == 36_929_536  # learner/memory.py's count (reval doctor: 36.9M)
