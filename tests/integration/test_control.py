"""The run's control keys in Redis (``reval/control.py``): requests, validation, the events
stream, and a foreign writer's garbage never reaching a learner."""

from __future__ import annotations

import json

import pytest
import redis

from reval.control import LiveHParams, RunControl


@pytest.fixture
def control(redis_url, redis_prefix):
    return RunControl(redis.Redis.from_url(redis_url), redis_prefix, "run")


def test_requests_are_read_back_and_logged(control):
    st = control.read()
    assert st.phase == "running" and st.workers is None and st.hparams == LiveHParams()
    control.set_phase("paused")
    control.set_workers(3)
    assert control.request("checkpoint") == 1 and control.request("checkpoint") == 2
    assert control.request("export") == 1
    typed = control.patch({"beta": 0.05, "ref_reset_steps": 20.0, "max_staleness": -1})
    assert typed == LiveHParams(beta=0.05, ref_reset_steps=20, max_staleness=-1)
    assert isinstance(typed.ref_reset_steps, int)
    st = control.read()
    assert st.phase == "paused" and st.workers == 3
    assert st.checkpoint == 2 and st.export == 1
    assert isinstance(st.hparams, LiveHParams) and st.hparams == typed
    assert isinstance(st.hparams.ref_reset_steps, int)
    assert control.client.hget(control.control, "hp:ref_reset_steps") == b"20"
    # A later request overrides one field and keeps the others.
    control.patch(LiveHParams(beta=0.1))
    assert control.read().hparams == typed.merged(LiveHParams(beta=0.1))
    control.record("hparams_applied", {"beta": 0.05}, step=17)
    events = control.events()
    kinds = [e["kind"] for e in events]
    assert kinds == [
        "request:paused",
        "request:scale",
        "request:checkpoint",
        "request:checkpoint",
        "request:export",
        "request:hparams",
        "request:hparams",
        "hparams_applied",
    ]
    assert events[-1]["step"] == 17 and events[-1]["detail"] == {"beta": 0.05}
    # Paging: only what came after an id.
    assert [e["kind"] for e in control.events(after=events[-2]["id"])] == ["hparams_applied"]
    control.clear()
    assert control.read().phase == "running" and control.events() == []


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"gamma": 1.0}, "not a live hyperparameter"),
        ({"beta": "0.1"}, "must be a number"),
        ({"beta": True}, "must be a number"),
        ({"beta": 0.0}, "beta: .*greater than 0"),
        ({"lr": 50.0}, "lr: .*less than or equal to 10"),
        ({"ref_reset_steps": 2.5}, "integer"),
        ({"temperature": float("nan")}, "finite"),
        ({"max_staleness": -2}, "max_staleness: .*greater than or equal to -1"),
        ({"beta": 0.1, "lr": -1.0}, "lr: "),
    ],
)
def test_bad_hyperparameters_are_refused(control, values, message):
    with pytest.raises(ValueError, match=message):
        control.patch(values)
    assert control.read().hparams == LiveHParams() and control.events() == []  # nothing written


def test_garbage_in_the_control_hash_is_ignored(control):
    control.client.hset(
        control.control,
        mapping={
            "phase": "exploding",
            "workers": "-4",
            "hp:beta": "not json",
            "hp:lr": json.dumps(99.0),
            "hp:temperature": json.dumps(0.7),
            "hp:max_staleness": json.dumps(True),
            "hp:samples_per_insert": json.dumps("2"),
            "hp:unknown": json.dumps(1),
        },
    )
    st = control.read()
    assert st.phase == "running" and st.workers is None
    assert st.hparams == LiveHParams(temperature=0.7)


def test_phase_and_workers_are_checked(control):
    with pytest.raises(ValueError, match="phase"):
        control.set_phase("sleeping")
    with pytest.raises(ValueError, match="workers"):
        control.set_workers(-1)
    with pytest.raises(ValueError, match="cannot request"):
        control.request("reboot")
    assert control.patch({}) == LiveHParams() and control.events() == []  # nothing to write
