"""Dealing prompts to any number of rollout workers: without replacement within an epoch, with a
cursor shared in Redis, so W workers never duplicate work and a restarted worker (or fleet)
resumes the epoch where it stopped.

Positions 0, 1, 2, ... of an endless deal map to (epoch, offset) = divmod(position, P); epoch e
visits the prompts in a permutation seeded by (seed, e). ``take(n)`` reserves n positions with one
INCRBY, so concurrent workers get disjoint ranges. The cursor key is tied to the dataset (its size
and a fingerprint of its ids): another dataset starts its own deal.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import redis

from reval.redis import deal_key
from reval.retry import retry_redis
from rollout.tasks import Prompt

log = logging.getLogger("reval.dealer")


def dataset_fingerprint(prompts: Sequence[Prompt]) -> str:
    h = hashlib.sha1(usedforsecurity=False)
    for p in prompts:
        h.update(p.id.encode())
        h.update(b"\0")
    return f"{len(prompts)}-{h.hexdigest()[:12]}"


class PromptDealer:
    def __init__(
        self,
        client: redis.Redis | None,
        key_prefix: str,
        run: str,
        prompts: Sequence[Prompt],
        seed: int = 0,
        retry_s: float = 300.0,
    ) -> None:
        """``client`` None: the cursor lives in this process (``reval train``, one consumer)."""
        if not prompts:
            raise ValueError("no prompts to deal")
        self.client = client
        self._local = 0
        self.prompts = list(prompts)
        self.seed = seed
        self.retry_s = retry_s
        self.key = deal_key(key_prefix, run, dataset_fingerprint(self.prompts))
        self._perms: dict[int, npt.NDArray[np.int64]] = {}

    def _perm(self, epoch: int) -> npt.NDArray[np.int64]:
        perm = self._perms.get(epoch)
        if perm is None:
            perm = np.random.default_rng([self.seed, epoch]).permutation(len(self.prompts))
            self._perms = {epoch: perm}  # one epoch at a time is all a worker needs
        return perm

    def _incr(self, n: int) -> int:
        if self.client is None:
            self._local += n
            return self._local
        client = self.client
        return int(retry_redis(lambda: client.incrby(self.key, n), self.retry_s, "prompt cursor"))

    def take(self, n: int) -> list[tuple[int, Prompt]]:
        """The next ``n`` prompts of the shared deal, each with its epoch."""
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        end = self._incr(n)
        out = []
        size = len(self.prompts)
        for pos in range(end - n, end):
            epoch, offset = divmod(pos, size)
            out.append((epoch, self.prompts[int(self._perm(epoch)[offset])]))
        return out

    def position(self) -> dict[str, Any]:
        """Where the deal stands: positions dealt, current epoch, offset within it."""
        dealt = self._local if self.client is None else int(self.client.get(self.key) or 0)
        epoch, offset = divmod(dealt, len(self.prompts))
        return {"dealt": dealt, "epoch": epoch, "offset": offset, "prompts": len(self.prompts)}
