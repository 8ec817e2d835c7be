"""One worker loop for every engine (issue 40): the HF engine behind ``LockstepStream``, lockstep
admission (``rollout.streaming = false``) in the ``Streamer``, and multi-turn episodes played
under the ``Streamer`` as ``collect_round`` plays them, with the weight versions of each turn."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest

from rollout.calculator import CalculatorEnv
from rollout.collect import Truncation, collect_round
from rollout.engines import (
    HFEngine,
    LockstepStream,
    Sample,
    SamplingParams,
    StreamEngine,
    as_stream,
)
from rollout.environment import EpisodeLimits, EpisodeRunner, Step
from rollout.streaming import Group, Streamer, group_records
from tests.unit.test_environment import EOS, PAD, PROMPT, RUNNER, TOK, ScriptedLM, _Task
from tests.unit.test_streaming import FakeEngine, FakeTokenizer, N, dealer, prompts

CALC = ["<calc>3*4</calc>", "\\boxed{12}"]
"""The scripted model's two turns: a calculator call, then the answer (reward 1)."""


class CountingEngine:
    """A ``GenerationEngine`` that answers each prompt with its own length in tokens, counting
    its ``generate`` calls."""

    def __init__(self) -> None:
        self.policy_version = 2
        self.receiver = None
        self.stop_ids = (EOS,)
        self.device = "cpu"
        self.calls: list[int] = []

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
                 seed: int) -> list[list[Sample]]:  # fmt: skip
        self.calls.append(len(prompts))
        out = []
        for p in prompts:
            ids = np.full(len(p), 7, dtype=np.int32)
            out.append([Sample(ids, np.zeros(len(p), np.float32), "length")] * params.n)
        return out

    def close(self) -> None:
        pass

    def load_weights(self, named_tensors: object, version: int) -> None:
        self.policy_version = version


def test_a_lockstep_stream_generates_every_queued_request_in_one_call() -> None:
    inner = CountingEngine()
    engine = as_stream(inner)  # type: ignore[arg-type]
    assert isinstance(engine, LockstepStream) and isinstance(engine, StreamEngine)
    assert as_stream(engine) is engine  # (a stream engine is used as it is)
    params = SamplingParams(n=3)
    for i, length in enumerate([2, 5, 4]):
        engine.submit(f"k{i}", [1] * length, params, seed=i)
    assert engine.running() == 9
    done = engine.step()
    assert inner.calls == [3] and engine.running() == 0 and engine.step() == []
    assert [f.key for f in done] == ["k0", "k1", "k2"]
    assert [[s.token_ids.size for s in f.samples] for f in done] == [[2] * 3, [5] * 3, [4] * 3]
    assert all(sp.tolist() == [0, 2] for f in done for sp in f.spans)  # (the version held)
    engine.policy_version = 5
    assert inner.policy_version == 5 and engine.stop_ids == (EOS,)
    # requests that differ only in max_new_tokens: one call at the largest, each answer cut to
    # its own request's (finish "length" where that cut it)
    engine.submit("a", [1] * 6, SamplingParams(n=1, max_new_tokens=3), seed=0)
    engine.submit("b", [1] * 6, SamplingParams(n=1, max_new_tokens=8), seed=1)
    a, b = engine.step()
    assert inner.calls[-1] == 2 and len(inner.calls) == 2
    assert a.samples[0].token_ids.size == 3 and a.samples[0].finish_reason == "length"
    assert b.samples[0].token_ids.size == 6


def test_lockstep_admission_waits_for_the_engine_to_empty() -> None:
    """``lockstep``: a batch of ``max_inflight // n`` prompts, the next one only once every
    answer of the last is done and graded (the old lockstep loop), even on a streaming engine."""
    engine, groups = FakeEngine(), []
    items = prompts([3, 9, 2, 4, 6, 2])
    dealt, deal = dealer(items)
    s = Streamer(engine, FakeTokenizer(), lambda _p: SamplingParams(n=N), groups.append,  # type: ignore[arg-type]
                 n=N, max_inflight=2 * N, lockstep=True, control_s=0.0)  # fmt: skip
    s.run(deal, max_groups=6)  # type: ignore[arg-type]
    assert len(groups) == 6 and len(dealt) == 6
    # submissions come two at a time, each pair after the last pair's answers all finished
    submits = [i for i, e in enumerate(engine.events) if e.startswith("submit")]
    assert len(submits) == 6
    assert all(submits[2 * b + 1] == submits[2 * b] + 1 for b in range(3))
    assert engine.running_per_step.count(0) == 0
    # without lockstep the short prompts' slots are refilled while the long one runs
    engine2, groups2 = FakeEngine(), []
    _, deal2 = dealer(prompts([3, 9, 2, 4, 6, 2]))
    Streamer(engine2, FakeTokenizer(), lambda _p: SamplingParams(n=N), groups2.append,  # type: ignore[arg-type]
             n=N, max_inflight=2 * N, control_s=0.0).run(deal2, max_groups=6)  # type: ignore[arg-type]  # fmt: skip
    assert len(engine2.running_per_step) < len(engine.running_per_step)


def _play(engine: StreamEngine, n: int = 2, on_step=None, runner=RUNNER) -> list[Group]:
    groups: list[Group] = []
    params = SamplingParams(n=n, temperature=1.0, max_new_tokens=24)
    s = Streamer(engine, TOK, lambda _p: params, groups.append, n=n, max_inflight=n,
                 episodes=runner, on_step=on_step, control_s=0.0)  # fmt: skip
    s.run(lambda k: [PROMPT][:k], max_groups=1)
    return groups


@pytest.mark.parametrize("max_tokens", [96, 30, 12])
def test_episodes_under_the_streamer_are_the_episodes_of_collect_round(max_tokens) -> None:
    """The same episodes, rewards and masks, also where the episode's token limit cuts a turn
    (30: after the first turn, no room for the observation; 12: the first turn): a cut turn
    is kept up to the limit and never given to the environment, in both loops."""
    runner = EpisodeRunner(CalculatorEnv, EpisodeLimits(max_turns=4, max_tokens=max_tokens))
    (group,) = _play(as_stream(HFEngine(ScriptedLM(CALC), PAD, EOS)), runner=runner)
    assert group.episodes is not None and len(group.episodes) == 2
    records, raw = group_records(group, _Task(), TOK, "binary", stop_ids=(EOS,))  # type: ignore[arg-type]
    played = collect_round(HFEngine(ScriptedLM(CALC), PAD, EOS), TOK, _Task(), [PROMPT],
                           SamplingParams(n=2, temperature=1.0, max_new_tokens=24), seed=3,
                           reward_variant="binary", group_prefix="r", episodes=runner)  # fmt: skip
    assert raw == ([1.0, 1.0] if max_tokens == 96 else [0.0, 0.0])
    assert [r.reward_raw for r in records] == [t.reward_raw for t in played.trajectories]
    for got, want in zip(records, played.trajectories, strict=True):
        assert got.response_ids.tolist() == want.response_ids.tolist()
        assert got.action_mask.tolist() == want.action_mask.tolist()
        assert got.finish_reason == want.finish_reason
        assert got.response_ids.size <= max_tokens
        assert (0 in got.action_mask.tolist()) == (max_tokens == 96)  # (the calculator's tokens)
        assert got.group_id == group.key and got.version_spans.size == 0


class Generous:
    """Rewards any turn it is given, and ends the episode: a cut turn must never reach it."""

    def start(self, prompt: object) -> None:
        pass

    def step(self, text: str) -> Step:
        return Step("", 1.0, True)


def test_a_turn_the_episodes_limit_cuts_is_never_stepped() -> None:
    """The first turn (17 tokens) is longer than the episode's room (12): it is kept up to the
    limit, finishes ``length`` and earns nothing even where cut answers keep their reward
    (``algo.truncated_reward = "graded"``), as in ``collect_round``."""
    runner = EpisodeRunner(Generous, EpisodeLimits(max_turns=2, max_tokens=12))
    graded = Truncation("graded")
    (group,) = _play(as_stream(HFEngine(ScriptedLM(CALC), PAD, EOS)), runner=runner)
    records, raw = group_records(group, _Task(), TOK, "binary", stop_ids=(EOS,),  # type: ignore[arg-type]
                                 truncation=graded)  # fmt: skip
    assert raw == [0.0, 0.0]
    assert all(r.finish_reason == "length" and r.response_ids.size == 12 for r in records)
    played = collect_round(HFEngine(ScriptedLM(CALC), PAD, EOS), TOK, _Task(), [PROMPT],
                           SamplingParams(n=2, temperature=1.0, max_new_tokens=24), seed=3,
                           reward_variant="binary", group_prefix="r", episodes=runner,
                           truncation=graded)  # fmt: skip
    assert [t.reward_raw for t in played.trajectories] == raw


def test_on_step_sees_the_engine_empty_only_at_a_batchs_end() -> None:
    """``on_step`` runs once a step's finished turns are submitted again: the worker sums a
    lockstep batch's steps (one per turn) and ticks its thread tuner when the engine is empty."""
    engine = as_stream(HFEngine(ScriptedLM(CALC), PAD, EOS))
    running: list[int] = []
    _play(engine, on_step=lambda _s: running.append(engine.running()))
    assert running == [2, 0]  # (two turns: the second submitted before the first step's call)


def test_an_episode_says_which_weights_played_each_turn() -> None:
    """New weights between two turns: the episode's record starts at the old version and its
    spans name the new one from the second turn's first token."""
    engine = as_stream(HFEngine(ScriptedLM(CALC), PAD, EOS))
    versions = iter([7])
    (group,) = _play(engine, n=1, on_step=lambda _s: setattr(
        engine, "policy_version", next(versions, engine.policy_version)))  # fmt: skip
    (record,), _ = group_records(group, _Task(), TOK, "binary", stop_ids=(EOS,))  # type: ignore[arg-type]
    first_turn = len(TOK(CALC[0], add_special_tokens=False).input_ids) + 1
    mask = record.action_mask.tolist()
    second_turn = mask.index(1, mask.index(0))  # (after the calculator's observation)
    assert first_turn < second_turn
    assert record.policy_version == 0
    assert record.version_spans.tolist() == [0, 0, second_turn, 7]


@pytest.mark.parametrize("broken", ["start", "step"])
def test_a_misbehaving_environment_loses_its_episodes_only_under_the_streamer(broken) -> None:
    class Broken:
        def start(self, prompt: object) -> None:
            if broken == "start":
                raise RuntimeError("no")

        def step(self, text: str) -> object:
            raise RuntimeError("no")

    groups: list[Group] = []
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=24)
    s = Streamer(as_stream(HFEngine(ScriptedLM(CALC), PAD, EOS)), TOK, lambda _p: params,
                 groups.append, n=2, max_inflight=2, control_s=0.0,
                 episodes=EpisodeRunner(Broken, EpisodeLimits(4, 96)))  # type: ignore[arg-type]  # fmt: skip
    s.run(lambda k: [PROMPT][:k], max_groups=1)
    (group,) = groups
    assert group.skipped() == {f"{broken}_failed": 2}
    records, raw = group_records(group, _Task(), TOK, "binary", stop_ids=(EOS,))  # type: ignore[arg-type]
    assert records == [] and raw == []
