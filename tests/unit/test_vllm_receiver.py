"""``VLLMReceiver.take`` with tensor-parallel workers (no vLLM needed: the workers are fakes
behind ``collective_rpc``): a worker that receives the next version between the engine's look
at the workers and its take declines while the others load; the engine then waits until they
all hold one version and loads it, instead of raising and leaving them on different weights."""

from __future__ import annotations

from typing import Any

import pytest

from rollout.vllm_worker import VLLMReceiver


class Worker:
    def __init__(self) -> None:
        self.held: int | None = None
        self.loaded: int | None = None
        self.received = 0

    def receive(self, version: int) -> None:
        self.held, self.received = version, self.received + 1

    def take(self, version: int, newer_than: int) -> bool:
        if self.held != version:
            return False
        self.held = None
        if version <= newer_than:
            return False
        self.loaded = version
        return True


class FakeLLM:
    """Two workers; ``on_state`` runs after each ``reval_state`` (a broadcast landing)."""

    def __init__(self) -> None:
        self.workers = [Worker(), Worker()]
        self.on_state: list[Any] = []

    def collective_rpc(self, method: str, args: tuple[Any, ...] = ()) -> list[Any]:
        if method == "reval_state":
            out = [(w.held, w.received) for w in self.workers]
            if self.on_state:
                self.on_state.pop(0)()
            return out
        if method == "reval_take":
            return [w.take(*args) for w in self.workers]
        raise AssertionError(method)


class FakeEngine:
    def __init__(self) -> None:
        self.llm = FakeLLM()
        self.policy_version = 0

    def _weights_changed(self, version: int) -> None:
        self.policy_version = version


def test_a_worker_a_version_ahead_mid_take_is_waited_for():
    engine = FakeEngine()
    a, b = engine.llm.workers
    receiver = VLLMReceiver(engine)  # type: ignore[arg-type]
    receiver.timeout_s = 5.0
    a.receive(3)
    b.receive(3)
    # v4 reaches b right after the engine saw both holding v3; a gets it a little later.
    engine.llm.on_state = [lambda: b.receive(4), lambda: None, lambda: a.receive(4)]
    assert receiver.take(newer_than=2) == 4
    assert a.loaded == b.loaded == 4 and engine.policy_version == 4
    assert receiver.received() == 2


def test_workers_that_never_agree_again_raise_after_the_timeout():
    engine = FakeEngine()
    a, b = engine.llm.workers
    receiver = VLLMReceiver(engine)  # type: ignore[arg-type]
    receiver.timeout_s = 0.2
    a.receive(3)
    b.receive(3)
    engine.llm.on_state = [lambda: b.receive(4)]
    with pytest.raises(RuntimeError, match="different weights"):
        receiver.take(newer_than=2)


def test_nothing_new_or_not_newer_is_none():
    engine = FakeEngine()
    a, b = engine.llm.workers
    receiver = VLLMReceiver(engine)  # type: ignore[arg-type]
    assert receiver.take(newer_than=None) is None
    a.receive(3)
    b.receive(3)
    assert receiver.take(newer_than=3) is None and engine.policy_version == 0
