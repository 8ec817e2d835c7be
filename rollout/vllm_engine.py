"""The vLLM generation engine: the same ``GenerationEngine`` protocol as ``HFEngine``, on GPU.

A thin adapter over ``vllm.LLM``. vLLM is imported lazily (in the constructor and in the worker
extension's methods), so this module imports on a machine without vLLM or a GPU.

Facts this adapter relies on, read in the vLLM sources (sdists from PyPI, v0.10.2 and v0.33.0;
v0.10.0, v0.10.1.1 and v0.11.0 checked where noted):

- Behaviour log-probs. ``logprobs_mode="processed_logprobs"`` (an engine argument,
  ``vllm/engine/arg_utils.py``) makes the V1 sampler return log-probs of the distribution it
  sampled from: ``log_softmax`` of the logits after temperature and top-k/top-p
  (``vllm/v1/sample/sampler.py`` ``Sampler.sample`` and ``vllm/v1/sample/ops/
  topk_topp_sampler.py`` ``forward_native`` in 0.10.2-0.33.0; ``vllm/v1/worker/gpu/sample/
  sampler.py`` for the V2 model runner in 0.33.0). In 0.10.0 and 0.10.1.1 the mode existed but
  "processed" meant *before* temperature and top-p (``vllm/v1/sample/sampler.py`` computes it
  right after the penalties), which is wrong for us: **vLLM >= 0.10.2 is required**. With a
  processed mode, FlashInfer's fused sampler is skipped because it cannot return those
  log-probs (``topk_topp_sampler.py`` in 0.10.2; ``fused_sampler_eligible`` in 0.33.0).
- ``SamplingParams(logprobs=0)`` still returns the sampled token's log-prob (the sampler gathers
  the sampled token first, then the top-k; ``Sampler.gather_logprobs``).
- ``SamplingParams.seed`` with ``n > 1``: child ``i`` gets ``seed + i``
  (``vllm/v1/engine/parallel_sampling.py`` ``_get_child_sampling_params``, 0.10.2 and 0.33.0).
  Per-request seeds are stored as int64 in 0.33.0 (``vllm/v1/worker/gpu/sample/states.py``),
  so request seeds here stay below 2**62.
- EOS: the scheduler appends the sampled token before ``check_stop``
  (``vllm/v1/core/sched/scheduler.py`` ``_update_request_with_output``;
  ``vllm/v1/core/sched/utils.py``), and the detokenizer skips the stop token only for the *text*,
  re-appending it to ``token_ids`` (``vllm/v1/engine/detokenizer.py``). So ``token_ids`` ends
  with EOS when ``finish_reason == "stop"``. In 0.10.2 ``check_stop`` tests the length cap
  *before* EOS (0.33.0 tests EOS first): an EOS drawn as the last allowed token reports
  "length" there, which ``_finish_reason`` maps to "stop" like ``HFEngine`` does.
- ``LLM.generate`` returns outputs in prompt order (sorted by request id,
  ``vllm/entrypoints/llm.py`` 0.10.2, ``vllm/entrypoints/common/offline.py`` 0.33.0).
- Weights: ``worker_extension_cls`` (engine argument) is mixed into the worker class, refusing any
  attribute name the worker already has (``vllm/worker/worker_base.py`` 0.10.2,
  ``vllm/v1/worker/worker_base.py`` 0.33.0, which already defines ``update_weights``,
  ``reload_weights``, ``init_weight_transfer_engine``...): every method here is ``reval_``-
  prefixed. ``LLM.collective_rpc(method, timeout, args, kwargs)`` runs it on every worker. Its
  arguments cross to the engine-core process as msgpack; in 0.10.2 a tensor argument is not
  rebuilt on that side (``vllm/v1/serial_utils.py`` ``_encode_tensor`` + the untyped utility
  decode in ``vllm/v1/engine/core.py``), so buckets travel as plain ``bytes``.
  ``Worker.get_model()`` unwraps the CUDA-graph wrapper (``gpu_model_runner.py``), and the
  model's own ``load_weights(weights)`` takes HF checkpoint names (as in vLLM's
  ``examples/offline_inference/rlhf_utils.py``, 0.10.2). ``StatelessProcessGroup.create`` and
  ``PyNcclCommunicator(group, device).broadcast(tensor, src, stream)`` have the same signatures
  in 0.10.2 and 0.33.0 (``vllm/distributed/utils.py``,
  ``vllm/distributed/device_communicators/pynccl.py``).
- Why not vLLM's newer weight-transfer API (``WeightTransferConfig``,
  ``NCCLWeightTransferEngine``, ``LLM.init_weight_transfer_engine`` / ``update_weights``,
  ``vllm/distributed/weight_transfer/``): it is absent from 0.10.2 and 0.11.0, and in 0.33.0 it
  fixes its own wire format (names/dtypes/shapes lists, its own packing). The worker extension
  works unchanged from 0.10.2 to 0.33.0 and carries this project's own bucket format
  (``reval/weights.py``), so HF and vLLM workers receive the same buckets.

Limits: ``model.load_weights`` is the plain unquantized path (correct for bf16/fp16/fp32 weights
on CUDA, where ``UnquantizedLinearMethod.process_weights_after_loading`` does nothing). Quantized
checkpoints would need vLLM's layerwise reload (``model_runner.reload_weights(weights_iterator=)``
in 0.33.0), which this adapter does not use.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor, nn

from buffer.records import FinishReason
from reval.weights import Bucket, pack_buckets, unpack_bucket
from rollout.engines import Sample, SamplingParams

MIN_VLLM_VERSION = (0, 10, 2)
"""First release whose ``processed_logprobs`` include temperature and top-p (see above)."""
LOGPROBS_MODE = "processed_logprobs"
DEFAULT_BUCKET_BYTES = 256 << 20
"""Bucket size for ``load_weights`` (one RPC per bucket, never one per tensor)."""


def _request_seed(seed: int, prompt_index: int) -> int:
    """A seed per prompt, below 2**62, so that prompts sharing a call draw independent streams
    (vLLM gives the ``n`` children of a request ``seed + i``)."""
    state = np.random.SeedSequence([seed % (1 << 64), prompt_index]).generate_state(1, np.uint64)
    return int(state[0]) >> 2


def _sampled_logprobs(logprobs: Any, token_ids: np.ndarray) -> np.ndarray:
    """The log-prob of each sampled token from a ``CompletionOutput.logprobs``: a list of
    ``{token_id: Logprob}`` (all versions) or a ``FlatLogprobs`` (``flat_logprobs=True``)."""
    if logprobs is None:
        raise RuntimeError("vLLM returned no log-probs (SamplingParams.logprobs was not set?)")
    if len(logprobs) != len(token_ids):
        raise RuntimeError(
            f"vLLM returned {len(logprobs)} log-prob positions for {len(token_ids)} tokens"
        )
    if hasattr(logprobs, "start_indices"):  # FlatLogprobs: the sampled token comes first
        starts = np.asarray(logprobs.start_indices, dtype=np.int64)
        flat_ids = np.asarray(logprobs.token_ids, dtype=np.int64)
        if starts.size == 0 or np.array_equal(flat_ids[starts], token_ids):
            return np.asarray(logprobs.logprobs, dtype=np.float32)[starts]
    return np.fromiter(
        (step[int(t)].logprob for step, t in zip(logprobs, token_ids, strict=True)),
        dtype=np.float32,
        count=len(token_ids),
    )


class VLLMEngine:
    """Sampling with vLLM; weights replaced in place through a worker extension.

    ``model`` is a local checkpoint directory or a hub id; ``seed`` seeds the engine (vLLM's
    global RNG), while each ``generate`` call seeds its own requests. ``engine_kwargs`` go to
    ``vllm.LLM`` unchanged (``enable_prefix_caching``, ``max_num_seqs``, ``tokenizer``...), except
    that ``logprobs_mode`` and ``worker_extension_cls`` are this adapter's.
    """

    def __init__(
        self,
        model: str,
        *,
        seed: int,
        dtype: str = "bfloat16",
        gpu_memory_utilization: float = 0.85,
        max_model_len: int | None = None,
        enforce_eager: bool = False,
        tensor_parallel_size: int = 1,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        weight_sync_timeout_s: float = 600.0,
        **engine_kwargs: Any,
    ) -> None:
        try:
            import vllm  # type: ignore[import-not-found]
        except ImportError as err:
            raise ImportError(
                "VLLMEngine needs vLLM >= "
                + ".".join(map(str, MIN_VLLM_VERSION))
                + " (pip install 'reval[gpu]')"
            ) from err
        from packaging.version import Version

        if Version(vllm.__version__).release < MIN_VLLM_VERSION:
            raise ImportError(
                f"vLLM {vllm.__version__} is too old: processed log-probs that include "
                f"temperature and top-p need vLLM >= {'.'.join(map(str, MIN_VLLM_VERSION))}"
            )
        for key, ours in (("logprobs_mode", LOGPROBS_MODE), ("worker_extension_cls", _EXT)):
            if engine_kwargs.get(key, ours) != ours:
                raise ValueError(f"VLLMEngine sets {key}={ours!r} itself")
        if bucket_bytes <= 0:
            raise ValueError("bucket_bytes must be > 0")
        args: dict[str, Any] = {
            "model": model,
            "seed": seed,
            "dtype": dtype,
            "gpu_memory_utilization": gpu_memory_utilization,
            "enforce_eager": enforce_eager,
            "tensor_parallel_size": tensor_parallel_size,
            **engine_kwargs,
            "logprobs_mode": LOGPROBS_MODE,
            "worker_extension_cls": _EXT,
        }
        if max_model_len is not None:
            args["max_model_len"] = max_model_len
        self._vllm = vllm
        self.llm: Any = vllm.LLM(**args)
        mode = self.llm.llm_engine.model_config.logprobs_mode
        self.logprobs_mode = str(getattr(mode, "value", mode))  # an Enum in 0.10.2, str later
        if self.logprobs_mode != LOGPROBS_MODE:
            raise RuntimeError(f"vLLM runs with logprobs_mode={self.logprobs_mode!r}")
        tok = self.tokenizer = self.llm.get_tokenizer()
        if tok.eos_token_id is None:
            raise ValueError(f"the tokenizer of {model!r} has no EOS token")
        self.eos_id = int(tok.eos_token_id)
        self.pad_id = int(tok.pad_token_id) if tok.pad_token_id is not None else self.eos_id
        self.bucket_bytes = bucket_bytes
        self.weight_sync_timeout_s = weight_sync_timeout_s
        fields = getattr(vllm.SamplingParams, "__struct_fields__", ())
        self._flat_logprobs = "flat_logprobs" in fields  # fewer Python objects per token
        self.policy_version = 0

    # -- generation --------------------------------------------------------------------------

    def _sampling_params(self, params: SamplingParams, seed: int) -> Any:
        extra: dict[str, Any] = {"flat_logprobs": True} if self._flat_logprobs else {}
        return self._vllm.SamplingParams(
            n=params.n,
            temperature=params.temperature,
            top_p=params.top_p,
            max_tokens=params.max_new_tokens,
            logprobs=0,  # only the sampled token's log-prob
            seed=seed,
            detokenize=False,
            **extra,
        )

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, seed: int
    ) -> list[list[Sample]]:
        if any(len(p) == 0 for p in prompts):
            raise ValueError("empty prompt")
        if params.n < 1 or params.max_new_tokens < 1:
            raise ValueError("n and max_new_tokens must be >= 1")
        if params.temperature <= 0 or not 0 < params.top_p <= 1:
            # vLLM samples greedily below temperature 1e-5: no behaviour distribution then.
            raise ValueError("temperature must be > 0 and top_p in (0, 1]")
        if not prompts:
            return []
        requests = [{"prompt_token_ids": [int(t) for t in p]} for p in prompts]
        sps = [self._sampling_params(params, _request_seed(seed, i)) for i in range(len(prompts))]
        outputs = self.llm.generate(requests, sps, use_tqdm=False)
        if len(outputs) != len(prompts):
            raise RuntimeError(f"vLLM returned {len(outputs)} outputs for {len(prompts)} prompts")
        result = []
        for out in outputs:
            comps = sorted(out.outputs, key=lambda c: c.index)
            if len(comps) != params.n:
                raise RuntimeError(f"vLLM returned {len(comps)} samples, expected {params.n}")
            result.append([self._to_sample(c) for c in comps])
        return result

    def _to_sample(self, comp: Any) -> Sample:
        token_ids = np.asarray(comp.token_ids, dtype=np.int32).reshape(-1)
        return Sample(
            token_ids=token_ids,
            logprobs=_sampled_logprobs(comp.logprobs, token_ids),
            finish_reason=self._finish_reason(comp.finish_reason, token_ids),
        )

    def _finish_reason(self, reason: str | None, token_ids: np.ndarray) -> FinishReason:
        if reason == "stop":
            return "stop"
        if reason == "length":
            ends_with_eos = token_ids.size > 0 and int(token_ids[-1]) == self.eos_id
            return "stop" if ends_with_eos else "length"
        raise RuntimeError(f"vLLM finished a request with reason {reason!r}")

    # -- weights -----------------------------------------------------------------------------

    def load_weights(self, named_tensors: Iterable[tuple[str, Tensor]], version: int) -> None:
        """Pack the tensors (HF checkpoint names) into buckets of ``bucket_bytes`` on the CPU and
        load them (``load_buckets``)."""
        cpu = ((name, t.detach().to("cpu")) for name, t in named_tensors)
        self.load_buckets(pack_buckets(cpu, self.bucket_bytes, version=version), version)

    def load_buckets(self, buckets: Iterable[Bucket], version: int) -> None:
        """Load packed buckets (``reval/weights.py``), one ``collective_rpc`` each, in every
        worker. A broadcast's buckets (``WeightSubscriber``) come here as they were received, in
        the learner's bucket size: they are not unpacked and packed again on the way."""
        for bucket in buckets:
            data = bucket.data.detach().to("cpu").numpy().tobytes()
            self.llm.collective_rpc("reval_load_bucket", args=(bucket.header(), data))
        self._weights_changed(version)

    def init_weight_update_group(
        self, master_address: str, master_port: int, rank_offset: int, world_size: int
    ) -> list[int]:
        """Join the learner's NCCL group (learner = rank 0, which hosts the rendezvous store).

        Every worker of this engine (``tensor_parallel_size`` of them) takes rank
        ``rank_offset + its vLLM rank``; ``world_size`` counts the learner and every worker of
        every engine in the group. Blocks until all ranks have joined; the learner must call
        ``StatelessProcessGroup.create(master_address, master_port, rank=0, world_size)`` and
        ``PyNcclCommunicator(group, device)`` meanwhile. Returns the workers' ranks.
        """
        return list(
            self.llm.collective_rpc(
                "reval_init_weight_update_group",
                args=(master_address, master_port, rank_offset, world_size),
                kwargs={"timeout_s": self.weight_sync_timeout_s},
            )
        )

    def update_weights_from_broadcast(self, headers: Sequence[bytes], version: int) -> None:
        """Receive one weight sync: for each bucket header (``Bucket.header()``, in order) the
        learner broadcasts that bucket's flat data from rank 0.

        Learner side, per sync, after sending the headers to the rollout workers (any control
        channel): ``group.barrier(timeout)`` on the same ``StatelessProcessGroup``, then
        ``comm.broadcast(bucket.data.cuda(), src=0)`` for each bucket in header order, then
        synchronize. The barrier has a timeout; a sender that dies in the middle of a broadcast
        still leaves the NCCL call waiting (NCCL itself has no timeout here).
        """
        for raw in headers:
            v, _, _ = Bucket.metas_from_header(raw)
            if v != version:
                raise ValueError(f"a bucket header carries version {v}, expected {version}")
        self.llm.collective_rpc(
            "reval_update_weights_from_broadcast",
            args=([bytes(h) for h in headers],),
            kwargs={"timeout_s": self.weight_sync_timeout_s},
        )
        self._weights_changed(version)

    def destroy_weight_update_group(self) -> None:
        self.llm.collective_rpc("reval_destroy_weight_update_group")

    def _weights_changed(self, version: int) -> None:
        # Cached prefix blocks hold K/V computed with the old weights.
        if self.llm.reset_prefix_cache() is False:
            raise RuntimeError("vLLM did not reset its prefix cache after a weight update")
        self.policy_version = version

    def close(self) -> None:
        """Shut the engine-core process down (vLLM also does it at exit)."""
        llm = getattr(self, "llm", None)
        engine_core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        if engine_core is not None:
            engine_core.shutdown()
        self.llm = None


class RevalWorkerExtension:
    """Mixed into vLLM's GPU worker through ``worker_extension_cls`` and called with
    ``LLM.collective_rpc``. ``self`` is the vLLM ``Worker`` (``device``, ``vllm_config``,
    ``get_model``). Names start with ``reval_``: vLLM refuses an extension whose attributes
    clash with the worker's."""

    if TYPE_CHECKING:
        device: torch.device
        vllm_config: Any
        _reval_group: Any
        _reval_comm: Any

        def get_model(self) -> nn.Module: ...

    def _reval_load(self, bucket: Bucket) -> int:
        from vllm.config import set_current_vllm_config  # type: ignore[import-not-found]

        weights = unpack_bucket(bucket)
        with torch.no_grad(), set_current_vllm_config(self.vllm_config):
            self.get_model().load_weights(weights=weights)  # type: ignore[operator]
        return len(weights)

    def reval_load_bucket(self, header: bytes, data: bytes) -> int:
        """Load one bucket sent by value; returns the number of tensors loaded."""
        version, nbytes, metas = Bucket.metas_from_header(bytes(header))
        if len(data) != nbytes:
            raise ValueError(f"bucket data has {len(data)} bytes, its header says {nbytes}")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # read-only buffer; copied at once
            host = torch.frombuffer(data, dtype=torch.uint8) if nbytes else torch.empty(0)
        buf = host.to(self.device, dtype=torch.uint8)
        return self._reval_load(Bucket(metas, buf, version))

    def reval_init_weight_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        timeout_s: float = 600.0,
    ) -> int:
        from vllm.distributed.device_communicators.pynccl import (  # type: ignore[import-not-found]
            PyNcclCommunicator,
        )
        from vllm.distributed.parallel_state import (  # type: ignore[import-not-found]
            get_world_group,
        )
        from vllm.distributed.utils import StatelessProcessGroup  # type: ignore[import-not-found]

        self.reval_destroy_weight_update_group()
        rank = int(get_world_group().rank) + rank_offset
        group = StatelessProcessGroup.create(
            host=master_address,
            port=master_port,
            rank=rank,
            world_size=world_size,
            store_timeout=max(1, int(timeout_s)),
        )
        self._reval_group = group
        self._reval_comm = PyNcclCommunicator(group, device=self.device)
        return rank

    def reval_update_weights_from_broadcast(
        self, headers: list[bytes], timeout_s: float = 600.0
    ) -> int:
        """Receive the buckets described by ``headers`` from rank 0, loading each as it
        arrives; returns the number of tensors loaded."""
        comm = getattr(self, "_reval_comm", None)
        if comm is None:
            raise RuntimeError("reval_init_weight_update_group was not called")
        parsed = [Bucket.metas_from_header(bytes(h)) for h in headers]
        self._reval_group.barrier(timeout=timeout_s)  # fails in time if the learner is gone
        loaded = 0
        stream = torch.cuda.current_stream()
        for version, nbytes, metas in parsed:
            buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            comm.broadcast(buf, src=0, stream=stream)
            loaded += self._reval_load(Bucket(metas, buf, version))  # same stream: ordered
        torch.cuda.synchronize(self.device)
        return loaded

    def reval_destroy_weight_update_group(self) -> None:
        comm = getattr(self, "_reval_comm", None)
        if comm is not None and hasattr(comm, "destroy"):  # PyNcclCommunicator.destroy: 0.33
            comm.destroy()
        self._reval_comm = None
        self._reval_group = None


_EXT = f"{RevalWorkerExtension.__module__}.{RevalWorkerExtension.__qualname__}"
"""Qualified name for ``worker_extension_cls`` (imported by name in vLLM's worker process)."""

__all__ = ["MIN_VLLM_VERSION", "RevalWorkerExtension", "VLLMEngine"]
