"""`reval eval`: benchmark loading (fields, GPQA options, the seeded cap), avg@k, and the command
on a saved tiny checkpoint with sample benchmark files built here."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from reval.config import ModelConfig
from reval.policy import load_policy
from rollout.engines import Sample, SamplingParams
from rollout.eval_sets import BENCHMARKS, Benchmark, Problem, load_benchmark, parse_rows
from services.evaluate import evaluate_benchmark, table
from tests.conftest import announce_weights

ROOT = Path(__file__).resolve().parents[2]


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def sample_data(d: Path) -> Path:
    good = [{"problem": f"{i}+1=?", "answer": str(i + 1)} for i in range(6)]
    write_jsonl(d / "aime24.jsonl", [*good, {"problem": "", "answer": "1"}, {"answer": "3"}])
    write_jsonl(d / "olympiad.jsonl", [{"question": "2+2?", "final_answer": ["4"]},
                                       {"question": "x", "final_answer": []}])  # fmt: skip
    write_jsonl(d / "gpqa.jsonl", [
        {"Question": f"Q{i}", "Correct Answer": f"right{i}", "Incorrect Answer 1": "w1",
         "Incorrect Answer 2": "w2", "Incorrect Answer 3": "w3"} for i in range(4)
    ] + [{"Question": "Q", "Correct Answer": "r", "Incorrect Answer 1": "w"}])  # fmt: skip
    return d


def test_loading_fields_options_and_the_cap(tmp_path):
    d = sample_data(tmp_path)
    aime = load_benchmark("aime24", d, max_problems=100)
    assert len(aime.problems) == 6 and aime.skipped == 2
    assert aime.problems[0].answer == "1" and aime.prompts[0].startswith("0+1=?")
    oly = load_benchmark("olympiad", d)
    assert [p.answer for p in oly.problems] == ["4"] and oly.skipped == 1
    gpqa = load_benchmark("gpqa", d, seed=3)
    assert len(gpqa.problems) == 4 and gpqa.skipped == 1  # (three wrong options needed)
    for i, p in enumerate(gpqa.problems):
        line = next(x for x in p.text.splitlines() if x.endswith(f"right{i}"))
        assert line.startswith(f"{p.answer})")  # the gold letter is where the right option went
    assert len({p.answer for p in gpqa.problems}) > 1  # shuffled, not always A
    again = load_benchmark("gpqa", d, seed=3)
    assert [p.text for p in again.problems] == [p.text for p in gpqa.problems]
    capped = load_benchmark("aime24", d, max_problems=3, seed=1)
    assert len(capped.problems) == 3 and capped.total == 6
    assert [p.id for p in load_benchmark("aime24", d, max_problems=3, seed=1).problems] == [
        p.id for p in capped.problems
    ]
    with pytest.raises(ValueError, match="unknown benchmark"):
        load_benchmark("mmlu", d)
    with pytest.raises(FileNotFoundError, match="amc"):
        load_benchmark("amc", d)
    assert set(BENCHMARKS) == {
        "aime24",
        "aime25",
        "amc",
        "math500",
        "minerva",
        "olympiad",
        "gpqa",
        "wordmath",
    }
    problems, skipped = parse_rows(BENCHMARKS["math500"], [{"problem": "p", "answer": 7}, "junk"])
    assert [p.answer for p in problems] == ["7"] and skipped == 1


class FakeTokenizer:
    eos_token_id = 0

    class _Enc:
        def __init__(self, ids: list[int]) -> None:
            self.input_ids = ids

    def __call__(self, text: str, add_special_tokens: bool = False):
        return self._Enc([1, 2, 3])

    def decode(self, tokens: list[int], skip_special_tokens: bool = True) -> str:
        return "right" if tokens == [7] else "wrong"


class FakeEngine:
    """Problem j (in call order) gets right answers in its first j % 4 samples of 4."""

    stop_ids = (0,)

    def __init__(self) -> None:
        self.seen = 0

    def generate(self, prompts, params, seed):
        out = []
        for _ in prompts:
            good = self.seen % 4
            ids = [np.array([7 if i < good else 8, 0], dtype=np.int32) for i in range(params.n)]
            out.append([Sample(t, np.zeros(2, np.float32), "stop") for t in ids])
            self.seen += 1
        return out


class FakeVerifier:
    def score_many(self, pairs):
        return [1.0 if r == "right" else 0.0 for _, r in pairs]


def test_avg_at_k_is_the_mean_over_problems_of_the_fraction_right():
    problems = [Problem(f"p{i}", "q", "a") for i in range(8)]
    bench = Benchmark(BENCHMARKS["math500"], problems, prompts=["q"] * 8)
    res = evaluate_benchmark(bench, FakeEngine(), FakeTokenizer(), FakeVerifier(),
                             SamplingParams(n=4), batch_prompts=3)  # fmt: skip
    assert res.per_problem == [0.0, 0.25, 0.5, 0.75] * 2
    assert res.avg_at_k == pytest.approx(0.375) and res.k == 4 and res.problems == 8
    t = table({"gpqa": res, "aime24": res})
    assert t.splitlines()[0] == "| aime24 | gpqa | avg |"  # the paper's column order
    assert t.splitlines()[2] == f"| {res.avg_at_k:.3f} | {res.avg_at_k:.3f} | {res.avg_at_k:.3f} |"


def test_the_table_is_in_eval_jsons_unit_under_the_configured_names():
    """It printed percent under `Word` for `wordmath` while eval.json stores fractions: now the
    same fractions as eval.json (3 decimals), each column named as the benchmark was given."""
    problems = [Problem(f"p{i}", "q", "a") for i in range(4)]
    words = evaluate_benchmark(Benchmark(BENCHMARKS["wordmath"], problems, prompts=["q"] * 4),
                               FakeEngine(), FakeTokenizer(), FakeVerifier(),
                               SamplingParams(n=4))  # fmt: skip
    math = evaluate_benchmark(Benchmark(BENCHMARKS["math500"], problems[:2], prompts=["q"] * 2),
                              FakeEngine(), FakeTokenizer(), FakeVerifier(),
                              SamplingParams(n=4))  # fmt: skip
    head, _, row = table({"wordmath": words, "math500": math}).splitlines()
    assert head == "| math500 | wordmath | avg |"
    avg = (math.avg_at_k + words.avg_at_k) / 2
    assert row == f"| {math.avg_at_k:.3f} | {words.avg_at_k:.3f} | {avg:.3f} |"
    assert 0 < math.avg_at_k < 1 and math.avg_at_k != words.avg_at_k  # (fractions, not percent)


@pytest.mark.timeout(300)
def test_reval_eval_on_a_saved_checkpoint(tmp_path):
    (tmp_path / "bench").mkdir()
    data = sample_data(tmp_path / "bench")
    policy = load_policy(ModelConfig(device="cpu"), seed=0)
    ckpt = tmp_path / "ckpt"
    policy.model.save_pretrained(ckpt)
    policy.tokenizer.save_pretrained(ckpt)
    done = subprocess.run(
        [sys.executable, "-m", "services.cli", "eval", "--checkpoint", str(ckpt), "--benchmarks",
         "aime24,gpqa", "--data", str(data), "--no-progress", "--set",
         "eval.samples_per_prompt=3", "--set", "rollout.max_new_tokens=6",
         "--set", "rollout.verifier_workers=1"],
        cwd=ROOT, capture_output=True, text=True, timeout=280,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((ckpt / "eval.json").read_text())
    # The printed table holds eval.json's figures, under the benchmarks' names.
    scores = [report["benchmarks"][b]["avg_at_k"] for b in ("aime24", "gpqa")]
    row = " | ".join(f"{v:.3f}" for v in [*scores, report["avg"]])
    assert f"| aime24 | gpqa | avg |\n|---|---|---|\n| {row} |" in done.stdout
    assert report["k"] == 3 and report["checkpoint"] == str(ckpt)
    assert report["benchmarks"]["aime24"]["problems"] == 6
    assert report["benchmarks"]["gpqa"]["problems"] == 4
    for r in report["benchmarks"].values():
        assert 0.0 <= r["avg_at_k"] <= 1.0 and len(r["per_problem"]) == r["problems"]
    bad = subprocess.run([sys.executable, "-m", "services.cli", "eval", "--checkpoint", str(ckpt),
                          "--benchmarks", "mmlu", "--data", str(data)],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert bad.returncode == 2 and "unknown benchmark" in bad.stderr


@pytest.mark.timeout(300)
def test_eval_follows_a_run(tmp_path, redis_url, redis_prefix):
    """`reval eval --follow`: evaluates announced versions at least --every steps apart, into
    run_dir/eval.jsonl, the run's events and its trackers (a TensorBoard run of its own,
    ``tensorboard/eval``: each version's scores and a table of its answers)."""
    import redis

    from reval.control import RunControl
    from reval.metrics import read_jsonl
    from reval.weights.files import WeightStore

    (tmp_path / "bench").mkdir()
    data = sample_data(tmp_path / "bench")
    policy = load_policy(ModelConfig(device="cpu"), seed=0)
    client = redis.Redis.from_url(redis_url)
    store = WeightStore(client, redis_prefix, "ev", tmp_path / "ev" / "weights")
    announce_weights(store, policy.model.state_dict().items(), 0)
    sets = ["buffer.backend=redis", f"redis.url={redis_url}",
            f"redis.prefix={redis_prefix}", f"output_dir={tmp_path}", "name=ev",
            "eval.samples_per_prompt=2", "rollout.max_new_tokens=4",
            "rollout.verifier_workers=1", 'metrics.trackers=["tensorboard"]']  # fmt: skip
    cmd = [sys.executable, "-m", "services.cli", "eval", "--follow", "--every", "5",
           "--max-evals", "2", "--benchmarks", "aime24", "--data", str(data)]  # fmt: skip
    for s in sets:
        cmd += ["--set", s]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)  # fmt: skip
    log = tmp_path / "ev" / "eval.jsonl"
    try:
        deadline = time.monotonic() + 120
        while not (log.is_file() and read_jsonl(log)):
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            assert time.monotonic() < deadline
            time.sleep(0.2)
        announce_weights(store, policy.model.state_dict().items(), 3)  # too close to 0: skipped
        time.sleep(4)
        assert len(read_jsonl(log)) == 1
        announce_weights(store, policy.model.state_dict().items(), 5)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-2000:]
    assert json.loads(out.strip().splitlines()[-1]) == {"evaluated": [0, 5]}
    rows = read_jsonl(log)
    assert [r["policy_version"] for r in rows] == [0, 5]
    assert all(0 <= r["scores"]["aime24"] <= 1 and r["k"] == 2 for r in rows)
    events = [e for e in RunControl(client, redis_prefix, "ev").events() if e["kind"] == "eval"]
    assert [e["step"] for e in events] == [0, 5]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "ev" / "tensorboard" / "eval"),
                           size_guidance={"scalars": 0, "tensors": 0})  # fmt: skip
    acc.Reload()
    for key, want in (("eval/avg", [r["avg"] for r in rows]),
                      ("eval/aime24", [r["scores"]["aime24"] for r in rows])):  # fmt: skip
        got = acc.Scalars(key)
        assert [e.step for e in got] == [0, 5], key
        assert [e.value for e in got] == pytest.approx(want), key
    tables = acc.Tensors("eval/answers/aime24/text_summary")
    assert [t.step for t in tables] == [0, 5]
    for answers in tables:
        lines = answers.tensor_proto.string_val[0].decode().splitlines()
        assert lines[0] == "| prompt | answer | score |" and len(lines) > 2
