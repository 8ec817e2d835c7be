"""A custom task: any dataset's rows as prompts, graded by the user's reward function.

``task.dataset`` is read by the math task's reader (``math_task.read_rows``: a local JSONL or
parquet file, or a ``datasets`` hub name). Each row's ``task.prompt_field`` is the prompt: a
string as it is, or a list of chat messages put through the tokenizer's chat template. Every
other column is the row's metadata. Rows without a usable prompt, or over
``task.max_prompt_tokens``, are skipped and counted (``reval_task_prompts_skipped``).

``task.reward`` grades the answers in the grading processes: how it is called and what scores 0
is ``rollout/grading/custom.py`` (``RewardFunction``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from reval.config import RolloutConfig, TaskConfig
from rollout.grading.custom import RewardFunction
from rollout.grading.pool import PooledVerifier
from rollout.math_task import TaskMetrics, answer_shape, read_rows
from rollout.task_types import Prompt, Verifier
from rollout.warm_start import WarmStart

log = logging.getLogger("reval.rewards")


def prompt_text(value: Any, tokenizer: Any | None) -> str | None:
    """What the model reads of a prompt field: a string as it is; chat messages through the
    tokenizer's chat template (ValueError without one); None for anything else."""
    if isinstance(value, str):
        return value
    if (
        isinstance(value, list)
        and value
        and all(isinstance(m, Mapping) and "role" in m and "content" in m for m in value)
    ):
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                "task.prompt_field holds chat messages but the model's tokenizer has no chat "
                "template: give the prompt as a string, or a model with a chat template"
            )
        messages = [dict(m) for m in value]
        text: str = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        return text
    return None


def read_prompts(
    rows: Iterable[Mapping[str, Any]],
    prompt_field: str,
    tokenizer: Any | None = None,
    max_prompt_tokens: int | None = None,
    source: str = "the dataset",
) -> tuple[list[Prompt], dict[str, int]]:
    """A custom task's prompts and its skipped rows by reason. Rows without a usable
    ``prompt_field`` (missing, not a string or chat messages: ``missing_field``; empty:
    ``empty_problem``) or over ``max_prompt_tokens`` (counted with ``tokenizer``; characters / 8
    without one: ``too_long``) are skipped and counted; none left is a ValueError naming
    ``task.prompt_field``."""
    prompts: list[Prompt] = []
    skipped: dict[str, int] = {}
    columns: set[str] = set()
    for i, row in enumerate(rows):
        columns.update(map(str, row))
        value = row.get(prompt_field)
        text = prompt_text(value, tokenizer)
        if text is None:
            reason = "missing_field"
        elif not text.strip():
            reason = "empty_problem"
        elif (
            max_prompt_tokens is not None
            and (
                len(tokenizer(text, add_special_tokens=False).input_ids)
                if tokenizer is not None
                else len(text) // 8
            )
            > max_prompt_tokens
        ):
            reason = "too_long"
        else:
            metadata = {k: v for k, v in row.items() if k != prompt_field}
            answer = metadata.get("answer")
            prompts.append(Prompt(id=str(row.get("id", i)), text=text,
                                      answer="" if answer is None else str(answer),
                                      raw=value, metadata=metadata))  # fmt: skip
            continue
        skipped[reason] = skipped.get(reason, 0) + 1
    if not prompts:
        have = ", ".join(sorted(columns)) or "none"
        raise ValueError(
            f"task.prompt_field: no row of {source} has a usable {prompt_field!r} (a "
            f"non-empty string or chat messages of at most task.max_prompt_tokens tokens; "
            f"columns: {have}; skipped: {skipped})"
        )
    if skipped:
        log.warning("skipped rows of %s: %s", source, skipped)
    return prompts, skipped


@dataclass
class CustomTask:
    """Prompts read from ``task.dataset``, graded by ``task.reward`` (the module's docstring)."""

    prompts: list[Prompt]
    verifier: Verifier
    name: str = "custom"
    skipped: dict[str, int] = field(default_factory=dict)

    @classmethod
    def from_config(
        cls,
        cfg: TaskConfig,
        tokenizer: Any | None = None,
        rollout: RolloutConfig | None = None,
        registry: Any | None = None,
        field: str = "task.dataset",
    ) -> CustomTask:
        """``cfg.dataset`` (named ``field`` in errors: ``eval.dataset`` for a held-out copy)
        graded by ``cfg.reward`` in a pool of ``rollout.verifier_workers`` processes; the
        grading and skipped-row metrics on ``registry``."""
        if cfg.reward is None or cfg.dataset is None:
            raise ValueError("task.kind=custom needs task.reward and task.dataset")
        timeout = rollout.verifier_timeout_s if rollout else 5.0
        grader = RewardFunction(cfg.reward, cfg.reward_args, timeout,
                                rollout.sandbox if rollout else "bwrap")  # fmt: skip
        rows = read_rows(cfg.dataset, cfg.split, field)
        memory_mb = rollout.grading_memory_mb if rollout else None
        verifier = PooledVerifier(grader, workers=rollout.grading_processes() if rollout else 2,
                                  timeout=timeout, registry=registry,
                                  memory_mb=memory_mb)  # fmt: skip
        try:
            prompts, skipped = read_prompts(rows, cfg.prompt_field, tokenizer,
                                            cfg.max_prompt_tokens,
                                            f"{field} {cfg.dataset!r} ({cfg.split})")  # fmt: skip
        except BaseException:
            verifier.close()
            raise
        task = cls(prompts=prompts, verifier=verifier, skipped=skipped)
        counter = TaskMetrics(registry).skipped
        for reason, n in task.skipped.items():
            counter.labels(reason).inc(n)
        return task

    def pretrain_texts(self, rng: Any, count: int) -> list[str]:
        """Each prompt followed by the ``answer`` column of another row, of the same shape
        (``math_task.answer_shape``) where one grades wrong: the answer format, never an answer
        the reward grades right (every pairing is graded by the task's reward first:
        ``rollout/warm_start.py``); the prompt alone where none is wrong or there is no
        ``answer`` column."""
        return self.warm_start.texts(rng, count)

    @cached_property
    def warm_start(self) -> WarmStart:
        return WarmStart(self.prompts, self.verifier, str, answer_shape)
