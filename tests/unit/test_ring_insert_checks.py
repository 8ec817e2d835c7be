"""The in-process ring checks a batch at insert once over the whole batch
(``record_codec.validate_many`` with its limits): a bad record anywhere in it is named, and
nothing of the batch is written."""

from __future__ import annotations

import numpy as np
import pytest

from buffer.records import RecordError, RecordLimits
from buffer.ring import MemoryRing
from tests.conftest import make_traj

LIMITS = RecordLimits(vocab_size=50, reward_bound=10.0, max_tokens=12)


def _bad(kind: str, i: int):
    t = make_traj(i)
    if kind == "token":
        t.response_ids = np.append(t.response_ids[:-1], 50).astype(t.response_ids.dtype)
    elif kind == "reward":
        t.reward = 11.0
    elif kind == "long":
        t = make_traj(i, plen=6, rlen=7)
    elif kind == "negative":
        t.prompt_ids = np.append(t.prompt_ids[:-1], -1).astype(t.prompt_ids.dtype)
    elif kind == "logprob":
        t.logprobs = np.append(t.logprobs[:-1], np.nan).astype(np.float32)
    return t


@pytest.mark.parametrize(
    ("kind", "says"),
    [("token", "token id 50 >= the vocabulary size 50"), ("reward", "reward 11.0 outside"),
     ("long", "> the model's context length 12"), ("negative", "negative token id"),
     ("logprob", "log-probs must be finite")],
)  # fmt: skip
def test_a_bad_record_is_named_and_the_batch_not_written(kind, says):
    ring = MemoryRing(64, limits=LIMITS)
    batch = [make_traj(i) for i in range(40)]
    batch[23] = _bad(kind, 23)
    with pytest.raises(RecordError) as err:
        ring.insert(batch)
    assert f"record 23 ({batch[23].traj_id!r})" in str(err.value)
    assert says in str(err.value) and "batch not written" in str(err.value)
    assert len(ring) == 0
    ring.insert([make_traj(i) for i in range(40)])  # the good batch goes in whole
    assert len(ring) == 40


def test_without_limits_only_the_wire_rules_apply():
    ring = MemoryRing(64)
    ring.insert([_bad("token", 0), _bad("reward", 1), _bad("long", 2)])
    assert len(ring) == 3
