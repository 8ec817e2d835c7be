"""LoRA adapters served by vLLM (``model.lora.publish = "adapter"``, issue 41): the learner
publishes only the adapters (through the one weight seam: a file or a broadcast, read inside
vLLM's worker processes), and vLLM applies them to the base it holds.

How, in vLLM 0.32 (``vllm/lora/worker_manager.py``, ``vllm/lora/request.py``), checked on the
CPU by ``tests/integration/test_vllm_lora.py``:

- The engine starts with ``enable_lora``, ``max_lora_rank`` = the adapters' rank and one adapter
  slot (``max_loras = max_cpu_loras = 1``): ``engine_kwargs``.
- One adapter, ``ADAPTER_ID``, overwritten in place at every version: ``LLMEngine.add_lora``
  with ``LoRARequest(load_inplace=True)`` loads the new weights first (a bad adapter is refused
  before the old one goes), then replaces the slot's. vLLM therefore never holds more than one
  version: memory stays flat over any number of versions (the test loads 200). The requests
  carry the same id without ``load_inplace`` (with it, every step would load the adapter
  again: ``LRUCacheWorkerLoRAManager.add_adapter``).
- In-flight updates mean what they mean for full weights: the running answers' next tokens are
  sampled under the new adapter at once (the slot is theirs too); ``keep`` keeps their KV cache
  computed under the old one, ``recompute`` prefills them again, ``finish`` loads with the
  engine empty. The prefix cache is reset after each version (``VLLMEngine._weights_changed``):
  its keys hold the adapter's id, which stays the same.
- vLLM reads adapters from a PEFT directory: the worker that receives a version writes it
  (``write_adapter``: peft's file names, ``adapter_config.json`` with the rank and alpha) into a
  directory of the rollout process's (``/dev/shm`` when it has room: ``adapter_root``),
  tensor-parallel rank 0 only; ``add_lora`` then has every worker read it. One directory,
  overwritten per version: the adapter is only read during ``add_lora``.
- Before the first adapter, requests run on the base alone: the learner's initial adapters
  (``B = 0``) are exactly that.
- The lineage's base (``base-{lineage}.safetensors``, unwrapped names) loads through vLLM's
  in-place ``reload_weights`` like any full version, which empties the slot
  (``AdapterSlot.clear``): the lineage's first adapters follow at once. Requests admitted
  before the first adapter run on the base for good (the worker loads base and adapters before
  it generates anything).
- The rank is the worker's ``model.lora.rank``; adapters of another rank are refused (the scale
  ``alpha / rank`` would be wrong without a word).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from torch import Tensor

from reval.lora import ADAPTER, is_adapter
from reval.weights.files import save_tensors

ADAPTER_ID = 1
"""vLLM's id of the one adapter slot (ids start at 1)."""
ADAPTER_NAME = "reval"
SHM = "/dev/shm"
SHM_NEEDS = 1 << 30
"""Free bytes ``/dev/shm`` needs to hold the adapter directory (``adapter_root``)."""
WEIGHTS_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"


def engine_kwargs(rank: int) -> dict[str, Any]:
    """What ``vllm.LLM`` needs to serve adapters of ``rank`` in one slot."""
    return {"enable_lora": True, "max_lora_rank": int(rank), "max_loras": 1, "max_cpu_loras": 1}


def peft_name(name: str) -> str:
    """A learner's adapter parameter name as peft saves it (vLLM's loader reads those):
    ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight`` ->
    ``...q_proj.lora_A.weight``; names that lack the adapter's name pass unchanged."""
    return name.replace(f".{ADAPTER}.", ".")


def target_modules(names: Sequence[str]) -> list[str]:
    """The modules the adapters wrap, by their last name (``q_proj``...), from tensor names."""
    out = set()
    for name in names:
        module = name.split(".lora_")[0]
        out.add(module.rsplit(".", 1)[-1])
    return sorted(out)


def write_adapter(
    weights: Sequence[tuple[str, Tensor]], directory: Path, alpha: float, rank: int,
    version: int,
) -> None:  # fmt: skip
    """Write one version's adapters as a PEFT adapter directory vLLM loads: the tensors under
    peft's file names, the config with ``rank`` and ``alpha`` (this worker's ``model.lora``).
    Each file is written beside its final name and renamed (a reader never sees half a file;
    a failed write leaves nothing). ValueError when a tensor is not an adapter's or its rank is
    not ``rank`` (the learner's config and the worker's differ: vLLM would scale the adapters by
    the wrong ``alpha / rank`` without a word)."""
    if not weights:
        raise ValueError("an adapter version with no tensors")
    ranks = set()
    for name, t in weights:
        if not is_adapter(name) or t.dim() != 2:
            raise ValueError(f"{name!r} is not a LoRA adapter matrix")
        ranks.add(int(t.shape[0] if ".lora_A." in name else t.shape[1]))
    if ranks != {rank}:
        raise ValueError(
            f"weights v{version} hold LoRA adapters of rank {', '.join(map(str, sorted(ranks)))}; "
            f"this worker serves rank {rank} (model.lora.rank): give the learner and the "
            "workers the same model.lora"
        )
    names = [peft_name(n) for n, _ in weights]
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": float(alpha),
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": target_modules(names),
        "base_model_name_or_path": None,
        "modules_to_save": None,
    }
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / f".{WEIGHTS_FILE}.{os.getpid()}"
    try:
        save_tensors(zip(names, (t for _, t in weights), strict=True), tmp, version)
        os.replace(tmp, directory / WEIGHTS_FILE)
        tmp = directory / f".{CONFIG_FILE}.{os.getpid()}"
        tmp.write_text(json.dumps(config))
        os.replace(tmp, directory / CONFIG_FILE)
    finally:
        tmp.unlink(missing_ok=True)


def adapter_root() -> str | None:
    """Where an engine keeps its adapter directory: ``/dev/shm`` (memory) when it has a GiB
    free (Docker gives a container 64 MB by default: a 7B model's rank-64 adapters are 320 MB
    in bf16), else the temporary directory's default (None)."""
    try:
        free = shutil.disk_usage(SHM).free
    except OSError:
        return None
    return SHM if free >= SHM_NEEDS else None


def all_adapters(names: Sequence[str]) -> bool:
    """Whether a version's tensors are adapters (True) or full weights (False: a base file, or
    a learner publishing merged weights). ValueError on a mix."""
    kinds = {is_adapter(n) for n in names}
    if len(kinds) > 1:
        raise ValueError("a weights version mixes adapters and full weights")
    return kinds == {True}


class AdapterSlot:
    """The rollout process's side: the one adapter slot of a ``vllm.LLM``, loaded in place from
    the directory the workers write. ``request`` is what every request carries (None before
    the first adapter: the base alone)."""

    def __init__(self, llm: Any, directory: Path) -> None:
        self.llm = llm
        self.directory = directory
        self.request: Any = None
        self.loaded = 0
        """Adapter versions loaded into the slot so far."""

    def load(self, count: int) -> None:
        """Load the adapter in ``directory`` into the slot, replacing the one there (``count``:
        adapter versions the workers have received so far)."""
        from vllm.lora.request import LoRARequest

        path = str(self.directory)
        inplace = LoRARequest(ADAPTER_NAME, ADAPTER_ID, path, load_inplace=True)
        if not self.llm.llm_engine.add_lora(inplace):
            raise RuntimeError(f"vLLM did not load the LoRA adapter in {path}")
        self.request = LoRARequest(ADAPTER_NAME, ADAPTER_ID, path)
        self.loaded = count

    def clear(self) -> None:
        """Full weights were loaded (a lineage's base, or a learner publishing merged): no
        adapter applies to them until the next adapters arrive. vLLM's reload drops its adapters
        (``reset_lora_state``), but a request carrying the slot would load the last directory
        again, onto weights it was not trained for: the requests carry none from now on."""
        if self.request is None:
            return
        self.request = None
        if ADAPTER_ID in set(self.llm.llm_engine.list_loras()):
            self.llm.llm_engine.remove_lora(ADAPTER_ID)


__all__ = [
    "ADAPTER_ID",
    "AdapterSlot",
    "adapter_root",
    "all_adapters",
    "engine_kwargs",
    "peft_name",
    "target_modules",
    "write_adapter",
]
