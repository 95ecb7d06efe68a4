"""A doorbell per rank, so a rank idling between requests blocks in the kernel instead of polling.

Each rank binds a Linux abstract-namespace UNIX datagram socket named after its segment (no file,
nothing to clean up: it vanishes with the process). A rank entering an idle wait raises the IDLE
word of its segment header and blocks in recv() with a timeout; a sender that publishes on the
collectives channel rings (one 1-byte datagram) every destination whose IDLE word is up.

The IDLE store and the EPOCH load of the sleeper, like the EPOCH store and the IDLE load of the
ringer, can pass each other in the x86 store buffer, so a ring can be missed: the sleeper's recv
timeout (the idle policy's max sleep, 20 ms) bounds what that costs. Elsewhere than Linux there is
no doorbell and idle waits sleep-poll.
"""

from __future__ import annotations

import socket
import sys


class Doorbell:
    """This rank's bell (`wait`) and the addresses of every rank's bell (`ring`)."""

    def __init__(self, names: list[str], rank: int):
        self.addresses = ["\0" + name for name in names]
        self.rank = rank
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            self.sock.bind(self.addresses[rank])
        except OSError:
            self.sock.close()
            raise
        self.out = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.out.setblocking(False)

    @classmethod
    def open(cls, names: list[str], rank: int) -> "Doorbell | None":
        """The doorbell, or None where abstract UNIX sockets do not exist (not Linux)."""
        if not sys.platform.startswith("linux"):
            return None
        try:
            return cls(names, rank)
        except OSError:
            return None

    def ring(self, dest: int) -> None:
        try:
            self.out.sendto(b"!", self.addresses[dest])
        except OSError:
            pass  # its queue is full (it will wake anyway) or it is gone (liveness will tell)

    def wait(self, seconds: float) -> None:
        """Block until rung or `seconds` passed; then drop any further rings already queued."""
        self.sock.settimeout(seconds)
        try:
            self.sock.recv(16)
        except (TimeoutError, socket.timeout, BlockingIOError, InterruptedError):
            return
        self.sock.setblocking(False)
        try:
            while True:
                self.sock.recv(16)
        except (BlockingIOError, OSError):
            pass

    def close(self) -> None:
        self.sock.close()
        self.out.close()
