"""Hand-run benchmark of the math verifier (``rollout/grading/math_grading.py``, graded in the pool
of ``rollout/grading/pool.py``).

A round of the demo's shape (``--prompts`` 32 x ``--n`` 16 = 512 answers by default) of
DeepScaleR-like answers: each prompt's gold answer is drawn from templates (fractions, integers,
radicals, intervals, sets, tuples, multiples of pi, polynomials, percentages) and each response is
a few hundred characters of reasoning ending in one of: the gold string itself (decided by the
fast path, ~30%), an equal answer in another form (~25%), a near miss or wrong answer (~30%), or
no box at all (a truncated response, ~15%). It measures answers/s of:

- ``in-process``: ``MathVerify.grade`` in this process's main thread, one answer after another;
- ``VerifierPool`` with 1 and 2 workers: one caller thread with ``score`` per answer and with one
  ``score_many`` of the whole round; 8 caller threads with ``score`` per answer and with
  ``score_many`` of their share.

Then, for each pool size, the share of a rollout worker's time that grading a round would take if
it graded after generating, ``grading / (grading + generation)``, for the generation times per
round given with ``--gen-seconds`` (grading at the one-caller ``score_many`` rate).

Run it from the repository root on an otherwise idle machine (about a minute):

    .venv/bin/python benchmarks/verifier_bench.py
    .venv/bin/python benchmarks/verifier_bench.py --prompts 64 --n 8 --gen-seconds 30 120

It prints markdown tables to stdout. Each timed pass follows a warm-up pass over another round
of the same shape (workers started, math-verify's parser warmed). Order matters a little:
math-verify keeps small LRU caches (20 parsed strings) and each worker caches parsed gold
answers, so a prompt's answers graded together (as a rollout worker does) cost less than the same
answers interleaved with other prompts'.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from rollout.grading.math_grading import MathVerify
from rollout.grading.pool import VerifierPool

Item = tuple[str, str]

FILLER = (
    "We start by writing the condition as an equation. ",
    "Substituting $x = 2$ gives $4 + 2a = b$, hence the relation between the coefficients. ",
    "By symmetry, it suffices to consider the case $a \\le b$. ",
    "Let $f(x) = x^2 - 3x + 2 = (x-1)(x-2)$, whose roots are $1$ and $2$. ",
    "Wait, let me double check the arithmetic: $12 \\cdot 7 = 84$, and $84 / 4 = 21$. ",
    "Therefore the sum of the first $n$ terms is $\\frac{n(n+1)}{2}$. ",
    "Taking logarithms of both sides, $\\log_2 8 = 3$. ",
    "Hmm, that does not match; go back to the previous step. ",
)


@dataclass
class Problem:
    gold: str
    equal: list[str]
    wrong: list[str]


def make_problem(rng: random.Random) -> Problem:
    kind = rng.randrange(9)
    a, b = rng.randint(2, 9), rng.randint(10, 19)
    if kind == 0:
        p, q = rng.choice([(1, 2), (3, 4), (1, 8), (7, 12), (5, 6), (2, 3), (9, 16)])
        dec = f"{p / q:.6f}".rstrip("0")
        return Problem(
            f"\\frac{{{p}}}{{{q}}}",
            [dec, f"\\dfrac{{{p}}}{{{q}}}", f"{p}/{q}", f"\\frac{{{2 * p}}}{{{2 * q}}}"],
            [f"{p / q:.2f}", f"\\frac{{{p + 1}}}{{{q}}}", f"\\frac{{{q}}}{{{p}}}"],
        )
    if kind == 1:
        n = rng.randint(2, 2000)
        return Problem(
            str(n),
            [f"x = {n}", f"{n} \\text{{ cm}}", f"{n}.0", f"\\frac{{{2 * n}}}{{2}}"],
            [str(n + 1), str(n - 1), str(10 * n)],
        )
    if kind == 2:
        s = rng.choice([2, 3, 5, 6, 7])
        return Problem(
            f"{a}\\sqrt{{{s}}}",
            [f"\\sqrt{{{a * a * s}}}", f"{a} \\sqrt {s}", f"\\sqrt{{{s}}} \\cdot {a}"],
            [f"{s}\\sqrt{{{a}}}", f"\\sqrt{{{a * s}}}", f"{a + 1}\\sqrt{{{s}}}"],
        )
    if kind == 3:
        return Problem(
            f"({a},{b}]",
            [f"\\left({a}, {b}\\right]", f"({a}, {b}]"],
            [f"[{a},{b}]", f"({a},{b})", f"({a},{b + 1}]"],
        )
    if kind == 4:
        return Problem(
            f"\\{{{a},{b}\\}}",
            [f"\\{{{b}, {a}\\}}", f"\\left\\{{{a},{b}\\right\\}}"],
            [f"\\{{{a},{b + 1}\\}}", f"\\{{{a}\\}}"],
        )
    if kind == 5:
        return Problem(f"({a},{b})", [f"({a}, {b})"], [f"({b},{a})", f"({a},{b - 1})"])
    if kind == 6:
        return Problem(
            f"\\frac{{{a}\\pi}}{{{b}}}",
            [f"\\frac{{{a}}}{{{b}}}\\pi", f"{a}\\pi/{b}"],
            [f"\\frac{{\\pi}}{{{b}}}", f"\\frac{{{a}}}{{{b}}}"],
        )
    if kind == 7:
        r, s = rng.randint(1, 5), rng.randint(1, 5)
        return Problem(
            f"x^2+{r + s}x+{r * s}",
            [f"(x+{r})(x+{s})", f"{r * s}+{r + s}x+x^2"],
            [f"(x+{r})(x-{s})", f"x^2+{r * s}"],
        )
    pct = rng.choice([5, 12, 25, 40, 75])
    return Problem(f"{pct}\\%", [f"{pct / 100}", f"{pct} \\%"], [f"{pct + 1}\\%", f"{pct / 1000}"])


def make_round(seed: int, prompts: int, n: int) -> list[Item]:
    rng = random.Random(seed)
    items: list[Item] = []
    for _ in range(prompts):
        prob = make_problem(rng)
        for _ in range(n):
            text = "".join(rng.choice(FILLER) for _ in range(rng.randint(4, 12)))
            u = rng.random()
            if u < 0.30:
                ans: str | None = prob.gold
            elif u < 0.55:
                ans = rng.choice(prob.equal)
            elif u < 0.85:
                ans = rng.choice(prob.wrong)
            else:
                ans = None
            items.append((prob.gold, text if ans is None else f"{text}\n\nThus \\boxed{{{ans}}}."))
    return items


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def one_by_one(pool: VerifierPool, items: Sequence[Item]) -> list[float]:
    return [pool.score_many([it])[0] for it in items]


def threaded(fn: Callable[[Sequence[Item]], list[float]], items: Sequence[Item], k: int) -> None:
    size = -(-len(items) // k)  # contiguous shares: each thread grades whole prompt groups
    shares = [items[i : i + size] for i in range(0, len(items), size)]
    with ThreadPoolExecutor(k) as ex:
        list(ex.map(fn, shares))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--n", type=int, default=16, help="answers per prompt")
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--pool-sizes", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--timeout", type=float, default=5.0, help="pool deadline per answer (s)")
    ap.add_argument(
        "--gen-seconds",
        type=float,
        nargs="+",
        default=[1.0, 10.0, 60.0],
        help="generation time per round (s): measured on the rollout worker, or assumed",
    )
    args = ap.parse_args()

    warm = make_round(1, args.prompts, args.n)
    items = make_round(0, args.prompts, args.n)
    total = len(items)
    grader = MathVerify()
    pre = [grader.precheck(g, r) for g, r in items]
    fast = sum(p.score is not None for p in pre)
    print(
        f"# verifier benchmark: {total} answers ({args.prompts} prompts x {args.n}), "
        f"{fast} decided without sympy ({100 * fast / total:.0f}%); "
        f"{os.cpu_count()} CPUs, {platform.python_version()}, load {os.getloadavg()[0]:.2f}\n"
    )

    rows: list[tuple[str, str, float]] = []
    for g, r in warm:
        grader.grade(g, r)
    dt = timed(lambda: [grader.grade(g, r) for g, r in items])
    rows.append(("in-process (main thread)", "-", total / dt))
    expected = [grader.grade(g, r) for g, r in items]

    batch_rate: dict[int, float] = {}
    for size in args.pool_sizes:
        with VerifierPool(grader, workers=size, timeout=args.timeout) as pool:
            assert pool.wait_ready(120), "workers did not start"
            pool.score_many(warm)
            modes: list[tuple[str, Callable[[], object]]] = [
                ("1 caller, score() each", lambda: one_by_one(pool, items)),
                ("1 caller, score_many(all)", lambda: pool.score_many(items)),
                (
                    f"{args.threads} threads, score() each",
                    lambda: threaded(lambda s: one_by_one(pool, s), items, args.threads),
                ),
                (
                    f"{args.threads} threads, score_many(share)",
                    lambda: threaded(pool.score_many, items, args.threads),
                ),
            ]
            for name, fn in modes:
                rate = total / timed(fn)
                rows.append((name, str(size), rate))
                if name.startswith("1 caller, score_many"):
                    batch_rate[size] = rate
            got = pool.score_many(items)
            if got != expected:
                diff = sum(a != b for a, b in zip(got, expected, strict=True))
                print(f"WARNING: pool of {size} disagrees with in-process on {diff} answers")
            errs = {r: pool.metrics.error_count(r) for r in ("timeout", "crash", "error")}
            if any(errs.values()):
                print(f"note: pool of {size}: errors {errs}")

    print("| mode | workers | answers/s | ms/answer |")
    print("|---|---:|---:|---:|")
    for name, size, rate in rows:
        print(f"| {name} | {size} | {rate:,.0f} | {1000 / rate:.2f} |")
    print(f"\nscore: {sum(expected):.0f}/{total} correct\n")

    print(f"Grading share of a rollout worker's time, {total} answers per round:\n")
    gens = " | ".join(f"gen {g:g} s" for g in args.gen_seconds)
    print(f"| workers | grading s/round | {gens} |")
    print("|---:|---:|" + "---:|" * len(args.gen_seconds))
    for size, rate in batch_rate.items():
        grade_s = total / rate
        shares = " | ".join(f"{100 * grade_s / (grade_s + g):.1f}%" for g in args.gen_seconds)
        print(f"| {size} | {grade_s:.2f} | {shares} |")


if __name__ == "__main__":
    main()
