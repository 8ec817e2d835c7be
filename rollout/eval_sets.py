"""The paper's evaluation benchmarks: loading, prompts, gold answers.

Each benchmark is read from ``{data_dir}/{name}.jsonl`` (or ``.json``/``.parquet``) when a local
directory is given, else through the ``datasets`` library by its hub name (the real loading code;
nothing is downloaded in tests). Expected fields, first one present wins:

| benchmark | hub dataset (split) | problem field | answer field |
|---|---|---|---|
| aime24 | HuggingFaceH4/aime_2024 (train) | problem | answer |
| aime25 | yentinglin/aime_2025 (train) | problem | answer |
| amc | AI-MO/aimo-validation-amc (train) | problem | answer |
| math500 | HuggingFaceH4/MATH-500 (test) | problem | answer |
| minerva | math-ai/minervamath (test) | question, problem | answer |
| olympiad | math-ai/olympiadbench (test) | question, problem | final_answer, answer (1) |
| gpqa | Idavidrein/gpqa, gpqa_diamond (train) | Question, question | Correct Answer, correct (2) |
| wordmath | none: ``reval make-data`` writes it (``rollout/word_problems.py``) | problem | answer |

(1) a list: its first item. (2) with the three wrong options as ``Incorrect Answer 1``-``3``, or
``incorrect`` (a list of three).

GPQA-Diamond is multiple choice: the four options are shuffled with a seed per problem, shown as
``A) ... D)``, and the boxed letter is graded against the correct option's letter. Every benchmark
is capped at ``max_problems`` (the paper: 100) by a seeded subsample. Prompts use the training
templates (``math_task.format_prompt``).
"""

from __future__ import annotations

import logging
import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollout.math_task import format_prompt, read_rows

CHOICES = "ABCD"
log = logging.getLogger("reval.benchmarks")


@dataclass(frozen=True)
class BenchmarkSpec:
    name: str
    title: str
    """Column name in the paper's table."""
    hub: str
    split: str
    problem_fields: tuple[str, ...] = ("problem", "question")
    answer_fields: tuple[str, ...] = ("answer",)
    hub_config: str | None = None
    multiple_choice: bool = False


BENCHMARKS: dict[str, BenchmarkSpec] = {
    s.name: s
    for s in (
        BenchmarkSpec("aime24", "AIME24", "HuggingFaceH4/aime_2024", "train"),
        BenchmarkSpec("aime25", "AIME25", "yentinglin/aime_2025", "train"),
        BenchmarkSpec("amc", "AMC", "AI-MO/aimo-validation-amc", "train"),
        BenchmarkSpec("math500", "MATH", "HuggingFaceH4/MATH-500", "test"),
        BenchmarkSpec(
            "minerva",
            "MINERVA",
            "math-ai/minervamath",
            "test",
            problem_fields=("question", "problem"),
        ),
        BenchmarkSpec(
            "olympiad",
            "Olympiad",
            "math-ai/olympiadbench",
            "test",
            problem_fields=("question", "problem"),
            answer_fields=("final_answer", "answer"),
        ),
        # Generated locally (``reval make-data``, ``rollout/word_problems.py``): no hub copy.
        BenchmarkSpec("wordmath", "Word", "", "test"),
        BenchmarkSpec(
            "gpqa",
            "GPQA",
            "Idavidrein/gpqa",
            "train",
            problem_fields=("Question", "question"),
            answer_fields=("Correct Answer", "correct"),
            hub_config="gpqa_diamond",
            multiple_choice=True,
        ),
    )
}


@dataclass
class Problem:
    id: str
    text: str
    """The problem as shown to the model (GPQA: with its lettered options)."""
    answer: str
    """The gold answer (GPQA: the correct option's letter)."""


@dataclass
class Benchmark:
    spec: BenchmarkSpec
    problems: list[Problem]
    skipped: int = 0
    """Rows without a usable problem or answer."""
    total: int = 0
    """Usable rows before the cap."""
    prompts: list[str] = field(default_factory=list)
    too_long: int = 0
    """Problems whose prompt is over ``max_prompt_tokens``: skipped, never truncated."""


def _first(row: Mapping[str, Any], names: Sequence[str]) -> Any:
    for name in names:
        value = row.get(name)
        if value is not None and value != "" and value != []:
            return value
    return None


def _as_answer(value: Any) -> str | None:
    if isinstance(value, list | tuple):
        value = value[0] if value else None
    if value is None:
        return None
    text = str(value).strip()
    return text or None


def _choice(row: Mapping[str, Any], spec: BenchmarkSpec, seed: int, index: int) -> Problem | None:
    question = _first(row, spec.problem_fields)
    correct = _as_answer(_first(row, spec.answer_fields))
    wrong = row.get("incorrect")
    if wrong is None:
        wrong = [row.get(f"Incorrect Answer {i}") for i in (1, 2, 3)]
    wrong = [str(w).strip() for w in (wrong or []) if w is not None and str(w).strip()]
    if not isinstance(question, str) or not question.strip() or correct is None or len(wrong) != 3:
        return None
    options = [correct, *wrong]
    random.Random(f"{seed}/{spec.name}/{index}").shuffle(options)
    letter = CHOICES[options.index(correct)]
    shown = "\n".join(f"{c}) {o}" for c, o in zip(CHOICES, options, strict=True))
    text = f"{question.strip()}\n\n{shown}\n\nAnswer with the letter of the correct option."
    return Problem(f"{spec.name}-{index}", text, letter)


def parse_rows(
    spec: BenchmarkSpec, rows: Iterable[Mapping[str, Any]], seed: int = 0
) -> tuple[list[Problem], int]:
    """Usable problems and the number of rows skipped."""
    problems, skipped = [], 0
    for index, row in enumerate(rows):
        if not isinstance(row, Mapping):
            skipped += 1
            continue
        if spec.multiple_choice:
            p = _choice(row, spec, seed, index)
        else:
            problem = _first(row, spec.problem_fields)
            answer = _as_answer(_first(row, spec.answer_fields))
            text = problem.strip() if isinstance(problem, str) else ""
            p = Problem(f"{spec.name}-{index}", text, answer) if text and answer else None
        if p is None:
            skipped += 1
        else:
            problems.append(p)
    return problems, skipped


def source_of(spec: BenchmarkSpec, data_dir: str | Path | None) -> str:
    if data_dir is not None:
        for ext in (".jsonl", ".json", ".parquet"):
            path = Path(data_dir) / f"{spec.name}{ext}"
            if path.is_file():
                return str(path)
        raise FileNotFoundError(f"{spec.name}: no {spec.name}.jsonl/.json/.parquet in {data_dir}")
    if not spec.hub:
        raise FileNotFoundError(
            f"{spec.name} is generated locally (reval make-data OUT): pass --data OUT/benchmarks"
        )
    return spec.hub


def load_benchmark(
    name: str,
    data_dir: str | Path | None = None,
    max_problems: int = 100,
    seed: int = 0,
    template: str = "plain",
    tokenizer: Any | None = None,
    max_prompt_tokens: int | None = None,
) -> Benchmark:
    """A benchmark's problems (a seeded subsample of ``max_problems``) and their prompts.
    With ``tokenizer`` and ``max_prompt_tokens``, problems whose templated prompt is longer are
    skipped (counted in ``too_long`` and logged), never truncated."""
    if name not in BENCHMARKS:
        raise ValueError(f"unknown benchmark {name!r} (one of {', '.join(BENCHMARKS)})")
    spec = BENCHMARKS[name]
    src = source_of(spec, data_dir)
    if data_dir is None and spec.hub_config is not None:
        import datasets  # the hub path only

        rows: Iterable[Mapping[str, Any]] = datasets.load_dataset(
            spec.hub, spec.hub_config, split=spec.split
        )
    else:
        rows = read_rows(src, spec.split)
    problems, skipped = parse_rows(spec, rows, seed)
    too_long = 0
    if tokenizer is not None and max_prompt_tokens is not None:
        fits = [
            len(tokenizer(format_prompt(p.text, template, tokenizer), add_special_tokens=False)
                .input_ids) <= max_prompt_tokens
            for p in problems
        ]  # fmt: skip
        too_long = fits.count(False)
        problems = [p for p, ok in zip(problems, fits, strict=True) if ok]
        if too_long:
            log.warning("%s: %d problems longer than %d prompt tokens skipped, not truncated",
                        name, too_long, max_prompt_tokens)  # fmt: skip
    total = len(problems)
    if total > max_problems:
        keep = sorted(random.Random(f"{seed}/{name}/subsample").sample(range(total), max_problems))
        problems = [problems[i] for i in keep]
    prompts = [format_prompt(p.text, template, tokenizer) for p in problems]
    return Benchmark(spec, problems, skipped, total, prompts, too_long)
