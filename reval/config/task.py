"""The config sections of what is generated: the policy model (``model``, ``model.tiny``), the
task and its verifier (``task``), generation (``rollout``) and evaluation (``eval``)."""

from __future__ import annotations

import math
from typing import Annotated, Any, ClassVar, Literal, get_args

from pydantic import Field, field_validator, model_validator

from reval.config.base import _Section

BUILTIN_ENVIRONMENTS = ("calculator",)
"""``task.environment``'s built-in names (``rollout/environment.py`` maps each to its class)."""


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


VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The adapter ranks vLLM serves (``vllm/config/lora.py``, ``max_lora_rank``'s choices)."""


class LoraConfig(_Section):
    """LoRA on the policy (``model.lora``): the base frozen, low-rank adapters trained
    (peft's ``LoraConfig``; docs/learner.md "LoRA"). ``rank = 0`` trains every weight."""

    rank: int = Field(0, ge=0)
    """The adapters' rank; 0: no LoRA (full fine-tuning). RL needs small ranks (1-32) on all
    linear layers. Only ranks vLLM serves are accepted (1, 8, 16, 32, 64, 128, 256, 320, 512)."""
    alpha: float | None = Field(None, gt=0)
    """The adapters' scale is ``alpha / rank``; ``None`` gives ``2 * rank`` (a scale of 2)."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the adapters' input while training (0: the update's log-probs are the
    generators' exactly)."""
    target_modules: list[str] | Literal["all-linear"] = "all-linear"
    """The linear layers that get adapters: ``all-linear`` (every linear layer but the output
    head, as peft resolves it) or module names (``q_proj``, ``v_proj``, ...)."""
    publish: Literal["adapter", "merged"] = "merged"
    """What a weight version carries to the generators. ``merged``: the full weights with the
    adapters folded in (``W + (alpha / rank) B A``, summed in fp32), under the base's names:
    every engine loads them as it loads a full fine-tune's. ``adapter``: the adapters' tensors
    alone (megabytes); the base travels once per learner (a base file announced beside the
    versions); HF workers apply each version to it in place, vLLM workers load it into their
    one adapter slot (``rollout/vllm_lora.py``)."""

    @field_validator("rank")
    @classmethod
    def _rank(cls, v: int) -> int:
        if v and v not in VLLM_LORA_RANKS:
            below = [r for r in VLLM_LORA_RANKS if r < v]
            above = [r for r in VLLM_LORA_RANKS if r > v]
            near = ", ".join(str(r) for r in (below[-1:] + above[:1]))
            allowed = ", ".join(map(str, VLLM_LORA_RANKS))
            raise ValueError(f"{v} is not a rank vLLM serves; the nearest are {near} "
                             f"(allowed: {allowed})")  # fmt: skip
        return v

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scale_alpha(self) -> float:
        """``alpha``, resolved (``2 * rank`` when unset)."""
        return self.alpha if self.alpha is not None else 2.0 * self.rank


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
    lora: LoraConfig = Field(default_factory=LoraConfig)
    """LoRA adapters instead of full fine-tuning (off by default)."""
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
    (built-ins: ``rollout.grading.graders:math_boxed``, ``exact_match``, ``regex_format``,
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
        from reval.plugins import canonical_spec

        # (checked, and a moved module's old name warned of once, here)
        return canonical_spec(value.strip(), "function")

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
    """Grading processes per rollout worker (math and custom tasks: ``rollout/grading/pool.py``);
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
    """Where model-written code runs (``rollout.grading.graders:code_tests``;
    ``rollout/grading/sandbox.py``): ``bwrap``, bubblewrap with no network, its own pid and
    user namespaces and only the interpreter of the host (grading refuses to start, in one
    line, where bubblewrap cannot run); ``unsafe-none``, the operator's explicit choice of no
    sandbox at all (rlimits and a no-fork filter only): it warns at every start and counts
    each answer as ``unsafe``."""
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
    steps (``inflight_updates``). Off: the same loop admits ``worker_prompts`` prompts at a time,
    with the engine empty (lockstep batches: each waits for its longest answer; weights load
    between batches). Unset: on for ``vllm``, off for ``hf`` (which always runs lockstep: it is
    for the CPU and tests)."""
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
