"""``reval launch`` and workers that exit when their run is done (issue 38): a worker that
finished by itself (not drained by the driver) saw its run end, so the driver starts no
replacement for it; one that died is still replaced."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from services.launch import Launch, _Worker


class DoneRay:
    """Every worker's ``run`` ref ready: returned (a summary) or raised (a death)."""

    def __init__(self, died: bool = False) -> None:
        self.died = died
        self.killed: list[Any] = []

    def wait(self, refs, num_returns, timeout):
        return refs, []

    def get(self, ref):
        if self.died:
            raise RuntimeError("the actor died")
        return {"worker": "w0", "batches": 3}

    def kill(self, actor, no_restart=True):
        self.killed.append(actor)


def _driver(ray: DoneRay) -> tuple[Launch, list[int]]:
    driver = Launch.__new__(Launch)  # (the loop's state only: no Ray)
    driver.ray = ray
    driver.workers = {"w0": _Worker("w0", actor="a0", ref="r0")}
    driver.control = SimpleNamespace(read=lambda: SimpleNamespace(phase="running", workers=1),
                                     set_workers=lambda n: None)  # fmt: skip
    driver.stop_requested = False
    driver.replace_after = 0.0
    driver.ended_workers = 0
    driver.deaths = []
    driver.dead_workers = 0
    driver.metrics = SimpleNamespace(dead=SimpleNamespace(inc=lambda: None))
    driver.cfg = SimpleNamespace(launch=SimpleNamespace(replace_dead_workers=True))
    added: list[int] = []
    driver.add_workers = lambda n: added.append(n) or []  # type: ignore[method-assign]
    return driver, added


def test_a_worker_that_finished_by_itself_is_not_replaced() -> None:
    driver, added = _driver(DoneRay())
    driver._check_workers()
    assert driver.workers == {}
    driver._follow_control()
    assert added == []


def test_a_worker_that_died_is_still_replaced() -> None:
    driver, added = _driver(DoneRay(died=True))
    driver._check_workers()
    driver.replace_after = 0.0  # (the back-off over)
    driver._follow_control()
    assert added == [1]
