"""A thread budget for every process: torch's and BLAS/OpenMP's threads sized from the CPUs the
process is given (its affinity, capped by the container's cgroup CPU quota), split between the
processes of a run on one machine. The operator's ``OMP_NUM_THREADS`` wins.

More threads than cores left to a process make OpenMP's threads spin at every barrier while a
core is taken: a demo round was 8x slower at torch's default beside other work (issue 39). The
budget is the most a process uses; within it, :class:`ThreadTuner` keeps the count that does the
process's work fastest, measured on that work (:func:`tick`), so a neighbour that takes a core
costs a few slow units, not every unit. torch is imported only by :func:`apply`.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("reval.threads")

CGROUP_ROOT = Path("/sys/fs/cgroup")
"""Where the cgroup files are read (v2: ``cpu.max``; v1: ``cpu/cpu.cfs_quota_us``)."""


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def cgroup_quota(root: Path | None = None) -> float | None:
    """The cgroup's CPU quota in CPUs (``"150000 100000"``: 1.5), None when there is none
    (v2 ``max``, v1 ``-1``, or no cgroup files)."""
    root = CGROUP_ROOT if root is None else root
    v2 = _read(root / "cpu.max")
    if v2 is not None:
        quota, _, period = v2.partition(" ")
        if quota == "max" or not period:
            return None
        return int(quota) / int(period)
    for d in (root / "cpu", root / "cpu,cpuacct", root):
        q, p = _read(d / "cpu.cfs_quota_us"), _read(d / "cpu.cfs_period_us")
        if q is not None and p is not None:
            return None if int(q) < 0 else int(q) / int(p)
    return None


def _affinity() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _given(root: Path | None) -> tuple[float, str]:
    cpus, source = float(_affinity()), "affinity"
    quota = cgroup_quota(root)
    if quota is not None and quota < cpus:
        cpus, source = quota, "cgroup quota"
    given_by_ray = ray_cpus()
    if given_by_ray is not None:
        cpus, source = min(cpus, given_by_ray), "Ray num_cpus"
    return max(1.0, cpus), source


def cpus_given(root: Path | None = None) -> float:
    """The CPUs this process may use: its affinity, capped by the cgroup quota and, in a Ray
    actor, by its ``num_cpus``; at least 1."""
    return _given(root)[0]


def machine_cpus(root: Path | None = None) -> int:
    """The whole CPUs this process is given (``cpus_given``, rounded down): what ``reval
    launch`` splits between the processes of a local Ray (``LaunchConfig.cpus``)."""
    return max(1, math.floor(cpus_given(root)))


@dataclass(frozen=True)
class ThreadBudget:
    """The threads one process of a run uses."""

    role: str
    """Which process: ``train``, ``learner rank``, ``worker``."""
    cpus: float
    """The CPUs given to this process's machine slot (:func:`cpus_given`)."""
    intra_op: int
    """torch's intra-op threads (``torch.set_num_threads``), and OpenMP's/BLAS's."""
    inter_op: int
    """torch's inter-op threads: 1 (reval forks no inter-op work; more threads only spin)."""
    source: str
    """Where ``intra_op`` came from: ``OMP_NUM_THREADS``, ``affinity`` or ``cgroup quota``,
    with ``share of N`` when N processes split the CPUs."""

    def describe(self) -> str:
        """The one line said at start."""
        return (f"threads: {self.intra_op} intra-op, {self.inter_op} inter-op "
                f"(of {self.cpus:g} CPUs given: {self.source})")  # fmt: skip


def ray_cpus() -> float | None:
    """The CPUs Ray gave this process when it is a Ray actor (``num_cpus``: ``reval launch``
    splits a node's cores between the learner's ranks and the workers through
    ``launch.learner_cpus`` and ``launch.rollout_cpus``), else None. Ray is not imported here:
    only a process that runs under Ray has it loaded."""
    ray = sys.modules.get("ray")
    if ray is None:
        return None
    try:
        if not ray.is_initialized():
            return None
        ctx = ray.get_runtime_context()
        if ctx.get_actor_id() is None:  # (the driver: not an actor of the run)
            return None
        cpus = ctx.get_assigned_resources().get("CPU")
    except Exception:  # (an older or stub Ray: as without Ray)
        return None
    return None if cpus is None else float(cpus)


def budget(
    role: str, share: int = 1, root: Path | None = None, ray_num_cpus: float | None = None
) -> ThreadBudget:
    """The budget of a process that splits this machine's CPUs with ``share - 1`` others (the
    learner's ranks on one machine); under Ray, the ``num_cpus`` it was given. The operator's
    ``OMP_NUM_THREADS`` wins (Ray sets it to ``num_cpus`` for its actors when unset: that
    value is Ray's, a cap the tuner works within, not a count to hold). ``ray_num_cpus``: the
    budget of a Ray actor given that many (``reval doctor`` on the driver, for ``reval launch``'s
    roles)."""
    cpus, source = _given(root)
    given_by_ray = ray_cpus()
    if ray_num_cpus is not None:
        given_by_ray = ray_num_cpus
        cpus, source = max(1.0, min(cpus, ray_num_cpus)), "Ray num_cpus"
    omp = os.environ.get("OMP_NUM_THREADS", "").strip()
    if given_by_ray is not None and omp == str(max(1, math.floor(given_by_ray))):
        omp = ""  # (Ray's own setting)
    if omp.isdigit() and int(omp) > 0:
        return ThreadBudget(role, cpus, int(omp), 1, "OMP_NUM_THREADS")
    share = max(1, share)
    intra = max(1, math.floor(cpus / share))
    if share > 1:
        source = f"{source}, share of {share}"
    return ThreadBudget(role, cpus, intra, 1, source)


def apply(b: ThreadBudget) -> ThreadTuner:
    """Set torch's threads to the budget (inter-op only while torch still allows it) and say
    the budget (at debug level: a process's first lines stay its own). Returns the tuner that
    keeps the intra-op threads within it the fastest for the work (fixed when the operator set
    ``OMP_NUM_THREADS``), which :func:`tick` feeds from then on. Nothing is exported to the
    environment: every process of a run applies its own budget, and a caller's environment is
    left as it was."""
    import torch

    torch.set_num_threads(b.intra_op)
    # (It raises once parallel work started in this process: the inter-op pool stays as it is.)
    with contextlib.suppress(RuntimeError):
        torch.set_num_interop_threads(b.inter_op)
    log.debug("%s: %s", b.role, b.describe())
    global _tuner
    fixed = b.source == "OMP_NUM_THREADS"
    _tuner = ThreadTuner(b.role, 1 if fixed else b.intra_op, torch.set_num_threads)
    return _tuner


_tuner: ThreadTuner | None = None
"""This process's tuner (:func:`apply`); None before."""


def tick(seconds: float, unit: str = "") -> None:
    """A ``unit`` of this process's work took ``seconds``: its loop's one call to the tuner (a
    ``"round"`` of ``reval train``, a ``"pretraining step"``, an ``"update"``, a worker's
    ``"batch"``). Nothing before :func:`apply`."""
    if _tuner is not None:
        _tuner.tick(seconds, unit)


def candidates(cap: int) -> list[int]:
    """The thread counts a tuner tries: the budget, halved down to 1 (``[8, 4, 2, 1]``)."""
    out = [max(1, cap)]
    while out[-1] > 1:
        out.append(out[-1] // 2)
    return out


class ThreadTuner:
    """Keeps torch's intra-op threads, within the budget, at the count that does the work
    fastest, measured on the work itself: each unit (a round of ``reval train``, an update, a
    worker's batch) reports its seconds through :meth:`tick` (the process's loops call the
    module's :func:`tick`).

    The budget's threads are right on an idle machine, but beside a busy neighbour OpenMP's
    threads spin at every barrier while one of them waits for a core: a demo round took 8x
    to 30x longer at two threads than at one (issue 39). So the tuner probes: one unit at each
    candidate (:func:`candidates`) in turn, dropping a candidate as soon as its units' median is
    ``slower`` times the best's (a count that spins costs one unit, not ``probe``), until each
    one left has ``probe`` units; it keeps the fastest (median) and probes again after
    ``every`` units (doubled, up to ``every_max``, each time the same count wins again), or at
    once when the held count is not the smallest and its units grow ``slower`` times its
    measured median (a neighbour came: fewer threads may now be faster; at the smallest count,
    slower units are the machine's load, which more threads would not help). A tuner of one
    candidate (a budget of 1, or ``OMP_NUM_THREADS`` set: the operator's count, run as is)
    does nothing. Different counts can change float results in their last bits (reductions
    split otherwise): ``OMP_NUM_THREADS`` fixes them."""

    def __init__(self, role: str, cap: int, set_threads: Callable[[int], None],
                 probe: int = 3, every: int = 100, every_max: int = 1600,
                 slower: float = 2.0) -> None:  # fmt: skip
        self.role = role
        self.candidates = candidates(cap)
        self._set = set_threads
        self.probe, self.every, self.every_max, self.slower = probe, every, every_max, slower
        self.threads = self.candidates[0]
        """The intra-op threads in force."""
        self._trial: dict[int, list[float]] | None = None
        """Probing: each candidate still in the race -> its units' seconds; None while a count
        is held."""
        self._held: list[float] = []
        """The held count's latest units' seconds (the last ``probe``)."""
        self._best_s = 0.0
        self._hold_left = 0
        self._interval = every
        self._last_pick: int | None = None
        self._unit: str | None = None
        """The kind of unit ticked last: another kind (pretraining steps, then rounds) starts
        the tuner afresh, since their seconds do not compare."""
        self._skip = 0
        """Units still to leave out: the first of a kind (warm-up: the first update's optimizer
        state, the first generation's set-up) would drop a count on its own."""
        if not self.fixed:
            self._start_probe()

    @property
    def fixed(self) -> bool:
        return len(self.candidates) == 1

    def _use(self, n: int) -> None:
        if n != self.threads:
            self._set(n)
            self.threads = n

    def _start_probe(self) -> None:
        self._trial = {n: [] for n in self.candidates}
        self._held = []
        self._use(self.candidates[0])

    def tick(self, seconds: float, unit: str = "") -> None:
        """One ``unit`` of work took ``seconds`` (wall-clock) at the threads in force."""
        if self.fixed:
            return
        if unit != self._unit:  # (the first unit, or another kind: afresh)
            self._unit, self._skip = unit, 1
            self._interval, self._last_pick = self.every, None
            self._start_probe()
        if self._skip:
            self._skip -= 1
            return
        seconds = max(seconds, 1e-6)  # (a clock's zero: no division by it)
        if self._trial is not None:
            self._probe_tick(seconds)
            return
        self._held = [*self._held, seconds][-self.probe :]
        self._hold_left -= 1
        if self._hold_left <= 0:
            self._start_probe()
        elif (self.threads > self.candidates[-1] and len(self._held) >= self.probe
              and _median(self._held) > self.slower * self._best_s):  # fmt: skip
            log.debug("%s: units %.1fx slower at %d threads: probing again",
                      self.role, _median(self._held) / self._best_s, self.threads)  # fmt: skip
            self._interval = self.every
            self._start_probe()

    def _probe_tick(self, seconds: float) -> None:
        trial = self._trial
        assert trial is not None
        trial[self.threads].append(seconds)
        best = min(_median(t) for t in trial.values() if t)
        for n in [n for n, t in trial.items() if t and _median(t) > self.slower * best]:
            del trial[n]  # (it spins, or is plainly slower: no more units at it)
        short = [n for n in trial if len(trial[n]) < self.probe]
        if short:  # the next unit: the candidate with the fewest so far (the larger first)
            self._use(min(short, key=lambda n: (len(trial[n]), -n)))
            return
        pick = min(trial, key=lambda n: (_median(trial[n]), n))
        self._best_s = _median(trial[pick])
        if pick == self._last_pick:
            self._interval = min(2 * self._interval, self.every_max)
        else:
            self._interval = self.every
            log.debug("%s: %d intra-op threads (%s)", self.role, pick, ", ".join(
                f"{n}: {_median(t):.3g} s" for n, t in sorted(trial.items())))  # fmt: skip
        self._last_pick = pick
        self._trial, self._held = None, []
        self._hold_left = self._interval
        self._use(pick)


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    return s[len(s) // 2] if len(s) % 2 else (s[len(s) // 2 - 1] + s[len(s) // 2]) / 2
