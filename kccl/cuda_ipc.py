"""kccl `cuda_ipc` transport: collectives between GPU ranks through peer-mapped device memory.

Each rank allocates one device window (cudaMalloc through `cupy.cuda.runtime.malloc`, outside CuPy's
pool), exports it with cudaIpcGetMemHandle, and every rank opens every peer's (handles travel as
fixed 128-byte records in one MPI Allgather of uint8, or through a FileRendezvous). The window holds
flag words, ack words and slot rings (see `CudaLayout` and kccl/device/kccl.cuh, which the monokernel
includes). Epochs start at 1, only grow, are never reset; epoch e of a channel lives in ring slot
e % depth, and a sender writes e only once every rank acked e - depth (same rules as the shm
transport: kccl/layout.py's ring_index / ack_needed are used here too).

The host API (`CudaCommunicator.allreduce / broadcast / barrier / post / collect` on device arrays)
launches one small kernel per call (kccl/device/kccl_ops.cu) that runs the same device protocol, and
waits for it while watching the peers' processes: a dead peer raises the host-mapped abort word, the
kernel gives up its wait, and the call raises PeerLost. A kernel wait that passes `timeout` writes an
error code into the host-mapped status words and the call raises KcclTimeout ("rank 0 timed out
waiting for rank 1 ..."). Any error leaves the communicator unusable (close it and exit non-zero).

`run_rounds` runs the persistent test kernel (kccl/device/kccl_test.cu: many all-reduces or DTP
post/collect pairs inside one kernel), used by the tests and by `python -m kccl.bench --transport
cuda_ipc`. `dev_ptr` / `dev_words()` give the KcclDev struct a monokernel needs (docs/kccl-gpu.md).

Files: this module holds the liveness and fault handling (`peer_gone`, `context_error`, and the
`CudaCommunicator` methods `watch / check_kernel / fault / raise_for_status` plus `_finish`, the wait
for a launched kernel) and `create`. Import the rest from where it is defined:
- kccl/cuda_layout.py: constants shared with kccl.cuh, CudaLayout, handle records, describe_status,
  the device source;
- kccl/cuda_comm.py: CudaCore (allocation, handle exchange, mapping, the host ops and launches,
  run_rounds/peek, shutdown/close), which CudaCommunicator extends;
- kccl/cuda_bench.py: bench_main (`python -m kccl.bench --transport cuda_ipc`).
"""

from __future__ import annotations

import threading
import time

from . import optional
from .cuda_comm import CudaCore
from .cuda_layout import describe_status
from .errors import KcclError, PeerLost
from .shm import process_alive


# Waiting for a kernel of this rank that uses kccl (check_kernel): a kernel that reads the abort word
# leaves within microseconds (every wait polls it every 1024 spins), so one that has not left after
# ABORT_GRACE_S never will by itself; a kernel that shows no progress for STALL_PROBE_S gets its CUDA
# context probed (every PROBE_EVERY_S) for a fault that the event/stream query may not report.
ABORT_GRACE_S = 2.0
STALL_PROBE_S = 1.0
PROBE_EVERY_S = 0.5
PF_EXITING = 0x4  # /proc/PID/stat field 9 (flags): the task is in do_exit


def peer_gone(pid: int, starttime: int = 0) -> bool:
    """True when `pid` is gone, a zombie or another process (shm.process_alive), or is exiting: a
    SIGKILLed process has PF_EXITING set from the start of its exit, which may take a while (its GPU
    state is torn down on the way), before it becomes a zombie."""
    if not process_alive(pid, starttime):
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        flags = int(stat[stat.rindex(b")") + 2:].split()[6])
    except (OSError, ValueError, IndexError):
        return False
    return bool(flags & PF_EXITING)


_probe_thread = None


def context_error(device: int | None = None, wait_s: float = 1.0):
    """None while this process's CUDA context accepts work, else an exception: the one a new stream
    gets, or a KcclError when that call does not return within wait_s. Once a context faulted (a sticky
    error such as cudaErrorIllegalAddress) creating a stream fails, while a query of the faulted
    kernel's event may go on answering "not ready" (under MPS, after a peer's death; see
    docs/lab/source-notes.md). The call runs in a thread (on `device`), so a CUDA call that blocks cannot
    stop the caller; raw runtime calls, no CuPy object whose destructor would print a traceback in a
    faulted context."""
    global _probe_thread
    rt = optional.cupy().cuda.runtime
    if getattr(rt, "streamCreateWithFlags", None) is None:  # a runtime without it (a fake): no probe
        return None
    if _probe_thread is not None and _probe_thread.is_alive():
        return KcclError("a CUDA call (cudaStreamCreate) has not returned for over "
                         f"{wait_s:g} s")
    out = []

    def probe():
        try:
            if device is not None:
                rt.setDevice(device)
            s = rt.streamCreateWithFlags(1)  # cudaStreamNonBlocking
            rt.streamDestroy(s)
            out.append(None)
        except Exception as exc:  # noqa: BLE001 - CUDARuntimeError, whatever the binding raises
            out.append(exc)

    t = threading.Thread(target=probe, name="kccl-cuda-probe", daemon=True)
    t.start()
    t.join(wait_s)
    if t.is_alive():
        _probe_thread = t
        return KcclError(f"a CUDA call (cudaStreamCreate) did not return within {wait_s:g} s")
    return out[0]


def one_line(exc) -> str:
    text = str(exc).strip()
    return (text.splitlines()[0] if text else type(exc).__name__)[:300]


class CudaCommunicator(CudaCore):
    """Ranks on GPUs of one host exchanging device buffers through CUDA IPC windows.

    Build with `kccl.Communicator.create(mpi_comm, transport="cuda_ipc", ...)` or
    `CudaCommunicator.create(...)`, with each rank's CuPy device already selected. One thread per rank.
    """

    _lost = None        # the dead peer the pid monitor found (watch)
    _lost_at = None     # when (perf_counter)
    _failed_at = None   # when check_kernel first saw a kccl error in the status words
    _next_probe = 0.0

    def watch(self) -> int | None:
        """Call every ~0.1 s while a kernel of yours runs: if a peer process died, raise the abort word
        (every kccl wait in the kernel gives up, status KCCL_ERR_ABORTED) and return its rank.
        check_kernel() does this and also stops waiting for a kernel that will not end."""
        dead = self._lost if self._lost is not None else self._dead_peer()
        if dead is not None:
            if self._lost is None:
                self._lost, self._lost_at = dead, time.perf_counter()
            if self._abort is not None and not self._abort.value:
                self._abort.value = 1
        return dead

    def check_kernel(self, what: str, stalled_s: float) -> None:
        """Call every ~0.1 s while a kernel of yours that uses kccl runs, with the seconds since it last
        showed progress (tokens, or since launch). Raises the abort word when a peer died (watch), and
        raises instead of waiting on when the kernel will not end by itself:
        - a peer died: PeerLost as soon as the CUDA context is found faulted (under MPS a dead client's
          memory goes away and the survivors' kernels fault on their next store into its window; the
          fault kills them, so they never read the abort word), or when the kernel is still running
          ABORT_GRACE_S after the abort word (a kernel that ignores it: a bug; the message says so);
        - a kernel wait failed (status words) but the kernel did not leave within ABORT_GRACE_S: that
          error (KcclTimeout, ...), saying the kernel is still running;
        - no progress for STALL_PROBE_S and the context faulted: fault() (PeerLost when a peer died).
        After a raise the communicator is unusable and abandoned: close() leaves the device alone (a
        synchronize would wait forever for a running kernel) and the process should exit."""
        now = time.perf_counter()
        dead = self.watch()
        if dead is not None:
            exc = context_error(self.device)
            if exc is not None:
                raise self.fault(exc, what)
            if now - self._lost_at > ABORT_GRACE_S:
                raise self._abandon(self._peer_lost(
                    dead, what, f"its kernel is still running {ABORT_GRACE_S:g} s after the abort word"))
            return
        if self._status is not None and self._status[0]:
            if self._failed_at is None:
                self._failed_at = now
            elif now - self._failed_at > ABORT_GRACE_S:
                cls, msg = describe_status(self._status, self.layout.channels, self.timeout)
                raise self._abandon(cls(f"{msg} (in {what}; its kernel is still running "
                                        f"{ABORT_GRACE_S:g} s after the error)"))
        if stalled_s > STALL_PROBE_S and now >= self._next_probe:
            self._next_probe = now + PROBE_EVERY_S
            exc = context_error(self.device)
            if exc is not None:
                raise self.fault(exc, what)

    def fault(self, exc, what: str) -> KcclError:
        """The error to raise for CUDA error `exc` met while a kernel of this rank ran: PeerLost naming a
        dead peer (waiting up to ABORT_GRACE_S for one to show: the fault may come before the dead
        process is a zombie), else the kccl error its status words hold, else KcclError. Marks the
        communicator unusable and abandoned (see check_kernel)."""
        dead = self.watch()
        t_end = time.perf_counter() + ABORT_GRACE_S
        while dead is None and time.perf_counter() < t_end:
            time.sleep(0.02)
            dead = self.watch()
        msg = one_line(exc)
        if dead is not None:
            err = self._peer_lost(dead, what, f"then this rank's CUDA context failed: {msg}")
        elif self._status is not None and self._status[0]:
            cls, smsg = describe_status(self._status, self.layout.channels, self.timeout)
            err = cls(f"{smsg} (in {what}; then the CUDA context failed: {msg})")
        else:
            err = KcclError(f"rank {self.rank}: CUDA error in {what}, every peer alive: {msg}")
        return self._abandon(err)

    def raise_for_status(self, what: str = "kernel") -> None:
        """After a kernel of yours ended: raise PeerLost/KcclTimeout/KcclError if a kccl wait failed."""
        if self._status[0] or self._abort.value:
            dead = self._lost if self._lost is not None else self._dead_peer()
            if dead is not None:
                err = self._peer_lost(dead, what)
            else:
                cls, msg = describe_status(self._status, self.layout.channels, self.timeout)
                err = cls(f"{msg} (in {what})")
            self._error = err
            raise err

    def _peer_lost(self, dead: int, what: str, note: str = "") -> PeerLost:
        pid = self.peers[dead][0]
        return PeerLost(f"rank {dead} (pid {pid}) exited (noticed by rank {self.rank} in {what}"
                        + (f"; {note})" if note else ")"), rank=dead, pid=pid)

    def _abandon(self, err: KcclError) -> KcclError:
        self._error = err
        self.abandoned = True
        if self._abort is not None:
            self._abort.value = 1  # a kernel of ours that still reads it leaves
        return err

    def _finish(self, what: str) -> None:
        """Wait for the launched kernel; watch the peers' processes; turn status words into errors."""
        stream = self._stream
        t0 = time.perf_counter()
        next_check = t0 + 0.1
        sleep = 0.0
        while True:
            try:
                if stream.done:
                    break
            except Exception as exc:  # noqa: BLE001 - a faulted context (e.g. a peer window gone)
                raise self.fault(exc, what) from exc
            now = time.perf_counter()
            if now - t0 > 200e-6:
                sleep = min(max(sleep * 2, 20e-6), 1e-3)
                time.sleep(sleep)
            if now > next_check:
                next_check = now + 0.1
                self.check_kernel(what, now - t0)
        self.raise_for_status(what)

    def _dead_peer(self):
        for r, (pid, start) in enumerate(self.peers):
            if r != self.rank and peer_gone(pid, start):
                return r
        return None


def cupy_missing() -> str | None:
    """Why this machine cannot run the transport (None: CuPy imports and sees a GPU)."""
    try:
        if optional.cupy().cuda.runtime.getDeviceCount() < 1:
            return "no CUDA device is visible"
    except Exception as exc:  # noqa: BLE001 - ImportError, CUDA driver errors
        return f"{type(exc).__name__}: {exc}"
    return None


def create_or_explain(mpi_comm=None, **kw) -> CudaCommunicator:
    """CudaCommunicator.create, or NotImplementedError where CuPy/a GPU is missing (the device code
    cannot be built here)."""
    why = cupy_missing()
    if why is not None:
        raise NotImplementedError(f"kccl transport 'cuda_ipc' needs CuPy and a CUDA GPU, and this "
                                  f"machine has none ({why}); use transport='shm'")
    return CudaCommunicator.create(mpi_comm, **kw)


create = create_or_explain


__all__ = ["CudaCommunicator", "context_error", "create", "create_or_explain", "cupy_missing", "one_line",
           "peer_gone"]

