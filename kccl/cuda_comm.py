"""kccl `cuda_ipc`: the communicator's core: one rank's window, the kernels launched on it, close.

`CudaCore.create` allocates the rank's device window (cudaMalloc, outside CuPy's pool) and the
host-mapped status and abort words, exports the window with cudaIpcGetMemHandle, exchanges the handle
records, opens and checks every peer's window; `shutdown` / `close` undo it. The host collectives
(`allreduce / broadcast / barrier / post / collect`) each launch one kccl_op kernel (kccl_ops.cu) on
the caller's stream; `channel / next_epoch / advance / dev_words` serve a kernel of the caller (the
monokernel) that posts and collects through kccl.cuh itself; `peek` and `run_rounds` (the persistent
test kernel, kccl_test.cu) serve the tests and `python -m kccl.bench --transport cuda_ipc`.

Waiting for a launched kernel (`_finish`) and everything about dead peers and faulted CUDA contexts
(`watch`, `check_kernel`, `fault`, `raise_for_status`) live in kccl/cuda_ipc.py, whose
`CudaCommunicator` adds them to `CudaCore`: use that class, not this one.
"""

from __future__ import annotations

import ctypes
import os
from types import SimpleNamespace

import numpy as np

from . import optional
from .cuda_layout import (COLL, COLL_DEPTH, M_ACK, M_COPY, M_POST, M_SUM, M_WAIT, MAGIC, OP_ALLREDUCE,
                          OP_BARRIER, OP_BROADCAST, OP_POST, RECORD_BYTES, STATUS_WORDS, THREADS,
                          CudaLayout, _module, agree_or_raise, allgather_bytes, check_records, pack_record,
                          unpack_record)
from .cuda_shared import release_ipc
from .errors import KcclError, unknown_tag
from .layout import check_create_args
from .rendezvous import as_rendezvous
from .shm import process_starttime, register, unregister


class CudaHandle:
    """What CudaCommunicator.post() returns; collect() takes it."""

    __slots__ = ("tag", "channel", "epoch", "shape", "dtype")

    def __init__(self, tag, channel, epoch, shape, dtype):
        self.tag, self.channel, self.epoch, self.shape, self.dtype = tag, channel, epoch, shape, dtype

    def __repr__(self) -> str:
        return f"CudaHandle({self.tag!r}, epoch={self.epoch}, shape={self.shape})"


def op_blocks(nbytes: int, sms: int, ranks_on_gpu: int) -> int:
    """Blocks of one host-API kernel: one per 16 KiB, at most 32; when ranks share a GPU (MPS) at most
    half of their share of its SMs, so every rank's kernel of an op can be resident at once (each waits
    for the others'). 8 ranks x 32 blocks on a 132-SM H200 did not fit: the 2B prefill of `kog bench --np 8`
    timed out at its first piece. The block count may differ between ranks and between epochs."""
    nb = max(1, min(32, nbytes // 16384))
    if ranks_on_gpu > 1 and sms > 0:
        nb = min(nb, max(1, sms // (2 * ranks_on_gpu)))
    return nb


def _at(ptr: int):
    """A device address where _launch expects an array (its .data.ptr): a piece of a larger array."""
    return SimpleNamespace(data=SimpleNamespace(ptr=ptr))


class _Chan:
    __slots__ = ("id", "name", "depth", "send_epoch", "collected", "ll")

    def __init__(self, cid, name, depth):
        self.id, self.name, self.depth = cid, name, depth
        self.send_epoch = 0
        self.collected = 0
        self.ll = None  # protocol of the host calls so far: None (none yet), False (flag), True (LL words)


class _Closer:
    """What the shm cleanup registry (atexit, signal handlers, close_all) closes: close(), never the
    collective shutdown() (peers may be gone or busy)."""

    def __init__(self, comm):
        self.comm = comm

    def close(self):
        self.comm.close()


class CudaCore:
    """What kccl.cuda_ipc.CudaCommunicator does besides waiting for its kernels: allocation, handle
    exchange, mapping, launches, close. `_run`, `collect` and `run_rounds` call `_finish`, which
    CudaCommunicator defines (with the peer watching); not usable on its own.
    """

    abandoned = False   # a kernel of this rank may still run or its context faulted: close() frees nothing

    def __init__(self):
        self.closed = True  # until create() finishes
        self._closer = None
        self._own = 0
        self._opened: list[int] = []
        self._host = 0

    @classmethod
    def create(cls, mpi_comm=None, *, max_floats: int = 1 << 16, depth: int = 4,
               tags=("attn", "mlp"), timeout: float = 30.0) -> "CudaCore":
        """Collective over `mpi_comm` (None: MPI.COMM_WORLD; or a kccl.FileRendezvous).

        max_floats: slot capacity in float32 (4*max_floats bytes: 2*max_floats fp16). depth: ring
        slots per DTP tag (>= delta+1). timeout: bound of every wait inside a kernel (s).
        """
        cp = optional.cupy()
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
            # a pageable-to-device copy may return before it lands: the peers read the header next
            rt.deviceSynchronize()
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
        agree_or_raise(rdv, self.rank, error, "allocating/exporting the cuda_ipc window", self._free)
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
                    raise KcclError(f"rank {r}'s window does not hold its kccl header after ipcOpenMemHandle "
                                    f"(read magic {int(got[0]):#x}, rank {int(got[2])}, layout {int(got[4]):#x})")
                bases.append(ptr)
        except Exception as exc:  # noqa: BLE001
            error = exc
        agree_or_raise(rdv, self.rank, error, "opening peer windows", self._free)
        self.peers = [(rec["pid"], rec["starttime"]) for rec in records]
        self.bus_ids = [rec["bus_id"] for rec in records]
        self.bases = bases
        words = lay.dev_words(bases, self.rank, self._host, self._host + 64, int(min(self.timeout, 1e9) * 1e9))
        self._dev = cp.asarray(words)
        self.dev_ptr = int(self._dev.data.ptr)
        self._mod = _module()
        self._k_op = self._mod.get_function("kccl_op")
        self._k_rounds = self._mod.get_function("kccl_test_rounds")
        self._k_ll_rounds = self._mod.get_function("kccl_test_ll_rounds")
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

    def allreduce_pieces(self, x, piece: int | None = None):
        """In place: a contiguous float32/float16 device array of any length summed over ranks, in pieces of
        at most `piece` elements (default: a slot). Every piece's kernel is queued on the stream at once and
        the host waits once: the multi-rank prefill makes thousands of pieces, and a host wait for each
        cost more than its copy (docs/lab/source-notes.md)."""
        cp = self._cp()
        self._check_usable()
        if x.dtype not in (cp.float32, cp.float16) or not x.flags.c_contiguous or x.data.ptr % 16:
            raise ValueError("allreduce_pieces needs a C-contiguous, 16-byte aligned float32/float16 device array")
        isz = np.dtype(x.dtype).itemsize
        piece = min(self.layout.payload_bytes // isz, piece or 1 << 62) // 8 * 8    # pieces stay 16-byte aligned
        if piece < 8:
            raise ValueError(f"allreduce_pieces: pieces of {piece} elements (8 at least)")
        ch, total = self._chans[COLL], x.nbytes // isz
        for a in range(0, total, piece):
            v = _at(x.data.ptr + a * isz)
            nbytes = min(piece, total - a) * isz
            e = ch.send_epoch + 1
            self._launch(ch.id, e, OP_ALLREDUCE, M_POST | M_WAIT | M_SUM | M_ACK, 0, v, nbytes, v, nbytes,
                         0 if x.dtype == cp.float32 else 1, nbytes)
            ch.send_epoch = e
        self._finish("allreduce")
        ch.collected = ch.send_epoch
        return x

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
        self._protocol(ch, False)
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

    def peek(self, channel: int = COLL) -> tuple[list[int], list[int]]:
        """(flags, acks) of `channel` in this rank's window (tests)."""
        cp = self._cp()
        out = cp.zeros(2 * self.size, dtype=cp.uint64)
        self._k_peek((1,), (32,), (np.uint64(self.dev_ptr), np.int32(channel), out), stream=self._stream)
        self._stream.synchronize()
        v = [int(a) for a in out.get()]
        return v[:self.size], v[self.size:]

    def run_rounds(self, tag: str, inputs, rounds: int, *, delta: int = 0, out_rounds: int = 1,
                   nblocks: int = 1, max_delay_ns: int = 0, seed: int = 0, ll: bool = False):
        """Run the persistent test kernel: `rounds` posts of fp16 inputs[s % len(inputs)] on `tag`,
        each collected `delta` steps later (0: all-reduce per round) into out[r % out_rounds] (fp32).

        ll=True: kccl_test_ll_rounds, an all-reduce per round through LL words (no fence, flag or ack;
        delta 0, n even, depth >= 2, n / 2 words of 8 bytes in a slot; every rank must pass the same
        nblocks). A tag run with ll=True carries LL words only: the flag protocol (post, run_rounds
        without ll) is refused on it, and the other way round.

        Returns (out [out_rounds, n] float32 device array, times [rounds, 6] uint64 numpy: globaltimer
        before post, after post, collect duration; clock64 before post, after post, collect cycles).
        """
        cp = self._cp()
        ch = self._tag(tag)
        if ch.send_epoch != ch.collected:
            raise KcclError(f"run_rounds({tag!r}): collect pending posts first")
        if ll and delta != 0:
            raise ValueError(f"run_rounds(ll=True) is an all-reduce per round: delta must be 0, not {delta}")
        if delta + 1 > ch.depth:
            raise KcclError(f"run_rounds: delta {delta} needs depth >= {delta + 1} (tag has {ch.depth})")
        inputs = cp.ascontiguousarray(cp.asarray(inputs, dtype=cp.float16))
        if inputs.ndim != 2 or inputs.shape[1] * 2 > self.layout.payload_bytes:
            raise ValueError("inputs must be [k, n] fp16 with 2n <= the slot payload")
        n = inputs.shape[1]
        if ll:
            self._check_ll(ch, n)
        self._protocol(ch, ll)
        out = cp.zeros((out_rounds, n), dtype=cp.float32)
        times = cp.zeros((rounds, 6), dtype=cp.uint64)
        first = ch.send_epoch + 1
        self._check_usable()
        kernel = self._k_ll_rounds if ll else self._k_rounds
        kernel((nblocks,), (THREADS,),
               (np.uint64(self.dev_ptr), np.int32(ch.id), np.uint64(first), np.int32(rounds),
                np.int32(delta), inputs, np.int32(inputs.shape[0]), out, np.int32(out_rounds),
                np.int32(n), times, np.int64(max_delay_ns), np.uint64(seed)),
               stream=self._stream)
        what = "persistent LL kernel" if ll else "persistent kernel"
        self._finish(f"{what} on {tag!r} (epochs {first}..{first + rounds - 1})")
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
            cp = optional.cupy()
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
        cp = optional.cupy()
        rt = cp.cuda.runtime
        release_ipc(self._opened, self._own)   # no kernel of ours may still use the mappings
        self._opened, self._own = [], 0
        if self._host:
            self._status = self._abort = None
            try:
                rt.freeHost(self._host)
            except Exception:  # noqa: BLE001
                pass
            self._host = 0

    def _gpu_share(self) -> tuple[int, int]:
        """(SMs of this rank's GPU, ranks on it) for op_blocks; looked up once."""
        if getattr(self, "_share", None) is None:
            try:
                cp = optional.cupy()
                sms = int(cp.cuda.Device().attributes["MultiProcessorCount"])
            except Exception:  # noqa: BLE001 - unknown: no cap from it
                sms = 0
            self._share = (sms, self.bus_ids.count(self.bus_ids[self.rank]))
        return self._share

    @property
    def _stream(self):
        """Launches go to the caller's current CuPy stream (ordered with the copies that made the inputs)."""
        cp = optional.cupy()
        return cp.cuda.get_current_stream()

    @staticmethod
    def _cp():
        return optional.cupy()

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
            raise unknown_tag(tag, self.tags) from None

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

    def _check_ll(self, ch, n: int) -> None:
        """run_rounds(ll=True)'s rules besides delta 0 (kccl_test.cu "LL all-reduce"), as ValueErrors."""
        if ch.depth < 2:
            raise ValueError(f"run_rounds(ll=True) needs depth >= 2 (no acks: ring safety comes from the "
                             f"rounds); tag {ch.name!r} has {ch.depth}")
        if n % 2:
            raise ValueError(f"run_rounds(ll=True) packs two fp16 per LL word: n must be even, not {n}")
        if n // 2 * 8 > self.layout.payload_bytes:
            raise ValueError(f"run_rounds(ll=True): {n // 2} LL words of 8 bytes exceed the slot "
                             f"({self.layout.payload_bytes} bytes); raise max_floats at create() to {n}")

    def _protocol(self, ch, ll: bool) -> None:
        """A tag carries LL words or the flag protocol, never both: after LL rounds nobody acked those
        epochs (a flag post would wait for the acks until it times out), and a flag payload left in a
        slot could pass for an LL word of a later epoch."""
        if ch.ll is not None and ch.ll != ll:
            used, now = ("LL words", "the flag protocol") if ch.ll else ("the flag protocol", "LL words")
            raise KcclError(f"tag {ch.name!r} carried {used}; it cannot carry {now} too: use another tag")
        ch.ll = ll

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
        nb = op_blocks(max(send_bytes, nbytes), *self._gpu_share())
        self._k_op((nb,), (THREADS,),
                   (np.uint64(self.dev_ptr), np.int32(c), np.uint64(e), np.int32(op), np.int32(mode),
                    np.int32(root), np.uint64(0 if src is None else src.data.ptr), np.int64(send_bytes),
                    np.uint64(0 if dst is None else dst.data.ptr), np.int64(nbytes), np.int32(dtype),
                    np.int64(expect)),
                   stream=self._stream)
