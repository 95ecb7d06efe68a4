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
"""

from __future__ import annotations

import ctypes
import os
import struct
import time
import zlib

import numpy as np

from . import layout as L
from .cuda_source import inline_sources
from .errors import KcclError, KcclTimeout, PeerLost
from .shm import process_alive, process_starttime, register, unregister

HERE = os.path.dirname(os.path.abspath(__file__))
DEVICE_DIR = os.path.join(HERE, "device")

# ---- constants shared with kccl.cuh (checked by tests/test_kccl_cuda.py) ---------------------------
MAX_RANKS = 8
MAX_CH = 8
MAX_DEPTH = 16
LINE = 128
META_BYTES = 64
HEADER_BYTES = 4096
MAGIC = 0x4B43434C47505531  # "KCCLGPU1"
VERSION = 1
DEV_WORDS = 36
STATUS_WORDS = 8
(ERR_TIMEOUT_FLAG, ERR_TIMEOUT_ACK, ERR_ABORTED, ERR_OP_MISMATCH, ERR_SIZE_MISMATCH,
 ERR_EPOCH) = range(1, 7)
# kccl_op modes and ops
M_POST, M_WAIT, M_SUM, M_COPY, M_ACK = 1, 2, 4, 8, 16
OP_ALLREDUCE, OP_BROADCAST, OP_BARRIER, OP_POST = 1, 2, 3, 4
OP_NAMES = {OP_ALLREDUCE: "allreduce", OP_BROADCAST: "broadcast", OP_BARRIER: "barrier", OP_POST: "post"}
COLL = 0
COLL_DEPTH = 2
THREADS = 256


def round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def ring_index(epoch: int, depth: int) -> int:
    return L.ring_index(epoch, depth)


def ack_needed(epoch: int, depth: int) -> int:
    return L.ack_needed(epoch, depth)


def last_arrival(counter: int, nchunks: int) -> tuple[bool, int]:
    """One block's arrival at a ring slot's counter (kccl.cuh kccl_arrive_last): (is it the last of
    `nchunks`, the counter afterwards: reset to 0 by the last one before it publishes)."""
    if nchunks < 1:
        raise ValueError("nchunks >= 1")
    counter += 1
    return (True, 0) if counter == nchunks else (False, counter)


ERROR_WORD_OFFSET = 256  # int in the window header: the rank's first error, claimed on the device

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
    kernel's event may go on answering "not ready": seen on the H200 under MPS (4 ranks on one GPU, one
    SIGKILLed mid-decode: the survivors' event queries said "not ready" for 20 s, then a
    cudaStreamCreate raised cudaErrorIllegalAddress). The call runs in a thread (on `device`), so a
    CUDA call that blocks cannot stop the caller; raw runtime calls, no CuPy object whose destructor
    would print a traceback in a faulted context."""
    global _probe_thread
    import threading

    import cupy as cp

    rt = cp.cuda.runtime
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


class CudaLayout:
    """Byte offsets inside one rank's window (identical in every window); mirrors kccl.cuh.

    channels: ((name, depth), ...), "_coll" (the host collectives, depth 2) first, then the DTP tags.
    payload_bytes: the largest payload of one slot (rounded up to 16).
    """

    def __init__(self, nranks: int, payload_bytes: int, channels):
        channels = tuple((str(n), int(d)) for n, d in channels)
        if not 1 <= nranks <= MAX_RANKS:
            raise ValueError(f"cuda_ipc supports 1..{MAX_RANKS} ranks (KCCL_MAX_RANKS), not {nranks}")
        if not 1 <= len(channels) <= MAX_CH:
            raise ValueError(f"cuda_ipc supports at most {MAX_CH} channels (collectives + tags)")
        for name, depth in channels:
            if not 1 <= depth <= MAX_DEPTH:
                raise ValueError(f"channel {name!r}: depth {depth} outside 1..{MAX_DEPTH}")
        if payload_bytes < 1 or payload_bytes >= 1 << 32:
            raise ValueError("payload_bytes must be in 1 .. 2**32 - 1")
        self.nranks, self.channels = nranks, channels
        self.payload_bytes = round_up(payload_bytes, 16)
        self.slot_bytes = round_up(META_BYTES + self.payload_bytes, LINE)
        nch = len(channels)
        self.off_flags = HEADER_BYTES
        self.off_acks = self.off_flags + nch * nranks * LINE
        self.off_cnt = self.off_acks + nch * nranks * LINE
        off = self.off_cnt + 2 * MAX_CH * MAX_DEPTH * LINE
        self.slot_off = []
        for _, depth in channels:
            self.slot_off.append(off)
            off += nranks * depth * self.slot_bytes
        self.size = round_up(off, 1 << 16)

    def depth(self, c: int) -> int:
        return self.channels[c][1]

    def flag_offset(self, c: int, src: int) -> int:
        """flag[c][src] in a receiver's window: the last epoch `src` published on channel c."""
        return self.off_flags + (c * self.nranks + src) * LINE

    def ack_offset(self, c: int, by: int) -> int:
        """ack[c][by] in a sender's window: the last of its epochs rank `by` consumed on channel c."""
        return self.off_acks + (c * self.nranks + by) * LINE

    def counter_offset(self, kind: int, c: int, ring: int) -> int:
        return self.off_cnt + ((kind * MAX_CH + c) * MAX_DEPTH + ring) * LINE

    def slot_offset(self, c: int, src: int, epoch: int) -> int:
        """Start (meta) of the slot holding `src`'s `epoch` of channel c; payload at + META_BYTES."""
        depth = self.depth(c)
        return self.slot_off[c] + (src * depth + ring_index(epoch, depth)) * self.slot_bytes

    @property
    def layout_hash(self) -> int:
        text = f"cuda{VERSION}|{self.nranks}|{self.payload_bytes}|{self.channels!r}"
        return zlib.crc32(text.encode()) | (VERSION << 32)

    def header_words(self, rank: int) -> np.ndarray:
        return np.array([MAGIC, VERSION, rank, self.nranks, self.layout_hash, self.size, 0, 0], np.uint64)

    def dev_words(self, bases, rank: int, status_ptr: int, abort_ptr: int, timeout_ns: int) -> np.ndarray:
        """The KcclDev struct of kccl.cuh as 36 uint64 words (bases[r]: rank r's window here)."""
        w = np.zeros(DEV_WORDS, np.uint64)
        for r, b in enumerate(bases):
            w[r] = b
        w[8:20] = [rank, self.nranks, len(self.channels), self.slot_bytes, self.payload_bytes,
                   self.off_flags, self.off_acks, self.off_cnt, status_ptr, abort_ptr,
                   min(int(timeout_ns), (1 << 63) - 1), MAGIC]
        for c, (_, depth) in enumerate(self.channels):
            w[20 + c] = depth
            w[28 + c] = self.slot_off[c]
        return w


# ---- handle exchange --------------------------------------------------------------------------------
RECORD = struct.Struct("<QIIQQQQ64s16s")  # magic, version, rank, layout hash, pid, starttime, size,
RECORD_BYTES = RECORD.size                # IPC handle, PCI bus id of the device: 128 bytes
assert RECORD_BYTES == 128


def pack_record(rank: int, layout_hash: int, pid: int, starttime: int, size: int, handle: bytes,
                bus_id: str) -> bytes:
    if len(handle) != 64:
        raise ValueError("a CUDA IPC memory handle is 64 bytes")
    return RECORD.pack(MAGIC, VERSION, rank, layout_hash, pid, starttime, size, handle,
                       bus_id.encode("ascii")[:16])


def unpack_record(buf: bytes) -> dict:
    if len(buf) != RECORD_BYTES:
        raise KcclError(f"handle record of {len(buf)} bytes (expected {RECORD_BYTES})")
    magic, version, rank, lhash, pid, start, size, handle, bus = RECORD.unpack(bytes(buf))
    if magic != MAGIC or version != VERSION:
        raise KcclError("not a kccl cuda_ipc handle record (magic/version)")
    return {"rank": rank, "layout_hash": lhash, "pid": pid, "starttime": start, "size": size,
            "handle": handle, "bus_id": bus.rstrip(b"\0").decode("ascii", "replace")}


def allgather_bytes(rdv, data: bytes) -> list[bytes]:
    """Every rank's `data` (equal lengths), by rank: one MPI Allgather of uint8, or files."""
    comm = getattr(rdv, "comm", None)
    if comm is not None:
        send = np.frombuffer(bytes(data), dtype=np.uint8)
        recv = np.empty(send.size * rdv.size, dtype=np.uint8)
        comm.Allgather(send, recv)
        return [recv[r * send.size:(r + 1) * send.size].tobytes() for r in range(rdv.size)]
    return [bytes.fromhex(t) for t in rdv._all(bytes(data).hex())]  # FileRendezvous


def check_records(records: list[dict], lay: CudaLayout) -> None:
    for r, rec in enumerate(records):
        if rec["rank"] != r:
            raise KcclError(f"handle record {r} says rank {rec['rank']}")
        if rec["layout_hash"] != lay.layout_hash or rec["size"] != lay.size:
            raise KcclError(f"rank {r}'s layout differs (max_floats, depth, tags and nranks must match "
                            "on every rank)")


def describe_status(st, channels, timeout: float) -> tuple[type, str]:
    """(exception class, message) for the status words a kernel wrote."""
    code, rank, peer, c, epoch, seen = (int(x) for x in st[:6])
    ch = channels[c][0] if 0 <= c < len(channels) else c
    where = f"on channel {ch!r} epoch {epoch}"
    if code == ERR_TIMEOUT_FLAG:
        return KcclTimeout, (f"rank {rank} timed out after {timeout:g} s waiting for rank {peer}'s data "
                             f"{where} (its flag reads {seen}): rank {peer} is hung, dead or in another op")
    if code == ERR_TIMEOUT_ACK:
        return KcclTimeout, (f"rank {rank} timed out after {timeout:g} s waiting for rank {peer} to free "
                             f"a slot {where} (ack reads {seen})")
    if code == ERR_ABORTED:
        return PeerLost, f"rank {rank} gave up a wait {where}: a peer process exited"
    if code == ERR_OP_MISMATCH:
        return KcclError, (f"rank {rank} {where}: rank {peer} sent {OP_NAMES.get(seen, seen)}: the ranks "
                           "called kccl ops in different orders")
    if code == ERR_SIZE_MISMATCH:
        return KcclError, f"rank {rank} {where}: rank {peer} sent {seen} bytes, a different size"
    if code == ERR_EPOCH:
        return KcclError, f"rank {rank} {where}: rank {peer}'s slot holds epoch {seen} (protocol bug)"
    return KcclError, f"rank {rank}: kccl kernel error code {code}"


# ---- device code ----------------------------------------------------------------------------------
def device_source() -> str:
    """kccl_ops.cu + kccl_test.cu with kccl.cuh inlined once (CuPy's cache keys on the source text)."""
    return inline_sources([os.path.join(DEVICE_DIR, f) for f in ("kccl_ops.cu", "kccl_test.cu")])


_modules: dict = {}


def _module():
    import cupy as cp

    dev = cp.cuda.Device().id
    if dev not in _modules:
        _modules[dev] = cp.RawModule(code=device_source(), options=("-std=c++17",), backend="nvrtc")
    return _modules[dev]


# ---- the communicator -------------------------------------------------------------------------------
class CudaHandle:
    """What CudaCommunicator.post() returns; collect() takes it."""

    __slots__ = ("tag", "channel", "epoch", "shape", "dtype")

    def __init__(self, tag, channel, epoch, shape, dtype):
        self.tag, self.channel, self.epoch, self.shape, self.dtype = tag, channel, epoch, shape, dtype

    def __repr__(self) -> str:
        return f"CudaHandle({self.tag!r}, epoch={self.epoch}, shape={self.shape})"


class _Chan:
    __slots__ = ("id", "name", "depth", "send_epoch", "collected")

    def __init__(self, cid, name, depth):
        self.id, self.name, self.depth = cid, name, depth
        self.send_epoch = 0
        self.collected = 0


class _Closer:
    """What the shm cleanup registry (atexit, signal handlers, close_all) closes: close(), never the
    collective shutdown() (peers may be gone or busy)."""

    def __init__(self, comm):
        self.comm = comm

    def close(self):
        self.comm.close()


class CudaCommunicator:
    """Ranks on GPUs of one host exchanging device buffers through CUDA IPC windows.

    Build with `kccl.Communicator.create(mpi_comm, transport="cuda_ipc", ...)` or
    `CudaCommunicator.create(...)`, with each rank's CuPy device already selected. One thread per rank.
    """

    _lost = None        # the dead peer the pid monitor found (watch)
    _lost_at = None     # when (perf_counter)
    _failed_at = None   # when check_kernel first saw a kccl error in the status words
    _next_probe = 0.0
    abandoned = False   # a kernel of this rank may still run or its context faulted: close() frees nothing

    def __init__(self):
        self.closed = True  # until create() finishes
        self._closer = None
        self._own = 0
        self._opened: list[int] = []
        self._host = 0

    @classmethod
    def create(cls, mpi_comm=None, *, max_floats: int = 1 << 16, depth: int = 4,
               tags=("attn", "mlp"), timeout: float = 30.0) -> "CudaCommunicator":
        """Collective over `mpi_comm` (None: MPI.COMM_WORLD; or a kccl.FileRendezvous).

        max_floats: slot capacity in float32 (4*max_floats bytes: 2*max_floats fp16). depth: ring
        slots per DTP tag (>= delta+1). timeout: bound of every wait inside a kernel (s).
        """
        import cupy as cp

        from .rendezvous import as_rendezvous

        from .communicator import check_create_args
        tags = check_create_args(depth, max_floats, tags)
        rdv = as_rendezvous(mpi_comm)
        lay = CudaLayout(rdv.size, 4 * max_floats, (("_coll", COLL_DEPTH),) + tuple((t, depth) for t in tags))
        self = cls()
        self.rank, self.size, self.tags, self.depth = rdv.rank, rdv.size, tags, depth
        self.max_floats, self.timeout, self.layout = max_floats, float(timeout), lay
        self._rdv = rdv
        self._chans = [_Chan(c, n, d) for c, (n, d) in enumerate(lay.channels)]
        self._by_tag = {ch.name: ch for ch in self._chans[1:]}
        rt = cp.cuda.runtime
        error = None
        records = None
        try:
            self.device = cp.cuda.Device().id
            self._own = rt.malloc(lay.size)  # outside CuPy's pool: IPC needs the allocation's base
            rt.memset(self._own, 0, lay.size)
            hdr = lay.header_words(self.rank)
            rt.memcpy(self._own, hdr.ctypes.data, hdr.nbytes, rt.memcpyHostToDevice)
            self._host = rt.hostAlloc(4096, 1 | 2)  # portable | mapped: status words + abort word
            ctypes.memset(self._host, 0, 4096)
            self._status = (ctypes.c_int * STATUS_WORDS).from_address(self._host)
            self._abort = ctypes.c_int.from_address(self._host + 64)
            handle = rt.ipcGetMemHandle(self._own)
            rec = pack_record(self.rank, lay.layout_hash, os.getpid(), process_starttime(os.getpid()),
                              lay.size, handle, rt.deviceGetPCIBusId(self.device))
        except Exception as exc:  # noqa: BLE001 - reported to every rank below
            error, rec = exc, bytes(RECORD_BYTES)
        try:
            raw = allgather_bytes(rdv, rec)
        except Exception:
            self._free()
            raise
        if not rdv.agree(error is None):
            self._free()
            raise KcclError(f"rank {self.rank}: allocating/exporting the cuda_ipc window failed"
                            + (f": {error}" if error else " on another rank")) from error
        try:
            records = [unpack_record(b) for b in raw]
            check_records(records, lay)
            bases = []
            for r, recd in enumerate(records):
                if r == self.rank:
                    bases.append(self._own)
                    continue
                ptr = rt.ipcOpenMemHandle(recd["handle"])
                self._opened.append(ptr)
                got = np.zeros(8, np.uint64)
                rt.memcpy(got.ctypes.data, ptr, got.nbytes, rt.memcpyDeviceToHost)
                if int(got[0]) != MAGIC or int(got[2]) != r or int(got[4]) != lay.layout_hash:
                    raise KcclError(f"rank {r}'s window does not hold its kccl header after "
                                    "ipcOpenMemHandle")
                bases.append(ptr)
        except Exception as exc:  # noqa: BLE001
            error = exc
        if not rdv.agree(error is None):
            self._free()
            raise KcclError(f"rank {self.rank}: opening peer windows failed"
                            + (f": {error}" if error else " on another rank")) from error
        self.peers = [(rec["pid"], rec["starttime"]) for rec in records]
        self.bus_ids = [rec["bus_id"] for rec in records]
        self.bases = bases
        words = lay.dev_words(bases, self.rank, self._host, self._host + 64, int(min(self.timeout, 1e9) * 1e9))
        self._dev = cp.asarray(words)
        self.dev_ptr = int(self._dev.data.ptr)
        self._mod = _module()
        self._k_op = self._mod.get_function("kccl_op")
        self._k_rounds = self._mod.get_function("kccl_test_rounds")
        self._k_peek = self._mod.get_function("kccl_peek")
        self._error = None
        self.closed = False
        rdv.barrier()  # every rank opened every window before anyone may write into them
        self._closer = _Closer(self)
        register(self._closer)
        return self

    # ---- public --------------------------------------------------------------------------------
    @property
    def status(self) -> list[int]:
        """The host-mapped status words (0 = ok; see kccl.cuh KCCL_ERR_*)."""
        return list(self._status)

    def dev_words(self) -> np.ndarray:
        """The KcclDev struct (36 uint64) for a kernel of this process; dev_ptr is a device copy."""
        return self._dev.get()

    def allreduce(self, x, *, out=None):
        """Sum over ranks of device array `x` (float32 or float16; rank order, fp32 accumulation)."""
        cp = self._cp()
        x = self._payload(x, (cp.float32, cp.float16))
        if out is None:
            out = cp.empty_like(x)
        self._check_out(out, x)
        ch = self._chans[COLL]
        self._run(ch, OP_ALLREDUCE, M_POST | M_WAIT | M_SUM | M_ACK, 0, x, x.nbytes, out, x.nbytes,
                  0 if x.dtype == cp.float32 else 1, x.nbytes, "allreduce")
        return out

    def broadcast(self, x, root: int = 0):
        """Root's device array into `x` on every rank, in place (same shape and dtype everywhere)."""
        if not 0 <= root < self.size:
            raise ValueError(f"root {root} out of range for {self.size} ranks")
        x = self._payload(x, None, contiguous_only=True)
        ch = self._chans[COLL]
        if self.rank == root:
            self._run(ch, OP_BROADCAST, M_POST | M_WAIT | M_ACK, root, x, x.nbytes, x, x.nbytes, 0, -1,
                      "broadcast")
        else:
            self._run(ch, OP_BROADCAST, M_POST | M_WAIT | M_COPY | M_ACK, root, None, 0, x, x.nbytes, 0,
                      -1, f"broadcast from rank {root}")
        return x

    def barrier(self) -> None:
        self._run(self._chans[COLL], OP_BARRIER, M_POST | M_WAIT | M_ACK, 0, None, 0, None, 0, 0, 0,
                  "barrier")

    def post(self, tag: str, x) -> CudaHandle:
        """Send this rank's partial (float32/float16 device array) for `tag`; returns once it is in every
        rank's slot (blocks only while a peer is `depth` epochs behind)."""
        cp = self._cp()
        ch = self._tag(tag)
        if ch.send_epoch - ch.collected >= ch.depth:
            raise KcclError(f"post({tag!r}): {ch.depth} posts are not collected yet; collect the oldest "
                            "before posting again (raise depth for a longer delay)")
        x = self._payload(x, (cp.float32, cp.float16))
        self._run(ch, OP_POST, M_POST, 0, x, x.nbytes, None, 0, 0, 0, f"post {tag!r}")
        return CudaHandle(tag, ch.id, ch.send_epoch, x.shape, x.dtype)

    def collect(self, handle: CudaHandle, *, out=None):
        """Sum over ranks (rank order) of the partials of `handle`'s epoch, as a device array."""
        cp = self._cp()
        ch = self._tag(handle.tag)
        if handle.epoch != ch.collected + 1:
            raise KcclError(f"collect({handle!r}): expected epoch {ch.collected + 1}; collect a tag's "
                            "handles once each, in the order they were posted")
        if out is None:
            out = cp.empty(handle.shape, dtype=handle.dtype)
        if out.shape != tuple(handle.shape) or out.dtype != handle.dtype or not out.flags.c_contiguous:
            raise ValueError(f"out must be a C-contiguous {handle.dtype} array of shape {handle.shape}")
        nbytes = out.nbytes
        self._launch(ch.id, handle.epoch, OP_POST, M_WAIT | M_SUM | M_ACK, 0, None, 0, out, nbytes,
                     0 if out.dtype == cp.float32 else 1, nbytes)
        self._finish(f"collect {handle.tag!r} epoch {handle.epoch}")
        ch.collected = handle.epoch
        return out

    def pending(self, tag: str) -> int:
        ch = self._tag(tag)
        return ch.send_epoch - ch.collected

    # -- for a kernel of the caller (the monokernel) that posts/collects through kccl.cuh itself --
    def channel(self, tag: str) -> int:
        """The channel id `c` a kernel passes to kccl_post/kccl_wait for `tag` (tags in create order: 1, 2...)."""
        return self._tag(tag).id

    def next_epoch(self, tag: str) -> int:
        """The epoch the next post of `tag` must use (a kernel's first epoch on this tag)."""
        ch = self._tag(tag)
        if ch.send_epoch != ch.collected:
            raise KcclError(f"{tag!r} has {ch.send_epoch - ch.collected} uncollected host posts")
        return ch.send_epoch + 1

    def advance(self, tag: str, count: int) -> None:
        """Record that a kernel posted and collected `count` epochs of `tag` (every rank the same)."""
        ch = self._tag(tag)
        ch.send_epoch += count
        ch.collected = ch.send_epoch

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

    def peek(self, channel: int = COLL) -> tuple[list[int], list[int]]:
        """(flags, acks) of `channel` in this rank's window (tests)."""
        cp = self._cp()
        out = cp.zeros(2 * self.size, dtype=cp.uint64)
        self._k_peek((1,), (32,), (np.uint64(self.dev_ptr), np.int32(channel), out), stream=self._stream)
        self._stream.synchronize()
        v = [int(a) for a in out.get()]
        return v[:self.size], v[self.size:]

    def run_rounds(self, tag: str, inputs, rounds: int, *, delta: int = 0, out_rounds: int = 1,
                   nblocks: int = 1, max_delay_ns: int = 0, seed: int = 0):
        """Run the persistent test kernel: `rounds` posts of fp16 inputs[s % len(inputs)] on `tag`,
        each collected `delta` steps later (0: all-reduce per round) into out[r % out_rounds] (fp32).

        Returns (out [out_rounds, n] float32 device array, times [rounds, 6] uint64 numpy: globaltimer
        before post, after post, collect duration; clock64 before post, after post, collect cycles).
        """
        cp = self._cp()
        ch = self._tag(tag)
        if ch.send_epoch != ch.collected:
            raise KcclError(f"run_rounds({tag!r}): collect pending posts first")
        if delta + 1 > ch.depth:
            raise KcclError(f"run_rounds: delta {delta} needs depth >= {delta + 1} (tag has {ch.depth})")
        inputs = cp.ascontiguousarray(cp.asarray(inputs, dtype=cp.float16))
        if inputs.ndim != 2 or inputs.shape[1] * 2 > self.layout.payload_bytes:
            raise ValueError("inputs must be [k, n] fp16 with 2n <= the slot payload")
        n = inputs.shape[1]
        out = cp.zeros((out_rounds, n), dtype=cp.float32)
        times = cp.zeros((rounds, 6), dtype=cp.uint64)
        first = ch.send_epoch + 1
        self._check_usable()
        self._k_rounds((nblocks,), (THREADS,),
                       (np.uint64(self.dev_ptr), np.int32(ch.id), np.uint64(first), np.int32(rounds),
                        np.int32(delta), inputs, np.int32(inputs.shape[0]), out, np.int32(out_rounds),
                        np.int32(n), times, np.int64(max_delay_ns), np.uint64(seed)),
                       stream=self._stream)
        self._finish(f"persistent kernel on {tag!r} (epochs {first}..{first + rounds - 1})")
        ch.send_epoch = ch.collected = first + rounds - 1
        return out, times.get()

    def shutdown(self) -> None:
        """Clean, collective close: wait for this rank's kernels, meet every rank on the host (the
        rendezvous: MPI barrier), then close. Needed because a peer's last kernel may still write an
        ack into this rank's window after this rank's last op returned. `with` ends with this when no
        error occurred. After an error use close() (a peer may be gone)."""
        if self.closed:
            return
        if self._error is None:
            import cupy as cp

            cp.cuda.runtime.deviceSynchronize()
            self._rdv.barrier()
        self.close()

    def close(self) -> None:
        """Close peers' IPC mappings and free this rank's window now. Idempotent, not collective: every
        rank must be done with its kernels first (shutdown() does that), else a peer still writing
        into a freed window is undefined behaviour. Also run at exit for communicators not closed."""
        if self.closed and not self._own and not self._opened and not self._host:
            return
        self.closed = True
        if self._closer is not None:
            unregister(self._closer)
        self._free()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is None and self._error is None:
            self.shutdown()
        else:
            self.close()

    # ---- internals -----------------------------------------------------------------------------
    def _free(self) -> None:
        if self.abandoned:
            # a kernel of this rank may still run (a synchronize, cudaFree or cudaFreeHost would wait
            # for it forever) or the context faulted (every call fails): the process's exit frees all
            self._opened, self._own, self._host = [], 0, 0
            return
        import cupy as cp

        rt = cp.cuda.runtime
        try:
            rt.deviceSynchronize()  # no kernel of ours may still use the mappings
        except Exception:  # noqa: BLE001 - a faulted context: free what we can
            pass
        for ptr in self._opened:
            try:
                rt.ipcCloseMemHandle(ptr)
            except Exception:  # noqa: BLE001
                pass
        self._opened = []
        if self._own:
            try:
                rt.free(self._own)
            except Exception:  # noqa: BLE001
                pass
            self._own = 0
        if self._host:
            self._status = self._abort = None
            try:
                rt.freeHost(self._host)
            except Exception:  # noqa: BLE001
                pass
            self._host = 0

    @property
    def _stream(self):
        """Launches go to the caller's current CuPy stream (ordered with the copies that made the inputs)."""
        import cupy as cp

        return cp.cuda.get_current_stream()

    @staticmethod
    def _cp():
        import cupy as cp

        return cp

    def _check_usable(self) -> None:
        if self._error is not None:
            raise self._error
        if self.closed:
            raise KcclError("communicator is closed")

    def _tag(self, tag: str) -> _Chan:
        self._check_usable()
        try:
            return self._by_tag[tag]
        except KeyError:
            raise KcclError(f"unknown tag {tag!r}; this communicator was created with tags={self.tags}") from None

    def _payload(self, x, dtypes, contiguous_only: bool = False):
        cp = self._cp()
        self._check_usable()
        x = cp.asarray(x)
        if dtypes is not None and x.dtype not in dtypes:
            x = x.astype(cp.float32)
        if not x.flags.c_contiguous or x.data.ptr % 16:
            if contiguous_only:
                raise ValueError("broadcast needs a C-contiguous, 16-byte aligned device array (in place)")
            x = cp.ascontiguousarray(x).copy()
        if x.nbytes > self.layout.payload_bytes:
            raise ValueError(f"payload of {x.nbytes} bytes exceeds the slot ({self.layout.payload_bytes} "
                             "bytes); raise max_floats at create() or split the payload")
        return x

    def _check_out(self, out, x) -> None:
        if out.shape != x.shape or out.dtype != x.dtype or not out.flags.c_contiguous:
            raise ValueError(f"out must be a C-contiguous {x.dtype} array of shape {x.shape}")

    def _run(self, ch, op, mode, root, src, send_bytes, dst, nbytes, dtype, expect, what) -> None:
        e = ch.send_epoch + 1
        self._launch(ch.id, e, op, mode, root, src, send_bytes, dst, nbytes, dtype, expect)
        ch.send_epoch = e
        self._finish(what)
        if ch.id == COLL:
            ch.collected = e

    def _launch(self, c, e, op, mode, root, src, send_bytes, dst, nbytes, dtype, expect) -> None:
        self._check_usable()
        big = max(send_bytes, nbytes)
        nb = max(1, min(32, big // 16384))
        self._k_op((nb,), (THREADS,),
                   (np.uint64(self.dev_ptr), np.int32(c), np.uint64(e), np.int32(op), np.int32(mode),
                    np.int32(root), np.uint64(0 if src is None else src.data.ptr), np.int64(send_bytes),
                    np.uint64(0 if dst is None else dst.data.ptr), np.int64(nbytes), np.int32(dtype),
                    np.int64(expect)),
                   stream=self._stream)

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
        import cupy as cp

        if cp.cuda.runtime.getDeviceCount() < 1:
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


# ---- bench ---------------------------------------------------------------------------------------
def _pct(samples_ns) -> dict:
    a = np.asarray(samples_ns, dtype=np.float64)
    p50, p99 = np.percentile(a, [50, 99]) / 1e3
    return {"p50_us": round(float(p50), 2), "p99_us": round(float(p99), 2)}


def bench_main(args) -> int:
    """`python -m kccl.bench --transport cuda_ipc`: run under MPI (one rank per GPU, or N ranks on one
    GPU under MPS). Rank r uses device r % device_count."""
    import cupy as cp
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    ndev = cp.cuda.runtime.getDeviceCount()
    cp.cuda.Device(world.rank % ndev).use()
    n = args.floats
    iters, warm, delta = args.iters, args.warmup, args.delta
    rows, notes = {}, []
    clock = time.perf_counter_ns
    with CudaCommunicator.create(world, max_floats=n, depth=max(delta + 1, 1), tags=("bench",),
                                 timeout=60.0) as comm:
        rng = np.random.default_rng(comm.rank)
        x = cp.asarray(rng.standard_normal(n).astype(np.float16))
        out = cp.empty_like(x)
        samples = {k: [] for k in ("host allreduce", "host post", f"host collect (delta={delta})",
                                   "host barrier")}
        comm.barrier()
        for i in range(warm + iters):
            t0 = clock()
            comm.allreduce(x, out=out)
            if i >= warm:
                samples["host allreduce"].append(clock() - t0)
        comm.barrier()
        handles = []
        for i in range(warm + iters + delta):
            t0 = clock()
            if i < warm + iters:
                handles.append(comm.post("bench", x))
            t1 = clock()
            if len(handles) > delta or i >= warm + iters:
                comm.collect(handles.pop(0), out=out)
            t2 = clock()
            if warm <= i < warm + iters:
                samples["host post"].append(t1 - t0)
            if warm + delta <= i:
                samples[f"host collect (delta={delta})"].append(t2 - t1)
        comm.barrier()
        for i in range(warm + iters):
            t0 = clock()
            comm.barrier()
            if i >= warm:
                samples["host barrier"].append(clock() - t0)
        # inside one persistent kernel
        inputs = cp.asarray(rng.standard_normal((8, n)).astype(np.float16))
        spans = {}
        runs = [("kernel allreduce", 0, 1), ("kernel allreduce 4 blocks", 0, 4)]
        if delta > 0:
            runs.append((f"kernel post/collect (delta={delta})", delta, 1))
        for label, dl, nb in runs:
            comm.barrier()
            _, times = comm.run_rounds("bench", inputs, warm + iters, delta=dl, nblocks=nb)
            t = times[warm:].astype(np.int64)
            post, coll = t[:, 1] - t[:, 0], t[:, 2]
            if dl == 0:
                samples[label] = list(post + coll)
            else:
                samples[label + " post"] = list(post)
                samples[label + " collect"] = list(coll)
                samples[label + " pair"] = list(post + coll)
            spans[label] = float(t[-1, 0] - t[0, 0]) / max(1, len(t) - 1)
        # NCCL beside it
        nccl_note = None
        distinct = len(set(comm.bus_ids)) == comm.size
        if comm.size > 1 and not distinct:
            nccl_note = (f"NCCL: not run: the {comm.size} ranks share one GPU ({comm.bus_ids[0]}); NCCL "
                         "refuses two ranks on one device, so there is no NCCL number for this setup")
        else:
            try:
                from cupy.cuda import nccl

                uid = world.bcast(nccl.get_unique_id() if comm.rank == 0 else None, root=0)
                nc = nccl.NcclCommunicator(comm.size, uid, comm.rank)
                s = cp.cuda.Stream(non_blocking=True)
                lat = []
                for i in range(warm + iters):
                    t0 = clock()
                    nc.allReduce(x.data.ptr, out.data.ptr, n, nccl.NCCL_FLOAT16, nccl.NCCL_SUM, s.ptr)
                    s.synchronize()
                    if i >= warm:
                        lat.append(clock() - t0)
                samples["NCCL allreduce (host)"] = lat
            except Exception as exc:  # noqa: BLE001
                nccl_note = f"NCCL: not run: {type(exc).__name__}: {exc}"
        comm.barrier()
    rows = {}
    for k, v in samples.items():
        local = np.asarray(v, dtype=np.int64)
        allv = world.gather(local, root=0)  # host ints, after the timed loops
        if world.rank == 0:
            rows[k] = _pct(np.concatenate(allv))
    spans_all = world.gather(spans, root=0)
    if world.rank != 0:
        return 0
    mean_span = {k: round(float(np.mean([s[k] for s in spans_all])) / 1e3, 2) for k in spans}
    report = {"transport": "cuda_ipc", "nranks": world.size, "elements": n, "dtype": "float16",
              "iters": iters, "delta": delta, "devices": sorted(set(comm.bus_ids)),
              "results": rows, "kernel_mean_loop_us": mean_span, "nccl": nccl_note or "ran"}
    if args.json:
        import json

        print(json.dumps(report))
    else:
        print(f"kccl cuda_ipc: {world.size} ranks on {len(set(comm.bus_ids))} GPU(s) {report['devices']}, "
              f"{n} fp16 ({n * 2 / 1024:g} KiB), {iters} iters, delta={delta}")
        print(f"{'op':<44}{'p50 us':>10}{'p99 us':>10}")
        for k, v in rows.items():
            print(f"{k:<44}{v['p50_us']:>10.2f}{v['p99_us']:>10.2f}")
        for k, v in mean_span.items():
            print(f"mean loop period of {k}: {v:.2f} us (globaltimer over all rounds)")
        if nccl_note:
            print(nccl_note)
    return 0


__all__ = ["CudaCommunicator", "CudaHandle", "CudaLayout", "create", "last_arrival", "pack_record",
           "unpack_record", "allgather_bytes", "describe_status", "device_source", "bench_main"]
