"""Weights on a disk that fails: the learner's background file write of a version that cannot be
written logs one line naming the file and the free space (it was a raw ``SafetensorError``
traceback that ended the learner), leaves no partial file and announces no file; the version
itself is announced and broadcast all the same (the run goes on broadcasting), and the next
version's file is written as usual. A full disk is simulated with RLIMIT_FSIZE in a process of
its own (writes past the limit fail with EFBIG, as on a full disk)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

FULL_DISK = r"""
import json, logging, resource, signal, sys, time
import redis, torch
from reval.weights.files import WeightStore
from reval.weights.sender import WeightSender
from reval.weights.collective import BroadcastHub
from reval.weights.receiver import LocalReceiver

url, prefix, directory = sys.argv[1:4]
logging.basicConfig(level=logging.ERROR, format="%(message)s")
store = WeightStore(redis.Redis.from_url(url), prefix, "wd", directory)
hub = BroadcastHub(0, timeout_s=20, bucket_bytes=64 << 10)
sender = WeightSender(0, torch.float32, "cpu", 64 << 10, store, hub)
got = []
member = LocalReceiver(lambda tensors, version: got.append(version), "cpu")
member.join(sender.address, "m", 20.0)
while int(hub.store.add("tickets", 0)) < 1:
    time.sleep(0.01)
model = torch.nn.Linear(1024, 64)  # 256 KiB
first = sender.send(model, 1); sender.files.wait()
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # (a write past the limit fails with EFBIG)
resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, resource.RLIM_INFINITY))
failed = sender.send(model, 2); sender.files.wait()
resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
after = store.latest()
deadline = time.monotonic() + 20
while member.take(None) != 2 and time.monotonic() < deadline:
    time.sleep(0.01)
again = sender.send(model, 3); sender.files.wait()
print(json.dumps({"receivers": failed.receivers, "announced": after.version,
                  "file_after_failure": after.file_version, "member_got": got,
                  "file_again": store.latest().file_version, "path": str(store.latest().path)}))
member.leave()
"""


def test_a_full_disk_is_one_line_and_the_broadcast_goes_on(tmp_path, redis_url, redis_prefix):
    directory = tmp_path / "weights"
    out = subprocess.run(
        [sys.executable, "-c", FULL_DISK, redis_url, redis_prefix, str(directory)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["receivers"] == 1 and 2 in got["member_got"]  # broadcast all the same
    assert got["announced"] == 2 and got["file_after_failure"] == 1  # the file stays v1's
    assert got["file_again"] == 3 and got["path"] == str(directory / "v00000003.safetensors")
    errors = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(errors) == 1, out.stderr  # one line, no traceback
    assert errors[0].startswith(f"could not write weights {directory / 'v00000002.safetensors'}")
    assert " free on " in errors[0] and "keep v1, the broadcast goes on" in errors[0]
    assert sorted(p.name for p in directory.iterdir()) == [
        "v00000001.safetensors", "v00000003.safetensors"
    ]  # no partial file of version 2  # fmt: skip
