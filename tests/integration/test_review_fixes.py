"""Fixes from the review of issue 38's work, against the shared Redis under the test's own key
prefix: a second ``reval learner`` that the run's lease will refuse writes no ``starting`` over
the live learner's phase, and the starting beat begins once the lease is free."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import redis

from reval.config import build_config
from reval.control import RunControl, RunLease
from services import cli
from services.cli_args import build_parser


def _cfg(tmp_path: Path, redis_url: str, redis_prefix: str):
    return build_config({"name": "lease-g", "output_dir": str(tmp_path),
                         "redis": {"url": redis_url, "prefix": redis_prefix}})  # fmt: skip


def test_a_learner_refused_by_the_lease_writes_no_starting_over_the_live_one(
    tmp_path: Path,
    redis_url: str,
    redis_prefix: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``reval learner`` on a run whose learner lives (it holds the lease) began its starting
    beat before the lease check and wrote ``starting`` over the live learner's ``running``
    until the lease refused it. Now the beat waits for the lease to be free."""
    from learner.ranks import StartingStatus

    cfg = _cfg(tmp_path, redis_url, redis_prefix)
    r = redis.Redis.from_url(redis_url)
    control = RunControl(r, redis_prefix, cfg.name)
    live = RunLease(r, redis_prefix, cfg.name, 30)
    live.acquire()  # (this process: alive, on this host)
    control.publish_status({"phase": "running", "step": 7})
    began: list[object] = []
    monkeypatch.setattr(StartingStatus, "begin", classmethod(lambda c, cfg: began.append(cfg)))

    def set_up(cfg, resume):  # (the pretraining, cut short: its output dir is refused)
        time.sleep(0.3)
        raise FileNotFoundError("no model here")

    monkeypatch.setattr("services.setup.prepare_learner", set_up)
    args = build_parser().parse_args(["learner", "--set", f"name={cfg.name}",
                                     "--set", f"output_dir={tmp_path}",
                                     "--set", f"redis.url={redis_url}",
                                     "--set", f"redis.prefix={redis_prefix}",
                                     "--set", "buffer.backend=redis"])  # fmt: skip
    assert cli._learner(cli.load_config(None, args.overrides), args) == 2, capsys.readouterr()
    assert "no model here" in capsys.readouterr().err  # (it got past the lease's check)
    time.sleep(0.2)
    assert began == []  # the live learner holds the lease
    assert control.read_status().phase == "running"
    live.release()


def test_the_starting_beat_begins_once_the_lease_is_free(
    tmp_path: Path, redis_url: str, redis_prefix: str
) -> None:
    """A holder that may be alive delays the beat; once it is gone, the beat begins (a learner
    restarted while its dead predecessor's lease runs out reads ``starting``); a holder that
    started after the call is this start's own learner: no beat."""
    cfg = _cfg(tmp_path, redis_url, redis_prefix)
    r = redis.Redis.from_url(redis_url)
    held = RunLease(r, redis_prefix, cfg.name, 30)
    held.acquire()
    began: list[object] = []
    thread = cli.begin_starting(cfg, began.append, poll_s=0.05)
    time.sleep(0.3)
    assert began == []
    held.release()
    thread.join(timeout=5)
    assert began == [cfg]

    before = json.dumps({"host": "elsewhere", "pid": 1, "started": time.time() - 60})
    r.set(held.key, before, px=30_000)  # a learner of another host, not ours
    began.clear()
    thread = cli.begin_starting(cfg, began.append, poll_s=0.05)
    time.sleep(0.2)
    ours = json.dumps({"host": "elsewhere", "pid": 1, "started": time.time() + 1})
    r.set(held.key, ours, px=30_000)  # this start's learner took it
    thread.join(timeout=5)
    assert not thread.is_alive() and began == []
