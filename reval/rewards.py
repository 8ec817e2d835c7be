"""Reward transforms, fixed per trajectory at collection time (docs/algorithm.md §4).

Torch-free: rollout workers apply them per prompt group before pushing to the buffer.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Hashable, Sequence
from typing import Literal

RewardVariant = Literal["binary", "group_mean", "plus_minus"]


def transform_rewards(
    rewards: Sequence[float], groups: Sequence[Hashable], variant: RewardVariant
) -> list[float]:
    """Transform raw 0/1 rewards.

    - ``binary``: unchanged.
    - ``group_mean``: ``r - mean`` over the answers that share a group (prompt uid) within the
      generation batch; with one answer per group this is identically 0.
    - ``plus_minus``: ``2r - 1``.
    """
    if len(rewards) != len(groups):
        raise ValueError(f"{len(rewards)} rewards but {len(groups)} group ids")
    if variant == "binary":
        return [float(r) for r in rewards]
    if variant == "plus_minus":
        return [2.0 * float(r) - 1.0 for r in rewards]
    if variant == "group_mean":
        sums: dict[Hashable, float] = defaultdict(float)
        counts: dict[Hashable, int] = defaultdict(int)
        for r, g in zip(rewards, groups, strict=True):
            sums[g] += float(r)
            counts[g] += 1
        return [float(r) - sums[g] / counts[g] for r, g in zip(rewards, groups, strict=True)]
    raise ValueError(f"unknown reward variant {variant!r}")
