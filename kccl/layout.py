"""Byte layout of one rank's shared-memory segment, and the epoch/ring arithmetic.

A segment belongs to its receiver R. It holds a header page, then for every channel c (the internal
collectives channel "_coll" first, then the DTP tags) and every source rank s a block:

    ack word   (8 bytes, own 64-byte line)  -- written by R: the last epoch R consumed from s on c
    depth slots, each:
        slot header (64 bytes, 8 uint64 words) -- written by s: EPOCH, NBYTES, DTYPE, NDIM, SHAPE[4]
        payload (payload_bytes, rounded up to 64) -- written by s before it stores EPOCH

Epochs start at 1 (0 = nothing yet, which is what fresh zeroed memory reads as), only grow and are
never reset. Epoch e of a (channel, source) lives in ring slot e % depth. A sender may write epoch e
only once the receiver's ack word says it consumed e - depth (the previous tenant of that slot).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np

MAGIC = 0x4B43434C53484D31  # "KCCLSHM1"
VERSION = 1
FIRST_EPOCH = 1
LINE = 64
HEADER_BYTES = 4096
MAX_NDIM = 4

# Header words (uint64 index into the segment).
(H_MAGIC, H_VERSION, H_NRANKS, H_RANK, H_PID, H_STARTTIME, H_STATE, H_LAYOUT_HASH, H_SIZE,
 H_LOST_RANK, H_LOST_REASON, H_IDLE) = range(12)
STATE_INIT, STATE_READY, STATE_CLOSED, STATE_ABORTED = 0, 1, 2, 3
LOST_EXITED, LOST_CLOSED = 1, 2  # H_LOST_REASON of an ABORTED rank
# H_IDLE: 1 while the rank blocks on its doorbell in an idle wait (ring it after publishing)

# Slot-header words (uint64 index relative to the slot).
S_EPOCH, S_NBYTES, S_DTYPE, S_NDIM, S_SHAPE = 0, 1, 2, 3, 4
SLOT_HEADER_BYTES = LINE

DTYPE_CODES = {np.dtype(np.float32): 1, np.dtype(np.int64): 2, np.dtype(np.float64): 3,
               np.dtype(np.int32): 4, np.dtype(np.uint8): 5, np.dtype(np.uint64): 6}
CODE_DTYPES = {code: dt for dt, code in DTYPE_CODES.items()}


def ring_index(epoch: int, depth: int) -> int:
    """The ring slot that holds `epoch`."""
    return epoch % depth


def ack_needed(epoch: int, depth: int) -> int:
    """The ack a receiver must have published before a sender may write `epoch` into its ring."""
    return epoch - depth


def slot_free(epoch: int, depth: int, acked: int) -> bool:
    """True when the slot for `epoch` no longer holds an unconsumed epoch (acked >= epoch - depth)."""
    return acked >= epoch - depth


def _round_up(n: int, to: int = LINE) -> int:
    return (n + to - 1) // to * to


@dataclass(frozen=True)
class SegmentLayout:
    """Offsets inside a segment. Identical on every rank (checked through `layout_hash`)."""

    nranks: int
    payload_bytes: int
    channels: tuple  # ((name, depth), ...), index = channel id

    @property
    def slot_bytes(self) -> int:
        return SLOT_HEADER_BYTES + _round_up(self.payload_bytes)

    def _channel_bytes(self, depth: int) -> int:
        return self.nranks * (LINE + depth * self.slot_bytes)

    def block_offset(self, channel: int, src: int) -> int:
        """Start of the (channel, src) block: its ack line."""
        off = HEADER_BYTES
        for _, depth in self.channels[:channel]:
            off += self._channel_bytes(depth)
        depth = self.channels[channel][1]
        return off + src * (LINE + depth * self.slot_bytes)

    def ack_offset(self, channel: int, src: int) -> int:
        return self.block_offset(channel, src)

    def slot_offset(self, channel: int, src: int, index: int) -> int:
        """Start of slot `index` (its header); the payload follows at + SLOT_HEADER_BYTES."""
        return self.block_offset(channel, src) + LINE + index * self.slot_bytes

    @property
    def size(self) -> int:
        return HEADER_BYTES + sum(self._channel_bytes(d) for _, d in self.channels)

    @property
    def layout_hash(self) -> int:
        text = f"{VERSION}|{self.nranks}|{self.payload_bytes}|{self.channels!r}"
        return zlib.crc32(text.encode()) | (VERSION << 32)


def check_create_args(depth: int, max_floats: int, tags) -> tuple:
    """The arguments every transport's create() shares; returns the tags as a tuple."""
    if depth < 1 or max_floats < 1:
        raise ValueError("depth and max_floats must be >= 1")
    tags = tuple(tags)
    if len(set(tags)) != len(tags) or any(t.startswith("_") for t in tags):
        raise ValueError(f"tags must be distinct and not start with '_': {tags}")
    return tags
