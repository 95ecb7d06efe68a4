"""Rank heartbeats: a frozen rank (SIGSTOP, a stopped VM vCPU, a process stuck with the GIL held) is
alive to every liveness check kccl has (its pid exists), so waits on it would only end at their 30 s
deadline. Every rank's thread stamps CLOCK_MONOTONIC (one clock for the whole host) into its line of
one shared page every ``interval_s``; rank 0's coordinator asks ``check()`` from its socket loop and
fails the job when a peer's stamp is older than ``timeout_s`` (default 3 s: reported within 5 s), or
at once when the peer's process is gone (so a launcher's SIGTERM that follows a rank's death, as
Open MPI's mpirun sends, is taken for the failure it is, not for a shutdown).

A follower watches rank 0 with a longer deadline (4 x timeout_s) and then leaves the job (exit 1),
SIGKILLing rank 0 first only when /proc says it is stopped (a busy rank 0 is left alone). Rank 0,
once its clients are told, SIGKILLs the ranks it found frozen (``kill_lost``), since neither the
launcher nor the frozen rank would end them. (A rank under a debugger looks frozen too: set
KOG_HEARTBEAT_S=0 to debug.)

The page lives in /dev/shm only between its creation and the barrier that follows everyone's
mapping of it (rank 0 then unlinks the name), as kccl's segments do: nothing is left behind however
the job ends. KOG_HEARTBEAT_S sets timeout_s; 0 turns the heartbeat off.
"""
from __future__ import annotations

import os
import secrets
import signal
import threading
import time

from kccl.mpi_plain import allreduce_int, bcast_str
from kccl.optional import mpi
from kccl.shm import SHM_DIR, Segment, process_alive, segment_prefix

PAGE = 4096
LINE_WORDS = 8                    # one 64-byte line per rank: [stamp_ns, pid, ...]
FOLLOWER_FACTOR = 4.0


class PeerFrozen(RuntimeError):
    """A peer rank stopped beating; `rank` and `pid` name it."""

    def __init__(self, message: str, rank: int, pid: int):
        super().__init__(message)
        self.rank, self.pid = rank, pid


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return stat[stat.rindex(b")") + 2:].split()[0].decode()
    except (OSError, ValueError, IndexError):
        return "?"


class Heartbeat:
    def __init__(self, seg: Segment, rank: int, size: int, interval_s: float, timeout_s: float, log):
        self.seg, self.rank, self.size = seg, rank, size
        self.interval_s, self.timeout_s, self.log = interval_s, timeout_s, log
        self.words = seg.words
        self.lost: list[PeerFrozen] = []
        self._stop = threading.Event()
        self._stamp()
        self.words[rank * LINE_WORDS + 1] = os.getpid()
        self._thread = None

    @classmethod
    def start(cls, world, *, timeout_s: float | None = None, interval_s: float = 0.25, log=print):
        """Collective over the MPI communicator `world`; None when off (one rank, KOG_HEARTBEAT_S=0) or
        when rank 0 cannot make the page (then no rank has one)."""
        rank, size = world.Get_rank(), world.Get_size()
        if timeout_s is None:
            try:
                timeout_s = float(os.environ.get("KOG_HEARTBEAT_S", "3"))
            except ValueError:
                timeout_s = 3.0
        if size < 2 or not timeout_s > 0:
            return None
        interval_s = min(interval_s, timeout_s / 4)
        seg, path = None, ""
        if rank == 0:
            path = os.path.join(SHM_DIR, f"{segment_prefix()}_hb_{os.getpid()}_{secrets.token_hex(4)}")
            try:
                seg = Segment.create(path, PAGE)
            except OSError as e:
                log(f"no rank heartbeat ({path}: {e.strerror or e}); a frozen rank is noticed at kccl's deadline")
                path = ""
        path = bcast_str(world, path)
        if path and rank != 0:
            try:
                seg = Segment.open(path, PAGE)
            except (OSError, ValueError):
                seg = None
        ok = int(seg is not None)
        everyone = allreduce_int(world, ok, mpi().SUM) if path else 0
        if rank == 0 and seg is not None:
            seg.unlink()                          # everyone mapped it (or gave up): the name can go
        if everyone != size:
            if seg is not None:
                seg.close()
            return None
        hb = cls(seg, rank, size, interval_s, timeout_s, log)
        world.Barrier()                           # every pid and first stamp written
        hb._thread = threading.Thread(target=hb._run, name="kog-heartbeat", daemon=True)
        hb._thread.start()
        return hb

    def _stamp(self):
        self.words[self.rank * LINE_WORDS] = time.monotonic_ns()

    def pid(self, r: int) -> int:
        return int(self.words[r * LINE_WORDS + 1])

    def age(self, r: int) -> float:
        return (time.monotonic_ns() - int(self.words[r * LINE_WORDS])) / 1e9

    def _run(self):
        while not self._stop.wait(self.interval_s):
            self._stamp()
            if self.rank != 0 and self.age(0) > self.timeout_s * FOLLOWER_FACTOR:
                self.log(f"rank {self.rank}: {self._describe(0)}; leaving the job")
                if _state(self.pid(0)) == "T":   # stopped, not merely busy: nothing else would end it
                    try:
                        os.kill(self.pid(0), signal.SIGKILL)
                    except OSError:
                        pass
                os._exit(1)

    def _describe(self, r: int) -> str:
        pid = self.pid(r)
        how = {"T": " (stopped: SIGSTOP?)", "t": " (stopped by a debugger)"}.get(_state(pid), "")
        if not process_alive(pid):
            how = " (the process is gone)"
        return f"rank {r} (pid {pid}) stopped responding: no heartbeat for {self.age(r):.1f} s{how}"

    def check(self) -> None:
        """Raise PeerFrozen for the first peer whose stamp is older than timeout_s (rank 0's view)."""
        if self.lost:
            raise self.lost[0]
        for r in range(self.size):
            if r == self.rank:
                continue
            if not process_alive(self.pid(r)):     # gone: say so at once, not after timeout_s
                self.lost.append(PeerFrozen(f"rank {r} (pid {self.pid(r)}) exited", r, self.pid(r)))
            elif self.age(r) > self.timeout_s:
                self.lost.append(PeerFrozen(self._describe(r), r, self.pid(r)))
        if self.lost:
            raise self.lost[0]

    def kill_lost(self) -> None:
        """SIGKILL the ranks found frozen (after the clients were told): a stopped process outlives
        every signal but this one, and the launcher would wait for it forever."""
        for e in self.lost:
            try:
                if process_alive(e.pid):
                    os.kill(e.pid, signal.SIGKILL)
            except OSError:
                pass

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2 * self.interval_s + 1)
        self.words = None
        self.seg.close()
