"""The rollout worker's one loop: the engine never waits for a batch's longest answer, and new
weights load between two decode steps.

``Streamer`` keeps up to ``rollout.max_inflight`` answers in a running engine: it admits a prompt
from the deal (its ``n`` answers, one request) whenever that many slots are free, hands each
prompt's group to a grading thread as soon as its last answer finishes (grading overlaps
generation; the group is inserted at once), and loads a new weight version as soon as it is
announced (``rollout.inflight_updates``):

- ``keep``: pause the engine between two steps, load, resume the running answers with their KV
  cache (computed under the older weights);
- ``recompute``: the same, but the running answers' KV cache is computed again under the new
  weights (their prompt and tokens so far are prefilled again);
- ``finish``: stop admitting, let the answers in the engine finish on the old weights, load,
  admit again.

``lockstep`` (``rollout.streaming = false``, and every engine that does not stream: the HF
engine behind ``rollout.engines.LockstepStream``, whose step generates everything submitted in
one batch) admits only with the engine empty and the grading done: batches of
``max_inflight // n`` prompts, weights loaded between them. With ``episodes``
(``task.environment``) a prompt's group is ``n`` multi-turn episodes: each turn is a request of
its own (the episode's context so far, one answer), the environment steps as the turn finishes,
and the group goes to grading when its last episode ends; each episode says which weight
versions sampled its turns.

Every answer says which versions sampled its tokens (``Trajectory.version_spans``, from vLLM's
own per-token weight-version labels); its behaviour log-probs are those of the weights that
sampled each token. The engine is anything with the ``StreamEngine`` methods
(``rollout/engines.py``: ``VLLMEngine``, ``LockstepStream``; the unit tests' fake). ``Streamer``
runs in one thread, the only one that calls the engine.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import redis
from transformers import PreTrainedTokenizerBase

from buffer.records import Trajectory
from reval.rewards import RewardVariant
from reval.weights.receiver import WeightSubscriber
from rollout.collect import Answer, Truncation, build_records, episode_answers, grade_answers
from rollout.engines import Finished, InflightMode, Sample, SamplingParams, StreamEngine
from rollout.environment import (
    Episode,
    EpisodeRunner,
    advance_episode,
    skipped_counts,
    start_episode,
    turn_params,
)
from rollout.tasks import Prompt, Task

log = logging.getLogger("reval.streaming")

WEIGHTS_CHECK_S = 0.005
"""The announcement is read at most this often (one Redis read; at most one per engine step)."""
CONTROL_S = 0.2
"""The run's control (pause, stop) is read this often."""
ADMIT_RETRY_S = 0.05
"""``may_admit`` (the limiter, pause) is asked before every admission; after a no, again this
often (at most ``control_s``), as the lockstep worker asks ``_ahead`` before every batch."""
LOAD_RETRY_S = 0.5
"""A load that gave nothing (the announced file unreadable, Redis away, a broadcast in transit) is
tried again this long after, the same announcement or not."""
IDLE_S = 0.005
"""Sleep of a loop turn with nothing in the engine."""


class WeightSource(Protocol):
    """Where new weights come from: a cheap look at the announcement, and the load."""

    def peek(self) -> Hashable:
        """What could be loaded now, as a value that changes when that does."""
        ...

    def load(self) -> int | None:
        """Load the newest weights into the engine; the version loaded, or None."""
        ...

    def behind(self) -> bool:
        """The announcement names weights the engine does not hold (asked after a load gave
        nothing: then the load is tried again)."""
        ...


class SubscriberSource:
    """A worker's ``WeightSubscriber`` as a ``WeightSource``: ``peek`` reads the announcement
    (one Redis read) and, while a newer version is announced and the worker joined the learner's
    hub, the versions the broadcast delivered; ``load`` is ``on_load`` (the worker's own load and
    bookkeeping)."""

    def __init__(self, subscriber: WeightSubscriber, on_load: Callable[[], int | None]) -> None:
        self.subscriber = subscriber
        self.on_load = on_load

    def peek(self) -> Hashable:
        try:
            ann = self.subscriber.store.latest()
        except (redis.ConnectionError, redis.TimeoutError):
            return None
        if ann is None:
            return None
        sub = self.subscriber
        behind = ann.version != sub.version or ann.lineage != sub.lineage
        # (the broadcast's count is an RPC into the engine's workers: asked only while behind)
        received = sub.received if behind and sub.backend is not None else 0
        return (ann.lineage, ann.version, ann.file_version, ann.broadcast, received)

    def load(self) -> int | None:
        return self.on_load()

    def behind(self) -> bool:
        try:
            ann = self.subscriber.store.latest()
        except (redis.ConnectionError, redis.TimeoutError):
            return True  # (Redis away: try again later)
        sub = self.subscriber
        return ann is not None and (ann.version != sub.version or ann.lineage != sub.lineage)


@dataclass
class Group:
    """One prompt's answers, finished, on their way to grading."""

    key: str
    prompt: Prompt
    prompt_ids: list[int]
    samples: list[Sample]
    spans: list[np.ndarray]
    submitted: float
    """``time.monotonic()`` when it entered the engine."""
    episodes: list[Episode] | None = None
    """Multi-turn (``task.environment``): the prompt's played episodes (``samples`` and
    ``spans`` empty)."""

    def skipped(self) -> dict[str, int]:
        """Episodes left out because their environment misbehaved, by reason."""
        return skipped_counts([self.episodes]) if self.episodes else {}


@dataclass
class _Open:
    """A prompt in the engine: its ``n`` answers (one request), or its ``n`` episodes (one
    request per live episode's turn)."""

    prompt: Prompt
    ids: list[int]
    params: SamplingParams
    submitted: float
    seed: int
    episodes: list[Episode] | None = None


@dataclass
class StreamStats:
    """What a ``Streamer`` did (the worker's metrics and the benchmark read it)."""

    submitted: int = 0
    """Groups (prompts) admitted."""
    finished: int = 0
    """Groups the engine finished."""
    graded: int = 0
    """Groups graded and handed on (inserted)."""
    tokens: int = 0
    """Answer tokens generated."""
    steps: int = 0
    step_s: float = 0.0
    """Time inside engine steps."""
    idle_s: float = 0.0
    """Time with nothing in the engine (waiting to admit, draining the grading)."""
    occupancy_s: float = 0.0
    """Sum over steps of step time x answers running / ``max_inflight``."""
    loads: int = 0
    load_s: float = 0.0
    """Time paused for weight loads (in-flight modes) or loading with the engine empty."""
    load_retries: int = 0
    """Loads that gave nothing while the engine was behind the announcement (each tried again
    ``load_retry_s`` later)."""
    update_delays: list[float] = field(default_factory=list)
    """Per version loaded, seconds from when the worker saw it announced to the end of the
    first engine step under it (the first tokens it sampled)."""
    max_step_s: float = 0.0


class Streamer:
    """The streaming scheduler (see the module docstring). ``on_group`` runs on one grading
    thread, group by group in finishing order; ``max_inflight`` counts answers (a prompt's
    ``n`` answers take ``n`` slots). ``params_for`` gives a prompt's sampling parameters (the
    benchmark varies ``max_new_tokens``); ``seed`` seeds the requests of a deterministic
    engine."""

    def __init__(
        self,
        engine: StreamEngine,
        tokenizer: PreTrainedTokenizerBase,
        params_for: Callable[[Prompt], SamplingParams],
        on_group: Callable[[Group], None],
        *,
        n: int,
        max_inflight: int,
        inflight: InflightMode = "keep",
        weights: WeightSource | None = None,
        seed: int = 0,
        key_prefix: str = "g",
        max_graded_behind: int | None = None,
        episodes: EpisodeRunner | None = None,
        lockstep: bool = False,
        on_step: Callable[[float], None] | None = None,
        weights_check_s: float = WEIGHTS_CHECK_S,
        control_s: float = CONTROL_S,
        load_retry_s: float = LOAD_RETRY_S,
    ) -> None:
        if max_inflight < n:
            raise ValueError(
                f"rollout.max_inflight must be >= rollout.n ({n}): one prompt's answers, "
                f"got {max_inflight}"
            )
        self.n = n
        self.engine = engine
        self.tokenizer = tokenizer
        self.params_for = params_for
        self.on_group = on_group
        self.max_inflight = max_inflight
        self.inflight = inflight
        engine.inflight = inflight
        self.weights = weights
        self.seed = seed
        self.key_prefix = key_prefix
        self.stats = StreamStats()
        self.episodes = episodes
        self.lockstep = lockstep
        """Admit only with the engine empty and the grading done (``rollout.streaming =
        false``: batches of ``max_inflight // n`` prompts, weights loaded between them)."""
        self.on_step = on_step
        """Called with each engine step's seconds, once its finished requests are handed on
        (the worker's thread tuner, lockstep: ``engine.running()`` is 0 at a batch's end)."""
        self._open: dict[str, _Open] = {}
        """Prompts in the engine, by key."""
        self._slots = 0
        self._grading = ThreadPoolExecutor(1, thread_name_prefix="grading")
        self._pending: deque[Future[None]] = deque()
        self.max_graded_behind = max_graded_behind or max(4, 2 * max_inflight)
        """Groups finished and not yet graded beyond which the loop waits for grading."""
        self.weights_check_s = max(weights_check_s, ADMIT_RETRY_S) if lockstep else weights_check_s
        """How often the announcement is read (lockstep loads only between batches: no need to
        read it more often than admissions are asked)."""
        self.control_s = control_s
        self.load_retry_s = load_retry_s
        self._peeked: Hashable = None
        """The announcement last tried (loaded, or retried at ``_retry_at``)."""
        self._retry_at: float | None = None
        """When the last load gave nothing: the time to try the same announcement again."""
        self._next_peek = 0.0
        self._hold = False
        """``finish`` mode: a new version waits for the engine to empty (no admissions)."""
        self._holding: Hashable = None
        """The announcement ``_hold`` waits to load."""
        self._announced_at: float | None = None
        self._sampled_under_new = False
        """A version was loaded and no step has run under it yet (``update_delays``)."""
        self._lock = threading.Lock()

    # -- the loop ---------------------------------------------------------------------------

    def run(
        self,
        deal: Callable[[int], list[Prompt]],
        should_stop: Callable[[], bool] = lambda: False,
        may_admit: Callable[[], bool] = lambda: True,
        max_groups: int | None = None,
    ) -> StreamStats:
        """Generate until ``should_stop`` (read every ``control_s``; then the answers in the
        engine finish, are graded and handed on: a drain) or ``max_groups`` prompts are done.
        ``deal(k)`` gives up to ``k`` more prompts; ``may_admit`` False admits none for now
        (pause, the limiter). ``may_admit`` is asked before every admission, not once per
        ``control_s``: a yes held for 0.2 s let a worker admit several groups past the limiter
        (short answers finish in tens of ms), which the learner then took one per update, ever
        staler (the one-shot service run's staleness went 1, 2, ..., 5, mean 2.1)."""
        draining, next_control, next_ask = False, 0.0, 0.0
        retry_s = min(ADMIT_RETRY_S, self.control_s)
        try:
            while True:
                now = time.monotonic()
                if now >= next_control:
                    next_control = now + self.control_s
                    draining = draining or should_stop()
                self._check_weights(now)
                capped = max_groups is not None and self.stats.submitted >= max_groups
                if (
                    not draining
                    and not capped
                    and not self._hold
                    and now >= next_ask
                    and self._room(max_groups) > 0
                    and not (self.lockstep and (self.engine.running() or self._pending))
                ):
                    if may_admit():
                        self._admit(deal, max_groups)
                    else:
                        next_ask = now + retry_s
                if self.engine.running():
                    self._step()
                elif (draining or capped) and not self._hold:
                    break
                else:
                    time.sleep(IDLE_S)
                    self.stats.idle_s += time.monotonic() - now
                self._reap(block=len(self._pending) > self.max_graded_behind)
        except BaseException as err:
            self.close(raised=err)  # (the error in hand is the first: later ones are logged)
            raise
        self.close()
        return self.stats

    def _room(self, max_groups: int | None) -> int:
        """Prompts that may be admitted now (free slots, what is left of ``max_groups``)."""
        k = (self.max_inflight - self._slots) // self.n
        if max_groups is not None:
            k = min(k, max_groups - self.stats.submitted)
        return k

    def _admit(self, deal: Callable[[int], list[Prompt]], max_groups: int | None) -> None:
        k = self._room(max_groups)
        if k <= 0:
            return
        for prompt in deal(k):
            ids = list(self.tokenizer(prompt.text, add_special_tokens=False).input_ids)
            params = self.params_for(prompt)
            if params.n != self.n:
                raise ValueError(f"params_for gave n={params.n}, the streamer runs n={self.n}")
            key = f"{self.key_prefix}-{self.stats.submitted}"
            seed = _seed(self.seed, self.stats.submitted)
            opened = self._open[key] = _Open(prompt, ids, params, time.monotonic(), seed)
            self._slots += params.n
            self.stats.submitted += 1
            if self.episodes is None:
                self.engine.submit(key, ids, params, seed)
                continue
            opened.episodes = [start_episode(self.episodes.factory, prompt, ids)
                               for _ in range(params.n)]  # fmt: skip
            for i, e in enumerate(opened.episodes):
                if e.live:
                    self._turn(key, i, e)
            if not any(e.live for e in opened.episodes):  # (no environment started)
                self._finish(key)

    def _turn(self, key: str, i: int, e: Episode) -> None:
        """Submit episode ``i`` of prompt ``key``'s next turn: its context so far, alone."""
        assert self.episodes is not None
        opened = self._open[key]
        params = turn_params(e, opened.params, self.episodes.limits)
        seed = _seed(opened.seed, 1 + i + self.n * e.turns)
        self.engine.submit(f"{key}/{i}/{e.turns}", e.prompt_ids + e.tokens, params, seed)

    def _played(self, f: Finished) -> str | None:
        """A turn finished: the episode advanced (its environment's step), its next turn
        submitted; the prompt's key when that was its last live episode."""
        assert self.episodes is not None
        key, i, _turn = f.key.rsplit("/", 2)
        opened = self._open[key]
        assert opened.episodes is not None
        e = opened.episodes[int(i)]
        (sample,), (spans,) = f.samples, f.spans
        start, limits = len(e.tokens), self.episodes.limits
        advance_episode(e, sample, self.tokenizer, self.engine.stop_ids, limits,
                        last=e.turns == limits.max_turns - 1)  # fmt: skip
        kept = min(len(sample.token_ids), limits.max_tokens - start)  # (a cut turn's kept part)
        for at, version in zip(spans[0::2].tolist(), spans[1::2].tolist(), strict=True):
            if at < kept and (not e.spans or e.spans[-1] != version):
                e.spans += [start + at, version]
        if e.live:
            self._turn(key, int(i), e)
            return None
        return None if any(x.live for x in opened.episodes) else key

    def _finish(self, key: str) -> None:
        """Prompt ``key`` is done: its group goes to grading."""
        opened = self._open.pop(key)
        self._slots -= opened.params.n
        self.stats.finished += 1
        for e in opened.episodes or ():
            if e.error is not None:
                log.warning("episode skipped (%s): %s", e.error.reason, e.error)
        group = Group(key, opened.prompt, opened.ids, [], [], opened.submitted, opened.episodes)
        self._pending.append(self._grading.submit(self._grade, group))

    def _step(self) -> None:
        t0 = time.monotonic()
        running = self.engine.running()
        done = self.engine.step()
        t1 = time.monotonic()
        s = self.stats
        s.steps += 1
        s.step_s += t1 - t0
        s.max_step_s = max(s.max_step_s, t1 - t0)
        s.occupancy_s += (t1 - t0) * min(1.0, running / self.max_inflight)
        if self._sampled_under_new:
            self._sampled_under_new = False
            if self._announced_at is not None:
                s.update_delays.append(t1 - self._announced_at)
            self._announced_at = None
        for f in done:
            s.tokens += sum(int(x.token_ids.size) for x in f.samples)
            if self.episodes is not None:
                if (key := self._played(f)) is not None:
                    self._finish(key)
                continue
            opened = self._open.pop(f.key)
            self._slots -= opened.params.n
            s.finished += 1
            group = Group(f.key, opened.prompt, opened.ids, f.samples, f.spans, opened.submitted)
            self._pending.append(self._grading.submit(self._grade, group))
        if self.on_step is not None:  # (after the step's turns are submitted again)
            self.on_step(t1 - t0)

    def _grade(self, group: Group) -> None:
        self.on_group(group)
        with self._lock:
            self.stats.graded += 1

    def _reap(self, block: bool = False) -> None:
        """Collect finished grading (its errors raise here)."""
        while self._pending and (self._pending[0].done() or block):
            self._pending.popleft().result()
            block = False

    def close(self, raised: BaseException | None = None) -> None:
        """Wait for all the grading in hand, release the grading thread. The first grading
        error (in finishing order) raises, unless one is on its way up already (``raised``);
        the later ones are logged, those that repeat the first (say, every group's insert
        refused by a corrupt ring) counted in one line."""
        first, repeats = raised, 0
        try:
            while self._pending:
                try:
                    self._pending.popleft().result()
                except Exception as err:
                    if first is None:
                        first = err
                    elif type(err) is type(first) and str(err) == str(first):
                        repeats += 1
                    else:
                        log.error("streaming: grading error after the first: %s: %s",
                                  type(err).__name__, err)  # fmt: skip
        finally:
            self._grading.shutdown(wait=True)
        if repeats:
            log.error("streaming: %d more group(s) failed as the first did (%s)", repeats,
                      type(first).__name__)  # fmt: skip
        if first is not None and raised is None:
            raise first

    # -- weights ----------------------------------------------------------------------------

    def _check_weights(self, now: float) -> None:
        if self.weights is None:
            return
        if self._hold:  # finish mode: load once the engine is empty
            if not self.engine.running():
                self._hold = False
                self._load(self._holding, paused=False, now=now)
            return
        if now < self._next_peek:
            return
        self._next_peek = now + self.weights_check_s
        seen = self.weights.peek()
        if seen is None:
            return
        if seen == self._peeked and (self._retry_at is None or now < self._retry_at):
            return
        self._announced_at = now
        if self.inflight == "finish" and self.engine.running():
            self._hold, self._holding = True, seen
            return
        paused = self.inflight != "finish" and self.engine.running() > 0
        self._load(seen, paused=paused, now=now)

    def _load(self, seen: Hashable, paused: bool, now: float) -> None:
        """Load what was announced (``seen``: the announcement peeked); ``paused``: with answers
        in the engine, frozen between two steps for the load. A load that gave nothing (the
        file unreadable, Redis away, a broadcast in transit) is tried again ``LOAD_RETRY_S``
        later (``load_retry_s``), or at once when the announcement changes."""
        assert self.weights is not None
        t0 = time.monotonic()
        if paused:
            self.engine.pause()
        try:
            version = self.weights.load()
        finally:
            if paused:
                self.engine.resume()
        self.stats.load_s += time.monotonic() - t0
        self._peeked = seen
        if version is None:  # nothing new, or nothing loaded of what is new
            self._announced_at = None
            self._retry_at = None
            if self.weights.behind():
                self._retry_at = now + self.load_retry_s
                self.stats.load_retries += 1
            return
        self._retry_at = None
        self.stats.loads += 1
        self._sampled_under_new = True
        log.debug("streaming: v%d loaded in %.3f s (%s)", version, time.monotonic() - t0,
                  "paused" if paused else "engine empty")  # fmt: skip


def _seed(seed: int, index: int) -> int:
    return int(np.random.SeedSequence([seed & 0xFFFFFFFF, index]).generate_state(1)[0])


def group_records(
    group: Group,
    task: Task,
    tokenizer: PreTrainedTokenizerBase,
    reward_variant: RewardVariant,
    *,
    stop_ids: Sequence[int],
    truncation: Truncation | None = None,
    worker_id: str = "",
    run_id: str = "",
) -> tuple[list[Trajectory], list[float]]:
    """One finished group graded (the task's verifier on each answer's text cut at
    ``stop_ids``, the engine's stop set; ``truncation`` on answers cut at the token limit: as
    ``collect_round`` does; a group of episodes: its environments' rewards) and
    reward-transformed: its records and raw scores. A record's ``policy_version`` is its first
    (oldest) version; ``version_spans`` is set only when more than one version sampled it."""
    if group.episodes is not None:
        answers, raw = episode_answers(group.prompt, group.prompt_ids, group.key, group.episodes,
                                       0, truncation or Truncation())  # fmt: skip
        records = build_records(answers, raw, reward_variant, worker_id=worker_id, run_id=run_id)
        return records, raw
    answers = [
        Answer(group.prompt, group.prompt_ids, group.key, s.token_ids, s.logprobs, s.finish_reason,
               int(spans[1]), spans=spans)
        for s, spans in zip(group.samples, group.spans, strict=True)
    ]  # fmt: skip
    raw = grade_answers(task, tokenizer, stop_ids, answers, truncation or Truncation())
    records = build_records(answers, raw, reward_variant, worker_id=worker_id, run_id=run_id)
    return records, raw
