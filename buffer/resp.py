"""The Redis protocol (RESP2) for the replay ring's hot commands, built directly as bytes.

redis-py (even with hiredis) spends about 4 us per record building and packing an HMGET/BITFIELD
of a 1024-record sample: Python tuples of mixed str/int arguments, then a C packer that converts
each. The commands here have a fixed shape, so each record costs one bytes formatting. Small
commands go through ``hiredis.pack_command``. ``tests/unit/test_resp.py`` checks every builder
against ``hiredis.pack_command``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import hiredis
import numpy as np

MULTI = b"*1\r\n$5\r\nMULTI\r\n"
EXEC = b"*1\r\n$4\r\nEXEC\r\n"
_INDEX_CACHE = 4096
# "$<len>\r\n<i>\r\n" for the field names 0, 1, 2, ... of a chunk's hash.
_FIELD = [b"$%d\r\n%d\r\n" % (len(b"%d" % i), i) for i in range(_INDEX_CACHE)]
# The same plus "$<len>\r\nf<i>\r\n": a record's field and its reference quantities' field.
_FIELD_AND_REF = [_FIELD[i] + b"$%d\r\nf%d\r\n" % (len(b"f%d" % i), i) for i in range(_INDEX_CACHE)]


def _bulk(x: str | bytes) -> bytes:
    b = x.encode() if isinstance(x, str) else x
    return b"$%d\r\n%s\r\n" % (len(b), b)


def _field(i: int) -> bytes:
    return _FIELD[i] if i < _INDEX_CACHE else _bulk(b"%d" % i)


def _field_and_ref(i: int) -> bytes:
    return _FIELD_AND_REF[i] if i < _INDEX_CACHE else _bulk(b"%d" % i) + _bulk(b"f%d" % i)


def pack(*args: Any) -> bytes:
    """Any small command."""
    out: bytes = hiredis.pack_command(args)
    return out


def hset_indexed(key: str, blobs: Sequence[bytes]) -> bytes:
    """``HSET key 0 blob0 1 blob1 ...``."""
    parts = [b"*%d\r\n$4\r\nHSET\r\n" % (2 + 2 * len(blobs)), _bulk(key)]
    for i, blob in enumerate(blobs):
        parts += (_field(i), b"$%d\r\n" % len(blob), blob, b"\r\n")
    return b"".join(parts)


def hmget_with_refs(key: str, offsets: Sequence[int]) -> bytes:
    """``HMGET key o1 fo1 o2 fo2 ...``: each record's field and its reference quantities'."""
    parts = [b"*%d\r\n$5\r\nHMGET\r\n" % (2 + 2 * len(offsets)), _bulk(key)]
    parts += [_field_and_ref(o) for o in offsets]
    return b"".join(parts)


_INCR = b"$6\r\nINCRBY\r\n$3\r\nu32\r\n"
_GET = b"$3\r\nGET\r\n$3\r\nu32\r\n"


# 10, 100, ...: np.searchsorted(_POW10, s, side="right") + 1 is the number of digits of s >= 0.
_POW10 = np.array([10**i for i in range(1, 19)], dtype=np.int64)


def bitfield_u32(key: str, slots: Sequence[int], by: int | None) -> bytes:
    """``BITFIELD key INCRBY u32 #s by ...`` (``by`` None: ``GET u32 #s``; a negative ``by``
    saturates at 0: ``OVERFLOW SAT`` first). The per-slot part is one ``%`` over the whole
    batch: the offsets' lengths come from numpy, not a format call per slot."""
    n = len(slots)
    if by is None:
        head, per, tail = 2 + 3 * n, _GET, b""
    else:
        head, per, tail = 2 + 4 * n, _INCR, _bulk(b"%d" % by)
    prefix = b""
    if by is not None and by < 0:
        head += 2
        prefix = b"$8\r\nOVERFLOW\r\n$3\r\nSAT\r\n"
    s = np.asarray(slots, dtype=np.int64)
    if n and s.min() < 0:
        raise ValueError("bit offsets must be >= 0")
    pairs = np.empty(2 * n, dtype=np.int64)
    pairs[0::2] = np.searchsorted(_POW10, s, side="right") + 2  # "#" and the digits
    pairs[1::2] = s
    body = ((per + b"$%d\r\n#%d\r\n" + tail) * n) % tuple(pairs.tolist())
    return b"".join([b"*%d\r\n$8\r\nBITFIELD\r\n" % head, _bulk(key), prefix, body])
