"""The run config tree: one pydantic model per part, validated once, handed to every part.

Loaded from a TOML file (``configs/*.toml``) plus overrides: environment variables
``REVAL__SECTION__FIELD=value`` and CLI ``--set section.field=value``. Every field has a docstring;
unknown keys are errors, so a typo fails before any work starts with a message naming the field.
This package imports no torch so the control plane and the buffer stay light.

Its modules, each section's fields (and their docstrings) in its class: ``base`` (``_Section``,
the rules of every section; ``ConfigError``), ``task`` (``model``, ``task``, ``rollout``,
``eval``), ``training`` (``buffer``, ``learner``, ``algo``), ``launch`` (``sync``, ``launch``,
``metrics``, ``redis``; ``ApiConfig``, ``reval serve``'s), ``run`` (``RunConfig`` and its rules
across sections; loading, the deprecated names, the error lines, the redacted dump). Import the
names from here.
"""

from __future__ import annotations

from reval.config.base import ConfigError
from reval.config.launch import (
    ApiConfig,
    LaunchConfig,
    MetricsConfig,
    RedisConfig,
    SyncConfig,
)
from reval.config.run import (
    CONFIG_DIR,
    DEFAULT_CONFIG,
    DEPRECATED_REDIS,
    ENV_PREFIX,
    REDACTED,
    Origins,
    RunConfig,
    build_config,
    did_you_mean,
    dump_config,
    env_overrides,
    load_config,
    move_deprecated,
    parse_overrides,
    public_dump,
    redact_url,
)
from reval.config.task import (
    BUILTIN_ENVIRONMENTS,
    ENGINES,
    STREAMING_ENGINES,
    VLLM_LORA_RANKS,
    EngineName,
    EvalConfig,
    LoraConfig,
    ModelConfig,
    RolloutConfig,
    TaskConfig,
    TinyModelConfig,
)
from reval.config.training import (
    BUILTIN_ALGORITHMS,
    MAX_CAPACITY,
    AlgoConfig,
    BufferConfig,
    LearnerConfig,
)

__all__ = [
    "BUILTIN_ALGORITHMS",
    "BUILTIN_ENVIRONMENTS",
    "CONFIG_DIR",
    "DEFAULT_CONFIG",
    "DEPRECATED_REDIS",
    "ENGINES",
    "ENV_PREFIX",
    "MAX_CAPACITY",
    "REDACTED",
    "STREAMING_ENGINES",
    "VLLM_LORA_RANKS",
    "AlgoConfig",
    "ApiConfig",
    "BufferConfig",
    "ConfigError",
    "EngineName",
    "EvalConfig",
    "LaunchConfig",
    "LearnerConfig",
    "LoraConfig",
    "MetricsConfig",
    "ModelConfig",
    "Origins",
    "RedisConfig",
    "RolloutConfig",
    "RunConfig",
    "SyncConfig",
    "TaskConfig",
    "TinyModelConfig",
    "build_config",
    "did_you_mean",
    "dump_config",
    "env_overrides",
    "load_config",
    "move_deprecated",
    "parse_overrides",
    "public_dump",
    "redact_url",
]
