"""``reval launch`` on a cluster (``RAY_ADDRESS``, issue 43): the weights reach workers on other
nodes without a shared directory unless the config says otherwise (``cluster_sync``)."""

from __future__ import annotations

from reval.config import load_config
from services.launch_cluster import cluster_sync


def test_a_cluster_announces_the_nodes_address_and_serves_the_files():
    cfg = cluster_sync(load_config(overrides=["name=c"], environ={}))
    assert cfg.sync.broadcast_host == "auto" and cfg.sync.serve_files


def test_what_the_config_says_stays():
    given = load_config(overrides=["name=c", "sync.broadcast_host=10.0.0.5",
                                   "sync.serve_files=false"], environ={})  # fmt: skip
    cfg = cluster_sync(given)
    assert cfg.sync.broadcast_host == "10.0.0.5" and not cfg.sync.serve_files
    assert cfg is given
    env = load_config(overrides=["name=c"], environ={"REVAL__SYNC__SERVE_FILES": "false"})
    assert not cluster_sync(env).sync.serve_files  # (from the environment: said too)


def test_a_failed_ranks_line_says_what_it_raised():
    """The driver's line for a rank that failed names the error, not only the actor (a
    ``RayTaskError``'s first line is ``ray::LearnerRank.run() (pid=..., ip=...)``)."""
    from services.launch_cluster import failure_line

    class TaskError(Exception):
        def __init__(self, cause):
            super().__init__(f"ray::LearnerRank.run() (pid=1, ip=10.0.0.2)\n  File ...\n{cause}")
            self.cause = cause

    err = TaskError(FileNotFoundError("/runs/x/initial: no such directory"))
    assert failure_line(err) == "FileNotFoundError: /runs/x/initial: no such directory"
    assert failure_line(RuntimeError("ray::X.run()\n\nValueError: bad")) == "ValueError: bad"


def test_the_learners_host_decides_whether_to_resume(tmp_path):
    """``LearnerRank.prepare`` on rank 0's host: a restart resumes where that host has a
    checkpoint, starts fresh where the run never got past step 0, and refuses with one line
    where the run was further (its checkpoints are on a host that is gone); ``--resume``
    without one there is refused."""
    import pytest

    from reval.config import load_config
    from services.launch_actors import LearnerRank

    cfg = load_config(overrides=[f"output_dir={tmp_path}", "name=h", "model.pretrain_steps=0"],
                      environ={})  # fmt: skip
    rank0 = LearnerRank(0, 1)
    assert rank0.prepare(cfg.model_dump_json(), None, at_step=0)[1] is False
    with pytest.raises(FileNotFoundError, match=r"has no checkpoint of run 'h', which had one at "
                       r"step 50: .* then reval launch --resume"):  # fmt: skip
        rank0.prepare(cfg.model_dump_json(), None, at_step=50)
    with pytest.raises(FileNotFoundError, match="--resume: no checkpoint under"):
        rank0.prepare(cfg.model_dump_json(), True)
    (cfg.paths.checkpoints / "step-00000050").mkdir(parents=True)
    (cfg.paths.checkpoints / "latest").write_text("step-00000050")
    assert rank0.prepare(cfg.model_dump_json(), None, at_step=50)[1] is True
