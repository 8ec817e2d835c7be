"""The run config tree: one pydantic model per part, validated once, handed to every part.

Loaded from a TOML file (``configs/*.toml``) plus overrides: environment variables
``REVAL__SECTION__FIELD=value`` and CLI ``--set section.field=value``. Every field has a docstring;
unknown keys are errors, so a typo fails before any work starts with a message naming the field.
This module imports no torch so the control plane and the buffer stay light.
"""

from __future__ import annotations

import difflib
import json
import math
import os
import re
import tomllib
import types
import warnings
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, Union, get_args, get_origin

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from reval.run_dir import RunDir

ENV_PREFIX = "REVAL__"
CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"
DEFAULT_CONFIG = CONFIG_DIR / "demo.toml"


MAX_CAPACITY = 100_000_000
"""Largest ``buffer.capacity``: the Redis ring's per-slot strings (4 bytes a slot) stay far
below Redis's 512 MB string limit."""

_Beta = Annotated[float, Field(ge=0, lt=1)]

BUILTIN_ENVIRONMENTS = ("calculator",)
"""``task.environment``'s built-in names (``rollout/environment.py`` maps each to its class)."""


class ConfigError(ValueError):
    """A config that cannot be used; the message names the offending field."""


def _takes_bool(annotation: Any) -> bool:
    """Whether a field's type admits a bool (``bool``, ``bool | None``, a Literal of bools)."""
    if annotation is bool:
        return True
    if get_origin(annotation) in (Union, types.UnionType):
        return any(_takes_bool(a) for a in get_args(annotation))
    return False


class _Section(BaseModel):
    """Every section: unknown keys are errors, floats are finite (no NaN or Infinity, which a
    JSON or TOML override can spell), and a bool is not a number (lax validation would take
    ``rounds = true`` as 1)."""

    model_config = ConfigDict(
        extra="forbid", validate_assignment=True, frozen=False, allow_inf_nan=False
    )

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        name = info.field_name
        if isinstance(value, bool) and name and not _takes_bool(cls.model_fields[name].annotation):
            raise ValueError(f"a boolean ({value}) where a number or text is expected")
        return value


class TinyModelConfig(_Section):
    """Shape of the random-initialized model used by tests and the demo: a Llama-architecture
    decoder with Qwen2's biased query/key/value projections (``attention_bias``), whose head size
    is set on its own, so that vLLM (which honours ``head_dim`` for Llama, not for Qwen2) serves
    exactly the model the learner trains."""

    hidden_size: int = Field(64, ge=8)
    """Width of the residual stream."""
    num_layers: int = Field(2, ge=1)
    """Number of decoder layers."""
    num_heads: int = Field(4, ge=1)
    """Attention heads per layer."""
    head_dim: int | None = Field(32, ge=4)
    """Width of each attention head; ``None`` gives ``hidden_size / num_heads``. 32 by default:
    vLLM's CPU attention takes heads of 32 or more (docs/rollout.md), so ``reval rollout --engine
    vllm`` serves the default model with no ``--set``."""
    num_kv_heads: int = Field(2, ge=1)
    """Key/value heads (grouped-query attention); must divide ``num_heads``."""
    intermediate_size: int = Field(128, ge=8)
    """Width of the MLP."""
    max_position_embeddings: int = Field(128, ge=16)
    """Longest sequence the model accepts."""

    @model_validator(mode="after")
    def _heads(self) -> TinyModelConfig:
        if self.head_dim is None and self.hidden_size % self.num_heads:
            raise ValueError(
                "model.tiny.hidden_size must be divisible by num_heads (or set head_dim)"
            )
        if self.head_dim is not None and self.head_dim % 2:
            raise ValueError("model.tiny.head_dim must be even (rotary embeddings pair dims)")
        if self.num_heads % self.num_kv_heads:
            raise ValueError("model.tiny.num_heads must be divisible by num_kv_heads")
        return self

    @property
    def head_size(self) -> int:
        """The width of each head: ``head_dim``, or ``hidden_size / num_heads`` when unset."""
        return self.head_dim or self.hidden_size // self.num_heads


class ModelConfig(_Section):
    """The policy model and its tokenizer."""

    name_or_path: str | None = None
    """A local checkpoint directory or a hub id loaded with ``from_pretrained``; ``None`` builds
    the tiny random-initialized model and the project's own character tokenizer."""
    tiny: TinyModelConfig = Field(default_factory=TinyModelConfig)
    """Shape of the tiny model (used only when ``name_or_path`` is ``None``)."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Compute dtype. The learner keeps fp32 master parameters and optimizer state and computes
    in this dtype (autocast; under ``reval learner`` FSDP2's ``MixedPrecisionPolicy`` also
    gathers the parameters in it and reduces the gradients in fp32); the frozen reference and the
    generators (vLLM, a worker's HF engine) hold their weights in it. fp32 on CPU (bf16 is ~3x
    slower there); bf16 on GPU."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the learner and the in-process generator run; ``auto`` picks cuda when present."""
    pretrain_steps: int = Field(0, ge=0)
    """Steps of next-token pretraining of the tiny model on task-shaped text before RL, so it
    starts as a smooth language model of the answer format (not of the answers)."""
    pretrain_lr: float = Field(3e-3, gt=0)
    """Learning rate of that pretraining."""
    pretrain_batch_size: int = Field(64, ge=1)
    """Sequences per pretraining step."""
    gradient_checkpointing: Literal["auto"] | bool = "auto"
    """Recompute activations in the backward pass to save memory (about a fifth of an update's
    time). ``auto``: on only when the learner's state and one micro-batch's activations would
    not fit in 85% of the device's memory without it (``learner/memory.py`` has the rule and
    the figures it was checked against); true or false forces it."""


class TaskConfig(_Section):
    """The prompts and the verifier that scores answers."""

    kind: Literal["addition", "oneshot", "math", "custom"] = "addition"
    """``addition``: every ``a+b=`` with single digits (100 prompts, answers 0..18), the model must
    learn a function. ``oneshot``: a single prompt whose accepted answers are chosen so that the
    initial policy succeeds with probability ``oneshot_base_success``. ``math``: a DeepScaleR-format
    dataset (``problem``, ``answer``) graded on its last ``\\boxed{}``. ``custom``: any dataset
    (``dataset``, ``prompt_field``) graded by ``reward``; setting ``reward`` alone selects it
    (docs/tasks.md)."""
    max_operand: int = Field(9, ge=1, le=99)
    """``addition``: operands run over 0..max_operand."""
    oneshot_base_success: float = Field(0.4, gt=0, lt=1)
    """``oneshot``: success rate of the initial policy (the paper's hard/medium/easy are about
    0.10 / 0.40 / 0.68)."""
    dataset: str | None = None
    """``math``, ``custom``: a local JSONL/parquet file or a ``datasets`` hub name."""
    split: str = "train"
    """``math``, ``custom``: dataset split to read."""
    prompt_field: str = "prompt"
    """``custom``: the column holding the prompt: a string, or a list of chat messages
    (``{"role", "content"}``) put through the tokenizer's chat template. Every other column of
    the row is the reward's ``metadata``."""
    reward: str | None = None
    """``custom``: the reward function, ``package.module:function`` or ``path/to/file.py:function``
    (built-ins: ``rollout.graders:math_boxed``, ``exact_match``, ``regex_format``,
    ``code_tests``, ``http_reward``). Called as ``f(prompt, completion, metadata,
    **reward_args)`` in the grading processes; returns a float, or a dict whose ``score`` is the
    reward and whose other numbers are logged components. ``f.batched = True``: called once with
    lists; an ``async def`` is awaited (docs/tasks.md)."""
    reward_args: dict[str, Any] = Field(default_factory=dict)
    """``custom``: keyword arguments of every ``reward`` call (a built-in's ``pattern``, ``url``,
    ``field``...)."""
    template: Literal["plain", "r1_distill", "qwen_math"] = "plain"
    """``math``: prompt template of the paper's appendix (through the tokenizer's chat template)."""
    max_prompt_tokens: int = Field(1024, ge=1)
    """Prompts longer than this are skipped (and counted)."""

    # -- multi-turn environments (rollout/environment.py; docs/tasks.md, "Environments") --
    environment: str | None = None
    """An environment the model talks to over several turns: a built-in name (``calculator``: a
    calculator tool for the word problems of ``reval make-data``) or ``package.module:Factory``
    / ``path/to/file.py:Factory``, called with no arguments once per episode for an
    ``Environment``. The episode's reward is the sum of the environment's rewards (the task's
    verifier does not grade it). Unset: one answer per prompt, graded by the verifier."""
    max_turns: int = Field(4, ge=1)
    """``environment``: the model's turns per episode at most; an episode the environment has
    not ended by then ends with finish reason ``length``."""
    max_episode_tokens: int = Field(256, ge=1)
    """``environment``: response tokens of an episode at most, the model's and the
    environment's together (each turn generates at most ``rollout.max_new_tokens``); an episode
    that reaches it ends with finish reason ``length``."""

    @field_validator("environment")
    @classmethod
    def _environment_spec(cls, value: str | None) -> str | None:
        """A built-in name or an import path's form; that it imports is checked before a
        command's work starts (``reval.paths.check_run_paths``; the REST API after confining a
        file to its ``models_dir``), never while a config is parsed."""
        if value is None or value in BUILTIN_ENVIRONMENTS:
            return value
        from reval.plugins import split_spec

        split_spec(value)
        return value.strip()

    @model_validator(mode="before")
    @classmethod
    def _reward_selects_custom(cls, data: Any) -> Any:
        """A ``reward`` makes the task ``custom``, whatever ``kind`` a preset says: a user sets
        the dataset, the prompt field and the reward, nothing else."""
        if isinstance(data, dict) and data.get("reward") is not None:
            return {**data, "kind": "custom"}
        return data

    @field_validator("reward")
    @classmethod
    def _reward_spec(cls, value: str | None) -> str | None:
        if value is None:
            return value
        from reval.plugins import split_spec

        split_spec(value, "function")
        return value.strip()

    @model_validator(mode="after")
    def _custom_needs(self) -> TaskConfig:
        if self.kind == "custom" and (self.reward is None or self.dataset is None):
            missing = "task.reward" if self.reward is None else "task.dataset"
            raise ValueError(f"kind=custom needs {missing} (docs/tasks.md)")
        return self


EngineName = Literal["hf", "vllm"]
"""The generation engines (``rollout/generators.py`` builds each; ``reval rollout --engine``)."""
ENGINES: tuple[str, ...] = get_args(EngineName)
STREAMING_ENGINES = frozenset({"vllm"})
"""The engines a worker streams with (``StreamEngine``, ``rollout/engines.py``); the others run
lockstep."""


class RolloutConfig(_Section):
    """Generation: how many answers per prompt and how they are sampled."""

    engine: EngineName = "hf"
    """Generation engine of the rollout workers: ``hf`` (transformers, CPU and GPU) or ``vllm``
    (GPU, the ``gpu`` extra). The one-process ``reval train`` always uses ``hf``."""
    prompts_per_round: int = Field(32, ge=1)
    """Prompts sampled per generation round (the paper: 128)."""
    n: int = Field(8, ge=1)
    """Answers generated per prompt (the paper's N: 8, or 1)."""
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature (the paper: 1.0). The loss always uses temperature-1 logits."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling mass."""
    max_new_tokens: int = Field(8, ge=1)
    """Longest answer; a truncated answer is terminal (what it earns: ``algo.truncated_reward``,
    ``algo.overlong_penalty_tokens``)."""
    worker_prompts: int | None = Field(None, ge=1)
    """Prompts a rollout worker takes per generation batch (default: ``prompts_per_round``)."""
    heartbeat_s: float = Field(5.0, gt=0)
    """A rollout worker refreshes its registration this often; it expires after 3 beats."""
    wait_for_weights: bool = True
    """A rollout worker generates only once the learner has announced weights (else it starts
    from its own initialization as version 0)."""
    weights_poll_s: float = Field(1.0, gt=0)
    """How often a waiting worker looks for the learner's first weights."""
    verifier_workers: Annotated[int, Field(ge=1)] | Literal["auto"] = "auto"
    """Grading processes per rollout worker (math and custom tasks: ``rollout/grading_pool.py``);
    ``"auto"``: one per CPU the process is given (``reval/threads.py``: its affinity, the
    container's quota, Ray's ``num_cpus``), at most ``MAX_AUTO_GRADERS`` (8): see
    ``grading_processes``."""
    verifier_timeout_s: float = Field(5.0, gt=0)
    """Per-answer grading timeout; a timeout scores 0 and is counted."""
    grading_memory_mb: int = Field(2048, ge=0)
    """Memory cap of each grading process (``RLIMIT_DATA``, MiB; what it starts inherits it;
    0: none). An answer whose grading needs more fails at once, scores 0 and is counted as
    ``memory`` (``reval_verifier_errors_total``)."""
    sandbox: Literal["bwrap", "unsafe-none"] = "bwrap"
    """Where model-written code runs (``rollout.graders:code_tests``; ``rollout/sandbox.py``):
    ``bwrap``, bubblewrap with no network, its own pid and user namespaces and only the
    interpreter of the host (grading refuses to start, in one line, where bubblewrap cannot
    run); ``unsafe-none``, the operator's explicit choice of no sandbox at all (rlimits and a
    no-fork filter only): it warns at every start and counts each answer as ``unsafe``."""
    vllm_gpu_memory_utilization: float | None = Field(None, gt=0, le=1)
    """``vllm``: fraction of GPU memory vLLM may take (on the CPU backend: of RAM). Default by
    device: 0.85 on a GPU; on the CPU a 1 GiB KV cache (``rollout/vllm_engine.py``)."""
    deterministic: bool = False
    """``vllm``: seed every request from the batch's seed (the same samples for the same seed;
    tests and evaluation). Off: one seeded stream per engine, vLLM's faster path on GPUs. The
    ``hf`` engine always seeds."""
    vllm_max_model_len: int | None = Field(None, ge=1)
    """``vllm``: context length (default: the model's)."""
    streaming: bool | None = None
    """A rollout worker streams (``rollout/streaming.py``): it keeps ``max_inflight`` answers in
    the engine, admitting prompts from the deal as others finish, grades and inserts each
    prompt's group as soon as its last answer is done, and loads new weights between two decode
    steps (``inflight_updates``). Off: lockstep batches of ``worker_prompts`` prompts (each
    waits for its longest answer; weights load between batches). Unset: on for ``vllm``, off
    for ``hf`` (which always runs lockstep: it is for the CPU and tests)."""
    max_inflight: int | None = Field(None, ge=1)
    """Streaming: answers in the engine at once (a prompt's ``n`` answers take ``n``). Default:
    a lockstep batch's, ``worker_prompts * n``."""
    inflight_updates: Literal["keep", "recompute", "finish"] = "keep"
    """Streaming: what a new weight version does to the answers in the engine. ``keep``: they
    pause between two decode steps, the weights load, they go on with their KV cache (computed
    under the older weights; the engine runs without prefix caching). ``recompute``: the same,
    their KV cache computed again under the new weights. ``finish``: no prompt is admitted until
    they have finished on the old weights (the lockstep worker's behaviour), then it loads."""

    @model_validator(mode="after")
    def _streaming_engine(self) -> RolloutConfig:
        if self.streaming and self.engine not in STREAMING_ENGINES:
            streams = "|".join(sorted(STREAMING_ENGINES))
            raise ValueError(f"rollout.streaming=true needs rollout.engine={streams} "
                             f"({self.engine} runs lockstep)")  # fmt: skip
        if self.max_inflight is not None and self.max_inflight < self.n:
            raise ValueError(
                f"rollout.max_inflight ({self.max_inflight}) must be >= rollout.n ({self.n})"
            )
        return self

    def streams(self) -> bool:
        """Whether a rollout worker streams (``streaming``, by engine when unset)."""
        return self.engine in STREAMING_ENGINES if self.streaming is None else self.streaming

    MAX_AUTO_GRADERS: ClassVar[int] = 8
    """The most grading processes ``verifier_workers = "auto"`` starts."""

    def grading_processes(self) -> int:
        """The grading pool's size: ``verifier_workers``, or for ``"auto"`` the CPUs this process
        is given (at least 1, at most ``MAX_AUTO_GRADERS``)."""
        if self.verifier_workers != "auto":
            return int(self.verifier_workers)
        from reval.threads import cpus_given

        return max(1, min(self.MAX_AUTO_GRADERS, math.floor(cpus_given())))


class BufferConfig(_Section):
    """The FIFO replay buffer (embedded ring or the Redis replay service)."""

    backend: Literal["memory", "redis"] = "memory"
    """``memory``: the embedded in-process ring (one-process runs, nothing survives the process).
    ``redis``: the replay service, shared by every worker and the learner and kept across
    restarts (see docs/buffer.md)."""
    capacity: int = Field(1280, ge=1, le=MAX_CAPACITY)
    """M: trajectories kept; the oldest is evicted on insert (the paper: 5120). At most 10^8:
    the Redis ring keeps 4 bytes per slot in strings of at most 512 MB."""
    samples_per_insert: float | None = Field(None, gt=0)
    """Rate limiter (like Reverb's SampleToInsertRatio): trajectories handed out may not exceed
    this times trajectories inserted (plus ``rate_slack``); sampling waits when the learner is
    ahead, inserts never wait. Unset: it follows from the update schedule, ``updates_per_round *
    batch_size / (prompts_per_round * n)`` (the paper's K = 2 with B = one round: each
    trajectory is used K times; ``RunConfig.samples_per_insert``), so the service reuses data as
    the one-process loop does."""
    generate_ahead: Annotated[int, Field(ge=0)] | Literal["off"] | None = None
    """Rollout workers wait before a generation batch while the learner owes more than this many
    samples under the limiter (``samples_per_insert * inserted - sampled``): generation runs at
    most this far ahead of training, so each trajectory is used K times also when the learner is
    the slower side (Reverb's rate limiter blocks the faster side the same way). Unset: one
    learner round's worth, ``samples_per_insert * round_size`` (``RunConfig.generate_ahead``; at
    least what the learner's first batch needs held).
    ``"off"``: workers never wait for the learner (what they generate faster than it trains is
    used fewer than K times, or evicted unused)."""
    rate_slack: int = Field(0, ge=0)
    """Trajectories the learner may sample beyond the ratio before it waits."""
    min_size_to_sample: int = Field(0, ge=0)
    """Sampling waits until the buffer holds this many (0: the batch size)."""
    max_staleness: int | None = Field(None, ge=0)
    """Skip (and drop, when they are the oldest) trajectories generated more than this many
    policy versions ago. Unset: every held trajectory may be sampled."""
    prioritized: bool = False
    """Sample in proportion to ``(|delta| + priority_eps) ** priority_alpha`` with importance
    weights, priorities updated after each update (off: uniform, the paper's choice)."""
    priority_alpha: float = Field(0.6, ge=0)
    """Prioritization exponent (0 = uniform)."""
    priority_beta: float = Field(0.4, ge=0, le=1)
    """Importance-weight exponent (1 = full correction)."""
    priority_eps: float = Field(1e-3, gt=0)
    """Added to |delta| so no trajectory gets zero probability."""
    sample_timeout_s: float = Field(60.0, gt=0)
    """The learner waits this long for a batch (rate limiter, too few held, Redis down) before
    it raises."""
    reward_bound: float = Field(100.0, gt=0)
    """The learner quarantines (counts, never trains on) a record whose ``|reward|`` or
    ``|reward_raw|`` exceeds this: the verifiers score 0/1 and every reward transform stays in
    [-1, 1], while one reward of 1e30 derails every update it is drawn into. Token ids are
    checked against the model's vocabulary the same way."""
    spool_max_mb: float = Field(256.0, ge=0)
    """``redis``: a producer that cannot reach Redis keeps up to this many MB of encoded records
    locally and flushes them when Redis answers again; beyond it the oldest are dropped (and
    counted). Generators are never blocked by the buffer."""


class LearnerConfig(_Section):
    """The optimizer and the update schedule."""

    rounds: int = Field(100, ge=1)
    """Generation rounds (the paper's iterations: 650)."""
    updates_per_round: int = Field(2, ge=1)
    """K: updates after each round, each on ``batch_size`` trajectories (the paper: 2)."""
    batch_size: int | None = Field(None, ge=1)
    """B: trajectories per update; ``None`` means one round's worth (prompts_per_round * n)."""
    first_update_fresh: bool = True
    """Whether the first updates of a round train on the round's fresh trajectories (the paper's
    appendix), rather than every update on a uniform sample of the buffer (its §4.3). The fresh
    batch is the whole round: ``round_size // batch_size`` updates (at most ``updates_per_round``)
    take never-used trajectories, so no trajectory is evicted before it is used once (the paper's
    B = one round: the first update)."""
    micro_batch_size: int = Field(64, ge=1)
    """Trajectories per forward/backward; gradients accumulate to the full-batch gradient."""
    max_tokens_per_micro_batch: int | None = Field(None, ge=1)
    """Tokens per forward/backward as computed, besides ``micro_batch_size``: packed (``packing``)
    the sum of the micro-batch's lengths, the trajectories placed first-fit decreasing; padded,
    trajectories x (longest prompt + longest response), the trajectories bucketed by length.
    Bounds the activations of long answers (the log-probs never hold [B, T, V] logits at once
    anyway: ``learner/sequence.py``). ``None``: no token budget. A trajectory longer than it is
    an error."""
    packing: Literal["auto"] | bool = "auto"
    """Packed micro-batches: each micro-batch's trajectories concatenated into one row with no
    padding, attention kept inside each sequence by its ``position_ids`` (transformers' packed
    path: sdpa/eager/flex document masks, flash-attention varlen), the same losses and gradients
    as padded ones on fewer tokens (``learner/sequence.py`` ``pack``). ``auto``: when the
    model's attention implementation is one transformers packs (``PACKED_ATTENTION``: sdpa,
    eager, flex, flash), each share is packed when padding would waste tokens: any on a GPU,
    over a quarter on the CPU, where a packed row's attention runs sequence by sequence
    (``learner/batches.py`` ``AUTO_PACK_BELOW``); padded otherwise. True or false forces it."""
    lr: float = Field(1e-6, gt=0)
    """AdamW learning rate (the paper: 1e-6)."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay."""
    adam_betas: tuple[_Beta, _Beta] = (0.9, 0.999)
    """AdamW betas, each in [0, 1)."""
    grad_clip: float = Field(1.0, gt=0)
    """Clip the global grad norm to this; steps with a non-finite norm are skipped."""
    world_size: int = Field(1, ge=1)
    """Learner ranks of ``reval learner`` (FSDP2 over all of them: gloo on CPU, NCCL on GPU)."""
    max_steps: int | None = Field(None, ge=1)
    """Optimizer steps of ``reval learner`` (default: ``rounds * updates_per_round``)."""
    lease_s: float = Field(30.0, gt=0, le=3600)
    """One learner per run: the learner holds a lease in Redis for this long, renewed every third
    of it. A second learner on the run waits this long for it, then refuses to start, naming the
    holder; one that died frees the lease after this long (at once when it ran on the same
    host)."""
    sample_prefetch: int = Field(1, ge=0)
    """``reval learner``: batches sampled ahead while an update runs (0: none)."""
    ref_reset_steps: int = Field(200, ge=0)
    """Copy the policy into the reference every this many rounds (the paper: 200; 0 = never)."""
    checkpoint_every: int = Field(500, ge=0)
    """Save a checkpoint every this many updates (``reval learner``) or rounds (``reval train``)
    (0: not by count). A stop (Ctrl-C, SIGTERM, ``reval runs stop``) and the end always write
    one."""
    checkpoint_every_s: float = Field(600.0, ge=0)
    """Also save one when this many seconds have passed since the last (0: not by time):
    whichever of the two comes first. A learner killed hard loses at most this much work."""
    keep_checkpoints: int = Field(3, ge=0)
    """``reval learner`` and ``reval train``: keep the newest this many checkpoints, deleting
    older ones after each save (0: keep every one). Checkpoints by time add up: a 1.5B model's
    (fp32 weights and AdamW) is ~18 GB, every 10 minutes."""
    stop_at_success: float | None = Field(None, gt=0, le=1)
    """``reval train`` on the one-shot task: stop once the exact success rate reaches this (the
    one-shot study's rounds-to-threshold)."""


BUILTIN_ALGORITHMS: dict[str, bool] = {"reval": False, "tbrm": False, "regression": False,
                                       "grpo": True}  # fmt: skip
"""The built-in losses (the table of ``learner/algorithms/``) and whether each is on-policy."""


class AlgoConfig(_Section):
    """The loss and the reward."""

    name: str = "reval"
    """Loss: ReVal, its baselines TBRM and the regression variant, GRPO (on-policy, K=1), or a loss
    of your own by import path (``package.module:Class``, ``path/to/file.py:Class``: a class
    built with this section, ``learner/algorithms/base.py: Algorithm``), with ``policy`` set
    (docs/algorithm.md, "Adding a loss"; not over the REST API)."""
    policy: Literal["off", "on"] | None = None
    """How a loss of your own is fed: ``off`` (the buffer replays each trajectory K times
    against the frozen reference, as for ReVal) or ``on`` (each trajectory once, in whole groups
    of its prompt, as for GRPO). A built-in loss knows its own (unset, or the same)."""
    beta: float = Field(0.02, gt=0)
    """KL strength beta of the soft Bellman residual (paper: 0.002 for ~5K-token answers, 0.02
    for ~600). The residual compares a *sum* of log-ratios with r/beta: scale with length."""
    reward: Literal["binary", "group_mean", "plus_minus"] = "binary"
    """Reward transform at collection time: 0/1, ``r - mean`` over the N answers of a prompt, or
    ``2r - 1``."""
    mask_truncated: bool = False
    """A response cut at ``rollout.max_new_tokens`` (finish reason ``length``) is terminal and
    trains with its reward (false, as in the paper); true leaves such responses out of the loss
    (their term weighted 0; GRPO: advantage 0, and they leave their group's mean and std, DAPO's
    overlong filtering). Either way the reward and the finish reason are recorded with the
    trajectory (docs/algorithm.md, "Truncated answers")."""
    truncated_reward: Literal["zero", "graded"] = "zero"
    """What a response cut at the token limit earns: ``zero`` (never counted as a full answer,
    whatever the verifier says) or ``graded`` (the verifier's score; a reward function receives
    the answer's ``finish_reason`` and may decide itself). Applied at collection time."""
    overlong_penalty_tokens: int = Field(0, ge=0)
    """DAPO's soft overlong punishment (eq. 13): with L_cache = this and L_max =
    ``rollout.max_new_tokens``, ``min(0, (L_max - L_cache - length) / L_cache)`` is added to a
    single-turn answer's reward (0 up to L_max - L_cache tokens, -1 at L_max). 0: off."""
    clip_low: float = Field(0.2, ge=0)
    """GRPO: lower ratio clip (1 - clip_low)."""
    clip_high: float = Field(0.28, ge=0)
    """GRPO: upper ratio clip (1 + clip_high)."""
    clip_ratio_c: float = Field(3.0, gt=1)
    """GRPO: dual-clip bound for negative advantages."""
    tis_cap: float = 2.0
    """GRPO: cap C of the truncated importance weight min(exp(old - rollout), C); <= 0 is off."""

    @field_validator("name")
    @classmethod
    def _loss_name(cls, value: str) -> str:
        if value in BUILTIN_ALGORITHMS:
            return value
        from reval.plugins import split_spec

        try:
            split_spec(value, "Class")
        except ValueError as err:
            names = ", ".join(BUILTIN_ALGORITHMS)
            raise ValueError(f"{err}, nor a built-in loss ({names})") from None
        return value.strip()

    @model_validator(mode="after")
    def _loss_policy(self) -> AlgoConfig:
        builtin = BUILTIN_ALGORITHMS.get(self.name)
        if builtin is None and self.policy is None:
            raise ValueError(f"algo.name={self.name} (a loss of your own) needs algo.policy: "
                             "off (replayed against the reference) or on (each trajectory "
                             "once)")  # fmt: skip
        if builtin is not None and self.policy is not None and (self.policy == "on") != builtin:
            raise ValueError(f"algo.policy={self.policy}, but {self.name} is "
                             f"{'on' if builtin else 'off'}-policy")  # fmt: skip
        return self

    @property
    def on_policy(self) -> bool:
        """Where the algorithms differ, asked in one place (never by name). GRPO is on-policy:
        each trajectory is trained on once, in whole groups of its prompt (its advantages need
        the group), newest first, with no reference, no importance weights of prioritized replay
        and a token-mean loss. The value losses (ReVal, TBRM, regression) are off-policy: they
        replay the buffer K times against a frozen reference (docs/algorithm.md). A loss of
        your own: ``policy``."""
        builtin = BUILTIN_ALGORITHMS.get(self.name)
        return builtin if builtin is not None else self.policy == "on"


class SyncConfig(_Section):
    """Weight transport from the learner to the generators."""

    every: int = Field(1, ge=1)
    """Push weights after every this many updates."""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """torch.distributed backend: gloo on CPU, NCCL on GPU (``auto`` chooses)."""
    bucket_mb: float = Field(64.0, gt=0)
    """Size of the packed buckets a broadcast sends; never one round trip per tensor."""
    timeout_s: float = Field(60.0, gt=0)
    """Timeout of every collective; a dead worker never blocks the learner longer than this."""
    weights_dir: str | None = None
    """Shared directory of the file transport of weights (default: ``{run_dir}/weights``)."""
    broadcast: bool = False
    """Also broadcast every version over torch.distributed (gloo; packed buckets) to the workers
    that joined the learner's hub: faster than the shared directory, which stays the fallback
    and what newcomers read first."""
    broadcast_host: str = "127.0.0.1"
    """Address the workers reach the learner's hub at (announced in Redis, with the run's
    secret that joining needs). ``auto``: the learner's own address as other hosts see it (its Ray
    node's IP under Ray, else its host name resolved, as torch.distributed does): for workers in
    other containers or on other nodes (docker-compose.yml, deploy/k8s)."""
    broadcast_bind: str | None = None
    """Address the hub listens on (its store and its gloo sockets). Unset: the address of
    ``broadcast_host`` (loopback by default; with ``auto`` the learner's own address, where
    the workers of other containers or nodes reach it), never every interface unless set to
    ``0.0.0.0``."""
    broadcast_port: int = Field(0, ge=0, le=65535)
    """Port of the hub (0: any free port; it is announced in Redis)."""


class LaunchConfig(_Section):
    """``reval launch``: the whole run on Ray (a local Ray, or the cluster at ``RAY_ADDRESS``)."""

    workers: int = Field(2, ge=0)
    """Rollout workers to start (``reval launch --add/--remove`` change it during the run)."""
    learner_cpus: Annotated[float, Field(gt=0)] | Literal["auto"] = "auto"
    """CPUs reserved for each learner rank (a Ray actor's ``num_cpus``: its thread budget,
    ``reval/threads.py``). ``"auto"``: on a local Ray, an even share of the machine's CPUs
    between the learner's ranks and the workers ``reval launch`` starts (see ``cpus``); on a
    cluster, 1."""
    learner_gpus: float = Field(0.0, ge=0)
    """GPUs reserved for each learner rank (1 on a GPU node)."""
    rollout_cpus: Annotated[float, Field(gt=0)] | Literal["auto"] = "auto"
    """CPUs reserved for each rollout worker. ``"auto"``: on a local Ray, what the learner's
    ranks leave of the machine's CPUs, shared evenly between the workers (see ``cpus``); on a
    cluster, 1."""
    rollout_gpus: float = Field(0.0, ge=0)
    """GPUs reserved for each rollout worker (1 for a vLLM worker on a GPU node)."""
    placement: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    """Placement-group strategy of the learner ranks (PACK keeps them on one node if it can)."""
    replace_dead_workers: bool = True
    """Start a new rollout worker in place of one that died (not of one removed on purpose)."""
    max_learner_restarts: int = Field(3, ge=0)
    """Restarts of the learner (all ranks, from the latest checkpoint) after a rank died."""
    namespace: str = "reval"
    """Ray namespace of the run's named control actor (``reval launch --add`` finds it there)."""
    local_cpus: int | None = Field(None, ge=1)
    """Logical CPUs of a local Ray (default: enough for the learner and the workers, at least
    the machine's cores); ignored when joining an existing cluster."""
    stop_timeout_s: float = Field(60.0, gt=0)
    """How long stopping waits for workers to drain and the learner to checkpoint."""
    metrics_port: int | None = Field(None, ge=0, le=65535)
    """The driver's ``/metrics``, ``/healthz``, ``/readyz`` (at ``metrics.addr``; None: off)."""

    def cpus(self, world_size: int, cores: int | None) -> tuple[float, float]:
        """``(learner rank, rollout worker)`` CPUs, ``learner_cpus`` and ``rollout_cpus`` with
        ``"auto"`` resolved for a local Ray on a machine of ``cores`` CPUs (``local_cpus`` if
        set): both ``"auto"``, an even share between the ``world_size`` ranks and the
        ``workers``; one set, the other role shares what it leaves; whole CPUs, at least 1 (on
        a machine with fewer CPUs than processes, 1 each: the thread tuner copes). ``cores``
        None (a cluster, whose nodes are not known here): 1 each."""
        if cores is None:
            learner = 1.0 if self.learner_cpus == "auto" else float(self.learner_cpus)
            return learner, 1.0 if self.rollout_cpus == "auto" else float(self.rollout_cpus)
        cores = self.local_cpus or cores
        rollout = None if self.rollout_cpus == "auto" else float(self.rollout_cpus)
        if self.learner_cpus != "auto":
            learner = float(self.learner_cpus)
        elif rollout is not None:  # the ranks share what the workers leave
            learner = float(max(1, math.floor((cores - self.workers * rollout) / world_size)))
        else:
            learner = float(max(1, cores // (world_size + self.workers)))
        if rollout is not None:
            return learner, rollout
        left = cores - world_size * learner
        return learner, float(max(1, int(left // self.workers) if self.workers else int(left)))

    def local_ray_cpus(self, world_size: int, cores: int) -> int:
        """The logical CPUs of the local Ray ``reval launch`` starts: ``local_cpus``, else
        enough for the learner ranks and the workers with two to spare, at least ``cores``."""
        learner, rollout = self.cpus(world_size, cores)
        need = world_size * learner + (self.workers + 2) * rollout
        return self.local_cpus or max(int(need + 0.999), cores)

    def local_ray_room(self, world_size: int, cores: int) -> int:
        """How many rollout workers (CPUs only) that local Ray has room for beside the learner."""
        learner, rollout = self.cpus(world_size, cores)
        free = self.local_ray_cpus(world_size, cores) - world_size * learner
        return max(0, int(free / rollout + 1e-9))


class MetricsConfig(_Section):
    """What the run records."""

    jsonl: bool = True
    """Write one JSON line of metrics per round into ``metrics.jsonl`` in the run directory."""
    plot: bool = True
    """Draw the learning curve ``curve.png`` at the end of the run."""
    progress: bool = True
    """Show a progress bar (round, success rate, loss)."""
    prometheus_port: int | None = Field(None, ge=0, le=65535)
    """Serve Prometheus metrics (and ``/healthz``, ``/readyz``) on this port (``None``: off)."""
    addr: str = "127.0.0.1"
    """Address of that endpoint (``0.0.0.0`` in a container, for Prometheus to scrape)."""
    log_every: int = Field(10, ge=0)
    """``reval learner``: a log line every this many updates (step, loss, batch reward, the wait
    for data, updates and trajectories per second since the last line; 0: none; ``--verbose``:
    every update)."""


class EvalConfig(_Section):
    """Periodic evaluation over all of the task's prompts."""

    every: int = Field(10, ge=0)
    """Evaluate every this many rounds (0: only before and after training)."""
    samples_per_prompt: int = Field(4, ge=1)
    """Answers sampled per prompt; the success rate is their mean (avg@n)."""
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature of the evaluation."""
    max_prompts: int = Field(512, ge=1)
    """Evaluate at most this many prompts (a fixed-seed subset beyond that)."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Top-p of the evaluation's sampling (``reval eval``)."""
    max_problems: int = Field(100, ge=1)
    """``reval eval``: each benchmark capped at this many problems by a seeded subsample (the
    paper: 100)."""
    dataset: str | None = None
    """``reval train`` with ``task.kind=math``: held-out problems (a DeepScaleR-format file, read
    like ``task.dataset``) that the periodic evaluation samples instead of the training prompts."""


class RedisConfig(_Section):
    """The run's Redis: the replay service, the control channel, the weights announcement, the
    worker registry (every key: ``reval/redis.py``)."""

    url: str = "redis://127.0.0.1:6379/0"
    """Where Redis lives (``redis://[user:password@]host:port/db``, ``rediss://`` for TLS). The
    password is redacted wherever the config is written."""
    prefix: str = "reval:"
    """Every key of a run is ``{prefix}{{run}}:...``, the run's name in braces (a Redis Cluster
    hash tag: one slot per run); runs are isolated (docs/architecture.md)."""
    outage_s: float = Field(600.0, gt=0)
    """How long every process (learner, workers) rides out Redis being unreachable or refusing
    writes (MISCONF: its disk is full, OOM, READONLY) before it gives up: it logs once when it
    starts waiting and once when Redis is back; workers keep their batches in the spool."""


DEPRECATED_REDIS = {"redis_url": "url", "key_prefix": "prefix"}
"""``buffer.<old name>`` -> ``redis.<name>``: the names before the ``redis`` section, still
read (with a deprecation message)."""


def move_deprecated(data: Mapping[str, Any]) -> dict[str, Any]:
    """``data`` (a raw config mapping) with ``buffer.redis_url`` and ``buffer.key_prefix`` moved
    to ``redis.url`` and ``redis.prefix``, with a FutureWarning for each one found. ConfigError
    when a field is given under both names with different values."""
    out = dict(data)
    buffer = out.get("buffer")
    if not isinstance(buffer, Mapping) or not any(k in buffer for k in DEPRECATED_REDIS):
        return out
    buffer = out["buffer"] = dict(buffer)
    section = out.get("redis")
    redis = out["redis"] = dict(section) if isinstance(section, Mapping) else {}
    for old, new in DEPRECATED_REDIS.items():
        if old not in buffer:
            continue
        value = buffer.pop(old)
        if new in redis and redis[new] != value:
            raise ConfigError(
                f"buffer.{old} (deprecated) and redis.{new} are both set, to different values: "
                f"keep redis.{new}"
            )
        redis[new] = value
        warnings.warn(
            f"buffer.{old} is deprecated: it is now redis.{new} (--set redis.{new}=..., "
            f"{ENV_PREFIX}REDIS__{new.upper()})",
            FutureWarning,
            stacklevel=2,
        )
    return out


class RunConfig(_Section):
    """A whole run: every part reads its own section."""

    name: str = Field("demo", pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
    """Run name; the run directory is ``output_dir/name`` and it is part of every Redis key of
    the run: letters, digits, ``.``, ``_``, ``-`` (no path separators, no braces)."""
    seed: int = 0
    """Seed of every random choice: the same seed gives the same curve."""
    output_dir: str = "runs"
    """Where run directories go."""
    model: ModelConfig = Field(default_factory=ModelConfig)
    task: TaskConfig = Field(default_factory=TaskConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    buffer: BufferConfig = Field(default_factory=BufferConfig)
    learner: LearnerConfig = Field(default_factory=LearnerConfig)
    algo: AlgoConfig = Field(default_factory=AlgoConfig)
    sync: SyncConfig = Field(default_factory=SyncConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    launch: LaunchConfig = Field(default_factory=LaunchConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    redis: RedisConfig = Field(default_factory=RedisConfig)

    @model_validator(mode="before")
    @classmethod
    def _deprecated_names(cls, data: Any) -> Any:
        return move_deprecated(data) if isinstance(data, Mapping) else data

    @property
    def round_size(self) -> int:
        """Trajectories generated per round."""
        return self.rollout.prompts_per_round * self.rollout.n

    @property
    def batch_size(self) -> int:
        """B: trajectories per update."""
        return self.learner.batch_size or self.round_size

    @property
    def samples_per_insert(self) -> float:
        """K of the replay limiter: ``buffer.samples_per_insert`` when set, else what the update
        schedule implies, ``updates_per_round * batch_size / round_size`` (1 for GRPO, which takes
        every trajectory once). Derived when asked, so a config changed after validation (a
        study's copy with another K) follows."""
        if self.buffer.samples_per_insert is not None:
            return self.buffer.samples_per_insert
        if self.algo.on_policy:
            return 1.0
        return self.learner.updates_per_round * self.batch_size / self.round_size

    @property
    def fresh_updates(self) -> int:
        """Updates of a round that take never-used trajectories (``learner.first_update_fresh``):
        as many as one round fills, at most ``updates_per_round``; every one for GRPO."""
        if self.algo.on_policy:
            return self.learner.updates_per_round
        if not self.learner.first_update_fresh:
            return 0
        return min(self.learner.updates_per_round, self.round_size // self.batch_size)

    def generate_ahead(self, samples_per_insert: float | None = None) -> int | None:
        """Samples the learner may owe before rollout workers wait (``buffer.generate_ahead``):
        when unset, one learner round, ``samples_per_insert * round_size``, or what its first
        batch needs held if that is more (with the K in force, ``samples_per_insert``, when a
        live change gave another); None when ``"off"``."""
        ahead = self.buffer.generate_ahead
        if ahead == "off":
            return None
        if ahead is None:
            k = self.samples_per_insert if samples_per_insert is None else samples_per_insert
            return math.ceil(k * max(self.round_size, self._first_sample_needs))
        return ahead

    @property
    def _first_sample_needs(self) -> int:
        """Trajectories the learner needs held before its first batch."""
        return max(self.batch_size, self.buffer.min_size_to_sample)

    @property
    def run_dir(self) -> Path:
        return Path(self.output_dir) / self.name

    @property
    def paths(self) -> RunDir:
        """The run directory's files (``reval/run_dir.py``)."""
        return RunDir(self.run_dir)

    @model_validator(mode="after")
    def _consistent(self) -> RunConfig:
        if self.batch_size > self.buffer.capacity:
            raise ValueError(
                f"learner.batch_size ({self.batch_size}) exceeds buffer.capacity "
                f"({self.buffer.capacity}): cannot sample without replacement"
            )
        if self.buffer.min_size_to_sample > self.buffer.capacity:
            raise ValueError(
                f"buffer.min_size_to_sample ({self.buffer.min_size_to_sample}) exceeds "
                f"buffer.capacity ({self.buffer.capacity}): sampling would wait forever"
            )
        if self.learner.first_update_fresh and self.batch_size > self.round_size:
            raise ValueError(
                f"learner.batch_size ({self.batch_size}) exceeds one round "
                f"({self.round_size} = rollout.prompts_per_round * rollout.n) while "
                "learner.first_update_fresh is set"
            )
        ahead = self.buffer.generate_ahead
        if isinstance(ahead, int) and ahead < self.samples_per_insert * self._first_sample_needs:
            need = self._first_sample_needs
            raise ValueError(
                f"buffer.generate_ahead ({ahead}) stops the workers before the learner can draw "
                f"its first batch: it needs {need} trajectories held (learner.batch_size, "
                f"buffer.min_size_to_sample), samples_per_insert x {need} = "
                f"{self.samples_per_insert * need:g} samples ahead; raise it, or leave it unset"
            )
        if self.algo.overlong_penalty_tokens >= self.rollout.max_new_tokens:
            raise ValueError(
                f"algo.overlong_penalty_tokens ({self.algo.overlong_penalty_tokens}) must be "
                f"below rollout.max_new_tokens ({self.rollout.max_new_tokens}): DAPO's penalty "
                "starts that many tokens before the limit"
            )
        if self.algo.on_policy and self.buffer.prioritized:
            raise ValueError(
                "buffer.prioritized needs a value loss (algo.name reval, tbrm or regression): "
                "grpo has no Bellman residual to prioritize by"
            )
        if self.algo.on_policy and self.batch_size // self.rollout.n < self.learner.world_size:
            raise ValueError(
                f"algo.name=grpo: a batch of {self.batch_size} holds "
                f"{self.batch_size // self.rollout.n} groups of rollout.n = {self.rollout.n}, "
                f"fewer than learner.world_size ({self.learner.world_size}): each rank needs "
                "whole groups"
            )
        if self.algo.on_policy and (
            self.learner.updates_per_round != 1 or not self.learner.first_update_fresh
        ):
            raise ValueError(
                "algo.name=grpo is on-policy: it needs learner.updates_per_round=1 and "
                "learner.first_update_fresh=true (use --algo grpo, which sets both)"
            )
        return self


# ---------------------------------------------------------------------------------------------
# Loading

Origins = dict[str, str]
"""Where each dotted key's value came from (``learner.lr`` -> ``configs/x.toml``, ``the
environment variable REVAL__LEARNER__LR`` or ``--set``), for the error messages."""


def _parse_value(text: str) -> Any:
    """A CLI/env override value: JSON when it parses (numbers, booleans, null, lists), else str."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _set_path(tree: dict[str, Any], dotted: str, value: Any, origin: str = "--set") -> None:
    keys = [k for k in dotted.split(".") if k]
    if not keys:
        raise ConfigError(f"empty override key {dotted!r} (from {origin})")
    node = tree
    for key in keys[:-1]:
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {dotted!r} (from {origin}): {key!r} is not a section")
        node = child
    node[keys[-1]] = value


def _set_items(items: Iterable[str]) -> list[tuple[str, Any, str]]:
    """``--set`` items as (dotted key, value, origin)."""
    out = []
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"override {item!r} is not of the form section.field=value")
        out.append((key.strip(), _parse_value(value.strip()), "--set"))
    return out


def _env_items(environ: Mapping[str, str] | None) -> list[tuple[str, Any, str]]:
    """``REVAL__SECTION__FIELD=value`` variables as (dotted key, value, origin)."""
    environ = os.environ if environ is None else environ
    return [
        (name[len(ENV_PREFIX) :].lower().replace("__", "."), _parse_value(value),
         f"the environment variable {name}")
        for name, value in environ.items()
        if name.startswith(ENV_PREFIX) and len(name) > len(ENV_PREFIX)
    ]  # fmt: skip


def _tree(items: Iterable[tuple[str, Any, str]]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for dotted, value, origin in items:
        _set_path(tree, dotted, value, origin)
    return tree


def parse_overrides(items: Iterable[str]) -> dict[str, Any]:
    """``["learner.lr=1e-3", ...]`` -> a nested dict of overrides."""
    return _tree(_set_items(items))


def env_overrides(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Overrides from ``REVAL__SECTION__FIELD=value`` environment variables."""
    return _tree(_env_items(environ))


def _merge(base: dict[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def _leaves(tree: Mapping[str, Any], prefix: str = "") -> Iterable[str]:
    """The dotted keys of a nested mapping's values (an empty section is a leaf)."""
    for key, value in tree.items():
        if isinstance(value, Mapping) and value:
            yield from _leaves(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}"


def _section(loc: tuple[str, ...]) -> type[BaseModel] | None:
    """The section model at ``loc`` (``()``: RunConfig), None when ``loc`` is no section."""
    model: type[BaseModel] = RunConfig
    for part in loc:
        field = model.model_fields.get(part)
        kind = field.annotation if field is not None else None
        if not (isinstance(kind, type) and issubclass(kind, BaseModel)):
            return None
        model = kind
    return model


def _all_keys(loc: tuple[str, ...] = ()) -> list[str]:
    """Every dotted key of the tree below section ``loc``, sections included."""
    section = _section(loc)
    if section is None:
        return []
    return [k for f in section.model_fields for k in (".".join((*loc, f)), *_all_keys((*loc, f)))]


def _initials(name: str) -> str | None:
    return "".join(w[0] for w in name.split("_") if w) if "_" in name else None


def did_you_mean(dotted: str) -> list[str]:
    """The valid keys closest to an unknown one: in its section, a field whose initials it is
    (``learning_rate`` -> ``lr``) or a close spelling (difflib); else a field of that name or
    close to it anywhere in the tree (``learner.beta`` -> ``algo.beta``). At most two."""
    *parent, name = dotted.split(".")
    section = _section(tuple(parent))
    fields = list(section.model_fields) if section is not None else []
    near = [f for f in fields if name in (f, _initials(f)) or f == _initials(name)]
    near += difflib.get_close_matches(name, fields, n=2, cutoff=0.6)
    found = [".".join((*parent, f)) for f in dict.fromkeys(near)]
    if not found:
        keys = _all_keys()
        found = [k for k in keys if k.rsplit(".", 1)[-1] == name]
        found = found or difflib.get_close_matches(dotted, keys, n=2, cutoff=0.75)
    return found[:2]


def _origin(dotted: str, origins: Mapping[str, str]) -> str | None:
    """Where ``dotted`` (or the key above it, or the keys below it) came from."""
    parts = dotted.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in origins:
            return origins[".".join(parts[:n])]
    below = dict.fromkeys(o for k, o in origins.items() if k.startswith(dotted + "."))
    return ", ".join(below) or None


def _shown(value: Any) -> str:
    text = redact_url(value) if isinstance(value, str) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _error_line(error: Any, origins: Mapping[str, str]) -> str:
    """One self-contained line for one pydantic error: the key, what is wrong, where it came
    from and, for an unknown key, the closest valid ones."""
    dotted = ".".join(str(p) for p in error["loc"])
    why = str(error["msg"]).removeprefix("Value error, ")
    if not dotted:
        return why  # a rule across sections: the message names the fields
    origin = _origin(dotted, origins)
    if error["type"] == "extra_forbidden":
        line = f"{dotted}: unknown key" + (f" (from {origin})" if origin else "")
        hints = did_you_mean(dotted)
        return line + (f"; did you mean {' or '.join(hints)}?" if hints else "")
    if origin is None:
        return f"{dotted}: {why}"
    if isinstance(error.get("input"), Mapping):
        return f"{dotted}: {why} (from {origin})"
    return f"{dotted}: {why} (got {_shown(error.get('input'))} from {origin})"


def build_config(data: Mapping[str, Any], origins: Mapping[str, str] | None = None) -> RunConfig:
    """Validate a nested mapping into a RunConfig, raising ConfigError naming the fields: one
    line per bad field, with where its value came from when ``origins`` says."""
    try:
        return RunConfig.model_validate(dict(data))
    except ValidationError as err:
        lines = [_error_line(e, origins or {}) for e in err.errors()]
        raise ConfigError("\n".join(dict.fromkeys(lines))) from None


def _read_file(path: Path) -> dict[str, Any]:
    if not path.is_file():
        near = difflib.get_close_matches(path.name, _names(path.parent), n=1, cutoff=0.6)
        hint = f" (did you mean {str(path.parent / near[0])!r}?)" if near else ""
        raise ConfigError(f"config file not found: {path}{hint}")
    if path.suffix == ".json":
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise ConfigError(f"{path}: not valid JSON: {err}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: a config is a JSON object")
        return data
    try:
        return tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{path}: not valid TOML: {err}") from None


def _names(directory: Path) -> list[str]:
    try:
        return [p.name for p in directory.iterdir()]
    except OSError:
        return []


def load_config(
    path: str | Path | None = None,
    overrides: Iterable[str] = (),
    environ: Mapping[str, str] | None = None,
) -> RunConfig:
    """Load TOML ``path`` (default: the demo preset; a ``.json`` file is read as JSON, as the
    REST API writes a run's config), then env overrides, then ``--set`` ones. A bad key or value
    is a ConfigError saying where it came from (the file, the variable, ``--set``)."""
    path = Path(path) if path is not None else DEFAULT_CONFIG
    data = move_deprecated(_read_file(path))
    origins: Origins = dict.fromkeys(_leaves(data), str(path))
    for items in (_env_items(environ), _set_items(overrides)):
        for dotted, value, origin in items:
            leaf = _tree([(_renamed(dotted), value, origin)])
            origins.update(dict.fromkeys(_leaves(leaf), origin))
        # Each source's old names move first, so a later source overrides an earlier one
        # whichever name each used (a config.json's redis.url, the environment's old name).
        data = _merge(data, move_deprecated(_tree(items)))
    return build_config(data, origins)


def _renamed(dotted: str) -> str:
    """A dotted key under its current name (``buffer.redis_url`` -> ``redis.url``)."""
    section, _, name = dotted.partition(".")
    if section == "buffer" and name in DEPRECATED_REDIS:
        return f"redis.{DEPRECATED_REDIS[name]}"
    return dotted


REDACTED = "***"


def redact_url(url: str) -> str:
    """``url`` with its secrets replaced by ``***``: the password of the user part (a Redis
    URL's: ``redis://:pw@host/0`` -> ``redis://:***@host/0``; all of it when there is no colon)
    and a ``password=`` query parameter (``unix://`` sockets)."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    auth, at, host = rest.rpartition("@")
    if at:
        user, colon, _ = auth.partition(":")
        rest = f"{user}:{REDACTED}@{host}" if colon else f"{REDACTED}@{host}"
    rest = re.sub(r"([?&]password=)[^&]*", rf"\g<1>{REDACTED}", rest)
    return f"{scheme}://{rest}"


def public_dump(cfg: RunConfig) -> dict[str, Any]:
    """The resolved config (every field, defaults and derived values included) as JSON data,
    with its secrets redacted (``redis.url``'s password): what is written to disk and
    shown. Reloading it needs the secret again (``REVAL__REDIS__URL`` or ``--set``)."""
    data = cfg.model_dump(mode="json")
    data["buffer"]["samples_per_insert"] = cfg.samples_per_insert
    data["redis"]["url"] = redact_url(cfg.redis.url)
    return data


def dump_config(cfg: RunConfig, path: str | Path) -> None:
    """Write ``public_dump(cfg)``: the resolved config, secrets redacted."""
    Path(path).write_text(json.dumps(public_dump(cfg), indent=2) + "\n")


class ApiConfig(BaseModel):
    """``reval serve``: the REST control plane (not part of a run's config: it serves many)."""

    model_config = ConfigDict(extra="forbid")

    host: str = "127.0.0.1"
    """Listen address; loopback unless set (``0.0.0.0`` in a container)."""
    port: int = Field(8080, ge=0, le=65535)
    redis_url: str = "redis://127.0.0.1:6379/0"
    """The replay service's Redis: the API keeps its state there (it may restart any time).
    Password and TLS go in the URL (``rediss://:password@host:6380/0``)."""
    key_prefix: str = "reval:"
    """Key prefix of the runs this API manages (their ``redis.prefix``)."""
    output_dir: str = "runs"
    """Run directories of the runs it starts. A POSTed config's ``output_dir`` and
    ``sync.weights_dir`` must lie under it (a run writes, and resumes by unpickling, there)."""
    models_dir: str | None = None
    """The directory a POSTed config may read local files from: model checkpoints
    (``model.name_or_path``), datasets (``task.dataset``) and reward or environment files
    (``task.reward``/``task.environment`` = ``file.py:name``); anything else must be a hub id
    (``NAME`` or ``ORG/NAME``). None: hub ids only. ``--models-dir``,
    ``REVAL_API__MODELS_DIR``."""
    plugins: list[str] = Field(default_factory=list)
    """Installed code a POSTed ``task.reward`` or ``task.environment`` may name by module,
    beyond the built-in graders (``reval.plugins.BUILTIN_PLUGINS``) and environments:
    ``pkg.mod:name``, or ``pkg.mod:*`` for the names of the module's ``__all__`` (without one,
    the public names it defines itself). Nothing else is imported over REST
    (``reval train`` and the CLI take any import path). ``--plugin`` (repeatable),
    ``REVAL_API__PLUGINS`` (comma-separated)."""

    token_env: str = "REVAL_API_TOKEN"
    """Environment variable holding the bearer token of mutating requests."""
    dev: bool = False
    """Development mode: allows an empty or default token (never in production)."""
    auth_reads: bool | None = None
    """Require the token on read endpoints (``GET /v1/runs...``, ``/docs``,
    ``/openapi.json``). None: yes whenever ``host`` is not a loopback address."""
    open_metrics: bool | None = None
    """``/metrics`` without the token. None: open on a loopback ``host``, token-guarded
    otherwise (a Prometheus in another container needs ``--open-metrics``, or the token)."""
    pass_env: list[str] = Field(default_factory=list)
    """Environment variables the runs it launches inherit beyond the built-in list
    (``services/api/runs.py: run_env``); ``NAME`` or ``PREFIX*``. Its own token never."""
    max_body_bytes: int = Field(1 << 20, ge=1024)
    """Largest request body accepted (413 beyond)."""
    ray_address: str | None = None
    """Where launched runs go (``RAY_ADDRESS`` of their ``reval launch``); None: a local Ray
    per run."""

    ENV: ClassVar[str] = "REVAL_API__"
    """``REVAL_API__<FIELD>`` sets a field (``ApiConfig.load``); lists are comma-separated."""

    def loopback(self) -> bool:
        """Whether ``host`` is a loopback address (only this machine can connect)."""
        import ipaddress

        if self.host.lower() == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host.strip("[]")).is_loopback
        except ValueError:
            return False  # a host name: it may resolve to anything

    def reads_need_token(self) -> bool:
        return self.auth_reads if self.auth_reads is not None else not self.loopback()

    def metrics_need_token(self) -> bool:
        return not self.open_metrics if self.open_metrics is not None else not self.loopback()

    @classmethod
    def load(cls, given: Mapping[str, Any], env: Mapping[str, str] | None = None) -> ApiConfig:
        """The config of ``reval serve``: ``given`` (its flags; None: not given) over
        ``REVAL_API__<FIELD>`` variables over the defaults. Raises pydantic's ValidationError."""
        env = os.environ if env is None else env
        fields: dict[str, Any] = {}
        for name, field in cls.model_fields.items():
            raw = env.get(cls.ENV + name.upper())
            if raw is None:
                continue
            listed = get_origin(field.annotation) is list
            fields[name] = [p.strip() for p in raw.split(",") if p.strip()] if listed else raw
        fields.update({k: v for k, v in given.items() if v is not None})
        return cls(**fields)

    @field_validator("plugins")
    @classmethod
    def _plugin_entries(cls, value: list[str]) -> list[str]:
        from reval.plugins import split_spec

        for entry in value:
            split_spec(entry, wildcard=True)  # (a malformed entry: said at start, not per request)
        return [e.strip() for e in value]
