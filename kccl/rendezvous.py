"""How ranks find each other for the bootstrap: over MPI (normal), or over files (no launcher).

The bootstrap needs only: this rank and the group size, one string from rank 0, an "everyone ok?"
vote, a barrier, and the number of ranks on this host. `MpiRendezvous` does that with mpi4py's
uppercase calls on numpy buffers (mpi_plain.py: no pickle). `FileRendezvous`
does it with files in a shared folder, for ranks started without mpiexec (plain subprocesses: tests
that must keep survivors alive after a peer is SIGKILLed, which MPICH's hydra would not do).
"""

from __future__ import annotations

import os
import time

from . import optional
from .errors import KcclError
from .mpi_plain import allreduce_int, bcast_str


class MpiRendezvous:
    def __init__(self, comm):
        self.comm = comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()

    def share_str(self, text: str | None) -> str:
        return bcast_str(self.comm, text)

    def agree(self, ok: bool) -> bool:
        MPI = optional.mpi()
        return bool(allreduce_int(self.comm, int(ok), MPI.MIN))

    def barrier(self) -> None:
        self.comm.Barrier()

    def local_ranks(self) -> int:
        MPI = optional.mpi()
        local = self.comm.Split_type(MPI.COMM_TYPE_SHARED)
        try:
            return local.Get_size()
        finally:
            local.Free()


class FileRendezvous:
    """Rendezvous through files in `folder` (on one host). Every rank uses a fresh, shared folder."""

    def __init__(self, folder: str, rank: int, size: int, timeout: float = 30.0):
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} out of range for size {size}")
        self.folder, self.rank, self.size, self.timeout = folder, rank, size, timeout
        self._step = 0

    def _put(self, name: str, text: str) -> None:
        tmp = os.path.join(self.folder, f".{name}.tmp{self.rank}")
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, os.path.join(self.folder, name))

    def _get(self, name: str) -> str:
        path = os.path.join(self.folder, name)
        deadline = time.monotonic() + self.timeout
        while not os.path.exists(path):
            if time.monotonic() > deadline:
                raise KcclError(f"rank {self.rank}: rendezvous timed out waiting for {path}")
            time.sleep(0.002)
        with open(path) as f:
            return f.read()

    def _all(self, text: str) -> list[str]:
        self._step += 1
        self._put(f"s{self._step}-r{self.rank}", text)
        return [self._get(f"s{self._step}-r{r}") for r in range(self.size)]

    def share_str(self, text: str | None) -> str:
        return self._all(text if self.rank == 0 else "")[0]

    def agree(self, ok: bool) -> bool:
        return all(v == "1" for v in self._all("1" if ok else "0"))

    def barrier(self) -> None:
        self._all("")

    def local_ranks(self) -> int:
        return self.size


def as_rendezvous(comm):
    """An mpi4py communicator (None: COMM_WORLD) or a rendezvous object -> a rendezvous object."""
    if isinstance(comm, (MpiRendezvous, FileRendezvous)):
        return comm
    if comm is None:
        MPI = optional.mpi()
        comm = MPI.COMM_WORLD
    return MpiRendezvous(comm)
