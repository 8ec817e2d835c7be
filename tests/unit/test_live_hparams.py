"""``LiveHParams`` (``reval/control.py``): the one typed model of the live hyperparameters. Its
bounds, the numbers-only rule, who applies each field, ``set_fields``/``merged``/
``learner_changes``, and the REST API and the control hash refusing exactly the same values."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import redis
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from reval.config import ApiConfig
from reval.control import LiveHParams, RunControl
from services.api import create_app

FIELDS = ("beta", "lr", "samples_per_insert", "ref_reset_steps", "max_staleness", "temperature")

# field -> (values taken, values refused): each bound from both sides
BOUNDS = {
    "beta": ([1e-12, 0.002, 1, 1e6], [0, -0.1, 1e6 * (1 + 1e-12)]),
    "lr": ([1e-12, 1e-6, 10], [0, -1e-6, 10.000001]),
    "samples_per_insert": ([1e-6, 2, 1e6], [0, -2, 1e6 + 1]),
    "ref_reset_steps": ([0, 200, 1_000_000_000, 20.0], [-1, 1_000_000_001, 2.5]),
    "max_staleness": ([-1, 0, 8, 1_000_000_000], [-2, 1_000_000_001, 0.5]),
    "temperature": ([1e-6, 1.0, 100], [0, -1, 100.5]),
}
NOT_NUMBERS = ["0.1", "", True, False, [1], {"v": 1}, math.nan, math.inf, -math.inf]


def test_the_fields_and_who_applies_them():
    assert tuple(LiveHParams.model_fields) == FIELDS == tuple(BOUNDS)
    assert {n: LiveHParams.applied_by(n) for n in FIELDS} == {
        **dict.fromkeys(FIELDS, "learner"), "temperature": "rollout"
    }  # fmt: skip
    for name, info in LiveHParams.model_fields.items():
        assert info.default is None, name  # every field optional
        assert info.description and len(info.description) > 20, name  # its docstring
    with pytest.raises(KeyError):
        LiveHParams.applied_by("gamma")


@pytest.mark.parametrize("name", FIELDS)
def test_bounds(name):
    ok, bad = BOUNDS[name]
    for value in ok:
        got = getattr(LiveHParams.checked({name: value}), name)
        assert got == value and type(got) is LiveHParams.model_fields[name].annotation.__args__[0]
    for value in [*bad, *NOT_NUMBERS]:
        with pytest.raises(ValueError, match=f"^{name}: "):
            LiveHParams.checked({name: value})
        with pytest.raises(ValidationError):
            LiveHParams(**{name: value})


def test_unknown_names_and_messages():
    with pytest.raises(ValueError, match="gamma: not a live hyperparameter"):
        LiveHParams.checked({"gamma": 1.0})
    with pytest.raises(ValidationError, match="Extra inputs"):
        LiveHParams(gamma=1.0)  # type: ignore[call-arg]
    with pytest.raises(ValueError, match=r"beta: must be a number, got '0\.1'"):
        LiveHParams.checked({"beta": "0.1"})
    with pytest.raises(ValueError, match=r"^lr: .*; temperature: "):  # every bad field named
        LiveHParams.checked({"lr": 0, "beta": 1, "temperature": -1})
    assert LiveHParams.checked({}) == LiveHParams() == LiveHParams.checked({"beta": None})


def test_immutable():
    hp = LiveHParams(beta=0.1)
    with pytest.raises(ValidationError):
        hp.beta = 0.2  # type: ignore[misc]


def test_set_fields_merged_and_learner_changes():
    empty = LiveHParams()
    assert empty.set_fields() == {}
    a = LiveHParams(beta=0.05, lr=1e-6, max_staleness=-1, temperature=0.7)
    assert a.set_fields() == {"beta": 0.05, "lr": 1e-6, "max_staleness": -1, "temperature": 0.7}
    b = LiveHParams(lr=1e-5, ref_reset_steps=0)
    assert a.merged(b) == LiveHParams(beta=0.05, lr=1e-5, ref_reset_steps=0, max_staleness=-1,
                                      temperature=0.7)  # fmt: skip
    assert a.merged(empty) == a and empty.merged(a) == a
    assert b.merged(a).lr == 1e-6  # (the other's set fields win)
    assert a == LiveHParams(beta=0.05, lr=1e-6, max_staleness=-1, temperature=0.7)  # unchanged
    # Learner changes: set here, learner-applied, different from what is in force.
    assert a.learner_changes(empty) == LiveHParams(beta=0.05, lr=1e-6, max_staleness=-1)
    applied = LiveHParams(beta=0.05, lr=1e-5, ref_reset_steps=200, temperature=1.0)
    assert a.learner_changes(applied) == LiveHParams(lr=1e-6, max_staleness=-1)
    assert a.learner_changes(a.merged(applied).merged(a)) == empty
    assert LiveHParams(temperature=0.5).learner_changes(empty) == empty  # the workers' field
    # ref_reset_steps 0 ("never") is a value, not "unset".
    assert LiveHParams(ref_reset_steps=0).learner_changes(empty) == LiveHParams(ref_reset_steps=0)


def test_the_control_module_imports_no_torch():
    code = "import sys, reval.control; assert 'torch' not in sys.modules, 'torch'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# -- the API and the control hash refuse the same values ------------------------------------------

TOKEN = "t0ken-for-the-tests-only-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}

values = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.floats(min_value=-3, max_value=3),
    st.integers(min_value=-3, max_value=3),
    st.integers(min_value=-(2**40), max_value=2**40),
    st.sampled_from([0, -1, 1e6, 1e6 + 1, 10, 10.5, 100, 100.5, 1e9, 1e9 + 1, 2.5, 20.0]),
    st.booleans(),
    st.sampled_from(["0.1", "1", "", "beta"]),
    st.none(),
)
bodies = st.dictionaries(st.sampled_from([*FIELDS, "gamma", "Beta"]), values, max_size=3)


@pytest.fixture
def live_run(tmp_path, redis_url, redis_prefix, monkeypatch):
    cfg = ApiConfig(redis_url=redis_url, key_prefix=redis_prefix, output_dir=str(tmp_path))
    monkeypatch.setenv(cfg.token_env, TOKEN)
    client = TestClient(create_app(cfg))
    r = client.post("/v1/runs", json={"config": {"name": "r1"}, "start": False}, headers=AUTH)
    assert r.status_code == 201, r.text
    api_side = RunControl(redis.Redis.from_url(redis_url), redis_prefix, "r1")
    api_side.publish_status({"phase": "running", "step": 1})  # as a learner would
    return client, api_side, RunControl(redis.Redis.from_url(redis_url), redis_prefix, "direct")


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # fmt: skip
@given(body=bodies)
def test_the_api_and_the_control_hash_refuse_the_same_values(live_run, body):
    client, api_side, direct = live_run
    # (Python's JSON, as the API parses it: NaN and Infinity included)
    r = client.patch("/v1/runs/r1/hparams", content=json.dumps(body), headers=AUTH)
    try:
        typed = direct.patch(body)
    except ValueError as err:
        assert r.status_code == 422, (body, r.text)
        # Both name the same fields.
        named = {str(e["loc"][1]) for e in r.json()["detail"]}
        assert named == {p.split(":")[0] for p in str(err).split("; ")}, (body, r.text, err)
        return
    if not typed.set_fields():  # nothing given: the API wants at least one
        assert r.status_code == 422 and "no hyperparameter given" in r.text
        return
    assert r.status_code == 202, (body, r.text)
    assert r.json()["detail"] == typed.set_fields()
    for side in (api_side, direct):  # what each hash holds now includes this request
        held = side.read().hparams
        assert held.merged(typed) == held and isinstance(held, LiveHParams)


def test_live_k_and_staleness_reach_the_rings_sampling() -> None:
    """``UpdateStep.apply`` changes the consumer's ``Sampling`` (the one object both backends
    sample by): the limiter lets more through at once, and -1 turns staleness off."""
    from types import SimpleNamespace

    from buffer.base import SampleTimeout, Sampling
    from buffer.ring import MemoryRing
    from learner.step import UpdateStep
    from reval.config import load_config
    from tests.conftest import make_traj

    cfg = load_config(overrides=["buffer.samples_per_insert=1", "buffer.max_staleness=2"],
                      environ={})  # fmt: skip
    ring = MemoryRing(64, sampling=Sampling.of(cfg.buffer))
    ring.insert([make_traj(i) for i in range(8)])
    ring.sample(8)
    with pytest.raises(SampleTimeout, match="rate limited"):  # K = 1: 8 sampled of 8 inserted
        ring.sample(8)
    optimizer = SimpleNamespace(param_groups=[{"lr": 1.0}])
    learner = SimpleNamespace(algo=SimpleNamespace(beta=0.1), optimizer=optimizer)
    step = UpdateStep(learner, cfg, ring)  # type: ignore[arg-type]
    step.apply(LiveHParams(samples_per_insert=2.0, max_staleness=-1))
    assert ring.sampling.samples_per_insert == 2.0 and ring.sampling.max_staleness is None
    assert len(ring.sample(8).trajectories) == 8  # K = 2 now
