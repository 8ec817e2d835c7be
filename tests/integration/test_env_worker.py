"""A rollout worker with ``task.environment`` against the real Redis (issue 28): it plays
multi-turn episodes, pushes records whose action mask marks the environment's tokens (and
which decode from the ring with it), and counts the episodes a misbehaving environment loses
(``reval_rollout_episodes_skipped_total``) without stopping."""

from __future__ import annotations

from pathlib import Path

from reval.policy import build_char_tokenizer
from rollout.worker import RolloutWorker
from tests.integration.test_rollout_worker import publish, ring_of, worker_cfg

ENV = """
from rollout.environment import Step


class Hinting:
    made = 0

    def __init__(self):
        type(self).made += 1
        self.broken = type(self).made % 4 == 0  # every fourth episode's environment misbehaves

    def start(self, prompt):
        self.turns = 0

    def step(self, message):
        if self.broken:
            return "not a step"
        self.turns += 1
        return Step("<hint>", 0.5, self.turns >= 2)
"""


def test_a_worker_plays_episodes_and_counts_the_skipped(tmp_path: Path, redis_url, redis_prefix):
    env = tmp_path / "hinting.py"
    env.write_text(ENV)
    cfg = worker_cfg(
        tmp_path, redis_url, redis_prefix,
        f"task.environment={env}:Hinting", "task.max_turns=3", "task.max_episode_tokens=40",
        "rollout.worker_prompts=4",
        # The random model's turns run to rollout.max_new_tokens; an episode whose last turn
        # was cut earns 0 by default (algo.truncated_reward): here the environment's rewards
        # are what is checked, so they stand as it gave them.
        "algo.truncated_reward=graded",
    )  # fmt: skip
    publish(cfg, 0)
    worker = RolloutWorker(cfg, "wenv")
    stats = worker.run(max_batches=1)
    skipped = worker.metrics.registry.get_sample_value(
        "reval_rollout_episodes_skipped_total", {"reason": "bad_step"}
    )
    assert skipped == 4  # 16 episodes (4 prompts x n=4), every fourth broken
    assert stats.trajectories == 12
    hint = build_char_tokenizer()("<hint>", add_special_tokens=False).input_ids
    held = ring_of(cfg).items()
    assert len(held) == 12
    for t in held:
        assert t.reward_raw == 1.0  # two steps of 0.5
        mask = t.action_mask.tolist()
        env_runs = [t.response_ids[i : i + len(hint)].tolist() for i in range(len(mask))
                    if mask[i] == 0 and (i == 0 or mask[i - 1] == 1)]  # fmt: skip
        assert env_runs == [hint] and mask.count(0) == len(hint)
