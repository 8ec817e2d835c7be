"""Every file of a run's directory is named once, in ``reval/run_dir.py`` (issue 38's review):
the learner's ``.learner-<pid>.stopped`` too."""

from __future__ import annotations

from pathlib import Path

from reval.run_dir import RunDir


def test_the_learner_stopped_file_is_named_by_the_run_dir(tmp_path: Path) -> None:
    from learner.ranks import _said_for

    run = RunDir(tmp_path / "r")
    assert run.learner_stopped(4242) == tmp_path / "r" / ".learner-4242.stopped"
    assert _said_for(4242, str(run.learner_state)) == run.learner_stopped(4242)
