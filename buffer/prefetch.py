"""Sampling ahead: background threads draw the next batches while the learner trains on the
current one, so the round trip to Redis and the decoding of records overlap the update (and
each other). Works with any ReplayConsumer.

Semantics: a prefetched batch was drawn up to ``depth`` batches before it is consumed (its use
counts, the rate limiter and its staleness figures were updated at draw time). The learner
service uses ``depth=1`` or ``2``; the Redis benchmark reports sampling throughput both ways.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

from buffer.base import ReplayConsumer, SampledBatch, SampleTimeout


class Prefetcher:
    def __init__(
        self,
        buffer: ReplayConsumer,
        batch_size: int,
        depth: int = 2,
        workers: int = 2,
        poll_s: float = 0.5,
        draw: Callable[[float], SampledBatch] | None = None,
    ) -> None:
        """``draw(timeout)``: how a batch is drawn (default ``buffer.sample(batch_size, ...)``;
        the learner passes its batch source). A stateful ``draw`` wants ``workers=1``."""
        if depth < 1 or workers < 1:
            raise ValueError(f"depth and workers must be >= 1, got {depth} and {workers}")
        self.buffer = buffer
        self.batch_size = batch_size
        self._draw = draw or (lambda timeout: buffer.sample(batch_size, timeout=timeout))
        self._queue: queue.Queue[SampledBatch | BaseException] = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._poll_s = poll_s
        self._threads = [
            threading.Thread(target=self._work, name=f"reval-prefetch-{i}", daemon=True)
            for i in range(workers)
        ]
        for t in self._threads:
            t.start()

    def _work(self) -> None:
        while not self._stop.is_set():
            try:
                batch = self._draw(self._poll_s)
            except SampleTimeout:
                continue  # nothing to hand out yet (limiter, too few held): keep waiting
            except BaseException as err:  # a real failure: hand it to the consumer
                self._put(err)
                return
            self._put(batch)

    def _put(self, item: SampledBatch | BaseException) -> None:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def get(self, timeout: float) -> SampledBatch:
        """The next batch; raises SampleTimeout when none comes within ``timeout`` seconds, and
        re-raises a worker's failure."""
        try:
            item = self._queue.get(timeout=timeout)
        except queue.Empty:
            raise SampleTimeout(
                f"no batch of {self.batch_size} within {timeout:.1f}s (prefetching)"
            ) from None
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=5)

    def __enter__(self) -> Prefetcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
