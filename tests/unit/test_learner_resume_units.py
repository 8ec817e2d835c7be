"""``reval learner``'s exit status from its ranks' (issue 38): ranks that all stopped on SIGTERM
or Ctrl-C (with their checkpoint, or killed by it before they could catch it) make 143 or 130;
anything else is not a stop."""

from __future__ import annotations

import signal

from learner.ranks import stop_status

TERM, INT = 128 + signal.SIGTERM, 128 + signal.SIGINT


def test_ranks_stopped_by_a_signal_give_its_status():
    assert stop_status([TERM, TERM]) == 143
    assert stop_status([INT]) == 130
    assert stop_status([-signal.SIGTERM, TERM]) == 143  # (one died of it while starting)
    assert stop_status([INT, TERM]) == 143


def test_anything_else_is_not_a_stop():
    assert stop_status([0, 0]) is None  # done, or stopped by a request: the caller's 0
    assert stop_status([TERM, 1]) is None  # a rank failed
    assert stop_status([TERM, 0]) is None
    assert stop_status([None]) is None
    assert stop_status([-signal.SIGKILL]) is None
    assert stop_status([]) is None


def test_prune_keeps_the_newest_written_and_the_one_just_written(tmp_path):
    """learner.keep_checkpoints: the newest by the time written, not by step (a run started
    over beside an earlier run's later steps keeps its own); partial ones are not counted."""
    import os

    from learner.checkpoint import PARTIAL, prune

    def made(name: str, t: float):
        (tmp_path / name).mkdir()
        os.utime(tmp_path / name, (t, t))
        return tmp_path / name

    old = [made(f"step-{s:08d}", 100 + i) for i, s in enumerate((500, 600, 700))]
    partial = made(f"step-00000800{PARTIAL}", 200)
    mine = [made(f"step-{s:08d}", 300 + i) for i, s in enumerate((5, 10))]
    assert prune(tmp_path, 0, mine[-1]) == []  # 0: keep every one
    assert prune(tmp_path, 3, mine[-1]) == old[:2]  # the newest 3 written: 700, 5, 10
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "step-00000005", "step-00000010", old[2].name, partial.name,
    ]  # fmt: skip
    assert prune(tmp_path, 1, mine[0]) == [old[2], mine[1]]  # (the one just written stays)
