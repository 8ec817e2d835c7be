"""The config sections of what is trained: the replay buffer and its sampler (``buffer``), the
optimizer and the update schedule (``learner``), and the loss (``algo``)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from reval.config.base import _Section

MAX_CAPACITY = 100_000_000
"""Largest ``buffer.capacity``: the Redis ring's per-slot strings (4 bytes a slot) stay far
below Redis's 512 MB string limit."""


_Beta = Annotated[float, Field(ge=0, lt=1)]


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
