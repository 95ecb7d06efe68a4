"""Is every peer still there? The check a waiting rank runs while it backs off.

Each segment header holds its rank's pid, process start time and state (READY, CLOSED, ABORTED).
A rank that raises PeerLost marks itself ABORTED and records whom it lost and why, so the other
ranks report the root cause ("rank 1 (pid 7) exited (reported by rank 0)") rather than the
cascade ("rank 0 closed its communicator"). Precedence of causes, most direct first:

1. a peer process is gone while its header still says READY: it crashed;
2. a peer is ABORTED: repeat what it lost;
3. a peer CLOSED its communicator (normal exit or an exception on that rank);
4. any other peer process gone.
"""

from __future__ import annotations

from . import layout as L
from .errors import PeerLost
from .shm import process_alive, unlink_quietly

REASONS = {L.LOST_EXITED: "exited", L.LOST_CLOSED: "closed its communicator"}


class PeerWatch:
    """Checks the peers of `rank` through their segment headers (`words[r]`, uint64 views)."""

    def __init__(self, rank: int, words: list, paths: list):
        self.rank = rank
        self.words = words
        self.paths = paths
        self.peers = [r for r in range(len(words)) if r != rank]
        self.pids = [int(w[L.H_PID]) for w in words]
        self.starts = [int(w[L.H_STARTTIME]) for w in words]
        self.lost: PeerLost | None = None

    def check(self) -> None:
        """Raise PeerLost (and remember it) if a peer is gone, closed, or lost a peer itself."""
        if self.lost is not None:
            raise self.lost
        states = {r: self.words[r][L.H_STATE] for r in self.peers}
        gone = [r for r in self.peers if not process_alive(self.pids[r], self.starts[r])]
        for r in gone:
            unlink_quietly(self.paths[r])  # survivor cleanup, if the name still exists
        crashed = [r for r in gone if states[r] == L.STATE_READY]
        aborted = [r for r in self.peers if states[r] == L.STATE_ABORTED]
        closed = [r for r in self.peers if states[r] == L.STATE_CLOSED]
        if crashed:
            self._lose(crashed[0], L.LOST_EXITED)
        if aborted:
            reporter = aborted[0]
            lost = int(self.words[reporter][L.H_LOST_RANK])
            why = int(self.words[reporter][L.H_LOST_REASON])
            if lost != self.rank and 0 <= lost < len(self.words):
                self._lose(lost, why, reporter)
            self._lose(reporter, 0)
        if closed:
            self._lose(closed[0], L.LOST_CLOSED)
        if gone:
            self._lose(gone[0], L.LOST_EXITED)

    def _lose(self, peer: int, why: int, reporter: int | None = None) -> None:
        seen = f"reported by rank {reporter}" if reporter is not None else f"noticed by rank {self.rank}"
        reason = REASONS.get(why, "gave up (PeerLost)")
        self.lost = PeerLost(f"rank {peer} (pid {self.pids[peer]}) {reason} "
                             f"({seen})", rank=peer, pid=self.pids[peer])
        own = self.words[self.rank]
        own[L.H_LOST_RANK] = peer
        own[L.H_LOST_REASON] = why
        own[L.H_STATE] = L.STATE_ABORTED
        raise self.lost
