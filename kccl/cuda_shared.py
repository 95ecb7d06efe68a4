"""kccl `cuda_ipc`: a device buffer of every rank, mapped into every other rank (for bulk exchanges).

The communicator's window carries small slots (the decode's partials, the host collectives' pieces). A
bulk exchange, e.g. the prefill's per-layer partials of every lane (tens of MB), would cross it in
thousands of slot-sized pieces; instead each rank allocates one `SharedBuffer` (cudaMalloc outside CuPy's
pool, exported with cudaIpcGetMemHandle), the ranks swap the handles once, and a rank then copies what
it needs straight out of a peer's buffer (`copy_from`) after a `comm.barrier()` has ordered the peer's
writes before the read. Collective: every rank creates it with the same size, at the same point.
"""

from __future__ import annotations

import numpy as np

from . import optional
from .cuda_layout import agree_or_raise, allgather_bytes
from .errors import KcclError

_HANDLE_BYTES = 64   # cudaIpcMemHandle_t
_MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: the direction from the (unified) addresses


class SharedBuffer:
    """`nbytes` of device memory on this rank; `ptrs[r]`: rank r's buffer as this rank addresses it."""

    def __init__(self, comm, nbytes: int):
        cp = optional.cupy()
        rt = cp.cuda.runtime
        rdv = comm._rdv
        self.rank, self.size, self.nbytes = comm.rank, comm.size, int(nbytes)
        self.own, self._opened = 0, []
        error = None
        try:
            self.own = rt.malloc(self.nbytes)   # outside CuPy's pool: IPC exports whole allocations
            handle = bytes(rt.ipcGetMemHandle(self.own))
            rec = np.frombuffer(handle.ljust(_HANDLE_BYTES, b"\0"), np.uint8).tobytes() + \
                np.array([self.nbytes], np.int64).tobytes()
        except Exception as exc:  # noqa: BLE001 - reported to every rank below
            error, rec = exc, bytes(_HANDLE_BYTES + 8)
        raw = allgather_bytes(rdv, rec)
        agree_or_raise(rdv, self.rank, error, f"allocating a shared buffer of {self.nbytes} bytes", self.close)
        self.ptrs = []
        try:
            for r, b in enumerate(raw):
                theirs = int(np.frombuffer(b[_HANDLE_BYTES:], np.int64)[0])
                if theirs != self.nbytes:
                    raise KcclError(f"rank {r} shares {theirs} bytes, this rank {self.nbytes}")
                if r == self.rank:
                    self.ptrs.append(self.own)
                    continue
                ptr = rt.ipcOpenMemHandle(b[:_HANDLE_BYTES])
                self._opened.append(ptr)
                self.ptrs.append(ptr)
        except Exception as exc:  # noqa: BLE001
            error = exc
        agree_or_raise(rdv, self.rank, error, "opening the peers' shared buffers", self.close)

    def view(self, offset: int, shape, dtype):
        """A CuPy array over this rank's own buffer at byte `offset`."""
        cp = optional.cupy()
        n = int(np.prod(shape)) * np.dtype(dtype).itemsize
        if offset < 0 or offset + n > self.nbytes:
            raise ValueError(f"shared buffer view [{offset}, {offset + n}) outside its {self.nbytes} bytes")
        mem = cp.cuda.UnownedMemory(self.own + offset, n, self)
        return cp.ndarray(shape, dtype, cp.cuda.MemoryPointer(mem, 0))

    def copy_from(self, rank: int, offset: int, nbytes: int) -> None:
        """Bytes [offset, offset + nbytes) of rank `rank`'s buffer into the same place of this rank's, on
        the current stream (the caller orders the peer's writes before it, e.g. with comm.barrier())."""
        cp = optional.cupy()
        if offset < 0 or offset + nbytes > self.nbytes:
            raise ValueError(f"shared buffer copy [{offset}, {offset + nbytes}) outside its {self.nbytes} bytes")
        if rank != self.rank and nbytes:
            cp.cuda.runtime.memcpyAsync(self.own + offset, self.ptrs[rank] + offset, nbytes, _MEMCPY_DEFAULT,
                                        cp.cuda.get_current_stream().ptr)

    def close(self) -> None:
        """Unmap the peers' buffers and free this rank's (after this device's work on them is done)."""
        if self._opened or self.own:
            release_ipc(self._opened, self.own)
        self._opened, self.own = [], 0


def release_ipc(opened, own: int) -> None:
    """Wait for this device's work, close the peers' mapped allocations `opened` and free `own` (0: none).
    Errors are passed over: in a faulted context, free what can be freed."""
    cp = optional.cupy()
    rt = cp.cuda.runtime
    _quiet(rt.deviceSynchronize)
    for ptr in opened:
        _quiet(rt.ipcCloseMemHandle, ptr)
    if own:
        _quiet(rt.free, own)


def _quiet(f, *args) -> None:
    try:
        f(*args)
    except Exception:  # noqa: BLE001
        pass
