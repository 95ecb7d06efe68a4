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

import numpy as np

from . import layout as L
from .errors import KcclError
from .liveness import PeerWatch
from .shm import register, unregister
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


class _Channel:
    __slots__ = ("id", "name", "depth", "send_epoch", "recv_epoch", "collected")

    def __init__(self, cid: int, name: str, depth: int, nranks: int):
        self.id, self.name, self.depth = cid, name, depth
        self.send_epoch = 0               # last epoch this rank sent on the channel
        self.recv_epoch = [0] * nranks    # last epoch received from each source
        self.collected = 0                # DTP tags: last epoch collected


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
        self._lay = lay
        self._words = [s.words for s in segs]
        self._peers = [r for r in range(size) if r != rank]
        self._watch = PeerWatch(rank, self._words, [seg.path for seg in segs])
        self._channels = [_Channel(c, name, d, size) for c, (name, d) in enumerate(lay.channels)]
        self._by_tag = {ch.name: ch for ch in self._channels[1:]}
        nch = len(lay.channels)
        # word index of slot (c, s, i) header and of ack (c, s): the same in every segment
        self._slot_word = [[[lay.slot_offset(c, s, i) // 8 for i in range(lay.channels[c][1])]
                            for s in range(size)] for c in range(nch)]
        self._ack_word = [[lay.ack_offset(c, s) // 8 for s in range(size)] for c in range(nch)]
        # payload views: payload[d][c][s][i] (uint8) in rank d's segment
        self._payload = []
        for seg in segs:
            arr = np.frombuffer(seg.buf, dtype=np.uint8)
            per_c = []
            for c in range(nch):
                per_s = []
                for s in range(size):
                    views = []
                    for i in range(lay.channels[c][1]):
                        off = lay.slot_offset(c, s, i) + L.SLOT_HEADER_BYTES
                        views.append(arr[off:off + lay.payload_bytes])
                    per_s.append(views)
                per_c.append(per_s)
            self._payload.append(per_c)
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
        if transport == "cuda_ipc":
            raise NotImplementedError("kccl transport 'cuda_ipc' is not built yet (it needs a GPU "
                                      "and CuPy); use transport='shm'")
        if transport != "shm":
            raise ValueError(f"unknown kccl transport {transport!r} (known: 'shm', 'cuda_ipc')")
        if depth < 1 or max_floats < 1:
            raise ValueError("depth and max_floats must be >= 1")
        tags = tuple(tags)
        if len(set(tags)) != len(tags) or any(t.startswith("_") for t in tags):
            raise ValueError(f"tags must be distinct and not start with '_': {tags}")
        from .bootstrap import check_one_host, open_segments
        from .rendezvous import as_rendezvous

        rdv = as_rendezvous(mpi_comm)
        nlocal = check_one_host(rdv)
        channels = (("_coll", COLL_DEPTH),) + tuple((t, depth) for t in tags)
        lay = L.SegmentLayout(rdv.size, 4 * max_floats, channels)
        segs = open_segments(rdv, lay, prefix, unlink_after_attach)
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
        from .bootstrap import create_local_segments

        channels = (("_coll", COLL_DEPTH),) + tuple((t, depth) for t in tags)
        lay = L.SegmentLayout(nranks, 4 * max_floats, channels)
        return [cls(r, nranks, segs, lay, tags, depth, max_floats, timeout,
                    policy or BackoffPolicy(spin_s=0.0, yield_s=0.0))
                for r, segs in enumerate(create_local_segments(lay))]

    # ---- public ops --------------------------------------------------------------------------

    def allreduce(self, x, *, out: np.ndarray | None = None, timeout: float | None = None) -> np.ndarray:
        """Sum of `x` (float32, any shape, <= max_floats) over all ranks; same bits on every rank."""
        x = self._as_payload(x, np.float32)
        ch = self._channels[COLL]
        if self.size > 1:
            self._send(ch, x, OP_ALLREDUCE, self._peers, timeout)
            epochs = self._recv_epochs(ch, self._peers)
            self._wait_slots(ch, epochs, timeout, "allreduce")
            self._check_meta(ch, epochs, x, OP_ALLREDUCE)
        result = self._sum(ch, epochs if self.size > 1 else {}, x, out)
        if self.size > 1:
            self._ack(ch, epochs)
        return result

    def broadcast(self, x, root: int = 0, *, timeout: float | None = None,
                  idle: bool = False) -> np.ndarray:
        """Root's array (any supported dtype, shape, <= 4*max_floats bytes) on every rank.

        Non-roots may pass None: shape and dtype travel with the data. idle=True: no deadline unless
        `timeout` is given, no spinning, sleeps up to 5 ms (a rank waiting for the next request).
        """
        self._check_open()
        if not 0 <= root < self.size:
            raise ValueError(f"root {root} out of range for {self.size} ranks")
        ch = self._channels[COLL]
        if self.rank == root:
            x = self._as_payload(x, None)
            if self.size > 1:
                self._send(ch, x, OP_BROADCAST, self._peers, timeout)
            return x.copy()
        epochs = self._recv_epochs(ch, [root])
        self._wait_slots(ch, epochs, timeout, f"broadcast from rank {root}", idle)
        words, w = self._words[self.rank], self._slot_word[COLL][root][epochs[root] % ch.depth]
        dtype, op, shape, nbytes = self._read_meta(words, w)
        if op != OP_BROADCAST:
            raise KcclError(self._mismatch(root, op, OP_BROADCAST))
        payload = self._payload[self.rank][COLL][root][epochs[root] % ch.depth]
        result = np.empty(shape, dtype=dtype)
        result.reshape(-1).view(np.uint8)[:] = payload[:nbytes]
        self._ack(ch, epochs)
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
        ch = self._channels[COLL]
        self._send(ch, None, OP_BARRIER, self._peers, timeout)
        epochs = self._recv_epochs(ch, self._peers)
        self._wait_slots(ch, epochs, timeout, "barrier", idle)
        for src, e in epochs.items():
            op = self._words[self.rank][self._slot_word[COLL][src][e % ch.depth] + L.S_DTYPE] >> 8
            if op != OP_BARRIER:
                raise KcclError(self._mismatch(src, op, OP_BARRIER))
        self._ack(ch, epochs)

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
        epoch = self._send(ch, x, OP_POST, range(self.size), timeout)
        return Handle(tag, ch.id, epoch, x.shape)

    def collect(self, handle: Handle, *, out: np.ndarray | None = None,
                timeout: float | None = None) -> np.ndarray:
        """Sum over all ranks of the partials posted with `handle`'s epoch (float32, post's shape)."""
        ch = self._tag_channel(handle.tag)
        if handle.epoch != ch.collected + 1:
            raise KcclError(f"collect({handle!r}): expected epoch {ch.collected + 1}; collect a tag's "
                            "handles once each, in the order they were posted")
        epochs = {s: handle.epoch for s in range(self.size)}
        self._wait_slots(ch, epochs, timeout, f"{handle.tag!r} epoch {handle.epoch}")
        mine = self._payload[self.rank][ch.id][self.rank][handle.epoch % ch.depth]
        n = math.prod(handle.shape)
        own = mine[:4 * n].view(np.float32).reshape(handle.shape)
        self._check_meta(ch, epochs, own, OP_POST)
        result = self._sum(ch, epochs, None, out, handle.shape)
        self._ack(ch, epochs)
        ch.collected = handle.epoch
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
        self._payload = []
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

    def _tag_channel(self, tag: str) -> _Channel:
        self._check_open()
        try:
            return self._by_tag[tag]
        except KeyError:
            raise KcclError(f"unknown tag {tag!r}; this communicator was created with tags={self.tags}") from None

    def _as_payload(self, x, dtype) -> np.ndarray:
        self._check_open()
        x = np.asarray(x, dtype=dtype, order="C")
        if x.dtype not in L.DTYPE_CODES or x.ndim > L.MAX_NDIM:
            raise ValueError(f"kccl payloads are {sorted(map(str, L.DTYPE_CODES))} of ndim <= {L.MAX_NDIM}; got {x.dtype} ndim {x.ndim}")
        if x.nbytes > self._lay.payload_bytes:
            raise ValueError(f"payload of {x.nbytes} bytes exceeds the slot ({self.max_floats} float32); "
                             "raise max_floats at create() or split the payload")
        return x

    def _send(self, ch: _Channel, x, op: int, dests, timeout) -> int:
        epoch = ch.send_epoch + 1
        idx = epoch % ch.depth
        me = self.rank
        self._wait_acks(ch, dests, epoch - ch.depth, timeout)
        words = self._words
        w = self._slot_word[ch.id][me][idx]
        if x is None:
            nbytes, code, shape = 0, 0, ()
        else:
            nbytes, code, shape = x.nbytes, L.DTYPE_CODES[x.dtype], x.shape
            flat = x.reshape(-1).view(np.uint8)
        for d in dests:
            wd = words[d]
            if nbytes:
                self._payload[d][ch.id][me][idx][:nbytes] = flat
            wd[w + L.S_NBYTES] = nbytes
            wd[w + L.S_DTYPE] = code | (op << 8)
            wd[w + L.S_NDIM] = len(shape)
            for k, extent in enumerate(shape):
                wd[w + L.S_SHAPE + k] = extent
            wd[w + L.S_EPOCH] = epoch  # publish: the last store
        ch.send_epoch = epoch
        return epoch

    def _wait_acks(self, ch: _Channel, dests, need: int, timeout) -> None:
        """Wait until every peer in `dests` consumed epoch `need` from this rank on `ch`."""
        me = self.rank
        ackw = self._ack_word[ch.id][me]
        words = self._words
        late = [d for d in dests if d != me and words[d][ackw] < need]
        if late:
            self._wait(lambda: all(words[d][ackw] >= need for d in late), timeout,
                       lambda: f"ranks {late} to consume {ch.name!r} epoch {need} of rank {me}")

    def _recv_epochs(self, ch: _Channel, srcs) -> dict:
        epochs = {}
        for s in srcs:
            ch.recv_epoch[s] += 1
            epochs[s] = ch.recv_epoch[s]
        return epochs

    def _wait_slots(self, ch: _Channel, epochs: dict, timeout, what: str, idle: bool = False) -> None:
        words = self._words[self.rank]
        table = self._slot_word[ch.id]
        waits = [(table[s][e % ch.depth], e, s) for s, e in epochs.items()]

        def ready() -> bool:
            for w, e, s in waits:
                got = words[w]
                if got != e:
                    if got > e:
                        raise KcclError(f"rank {self.rank}: {ch.name!r} slot of rank {s} holds epoch "
                                        f"{got} while epoch {e} was expected (slot reused too early)")
                    return False
            return True

        if not ready():
            def describe():
                missing = [s for w, e, s in waits if words[w] != e]
                return f"{what} from ranks {missing} (rank {self.rank})"
            self._wait(ready, timeout, describe, idle)

    def _wait(self, ready, timeout, describe, idle: bool = False) -> None:
        policy = self.policy.for_idle() if idle else self.policy
        if timeout is None:
            timeout = math.inf if idle else self.timeout
        wait_until(ready, policy, timeout, self._watch.check, describe)

    def _read_meta(self, words, w):
        code = words[w + L.S_DTYPE]
        ndim = words[w + L.S_NDIM]
        shape = tuple(words[w + L.S_SHAPE + k] for k in range(ndim))
        return L.CODE_DTYPES.get(code & 0xFF), code >> 8, shape, words[w + L.S_NBYTES]

    def _mismatch(self, src: int, got_op: int, want_op: int) -> str:
        return (f"rank {self.rank} is in {OP_NAMES.get(want_op)} but rank {src} sent "
                f"{OP_NAMES.get(got_op, got_op)}: the ranks called kccl ops in different orders")

    def _check_meta(self, ch: _Channel, epochs: dict, x: np.ndarray, op: int) -> None:
        words = self._words[self.rank]
        for s, e in epochs.items():
            dtype, got_op, shape, _ = self._read_meta(words, self._slot_word[ch.id][s][e % ch.depth])
            if got_op != op:
                raise KcclError(self._mismatch(s, got_op, op))
            if shape != x.shape or dtype != x.dtype:
                raise KcclError(f"{OP_NAMES[op]} on {ch.name!r}: rank {s} sent {dtype}{list(shape)}, "
                                f"rank {self.rank} has {x.dtype}{list(x.shape)}")

    def _sum(self, ch: _Channel, epochs: dict, own, out, shape=None) -> np.ndarray:
        shape = own.shape if own is not None else shape
        n = math.prod(shape)
        if out is None:
            out = np.empty(shape, dtype=np.float32)
        elif out.shape != tuple(shape) or out.dtype != np.float32 or not out.flags.c_contiguous:
            raise ValueError(f"out must be a C-contiguous float32 array of shape {tuple(shape)}")
        flat = out.reshape(-1)
        mine = self._payload[self.rank][ch.id]
        for s in range(self.size):
            if s == self.rank and own is not None:
                part = own.reshape(-1)
            else:
                part = mine[s][epochs[s] % ch.depth][:4 * n].view(np.float32)
            if s == 0:
                np.copyto(flat, part)
            else:
                np.add(flat, part, out=flat)
        return out

    def _ack(self, ch: _Channel, epochs: dict) -> None:
        words = self._words[self.rank]
        table = self._ack_word[ch.id]
        for s, e in epochs.items():
            words[table[s]] = e
