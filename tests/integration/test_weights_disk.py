"""Weights on a disk that fails (issue 26, its full-disk point): the learner's publish of a
version whose file cannot be written logs one line naming the file and the free space (it was a
raw ``SafetensorError`` traceback that ended the learner), leaves no partial file, announces
nothing and broadcasts nothing (the workers keep the last version, all transports alike), and
the next version publishes as usual. A full disk is simulated with RLIMIT_FSIZE in a process of
its own (writes past the limit fail with EFBIG, as on a full disk)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

FULL_DISK = r"""
import json, logging, resource, signal, sys
import redis, torch
from reval.weight_sync import WeightPublisher, WeightStore

url, prefix, directory = sys.argv[1:4]
logging.basicConfig(level=logging.ERROR, format="%(message)s")
store = WeightStore(redis.Redis.from_url(url), prefix, "wd", directory)
publisher = WeightPublisher(store)
weights = [("w", torch.randn(64, 1024)), ("b", torch.zeros(8))]  # 256 KiB
first = publisher.publish(weights, 1)
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # (a write past the limit fails with EFBIG)
resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, resource.RLIM_INFINITY))
failed = publisher.publish(weights, 2)
resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
after = store.latest()
again = publisher.publish(weights, 3)
print(json.dumps({"first": str(first.path), "failed": failed.path, "receivers": failed.receivers,
                  "announced_after_failure": after.version, "again": str(again.path),
                  "announced": store.latest().version}))
"""


def test_a_full_disk_is_one_line_and_the_next_version_publishes(tmp_path, redis_url, redis_prefix):
    directory = tmp_path / "weights"
    out = subprocess.run(
        [sys.executable, "-c", FULL_DISK, redis_url, redis_prefix, str(directory)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["failed"] is None and got["receivers"] == 0
    assert got["announced_after_failure"] == 1  # the last version stays announced
    assert got["again"] == str(directory / "v00000003.safetensors") and got["announced"] == 3
    errors = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(errors) == 1, out.stderr  # one line, no traceback
    assert errors[0].startswith(f"could not write weights {directory / 'v00000002.safetensors'}")
    assert "GiB free on" in errors[0] and "version 2 not published" in errors[0]
    assert sorted(p.name for p in directory.iterdir()) == [
        "v00000001.safetensors", "v00000003.safetensors"
    ]  # no partial file of version 2  # fmt: skip
