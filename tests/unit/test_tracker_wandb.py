"""The ``wandb`` tracker (reval/tracker_wandb.py, issue 42), offline (no network): a ``reval
train`` run's W&B files, read back record by record, hold the rows of ``metrics.jsonl`` at their
policy versions and the resolved config; a resumed run continues the same W&B run (same id) and
its rows follow; the API key from the environment is written nowhere in the run directory."""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path

import pytest
from wandb.proto import wandb_internal_pb2

from reval.config import load_config
from reval.metrics import read_jsonl
from services.train import train
from tests.unit.test_trackers import TINY, expected_series

KEY = "0123456789abcdef0123456789abcdef01234567"  # (a made-up key: offline, never sent)

# The .wandb file (wandb-core's transaction log, LevelDB's log format): a 7-byte header
# (":W&B", magic 0xBEE1, version), then 32 KiB blocks of records, each a 7-byte header (crc32,
# length, type: 1 full, 2 first, 3 middle, 4 last) and its bytes; a block's tail shorter than
# a header is zero padding. The records are wandb_internal_pb2.Record messages.
BLOCK = 32768
HEADER = struct.Struct("<4sHB")
RECORD = struct.Struct("<IHB")


def wandb_records(path: Path) -> list[wandb_internal_pb2.Record]:
    data = path.read_bytes()
    ident, magic, _version = HEADER.unpack_from(data, 0)
    assert (ident, magic) == (b":W&B", 0xBEE1)
    out, pos, parts = [], HEADER.size, b""
    while pos + RECORD.size <= len(data):
        if BLOCK - pos % BLOCK < RECORD.size:  # (the block's zero padding)
            pos += BLOCK - pos % BLOCK
            continue
        crc, length, kind = RECORD.unpack_from(data, pos)
        if kind == 0 and length == 0:
            break
        chunk = data[pos + RECORD.size : pos + RECORD.size + length]
        assert zlib.crc32(bytes([kind]) + chunk) & 0xFFFFFFFF == crc
        pos += RECORD.size + length
        parts = chunk if kind in (1, 2) else parts + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(parts)
            out.append(record)
    return out


def read_run(run_file: Path) -> tuple[str, dict, dict[str, list[tuple[int, float]]]]:
    """A W&B run file's id, config (the last value of each key) and series (key: steps and
    values, in order)."""
    run_id, config, series = "", {}, {}
    media: set[str] = set()
    for record in wandb_records(run_file):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run_id = record.run.run_id
            for item in record.run.config.update:
                config[item.key] = json.loads(item.value_json)
        elif kind == "config":
            for item in record.config.update:
                config[item.key] = json.loads(item.value_json)
        elif kind == "history":
            step = record.history.step.num
            for item in record.history.item:
                key = item.key or "/".join(item.nested_key)
                value = json.loads(item.value_json)
                if key.endswith("/_type"):  # (a table or an image: W&B's fields under its key)
                    media.add(key.removesuffix("/_type"))
                elif not key.startswith("_"):  # (W&B's own: _step, _runtime, _timestamp)
                    series.setdefault(key, []).append((step, value))
    series = {k: v for k, v in series.items() if not any(k.startswith(f"{m}/") for m in media)}
    return run_id, config, series


def read_media(run_file: Path) -> tuple[dict[str, list[tuple[int, dict]]], dict]:
    """A W&B run file's media (key: steps and W&B's fields of the table or image, which W&B
    logs as ``KEY/_type``, ``KEY/path``...) and its summary (the last value of each key)."""
    media: dict[str, list[tuple[int, dict]]] = {}
    summary: dict = {}
    for record in wandb_records(run_file):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            fields = {(item.key or "/".join(item.nested_key)): json.loads(item.value_json)
                      for item in record.history.item}  # fmt: skip
            for key in [k.removesuffix("/_type") for k in fields if k.endswith("/_type")]:
                got = {k[len(key) + 1 :]: v for k, v in fields.items() if k.startswith(f"{key}/")}
                media.setdefault(key, []).append((record.history.step.num, got))
        elif kind == "summary":
            for item in record.summary.update:
                summary[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    return media, summary


def _expected(rows):
    want = expected_series(rows)
    return want


@pytest.fixture
def offline(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_API_KEY", KEY)
    monkeypatch.setenv("WANDB_SILENT", "true")
    for name in ("WANDB_PROJECT", "WANDB_ENTITY", "WANDB_RUN_ID", "WANDB_RESUME", "WANDB_DIR"):
        monkeypatch.delenv(name, raising=False)


def test_a_resumed_run_continues_the_same_wandb_run(tmp_path, offline):
    overrides = [
        *TINY,
        f"output_dir={tmp_path}",
        'metrics.trackers=["wandb"]',
        "metrics.wandb.project=reval-test",
        'metrics.wandb.tags=["ci", "tiny"]',
    ]
    first = load_config(overrides=[*overrides, "learner.rounds=2"], environ={})
    train(first)
    run_dir = first.run_dir
    kept = json.loads((run_dir / "trackers.json").read_text())
    (run_dir / "summary.json").unlink()  # (a stopped run: resumable)
    cfg = load_config(overrides=[*overrides, "learner.rounds=4"], environ={})
    train(cfg, resume=True)
    assert json.loads((run_dir / "trackers.json").read_text()) == kept

    files = sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(files) == 2, files  # (one per process; the same W&B run)
    runs = [read_run(f) for f in files]
    assert [r[0] for r in runs] == [kept["wandb"]] * 2
    rows = read_jsonl(cfg.paths.metrics)
    assert [r["round"] for r in rows] == [0, 1, 2, 3, 4]
    series: dict[str, list[tuple[int, float]]] = {}
    for _, _, part in runs:
        for key, points in part.items():
            series.setdefault(key, []).extend(points)
    want = _expected(rows)
    assert {"loss", "reward_mean", "eval_success", "policy_version"} <= set(want)
    assert series == want
    assert [s for s, _ in series["policy_version"]] == [0, 2, 4, 6, 8]
    assert min(s for s, _ in runs[1][2]["policy_version"]) == 6  # (the second process's rows)

    # The resolved config: the first run's, then the resumed one's (more rounds).
    assert runs[0][1]["learner"]["rounds"] == 2 and runs[1][1]["learner"]["rounds"] == 4
    assert runs[1][1]["metrics"]["wandb"]["tags"] == ["ci", "tiny"]
    assert "git_revision" in runs[1][1]
    # The key is in no file of the run directory.
    for path in run_dir.rglob("*"):
        if path.is_file():
            assert KEY.encode() not in path.read_bytes(), path


def test_a_fresh_start_begins_a_new_wandb_run(tmp_path, offline):
    overrides = [*TINY, f"output_dir={tmp_path}", 'metrics.trackers=["wandb"]',
                 "learner.rounds=1"]  # fmt: skip
    cfg = load_config(overrides=overrides, environ={})
    train(cfg)
    before = json.loads((cfg.run_dir / "trackers.json").read_text())["wandb"]
    train(cfg)  # (finished: a plain rerun starts over)
    after = json.loads((cfg.run_dir / "trackers.json").read_text())["wandb"]
    assert before != after


def test_tables_the_curve_and_the_summary_reach_the_wandb_run(tmp_path, offline):
    """``log_table`` (a ``wandb.Table`` at its step, its rows in the run's files),
    ``log_image`` (the PNG's bytes among them) and ``log_summary`` (the run's summary)."""
    from reval.tracker_common import RunIds
    from reval.tracker_wandb import WandbTracker
    from reval.trackers import Table

    cfg = load_config(overrides=[f"output_dir={tmp_path}", "name=media",
                                 "metrics.wandb.project=reval-test"], environ={})  # fmt: skip
    png = tmp_path / "curve.png"
    _write_png(png)
    tracker = WandbTracker(cfg, cfg.run_dir, RunIds(cfg.run_dir, False))
    answers = Table(("prompt", "answer", "score"), (("2+2=", "4 <b>|", 1.0), ("3+4=", "8", 0.0)))
    tracker.log_row(4, {"loss": 1.5})
    tracker.log_table("eval/answers", 4, answers)
    tracker.log_image("curve", png)
    tracker.log_summary({"final_success": 0.75, "rounds": 3, "warnings": []})
    tracker.close()
    (run_file,) = cfg.run_dir.glob("wandb/offline-run-*/run-*.wandb")
    media, summary = read_media(run_file)
    ((step, table),) = media["eval/answers"]
    assert step == 4 and table["_type"] == "table-file"
    files = run_file.parent / "files"
    logged = json.loads((files / table["path"]).read_text())
    assert logged["columns"] == list(answers.columns)
    assert logged["data"] == [list(r) for r in answers.rows]
    ((_, image),) = media["curve"]
    assert image["_type"] == "image-file"
    assert (files / image["path"]).read_bytes() == png.read_bytes()
    assert summary["final_success"] == 0.75 and summary["rounds"] == 3


def _write_png(path: Path) -> None:
    """A 2x1 RGB PNG, by hand."""
    import zlib as z

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(
            ">I", z.crc32(kind + data) & 0xFFFFFFFF)  # fmt: skip

    raw = b"\x00" + b"\xff\x00\x00" + b"\x00\xff\x00"
    path.write_bytes(
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", struct.pack(">IIBBBBB", 2, 1, 8, 2, 0, 0, 0))
        + chunk(b"IDAT", z.compress(raw))
        + chunk(b"IEND", b"")
    )
