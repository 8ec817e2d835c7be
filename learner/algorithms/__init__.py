"""The loss table: one module per algorithm (``value.py``: ReVal, TBRM, regression; ``grpo.py``),
each an ``Algorithm`` (``base.py``), and the registry ``algo.name`` resolves through, once, when
the learner is built (``build_algorithm``): a name of ``ALGORITHMS``, or a class of the user's by
import path (``package.module:Class``, ``path/to/file.py:Class``; docs/algorithm.md, "Adding a
loss")."""

from __future__ import annotations

from collections.abc import Callable

from learner.algorithms.base import Algorithm, LossInputs, MiniBatch
from learner.algorithms.grpo import GRPO
from learner.algorithms.value import ValueAlgorithm
from reval.config import AlgoConfig

ALGORITHMS: dict[str, Callable[[AlgoConfig], Algorithm]] = {
    "reval": lambda algo: ValueAlgorithm(algo, "reval"),
    "tbrm": lambda algo: ValueAlgorithm(algo, "tbrm"),
    "regression": lambda algo: ValueAlgorithm(algo, "regression"),
    "grpo": GRPO,
}
"""The built-in losses by ``algo.name`` (``reval.config.BUILTIN_ALGORITHMS`` lists the names)."""


def build_algorithm(algo: AlgoConfig) -> Algorithm:
    """The ``Algorithm`` of ``algo.name``: built-in, or the user's class (called with the
    ``algo`` section) by import path."""
    make = ALGORITHMS.get(algo.name)
    if make is None:
        from reval.plugins import load_callable

        make = load_callable(algo.name, "algo.name")
    return make(algo)


__all__ = ["ALGORITHMS", "Algorithm", "LossInputs", "MiniBatch", "build_algorithm"]
