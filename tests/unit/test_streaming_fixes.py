"""Three fixes of the streaming worker (issue 37): a load that gave nothing is tried again for the
same announcement; an earlier grading error is not masked by a later one at shutdown. (The third,
``WorkerStats.versions`` bounded to one entry per version, is checked in
``test_streaming_worker.py``.) On ``test_streaming.py``'s fake engine."""

from __future__ import annotations

import logging
import time

import pytest

from rollout.streaming import Group
from tests.unit.test_streaming import FakeEngine, Weights, dealer, prompts, streamer


class FlakyWeights(Weights):
    """The first load of an announcement gives nothing (the file unreadable: pruned, cut short
    on a shared volume), the next one loads."""

    def __init__(self, engine: FakeEngine) -> None:
        super().__init__(engine)
        self.tries = 0

    def load(self) -> int | None:
        if self.announced != self.engine.policy_version:
            self.tries += 1
            if self.tries == 1:
                return None
        return super().load()


@pytest.mark.parametrize("inflight", ["keep", "finish"])
def test_a_load_that_gave_nothing_is_retried_for_the_same_announcement(inflight):
    engine, groups = FakeEngine(), []
    weights = FlakyWeights(engine)
    items = prompts([40, 3, 3, 3, 3, 3, 3, 3])
    _, deal = dealer(items)
    s = streamer(engine, groups, weights, inflight=inflight)  # type: ignore[arg-type]
    s.load_retry_s = 0.0
    original = engine.step

    def step() -> list:
        if len(engine.running_per_step) == 2:
            weights.announced = 1  # announced once, never again
        return original()

    engine.step = step  # type: ignore[method-assign]
    stats = s.run(deal, max_groups=len(items))
    assert weights.tries == 2 and [v for v, _ in weights.loads] == [1]
    assert engine.policy_version == 1 and stats.loads == 1 and stats.load_retries == 1


def test_the_first_grading_error_raises_and_the_later_ones_are_logged(caplog):
    engine, graded = FakeEngine(), []
    items = prompts([2, 2, 60])

    def on_group(g: Group) -> None:
        graded.append(g.prompt.id)
        if g.prompt.id == "p0":
            raise ValueError("first")
        if g.prompt.id == "p1":
            time.sleep(0.05)  # (still grading when the loop meets the first error)
            raise RuntimeError("second")

    s = streamer(engine, [], None)
    s.on_group = on_group
    _, deal = dealer(items)
    with (
        caplog.at_level(logging.ERROR, "reval.streaming"),
        pytest.raises(ValueError, match="first"),
    ):
        s.run(deal, max_groups=len(items))
    assert graded[:2] == ["p0", "p1"]
    assert "RuntimeError: second" in caplog.text
