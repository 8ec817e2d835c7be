"""Math prompts in the DeepScaleR format (``problem``, ``answer``, optional ``solution``) with the
paper's prompt templates, graded on the last ``\\boxed{}`` of the answer.

The loader is the real one: a local JSONL or parquet file, or a dataset name through the
``datasets`` library. Answers are graded by math-verify in a process pool
(``rollout/grading/pool.py``: ``PooledVerifier``), the same grader as the rollout workers' and
``reval eval``'s.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter

from reval.config import RolloutConfig, TaskConfig
from reval.paths import check_dataset
from rollout.grading.math_grading import MathVerify
from rollout.grading.pool import PooledVerifier
from rollout.task_types import Prompt, Verifier
from rollout.warm_start import WarmStart

log = logging.getLogger("reval.math")

SKIP_REASONS = ("missing_field", "empty_problem", "too_long")


class TaskMetrics:
    """What loading a math dataset skipped, on the process's registry (``reval train`` and the
    rollout workers)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.skipped = Counter(
            "reval_task_prompts_skipped",
            "Dataset rows skipped at load (too_long: over task.max_prompt_tokens, not truncated)",
            ["reason"],
            registry=self.registry,
        )
        for reason in SKIP_REASONS:
            self.skipped.labels(reason)


USER_SUFFIX = " Let's think step by step and output the final answer within \\boxed{}."
QWEN_MATH_SYSTEM = "Please reason step by step, and put your final answer within \\boxed{}."


def read_rows(
    source: str, split: str = "train", field: str = "task.dataset"
) -> Iterable[Mapping[str, Any]]:
    """Rows from a local ``.jsonl``/``.json``/``.parquet`` file or a ``datasets`` hub name. A
    local-looking ``source`` must be such a file (``reval.paths.check_dataset``): else a
    ``DatasetNotFound`` or ValueError naming ``field`` now, not when the rows are read. Only a
    hub-looking name (or a local dataset directory) goes to ``datasets``."""
    path = check_dataset(source, field)
    if path is not None:
        return _read_file(path)
    try:
        import datasets  # optional dependency for hub datasets (and local dataset directories)
    except ImportError:
        raise ValueError(
            f"{field}: {source!r} is not a local .jsonl/.json/.parquet file; loading it as a "
            "hub dataset needs the `datasets` package (pip install datasets)"
        ) from None
    rows: Iterable[Mapping[str, Any]] = datasets.load_dataset(source, split=split)
    return rows


def _read_file(path: Path) -> Iterator[Mapping[str, Any]]:
    if path.suffix == ".jsonl":
        with path.open(encoding="utf-8") as fh:
            for n, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    yield json.loads(line)
                except json.JSONDecodeError as err:
                    log.warning("%s:%d: skipped, not JSON (%s)", path, n, err)
                    yield {}
    elif path.suffix == ".json":
        data = json.loads(path.read_text(encoding="utf-8"))
        yield from data if isinstance(data, list) else []
    else:
        import pyarrow.parquet as pq  # optional; installed with `datasets`

        yield from pq.read_table(path).to_pylist()


def format_prompt(problem: str, template: str, tokenizer: Any | None) -> str:
    """The paper's templates (App. F) through the tokenizer's chat template when it has one."""
    user = problem + USER_SUFFIX
    if template == "plain" or tokenizer is None or not getattr(tokenizer, "chat_template", None):
        return user if template != "plain" else problem
    messages = [{"role": "user", "content": user}]
    if template == "qwen_math":
        messages.insert(0, {"role": "system", "content": QWEN_MATH_SYSTEM})
    text: str = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    if template == "r1_distill" and not text.rstrip().endswith("<think>"):
        text += "<think>\n"
    return text


@dataclass
class MathTask:
    prompts: list[Prompt]
    verifier: Verifier
    name: str = "math"
    skipped: dict[str, int] = field(default_factory=dict)

    @classmethod
    def from_rows(
        cls,
        rows: Iterable[Mapping[str, Any]],
        template: str = "plain",
        tokenizer: Any | None = None,
        max_prompt_chars: int | None = None,
        max_prompt_tokens: int | None = None,
        verifier: Verifier | None = None,
    ) -> MathTask:
        """Bad rows (missing fields, empty problem, over-long prompt) are skipped and counted.
        ``max_prompt_tokens`` counts the templated prompt's tokens with ``tokenizer``. The
        verifier: ``verifier``, else math-verify in a pool of 2 processes (``PooledVerifier``),
        with DeepScaleR's ``</think>`` rule for the ``r1_distill`` template."""
        prompts: list[Prompt] = []
        skipped: dict[str, int] = {}
        for i, row in enumerate(rows):
            problem, answer = row.get("problem"), row.get("answer")
            reason = None
            if not isinstance(problem, str) or not isinstance(answer, str | int | float):
                reason = "missing_field"
            elif not problem.strip():
                reason = "empty_problem"
            else:
                text = format_prompt(problem, template, tokenizer)
                if (max_prompt_chars is not None and len(text) > max_prompt_chars) or (
                    max_prompt_tokens is not None
                    and tokenizer is not None
                    and len(tokenizer(text, add_special_tokens=False).input_ids) > max_prompt_tokens
                ):
                    reason = "too_long"
                else:
                    prompts.append(Prompt(id=str(row.get("id", i)), text=text, answer=str(answer)))
            if reason:
                skipped[reason] = skipped.get(reason, 0) + 1
        if not prompts:
            raise ValueError(f"no usable rows (skipped: {skipped})")
        if skipped.get("too_long"):
            log.warning("%d prompts longer than %s tokens (%s chars) skipped, not truncated",
                        skipped["too_long"], max_prompt_tokens, max_prompt_chars)  # fmt: skip
        if skipped:
            log.warning("skipped rows: %s", skipped)
        if verifier is None:
            verifier = PooledVerifier(MathVerify(require_think=template == "r1_distill"))
        return cls(prompts=prompts, verifier=verifier, skipped=skipped)

    @classmethod
    def from_config(
        cls,
        cfg: TaskConfig,
        tokenizer: Any | None = None,
        rollout: RolloutConfig | None = None,
        registry: Any | None = None,
        field: str = "task.dataset",
    ) -> MathTask:
        """The configured dataset, graded by math-verify in a pool of
        ``rollout.verifier_workers`` processes; the grading and skipped-row metrics on
        ``registry``. ``field`` names ``cfg.dataset`` in errors (``eval.dataset`` for a held-out
        copy)."""
        if not cfg.dataset:
            raise ValueError(f"task.kind=math needs {field} (a file or a dataset name)")
        # Without a tokenizer, characters bound tokens from above (a token is at most ~8 chars
        # for the tokenizers in use); with one, the templated prompt's tokens are counted.
        rows = read_rows(cfg.dataset, cfg.split, field)
        verifier = PooledVerifier(
            MathVerify(require_think=cfg.template == "r1_distill"),
            workers=rollout.grading_processes() if rollout else 2,
            timeout=rollout.verifier_timeout_s if rollout else 5.0,
            registry=registry,
            memory_mb=rollout.grading_memory_mb if rollout else None,
        )
        try:
            task = cls.from_rows(
                rows,
                cfg.template,
                tokenizer,
                cfg.max_prompt_tokens * 8 if tokenizer is None else None,
                cfg.max_prompt_tokens if tokenizer is not None else None,
                verifier,
            )
        except ValueError as err:  # no row to train on: say which file, and what a row needs
            verifier.close()
            raise ValueError(
                f"{field}: {cfg.dataset!r} ({cfg.split}) has {err}: each row needs a non-empty "
                f"'problem' string and an 'answer', its prompt at most task.max_prompt_tokens "
                f"({cfg.max_prompt_tokens}) tokens"
            ) from None
        counter = TaskMetrics(registry).skipped
        for reason, n in task.skipped.items():
            counter.labels(reason).inc(n)
        return task

    def pretrain_texts(self, rng: Any, count: int) -> list[str]:
        """Each prompt followed by the boxed answer of another prompt, of the same shape
        (``answer_shape``) where one grades wrong: the answer format, never a right answer (every
        pairing is graded by the task's verifier first: ``rollout/warm_start.py``), so RL starts
        near chance, as the built-in tasks' pretraining does."""
        return self.warm_start.texts(rng, count)

    @cached_property
    def warm_start(self) -> WarmStart:
        return WarmStart(self.prompts, self.verifier, boxed, answer_shape)


def boxed(answer: str) -> str:
    """The response the format pretraining writes after a math prompt."""
    return f" \\boxed{{{answer}}}"


_DIGITS = re.compile(r"\d+")


def answer_shape(answer: str) -> str:
    """An answer's format: every run of digits read as one digit, every letter as ``a``.
    ``\\frac{3}{4}`` and ``\\frac{1}{12}`` share a shape, ``-4`` and ``x+4`` do not; letters-only
    answers of one length share one (``olleh`` and ``dlrow``: a "reverse the word" task pairs a
    word with another word of its length, not with its own answer)."""
    return "".join("a" if ch.isalpha() else ch for ch in _DIGITS.sub("0", answer))
