"""`Communicator`: all-reduce, broadcast, barrier and the DTP post/collect pair over peer-mapped memory.

Protocol (see layout.py for bytes): to send epoch e on a channel, a rank waits until every receiver
acked e - depth for it, copies the payload into its slot e % depth in each receiver's segment, writes
the slot's size/dtype/shape words, and then stores e into the slot's EPOCH word. A receiver waits
until that word equals e, reads the payload, and stores e into its ack word for that sender.

Ordering: on x86-64 (TSO) stores become visible in program order and loads are not reordered with
older loads, so "payload, then an aligned 8-byte EPOCH store" is a release and "EPOCH load, then
payload loads" an acquire; each store here is a separate C call under CPython (memoryview 'Q'
item assignment is one aligned 8-byte store), so the compiler cannot reorder them either. Weakly
ordered CPUs (aarch64) would need explicit fences, which pure Python cannot issue: unsupported.

Sums are taken in rank order 0..N-1 in float32 on every rank, so every rank gets the same bits.
"""

from __future__ import annotations

import math
import os

import numpy as np

from . import layout as L
from .bootstrap import check_one_host, create_local_segments, open_segments
from .errors import KcclError, unknown_tag
from .channel import Channel, make_meta, read_meta
from .cuda_ipc import create_or_explain
from .doorbell import Doorbell
from .layout import check_create_args
from .liveness import PeerWatch
from .rendezvous import as_rendezvous
from .shm import register, unlink_mpich_segments, unregister
from .wait import BackoffPolicy, default_policy, wait_until

COLL = 0  # channel id of the blocking collectives
COLL_DEPTH = 2
OP_ALLREDUCE, OP_BROADCAST, OP_BARRIER, OP_POST = 1, 2, 3, 4
OP_NAMES = {OP_ALLREDUCE: "allreduce", OP_BROADCAST: "broadcast", OP_BARRIER: "barrier", OP_POST: "post"}


class Handle:
    """What post() returns: pass it to collect(). Collect a tag's handles in the order posted."""

    __slots__ = ("tag", "channel", "epoch", "shape")

    def __init__(self, tag: str, channel: int, epoch: int, shape: tuple):
        self.tag, self.channel, self.epoch, self.shape = tag, channel, epoch, shape

    def __repr__(self) -> str:
        return f"Handle({self.tag!r}, epoch={self.epoch}, shape={self.shape})"


class Communicator:
    """A group of ranks exchanging float32 vectors through peer-mapped shared memory.

    Build with `Communicator.create(mpi_comm)`. Every rank must call the collectives (allreduce,
    broadcast, bcast_int64s, barrier) in the same order, and post the same tags the same number of
    times with the same shapes. Not thread-safe: one thread per rank drives it.
    """

    def __init__(self, rank, size, segs, lay, tags, depth, max_floats, timeout, policy):
        self.rank, self.size = rank, size
        self.tags, self.depth, self.max_floats = tuple(tags), depth, max_floats
        self.timeout = timeout
        self.policy = policy
        self.closed = False
        self._segs = segs
        self._payload_bytes = lay.payload_bytes
        self._peers = [r for r in range(size) if r != rank]
        self._everyone = list(range(size))
        words = [seg.words for seg in segs]
        arrays = [np.frombuffer(seg.buf, dtype=np.uint8) for seg in segs]
        self._channels = [Channel(c, lay, rank, words, arrays) for c in range(len(lay.channels))]
        self._coll = self._channels[COLL]
        self._by_tag = {ch.name: ch for ch in self._channels[1:]}
        self._watch = PeerWatch(rank, words, [seg.path for seg in segs])
        self._words = words
        self._bell = Doorbell.open([os.path.basename(seg.path) for seg in segs], rank)
        register(self)

    # ---- construction ------------------------------------------------------------------------

    @classmethod
    def create(cls, mpi_comm=None, transport: str = "shm", *, max_floats: int = 1 << 16,
               depth: int = 4, tags=("attn", "mlp"), timeout: float = 30.0,
               unlink_after_attach: bool = True, prefix: str | None = None,
               policy: BackoffPolicy | None = None) -> "Communicator":
        """Collective over `mpi_comm` (default MPI.COMM_WORLD; or a kccl.FileRendezvous for ranks
        started without MPI): every rank calls it with equal args.

        max_floats: the largest float32 payload of any one call. depth: ring slots per DTP tag
        (>= delta+1 for collects delta layers after the post). tags: the DTP tags post() accepts.
        timeout: default deadline (s) of every wait; math.inf waits forever (still sees dead peers).
        """
        if transport == "cuda_ipc":  # kccl/cuda_ipc.py: device buffers, CUDA IPC windows
            return create_or_explain(mpi_comm, max_floats=max_floats, depth=depth, tags=tags,
                                     timeout=timeout)
        if transport != "shm":
            raise ValueError(f"unknown kccl transport {transport!r} (known: 'shm', 'cuda_ipc')")
        tags = check_create_args(depth, max_floats, tags)
        rdv = as_rendezvous(mpi_comm)
        nlocal = check_one_host(rdv)
        channels = (("_coll", COLL_DEPTH),) + tuple((t, depth) for t in tags)
        lay = L.SegmentLayout(rdv.size, 4 * max_floats, channels)
        segs = open_segments(rdv, lay, prefix, unlink_after_attach)
        unlink_mpich_segments()   # every rank is past MPI_Init now (open_segments' collectives)
        return cls(rdv.rank, rdv.size, segs, lay, tags, depth, max_floats, timeout,
                   policy or default_policy(nlocal))

    @classmethod
    def create_local_group(cls, nranks: int, *, max_floats: int = 1 << 12, depth: int = 4,
                           tags=("attn", "mlp"), timeout: float = 5.0,
                           policy: BackoffPolicy | None = None) -> list["Communicator"]:
        """`nranks` communicators in this process, one per rank, without MPI (for tests and tools).

        Drive them from one thread in an order that cannot deadlock (e.g. post on every rank, then
        collect on every rank). The segment names are unlinked before this returns.
        """
        channels = (("_coll", COLL_DEPTH),) + tuple((t, depth) for t in tags)
        lay = L.SegmentLayout(nranks, 4 * max_floats, channels)
        return [cls(r, nranks, segs, lay, tags, depth, max_floats, timeout,
                    policy or BackoffPolicy(spin_s=0.0, yield_s=0.0))
                for r, segs in enumerate(create_local_segments(lay))]

    # ---- public ops --------------------------------------------------------------------------

    def allreduce(self, x, *, out: np.ndarray | None = None, timeout: float | None = None) -> np.ndarray:
        """Sum of `x` (float32, any shape, <= max_floats) over all ranks; same bits on every rank."""
        x = self._as_payload(x, np.float32)
        ch = self._coll
        if self.size == 1:
            return self._sum(ch, {}, x, out, x.shape)
        meta = make_meta(x, OP_ALLREDUCE)
        self._send(ch, x, meta, self._peers, timeout)
        epochs = ch.next_epochs(self._peers)
        self._wait_arrivals(ch, epochs, timeout, "allreduce")
        self._expect_meta(ch, epochs, meta)
        result = self._sum(ch, epochs, x, out, x.shape)
        ch.consumed(epochs)
        return result

    def broadcast(self, x, root: int = 0, *, timeout: float | None = None,
                  idle: bool = False) -> np.ndarray:
        """Root's array (any supported dtype, shape, <= 4*max_floats bytes) on every rank.

        Non-roots may pass None: shape and dtype travel with the data. idle=True: no deadline unless
        `timeout` is given, no spinning, sleeps up to 5 ms (a rank waiting for the next request).
        A timeout on a non-root leaves the communicator as it was: the call may be repeated.
        """
        self._check_open()
        if not 0 <= root < self.size:
            raise ValueError(f"root {root} out of range for {self.size} ranks")
        ch = self._coll
        if self.rank == root:
            x = self._as_payload(x, None)
            if self.size > 1:
                self._send(ch, x, make_meta(x, OP_BROADCAST), self._peers, timeout)
            return x.copy()
        epochs = ch.next_epochs([root])
        self._wait_arrivals(ch, epochs, timeout, f"broadcast from rank {root}", idle)
        nbytes, dtype, op, shape = read_meta(ch.meta(root, epochs[root]))
        if op != OP_BROADCAST or dtype is None:
            raise KcclError(self._mismatch(root, op, OP_BROADCAST))
        result = np.empty(shape, dtype=dtype)
        result.reshape(-1).view(np.uint8)[:] = ch.payload(root, epochs[root], nbytes)
        ch.consumed(epochs)
        return result

    def bcast_int64s(self, values=None, root: int = 0, *, timeout: float | None = None,
                     idle: bool = False) -> np.ndarray:
        """Broadcast a few int64 control words (request start, lengths, a cancel flag...)."""
        if self.rank == root:
            values = np.asarray(values, dtype=np.int64)
        return self.broadcast(values, root, timeout=timeout, idle=idle)

    def barrier(self, *, timeout: float | None = None, idle: bool = False) -> None:
        """Return once every rank has entered the barrier."""
        self._check_open()
        if self.size == 1:
            return
        ch = self._coll
        meta = make_meta(None, OP_BARRIER)
        self._send(ch, None, meta, self._peers, timeout)
        epochs = ch.next_epochs(self._peers)
        self._wait_arrivals(ch, epochs, timeout, "barrier", idle)
        self._expect_meta(ch, epochs, meta)
        ch.consumed(epochs)

    def post(self, tag: str, x, *, timeout: float | None = None) -> Handle:
        """Send this rank's partial `x` (float32, <= max_floats) for `tag` now; returns at once.

        Blocks only if a peer is `depth` epochs behind on this tag. Raises KcclError if this rank
        already has `depth` uncollected posts on the tag (collect first: that would deadlock).
        """
        ch = self._tag_channel(tag)
        if ch.send_epoch - ch.collected >= ch.depth:
            raise KcclError(f"post({tag!r}): {ch.depth} posts are not collected yet; collect the "
                            f"oldest before posting again (raise depth for a longer delay)")
        x = self._as_payload(x, np.float32)
        epoch = self._send(ch, x, make_meta(x, OP_POST), self._everyone, timeout)
        return Handle(tag, ch.id, epoch, x.shape)

    def collect(self, handle: Handle, *, out: np.ndarray | None = None,
                timeout: float | None = None) -> np.ndarray:
        """Sum over all ranks of the partials posted with `handle`'s epoch (float32, post's shape).

        A timeout leaves the communicator as it was: the call may be repeated.
        """
        ch = self._tag_channel(handle.tag)
        e = handle.epoch
        if e != ch.collected + 1:
            raise KcclError(f"collect({handle!r}): expected epoch {ch.collected + 1}; collect a tag's "
                            "handles once each, in the order they were posted")
        epochs = dict.fromkeys(self._everyone, e)
        self._wait_arrivals(ch, epochs, timeout, f"{handle.tag!r} epoch {e}")
        self._expect_meta(ch, epochs, ch.meta(self.rank, e))
        result = self._sum(ch, epochs, None, out, handle.shape)
        ch.ack(epochs)
        ch.collected = e
        return result

    def pending(self, tag: str) -> int:
        """How many posts of `tag` this rank has not collected yet."""
        ch = self._tag_channel(tag)
        return ch.send_epoch - ch.collected

    def close(self) -> None:
        """Mark this rank closed (peers waiting on it get PeerLost), unlink names, unmap. Idempotent."""
        if self.closed:
            return
        self.closed = True
        unregister(self)
        own = self._segs[self.rank]
        try:
            if own.words[L.H_STATE] == L.STATE_READY:  # an ABORTED rank stays ABORTED
                own.words[L.H_STATE] = L.STATE_CLOSED
        except (ValueError, TypeError):
            pass
        if own.linked:
            own.unlink()
        if self._bell is not None:
            self._bell.close()
        self._channels, self._coll, self._by_tag = [], None, {}  # drop the views, then unmap
        self._words = self._watch.words = []
        for seg in self._segs:
            seg.close()

    def __enter__(self) -> "Communicator":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- internals ---------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._watch.lost is not None:
            raise self._watch.lost
        if self.closed:
            raise KcclError("communicator is closed")

    def _tag_channel(self, tag: str) -> Channel:
        self._check_open()
        try:
            return self._by_tag[tag]
        except KeyError:
            raise unknown_tag(tag, self.tags) from None

    def _as_payload(self, x, dtype) -> np.ndarray:
        self._check_open()
        x = np.asarray(x, dtype=dtype, order="C")
        if x.dtype not in L.DTYPE_CODES or x.ndim > L.MAX_NDIM:
            raise ValueError(f"kccl payloads are {sorted(map(str, L.DTYPE_CODES))} of ndim <= "
                             f"{L.MAX_NDIM}; got {x.dtype} ndim {x.ndim}")
        if x.nbytes > self._payload_bytes:
            raise ValueError(f"payload of {x.nbytes} bytes exceeds the slot ({self.max_floats} "
                             "float32); raise max_floats at create() or split the payload")
        return x

    def _send(self, ch: Channel, x, meta, dests, timeout) -> int:
        epoch = ch.send_epoch + 1
        self._wait_acks(ch, dests, epoch - ch.depth, timeout)
        ch.write(dests, epoch, None if x is None else x.reshape(-1).view(np.uint8), meta)
        ch.send_epoch = epoch
        if ch is self._coll and self._bell is not None:
            for d in dests:  # wake peers blocked in an idle wait
                if d != self.rank and self._words[d][L.H_IDLE]:
                    self._bell.ring(d)
        return epoch

    def _wait_acks(self, ch: Channel, dests, need: int, timeout) -> None:
        """Wait until every peer in `dests` consumed epoch `need` from this rank on `ch`."""
        if need <= 0:
            return
        late = [d for d in dests if d != self.rank and ch.acked_by(d) < need]
        if late:
            self._wait(lambda: all(ch.acked_by(d) >= need for d in late), timeout,
                       lambda: f"ranks {late} to consume {ch.name!r} epoch {need} of rank {self.rank}")

    def _wait_arrivals(self, ch: Channel, epochs: dict, timeout, what: str, idle=False) -> None:
        """Wait until every source's slot holds the expected epoch."""
        def ready() -> bool:
            for s, e in epochs.items():
                got = ch.arrived(s, e)
                if got != e:
                    if got > e:
                        raise KcclError(f"rank {self.rank}: {ch.name!r} slot of rank {s} holds "
                                        f"epoch {got} while epoch {e} was expected (slot reused "
                                        "too early)")
                    return False
            return True

        if not ready():
            def describe():
                missing = [s for s, e in epochs.items() if ch.arrived(s, e) != e]
                return f"{what} from ranks {missing} (rank {self.rank})"
            self._wait(ready, timeout, describe, idle)

    def _wait(self, ready, timeout, describe, idle: bool = False) -> None:
        if timeout is None:
            timeout = math.inf if idle else self.timeout
        if not idle:
            wait_until(ready, self.policy, timeout, self._watch.check, describe)
        elif self._bell is None:
            wait_until(ready, self.policy.for_idle(5e-3), timeout, self._watch.check, describe)
        else:
            own = self._words[self.rank]
            own[L.H_IDLE] = 1  # senders ring us from now on
            try:
                wait_until(ready, self.policy.for_idle(20e-3), timeout, self._watch.check,
                           describe, sleep=self._bell.wait)
            finally:
                own[L.H_IDLE] = 0

    def _mismatch(self, src: int, got_op: int, want_op: int) -> str:
        return (f"rank {self.rank} is in {OP_NAMES.get(want_op)} but rank {src} sent "
                f"{OP_NAMES.get(got_op, got_op)}: the ranks called kccl ops in different orders")

    def _expect_meta(self, ch: Channel, epochs: dict, meta) -> None:
        """Every source sent the same op, dtype and shape as `meta` describes."""
        for s, e in epochs.items():
            got = ch.meta(s, e)
            if got != meta:
                _, dtype, op, shape = read_meta(got)
                _, my_dtype, my_op, my_shape = read_meta(meta)
                if op != my_op:
                    raise KcclError(self._mismatch(s, op, my_op))
                raise KcclError(f"{OP_NAMES[my_op]} on {ch.name!r}: rank {s} sent {dtype}"
                                f"{list(shape)}, rank {self.rank} has {my_dtype}{list(my_shape)}")

    def _sum(self, ch: Channel, epochs: dict, own, out, shape) -> np.ndarray:
        """float32 sum in rank order; `own` (or None: this rank's slot) stands for this rank."""
        n = math.prod(shape)
        if out is None:
            out = np.empty(shape, dtype=np.float32)
        elif out.shape != tuple(shape) or out.dtype != np.float32 or not out.flags.c_contiguous:
            raise ValueError(f"out must be a C-contiguous float32 array of shape {tuple(shape)}")
        flat = out.reshape(-1)
        for s in self._everyone:
            if s == self.rank and own is not None:
                part = own.reshape(-1)
            else:
                part = ch.floats(s, epochs[s], n)
            if s == 0:
                np.copyto(flat, part)
            else:
                np.add(flat, part, out=flat)
        return out
