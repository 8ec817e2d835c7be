"""A worker's spool directory (``buffer/redis_producer.py``) under faults, with no Redis at all
(the producer's Redis is a closed port, so every send fails at once): the claims of a producer
that was killed are taken back, a file that cannot be read or holds no spool chunk is one line
and set aside (never a crash of the worker at its start), and a full disk at ``close`` is one
line with the count of records lost, not a traceback."""

from __future__ import annotations

import errno
import logging
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import msgpack
import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from buffer.record_codec import encode_many
from buffer.redis_layout import RingLayout
from buffer.redis_producer import RedisProducer, _claim_name
from tests.conftest import make_traj

RUN = "spoolg"


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # (nothing listens once it is closed)


def _producer(spool: Path) -> RedisProducer:
    client = redis.Redis(port=_closed_port(), retry=Retry(NoBackoff(), 0))  # (fails at once)
    layout = RingLayout(RUN, 1000, client=client, key_prefix="reval-test:spoolg:", open_retry_s=0)
    return RedisProducer(layout, spool_dir=spool)


def _chunk_file(path: Path, lo: int, n: int = 4, run: str = RUN) -> None:
    """A spool file as ``keep`` writes it, of trajectories ``t<lo>``..``t<lo+n-1>``."""
    trajs = [make_traj(i) for i in range(lo, lo + n)]
    body = {"run": run, "stage": uuid.uuid4().hex, "ids": [t.traj_id for t in trajs],
            "versions": [0] * n, "blobs": encode_many(trajs)}  # fmt: skip
    path.write_bytes(msgpack.packb(body, use_bin_type=True))


def _ids(prod: RedisProducer) -> list[str]:
    return [i for c in prod._spool for i in c.ids]


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_the_claims_of_a_killed_producer_are_taken_back(tmp_path: Path) -> None:
    """A producer killed after it claimed its files (``*.sending-<pid>-<host>-<token>``) left
    them there for ever: the next one on this host takes them back; a live producer's claims
    (this process's, a live process's, another host's) stay."""
    spool = tmp_path / "spool"
    spool.mkdir()
    host = socket.gethostname()
    _chunk_file(spool / f"00000000000000000001-000000.sending-{_dead_pid()}-{host}-0a1b2c3d", 0)
    _chunk_file(spool / "00000000000000000002-000000.sending-1-other.host-0a1b2c3d", 4)
    _chunk_file(spool / f"00000000000000000003-000000{_claim_name()}", 8)  # (this process's)
    _chunk_file(spool / f"00000000000000000004-000000.sending-{1}-{host}-0a1b2c3d", 12)  # init
    _chunk_file(spool / "00000000000000000005-000000.spool", 16)
    prod = _producer(spool)
    assert _ids(prod) == [f"t{i}" for i in (0, 1, 2, 3, 16, 17, 18, 19)]  # in order kept
    assert len(list(spool.glob("*.sending-*"))) == 5  # (3 left, 2 claimed by this one)
    prod.close(flush_s=0)  # Redis still away: kept again, for the next
    assert len(list(spool.glob("*.spool"))) == 2
    assert _ids(_producer(spool)) == [f"t{i}" for i in (0, 1, 2, 3, 16, 17, 18, 19)]


def test_an_unreadable_or_foreign_file_is_one_line_and_set_aside(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Garbage, a msgpack list, a dict without the chunk's fields: each one line naming it, set
    aside as ``bad-<name>`` (tried once, not at every start); the good file after them is taken
    back. Before, a non-dict body crashed the worker at its start (AttributeError)."""
    spool = tmp_path / "spool"
    spool.mkdir()
    (spool / "00000000000000000001-000000.spool").write_bytes(b"\xc1 not msgpack")
    (spool / "00000000000000000002-000000.spool").write_bytes(msgpack.packb([1, 2, 3]))
    (spool / "00000000000000000003-000000.spool").write_bytes(msgpack.packb({"run": RUN}))
    (spool / "00000000000000000004-000000.spool").write_bytes(
        msgpack.packb({"run": RUN, "stage": "s", "ids": ["a"], "versions": [], "blobs": [b"x"]})
    )
    _chunk_file(spool / "00000000000000000005-000000.spool", 0)
    _chunk_file(spool / "00000000000000000006-000000.spool", 8, run="another")
    with caplog.at_level(logging.ERROR, logger="reval.buffer"):
        prod = _producer(spool)
    assert _ids(prod) == ["t0", "t1", "t2", "t3"]
    assert (spool / "00000000000000000006-000000.spool").is_file()  # (not ours: left)
    lines = [r.getMessage() for r in caplog.records if "cannot be taken back" in r.getMessage()]
    assert len(lines) == 4
    assert all("set aside as bad-" in line for line in lines)
    assert sorted(p.name for p in spool.glob("bad-*")) == [
        f"bad-0000000000000000000{k}-000000" for k in (1, 2, 3, 4)
    ]
    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="reval.buffer"):
        assert _producer(spool).spooled == 0  # (the good one is claimed; the bad ones aside)
    assert not [r for r in caplog.records if "cannot be taken back" in r.getMessage()]


def test_a_full_disk_at_close_is_one_line_with_the_records_lost(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``close`` with Redis away and no room for the spool files: one line saying how many
    records are lost and why (before: an OSError traceback out of ``close``); a chunk taken
    back from a file goes back to it (a rename needs no room)."""
    spool = tmp_path / "spool"
    spool.mkdir()
    _chunk_file(spool / "00000000000000000001-000000.spool", 0)
    prod = _producer(spool)
    prod.insert([make_traj(i) for i in range(4, 10)])
    assert prod.spooled == 10

    def full(self: Path, data: bytes) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Path, "write_bytes", full)
    with caplog.at_level(logging.WARNING, logger="reval.buffer"):
        prod.close(flush_s=0)
    lines = [r.getMessage() for r in caplog.records if "could not be kept" in r.getMessage()]
    assert len(lines) == 1
    assert "6 unsent records" in lines[0] and "No space left on device" in lines[0]
    assert "4 kept there" in lines[0]
    monkeypatch.undo()
    assert [p.suffix for p in spool.iterdir()] == [".spool"]  # (the taken-back chunk's)
    assert _ids(_producer(spool)) == ["t0", "t1", "t2", "t3"]
