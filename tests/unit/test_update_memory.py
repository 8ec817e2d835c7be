"""An update that runs out of memory on its batch (issue 31's chaos faults): no optimizer step,
``UpdateMemoryError`` (which the learner service quarantines, the batch never drawn again), and
the next update runs as usual; any other error still propagates unchanged."""

from __future__ import annotations

import pytest
import torch

from learner.trainer import Learner, UpdateMemoryError, is_memory_error
from reval.config import AlgoConfig, LearnerConfig, ModelConfig
from reval.policy import load_policy
from tests.conftest import make_traj


def _batch() -> list:
    return [make_traj(i, reward=float(i % 2), plen=3, rlen=3) for i in range(4)]


def _failing_once(model: torch.nn.Module, err: BaseException) -> list[int]:
    """The model's forward raises ``err`` on its next call only; returns the call counter."""
    calls = [0]
    forward = model.forward

    def patched(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 1:
            raise err
        return forward(*args, **kwargs)

    model.forward = patched  # type: ignore[method-assign]
    return calls


@pytest.mark.parametrize(
    "err",
    [torch.OutOfMemoryError("CUDA out of memory"), RuntimeError("DefaultCPUAllocator: "
     "can't allocate memory: you tried to allocate 9 GB"), MemoryError()],
    ids=["cuda", "cpu-allocator", "memoryerror"],
)  # fmt: skip
def test_an_update_out_of_memory_steps_nothing_and_the_next_runs(err):
    policy = load_policy(ModelConfig(device="cpu"), seed=0)
    cfg = LearnerConfig(lr=1e-2, micro_batch_size=2)
    learner = Learner(policy.model, cfg, AlgoConfig(name="reval"), 0, 1, torch.device("cpu"))
    before = {k: v.detach().clone() for k, v in policy.model.state_dict().items()}
    _failing_once(policy.model, err)
    with pytest.raises(UpdateMemoryError, match="ran out of memory"):
        learner.update(_batch())
    assert learner.step == 0
    assert all(p.grad is None for p in policy.model.parameters())
    after = policy.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # no step taken
    learner.update(_batch())  # the next batch trains
    assert learner.step == 1
    assert any(not torch.equal(before[k], after[k]) for k in before)


def test_other_errors_are_not_memory_errors():
    policy = load_policy(ModelConfig(device="cpu"), seed=0)
    learner = Learner(policy.model, LearnerConfig(micro_batch_size=2), AlgoConfig(name="reval"),
                      0, 1, torch.device("cpu"))  # fmt: skip
    _failing_once(policy.model, RuntimeError("shape mismatch"))
    with pytest.raises(RuntimeError, match="shape mismatch"):
        learner.update(_batch())
    assert not is_memory_error(ValueError("out of memory"))  # only RuntimeErrors say so
    assert is_memory_error(RuntimeError("CUDA error: out of memory"))
