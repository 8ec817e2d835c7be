"""benchmarks/race_bench.py's pieces that need no service: the cost model's arithmetic, the
calibration from a ``reval train`` log, the time-to-threshold extraction from the one-process and
the service logs, the censored median, and the generate wrapper it installs in every process."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def race() -> ModuleType:
    """benchmarks/race_bench.py as a module (benchmarks/ is not a package)."""
    spec = importlib.util.spec_from_file_location(
        "race_bench", ROOT / "benchmarks" / "race_bench.py"
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["race_bench"] = mod  # (its dataclasses look their module up there)
    spec.loader.exec_module(mod)
    return mod


def test_delay_makes_generation_the_share_of_a_synchronous_round(race: ModuleType) -> None:
    # updates 0.3 s, generation 0.1 s, 1000 tokens: at 70% generation must cost 0.7 s, so
    # 0.6 s of delay over 1000 tokens.
    assert race.delay_per_token(0.3, 0.1, 1000, 0.7) == pytest.approx(0.6e-3)
    update_s, gen_s, tokens = 0.5, 0.05, 1200
    delay = race.delay_per_token(update_s, gen_s, tokens, 0.8) * tokens
    assert (gen_s + delay) / (gen_s + delay + update_s) == pytest.approx(0.8)
    assert race.delay_per_token(0.3, 5.0, 1000, 0.7) == 0.0  # generation already dearer
    assert race.delay_per_token(0.3, 0.0, 1000, 0.0) == 0.0
    with pytest.raises(ValueError):
        race.delay_per_token(0.3, 0.1, 1000, 1.0)
    with pytest.raises(ValueError):
        race.delay_per_token(0.3, 0.1, 0, 0.7)


def test_calibration_takes_medians_after_the_warm_up(race: ModuleType) -> None:
    warm = [{"round": i, "gen_s": 9.0, "round_s": 99.0, "tokens": 1} for i in (1, 2)]
    steady = [{"round": 3 + i, "gen_s": g, "round_s": g + u, "tokens": t}
              for i, (g, u, t) in enumerate([(0.1, 0.5, 1000), (0.2, 0.7, 1100),
                                             (0.3, 0.6, 1200)])]  # fmt: skip
    rows = [{"round": 0, "eval_success": 0.1}, *warm, *steady]
    cal = race.calibrate(rows, 0.7)
    assert cal.gen_s == pytest.approx(0.2)
    assert cal.update_s == pytest.approx(0.6)
    assert cal.tokens == 1100
    assert cal.token_s == pytest.approx((0.7 / 0.3 * 0.6 - 0.2) / 1100)
    with pytest.raises(ValueError):
        race.calibrate([{"round": 0, "eval_success": 0.1}])


def test_sync_log_reaches_the_threshold_over_a_window_of_rounds(race: ModuleType) -> None:
    rows = [{"round": 0, "eval_success": 0.05, "_t": 1.0}]
    rows += [{"round": r, "reward_mean": s, "_t": 10.0 + r}
             for r, s in enumerate([0.1, 0.5, 0.1, 0.3, 0.35], start=1)]  # fmt: skip
    one = race.sync_points(rows, 512, window=512)  # one round per window
    assert race.first_reaching(one, 0.3).samples == 2 * 512
    two = race.sync_points(rows, 256, window=512)  # two rounds of 256 per window
    assert [p.success for p in two] == pytest.approx([0.1, 0.3, 0.3, 0.2, 0.325])
    hit = race.first_reaching(two, 0.31)
    assert (hit.samples, hit.seconds) == (5 * 256, 15.0)
    assert race.first_reaching(two, 0.4) is None


def test_service_log_counts_only_fresh_batches(race: ModuleType) -> None:
    rows = [
        {"fresh": 1, "batch_size": 256, "batch_success_rate": 0.2, "buffer_inserted": 512, "_t": 5},
        {"fresh": 0, "batch_size": 256, "batch_success_rate": 0.9, "buffer_inserted": 512, "_t": 6},
        {
            "fresh": 1,
            "batch_size": 256,
            "batch_success_rate": 0.3,
            "buffer_inserted": 1024,
            "_t": 7,
        },
        {
            "fresh": 1,
            "batch_size": 256,
            "batch_success_rate": 0.5,
            "buffer_inserted": 1536,
            "_t": 9,
        },
    ]
    points = race.service_points(rows, window=512)
    assert [p.success for p in points] == pytest.approx([0.2, 0.25, 0.4])
    hit = race.first_reaching(points, 0.3)
    assert (hit.seconds, hit.samples) == (9, 1536)  # the replayed 0.9 never counted
    on_policy = [{k: v for k, v in r.items() if k != "fresh"} for r in rows]
    hit = race.first_reaching(race.service_points(on_policy, window=512), 0.5)  # (0.2 + 0.9) / 2
    assert (hit.seconds, hit.samples) == (6, 512)


def test_censored_median_counts_unreached_runs_as_slowest(race: ModuleType) -> None:
    med = race.censored_median
    assert med([100.0, None, 300.0]) == 300.0
    assert med([100.0, 200.0, 300.0]) == 200.0
    assert med([None, 100.0, None]) is None
    assert med([50.0]) == 50.0
    assert med([]) is None


def test_generate_sleeps_per_token_and_logs_the_charge(race: ModuleType, tmp_path: Path) -> None:
    """The wrapper is installed when ``rollout.engines`` is imported; a call then sleeps
    ``REVAL_RACE_TOKEN_S`` per generated token and logs the tokens and the delay."""
    (tmp_path / "sitecustomize.py").write_text(race.SITECUSTOMIZE)
    log = tmp_path / "charges.log"
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import time, numpy as np\n"
        "import rollout.engines as e\n"
        "import sitecustomize\n"
        "name = e.HFEngine.generate.__name__\n"
        "assert name == 'generate_at_gpu_cost', name\n"
        "def fake(self, prompts, params, seed):  # (no model: 5 tokens per answer)\n"
        "    return [[e.Sample(np.zeros(5, np.int32), np.zeros(5, np.float32), 'stop')]\n"
        "            * params.n for _ in prompts]\n"
        "e.HFEngine.generate = fake\n"
        "sitecustomize._patch(e.HFEngine)\n"
        "t = time.perf_counter()\n"
        "out = e.HFEngine.generate(None, [[1], [2]], e.SamplingParams(n=3), 0)\n"
        "print(len(out), time.perf_counter() - t)\n"
    )
    env = {"PYTHONPATH": f"{tmp_path}:{ROOT}", "REVAL_RACE_TOKEN_S": "0.02",
           "REVAL_RACE_LOG": str(log), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}  # fmt: skip
    done = subprocess.run([sys.executable, str(probe)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    groups, seconds = done.stdout.split()
    assert int(groups) == 2 and float(seconds) >= 0.6  # 2 prompts x 3 answers x 5 tokens x 0.02
    _pid, tokens, _spent, delay = log.read_text().split()
    assert (int(tokens), float(delay)) == (30, pytest.approx(0.6))
