"""kccl `cuda_ipc`: what one rank's device window holds and how the ranks describe it to each other.

The constants shared with kccl/device/kccl.cuh (checked by tests/test_kccl_cuda.py), `CudaLayout`
(byte offsets inside a window; the KcclDev words a kernel gets), the fixed 128-byte handle records
the ranks exchange at create (`pack_record` / `unpack_record` / `allgather_bytes` / `check_records`),
`describe_status` (the status words a kernel wrote, as an exception class and a message) and the
device code (kccl_ops.cu + kccl_test.cu, built once per device by `_module`). Host arithmetic only:
nothing here touches CuPy except `_module`. Import these names from here.
"""

from __future__ import annotations

import os
import struct
import zlib

import numpy as np

from . import layout as L
from . import optional
from .cuda_source import inline_sources
from .errors import KcclError, KcclTimeout, PeerLost

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


def agree_or_raise(rdv, rank: int, error: Exception | None, what: str, cleanup) -> None:
    """Collective: every rank learns whether `what` worked on all of them; if not, every rank runs
    `cleanup` and raises KcclError with its own error (or "on another rank")."""
    if not rdv.agree(error is None):
        cleanup()
        raise KcclError(f"rank {rank}: {what} failed" + (f": {error}" if error else " on another rank")) from error


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
    cp = optional.cupy()
    dev = cp.cuda.Device().id
    if dev not in _modules:
        _modules[dev] = cp.RawModule(code=device_source(), options=("-std=c++17",), backend="nvrtc")
    return _modules[dev]

