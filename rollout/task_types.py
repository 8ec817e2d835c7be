"""The types every task shares: a ``Prompt``, the ``Verifier`` protocol that scores a response to
it, and the ``Task`` protocol. Torch-free, so a task module (``rollout/math_task.py``) and the
built-in tasks with their factory (``rollout/tasks.py``, which re-exports these) both import
them from here without importing each other."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True)
class Prompt:
    id: str
    """Stable id within the task."""
    text: str
    """What the model is conditioned on."""
    answer: str
    """Gold answer, as the verifier reads it."""
    raw: Any = field(default=None, compare=False, repr=False)
    """A custom task's prompt as its dataset holds it (a string or chat messages), handed to
    the reward function; ``text`` is what the model reads."""
    metadata: Mapping[str, Any] | None = field(default=None, compare=False, repr=False)
    """A custom task's other columns of the row, handed to the reward function."""


class Verifier(Protocol):
    def score(self, prompt: Prompt, response: str) -> float:
        """Reward of ``response`` to ``prompt``: 1.0 correct, 0.0 not."""
        ...


class Task(Protocol):
    name: str
    prompts: Sequence[Prompt]
    verifier: Verifier

    def pretrain_texts(self, rng: random.Random, count: int) -> list[str]:
        """Task-shaped text (prompt + a plausible but random answer) for LM pretraining."""
        ...
