"""MPI collectives of plain values on numpy buffers, for the bootstrap and the benchmarks' reports.

mpi4py's lowercase calls (bcast, gather, allgather, allreduce of Python objects) pickle what they move;
nothing in kog_dist unpickles anything, so strings travel as UTF-8 bytes, numbers as int64 / float64
arrays, and small structures as JSON text.
"""

from __future__ import annotations

import json

import numpy as np

from . import optional


def bcast_bytes(comm, data: bytes | None, root: int = 0) -> bytes:
    """Root's `data` on every rank (the others pass None)."""
    mine = comm.Get_rank() == root
    n = np.array([len(data) if mine else 0], dtype=np.int64)
    comm.Bcast(n, root=root)
    buf = np.frombuffer(data, dtype=np.uint8).copy() if mine else np.empty(int(n[0]), dtype=np.uint8)
    if n[0]:
        comm.Bcast(buf, root=root)
    return buf.tobytes()


def bcast_str(comm, text: str | None, root: int = 0) -> str:
    return bcast_bytes(comm, text.encode() if comm.Get_rank() == root else None, root).decode()


def allgather_bytes(comm, data: bytes) -> list[bytes]:
    """Every rank's `data` (any lengths), by rank."""
    size = comm.Get_size()
    lens = np.empty(size, dtype=np.int64)
    comm.Allgather(np.array([len(data)], dtype=np.int64), lens)
    width = max(1, int(lens.max()))
    send = np.zeros(width, dtype=np.uint8)
    send[:len(data)] = np.frombuffer(data, dtype=np.uint8)
    recv = np.empty(size * width, dtype=np.uint8)
    comm.Allgather(send, recv)
    return [recv[q * width:q * width + int(lens[q])].tobytes() for q in range(size)]


def allgather_json(comm, value) -> list:
    """Every rank's JSON-able `value` (numbers, strings, lists, dicts), by rank."""
    return [json.loads(b) for b in allgather_bytes(comm, json.dumps(value).encode())]


def allreduce_int(comm, value: int, op) -> int:
    """One int64 reduced over the ranks with the MPI op `op` (MPI.MIN, MPI.MAX, MPI.SUM)."""
    out = np.zeros(1, dtype=np.int64)
    comm.Allreduce(np.array([value], dtype=np.int64), out, op=op)
    return int(out[0])


def forbid_pickle() -> None:
    """Make mpi4py's pickling calls fail in this process (entry points call it first), so that no
    lowercase collective can slip in: they raise instead of pickling."""
    MPI = optional.mpi()

    def refuse(*_a, **_k):
        raise RuntimeError("mpi4py's pickling collectives are off in kog_dist (use kccl.mpi_plain)")

    MPI.pickle.__init__(refuse, refuse)
