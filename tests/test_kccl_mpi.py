"""kccl under a real mpiexec: allreduce, broadcast, barrier and post/collect against numpy, N = 1..8.

Each test launches one rank program (the strings below) and checks that every rank printed OK and
that no /dev/shm entry with the test's private prefix is left. Ranks oversubscribe 2 cores, so
rounds are few.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid

import pytest

from mpi_helpers import REPO_ROOT, have_mpiexec, mpi_env, run_mpi

pytestmark = [pytest.mark.mpi,
              pytest.mark.skipif(not have_mpiexec(), reason="no mpiexec (pip install mpich)")]

SHM_DIR = "/dev/shm"

CORRECTNESS = r'''
import sys, time
import numpy as np
from mpi4py import MPI
from kccl import Communicator, KcclError
from kccl.mpi_plain import allgather_json

D = 3072
comm = Communicator.create(MPI.COMM_WORLD, max_floats=8 * D, depth=4, tags=("attn", "mlp"))
r, n = comm.rank, comm.size

def part(seed, rank, shape):
    return np.random.default_rng([seed, rank]).standard_normal(shape).astype(np.float32)

def ranksum(seed, shape):
    acc = part(seed, 0, shape).copy()
    for q in range(1, n):
        acc += part(seed, q, shape)
    return acc

# allreduce: several shapes, bitwise equal to a rank-ordered float32 sum
for k, shape in enumerate([(D,), (1,), (5, D), (8, D), (0,), (2, 3, 4), ()]):
    got = comm.allreduce(part(k, r, shape))
    want = ranksum(k, shape)
    assert got.shape == want.shape and got.dtype == np.float32, (got.shape, want.shape)
    assert np.array_equal(got, want), ("allreduce", shape)
out = np.empty(D, np.float32)
assert comm.allreduce(part(99, r, (D,)), out=out) is out and np.array_equal(out, ranksum(99, (D,)))
# float64 input is converted to float32
assert comm.allreduce(np.full(3, 0.5)).dtype == np.float32

# broadcast from every root, several dtypes/shapes; non-roots pass None
for root in range(n):
    for k, arr in enumerate([part(root, 7, (3, D)), np.arange(5, dtype=np.int64) * (root + 1),
                             np.zeros((0, 4), np.float32), np.array(2.5, np.float64)]):
        got = comm.broadcast(arr if r == root else None, root=root)
        assert got.dtype == arr.dtype and got.shape == arr.shape and np.array_equal(got, arr)
    ints = comm.bcast_int64s([root, -1, 2**62] if r == root else None, root=root)
    assert ints.dtype == np.int64 and ints.tolist() == [root, -1, 2**62]

# barrier: nobody leaves before the last one entered (CLOCK_MONOTONIC is system-wide)
for k in range(3):
    time.sleep(0.002 * ((r + k) % n))
    t_in = time.monotonic()
    comm.barrier()
    t_out = time.monotonic()
    ins = allgather_json(MPI.COMM_WORLD, t_in)
    assert t_out >= max(ins), ("barrier", t_out, ins)

# post/collect: delta = 0..3, two tags interleaved, prefill [T, D] then decode [D]
for delta in range(4):
    posted = {"attn": [], "mlp": []}
    for layer in range(12):
        shape = (3, D) if layer < 2 else (D,)
        for tag in ("attn", "mlp"):
            seed = 1000 * delta + 10 * layer + (tag == "mlp")
            posted[tag].append((comm.post(tag, part(seed, r, shape)), seed, shape))
            if len(posted[tag]) > delta:
                h, s, shp = posted[tag].pop(0)
                assert np.array_equal(comm.collect(h), ranksum(s, shp)), (delta, layer, tag)
    for tag in ("attn", "mlp"):
        for h, s, shp in posted[tag]:
            assert np.array_equal(comm.collect(h), ranksum(s, shp))
        assert comm.pending(tag) == 0

# misuse is refused with a clear error, not a hang
def refused(fn, kind=KcclError):
    try:
        fn()
    except kind as exc:
        return str(exc)
    raise AssertionError(f"{fn} was not refused")

h1 = comm.post("attn", np.ones(4)); h2 = comm.post("attn", np.ones(4))
assert "order" in refused(lambda: comm.collect(h2))
comm.collect(h1); comm.collect(h2)
hs = [comm.post("mlp", np.ones(2)) for _ in range(4)]
assert "not collected" in refused(lambda: comm.post("mlp", np.ones(2)))
for h in hs:
    comm.collect(h)
assert "unknown tag" in refused(lambda: comm.post("moe", np.ones(2)))
refused(lambda: comm.allreduce(np.ones(8 * D + 1)), ValueError)
comm.barrier()
comm.close()
assert "closed" in refused(lambda: comm.barrier())
print(f"OK {r}")
'''


def leftovers(prefix: str) -> list[str]:
    return sorted(name for name in os.listdir(SHM_DIR) if name.startswith(prefix))


@pytest.fixture
def prefix():
    name = f"kccltest-{uuid.uuid4().hex[:8]}"
    yield name
    for entry in leftovers(name):  # never leak into the machine, even when a test fails
        os.unlink(os.path.join(SHM_DIR, entry))


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_collectives_match_numpy(n, prefix):
    res = run_mpi(n, code=CORRECTNESS, timeout=120, env={"KCCL_SHM_PREFIX": prefix})
    assert res.returncode == 0, res.output
    assert res.marks("OK") == list(range(n)), res.output
    assert leftovers(prefix) == []


def test_bench_relaunches_under_mpiexec_and_reports_json():
    res = subprocess.run([sys.executable, "-m", "kccl.bench", "--transport", "shm", "-n", "2",
                          "--iters", "50", "--warmup", "5", "--json"], capture_output=True,
                         text=True, timeout=120, env=mpi_env(), cwd=REPO_ROOT)
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout)
    assert report["nranks"] == 2 and report["floats"] == 3072
    for op in ("allreduce", "post", "collect", "pair", "barrier"):
        assert 0 < report["results"][op]["p50_us"] <= report["results"][op]["p99_us"]


def test_bench_refuses_cuda_ipc_with_exit_2():
    from kccl.cuda_ipc import cupy_missing
    if cupy_missing() is None:
        pytest.skip("CuPy and a GPU are here: cuda_ipc runs (tests/test_kccl_cuda_gpu.py)")
    res = subprocess.run([sys.executable, "-m", "kccl.bench", "--transport", "cuda_ipc", "-n", "2"],
                         capture_output=True, text=True, timeout=60, env=mpi_env(), cwd=REPO_ROOT)
    assert res.returncode == 2 and "needs CuPy and a CUDA GPU" in res.stderr


PLAIN = r'''
from mpi4py import MPI
from kccl.mpi_plain import allgather_bytes, allgather_json, allreduce_int, bcast_str, forbid_pickle
from kccl.rendezvous import MpiRendezvous
from launch.discovery import hosts_of, require_single_node
forbid_pickle()
w = MPI.COMM_WORLD
r, n = w.Get_rank(), w.Get_size()
try:
    w.allgather("x")   # every rank pickles its part first, so every rank raises (a bcast would hang the others)
    raise SystemExit("a pickling collective went through")
except RuntimeError as e:
    assert "pickling" in str(e), e
for root in range(n):
    for text in ("", "/tmp/model", "lanes ü ∑ " * 40):
        assert bcast_str(w, text if r == root else None, root=root) == text
got = allgather_bytes(w, bytes([r]) * (3 * r))          # rank 0 sends nothing
assert got == [bytes([q]) * (3 * q) for q in range(n)], got
assert allgather_json(w, {"rank": r, "ids": list(range(r)), "bw": r / 3}) == \
    [{"rank": q, "ids": list(range(q)), "bw": q / 3} for q in range(n)]
assert allreduce_int(w, r + 1, MPI.MIN) == 1 and allreduce_int(w, r + 1, MPI.MAX) == n
assert allreduce_int(w, 2**40 + r, MPI.SUM) == n * 2**40 + n * (n - 1) // 2
info = require_single_node(w)
assert (info.rank, info.size) == (r, n) and hosts_of(w) == [info.hostname] * n
rdv = MpiRendezvous(w)
assert rdv.share_str("hello" if r == 0 else None) == "hello" and rdv.agree(True) and not rdv.agree(r != n - 1)
print(f"OK {r}")
'''


@pytest.mark.parametrize("n", [1, 3])
def test_bootstrap_collectives_never_pickle(n):
    """kccl.mpi_plain (strings as bytes, numbers as int64, small structures as JSON) and the bootstrap
    built on it (launch.discovery, MpiRendezvous) work with mpi4py's pickling switched off, which also
    makes any lowercase collective raise (forbid_pickle, called by every entry point)."""
    res = run_mpi(n, code=PLAIN, timeout=60)
    assert res.returncode == 0, res.output
    assert res.marks("OK") == list(range(n)), res.output
