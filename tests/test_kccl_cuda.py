"""kccl cuda_ipc on the CPU: the host-side logic (window layout, handle records and their exchange,
ring/epoch/chunk arithmetic, status messages), a step-by-step model of the device protocol under
random interleavings, and nvcc compile checks of kccl/device/*.cu (skipped without nvcc).
The GPU behaviour is in tests/test_kccl_cuda_gpu.py (marker gpu)."""

from __future__ import annotations

import os
import random
import re
import shutil
import subprocess
import threading

import numpy as np
import pytest

from kccl import cuda_ipc as K
from kccl import cuda_layout as CL
from kccl.errors import KcclError, KcclTimeout, PeerLost
from kccl.rendezvous import FileRendezvous

HEADER = os.path.join(CL.DEVICE_DIR, "kccl.cuh")


# ---- constants and struct shared with kccl.cuh ------------------------------------------------------
def _defines() -> dict:
    out = {}
    for m in re.finditer(r"^#define\s+(KCCL_\w+)\s+(0x[0-9A-Fa-f]+|\d+)", open(HEADER).read(), re.M):
        out[m.group(1)] = int(m.group(2), 0)
    return out


def test_header_constants_match_python():
    d = _defines()
    assert d["KCCL_MAX_RANKS"] == CL.MAX_RANKS and d["KCCL_MAX_CH"] == CL.MAX_CH
    assert d["KCCL_MAX_DEPTH"] == CL.MAX_DEPTH and d["KCCL_LINE"] == CL.LINE
    assert d["KCCL_META_BYTES"] == CL.META_BYTES and d["KCCL_MAGIC"] == CL.MAGIC
    assert d["KCCL_STATUS_WORDS"] == CL.STATUS_WORDS
    assert [d[f"KCCL_ERR_{n}"] for n in ("TIMEOUT_FLAG", "TIMEOUT_ACK", "ABORTED", "OP_MISMATCH",
                                        "SIZE_MISMATCH", "EPOCH")] == [1, 2, 3, 4, 5, 6]
    ops = open(os.path.join(CL.DEVICE_DIR, "kccl_ops.cu")).read()
    for name, v in (("POST", CL.M_POST), ("WAIT", CL.M_WAIT), ("SUM", CL.M_SUM), ("COPY", CL.M_COPY),
                    ("ACK", CL.M_ACK)):
        assert re.search(rf"#define KCCL_M_{name} {v}\b", ops)


def test_struct_word_indices_match_dev_words():
    body = open(HEADER).read()
    struct = body[body.index("struct KcclDev {"):body.index("};", body.index("struct KcclDev {"))]
    idx = [int(m.group(2) or m.group(1)) for m in re.finditer(r"//\s*(\d+)(?:\.\.(\d+)|,\s*\d+)?", struct)]
    assert max(idx) + 1 == CL.DEV_WORDS == 36
    lay = CL.CudaLayout(2, 3072 * 2, (("_coll", 2), ("attn", 3), ("mlp", 3)))
    w = lay.dev_words([0x1000, 0x2000], 1, 0x7000, 0x7040, 5 * 10**9)
    assert list(w[:2]) == [0x1000, 0x2000] and not w[2:8].any()
    assert list(w[8:13]) == [1, 2, 3, lay.slot_bytes, lay.payload_bytes]
    assert list(w[13:16]) == [lay.off_flags, lay.off_acks, lay.off_cnt]
    assert list(w[16:20]) == [0x7000, 0x7040, 5 * 10**9, CL.MAGIC]
    assert list(w[20:23]) == [2, 3, 3] and list(w[28:31]) == lay.slot_off


# ---- layout ------------------------------------------------------------------------------------
@pytest.mark.parametrize("nranks", [1, 2, 4, 8])
@pytest.mark.parametrize("payload", [1, 100, 6144, 12288, 196608])
def test_layout_regions_disjoint_and_aligned(nranks, payload):
    chans = (("_coll", 2), ("attn", 3), ("mlp", 5))
    lay = CL.CudaLayout(nranks, payload, chans)
    assert lay.payload_bytes >= payload and lay.payload_bytes % 16 == 0
    assert lay.slot_bytes % CL.LINE == 0 and lay.slot_bytes >= CL.META_BYTES + lay.payload_bytes
    regions = [(0, CL.HEADER_BYTES)]
    for c in range(len(chans)):
        for s in range(nranks):
            regions.append((lay.flag_offset(c, s), lay.flag_offset(c, s) + 8))
            regions.append((lay.ack_offset(c, s), lay.ack_offset(c, s) + 8))
    for k in range(2):
        for c in range(CL.MAX_CH):
            for r in range(CL.MAX_DEPTH):
                regions.append((lay.counter_offset(k, c, r), lay.counter_offset(k, c, r) + 8))
    for c, (_, depth) in enumerate(chans):
        for s in range(nranks):
            for e in range(1, depth + 1):
                off = lay.slot_offset(c, s, e)
                assert (off + CL.META_BYTES) % 16 == 0 and off % CL.LINE == 0
                regions.append((off, off + CL.META_BYTES + lay.payload_bytes))
    regions.sort()
    for (a0, a1), (b0, b1) in zip(regions, regions[1:]):
        assert a1 <= b0, "overlapping regions"
    assert regions[-1][1] <= lay.size and lay.size % (1 << 16) == 0
    # flag/ack words have 128-byte lines of their own
    assert all(lay.flag_offset(0, s) % CL.LINE == 0 for s in range(nranks))


def test_layout_slot_ring_and_hash():
    lay = CL.CudaLayout(4, 64, (("_coll", 2), ("attn", 3)))
    assert lay.slot_offset(1, 2, 3) == lay.slot_offset(1, 2, 6) == lay.slot_offset(1, 2, 0)
    assert len({lay.slot_offset(1, 2, e) for e in (1, 2, 3)}) == 3
    assert lay.slot_offset(1, 3, 1) - lay.slot_offset(1, 2, 1) == 3 * lay.slot_bytes
    other = CL.CudaLayout(4, 64, (("_coll", 2), ("attn", 4)))
    assert lay.layout_hash != other.layout_hash
    assert lay.layout_hash == CL.CudaLayout(4, 64, (("_coll", 2), ("attn", 3))).layout_hash


def test_layout_limits():
    with pytest.raises(ValueError, match="1..8 ranks"):
        CL.CudaLayout(9, 64, (("_coll", 2),))
    with pytest.raises(ValueError, match="depth"):
        CL.CudaLayout(2, 64, (("_coll", 2), ("attn", 17)))
    with pytest.raises(ValueError, match="channels"):
        CL.CudaLayout(2, 64, tuple((f"t{i}", 2) for i in range(9)))


# ---- epoch arithmetic ----------------------------------------------------------------------------------
def test_ring_and_last_arrival():
    assert [CL.ring_index(e, 3) for e in range(1, 8)] == [1, 2, 0, 1, 2, 0, 1]
    assert CL.ack_needed(5, 3) == 2
    c, seen = 0, []
    for nchunks in (3, 1, 2):  # the block count may change from one epoch to the next
        for _ in range(nchunks):
            last, c = CL.last_arrival(c, nchunks)
            seen.append(last)
        assert c == 0
    assert seen == [False, False, True, True, False, True]
    src = open(HEADER).read()
    assert "kccl_add_acq_rel(counter, 1ull) + 1 != (kccl_u64)nchunks" in src  # same rule on the device
    assert "*(volatile kccl_u64*)counter = 0;" in src
    assert CL.ERROR_WORD_OFFSET == 256 and "(d.base[d.rank] + 256)" in src
    assert CL.ERROR_WORD_OFFSET >= 8 * len(CL.CudaLayout(2, 64, (("_coll", 2),)).header_words(0))


class _Model:
    """The device protocol of kccl.cuh, one step per call, for N ranks x B blocks (post chunks, last
    arriver publishes; readers wait for every flag, last reader acks every source)."""

    def __init__(self, n, blocks, depth, delta, rounds, rng, ack_wait=True):
        self.n, self.b, self.depth, self.delta, self.rounds = n, blocks, depth, delta, rounds
        self.rng, self.ack_wait = rng, ack_wait
        self.flag = [[0] * n for _ in range(n)]        # flag[dst][src]
        self.ack = [[0] * n for _ in range(n)]         # ack[owner][by]
        self.cnt = [[[0] * depth for _ in range(2)] for _ in range(n)]
        self.slot = [[[[None] * blocks for _ in range(depth)] for _ in range(n)] for _ in range(n)]
        self.got = {}

    def actor(self, r, b):
        for s in range(self.rounds + self.delta):
            if s < self.rounds:
                e = s + 1
                need = e - self.depth
                while self.ack_wait and not all(self.ack[r][q] >= need for q in range(self.n)):
                    yield
                for q in range(self.n):  # this block's chunk into every rank's slot
                    self.slot[q][r][e % self.depth][b] = (e, r, b)
                    yield
                last, self.cnt[r][0][e % self.depth] = CL.last_arrival(self.cnt[r][0][e % self.depth], self.b)
                if last:
                    for q in range(self.n):
                        self.flag[q][r] = e
                        yield
            if s >= self.delta:
                e = s - self.delta + 1
                while not all(self.flag[r][q] >= e for q in range(self.n)):
                    yield
                for q in range(self.n):
                    self.got[(r, b, e, q)] = self.slot[r][q][e % self.depth][b]
                    yield
                last, self.cnt[r][1][e % self.depth] = CL.last_arrival(self.cnt[r][1][e % self.depth], self.b)
                if last:
                    for q in range(self.n):
                        self.ack[q][r] = e
                        yield

    def run(self):
        actors = [self.actor(r, b) for r in range(self.n) for b in range(self.b)]
        live = list(actors)
        steps = 0
        while live:
            a = self.rng.choice(live)
            try:
                next(a)
            except StopIteration:
                live.remove(a)
            steps += 1
            assert steps < 5_000_000, "no progress (deadlock)"
        return all(v == (e, q, b) for (r, b, e, q), v in self.got.items()) and \
            len(self.got) == self.n * self.b * self.rounds * self.n


@pytest.mark.parametrize("n,blocks,delta", [(2, 1, 0), (2, 3, 2), (4, 2, 1), (3, 3, 3)])
def test_protocol_model_random_interleavings(n, blocks, delta):
    for seed in range(4):
        assert _Model(n, blocks, delta + 1, delta, 25, random.Random(seed)).run()


def test_protocol_model_without_ack_wait_fails():
    bad = 0
    for seed in range(20):
        bad += not _Model(3, 2, 2, 1, 30, random.Random(seed), ack_wait=False).run()
    assert bad > 0  # the ack wait is what keeps a slot from being overwritten too early


# ---- handle records and their exchange ------------------------------------------------------------
def test_record_round_trip_and_errors():
    h = bytes(range(64))
    rec = CL.pack_record(3, 0xABCDEF, 1234, 99, 1 << 20, h, "0000:4E:00.0")
    assert len(rec) == CL.RECORD_BYTES == 128
    d = CL.unpack_record(rec)
    assert d == {"rank": 3, "layout_hash": 0xABCDEF, "pid": 1234, "starttime": 99, "size": 1 << 20,
                 "handle": h, "bus_id": "0000:4E:00.0"}
    with pytest.raises(KcclError, match="128"):
        CL.unpack_record(rec[:-1])
    with pytest.raises(KcclError, match="magic"):
        CL.unpack_record(bytes(128))
    with pytest.raises(ValueError, match="64 bytes"):
        CL.pack_record(0, 0, 0, 0, 0, b"x", "")


class _FakeMpi:
    """Allgather over threads, like mpi4py's uppercase call on numpy buffers."""

    def __init__(self, size):
        self.size, self.parts, self.bar = size, [None] * size, threading.Barrier(size)

    def view(self, rank):
        fake = self

        class C:
            def Allgather(self, send, recv):
                assert send.dtype == np.uint8 and recv.dtype == np.uint8
                fake.parts[rank] = send.copy()
                fake.bar.wait()
                recv[:] = np.concatenate(fake.parts)
                fake.bar.wait()

        class R:
            comm = C()

        R.rank, R.size = rank, self.size
        return R()


def _gather_all(rdvs, payloads):
    out = [None] * len(rdvs)

    def run(i):
        out[i] = CL.allgather_bytes(rdvs[i], payloads[i])

    ts = [threading.Thread(target=run, args=(i,)) for i in range(len(rdvs))]
    for t in ts:
        t.start()
    for t in ts:
        t.join(10)
    return out


def test_allgather_bytes_mpi_and_files(tmp_path):
    recs = [CL.pack_record(r, 7, 100 + r, 0, 4096, bytes([r]) * 64, "bus") for r in range(3)]
    fake = _FakeMpi(3)
    for got in _gather_all([fake.view(r) for r in range(3)], recs):
        assert got == recs
    files = [FileRendezvous(str(tmp_path), r, 3, timeout=10) for r in range(3)]
    for got in _gather_all(files, recs):
        assert got == recs


def test_check_records():
    lay = CL.CudaLayout(2, 64, (("_coll", 2),))
    good = [CL.unpack_record(CL.pack_record(r, lay.layout_hash, 1, 0, lay.size, bytes(64), "b")) for r in range(2)]
    CL.check_records(good, lay)
    bad = [good[0], dict(good[1], layout_hash=1)]
    with pytest.raises(KcclError, match="rank 1's layout differs"):
        CL.check_records(bad, lay)
    with pytest.raises(KcclError, match="says rank 0"):
        CL.check_records([good[0], good[0]], lay)


def test_describe_status_messages():
    chans = (("_coll", 2), ("attn", 3))
    cls, msg = CL.describe_status([1, 0, 1, 1, 17, 16, 0, 0], chans, 2.0)
    assert cls is KcclTimeout and "rank 0 timed out after 2 s waiting for rank 1" in msg and "'attn'" in msg
    assert CL.describe_status([2, 3, 2, 0, 5, 2, 0, 0], chans, 1)[0] is KcclTimeout
    assert CL.describe_status([3, 0, 1, 0, 5, 2, 0, 0], chans, 1)[0] is PeerLost
    cls, msg = CL.describe_status([4, 1, 0, 0, 9, 3, 0, 0], chans, 1)
    assert cls is KcclError and "barrier" in msg and "different orders" in msg


def test_without_cupy_create_explains():
    if K.cupy_missing() is None:
        pytest.skip("CuPy and a GPU are here")
    from kccl import Communicator

    with pytest.raises(NotImplementedError, match="needs CuPy and a CUDA GPU"):
        Communicator.create(None, transport="cuda_ipc")


# ---- nvcc ------------------------------------------------------------------------------------------
NVCC = shutil.which("nvcc")
SOURCES = ["kccl_ops.cu", "kccl_test.cu"]


@pytest.mark.skipif(NVCC is None, reason="nvcc is not on PATH")
@pytest.mark.parametrize("name", SOURCES)
def test_nvcc_compiles(name, tmp_path):
    r = subprocess.run([NVCC, "-arch=sm_90", "-std=c++17", "-c", os.path.join(CL.DEVICE_DIR, name),
                        "-o", str(tmp_path / "x.o")], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]


@pytest.mark.skipif(NVCC is None, reason="nvcc is not on PATH")
def test_nvcc_header_alone_and_inlined_source(tmp_path):
    user = tmp_path / "user.cu"  # how a monokernel uses it: struct pointer in, one block posts/collects
    user.write_text('#include "kccl.cuh"\n'
                    'extern "C" __global__ void k(const KcclDev* d, const float* x, float* y, int n,\n'
                    '                             unsigned long long e) {\n'
                    '  if (!kccl_post(*d, 1, e, x, 4LL * n, 4)) return;\n'
                    '  kccl_collect_f32(*d, 1, e, y, n);\n}\n')
    r = subprocess.run([NVCC, "-arch=sm_90", "-std=c++17", "-DKCCL_MAX_RANKS=8", f"-I{CL.DEVICE_DIR}", "-c",
                        str(user), "-o", str(tmp_path / "u.o")], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    src = tmp_path / "all.cu"
    src.write_text(CL.device_source())
    assert '#include "' not in CL.device_source()
    r = subprocess.run([NVCC, "-arch=sm_90", "-std=c++17", "-c", str(src), "-o", str(tmp_path / "a.o")],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]


def test_op_blocks_fit_ranks_sharing_a_gpu():
    """Host-API kernels: one block per 16 KiB up to 32; ranks sharing a GPU (MPS) get at most half of their
    share of its SMs, so all their kernels of one op are resident together (they wait for each other)."""
    from kccl.cuda_comm import op_blocks
    assert op_blocks(100, 132, 1) == 1 and op_blocks(16384 * 5, 132, 1) == 5 and op_blocks(1 << 21, 132, 1) == 32
    assert op_blocks(1 << 21, 132, 2) == 32            # 2 ranks on an H200: as before (measured)
    assert op_blocks(1 << 21, 132, 4) == 16 and op_blocks(1 << 21, 132, 8) == 8
    for n in (2, 3, 4, 5, 8):
        assert n * op_blocks(1 << 21, 132, n) <= 132
    assert op_blocks(1 << 21, 0, 8) == 32               # SM count unknown: no cap
