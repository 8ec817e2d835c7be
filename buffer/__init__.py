"""Replay service: the trajectory record and the FIFO ring (embedded memory backend; Redis next)."""

from buffer.base import BufferStats, ReplayBuffer
from buffer.records import RecordError, Trajectory, decode, encode
from buffer.ring import MemoryRing

__all__ = [
    "BufferStats",
    "MemoryRing",
    "RecordError",
    "ReplayBuffer",
    "Trajectory",
    "decode",
    "encode",
]
