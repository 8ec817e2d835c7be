"""Checkpoints on a disk that fails (issue 19): one line naming the path and the free space (it
was a torch internal, ``enforce fail at inline_container.cc``, or a bare traceback), and no
partial ``step-*`` directory left behind. A disk that fills up is simulated with RLIMIT_FSIZE
in a process of its own (writes past the limit fail with EFBIG, as on a full disk)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from learner.checkpoint import CheckpointWriteError, latest_checkpoint, save_checkpoint
from reval.config import ModelConfig
from reval.policy import load_policy

ROOT = Path(__file__).resolve().parents[2]

FULL_DISK = r"""
import json, resource, signal, sys
from pathlib import Path
import torch
from learner.checkpoint import CheckpointWriteError, save_checkpoint
from reval.config import ModelConfig
from reval.policy import load_policy

ckpt = Path(sys.argv[1])
model = load_policy(ModelConfig(device="cpu"), 0).model
ref = load_policy(ModelConfig(device="cpu"), 0).model
opt = torch.optim.AdamW(model.parameters())
save_checkpoint(ckpt, model, ref, opt, {"step": 1})  # fits
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # (a write past the limit fails with EFBIG)
resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, resource.RLIM_INFINITY))
try:
    save_checkpoint(ckpt, model, ref, opt, {"step": 2})
except CheckpointWriteError as err:
    print(json.dumps({"error": str(err)}))
"""


def _modules():
    model = load_policy(ModelConfig(device="cpu"), 0).model
    ref = load_policy(ModelConfig(device="cpu"), 0).model
    return model, ref, torch.optim.AdamW(model.parameters())


def test_a_full_disk_is_one_line_and_leaves_no_partial_checkpoint(tmp_path):
    ckpt = tmp_path / "checkpoints"
    out = subprocess.run(
        [sys.executable, "-c", FULL_DISK, str(ckpt)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    error = json.loads(out.stdout.strip().splitlines()[-1])["error"]
    assert "\n" not in error
    assert f"could not write checkpoint {ckpt / 'step-00000002'}" in error
    assert re.search(r"\d (B|KiB|MiB|GiB|TiB) free on ", error), error
    # The good checkpoint stays the latest; nothing of the failed one is left.
    assert sorted(p.name for p in ckpt.iterdir()) == ["latest", "step-00000001"]
    assert latest_checkpoint(ckpt) == ckpt / "step-00000001"


def test_an_unwritable_directory_is_the_same_one_line(tmp_path):
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    with pytest.raises(CheckpointWriteError) as err:
        save_checkpoint(blocker / "checkpoints", *_modules(), {"step": 3})
    assert "\n" not in str(err.value)
    assert str(blocker / "checkpoints" / "step-00000003") in str(err.value)
    assert f"free on {tmp_path}" in str(err.value)


def test_a_killed_saves_partial_directory_goes_at_the_next_save(tmp_path):
    ckpt = tmp_path / "checkpoints"
    (ckpt / "step-00000004.partial").mkdir(parents=True)
    (ckpt / "step-00000004.partial" / "__0_0.distcp").write_bytes(b"half")
    path = save_checkpoint(ckpt, *_modules(), {"step": 5})
    assert sorted(p.name for p in ckpt.iterdir()) == ["latest", "step-00000005"]
    assert path == latest_checkpoint(ckpt)
    # The same step saved again (a learner resumed from before it) replaces it whole.
    assert save_checkpoint(ckpt, *_modules(), {"step": 5}) == path
    assert json.loads((path / "reval_state.json").read_text())["step"] == 5
