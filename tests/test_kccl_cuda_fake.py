"""kccl cuda_ipc host code on the CPU, against a fake `cupy` (no GPU needed).

The fake gives "device" memory as plain host memory (ctypes buffers, so pointers are real addresses),
IPC handles that encode the address (ranks are threads of this process), and a Python model of the
kernels in kccl/device/kccl_ops.cu and kccl_test.cu (the LL all-reduce included: words carry (tag,
value), the reader polls the tag; one block; the multi-block arrival logic is
covered by test_kccl_cuda.py's protocol model). Every launch is checked against the kernel's C
signature (count and kind of each argument), so the host code's argument lists are tested too.
What this checks: create (allocation, record exchange, opening, header check, votes), epochs of the
host collectives and the DTP tags, the persistent-kernel bookkeeping, status words -> exceptions,
peer-death handling, and that close() releases every allocation and mapping.
"""

from __future__ import annotations

import ctypes
import re
import struct
import sys
import threading
import time
import types

import numpy as np
import pytest

from kccl import cuda_ipc as K
from kccl import cuda_layout as CL
from kccl.errors import KcclError, KcclTimeout, PeerLost
from kccl.rendezvous import FileRendezvous


# ---- fake memory and runtime ---------------------------------------------------------------------
class _Mem:
    def __init__(self):
        self.bufs = {}
        self.lock = threading.Lock()
        self.opened = {}   # thread id -> open count
        self.freed_while_open = 0

    def alloc(self, size):
        buf = ctypes.create_string_buffer(size + 256)
        addr = (ctypes.addressof(buf) + 255) // 256 * 256
        with self.lock:
            self.bufs[addr] = buf
        return addr

    def free(self, addr):
        with self.lock:
            del self.bufs[addr]


MEM = _Mem()


def u64(addr):
    return ctypes.c_uint64.from_address(addr)


def i32(addr):
    return ctypes.c_int.from_address(addr)


class _Runtime:
    memcpyHostToDevice, memcpyDeviceToHost = 1, 2

    malloc = staticmethod(MEM.alloc)
    free = staticmethod(MEM.free)
    hostAlloc = staticmethod(lambda size, flags: MEM.alloc(size))
    freeHost = staticmethod(MEM.free)

    @staticmethod
    def memset(ptr, value, size):
        ctypes.memset(ptr, value, size)

    @staticmethod
    def memcpy(dst, src, size, kind):
        ctypes.memmove(dst, src, size)

    @staticmethod
    def ipcGetMemHandle(ptr):
        assert ptr in MEM.bufs, "handle of a pointer that is not an allocation's base"
        return struct.pack("<Q", ptr) + b"\x07" * 56

    @staticmethod
    def ipcOpenMemHandle(handle, flags=1):
        ptr = struct.unpack("<Q", handle[:8])[0]
        assert ptr in MEM.bufs
        with MEM.lock:
            MEM.opened[threading.get_ident()] = MEM.opened.get(threading.get_ident(), 0) + 1
        return ptr

    @staticmethod
    def ipcCloseMemHandle(ptr):
        with MEM.lock:
            MEM.opened[threading.get_ident()] -= 1

    deviceGetPCIBusId = staticmethod(lambda dev: "0000:FA:00.0")
    getDeviceCount = staticmethod(lambda: 1)
    deviceSynchronize = staticmethod(lambda: None)


class _Flags:
    c_contiguous = True


class FakeArray:
    def __init__(self, arr: np.ndarray):
        self._keep = MEM.alloc(max(arr.nbytes, 1))
        self.a = np.ndarray(arr.shape, arr.dtype,
                            buffer=(ctypes.c_char * max(arr.nbytes, 1)).from_address(self._keep))
        self.a[...] = arr
        self.data = types.SimpleNamespace(ptr=self._keep)
        self.flags = _Flags()

    shape = property(lambda s: s.a.shape)
    dtype = property(lambda s: s.a.dtype)
    nbytes = property(lambda s: s.a.nbytes)
    ndim = property(lambda s: s.a.ndim)

    def get(self):
        return self.a.copy()

    def astype(self, dt):
        return FakeArray(self.a.astype(dt))

    def copy(self):
        return FakeArray(self.a)

    def __getitem__(self, k):
        return self.a[k]


def _asarray(x, dtype=None):
    if isinstance(x, FakeArray):
        return x if dtype is None or x.dtype == dtype else x.astype(dtype)
    return FakeArray(np.asarray(x, dtype=dtype))


# ---- kernels: argument check against the C signature, then a Python model ------------------------
def _signatures():
    src = CL.device_source()
    sigs = {}
    for m in re.finditer(r'extern "C" __global__ void (\w+)\(([^)]*)\)', src):
        params = [p.strip() for p in m.group(2).replace("\n", " ").split(",")]
        sigs[m.group(1)] = params
    return sigs


SIGS = _signatures()


def _check_args(name, args):
    params = SIGS[name]
    assert len(args) == len(params), f"{name}: {len(args)} args for {len(params)} parameters"
    for a, p in zip(args, params):
        if "*" in p:
            assert isinstance(a, (FakeArray, np.uint64)), f"{name}: {p} got {type(a)}"
        elif p.startswith("int "):
            assert isinstance(a, np.int32), f"{name}: {p} got {type(a)}"
        elif p.startswith("long long"):
            assert isinstance(a, np.int64), f"{name}: {p} got {type(a)}"
        elif p.startswith("unsigned long long"):
            assert isinstance(a, np.uint64), f"{name}: {p} got {type(a)}"
        else:
            raise AssertionError(f"{name}: unexpected parameter {p}")


def _ptr(a):
    return a.data.ptr if isinstance(a, FakeArray) else int(a)


class Dev:
    """kccl.cuh's KcclDev read from memory, and the protocol in Python (one block)."""

    def __init__(self, dp):
        w = [u64(dp + 8 * i).value for i in range(CL.DEV_WORDS)]
        self.base = w[:8]
        self.rank, self.n, self.nch, self.slot_bytes, self.payload = w[8:13]
        self.off_flags, self.off_acks, self.off_cnt, self.status, self.abort, self.timeout_ns, magic = w[13:20]
        assert magic == CL.MAGIC
        self.depth, self.slot_off = w[20:28], w[28:36]

    def flag(self, dst, c, src):
        return self.base[dst] + self.off_flags + (c * self.n + src) * 128

    def ack(self, owner, c, by):
        return self.base[owner] + self.off_acks + (c * self.n + by) * 128

    def meta(self, dst, c, src, e):
        return self.base[dst] + self.slot_off[c] + (src * self.depth[c] + e % self.depth[c]) * self.slot_bytes

    def failed(self):
        return i32(self.base[self.rank] + 256).value != 0

    def fail(self, code, peer, c, e, seen):
        w = i32(self.base[self.rank] + 256)
        if w.value:
            return
        w.value = code
        for k, v in enumerate((self.rank, peer, c, e, seen, 0), start=1):
            i32(self.status + 4 * k).value = v
        i32(self.status).value = code

    def spin_ge(self, addr, target, code, peer, c, e):
        t0 = time.monotonic_ns()
        while u64(addr).value < target:
            if i32(self.abort).value:
                self.fail(CL.ERR_ABORTED, peer, c, e, u64(addr).value)
                return False
            if self.failed():
                return False
            if time.monotonic_ns() - t0 > self.timeout_ns:
                self.fail(code, peer, c, e, u64(addr).value)
                return False
            time.sleep(1e-5)
        return True

    def post(self, c, e, src, nbytes, op):
        if e > self.depth[c]:
            for r in range(self.n):
                if not self.spin_ge(self.ack(self.rank, c, r), e - self.depth[c], CL.ERR_TIMEOUT_ACK, r, c, e):
                    return False
        for r in range(self.n):
            m = self.meta(r, c, self.rank, e)
            if nbytes:
                ctypes.memmove(m + 64, src, nbytes)
            u64(m).value = e
            u64(m + 8).value = (op << 32) | nbytes
        for r in range(self.n):
            u64(self.flag(r, c, self.rank)).value = e
        return True

    def wait(self, c, e):
        return all(self.spin_ge(self.flag(self.rank, c, s), e, CL.ERR_TIMEOUT_FLAG, s, c, e) for s in range(self.n))

    def check_meta(self, c, e, op, nbytes):
        for s in range(self.n):
            m = self.meta(self.rank, c, s, e)
            me, w = u64(m).value, u64(m + 8).value
            if me != e:
                self.fail(CL.ERR_EPOCH, s, c, e, me)
                return False
            if w >> 32 != op:
                self.fail(CL.ERR_OP_MISMATCH, s, c, e, w >> 32)
                return False
            if nbytes >= 0 and w & 0xFFFFFFFF != nbytes:
                self.fail(CL.ERR_SIZE_MISMATCH, s, c, e, w & 0xFFFFFFFF)
                return False
        return True

    def payload_of(self, c, s, e, dtype, count):
        addr = self.meta(self.rank, c, s, e) + 64
        return np.ndarray((count,), dtype, buffer=(ctypes.c_char * (count * np.dtype(dtype).itemsize)).from_address(addr))

    def ranksum(self, c, e, dtype, count):
        acc = self.payload_of(c, 0, e, dtype, count).astype(np.float32)
        for s in range(1, self.n):
            acc = acc + self.payload_of(c, s, e, dtype, count).astype(np.float32)
        return acc

    def ack_all(self, c, e):
        for s in range(self.n):
            u64(self.ack(s, c, self.rank)).value = e

    def ll_words(self, dst, c, src, e, count):
        """kccl_ll_words: src's LL words of epoch e in dst's window, as uint64 (tag << 32 | value bits)."""
        return np.ndarray((count,), np.uint64, buffer=(ctypes.c_char * (8 * count)).from_address(
            self.meta(dst, c, src, e) + 64))

    def ll_get(self, c, src, e, count):
        """kccl_ll_get on every word of src's epoch e in this window: the value bits (uint32) once every
        word carries tag (u32)e, bounded like spin_ge; None after a failure."""
        tag, words = e & 0xFFFFFFFF, self.ll_words(self.rank, c, src, e, count)
        t0 = time.monotonic_ns()
        while True:
            w = words.copy()
            late = np.flatnonzero((w >> np.uint64(32)) != tag)
            if not late.size:
                return (w & np.uint64(0xFFFFFFFF)).astype(np.uint32)
            seen = int(w[late[0]] >> np.uint64(32))
            if i32(self.abort).value:
                self.fail(CL.ERR_ABORTED, src, c, tag, seen)
                return None
            if self.failed():
                return None
            if time.monotonic_ns() - t0 > self.timeout_ns:
                self.fail(CL.ERR_TIMEOUT_FLAG, src, c, tag, seen)
                return None
            time.sleep(1e-5)


def k_op(args):
    dp, c, e, op, mode, root, src, send, dst, nbytes, dtype, expect = (
        _ptr(args[0]), int(args[1]), int(args[2]), int(args[3]), int(args[4]), int(args[5]), _ptr(args[6]),
        int(args[7]), _ptr(args[8]), int(args[9]), int(args[10]), int(args[11]))
    d = Dev(dp)
    if d.failed():
        return
    if mode & CL.M_POST and not d.post(c, e, src, send, op):
        return
    if not mode & CL.M_WAIT:
        return
    if not d.wait(c, e) or not d.check_meta(c, e, op, expect):
        return
    if op == CL.OP_BROADCAST:
        got = u64(d.meta(d.rank, c, root, e) + 8).value & 0xFFFFFFFF
        if got != nbytes:
            d.fail(CL.ERR_SIZE_MISMATCH, root, c, e, got)
            return
    if mode & CL.M_SUM:
        dt = np.float32 if dtype == 0 else np.float16
        cnt = nbytes // np.dtype(dt).itemsize
        out = d.ranksum(c, e, dt, cnt).astype(dt)
        ctypes.memmove(dst, out.ctypes.data, nbytes)
    elif mode & CL.M_COPY:
        ctypes.memmove(dst, d.meta(d.rank, c, root, e) + 64, nbytes)
    if mode & CL.M_ACK:
        d.ack_all(c, e)


def k_rounds(args):
    dp, c, first, rounds, delta = _ptr(args[0]), int(args[1]), int(args[2]), int(args[3]), int(args[4])
    inp, in_rounds, out, out_rounds, n, times = args[5], int(args[6]), args[7], int(args[8]), int(args[9]), args[10]
    d = Dev(dp)
    for s in range(rounds + delta):
        if s < rounds:
            times.a[s, 0] = time.monotonic_ns()
            if not d.post(c, first + s, inp.data.ptr + (s % in_rounds) * n * 2, 2 * n, 4):
                return
            times.a[s, 1] = time.monotonic_ns()
        if s >= delta:
            r, e = s - delta, first + s - delta
            t = time.monotonic_ns()
            if not d.wait(c, e):
                return
            out.a[r % out_rounds] = d.ranksum(c, e, np.float16, n)
            d.ack_all(c, e)
            times.a[r, 2] = time.monotonic_ns() - t


def k_ll_rounds(args):
    """kccl_test_ll_rounds (one block): per round, this rank's n/2 LL words (two fp16 in the low 32 bits,
    tag = epoch in the high 32) into its slot of the epoch in every other rank's window, then the rank-
    order fp32 sum of its own words (from the input) and the others' (from its own window, once their
    tags show). No flag, no ack: the round structure keeps the ring safe (depth >= 2). Honours
    max_delay_ns (a sleep before each post) so that the ranks interleave differently."""
    dp, c, first, rounds, delta = _ptr(args[0]), int(args[1]), int(args[2]), int(args[3]), int(args[4])
    inp, in_rounds, out, out_rounds, n, times = args[5], int(args[6]), args[7], int(args[8]), int(args[9]), args[10]
    max_delay_ns, seed = int(args[11]), int(args[12])
    d = Dev(dp)
    assert delta == 0 and n % 2 == 0 and d.depth[c] >= 2, "run_rounds(ll=True) must refuse these"
    rng = np.random.default_rng([seed, d.rank])
    for s in range(rounds):
        if max_delay_ns > 0:
            time.sleep(int(rng.integers(max_delay_ns)) * 1e-9)
        e, x = first + s, inp.a[s % in_rounds].view(np.uint32)
        words = (np.uint64(e & 0xFFFFFFFF) << np.uint64(32)) | x
        times.a[s, 0] = time.monotonic_ns()
        for k in range(1, d.n):
            d.ll_words((d.rank + k) % d.n, c, d.rank, e, n // 2)[:] = words
        times.a[s, 1] = time.monotonic_ns()
        acc = None
        for src in range(d.n):
            v = x if src == d.rank else d.ll_get(c, src, e, n // 2)
            if v is None:
                return
            h = v.view(np.float16).astype(np.float32)  # little-endian: half 2i in the low 16 bits of word i
            acc = h if src == 0 else acc + h
        out.a[s % out_rounds] = acc
        times.a[s, 2] = time.monotonic_ns() - times.a[s, 1]


def k_peek(args):
    d = Dev(_ptr(args[0]))
    c, out = int(args[1]), args[2]
    for s in range(d.n):
        out.a[s] = u64(d.flag(d.rank, c, s)).value
        out.a[d.n + s] = u64(d.ack(d.rank, c, s)).value


class _Stream:
    """A launch runs in a thread (the kernel runs while the host waits and watches); a launch while the
    previous kernel runs queues behind it, in order, as on a CUDA stream."""

    def __init__(self):
        self.t, self.exc = None, None

    def launch(self, impl, args):
        prev = self.t

        def run():
            if prev is not None:
                prev.join()
            try:
                if self.exc is None:          # a failed kernel: the queued ones do not run
                    impl(args)
            except BaseException as exc:  # noqa: BLE001
                self.exc = exc

        self.t = threading.Thread(target=run, daemon=True)
        self.t.start()

    def _raise(self):
        if self.exc is not None:
            exc, self.exc = self.exc, None
            raise exc

    @property
    def done(self):
        alive = self.t is not None and self.t.is_alive()
        if not alive:
            self._raise()
        return not alive

    def synchronize(self):
        if self.t is not None:
            self.t.join()
        self._raise()


_streams = threading.local()


def _current_stream():
    if not hasattr(_streams, "s"):
        _streams.s = _Stream()
    return _streams.s


class _Fn:
    def __init__(self, name, impl):
        self.name, self.impl = name, impl

    def __call__(self, grid, block, args, stream=None):
        _check_args(self.name, args)
        assert 1 <= grid[0] <= 32 and block[0] <= 1024
        assert stream is _current_stream()
        stream.launch(self.impl, args)


class _Module:
    def __init__(self, code, options=(), backend="nvrtc"):
        assert '#include "' not in code and "-std=c++17" in options

    def get_function(self, name):
        return _Fn(name, {"kccl_op": k_op, "kccl_test_rounds": k_rounds, "kccl_test_ll_rounds": k_ll_rounds,
                          "kccl_peek": k_peek}[name])


def _fake_cupy():
    cp = types.ModuleType("cupy")
    cp.float32, cp.float16, cp.uint64, cp.int64 = np.float32, np.float16, np.uint64, np.int64
    cp.asarray = _asarray
    cp.ascontiguousarray = lambda x: x
    cp.empty_like = lambda x: FakeArray(np.empty_like(x.a))
    cp.empty = lambda shape, dtype=np.float32: FakeArray(np.empty(shape, dtype))
    cp.zeros = lambda shape, dtype=np.float32: FakeArray(np.zeros(shape, dtype))
    cp.ones = lambda shape, dtype=np.float32: FakeArray(np.ones(shape, dtype))
    cp.RawModule = _Module
    cuda = types.SimpleNamespace(runtime=_Runtime, Device=lambda i=0: types.SimpleNamespace(id=0, use=lambda: None),
                                 get_current_stream=_current_stream)
    cp.cuda = cuda
    return cp


@pytest.fixture
def fake_cupy(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy())
    CL._modules.clear()
    yield
    CL._modules.clear()


def _ranks(n, body, tmp_path, timeout=60):
    """Run body(rank, comm_factory) in n threads; return per-rank results or raise the first error."""
    res, errs = [None] * n, [None] * n

    def run(r):
        try:
            rdv = FileRendezvous(str(tmp_path), r, n, timeout=20)
            res[r] = body(r, rdv)
        except BaseException as exc:  # noqa: BLE001
            errs[r] = exc

    ts = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout)
        assert not t.is_alive(), "rank thread hung"
    return res, errs


def _ranksum(parts):
    acc = parts[0].astype(np.float32)
    for p in parts[1:]:
        acc = acc + p.astype(np.float32)
    return acc


# ---- tests -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 2, 3])
def test_host_ops_end_to_end(fake_cupy, tmp_path, n):
    import cupy as cp

    def part(seed, q, size, dt):
        return np.random.default_rng([seed, q]).standard_normal(size).astype(dt)

    def body(r, rdv):
        comm = K.CudaCommunicator.create(rdv, max_floats=4096, depth=3, tags=("attn", "mlp"), timeout=5)
        assert comm.channel("attn") == 1 and comm.channel("mlp") == 2
        for seed, size in enumerate([1, 7, 3072]):
            for dt in (np.float32, np.float16):
                got = comm.allreduce(cp.asarray(part(seed, r, size, dt))).get()
                assert np.array_equal(got, _ranksum([part(seed, q, size, dt) for q in range(n)]).astype(dt))
        for root in range(n):
            x = cp.asarray(np.arange(5) * (root + 1)) if r == root else cp.zeros(5, cp.int64)
            assert np.array_equal(comm.broadcast(x, root=root).get(), np.arange(5) * (root + 1))
        comm.barrier()
        hs = []
        for layer in range(10):
            hs.append((layer, comm.post("attn", cp.asarray(part(100 + layer, r, 64, np.float32)))))
            if len(hs) > 2:
                l0, h = hs.pop(0)
                assert np.array_equal(comm.collect(h).get(), _ranksum([part(100 + l0, q, 64, np.float32) for q in range(n)]))
        for l0, h in hs:
            comm.collect(h)
        assert comm.pending("attn") == 0 and comm.next_epoch("attn") == 11
        ins = np.stack([part(7, r, 32, np.float16) for _ in range(1)])
        out, times = comm.run_rounds("mlp", ins, 20, delta=2, out_rounds=20)
        want = _ranksum([part(7, q, 32, np.float16) for q in range(n)])
        assert all(np.array_equal(out.get()[i], want) for i in range(20))
        assert times.shape == (20, 6) and comm.next_epoch("mlp") == 21
        comm.advance("mlp", 5)
        assert comm.next_epoch("mlp") == 26
        comm.barrier()
        flags, acks = comm.peek(0)
        done = 6 + n + 2  # collectives so far; a barrier returns once every rank posted it, so a
        # peer may not have acked it yet, and a faster one may already have posted the next one
        assert all(done - 1 <= a <= done for a in acks) and all(done <= f <= done + 1 for f in flags), \
            (flags, acks)
        flags, acks = comm.peek(1)  # the DTP tag: everything posted was collected before the barrier
        assert acks == [10] * n and all(10 <= f <= 13 for f in flags), (flags, acks)  # (3 posts below)
        with pytest.raises(KcclError, match="not collected"):
            for _ in range(4):
                comm.post("attn", cp.zeros(4, cp.float32))
        with pytest.raises(ValueError, match="exceeds the slot"):
            comm.allreduce(cp.zeros(4097, cp.float32))
        with pytest.raises(KcclError, match="unknown tag"):
            comm.post("moe", cp.zeros(4, cp.float32))
        comm.shutdown()  # collective: no peer kernel writes into a freed window
        comm.close()  # idempotent
        return MEM.opened.get(threading.get_ident(), 0)

    res, errs = _ranks(n, body, tmp_path)
    assert errs == [None] * n, errs
    assert res == [0] * n  # every opened peer mapping was closed


def _ll_parts(q, rows, size):
    """Rank q's fp16 inputs: random, with words of +0 (two +0 halves: the kernel's "0 or a failure?"
    case) and -0 halves: in every rank (the rank-order sum is -0: it starts from rank 0's value, not
    from +0) and in rank 0 only (+0)."""
    x = np.random.default_rng([11, q]).standard_normal((rows, size)).astype(np.float16)
    x[:, :4] = 0
    x[:, 4:6] = -0.0
    x[:, 6:8] = -0.0 if q == 0 else 0.0
    return x


@pytest.mark.parametrize("n", [2, 3])
def test_ll_rounds_rank_order_sums(fake_cupy, tmp_path, n):
    """run_rounds(ll=True): every round gives the rank-order fp32 sum bit for bit, on every rank, with
    random delays and depth 2 (the least LL allows); a second launch continues the tag's epochs over
    slots that still hold the first one's words; nothing writes a flag or an ack."""
    size, rows = 64, 5  # max_floats = size (as in the bench): 256 bytes a slot, the 64 fp16 as 32 LL words

    def body(r, rdv):
        comm = K.CudaCommunicator.create(rdv, max_floats=size, depth=2, tags=("ll",), timeout=5)
        want = np.stack([_ranksum([_ll_parts(q, rows, size)[k] for q in range(n)]) for k in range(rows)])
        for launch, nblocks in enumerate((1, 4)):
            out, times = comm.run_rounds("ll", _ll_parts(r, rows, size), 30, out_rounds=30, nblocks=nblocks,
                                         max_delay_ns=200_000, seed=launch, ll=True)
            got = out.get()
            assert got.shape == (30, size) and times.shape == (30, 6)
            assert all(np.array_equal(got[i].view(np.uint32), want[i % rows].view(np.uint32))
                       for i in range(30))
            assert (times[:, 1] >= times[:, 0]).all()
            assert comm.next_epoch("ll") == 30 * (launch + 1) + 1
        assert comm.peek(1) == ([0] * n, [0] * n)
        comm.shutdown()

    _, errs = _ranks(n, body, tmp_path)
    assert errs == [None] * n, errs


def test_ll_rounds_refuses_bad_arguments(fake_cupy, tmp_path):
    """The LL kernel's rules as one-line errors before anything is launched (epochs unchanged), and a
    tag carries LL words or the flag protocol, never both."""
    import cupy as cp

    def body(r, rdv):
        comm = K.CudaCommunicator.create(rdv, max_floats=32, depth=3, tags=("ll", "t"), timeout=5)
        ins = np.zeros((1, 32), np.float16)  # max_floats 32: 128 bytes a slot, 16 LL words
        too_big = r"17 LL words of 8 bytes exceed the slot \(128 bytes\); raise max_floats at create\(\) to 34"
        for x, delta, match in ((ins, 2, "delta must be 0, not 2"),
                                (np.zeros((1, 31), np.float16), 0, "n must be even, not 31"),
                                (np.zeros((1, 34), np.float16), 0, too_big)):
            with pytest.raises(ValueError, match=match) as ei:
                comm.run_rounds("ll", x, 4, delta=delta, ll=True)
            assert "\n" not in str(ei.value)
        assert comm.next_epoch("ll") == 1
        comm.run_rounds("ll", ins, 4, ll=True)
        with pytest.raises(KcclError, match="tag 'll' carried LL words; it cannot carry the flag protocol too"):
            comm.post("ll", cp.zeros(4, cp.float32))
        with pytest.raises(KcclError, match="cannot carry the flag protocol"):
            comm.run_rounds("ll", ins, 4)
        comm.collect(comm.post("t", cp.zeros(4, cp.float32)))
        with pytest.raises(KcclError, match="tag 't' carried the flag protocol; it cannot carry LL words too"):
            comm.run_rounds("t", ins, 4, ll=True)
        assert comm.next_epoch("ll") == 5 and comm.next_epoch("t") == 2
        comm.shutdown()
        shallow = K.CudaCommunicator.create(rdv, max_floats=32, depth=1, tags=("ll",), timeout=5)
        with pytest.raises(ValueError, match="needs depth >= 2 .* tag 'll' has 1") as ei:
            shallow.run_rounds("ll", ins, 4, ll=True)
        assert "\n" not in str(ei.value)
        shallow.shutdown()

    _, errs = _ranks(1, body, tmp_path)
    assert errs == [None], errs


def test_silent_rank_times_out_naming_it(fake_cupy, tmp_path):
    import cupy as cp

    def body(r, rdv):
        comm = K.CudaCommunicator.create(rdv, max_floats=64, depth=2, tags=("t",), timeout=0.5)
        if r == 0:
            with pytest.raises(KcclTimeout, match=r"rank 0 timed out after 0.5 s waiting for rank 1's data "
                                                  r"on channel '_coll' epoch 1"):
                comm.allreduce(cp.ones(4, cp.float32))
            assert comm.status[:3] == [CL.ERR_TIMEOUT_FLAG, 0, 1]
            with pytest.raises(KcclTimeout):  # unusable from now on
                comm.barrier()
        rdv.barrier()
        comm.close()

    _, errs = _ranks(2, body, tmp_path)
    assert errs == [None, None], errs


def test_ops_in_different_orders_fail_everywhere(fake_cupy, tmp_path):
    import cupy as cp

    def body(r, rdv):
        comm = K.CudaCommunicator.create(rdv, max_floats=64, depth=2, tags=("t",), timeout=5)
        with pytest.raises(KcclError, match="different orders"):
            if r == 0:
                comm.barrier()
            else:
                comm.allreduce(cp.ones(4, cp.float32))
        rdv.barrier()
        comm.close()

    _, errs = _ranks(3, body, tmp_path)
    assert errs == [None] * 3, errs


def test_dead_peer_raises_peer_lost(fake_cupy, tmp_path):
    import subprocess
    import cupy as cp

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()

    def body(r, rdv):
        comm = K.CudaCommunicator.create(rdv, max_floats=64, depth=2, tags=("t",), timeout=30)
        if r == 0:
            comm.peers[1] = (gone.pid, 0)  # rank 1 "exits": its pid is gone
            t0 = time.monotonic()
            with pytest.raises(PeerLost, match=rf"rank 1 \(pid {gone.pid}\) exited \(noticed by rank 0"):
                comm.allreduce(cp.ones(4, cp.float32))
            assert time.monotonic() - t0 < 5
            assert comm.status[0] == CL.ERR_ABORTED
        rdv.barrier()
        comm.close()

    _, errs = _ranks(2, body, tmp_path)
    assert errs == [None, None], errs


def test_layout_mismatch_refused_on_every_rank(fake_cupy, tmp_path):
    def body(r, rdv):
        with pytest.raises(KcclError, match="layout differs"):
            K.CudaCommunicator.create(rdv, max_floats=64 * (r + 1), depth=2, tags=("t",))

    _, errs = _ranks(2, body, tmp_path)
    assert errs == [None, None], errs


# ---- a kernel that will not end (check_kernel): the H200 run under MPS ----------------------------
# A rank SIGKILLed mid-decode under MPS: the survivors' kernels faulted (cudaErrorIllegalAddress), their
# event queries went on answering "not ready", and only a new stream got the error, 20 s later (the
# backend's hang bound). The fakes below: a kernel that never ends and ignores the abort word, and a
# runtime whose cudaStreamCreate raises (a faulted context), blocks, or works (a kernel still running).
class _CudaRuntimeError(RuntimeError):
    pass


_CudaRuntimeError.__name__ = "CUDARuntimeError"


class _Context:
    """The fake context's state: 'ok', 'faulted' (a new stream raises) or 'blocked' (it never returns)."""

    def __init__(self):
        self.state = "ok"
        self.release = threading.Event()   # ends the never-ending kernels and blocked calls
        self.synced = 0

    def stream_create(self, flags):
        if self.state == "faulted":
            raise _CudaRuntimeError("cudaErrorIllegalAddress: an illegal memory access was encountered")
        if self.state == "blocked":
            self.release.wait()
        return 1234

    def device_synchronize(self):
        self.synced += 1


@pytest.fixture
def ctx(fake_cupy, monkeypatch):
    c = _Context()
    monkeypatch.setattr(_Runtime, "streamCreateWithFlags", staticmethod(c.stream_create), raising=False)
    monkeypatch.setattr(_Runtime, "streamDestroy", staticmethod(lambda s: None), raising=False)
    monkeypatch.setattr(_Runtime, "setDevice", staticmethod(lambda d: None), raising=False)
    monkeypatch.setattr(_Runtime, "deviceSynchronize", staticmethod(c.device_synchronize))
    monkeypatch.setattr(K, "ABORT_GRACE_S", 0.5)
    monkeypatch.setattr(K, "STALL_PROBE_S", 0.3)
    yield c
    c.release.set()
    if K._probe_thread is not None:
        K._probe_thread.join(5)
        K._probe_thread = None


def _stuck_kernel(ctx):
    """A kccl_op that neither ends nor reads the abort word (killed by a fault, or a bug)."""
    return _Fn("kccl_op", lambda args: ctx.release.wait())


def _gone_pid():
    import subprocess
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


@pytest.mark.parametrize("state, note", [("faulted", "then this rank's CUDA context failed: cudaErrorIllegalAddress"),
                                         ("blocked", "then this rank's CUDA context failed: a CUDA call "
                                                     r"\(cudaStreamCreate\) did not return"),
                                         ("ok", "its kernel is still running 0.5 s after the abort word")])
def test_dead_peer_and_a_kernel_that_does_not_leave(ctx, tmp_path, state, note):
    """A peer died and this rank's kernel does not leave on the abort word: PeerLost naming the peer
    as soon as the context is found faulted (or a CUDA call blocks), else ABORT_GRACE_S after the
    abort word, saying the kernel is still running; the communicator is abandoned: close() does not
    synchronize (it would wait for the kernel forever) and frees nothing."""
    import cupy as cp

    gone = _gone_pid()

    def body(r, rdv):
        comm = K.CudaCommunicator.create(rdv, max_floats=64, depth=2, tags=("t",), timeout=30)
        rdv.barrier()
        if r == 0:
            comm._k_op = _stuck_kernel(ctx)
            comm.peers[1] = (gone, 0)
            ctx.state = state
            t0 = time.monotonic()
            with pytest.raises(PeerLost, match=rf"rank 1 \(pid {gone}\) exited \(noticed by rank 0 in allreduce; "
                                               + note) as ei:
                comm.allreduce(cp.ones(4, cp.float32))
            took = time.monotonic() - t0
            assert ei.value.rank == 1
            assert took < (0.5 + 1.0 if state == "ok" else 1.5), took
            assert comm.abandoned and comm._abort.value == 1
            with pytest.raises(PeerLost):        # unusable from now on
                comm.barrier()
            ctx.synced = 0
            comm.close()
            assert ctx.synced == 0 and comm._own == 0 and comm._opened == []
        else:
            comm.close()

    _, errs = _ranks(2, body, tmp_path)
    assert errs == [None, None], errs


def test_fault_with_every_peer_alive_is_a_kccl_error(ctx, tmp_path):
    """The kernel stalls (no progress for STALL_PROBE_S) and the context faulted while every peer is
    alive: KcclError saying so (after waiting ABORT_GRACE_S for a peer to show dead), not a hang."""
    import cupy as cp

    def body(r, rdv):
        comm = K.CudaCommunicator.create(rdv, max_floats=64, depth=2, tags=("t",), timeout=30)
        rdv.barrier()
        if r == 0:
            comm._k_op = _stuck_kernel(ctx)
            ctx.state = "faulted"
            t0 = time.monotonic()
            with pytest.raises(KcclError, match="rank 0: CUDA error in barrier, every peer alive: "
                                                "cudaErrorIllegalAddress") as ei:
                comm.barrier()
            assert not isinstance(ei.value, PeerLost)
            assert 0.3 < time.monotonic() - t0 < 2.5
            assert comm.abandoned
            comm.close()
        rdv.barrier()
        if r == 1:
            comm.close()

    _, errs = _ranks(2, body, tmp_path)
    assert errs == [None, None], errs


def test_peer_gone_sees_an_exiting_process(monkeypatch):
    """PF_EXITING in /proc/PID/stat counts as gone (a SIGKILLed process whose exit takes a while)."""
    import builtins
    import io
    import os
    me = os.getpid()
    assert not K.peer_gone(me)
    with open(f"/proc/{me}/stat", "rb") as f:
        stat = f.read()
    head, rest = stat[:stat.rindex(b")") + 2], stat[stat.rindex(b")") + 2:].split(b" ")
    rest[6] = str(int(rest[6]) | K.PF_EXITING).encode()
    exiting = head + b" ".join(rest)
    real_open = builtins.open

    def fake_open(path, *a, **k):
        if path == f"/proc/{me}/stat":
            return io.BytesIO(exiting)
        return real_open(path, *a, **k)

    monkeypatch.setattr(builtins, "open", fake_open)
    assert K.peer_gone(me)
    assert K.peer_gone(_gone_pid())


# ---- the cuda backend's decode loop against a kernel that faulted (no GPU: the loop only) -------------
class _Event:
    """A CuPy event whose kernel never completes and whose query never reports the fault (the H200)."""

    def record(self, stream=None):
        pass

    done = property(lambda self: False)


class _Ctx:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _backend(comm, n_written):
    """A CudaBackend with only what _generate touches: the kernel 'wrote' n_written tokens, then hung."""
    import cupy as cp
    from workers.cuda import backend as B

    b = object.__new__(B.CudaBackend)
    b.cp = cp
    cp.cuda.Event = _Event
    b.cfg = types.SimpleNamespace(vocab_size=100, num_hidden_layers=2)
    b.comm, b.nranks, b.num_slots = comm, comm.size, 1
    b.stream = _Ctx()
    b._poison = b._launch = lambda *a: None
    b._params = lambda *a: None
    b._timing = None
    ring = types.SimpleNamespace(a=np.full(64, -1, np.int32), free=lambda: pytest.fail("freed"))
    ring.a[:n_written] = 7
    b.ring = ring
    b.status = types.SimpleNamespace(a=np.array([n_written, 0, 0, 0], np.int32), free=lambda: pytest.fail("freed"))
    b.cancel = types.SimpleNamespace(a=np.zeros(1, np.int32), free=lambda: pytest.fail("freed"))
    return b


def test_backend_reports_peer_lost_when_the_kernel_faulted(ctx, tmp_path):
    """The H200 run, on the CPU: a peer died mid-decode, the kernel stopped after 5 tokens and its event
    never completes; a new stream raises cudaErrorIllegalAddress. The decode loop raises PeerLost
    naming the peer within a second (not the 20 s hang bound and a raw CUDA error), keeps the launch's
    events (destroying them would print tracebacks) and close() frees nothing."""
    from kog_dist.backend import Clock, RunResult
    from workers.cuda import backend as B
    from kog_dist.sampling import SamplingParams

    gone = _gone_pid()

    def body(r, rdv):
        comm = K.CudaCommunicator.create(rdv, max_floats=64, depth=2, tags=("t",), timeout=5)
        rdv.barrier()
        if r == 0:
            b = _backend(comm, 5)
            comm.peers[1] = (gone, 0)
            ctx.state = "faulted"
            kept = len(B._KEEP)
            t0 = time.monotonic()
            toks = []
            with pytest.raises(PeerLost, match=rf"rank 1 \(pid {gone}\) exited \(noticed by rank 0 in decode; "
                                               "then this rank's CUDA context failed: cudaErrorIllegalAddress"):
                b._generate(None, None, 1, 3, 50, SamplingParams(), (), (), toks.append, Clock(), RunResult(), None)
            assert time.monotonic() - t0 < 1.0
            assert toks == [7] * 5 and len(B._KEEP) == kept + 1
            b.close()
            comm.close()
        else:
            comm.close()

    _, errs = _ranks(2, body, tmp_path)
    assert errs == [None, None], errs


@pytest.mark.parametrize("n", [2, 3])
def test_allreduce_pieces_queues_every_piece(fake_cupy, tmp_path, n):
    """allreduce_pieces: an array of several slots summed in place over ranks, bit for bit the rank-order
    sum, with one host wait; every piece is one epoch of the collective channel."""
    import cupy as cp

    def body(r, rdv):
        comm = K.CudaCommunicator.create(rdv, max_floats=256, depth=3, tags=("attn",), timeout=5)
        for size, dt in ((256 * 5 + 24, np.float32), (1000, np.float16)):
            parts = [np.random.default_rng([size, q]).standard_normal(size).astype(dt) for q in range(n)]
            before = comm.peek(0)[0][r]
            x = cp.asarray(parts[r])
            assert comm.allreduce_pieces(x, piece=200) is x
            assert np.array_equal(x.get(), _ranksum(parts).astype(dt))
            comm.barrier()
            assert comm.peek(0)[0][r] - before == -(-size // 200) + 1      # the pieces, then the barrier
        with pytest.raises(ValueError, match="C-contiguous"):
            comm.allreduce_pieces(cp.asarray(np.zeros(64, np.int32)))
        comm.shutdown()
        return True

    res, errs = _ranks(n, body, tmp_path)
    assert errs == [None] * n, errs
    assert res == [True] * n
