"""`reval train` end to end in one process: learning, determinism, artifacts, metrics, CLI."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from reval.config import load_config
from reval.metrics import read_jsonl
from services.train import train

ONESHOT = [
    "task.kind=oneshot",
    "task.oneshot_base_success=0.4",
    "model.pretrain_steps=60",
    "rollout.prompts_per_round=4",
    "rollout.n=8",
    "rollout.max_new_tokens=3",
    "rollout.temperature=1.0",  # the one-shot study's (configs/oneshot.toml), not the demo's 1.3
    "buffer.capacity=256",
    "learner.batch_size=32",
    "learner.updates_per_round=2",
    "learner.rounds=15",
    "learner.lr=3e-3",
    "learner.ref_reset_steps=5",
    "algo.beta=0.2",
    "eval.every=5",
    "eval.samples_per_prompt=64",
    "metrics.progress=false",
]


def cfg_for(tmp_path: Path, *extra: str, name: str = "t"):
    return load_config(
        overrides=[*ONESHOT, f"output_dir={tmp_path}", f"name={name}", *extra], environ={}
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def strip_timing(rows):
    return [{k: v for k, v in r.items() if not k.endswith("_s")} for r in rows]


def test_reval_learns_oneshot_and_writes_artifacts(tmp_path):
    port = free_port()
    cfg = cfg_for(tmp_path, f"metrics.prometheus_port={port}")
    res = train(cfg)
    assert res.history[0]["oneshot_base_success"] == pytest.approx(0.4, abs=0.03)
    assert res.initial_success < 0.6
    assert res.final_success > res.initial_success + 0.3, res.history
    run = res.run_dir
    rows = read_jsonl(run / "metrics.jsonl")
    assert [r["round"] for r in rows] == list(range(16))
    assert rows[-1]["policy_version"] == 30  # K=2 updates per round
    assert rows[-1]["ref_version"] == 3  # reset every 5 rounds
    assert rows[-1]["use_count_mean"] > 1.0  # trajectories are reused
    assert rows[-1]["buffer_reuse"] == pytest.approx(cfg.samples_per_insert)  # K as configured
    assert (run / "curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((run / "config.json").read_text())["learner"]["rounds"] == 15
    model = AutoModelForCausalLM.from_pretrained(run / "final")
    tok = AutoTokenizer.from_pretrained(run / "final")
    assert model.config.vocab_size == len(tok)
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    assert "reval_train_round 15.0" in body
    assert f"reval_buffer_samples_per_insert {cfg.samples_per_insert}" in body
    assert "reval_learner_updates_total 30.0" in body


def test_same_seed_same_curve(tmp_path):
    a = train(cfg_for(tmp_path, "learner.rounds=4", "metrics.plot=false", name="a"))
    b = train(cfg_for(tmp_path, "learner.rounds=4", "metrics.plot=false", name="b"))
    c = train(cfg_for(tmp_path, "learner.rounds=4", "metrics.plot=false", "seed=1", name="c"))
    assert strip_timing(a.history) == strip_timing(b.history)
    assert strip_timing(a.history) != strip_timing(c.history)


@pytest.mark.parametrize("algo", ["grpo", "tbrm"])
def test_baselines_run_through_the_same_loop(tmp_path, algo):
    # GRPO at lr 1e-3: at the file's 3e-3 its one update a round took seeds 1 and 2 from 0.44 and
    # 0.39 to 0.0 in 6 rounds (seed 0 alone learnt, and only until the sampler's draws changed);
    # at 1e-3 seeds 0-2 learn (+0.10 to +0.14)
    extra = (
        ["algo.name=grpo", "learner.updates_per_round=1", "learner.lr=1e-3"]
        if algo == "grpo"
        else ["algo.name=tbrm"]
    )
    res = train(cfg_for(tmp_path, *extra, "learner.rounds=6", "metrics.plot=false", name=algo))
    assert len(res.history) == 7
    assert all(r.get("loss") is not None for r in res.history[1:])
    if algo == "grpo":
        assert res.history[-1]["policy_version"] == 6
        assert res.final_success > res.initial_success


def test_grpo_rounds_of_two_updates_clip_against_the_generating_policy(tmp_path):
    """A round of 32 trajectories in batches of 16: the second update's PPO ratio is taken
    against the policy that generated the round (it moved in the first), so it is not 1."""
    res = train(cfg_for(tmp_path, "algo.name=grpo", "learner.updates_per_round=1", "algo.tis_cap=0",
                        "learner.batch_size=16",
                        "learner.rounds=3", "metrics.plot=false", name="grpo2"))  # fmt: skip
    rounds = res.history[1:]
    assert [r["updates"] for r in rounds] == [2, 2, 2]
    assert res.history[-1]["policy_version"] == 6
    # each round's record is the mean of its two updates: (1 + ratio of the second) / 2
    assert all(abs(r["ratio_mean"] - 1.0) > 1e-6 for r in rounds), rounds
    assert all(r["ppo_kl"] != 0.0 for r in rounds)


def run_cli(*args: str, cwd: Path):
    return subprocess.run(
        [sys.executable, "-m", "services.cli", *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    )


def test_cli_rejects_bad_config_naming_the_field(tmp_path):
    out = run_cli("train", "--set", "learner.lrr=1", cwd=tmp_path)
    assert out.returncode == 2
    assert "learner.lrr" in out.stderr
    out = run_cli("train", "--config", str(tmp_path / "nope.toml"), cwd=tmp_path)
    assert out.returncode == 2 and "not found" in out.stderr
    assert not (tmp_path / "runs").exists()  # nothing started


def test_cli_trains_with_algo_flag(tmp_path):
    sets = [
        x
        for o in [*ONESHOT, "learner.rounds=3", f"output_dir={tmp_path}", "name=cli"]
        if not o.startswith("learner.updates_per_round")
        for x in ("--set", o)
    ]
    out = run_cli("train", "--algo", "grpo", "--no-progress", *sets, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "success rate" in out.stdout
    saved = json.loads((tmp_path / "cli" / "config.json").read_text())
    assert saved["algo"]["name"] == "grpo" and saved["learner"]["updates_per_round"] == 1
    assert len(read_jsonl(tmp_path / "cli" / "metrics.jsonl")) == 4


def test_all_updates_from_the_buffer_and_reload_through_load_policy(tmp_path):
    """§4.3's schedule (every update samples the buffer), then the checkpoint loads back through
    the real-checkpoint path of the policy factory with identical outputs."""
    import torch

    from learner.checkpoint import load_checkpoint
    from learner.trainer import Learner
    from reval.config import ModelConfig
    from reval.policy import load_policy
    from services.setup import build_policy_and_task

    res = train(
        cfg_for(
            tmp_path, "learner.first_update_fresh=false", "learner.rounds=4", "metrics.plot=false"
        )
    )
    assert res.history[-1]["policy_version"] == 8
    assert res.history[-1]["use_count_mean"] > 0
    loaded = load_policy(ModelConfig(name_or_path=str(res.checkpoint), device="cpu"))
    assert loaded.tokenizer.padding_side == "left"
    ids = loaded.tokenizer("code:", add_special_tokens=False, return_tensors="pt").input_ids
    # the checkpoint holds the trained weights, not those of a fresh build of the same run
    fresh, _, _ = build_policy_and_task(cfg_for(tmp_path, name="fresh"))
    with torch.no_grad():
        a = loaded.model(input_ids=ids).logits
        b = fresh.model(input_ids=ids).logits
    assert not torch.allclose(a, b)
    # The learner's checkpoint (DCP, the ranks' format) restores the trained policy too.
    cfg = cfg_for(tmp_path, name="fresh")
    learner = Learner(fresh.model, cfg.learner, cfg.algo, fresh.pad_id, fresh.eos_id, fresh.device)
    ckpts = tmp_path / "t" / "checkpoints"
    path, meta = load_checkpoint(ckpts, learner.model, learner.reference.model, learner.optimizer)
    assert path.name == "step-00000008" and meta["step"] == 8 and meta["round"] == 4
    with torch.no_grad():
        c = fresh.model(input_ids=ids).logits
    torch.testing.assert_close(c, a)


def test_training_through_the_redis_buffer(tmp_path, redis_url, redis_prefix):
    import redis

    from reval.redis import ring_keys

    extra = ["buffer.backend=redis", f"redis.url={redis_url}"]
    extra.append(f"redis.prefix={redis_prefix}")
    res = train(cfg_for(tmp_path, *extra, "metrics.plot=false", name="rd"))
    assert res.final_success > res.initial_success + 0.3, res.history
    client = redis.Redis.from_url(redis_url)
    meta = ring_keys(redis_prefix, "rd").meta
    assert int(client.hget(meta, "head")) == 15 * 32  # every trajectory went through Redis
    assert int(client.hget(meta, "version")) == res.history[-1]["policy_version"] - 1
    assert int(client.hget(meta, "sampled")) == 2 * 15 * 32  # fresh, then sampled: K = 2
    # A second run of the same name starts from an empty buffer.
    train(cfg_for(tmp_path, *extra, "learner.rounds=1", "metrics.plot=false", name="rd"))
    assert int(client.hget(meta, "head")) == 32


def test_prioritized_replay_updates_priorities(tmp_path, redis_url, redis_prefix):
    """Wiring only: with a tiny model and lr 3e-3, prioritized replay learns on some seeds and
    diverges on others (docs/buffer.md), so no learning claim here."""
    import redis

    from reval.redis import ring_keys

    extra = ["buffer.backend=redis", f"redis.url={redis_url}"]
    extra += [f"redis.prefix={redis_prefix}", "buffer.prioritized=true"]
    res = train(cfg_for(tmp_path, *extra, "learner.rounds=3", "metrics.plot=false", name="pr"))
    assert all(r["updates"] == 2 for r in res.history[1:])
    client = redis.Redis.from_url(redis_url)
    meta, tree = ring_keys(redis_prefix, "pr").meta, ring_keys(redis_prefix, "pr").tree
    leaves = int(client.hget(meta, "leaves"))
    prios = [float(v) for k, v in client.hgetall(tree).items() if int(k) >= leaves]
    assert len(prios) == 96 and len(set(prios)) > 50  # set from each trajectory's |delta|
    assert float(client.hget(meta, "maxp")) > 0


def test_rate_limiter_skips_updates_in_one_process(tmp_path):
    rows = train(
        cfg_for(
            tmp_path,
            "buffer.samples_per_insert=0.5",
            "learner.first_update_fresh=false",
            "learner.rounds=4",
            "metrics.plot=false",
            name="rl",
        )
    ).history
    # 32 inserted per round allow 16 sampled per round on average: one update of 32 every
    # second round.
    assert [r["updates"] for r in rows[1:]] == [0, 1, 0, 1]
    assert rows[-1]["policy_version"] == 2
