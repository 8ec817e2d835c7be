"""The raw RESP builders of the replay ring's hot commands give exactly the bytes that
hiredis.pack_command gives for the same command."""

from __future__ import annotations

import hiredis
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from buffer import resp

KEY = "reval:{run}:r:1024"


@settings(max_examples=200, deadline=None)
@given(st.lists(st.binary(max_size=300), max_size=40))
def test_hset_indexed_matches_hiredis(blobs):
    args = [a for i, b in enumerate(blobs) for a in (str(i).encode(), b)]
    assert resp.hset_indexed(KEY, blobs) == hiredis.pack_command(("HSET", KEY, *args))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 10_000), max_size=40))  # past the cached field names too
def test_hmget_with_refs_matches_hiredis(offsets):
    args = [a for o in offsets for a in (str(o), f"f{o}")]
    assert resp.hmget_with_refs(KEY, offsets) == hiredis.pack_command(("HMGET", KEY, *args))


def bitfield_by_hiredis(slots, by):
    if by is None:
        args = [a for s in slots for a in ("GET", "u32", f"#{s}")]
    else:
        args = [a for s in slots for a in ("INCRBY", "u32", f"#{s}", str(by))]
        if by < 0:
            args = ["OVERFLOW", "SAT", *args]
    return hiredis.pack_command(("BITFIELD", KEY, *args))


@pytest.mark.parametrize("by", [None, 1, -1])
@settings(max_examples=100, deadline=None)
@given(slots=st.lists(st.integers(0, 1 << 30), max_size=40))
def test_bitfield_matches_hiredis(by, slots):
    assert resp.bitfield_u32(KEY, slots, by) == bitfield_by_hiredis(slots, by)


@pytest.mark.parametrize("by", [None, 1, -1])
def test_bitfield_at_every_digit_boundary(by):
    """The offsets' lengths are counted with numpy: each power of ten and the number below it."""
    slots = [0, *(x for e in range(1, 19) for x in (10**e - 1, 10**e)), 2**63 - 1]
    assert resp.bitfield_u32(KEY, slots, by) == bitfield_by_hiredis(slots, by)


def test_bitfield_refuses_a_negative_offset():
    with pytest.raises(ValueError, match="offsets"):
        resp.bitfield_u32(KEY, [3, -1], 1)


def test_pack_small_commands():
    assert resp.pack("HGET", "k", "tail") == b"*3\r\n$4\r\nHGET\r\n$1\r\nk\r\n$4\r\ntail\r\n"
    assert hiredis.pack_command(("MULTI",)) == resp.MULTI
    assert hiredis.pack_command(("EXEC",)) == resp.EXEC
