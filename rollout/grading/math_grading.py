"""Math answers graded for equivalence with math-verify (run in the grading processes of
``rollout/grading/pool.py``).

``MathVerify`` is the grading function: the last ``\\boxed{...}`` of a response against the gold
answer. It is the one grader of math answers: ``reval train``, the rollout workers and
``reval eval`` all grade through ``PooledVerifier``/``VerifierPool``.

Cheap decisions come first and need no sympy (no box: 0; require_think without ``</think>``: 0; the
normalized strings equal, ``normalize_answer``: 1; multiple choice: letters compared); the rest goes
through math-verify's ``parse`` and ``verify`` (gold and answer both read as ``\\boxed{...}`` LaTeX;
math-verify's defaults: numbers rounded to 6 places, strict variables, ``x = 3`` read as ``3``
against a gold ``3``).

math-verify bounds its own work with ``signal.alarm``: it only works on a process's main thread
(elsewhere ``parse``/``verify`` raise ``ValueError``) and its ``TimeoutException`` is a
``BaseException``: hence the grading processes, each grading in its main thread.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rollout.grading.process import Graded, Precheck

if TYPE_CHECKING:
    from rollout.task_types import Prompt

# -- extraction (pure string work, no sympy) -------------------------------------------------------

_BOX_RE = re.compile(r"\\(?:boxed|fbox)")


def last_boxed_answer(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` / ``\\fbox{...}`` (brace-matched), ``\\boxed 5`` (up to
    the next ``$`` or white space) too; None when there is none or the last one is not closed."""
    matches = list(_BOX_RE.finditer(text))
    if not matches:
        return None
    i = matches[-1].end()
    j = i
    while j < len(text) and text[j] in " \t":
        j += 1
    if j < len(text) and text[j] == "{":
        depth = 0
        for k in range(j, len(text)):
            c = text[k]
            if c == "{":
                depth += 1
            elif c == "}":
                depth -= 1
                if depth == 0:
                    return text[j + 1 : k]
        return None
    if j > i and j < len(text):  # "\boxed 5$": a single token
        m = re.match(r"[^\s$]+", text[j:])
        return m.group(0) if m else None
    return None


def clean_gold(gold: str) -> str:
    """The gold answer as LaTeX: inside its last ``\\boxed{}`` when it has one, ``$`` stripped."""
    g = str(gold).strip()
    if _BOX_RE.search(g):
        g = last_boxed_answer(g) or g
    g = g.strip()
    while len(g) >= 2 and g[0] == "$" and g[-1] == "$":
        g = g[1:-1].strip()
    return g


_TEXT_WRAP = re.compile(r"\\(?:text|textbf|mathrm|mathbf|textrm|mbox)\s*\{([^{}]*)\}")
_CHOICE_RE = re.compile(r"\(([A-Za-z])\)(?:\s+.*)?|([A-Za-z])[).:](?:\s+.*)?|([A-Za-z])", re.S)


def choice_letter(answer: str, choices: str = "ABCD") -> str | None:
    """The option letter of a multiple-choice answer (``B``, ``(B)``, ``B)``, ``\\text{B}``,
    ``(B) 42``), upper case; None when the answer is not one of ``choices``."""
    s = answer.strip().replace("$", "")
    for _ in range(3):  # \textbf{\text{B}}
        s = _TEXT_WRAP.sub(r"\1", s)
    s = s.replace("\\left", "").replace("\\right", "").replace("\\,", " ").strip()
    m = _CHOICE_RE.fullmatch(s)
    if m is None:
        return None
    letter = next(g for g in m.groups() if g).upper()
    return letter if letter in choices.upper() else None


_SPACES = re.compile(r"\s+")


def normalize_answer(ans: str) -> str:
    """A boxed answer as a plain string for the fast path: spaces, ``\\left``/``\\right``,
    degree signs, dollars and a final dot dropped, ``\\dfrac``/``\\tfrac`` read as ``\\frac``,
    ``10.0`` read as ``10``."""
    s = _SPACES.sub("", ans)
    for a, b in (
        ("\\dfrac", "\\frac"),
        ("\\tfrac", "\\frac"),
        ("\\left", ""),
        ("\\right", ""),
        ("^{\\circ}", ""),
        ("^\\circ", ""),
        ("\\$", ""),
        ("$", ""),
        ("\\!", ""),
    ):
        s = s.replace(a, b)
    s = s.rstrip(".")
    if re.fullmatch(r"-?\d+\.0+", s):
        s = s.split(".")[0]
    return s


# -- math-verify, in the main thread of a process ------------------------------------------------


def _is_timeout(err: BaseException) -> bool:
    return type(err).__name__ == "TimeoutException"


@functools.lru_cache(maxsize=1)
def _configs() -> tuple[Any, Any, Any]:
    from math_verify import ExprExtractionConfig, LatexExtractionConfig

    latex = LatexExtractionConfig(boxed_match_priority=0)
    return latex, ExprExtractionConfig(), [latex]


@functools.lru_cache(maxsize=4096)
def _parse_gold(gold: str, parsing_timeout: int) -> tuple[Any, ...]:
    """Gold answers repeat (n samples per prompt): parsed once per worker. Timeouts and errors
    raise, so they are not cached."""
    from math_verify import parse

    latex, expr, _ = _configs()
    return tuple(
        parse(
            f"\\boxed{{{gold}}}",
            extraction_config=[latex, expr],
            parsing_timeout=parsing_timeout,
            raise_on_error=True,
        )
    )


@dataclass(frozen=True)
class MathVerify:
    """Grades the last boxed answer of a response against a gold answer (1.0 or 0.0).

    ``require_think``: DeepScaleR's rule for thinking models (``deepscaler/rewards/
    math_reward.py``, ``RewardMathFn.__call__``): the decoded prompt + response must hold
    ``<think>`` and ``</think>`` (else 0), and only ``text.split("</think>")[1]`` is graded, the
    text between the first ``</think>`` and the next one, if any. The ``r1_distill`` template
    ends the prompt with ``<think>`` (``math_task.format_prompt``), so the response needs
    ``</think>``. ``multiple_choice``: the
    boxed answer is an option letter of ``choices`` (``B``, ``(B)``, ``B)``, ``\\text{B}``),
    compared with the gold letter case-insensitively; sympy is not used. ``parsing_timeout`` and
    ``verify_timeout`` are math-verify's own alarms (whole seconds; per parse, per comparison).

    ``grade``/``score`` run math-verify in this process: main thread only (math-verify's alarm);
    from other threads use ``VerifierPool``.
    """

    require_think: bool = False
    multiple_choice: bool = False
    batched = False  # (a class attribute: one answer per task)
    choices: str = "ABCD"
    parsing_timeout: int = 1
    verify_timeout: int = 2
    float_rounding: int = 6
    max_answer_chars: int = 2000

    def extract(self, response: str) -> str | None:
        """The answer to grade: the last boxed content (with require_think, of the text between
        the first ``</think>`` and the next one, as DeepScaleR grades)."""
        if self.require_think:
            parts = response.split("</think>")
            if len(parts) < 2:
                return None
            response = parts[1]
        return last_boxed_answer(response)

    def precheck(self, gold: str, response: str) -> Precheck:
        """Everything that needs no sympy. Raises ValueError for a multiple-choice gold answer
        that is not a letter of ``choices`` (a data error, not a wrong answer)."""
        pred = self.extract(response)
        if self.multiple_choice:
            g = choice_letter(clean_gold(gold), self.choices)
            if g is None:
                raise ValueError(
                    f"multiple-choice gold answer {gold!r} is not one of {self.choices}"
                )
            if pred is None:
                return Precheck(0.0)
            return Precheck(1.0 if choice_letter(pred, self.choices) == g else 0.0)
        if pred is None or not pred.strip():
            return Precheck(0.0)
        if normalize_answer(pred) == normalize_answer(clean_gold(gold)):
            return Precheck(1.0)
        if len(pred) > self.max_answer_chars:
            return Precheck(0.0, reason="too_long")
        return Precheck(None, pred=pred)

    def equivalent(self, gold: str, pred: str) -> bool:
        """math-verify's equivalence of a boxed answer and the gold answer.

        Raises math-verify's ``TimeoutException`` (a ``BaseException``) when one of its alarms
        fires, and whatever else parsing or comparing raised when no comparison succeeded.
        """
        self._check_thread()
        from math_verify import parse, verify

        _, _, pred_config = _configs()
        golds = _parse_gold(clean_gold(gold), self.parsing_timeout)
        if not golds:
            return False
        preds = parse(
            f"\\boxed{{{pred}}}",
            extraction_config=pred_config,
            parsing_timeout=self.parsing_timeout,
            raise_on_error=True,
        )
        failure: BaseException | None = None
        for g, p in itertools.product(golds, preds):
            try:
                if verify(
                    g,
                    p,
                    float_rounding=self.float_rounding,
                    timeout_seconds=self.verify_timeout,
                    raise_on_error=True,
                ):
                    return True
            except Exception as err:
                failure = failure or err
            except BaseException as err:
                if not _is_timeout(err):
                    raise
                failure = failure or err
        if failure is not None:
            raise failure
        return False

    def _check_thread(self) -> None:
        # Raised, never caught into a 0 score: that would silently fail every answer.
        if (self.parsing_timeout or self.verify_timeout) and (
            threading.current_thread() is not threading.main_thread()
        ):
            raise RuntimeError(
                "math-verify's timeouts use signal.alarm and only work on the main thread; "
                "grade through VerifierPool"
            )

    def grade_extracted(self, gold: str, pred: str) -> tuple[float, str | None, str]:
        """(score, error reason or None, detail) of an extracted answer, grading exceptions
        caught: what a worker runs. Raises RuntimeError off the main thread."""
        self._check_thread()
        try:
            return (1.0 if self.equivalent(gold, pred) else 0.0), None, ""
        except MemoryError:
            return 0.0, "memory", "over the grading processes' memory cap"
        except Exception as err:
            return 0.0, "error", f"{type(err).__name__}: {err}"[:500]
        except BaseException as err:
            if _is_timeout(err):
                return 0.0, "timeout", "math-verify timeout"
            raise

    def item(self, prompt: Prompt, response: str, finish_reason: str = "stop") -> tuple[str, str]:
        return (prompt.answer, response)

    def grade_many(self, work: Sequence[tuple[tuple[Any, ...], str | None]]) -> list[Graded]:
        """``((gold, response), pred)`` pairs: each extracted answer against its gold."""
        return [Graded(*self.grade_extracted(item[0], str(pred))) for item, pred in work]

    def grade(self, gold: str, response: str) -> float:
        """Reward of ``response`` against ``gold``, graded in this process (main thread)."""
        pre = self.precheck(gold, response)
        if pre.score is not None:
            return pre.score
        assert pre.pred is not None
        return self.grade_extracted(gold, pre.pred)[0]

    def score(self, prompt: Prompt, response: str) -> float:
        return self.grade(prompt.answer, response)

    def warm_up(self) -> None:
        """Loads math-verify's parser (the first parse costs ~0.1 s)."""
        with contextlib.suppress(Exception):
            self.equivalent("\\frac{1}{2}", "0.5")
