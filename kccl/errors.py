"""Exceptions raised by kccl.

Every error a caller may want to catch derives from `KcclError`. `PeerLost` and `KcclTimeout` are the
two ways a wait ends without data: a peer process is gone (or closed its communicator), or the deadline
passed while every peer still looked alive.
"""

from __future__ import annotations


class KcclError(RuntimeError):
    """Any kccl failure: bad arguments, layout mismatch between ranks, bootstrap failure, protocol bug."""


def unknown_tag(tag: str, tags) -> KcclError:
    """What every communicator raises for a tag it was not created with."""
    return KcclError(f"unknown tag {tag!r}; this communicator was created with tags={tags}")


class PeerLost(KcclError):
    """A peer rank exited (or closed its communicator) while this rank depended on it.

    `rank` and `pid` name the lost peer; the message reads like "rank 3 (pid 1234) exited".
    """

    def __init__(self, message: str, rank: int = -1, pid: int = -1):
        super().__init__(message)
        self.rank = rank
        self.pid = pid


class KcclTimeout(KcclError, TimeoutError):
    """A wait passed its deadline while every peer was still alive (a hang, or a mismatched call order)."""
