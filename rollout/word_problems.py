"""A generated set of math word problems in DeepScaleR's JSONL schema (``problem``, ``answer``,
``solution``), for the CPU path of a real-shaped checkpoint (``reval make-data``).

Five kinds, whose gold answers exercise the grader: ``integer`` (a sum), ``negative`` (a
temperature that drops below zero), ``fraction`` (``\\frac{a}{b}``, not reduced: math-verify
accepts any equal form), ``decimal`` (``a.5``) and ``expression`` (``x+a``: math-verify accepts
``a+x``). Operands are single digits, so a tiny model can learn the set on a CPU. Every row also
carries its ``kind``. The split is by problem text: no test problem is a training problem.

Layout written by ``write_dataset(out)``: ``out/train.jsonl``, ``out/test.jsonl`` and
``out/benchmarks/wordmath.jsonl`` (the test split, where ``reval eval --benchmarks wordmath
--data out/benchmarks`` reads it).
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path

KINDS = ("integer", "negative", "fraction", "decimal", "expression")
NAMES = ("Ana", "Ben", "Carla", "Dev", "Eli", "Fay", "Gus", "Hana", "Ivo", "Jun")
ITEMS = ("apples", "books", "coins", "cards", "shells", "stamps")
FOODS = ("cake", "pizza", "pie", "bar")


def _integer(rng: random.Random) -> dict[str, str]:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    a, b = rng.randint(1, 9), rng.randint(1, 9)
    return {
        "problem": f"{name} has {a} {item} and gets {b} more. "
        f"How many {item} does {name} have now?",
        "answer": str(a + b),
        "solution": f"{a} + {b} = {a + b}, so the answer is \\boxed{{{a + b}}}.",
    }


def _negative(rng: random.Random) -> dict[str, str]:
    a = rng.randint(0, 8)
    b = rng.randint(a + 1, 9)
    return {
        "problem": f"The temperature is {a} degrees. It drops by {b} degrees. "
        "What is the temperature now?",
        "answer": str(a - b),
        "solution": f"{a} - {b} = {a - b}, so the answer is \\boxed{{{a - b}}}.",
    }


def _fraction(rng: random.Random) -> dict[str, str]:
    name, food = rng.choice(NAMES), rng.choice(FOODS)
    b = rng.randint(2, 9)
    a = rng.randint(1, b - 1)
    frac = f"\\frac{{{a}}}{{{b}}}"
    return {
        "problem": f"A {food} is cut into {b} equal pieces. {name} eats {a} of them. "
        f"What fraction of the {food} does {name} eat?",
        "answer": frac,
        "solution": f"{a} of {b} pieces is {frac}, so the answer is \\boxed{{{frac}}}.",
    }


def _decimal(rng: random.Random) -> dict[str, str]:
    name = rng.choice(NAMES)
    a = rng.randint(1, 9)
    return {
        "problem": f"{name} walks {a} km and then half a km more. How many km does {name} walk?",
        "answer": f"{a}.5",
        "solution": f"{a} + 0.5 = {a}.5, so the answer is \\boxed{{{a}.5}}.",
    }


def _expression(rng: random.Random) -> dict[str, str]:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    a = rng.randint(1, 9)
    return {
        "problem": f"{name} has x {item} and finds {a} more. "
        f"Write an expression for the number of {item} {name} has now.",
        "answer": f"x+{a}",
        "solution": f"x plus {a} is x+{a}, so the answer is \\boxed{{x+{a}}}.",
    }


MAKERS: dict[str, Callable[[random.Random], dict[str, str]]] = {
    "integer": _integer,
    "negative": _negative,
    "fraction": _fraction,
    "decimal": _decimal,
    "expression": _expression,
}


def generate(
    per_kind: int = 200, seed: int = 0, kinds: tuple[str, ...] = KINDS
) -> list[dict[str, str]]:
    """Up to ``per_kind`` distinct problems of each kind (fewer where a kind has fewer), in a
    seeded order."""
    unknown = [k for k in kinds if k not in MAKERS]
    if unknown:
        raise ValueError(f"unknown kinds {unknown} (known: {', '.join(KINDS)})")
    rng = random.Random(seed)
    rows: list[dict[str, str]] = []
    for kind in kinds:
        seen: set[str] = set()
        for _ in range(per_kind * 20):  # distinct problems; small kinds run out first
            row = MAKERS[kind](rng)
            if row["problem"] not in seen:
                seen.add(row["problem"])
                rows.append({**row, "kind": kind})
            if len(seen) >= per_kind:
                break
    rng.shuffle(rows)
    return rows


def split(
    rows: list[dict[str, str]], test_fraction: float = 0.2, seed: int = 0
) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """(train, test): a seeded ``test_fraction`` of each kind held out."""
    if not 0 < test_fraction < 1:
        raise ValueError("test_fraction must be in (0, 1)")
    rng = random.Random(seed + 1)
    train: list[dict[str, str]] = []
    test: list[dict[str, str]] = []
    for kind in dict.fromkeys(r["kind"] for r in rows):
        of_kind = [r for r in rows if r["kind"] == kind]
        rng.shuffle(of_kind)
        n_test = max(1, round(len(of_kind) * test_fraction))
        test += of_kind[:n_test]
        train += of_kind[n_test:]
    return train, test


def write_jsonl(path: Path, rows: list[dict[str, str]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as fh:
        for row in rows:
            fh.write(json.dumps(row) + "\n")


def write_dataset(
    out: str | Path,
    per_kind: int = 200,
    seed: int = 0,
    kinds: tuple[str, ...] = KINDS,
    test_fraction: float = 0.2,
) -> dict[str, int]:
    """Write the train/test split and the held-out benchmark file; returns the row counts."""
    out = Path(out)
    train, test = split(generate(per_kind, seed, kinds), test_fraction, seed)
    write_jsonl(out / "train.jsonl", train)
    write_jsonl(out / "test.jsonl", test)
    write_jsonl(out / "benchmarks" / "wordmath.jsonl", test)
    return {"train": len(train), "test": len(test)}


def corpus(rows: list[dict[str, str]]) -> list[str]:
    """Text a tokenizer for this set learns from: problems and worked solutions."""
    return [f"{r['problem']}\n{r['solution']}" for r in rows]
