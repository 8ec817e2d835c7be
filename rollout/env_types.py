"""The types of the multi-turn environment seam (``rollout/environment.py`` runs episodes;
re-exported there): the ``Environment`` protocol a user implements and the ``Step`` it answers.
Torch-free; a module of its own so that an environment module (the built-in
``rollout/calculator.py``, a user's) imports it without importing the episode loop."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from rollout.task_types import Prompt


@dataclass(frozen=True)
class Step:
    """The environment's answer to one turn of the model."""

    observation: str
    """Text appended after the turn when the episode goes on (tokenized as it is: the
    environment writes any chat markup it wants around it); ignored when ``done``."""
    reward: float
    """This step's reward (the episode's is the sum)."""
    done: bool
    """The episode is over (a final answer, a failure)."""


class Environment(Protocol):
    """One episode's environment; a new one per episode (``task.environment`` names its
    factory)."""

    def start(self, prompt: Prompt) -> None:
        """Begin an episode on ``prompt`` (its text is the model's first context; its gold
        answer and row are the environment's to use)."""
        ...

    def step(self, message: str) -> Step:
        """The model's turn (its text, special tokens removed) -> the next observation, a
        reward, done."""
        ...


EnvironmentFactory = Callable[[], Environment]
