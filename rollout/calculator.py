"""The example environment (``task.environment = "calculator"``): a calculator tool for the word
problems of ``reval make-data`` (``rollout/word_problems.py``).

A turn of the model that holds ``<calc>EXPR</calc>`` is a tool call: the environment answers
``<result>VALUE</result>`` (``<result>error</result>`` when EXPR is not arithmetic it can
evaluate) and the episode goes on, reward 0. Any other turn is the final answer: the episode
ends with reward 1 when it equals the prompt's gold answer (``answer_matches``), else 0. An
episode that reaches ``task.max_turns`` without a final answer ends with reward 0.

EXPR is evaluated without ``eval``: numbers, ``+ - * /``, unary minus and parentheses only
(``evaluate``), exactly with fractions; at most ``MAX_EXPRESSION_CHARS`` characters.
"""

from __future__ import annotations

import ast
import operator
import re
from fractions import Fraction

from rollout.env_types import Step
from rollout.task_types import Prompt

CALL = re.compile(r"<calc>(.*?)</calc>", re.DOTALL)
BOXED = re.compile(r"\\boxed\{((?:[^{}]|\{[^{}]*\})*)\}")
FRAC = re.compile(r"^\\[dt]?frac\{(-?\d+)\}\{(-?\d+)\}$")
MAX_EXPRESSION_CHARS = 64
"""A longer expression is an error (a tiny model's runaway turn, not arithmetic)."""
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
        ast.Div: operator.truediv}  # fmt: skip


def evaluate(expr: str) -> Fraction:
    """The exact value of an arithmetic expression; ValueError for anything else (names,
    calls, powers, a division by zero, too long)."""
    if len(expr) > MAX_EXPRESSION_CHARS:
        raise ValueError("expression too long")
    try:
        tree = ast.parse(expr.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"not an expression: {expr!r}") from None
    return _value(tree.body)


def _value(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return Fraction(str(node.value))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        v = _value(node.operand)
        return -v if isinstance(node.op, ast.USub) else v
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Div) and right == 0:
            raise ValueError("division by zero")
        return Fraction(_OPS[type(node.op)](left, right))
    raise ValueError(f"not arithmetic: {type(node).__name__}")


def show(value: Fraction) -> str:
    """An integer as itself, anything else as a decimal (at most 6 places) or ``a/b``."""
    if value.denominator == 1:
        return str(value.numerator)
    text = f"{float(value):.6f}".rstrip("0")
    return text if Fraction(text) == value else f"{value.numerator}/{value.denominator}"


def _number(text: str) -> Fraction | None:
    text = text.strip().strip("$").replace(" ", "")
    m = FRAC.match(text)
    try:
        if m:
            return Fraction(int(m.group(1)), int(m.group(2)))
        return Fraction(text)
    except (ValueError, ZeroDivisionError):
        return None


def final_answer(message: str) -> str:
    """The answer in a final turn: its last ``\\boxed{}``, else the whole message, stripped."""
    boxed = BOXED.findall(message)
    return (boxed[-1] if boxed else message).strip()


def answer_matches(message: str, gold: str) -> bool:
    """The final answer equals ``gold``: as numbers (``1/2``, ``0.5`` and ``\\frac{1}{2}`` are
    equal) when both read as one, else as text without spaces (``x+3``)."""
    answer = final_answer(message)
    a, g = _number(answer), _number(gold)
    if a is not None and g is not None:
        return a == g
    return answer.replace(" ", "") == gold.replace(" ", "")


class CalculatorEnv:
    """One episode of a word problem with a calculator (module docstring)."""

    def __init__(self) -> None:
        self.gold = ""
        self.calls = 0
        """Tool calls answered in this episode."""

    def start(self, prompt: Prompt) -> None:
        self.gold = prompt.answer
        self.calls = 0

    def step(self, message: str) -> Step:
        call = CALL.search(message)
        if call is None:
            return Step("", 1.0 if answer_matches(message, self.gold) else 0.0, True)
        self.calls += 1
        try:
            result = show(evaluate(call.group(1)))
        except ValueError:
            result = "error"
        return Step(f"<result>{result}</result>", 0.0, False)
