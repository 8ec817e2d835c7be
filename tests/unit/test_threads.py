"""The thread budget (reval/threads.py): the CPUs given (affinity, capped by a cgroup v2 or v1
quota, read from made-up cgroup files), the operator's OMP_NUM_THREADS winning, the split
between processes, Ray's num_cpus, ``apply`` setting torch's threads (and nothing else), the
tuner keeping the fastest count within the budget, and ``reval doctor`` saying each role's."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from reval import threads
from reval.config import load_config
from services import doctor

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads, "_affinity", lambda: 8)


def v2(tmp_path: Path, text: str) -> Path:
    (tmp_path / "cpu.max").write_text(text + "\n")
    return tmp_path


def v1(tmp_path: Path, quota: int, period: int = 100000) -> Path:
    (tmp_path / "cpu").mkdir(parents=True)
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text(f"{quota}\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text(f"{period}\n")
    return tmp_path


def test_cgroup_v2_quota_caps_the_affinity(tmp_path: Path) -> None:
    root = v2(tmp_path, "150000 100000")
    assert threads.cgroup_quota(root) == 1.5
    assert threads.cpus_given(root) == 1.5
    b = threads.budget("train", root=root)
    assert (b.intra_op, b.inter_op, b.source) == (1, 1, "cgroup quota")


def test_cgroup_v2_max_is_no_cap(tmp_path: Path) -> None:
    root = v2(tmp_path, "max 100000")
    assert threads.cgroup_quota(root) is None
    assert threads.cpus_given(root) == 8
    assert threads.budget("train", root=root).source == "affinity"


def test_cgroup_v1_quota_and_none(tmp_path: Path) -> None:
    assert threads.cgroup_quota(v1(tmp_path / "a", 300000)) == 3.0
    assert threads.budget("worker", root=tmp_path / "a").intra_op == 3
    assert threads.cgroup_quota(v1(tmp_path / "b", -1)) is None
    assert threads.cpus_given(tmp_path / "b") == 8


def test_no_cgroup_files_the_affinity_alone(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(threads, "_affinity", lambda: 3)
    assert threads.cgroup_quota(tmp_path) is None
    assert threads.cpus_given(tmp_path) == 3
    # A quota above the affinity does not raise it.
    assert threads.cpus_given(v2(tmp_path, "800000 100000")) == 3


def test_never_below_one_cpu(tmp_path: Path) -> None:
    root = v2(tmp_path, "20000 100000")  # 0.2 CPU
    assert threads.cpus_given(root) == 1
    assert threads.budget("learner rank", share=4, root=root).intra_op == 1


def test_share_splits_the_cpus(tmp_path: Path) -> None:
    b = threads.budget("learner rank", share=3, root=tmp_path)
    assert (b.cpus, b.intra_op, b.source) == (8, 2, "affinity, share of 3")
    assert b.describe() == "threads: 2 intra-op, 1 inter-op (of 8 CPUs given: affinity, share of 3)"


def test_the_operators_omp_num_threads_wins(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "5")
    b = threads.budget("learner rank", share=4, root=v2(tmp_path, "100000 100000"))
    assert (b.intra_op, b.source) == (5, "OMP_NUM_THREADS")


def test_apply_sets_torchs_threads_and_leaves_the_environment(monkeypatch, caplog) -> None:
    import logging

    import torch

    caplog.set_level(logging.DEBUG, logger="reval.threads")
    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    env = dict(os.environ)
    b = threads.ThreadBudget("train", 8, 3, 1, "affinity")
    try:
        tuner = threads.apply(b)  # inter-op may be fixed already in this process: not an error
        assert torch.get_num_threads() == 3
        assert tuner.candidates == [3, 1] and not tuner.fixed
        assert dict(os.environ) == env  # (a caller's environment, e.g. a test's, untouched)
        assert "train: threads: 3 intra-op, 1 inter-op (of 8 CPUs given: affinity)" in caplog.text
        assert all(r.levelno == logging.DEBUG for r in caplog.records)  # (not one more line)
    finally:
        torch.set_num_threads(before)


def test_doctor_shows_the_budget_of_each_role(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(threads, "CGROUP_ROOT", tmp_path)  # no quota
    cfg = load_config(str(ROOT / "configs" / "demo.toml"), ["learner.world_size=2"], environ={})
    budgets = doctor.thread_budgets(cfg)
    facts = doctor.Facts(cuda_available=False, torch_version="2", cuda_version=None,
                         nccl_version=None, gpu_count=0, shm_bytes=None, disk_free_bytes=0,
                         disk_path="/", vllm_version=None, threads=budgets)  # fmt: skip
    check = {c.name: c for c in doctor.run_checks(cfg, facts, None)}["threads"]
    assert check.status == "ok"
    assert "train: threads: 8 intra-op" in check.message
    assert "learner rank: threads: 4 intra-op" in check.message
    assert "share of 2" in check.message
    assert "worker: threads: 8 intra-op" in check.message
    # reval launch on a local Ray: "auto" splits the 8 CPUs between the 2 ranks and 2 workers.
    assert (
        "learner rank (reval launch): threads: 2 intra-op, 1 inter-op (of 2 CPUs given: Ray "
        "num_cpus)" in check.message
    )
    assert "worker (reval launch): threads: 2 intra-op" in check.message
    # On a cluster (RAY_ADDRESS) the nodes are not known here: 1 CPU each, unless set.
    monkeypatch.setenv("RAY_ADDRESS", "ray://head:10001")
    cluster = {b.role: b for b in doctor.thread_budgets(cfg)}
    assert cluster["learner rank (reval launch)"].intra_op == 1
    assert cluster["worker (reval launch)"].intra_op == 1


@pytest.mark.parametrize(
    ("sets", "world", "cores", "want"),
    [
        ({}, 1, 16, (5.0, 5.0)),  # 1 rank + 2 workers share 16 CPUs: 5 each (1 left over)
        ({}, 2, 8, (2.0, 2.0)),
        ({}, 1, 2, (1.0, 1.0)),  # fewer CPUs than processes: 1 each, never 0
        ({"learner_cpus": 4}, 1, 16, (4.0, 6.0)),  # the workers share what the rank leaves
        ({"rollout_cpus": 0.5}, 1, 16, (15.0, 0.5)),  # the rank shares what the workers leave
        ({"workers": 0}, 2, 8, (4.0, 1.0)),  # no workers: the ranks share the machine
        ({"local_cpus": 32}, 1, 4, (10.0, 11.0)),  # a local Ray told its size: that is split
        ({}, 1, None, (1.0, 1.0)),  # a cluster: 1 each
        ({"learner_cpus": 3, "rollout_cpus": 2}, 1, None, (3.0, 2.0)),  # numbers stand
    ],
)
def test_launch_splits_a_local_rays_cpus_between_the_learner_and_the_workers(
    sets: dict, world: int, cores: int | None, want: tuple[float, float]
) -> None:
    from reval.config import LaunchConfig

    launch = LaunchConfig(**sets)
    assert launch.cpus(world, cores) == want
    if cores is not None:  # the local Ray holds them all, with room for two more workers
        learner, rollout = want
        ray_cpus = launch.local_ray_cpus(world, cores)
        assert ray_cpus >= world * learner + launch.workers * rollout
        assert launch.local_ray_room(world, cores) >= launch.workers


def test_launch_cpus_auto_is_the_default_and_numbers_are_checked() -> None:
    from pydantic import ValidationError

    cfg = load_config(str(ROOT / "configs" / "demo.toml"), ["launch.rollout_cpus=1.5"], environ={})
    assert cfg.launch.learner_cpus == "auto" and cfg.launch.rollout_cpus == 1.5
    for bad in ("launch.learner_cpus=0", "launch.rollout_cpus=-1", "launch.learner_cpus=many"):
        with pytest.raises((ValidationError, ValueError)):
            load_config(str(ROOT / "configs" / "demo.toml"), [bad], environ={})


class _Applied(Exception):
    """Raised by the spy: the process stops at its budget (nothing else of it runs)."""


def _spy(seen: list[threads.ThreadBudget]):
    def apply(b: threads.ThreadBudget) -> None:
        seen.append(b)
        raise _Applied

    return apply


def test_each_process_applies_its_budget_first(tmp_path: Path, monkeypatch) -> None:
    import learner.ranks
    import rollout.worker
    from services.cli import main

    seen: list[threads.ThreadBudget] = []
    monkeypatch.setattr(threads, "apply", _spy(seen))
    monkeypatch.setattr(learner.ranks, "apply_threads", _spy(seen))
    monkeypatch.setattr(rollout.worker, "apply_threads", _spy(seen))
    monkeypatch.setattr(threads, "CGROUP_ROOT", tmp_path)
    cfg = load_config(str(ROOT / "configs" / "demo.toml"), [], environ={})
    with pytest.raises(_Applied):
        main(["train", "--set", f"output_dir={tmp_path}"])
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(_Applied):
        learner.ranks.run_rank(cfg, False, None)
    with pytest.raises(_Applied):
        rollout.worker.main(cfg, None, 1, None)
    assert [(b.role, b.intra_op) for b in seen] == [
        ("train", 8),
        ("learner rank", 4),
        ("worker", 8),
    ]


class _Work:
    """A unit of work whose seconds depend on the threads in force (the tuner's setter)."""

    def __init__(self, seconds: dict[int, float]) -> None:
        self.seconds = seconds
        self.threads = -1
        self.sets: list[int] = []
        self.units: list[int] = []
        """The threads each unit ran at."""

    def set(self, n: int) -> None:
        self.threads = n
        self.sets.append(n)

    def warm_up(self, tuner: threads.ThreadTuner) -> None:
        """The first unit, which the tuner leaves out (warm-up)."""
        tuner.tick(1000.0)

    def run(self, tuner: threads.ThreadTuner, units: int) -> None:
        for _ in range(units):
            self.units.append(tuner.threads)
            tuner.tick(self.seconds[tuner.threads])


def test_candidates_halve_down_to_one() -> None:
    assert threads.candidates(8) == [8, 4, 2, 1]
    assert threads.candidates(3) == [3, 1]
    assert threads.candidates(1) == [1]


def test_the_tuner_keeps_the_fastest_count_beside_a_busy_neighbour() -> None:
    work = _Work({2: 6.8, 1: 0.83})  # issue 39's demo round: two threads beside a neighbour
    tuner = threads.ThreadTuner("train", 2, work.set, probe=3, every=10)
    work.warm_up(tuner)
    work.run(tuner, 3)
    assert tuner.threads == work.threads == 1  # two threads dropped after their first unit
    work.run(tuner, 9)
    assert tuner.threads == 1  # held
    assert work.units[:4] == [2, 1, 1, 1] and work.units.count(2) == 1


def test_the_tuner_keeps_the_budget_when_it_is_fastest() -> None:
    work = _Work({4: 0.5, 2: 0.6, 1: 0.9})
    tuner = threads.ThreadTuner("learner rank", 4, work.set, probe=3, every=10)
    work.warm_up(tuner)
    work.run(tuner, 9)
    assert tuner.threads == 4
    assert sorted(work.units) == [1, 1, 1, 2, 2, 2, 4, 4, 4]  # each tried in turn


def test_the_tuner_probes_again_when_a_neighbour_comes_and_goes() -> None:
    work = _Work({2: 0.6, 1: 0.9})
    tuner = threads.ThreadTuner("worker", 2, work.set, probe=3, every=1000)
    work.warm_up(tuner)
    work.run(tuner, 6)
    assert tuner.threads == 2
    work.seconds = {2: 6.0, 1: 0.9}  # a busy neighbour: two threads now spin
    work.run(tuner, 3 + 2)  # the held units grow slower: probed again at once
    assert tuner.threads == 1
    # It goes on probing after its interval (doubled while the same count wins), so a
    # neighbour that leaves gives the threads back.
    work.seconds = {2: 0.6, 1: 0.9}
    work.run(tuner, 1100)
    assert tuner.threads == 2


def test_at_one_thread_slower_units_are_the_load_not_a_reason_to_probe() -> None:
    work = _Work({2: 6.0, 1: 0.9})
    tuner = threads.ThreadTuner("train", 2, work.set, probe=3, every=1000)
    work.warm_up(tuner)
    work.run(tuner, 3)
    assert tuner.threads == 1
    work.seconds = {2: 60.0, 1: 5.0}  # the machine got busier still
    work.run(tuner, 500)
    assert work.units.count(2) == 1  # (only the first probe's unit)


def test_the_interval_doubles_while_the_same_count_wins() -> None:
    work = _Work({2: 1.0, 1: 0.5})  # (two threads slower, but not dropped: not 2x)
    tuner = threads.ThreadTuner("train", 2, work.set, probe=2, every=10, every_max=40)
    work.warm_up(tuner)
    work.run(tuner, 4 + 10 + 4 + 20 + 4 + 40 + 4 + 40 + 4)  # probes, held 10, 20, 40, 40
    at_two = [i for i, n in enumerate(work.units) if n == 2]
    starts = [0, 14, 38, 82, 126]  # each probe: one unit at each count, twice (2 first)
    assert at_two == [i + k for i in starts for k in (0, 2)]
    assert tuner.threads == 1


def test_a_fixed_count_is_never_changed(monkeypatch) -> None:
    work = _Work({3: 9.0, 1: 0.1})
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    b = threads.budget("train")
    import torch

    before = torch.get_num_threads()
    try:
        tuner = threads.apply(b)
        tuner._set = work.set
        work.threads = 3
        work.run(tuner, 50)
        assert tuner.fixed and work.sets == [] and torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)


def test_under_ray_the_actors_num_cpus_is_the_cap_and_rays_omp_is_not_held(
    tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.setattr(threads, "ray_cpus", lambda: 3.0)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # what Ray sets for an actor of num_cpus=3
    b = threads.budget("worker", root=tmp_path)
    assert (b.cpus, b.intra_op, b.source) == (3.0, 3, "Ray num_cpus")
    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # the operator's: held
    assert threads.budget("worker", root=tmp_path).source == "OMP_NUM_THREADS"


def test_the_grading_pool_is_sized_from_the_cpus_given(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(threads, "CGROUP_ROOT", tmp_path)  # no quota: the affinity's 8
    cfg = load_config(str(ROOT / "configs" / "demo.toml"), [], environ={})
    assert cfg.rollout.verifier_workers == "auto"
    assert cfg.rollout.grading_processes() == 8
    v2(tmp_path, "250000 100000")  # a container of 2.5 CPUs
    assert cfg.rollout.grading_processes() == 2
    monkeypatch.setattr(threads, "_affinity", lambda: 64)
    (tmp_path / "cpu.max").unlink()
    assert cfg.rollout.grading_processes() == cfg.rollout.MAX_AUTO_GRADERS
    monkeypatch.setattr(threads, "ray_cpus", lambda: 1.0)  # a Ray actor of num_cpus=1
    assert cfg.rollout.grading_processes() == 1
    fixed = load_config(str(ROOT / "configs" / "demo.toml"), ["rollout.verifier_workers=3"],
                        environ={})  # fmt: skip
    assert fixed.rollout.grading_processes() == 3
    with pytest.raises(Exception, match="verifier_workers"):
        load_config(str(ROOT / "configs" / "demo.toml"), ["rollout.verifier_workers=0"],
                    environ={})  # fmt: skip


def test_the_first_unit_and_each_new_kind_start_afresh() -> None:
    work = _Work({2: 0.6, 1: 0.9})
    tuner = threads.ThreadTuner("train", 2, work.set, probe=2, every=1000)
    tuner.tick(50.0, "pretraining step")  # warm-up at two threads: left out, 2 not dropped
    for _ in range(4):
        work.units.append(tuner.threads)
        tuner.tick(work.seconds[tuner.threads], "pretraining step")
    assert tuner.threads == 2
    work.seconds = {2: 6.0, 1: 3.0}  # rounds: longer units, one thread now faster
    tuner.tick(6.0, "round")  # another kind: afresh (and its first left out)
    for _ in range(4):
        tuner.tick(work.seconds[tuner.threads], "round")
    assert tuner.threads == 1


def test_a_zero_second_unit_does_not_break_the_tuner() -> None:
    tuner = threads.ThreadTuner("worker", 2, lambda n: None, probe=2, every=1000)
    for s in (0.0, 0.0, 0.5, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0):
        tuner.tick(s)  # (ZeroDivisionError before: a held count's median over a best of 0)
    assert tuner.threads in (1, 2)


def test_under_reval_launch_a_worker_applies_its_budget_and_ranks_split_nothing_again(
    tmp_path: Path, monkeypatch
) -> None:
    """A Ray worker actor applies its budget (it runs no ``rollout.worker.main``), and a learner
    rank in a Ray actor takes its own ``num_cpus`` whole (Ray split the node already)."""
    import learner.ranks
    from services.launch_actors import RolloutActor

    seen: list[threads.ThreadBudget] = []
    monkeypatch.setattr(threads, "apply", _spy(seen))
    monkeypatch.setattr(learner.ranks, "apply_threads", _spy(seen))
    monkeypatch.setattr(threads, "CGROUP_ROOT", tmp_path)
    monkeypatch.setattr(threads, "ray_cpus", lambda: 4.0)
    monkeypatch.setattr(learner.ranks, "ray_cpus", lambda: 4.0)
    cfg = load_config(str(ROOT / "configs" / "demo.toml"), [], environ={})
    with pytest.raises(_Applied):
        RolloutActor("w0").run(cfg.model_dump_json())
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(_Applied):
        learner.ranks.run_rank(cfg, False, None)
    assert [(b.role, b.intra_op, b.source) for b in seen] == [
        ("worker", 4, "Ray num_cpus"),
        ("learner rank", 4, "Ray num_cpus"),
    ]
