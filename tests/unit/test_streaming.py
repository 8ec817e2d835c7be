"""The streaming scheduler (``rollout/streaming.py``) against a fake engine: one token per running
answer per step, lengths fixed per prompt (a long tail), the weight version of each step
recorded per token. No vLLM: the vLLM lane runs the same scheduler on the real engine
(``tests/integration/test_vllm_streaming.py``)."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import ClassVar

import numpy as np
import pytest

from reval.config import RunConfig
from rollout.engines import Finished, Sample, SamplingParams
from rollout.streaming import Group, Streamer, group_records
from rollout.tasks import Prompt

N = 2
EOS = 1


class FakeTokenizer:
    def __call__(self, text: str, add_special_tokens: bool = False) -> object:
        return type("Enc", (), {"input_ids": [ord(c) % 50 + 2 for c in text]})()

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(len(ids))


class FakeEngine:
    """Each answer of prompt ``p<L>`` is ``L`` tokens long; a step adds one token to every
    running answer under the current version. Stepping while paused fails."""

    def __init__(self) -> None:
        self.policy_version = 0
        self.inflight = "finish"
        self.receiver = None
        self.paused = False
        self.requests: dict[str, list[list[tuple[int, int]]]] = {}
        self.lengths: dict[str, int] = {}
        self.most_running = 0
        self.running_per_step: list[int] = []
        self.events: list[str] = []
        self.lock = threading.Lock()

    def submit(self, key: str, prompt: Sequence[int], params: SamplingParams, seed: int) -> None:
        assert key not in self.requests and key not in self.lengths
        self.requests[key] = [[] for _ in range(params.n)]
        self.lengths[key] = self._length[key_of(prompt)]
        self.events.append(f"submit {key}")

    _length: ClassVar[dict[tuple[int, ...], int]] = {}

    def step(self) -> list[Finished]:
        assert not self.paused, "a step while paused"
        self.running_per_step.append(len(self.requests))
        self.most_running = max(self.most_running, len(self.requests))
        done = []
        for key, answers in list(self.requests.items()):
            for a in answers:
                if len(a) < self.lengths[key]:
                    a.append((EOS if len(a) == self.lengths[key] - 1 else 7, self.policy_version))
            if all(len(a) == self.lengths[key] for a in answers):
                del self.requests[key]
                done.append(Finished(key, [_sample(a) for a in answers],
                                     [_spans(a) for a in answers]))  # fmt: skip
        return done

    def running(self) -> int:
        return sum(
            len(a) < self.lengths[k] for k, answers in self.requests.items() for a in answers
        )

    def pause(self) -> None:
        assert not self.paused
        self.paused = True
        self.events.append("pause")

    def resume(self) -> None:
        assert self.paused
        self.paused = False
        self.events.append("resume")


def key_of(prompt: Sequence[int]) -> tuple[int, ...]:
    return tuple(prompt)


def _sample(answer: list[tuple[int, int]]) -> Sample:
    ids = np.array([t for t, _ in answer], dtype=np.int32)
    return Sample(ids, np.full(ids.size, -0.5, np.float32), "stop")


def _spans(answer: list[tuple[int, int]]) -> np.ndarray:
    out: list[int] = []
    for j, (_, v) in enumerate(answer):
        if not out or out[-1] != v:
            out += [j, v]
    return np.array(out, dtype=np.int32)


class Weights:
    """A learner that announces versions; ``load`` loads the newest announced one."""

    def __init__(self, engine: FakeEngine) -> None:
        self.engine = engine
        self.announced = 0
        self.loads: list[tuple[int, int]] = []
        """(version, answers running at load)."""

    def peek(self) -> int:
        return self.announced

    def behind(self) -> bool:
        return self.announced != self.engine.policy_version

    def load(self) -> int | None:
        if self.announced == self.engine.policy_version:
            return None
        self.engine.policy_version = self.announced
        self.loads.append((self.announced, self.engine.running()))
        self.engine.events.append(f"load {self.announced}")
        return self.announced


def prompts(lengths: Sequence[int]) -> list[Prompt]:
    out = [Prompt(id=f"p{i}", text=f"q{i:03d}", answer="") for i in range(len(lengths))]
    for p, n in zip(out, lengths, strict=True):
        FakeEngine._length[key_of(FakeTokenizer()(p.text).input_ids)] = n
    return out


def streamer(engine: FakeEngine, groups: list[Group], weights: Weights | None = None,
             inflight: str = "keep", max_inflight: int = 4 * N) -> Streamer:  # fmt: skip
    return Streamer(engine, FakeTokenizer(), lambda _p: SamplingParams(n=N), groups.append,  # type: ignore[arg-type]
                    n=N, max_inflight=max_inflight, inflight=inflight, weights=weights,
                    weights_check_s=0.0, control_s=0.0)  # type: ignore[arg-type]  # fmt: skip


def dealer(items: list[Prompt]) -> tuple[list[Prompt], object]:
    dealt: list[Prompt] = []

    def deal(k: int) -> list[Prompt]:
        got = items[len(dealt) : len(dealt) + k]
        dealt.extend(got)
        return got

    return dealt, deal


LONG_TAIL = [3, 40, 3, 4, 3, 5, 30, 3, 4, 3, 6, 3, 3, 25, 4, 3]


def test_the_engine_stays_full_and_every_group_is_graded_once():
    engine, groups = FakeEngine(), []
    items = prompts(LONG_TAIL)
    dealt, deal = dealer(items)
    stats = streamer(engine, groups).run(deal, max_groups=len(items))
    assert sorted(g.prompt.id for g in groups) == sorted(p.id for p in items)  # none lost/twice
    assert [p.id for p in dealt] == [p.id for p in items]
    assert engine.most_running == 4  # max_inflight / n
    # Admitted as others finish: full until the deal runs dry (the lockstep worker's batch of 4
    # would run its longest answer, 40 steps, with 1 prompt in the engine).
    steps = engine.running_per_step
    last_admit = max(i for i, e in enumerate(engine.events) if e.startswith("submit"))
    assert last_admit > 0
    full_until = next(i for i, r in enumerate(steps) if r < 4)
    assert full_until >= sum(sorted(LONG_TAIL)[:8]) // 4  # full while prompts were left
    assert stats.tokens == N * sum(LONG_TAIL)
    assert stats.graded == stats.finished == len(items)
    assert max(steps) == 4 and len(steps) < sum(LONG_TAIL) / 2  # far fewer steps than serial
    for g in groups:
        assert all(s.token_ids.size == FakeEngine._length[tuple(g.prompt_ids)] for s in g.samples)


@pytest.mark.parametrize("inflight", ["keep", "recompute"])
def test_a_new_version_loads_between_two_steps_and_answers_say_which_tokens_it_sampled(inflight):
    engine, groups = FakeEngine(), []
    weights = Weights(engine)
    items = prompts([30] * 4 + [5] * 4)
    _, deal = dealer(items)
    s = streamer(engine, groups, weights, inflight=inflight)
    original = engine.step

    def step() -> list[Finished]:
        if len(engine.running_per_step) == 10:
            weights.announced = 1  # the learner publishes v1 after 10 steps
        return original()

    engine.step = step  # type: ignore[method-assign]
    stats = s.run(deal, max_groups=len(items))
    assert weights.loads == [(1, 4 * N)]  # loaded once, the 4 long groups running
    assert engine.events.count("pause") == 1 and engine.events.index(
        "pause"
    ) + 2 == engine.events.index("resume")  # fmt: skip  (pause, load, resume)
    assert engine.inflight == inflight
    spanned = [g for g in groups if g.prompt.text < "q004"]
    for g in spanned:  # 11 tokens under v0 (the 10 steps, and the one that saw it announced)
        for sp in g.spans:
            assert sp.tolist() == [0, 0, 11, 1]
    for g in groups:
        if g not in spanned:
            assert all(sp.tolist() == [0, 1] for sp in g.spans)
    assert len(stats.update_delays) == 1 and stats.loads == 1
    records = [
        r
        for g in spanned
        for r in group_records(g, Task(), FakeTokenizer(), "binary", stop_ids=[EOS])[0]
    ]
    for r in records:
        assert r.policy_version == 0  # the oldest version
        assert r.token_versions().tolist() == [0] * 11 + [1] * 19
        assert r.logprobs.size == r.response_ids.size == 30


def test_finish_mode_loads_only_with_the_engine_empty_and_no_answer_mixes_versions():
    engine, groups = FakeEngine(), []
    weights = Weights(engine)
    items = prompts([30, 5, 5, 5, 5, 5, 5, 5])
    _, deal = dealer(items)
    s = streamer(engine, groups, weights, inflight="finish")
    original = engine.step

    def step() -> list[Finished]:
        if len(engine.running_per_step) == 3:
            weights.announced = 1
            engine.events.append("announce")
        return original()

    engine.step = step  # type: ignore[method-assign]
    s.run(deal, max_groups=len(items))
    assert weights.loads == [(1, 0)]
    assert "pause" not in engine.events
    held = engine.events[engine.events.index("announce") : engine.events.index("load 1")]
    assert held and not [e for e in held if e.startswith("submit")]  # nothing admitted
    for g in groups:
        for sp in g.spans:
            assert sp.size == 2  # one version per answer
    assert len(groups) == len(items)


def test_stop_drains_the_answers_in_hand_and_admits_nothing_more():
    engine, groups = FakeEngine(), []
    items = prompts([20] * 8)
    dealt, deal = dealer(items)
    stop = threading.Event()
    original = engine.step

    def step() -> list[Finished]:
        if len(engine.running_per_step) == 3:
            stop.set()
        return original()

    engine.step = step  # type: ignore[method-assign]
    streamer(engine, groups).run(deal, should_stop=stop.is_set)
    assert len(dealt) == 4  # the first admission only
    assert sorted(g.prompt.id for g in groups) == sorted(p.id for p in dealt)  # all finished
    assert engine.running() == 0


def test_no_admission_while_paused_or_ahead():
    engine, groups = FakeEngine(), []
    items = prompts([3] * 6)
    _, deal = dealer(items)
    allowed = threading.Event()
    calls = [0]

    def may_admit() -> bool:
        calls[0] += 1
        if calls[0] > 3:
            allowed.set()
        return allowed.is_set()

    stats = streamer(engine, groups).run(deal, may_admit=may_admit, max_groups=6)
    assert calls[0] > 3 and len(groups) == 6 and stats.idle_s > 0


class Task:
    class verifier:
        @staticmethod
        def score(prompt: Prompt, response: str) -> float:
            return float(int(response) % 2)


def test_group_records_grade_and_transform_the_group():
    g = Group("w-3", Prompt("p", "q", ""), [5, 6], [
        Sample(np.array([7, 7, EOS], np.int32), np.full(3, -0.1, np.float32), "stop"),
        Sample(np.array([7, EOS], np.int32), np.full(2, -0.1, np.float32), "stop"),
    ], [np.array([0, 3], np.int32), np.array([0, 3, 1, 4], np.int32)], 0.0)  # fmt: skip
    records, raw = group_records(
        g, Task(), FakeTokenizer(), "group_mean", stop_ids=[EOS], worker_id="w"
    )
    assert raw == [0.0, 1.0]  # (graded up to the stop token: 2 and 1 tokens)
    assert [r.reward for r in records] == [-0.5, 0.5]  # centred within the group
    assert [r.policy_version for r in records] == [3, 3]
    assert records[0].version_spans.size == 0  # one version: absent
    assert records[1].token_versions().tolist() == [3, 4]
    assert {r.group_id for r in records} == {"w-3"}


def test_streaming_needs_the_vllm_engine_and_room_for_a_group():
    with pytest.raises(ValueError, match=r"rollout\.streaming=true needs rollout\.engine=vllm"):
        RunConfig.model_validate({"rollout": {"streaming": True}})
    with pytest.raises(ValueError, match=r"rollout\.max_inflight"):
        RunConfig.model_validate({"rollout": {"engine": "vllm", "n": 4, "max_inflight": 2}})
    assert RunConfig.model_validate({"rollout": {"engine": "vllm"}}).rollout.streams()
    assert not RunConfig.model_validate({}).rollout.streams()
