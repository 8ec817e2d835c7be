"""What runs inside vLLM's worker processes (``RevalWorkerExtension``, mixed into the worker
class through ``worker_extension_cls``) and the rollout process's hand on it (``VLLMReceiver``,
``VLLMEngine.receiver``): the ``WeightReceiver`` protocol forwarded by ``LLM.collective_rpc`` to a
``LocalReceiver`` next to the model. ``rollout/vllm_engine.py``'s docstring says what of vLLM
this relies on; LoRA adapters (``model.lora.publish = "adapter"``) are ``rollout/vllm_lora.py``.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import Tensor, nn

from reval.lora import is_adapter
from reval.weights.receiver import LocalReceiver
from rollout.vllm_lora import all_adapters, write_adapter


class Engine(Protocol):
    """What ``VLLMReceiver`` needs of ``VLLMEngine`` (named here: the engine imports this)."""

    llm: Any

    def _weights_changed(self, version: int) -> None: ...


class RevalWorkerExtension:
    """Mixed into vLLM's worker (GPU or CPU) through ``worker_extension_cls`` and called with
    ``LLM.collective_rpc``; runs in the worker process, next to the model. ``self`` is the vLLM
    ``Worker`` (``device``, ``rank``, ``reload_weights``). Names start with ``reval_``: vLLM
    refuses an extension whose attributes clash with the worker's."""

    if TYPE_CHECKING:
        device: torch.device
        rank: int
        _reval_receiver: LocalReceiver | None
        _reval_lora: tuple[Path, float, int] | None
        _reval_adapters: int

        def reload_weights(self, *args: Any, **kwargs: Any) -> None: ...

        def get_model(self) -> nn.Module: ...

    def _reval_reload(self, weights: Iterable[tuple[str, Tensor]]) -> None:
        """vLLM's in-place reload (``model_executor/model_loader/reload/``): each layer is
        restored to its checkpoint layout, loaded, processed (the CPU backend's repacking,
        quantization) and copied back into the tensors the kernels use. One call per version:
        a layer whose weights arrived only in part would be processed half-loaded."""
        with torch.no_grad():
            self.reload_weights(weights_iterator=weights)
            self._reval_process_tied()

    def _reval_process_tied(self) -> None:
        """Process again every layer whose weight is tied to another layer's (the LM head tied
        to the embedding): the reload processes only the layer that loaded the weight, so the
        CPU backend's packed GEMM copy of a tied LM head (``dispatch_cpu_unquantized_gemm``)
        would keep the old weights (measured: log-probs off by 0.8 after a reload). On CUDA the
        unquantized embedding's processing does nothing."""
        owners: dict[int, list[nn.Module]] = {}
        for module in self.get_model().modules():
            weight = module._parameters.get("weight")
            if weight is not None:
                owners.setdefault(id(weight), []).append(module)
        for modules in owners.values():
            if len(modules) < 2:
                continue
            for module in modules:
                method = getattr(module, "quant_method", None)
                if method is not None:
                    method.process_weights_after_loading(module)

    def _reval_load(self, weights: Iterable[tuple[str, Tensor]], version: int) -> None:
        """A version: full weights reload in place; with LoRA on (``reval_set_lora``), a
        version of adapters is written where the rollout process loads it into vLLM's adapter
        slot (``rollout/vllm_lora.py``)."""
        lora = getattr(self, "_reval_lora", None)
        if lora is None:
            self._reval_reload(weights)
            return
        it = iter(weights)
        first = next(it, None)
        if first is None:
            return
        if not is_adapter(first[0]):  # (a base file, or a learner publishing merged)
            self._reval_reload(itertools.chain([first], it))
            return
        writes = getattr(self, "rank", 0) == 0  # (one directory: every rank reads rank 0's)
        adapters = [(n, t.to("cpu") if writes else t) for n, t in itertools.chain([first], it)]
        if not all_adapters([n for n, _ in adapters]):
            raise ValueError(f"weights v{version} mix adapters and full weights")
        if writes:
            write_adapter(adapters, lora[0], lora[1], lora[2], version)
        self._reval_adapters = getattr(self, "_reval_adapters", 0) + 1

    def reval_set_lora(self, directory: str, alpha: float, rank: int) -> None:
        """Adapter versions go to ``directory`` as a PEFT adapter of ``rank`` and scale
        ``alpha / rank``."""
        self._reval_lora = (Path(directory), float(alpha), int(rank))

    def reval_adapters(self) -> int:
        """How many adapter versions this worker has received and written."""
        return int(getattr(self, "_reval_adapters", 0))

    def _reval_here(self) -> LocalReceiver:
        """This worker's receiver (the one ``LocalReceiver`` code, next to the model)."""
        r = getattr(self, "_reval_receiver", None)
        if r is None:
            r = self._reval_receiver = LocalReceiver(self._reval_load, self.device)
        return r

    def reval_load_file(self, path: str, version: int) -> bool:
        return self._reval_here().load_file(Path(path), version)

    def reval_join(self, address: str, worker_id: str, timeout_s: float) -> bool:
        member = f"{worker_id}/vllm{getattr(self, 'rank', 0)}"
        return self._reval_here().join(address, member, timeout_s)

    def reval_state(self) -> tuple[int | None, int]:
        """(the version received and not taken, versions received so far)."""
        r = self._reval_here()
        return r.ready(), r.received()

    def reval_take(self, version: int, newer_than: int) -> bool:
        """Load ``version`` if this worker holds it and it is newer than ``newer_than``."""
        newer = None if newer_than < 0 else newer_than
        return self._reval_here().take(newer, only=version) is not None

    def reval_leave(self) -> None:
        self._reval_here().leave()


class VLLMReceiver:
    """``VLLMEngine.receiver``: the ``WeightReceiver`` protocol, each call forwarded to the
    ``LocalReceiver`` inside every vLLM worker (``RevalWorkerExtension``). Tensor-parallel
    workers load a broadcast version only when all of them hold it."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.timeout_s = 60.0
        """The hub's timeout (from ``join``): how long workers may hold different versions."""

    def _rpc(self, method: str, *args: Any) -> list[Any]:
        return list(self.engine.llm.collective_rpc(method, args=args))

    def load_file(self, path: Path, version: int) -> bool:
        if not all(self._rpc("reval_load_file", str(path), version)):
            return False
        self.engine._weights_changed(version)
        return True

    def join(self, address: str, worker_id: str, timeout_s: float) -> bool:
        self.timeout_s = float(timeout_s)
        if not all(self._rpc("reval_join", address, worker_id, float(timeout_s))):
            self.leave()
            return False
        return True

    def take(self, newer_than: int | None) -> int | None:
        """The version every worker holds, loaded by all. A worker that received the next
        version between the state and the take declines (the others loaded): then the workers
        wait until they all hold one version again and load it, so they never keep different
        weights (at most the hub's timeout)."""
        partial, deadline = False, time.monotonic() + self.timeout_s
        while True:
            versions = {v for v, _ in self._rpc("reval_state")}
            version = versions.pop() if len(versions) == 1 else None
            if version is None:
                if not partial:
                    return None
                if time.monotonic() > deadline:
                    raise RuntimeError("the vLLM workers hold different weights")
                time.sleep(0.01)
                continue
            floor = -1 if partial or newer_than is None else newer_than
            loaded = self._rpc("reval_take", version, floor)
            if all(loaded):
                self.engine._weights_changed(version)
                return version
            if not any(loaded) and not partial:
                return None
            partial = True

    def received(self) -> int:
        return min(n for _, n in self._rpc("reval_state"))

    def adapters(self) -> int:
        """Adapter versions every worker has received (``rollout/vllm_lora.py``)."""
        return min(self._rpc("reval_adapters"))

    def leave(self) -> None:
        if self.engine.llm is not None:  # (None once the engine closed)
            self._rpc("reval_leave")


EXTENSION = f"{RevalWorkerExtension.__module__}.{RevalWorkerExtension.__qualname__}"
"""Qualified name for ``worker_extension_cls`` (imported by name in vLLM's worker process)."""

__all__ = ["EXTENSION", "RevalWorkerExtension", "VLLMReceiver"]
