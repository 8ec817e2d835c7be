"""The HF engine's conformance (seeded, N samples, log-probs, in-place weights) and the tasks."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from learner.pretrain import pretrain
from reval.config import ModelConfig, TaskConfig
from reval.policy import load_policy
from rollout.engines import HFEngine, SamplingParams, top_p_filter
from rollout.math_task import MathTask
from rollout.tasks import AdditionTask, OneShotTask, build_task


@pytest.fixture(scope="module")
def policy():
    torch.manual_seed(0)
    return load_policy(ModelConfig(device="cpu"), seed=0)


@pytest.fixture
def engine(policy):
    return HFEngine(policy.model, policy.pad_id, policy.eos_id)


PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13, 14]]


def test_seeded_and_n_samples(engine):
    params = SamplingParams(n=3, max_new_tokens=6)
    a = engine.generate(PROMPTS, params, seed=4)
    b = engine.generate(PROMPTS, params, seed=4)
    c = engine.generate(PROMPTS, params, seed=5)
    assert [len(g) for g in a] == [3, 3, 3]
    flat = lambda out: [s.token_ids.tolist() for g in out for s in g]  # noqa: E731
    assert flat(a) == flat(b)
    assert flat(a) != flat(c)
    for g in a:
        for s in g:
            assert s.token_ids.size == s.logprobs.size >= 1
            if s.finish_reason == "stop":
                assert s.token_ids[-1] == engine.eos_id
                assert engine.eos_id not in s.token_ids[:-1]
            else:
                assert s.token_ids.size == 6


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_match_teacher_forced_forward(engine, policy, temperature):
    out = engine.generate(
        PROMPTS, SamplingParams(n=2, temperature=temperature, max_new_tokens=5), seed=1
    )
    with torch.no_grad():
        for prompt, group in zip(PROMPTS, out, strict=True):
            for s in group:
                ids = torch.tensor([prompt + s.token_ids.tolist()])
                logits = policy.model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
                want = (logits / temperature).log_softmax(-1)
                want = want.gather(-1, torch.tensor(s.token_ids, dtype=torch.long)[:, None])[:, 0]
                np.testing.assert_allclose(s.logprobs, want.numpy(), atol=2e-4)


def test_each_distinct_prompt_is_prefilled_once_with_the_same_answers(engine, policy, monkeypatch):
    """n answers of a prompt share its prefill (the cache copied to its rows): one forward row
    per distinct prompt, and the answers and log-probs of prefilling every row."""
    seen: list[tuple[int, ...]] = []
    hook = policy.model.register_forward_pre_hook(
        lambda _m, _a, kw: seen.append(tuple(kw["input_ids"].shape)), with_kwargs=True
    )
    params = SamplingParams(n=4, max_new_tokens=5)
    prompts = [*PROMPTS, PROMPTS[0]]
    try:
        shared = engine.generate(prompts, params, seed=3)
        assert seen[0] == (len(PROMPTS), max(map(len, PROMPTS)))  # (4 prompts, 3 distinct)
        assert all(shape[0] <= 4 * 4 for shape in seen[1:])  # decoding: the running answers
        monkeypatch.setattr(engine, "_prefill", engine._forward_prompts)
        seen.clear()
        each = engine.generate(prompts, params, seed=3)
        assert seen[0] == (4 * 4, max(map(len, PROMPTS)))
    finally:
        hook.remove()
    for a, b in zip([s for g in shared for s in g], [s for g in each for s in g], strict=True):
        assert a.token_ids.tolist() == b.token_ids.tolist() and a.finish_reason == b.finish_reason
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)


def test_load_weights_in_place_changes_outputs(policy):
    model = type(policy.model)(policy.model.config)
    model.load_state_dict(policy.model.state_dict())
    eng = HFEngine(model, policy.pad_id, policy.eos_id)
    params = SamplingParams(n=2, max_new_tokens=4)
    before = eng.generate(PROMPTS, params, seed=0)
    # zero every weight: all logits equal, so every token has log-prob -log(V)
    eng.load_weights(((n, torch.zeros_like(p)) for n, p in model.named_parameters()), version=7)
    assert eng.policy_version == 7
    after = eng.generate(PROMPTS, params, seed=0)
    v = model.config.vocab_size
    for g in after:
        for s in g:
            np.testing.assert_allclose(s.logprobs, -np.log(v), rtol=1e-5)
    assert [s.logprobs.tolist() for g in before for s in g] != [
        s.logprobs.tolist() for g in after for s in g
    ]
    with pytest.raises(KeyError, match="no tensor named"):
        eng.load_weights([("nope", torch.zeros(1))], version=8)
    with pytest.raises(ValueError, match="shape"):
        name = next(iter(dict(model.named_parameters())))
        eng.load_weights([(name, torch.zeros(1))], version=8)


def test_top_p_keeps_smallest_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = torch.isfinite(top_p_filter(logits, 0.7))
    assert kept.tolist() == [[True, True, False, False]]
    assert torch.isfinite(top_p_filter(logits, 0.1)).sum() == 1


def test_addition_task_and_verifier():
    task = AdditionTask(max_operand=9)
    assert len(task.prompts) == 100
    p = next(q for q in task.prompts if q.text == "7+8=")
    assert task.verifier.score(p, "15") == 1.0
    assert task.verifier.score(p, " 15 ") == 1.0
    assert task.verifier.score(p, "16") == 0.0
    texts = task.pretrain_texts(random.Random(0), 500)
    correct = sum(eval(t.split("=")[0]) == int(t.split("=")[1]) for t in texts)
    assert correct == 0  # answers are random and never the sum (the honest warm start)
    assert len({t.split("=")[1] for t in texts}) == 19  # every other answer of the range


@pytest.mark.parametrize("target", [0.10, 0.40, 0.68])
def test_oneshot_calibrates_base_success(target):
    torch.manual_seed(0)
    pol = load_policy(ModelConfig(device="cpu"), seed=0)
    task = OneShotTask(base_success=target, seed=0)
    pretrain(pol, task.pretrain_texts, steps=60, lr=3e-3, batch_size=64, seed=0)
    achieved = task.calibrate(pol)
    assert achieved == pytest.approx(target, abs=0.03)
    # the exact probability agrees with sampling
    eng = HFEngine(pol.model, pol.pad_id, pol.eos_id)
    ids = pol.tokenizer(task.prompts[0].text, add_special_tokens=False).input_ids
    out = eng.generate([ids], SamplingParams(n=2000, max_new_tokens=3), seed=0)[0]
    texts = [pol.tokenizer.decode(s.token_ids, skip_special_tokens=True) for s in out]
    rate = np.mean([task.verifier.score(task.prompts[0], t) for t in texts])
    assert rate == pytest.approx(achieved, abs=0.04)


def test_math_task_rows_templates_and_grading(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text(
        '{"problem": "What is 1+1?", "answer": "2"}\n'
        "not json\n"
        '{"problem": "", "answer": "3"}\n'
        '{"answer": "4"}\n'
        '{"problem": "Half of 1?", "answer": "\\\\frac{1}{2}", "solution": "..."}\n'
    )
    task = build_task(TaskConfig(kind="math", dataset=str(path), template="r1_distill"))
    assert isinstance(task, MathTask)
    assert len(task.prompts) == 2
    assert task.skipped == {"missing_field": 2, "empty_problem": 1}
    assert task.prompts[0].text.endswith("within \\boxed{}.")
    half = task.prompts[1]
    try:
        assert task.verifier.score(half, "<think>hmm</think> so \\boxed{\\dfrac{1}{2}}") == 1.0
        assert task.verifier.score(half, "hmm</think> so \\boxed{0.5}") == 1.0  # sympy
        assert task.verifier.score(half, "no think \\boxed{\\frac{1}{2}}") == 0.0  # DeepScaleR
    finally:
        task.verifier.close()
    with pytest.raises(ValueError, match=r"needs task\.dataset"):
        build_task(TaskConfig(kind="math"))


# (gold, response): the reward math-verify gives, which the boxed-string match of `reval train`
# (before one grader) did not: the same answer earned 1 from the rollout workers and 0 in train.
SAME_IN_EVERY_LOOP = [
    ("\\frac{1}{2}", "\\boxed{0.5}", 1.0),
    ("0.5", "\\boxed{\\frac{1}{2}}", 1.0),
    ("-3", "\\boxed{-3.0}", 1.0),
    ("\\frac{3}{4}", "\\boxed{\\frac{6}{8}}", 1.0),
    ("2x+1", "\\boxed{1+2x}", 1.0),
    ("7", "\\boxed{x = 7}", 1.0),
    ("7", "\\boxed{8}", 0.0),
]


def test_train_and_worker_grade_alike(tmp_path):
    """`reval train` (services/setup.py) and the rollout worker both take the task's verifier
    from ``build_task``; ``reval eval`` grades with ``MathVerify`` in a ``VerifierPool``. The same
    response earns the same reward from each."""
    from rollout.grading.math_grading import MathVerify
    from rollout.grading.pool import VerifierPool

    path = tmp_path / "data.jsonl"
    path.write_text("".join(
        json.dumps({"problem": f"p{i}", "answer": gold}) + "\n"
        for i, (gold, _, _) in enumerate(SAME_IN_EVERY_LOOP)
    ))  # fmt: skip
    task = build_task(TaskConfig(kind="math", dataset=str(path)))
    pairs = [(p, r) for p, (_, r, _) in zip(task.prompts, SAME_IN_EVERY_LOOP, strict=True)]
    expected = [want for _, _, want in SAME_IN_EVERY_LOOP]
    try:
        assert [task.verifier.score(p, r) for p, r in pairs] == expected
    finally:
        close = getattr(task.verifier, "close", None)
        if close is not None:
            close()
    with VerifierPool(MathVerify(), workers=1) as pool:  # reval eval's
        assert pool.score_many([(g, r) for g, r, _ in SAME_IN_EVERY_LOOP]) == expected


def test_task_setup_round_trip_and_refusals():
    from rollout.tasks import AdditionTask, OneShotTask, apply_task_setup, task_setup

    learner_side = OneShotTask(base_success=0.4, seed=3)
    assert task_setup(learner_side) is None  # not calibrated: nothing to share
    learner_side.verifier = type(learner_side.verifier)(["01", "02"])
    learner_side.achieved_base_success = 0.41
    setup = task_setup(learner_side)
    assert setup == {"kind": "oneshot", "accepted": ["01", "02"], "base_success": 0.41}
    worker_side = OneShotTask(base_success=0.4, seed=3)
    apply_task_setup(worker_side, setup)
    assert worker_side.verifier.accepted == {"01", "02"}
    assert worker_side.achieved_base_success == 0.41
    with pytest.raises(ValueError, match="does not fit"):
        apply_task_setup(AdditionTask(), setup)
    for bad in ([], ["100"], "01", None):
        with pytest.raises(ValueError, match="accepted codes"):
            apply_task_setup(worker_side, {"kind": "oneshot", "accepted": bad})
