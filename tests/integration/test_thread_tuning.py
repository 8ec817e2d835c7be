"""The thread budget in running processes (``reval/threads.py``): ``reval train`` feeds its tuner
each pretraining step and each round, and the tuner settles on a count within the budget; under
Ray an actor's ``num_cpus`` is its CPUs, and the ``OMP_NUM_THREADS`` Ray sets for it is a cap the
tuner works within, not the operator's count; the driver has no Ray budget."""

from __future__ import annotations

import pytest

from tests.integration.test_train_resume import TINY, sets


def test_reval_train_feeds_its_tuner_each_step_and_round(tmp_path, monkeypatch) -> None:
    import torch

    from reval import threads
    from services.cli import main

    monkeypatch.delenv("OMP_NUM_THREADS")  # (the tests' runs hold a count: tests/conftest.py)
    monkeypatch.setattr(threads, "_affinity", lambda: 2)  # a budget of 2 on any machine
    monkeypatch.setattr(threads, "CGROUP_ROOT", tmp_path)
    seen: list[tuple[int, float]] = []
    kinds: list[str] = []
    real_tick = threads.ThreadTuner.tick

    def tick(self: threads.ThreadTuner, seconds: float, unit: str = "") -> None:
        seen.append((self.threads, seconds))
        kinds.append(unit)
        assert torch.get_num_threads() == self.threads  # (what it says is what torch runs)
        real_tick(self, seconds, unit)

    monkeypatch.setattr(threads.ThreadTuner, "tick", tick)
    rounds = 6
    rc = main(["train", "--no-progress",
               *sets(*TINY, "model.pretrain_steps=12", f"learner.rounds={rounds}",
                     f"output_dir={tmp_path}", "name=t")])  # fmt: skip
    assert rc == 0
    assert kinds == ["pretraining step"] * 12 + ["round"] * rounds  # each step, then each round
    assert {n for n, _ in seen} <= {1, 2} and {n for n, _ in seen[:3]} == {1, 2}  # both tried
    assert threads._tuner is not None and threads._tuner.candidates == [2, 1]


@pytest.mark.timeout(300)
def test_a_ray_actor_takes_its_num_cpus_as_its_budget(monkeypatch) -> None:
    import ray

    from reval import threads

    monkeypatch.delenv("OMP_NUM_THREADS")  # (Ray's workers inherit the driver's environment)

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:

        @ray.remote(num_cpus=1)
        class Probe:
            def budget(self) -> tuple[float, int, str, bool]:
                from reval import threads

                b = threads.budget("worker")
                return b.cpus, b.intra_op, b.source, threads.apply(b).fixed

        probe = Probe.remote()  # type: ignore[attr-defined]
        assert ray.get(probe.budget.remote(), timeout=120) == (1.0, 1, "Ray num_cpus", True)
        assert threads.ray_cpus() is None  # (this process is Ray's driver)
    finally:
        ray.shutdown()
