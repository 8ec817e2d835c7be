"""Custom rewards: the function a custom task's ``task.reward`` names, called in the grading
processes (``RewardFunction``); the task that reads its prompts is ``rollout/custom_task.py``.

``task.reward`` (``package.module:function`` or ``path/to/file.py:function``, loaded by
``reval.paths.load_reward``) is called as ``f(prompt, completion, metadata, **task.reward_args)``,
where ``prompt`` is the row's prompt field as the dataset holds it and ``completion`` the answer
as generated (``reval.answers.answer_text``: up to its stop token, special tokens kept); a
function that declares a ``finish_reason`` parameter also gets ``finish_reason="stop"`` or
``"length"`` (cut at the token limit; ``algo.truncated_reward`` decides what such an answer
earns in training, docs/tasks.md). It runs in the worker's
grading processes (``rollout/grading/pool.py``: ``VerifierPool``, the math grader's pool) under
the per-answer deadline ``rollout.verifier_timeout_s``. How a function is called:

- plain (``def f(prompt, completion, metadata)``): once per answer, one answer per task;
- batched (the function has the attribute ``batched = True``, set by hand or by the ``batched``
  decorator here): ``f(prompts, completions, metadatas)`` with lists, returning a list of as
  many rewards; the pool hands each grading process one chunk of a round's answers, with a
  deadline of the per-answer one times its size;
- async (``async def``, recognised by ``inspect.iscoroutinefunction``): the answers of a chunk
  are awaited together on the process's event loop, each under the per-answer deadline (a
  batched async function: one await per chunk).

A function with a ``preflight`` attribute (``preflighted``: ``f(reward_args, timeout_s,
sandbox_mode)``) has it called when grading starts, in the worker and in each grading process.

A reward is a number (``bool`` counts), or a dict whose ``score`` is the reward and whose other
numeric entries are named components (the ``reval_reward_component{name}`` summary; the
``reward/NAME`` columns of ``reval train``'s rows). What scores 0 and is counted in
``reval_verifier_errors_total{reason}``: an exception (``error``), passing the deadline
(``timeout``: the process is killed and replaced), needing more memory than
``rollout.grading_memory_mb`` (``memory``), anything that is not a number or a dict with
a numeric ``score`` (``not_a_number``) and a NaN or infinite value (``not_finite``). None of
them stops the run.
"""

from __future__ import annotations

import asyncio
import inspect
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, TypeVar, cast

from reval.paths import load_reward
from rollout.grading.process import Graded, Precheck
from rollout.task_types import Prompt

Preflight = Callable[[Mapping[str, Any], float, str], None]
"""A reward's check when grading starts: ``(task.reward_args, the pool's per-answer deadline,
rollout.sandbox)``; it raises, in one line, what keeps the reward from grading."""

F = TypeVar("F", bound=Callable[..., Any])


class _Batched(Protocol):
    batched: bool


class _Preflighted(Protocol):
    preflight: Preflight


def batched(fn: F) -> F:
    """``fn`` marked batched: ``fn.batched = True`` (what a user may also write by hand; see the
    module's docstring for how a batched function is called)."""
    cast(_Batched, fn).batched = True
    return fn


def preflighted(check: Preflight) -> Callable[[F], F]:
    """A decorator giving the reward ``check`` as its ``preflight`` (``RewardFunction`` calls it
    when grading starts)."""

    def mark(fn: F) -> F:
        cast(_Preflighted, fn).preflight = check
        return fn

    return mark


def to_graded(value: Any) -> Graded:
    """A reward function's return value as a ``Graded``: a finite number, or a dict with a
    finite numeric ``score`` (its other finite numeric entries are components); anything else
    scores 0 with the reason ``not_a_number`` or ``not_finite``."""
    components: dict[str, float] | None = None
    if isinstance(value, Mapping):
        components = {}
        for name, v in value.items():
            if name != "score" and _is_number(v) and math.isfinite(float(v)):
                components[str(name)] = float(v)
        if "score" not in value:
            keys = ", ".join(map(str, value))
            return Graded(0.0, "not_a_number", f"a dict without 'score' ({keys})", components)
        value = value["score"]
    if not _is_number(value):
        return Graded(0.0, "not_a_number", f"returned {type(value).__name__} {value!r:.80}",
                      components)  # fmt: skip
    score = float(value)
    if not math.isfinite(score):
        return Graded(0.0, "not_finite", f"returned {score}", components)
    return Graded(score, None, "", components)


def _is_number(value: Any) -> bool:
    """A real number, or what converts to one (numpy and one-element torch scalars); not text."""
    if isinstance(value, str | bytes) or not hasattr(value, "__float__"):
        return False
    try:
        float(value)
    except (TypeError, ValueError):
        return False
    return not isinstance(value, complex)


def _error(err: BaseException) -> Graded:
    if isinstance(err, MemoryError):  # (rollout.grading_memory_mb)
        return Graded(0.0, "memory", "over the grading processes' memory cap")
    return Graded(0.0, "error", f"{type(err).__name__}: {err}"[:500])


class RewardFunction:
    """The grader (``rollout.grading.process.PoolGrader``) of a custom task: the function ``spec``
    names, called with ``kwargs`` in the grading processes. Loaded here too: what ``batched`` is
    depends on it. ``timeout``: the per-answer deadline of an async function's answers."""

    def __init__(self, spec: str, kwargs: Mapping[str, Any] | None = None,
                 timeout: float = 5.0, sandbox: str = "bwrap") -> None:  # fmt: skip
        self.spec = spec
        self.kwargs = dict(kwargs or {})
        self.timeout = timeout
        self.sandbox = sandbox
        fn = load_reward(spec)
        self._preflight(fn)
        self.batch_call = getattr(fn, "batched", False) is True
        self.is_async = inspect.iscoroutinefunction(fn)
        self.takes_finish_reason = takes_finish_reason(fn)
        """The function declares a ``finish_reason`` parameter: it receives the answer's."""
        self.batched = self.batch_call or self.is_async
        self._fn: Any = fn
        self._loop: asyncio.AbstractEventLoop | None = None

    def __getstate__(self) -> dict[str, Any]:
        # (a grading process loads the function itself: a file's module is not importable by
        # name there, and neither is an event loop picklable)
        return {**self.__dict__, "_fn": None, "_loop": None}

    def item(
        self, prompt: Prompt, response: str, finish_reason: str = "stop"
    ) -> tuple[Any, str, Mapping[str, Any], str]:
        raw = prompt.raw if prompt.raw is not None else prompt.text
        return (raw, response, dict(prompt.metadata or {}), finish_reason)

    def _kwargs(self, finish_reason: Any) -> dict[str, Any]:
        """``task.reward_args``, and ``finish_reason`` where the function declares it."""
        if not self.takes_finish_reason:
            return self.kwargs
        return {**self.kwargs, "finish_reason": finish_reason}

    def precheck(self, *item: Any) -> Precheck:
        return Precheck(None)  # (every answer goes to a grading process)

    def warm_up(self) -> None:
        if self._fn is None:
            self._fn = load_reward(self.spec)
            self._preflight(self._fn)

    def _preflight(self, fn: Any) -> None:
        """A function that runs model code (``rollout.grading.graders:code_tests``: its
        ``preflight``) checks its sandbox (``rollout/grading/sandbox.py``) and its deadline against
        ``timeout`` when grading starts, in the worker and in each grading process: it refuses
        there, in one line, not per answer."""
        preflight = getattr(fn, "preflight", None)
        if callable(preflight):
            preflight(self.kwargs, self.timeout, self.sandbox)

    def grade_many(self, work: Sequence[tuple[tuple[Any, ...], str | None]]) -> list[Graded]:
        """Each ``((prompt, completion, metadata, finish_reason), _)`` graded by the function
        (see the module's docstring for how it is called and what scores 0)."""
        self.warm_up()
        items = [item for item, _ in work]
        if self.batch_call:
            try:
                prompts, completions, metadatas, reasons = (
                    list(col) for col in zip(*items, strict=True)
                )
                out = self._fn(prompts, completions, metadatas, **self._kwargs(reasons))
                if inspect.isawaitable(out):
                    out = self._run(out)
            except Exception as err:
                return [_error(err)] * len(items)
            if isinstance(out, str | bytes | Mapping) or not isinstance(out, Sequence):
                why = f"a batched reward returned {type(out).__name__}, not a list"
                return [Graded(0.0, "not_a_number", why)] * len(items)
            if len(out) != len(items):
                why = f"a batched reward returned {len(out)} rewards for {len(items)} answers"
                return [Graded(0.0, "not_a_number", why)] * len(items)
            return [to_graded(v) for v in out]
        if self.is_async:
            gathered: list[Graded] = self._run(self._gather(items))
            return gathered
        graded = []
        for prompt, completion, metadata, reason in items:
            try:
                value = self._fn(prompt, completion, metadata, **self._kwargs(reason))
                graded.append(to_graded(value))
            except Exception as err:
                graded.append(_error(err))
        return graded

    async def _gather(self, items: list[tuple[Any, ...]]) -> list[Graded]:
        async def one(prompt: Any, completion: str, metadata: Any, reason: str) -> Graded:
            try:
                coro = self._fn(prompt, completion, metadata, **self._kwargs(reason))
                return to_graded(await asyncio.wait_for(coro, self.timeout))
            except TimeoutError:
                return Graded(0.0, "timeout", f"not done in {self.timeout} s")
            except Exception as err:
                return _error(err)

        return list(await asyncio.gather(*(one(*item) for item in items)))

    def _run(self, coro: Any) -> Any:
        """``coro`` run to its end on this process's own event loop (kept between calls, so an
        async function's clients and connections live across answers)."""
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
        return self._loop.run_until_complete(coro)


def takes_finish_reason(fn: Any) -> bool:
    """``fn`` declares a parameter named ``finish_reason`` (then it is called with the answer's:
    ``stop``, or ``length`` for an answer cut at the token limit; a batched function gets a
    list). Functions without it are called as before."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    param = params.get("finish_reason")
    return param is not None and param.kind in (
        inspect.Parameter.POSITIONAL_OR_KEYWORD,
        inspect.Parameter.KEYWORD_ONLY,
    )
