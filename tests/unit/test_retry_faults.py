"""reval/retry.py's ``wait_fault``: Redis away or refusing writes is waited on; an error that
waiting does not change is not (it was: any OSError counted, so a full disk, a missing file or a
taken port were retried for ``redis.outage_s`` and logged as "Redis is away")."""

from __future__ import annotations

import errno

import pytest
import redis

from reval.ops_http import PortTaken
from reval.retry import retry_redis, wait_fault


class InnerWaitExhausted(ConnectionError):
    """As ``buffer.base.BufferUnavailable``: an inner caller that already waited its budget."""


@pytest.mark.parametrize(
    "err",
    [
        redis.ConnectionError("Connection refused"),
        redis.TimeoutError("Timeout reading from socket"),
        ConnectionResetError(errno.ECONNRESET, "reset"),
        BrokenPipeError(errno.EPIPE, "broken pipe"),
        TimeoutError("timed out"),
        redis.ResponseError("MISCONF Redis is configured to save RDB snapshots, but ..."),
    ],
)
def test_redis_away_or_refusing_is_a_wait(err: BaseException) -> None:
    assert wait_fault(err)


@pytest.mark.parametrize(
    "err",
    [
        OSError(errno.ENOSPC, "No space left on device"),
        PermissionError(errno.EACCES, "denied"),
        FileNotFoundError(errno.ENOENT, "no such file"),
        PortTaken("port 9400 is taken"),
        InnerWaitExhausted("the replay service was unreachable for 600 s"),
        redis.ResponseError("WRONGTYPE Operation against a key holding the wrong kind of value"),
    ],
)
def test_other_errors_are_not_waited_on(err: BaseException) -> None:
    assert not wait_fault(err)


def test_a_full_disk_inside_the_call_raises_at_once() -> None:
    calls = []

    def fn() -> None:
        calls.append(1)
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError, match="No space"):
        retry_redis(fn, budget_s=30.0, what="test")
    assert calls == [1]


def test_a_port_refused_for_its_number_is_not_said_to_be_taken() -> None:
    """A port in use names the other process; a port below 1024 without root (EACCES) says so,
    not "another process holds the port" (nothing does)."""
    from reval.ops_http import port_taken

    used = str(port_taken(9400, "0.0.0.0", OSError(errno.EADDRINUSE, "Address already in use")))
    assert "0.0.0.0:9400" in used and "another process holds the port" in used
    denied = str(port_taken(22, "0.0.0.0", PermissionError(errno.EACCES, "Permission denied")))
    assert "0.0.0.0:22 (Permission denied)" in denied and "below 1024 need root" in denied
    assert "another process" not in denied and "metrics.prometheus_port" in denied
