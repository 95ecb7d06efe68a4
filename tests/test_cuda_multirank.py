"""The multi-rank `cuda` backend (workers/cuda/multirank.py, monokernel.cu `#if KOG_NRANKS > 1`).

CPU (always run): the lane ranges and the rank's sub-model, the build's defines (one rank: exactly the
measured build's), the epoch schedule against the calls the numpy engine makes to its exchange, the
ring depth against a model of the kernel's post / wait / ack protocol under random interleavings of
ranks (and a depth one short deadlocks), slot sizes, the prefill gather pieces, and nvcc compiles of
the multi-rank kernel for N = 2, 4, 8 (when nvcc is installed).

GPU (marker gpu; skipped without CuPy, a GPU or mpiexec; tests/gpu_multirank.sh runs them on the H200
under MPS): N = 2, 4, 8 ranks give the one-rank greedy ids (and the numpy engine's) for 128 tokens of an
fp32 tiny checkpoint with 8 lanes, a second request continues the slot and the kccl epochs, seeded
sampling gives the one-rank ids; a rank SIGKILLed mid-decode makes the others raise PeerLost instead of
spinning. STATUS: the GPU tests were written without a GPU and have never run.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys

import numpy as np
import pytest

from kog_dist.config import LaneformerConfig
from kog_dist.tiny import TINY_DEFAULTS
from workers.cuda import multirank as mr

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cfg(**over):
    d = dict(TINY_DEFAULTS)
    d.update(over)
    d["model_type"] = "laneformer_tp"
    return LaneformerConfig.from_dict(d)


VARIANTS = {
    "L8_d2": dict(num_lanes=8),
    "L8_d1_no_early": dict(num_lanes=8, broadcast_delay=1, use_early_comm=False),
    "L8_no_future": dict(num_lanes=8, early_layers_to_future=False),
    "L4_d3_6layers_no_flags": dict(broadcast_delay=3, num_hidden_layers=6, use_early_comm=False,
                                   early_layers_to_future=False),
    "L4_d2_8layers": dict(num_hidden_layers=8),
    "L8_d3_10layers_mha": dict(num_lanes=8, broadcast_delay=3, num_hidden_layers=10, num_key_value_heads=None),
    "no_comm": dict(num_lanes=8, use_comm=False),
}


# ---- lanes and the rank's sub-model ----------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_rank_views_cover_the_model(n):
    cfg = _cfg(num_lanes=8)
    views = [mr.RankView(cfg, r, n) for r in range(n)]
    assert [g for v in views for g in v.lanes] == list(range(8))          # contiguous, in rank order
    for v in views:
        assert v.num_lanes == 8 // n and v.num_attention_heads * n == cfg.num_attention_heads
        assert v.kv_heads * n == cfg.kv_heads and v.intermediate_size * n == cfg.intermediate_size
        # per-lane shapes and everything else are the model's
        assert (v.heads_per_lane, v.kv_heads_per_lane, v.ffn_per_lane, v.head_dim) == \
            (cfg.heads_per_lane, cfg.kv_heads_per_lane, cfg.ffn_per_lane, cfg.head_dim)
        assert v.vocab_size == cfg.vocab_size and v.hidden_size == cfg.hidden_size and v.full is cfg


def test_ranks_must_divide_lanes():
    with pytest.raises(Exception, match="do not divide"):
        mr.check(_cfg(num_lanes=8), 3)
    with pytest.raises(ValueError, match="1..8"):
        mr.check(_cfg(num_lanes=16, num_attention_heads=16, num_key_value_heads=16, intermediate_size=512), 16)
    with pytest.raises(ValueError, match="num_hidden_layers > broadcast_delay"):
        mr.check(_cfg(num_lanes=4, num_hidden_layers=2, broadcast_delay=2), 2)
    with pytest.raises(ValueError, match="16 at most"):
        mr.check(_cfg(num_lanes=4, num_hidden_layers=40, broadcast_delay=15), 2)
    mr.check(_cfg(num_lanes=4, num_hidden_layers=40, broadcast_delay=14), 2)


def test_one_rank_defines_are_the_measured_build():
    from workers.cuda.build import defines
    cfg = _cfg(num_lanes=8)
    one = defines(cfg, "F32", 128)
    assert defines(cfg, "F32", 128, nranks=1) == one and list(defines(cfg, "F32", 128, nranks=1)) == list(one)
    assert not any(k in one for k in ("KOG_NRANKS", "CFG_LG")) and mr.defines(cfg, 1) == {}
    two = defines(cfg, "F32", 64, nranks=2)
    assert two["KOG_NRANKS"] == 2 and two["CFG_LG"] == 8 and two["CFG_L"] * 2 == 8
    assert two["CFG_H"] * 2 == one["CFG_H"] and two["CFG_KV"] * 2 == one["CFG_KV"] and two["CFG_F"] * 2 == one["CFG_F"]
    assert two["CFG_HD"] == one["CFG_HD"] and two["CFG_V"] == one["CFG_V"]


@pytest.mark.parametrize("sms,n,want", [(132, 1, 128), (132, 2, 64), (132, 4, 32), (132, 8, 16)])
def test_blocks_per_rank_keep_the_attention_chunks(sms, n, want):
    """NB / KV (the attention's position chunks) stays that of one rank, so the ranks' attention sums
    are the one-rank kernel's (the ids then match bit for bit, not only up to rounding)."""
    cfg = _cfg(num_lanes=8)
    v = mr.RankView(cfg, 0, n)
    nb = mr.blocks_per_rank(v, sms, n)
    assert nb == want and nb // v.kv_heads == 128 // cfg.kv_heads


# ---- the epoch schedule against the numpy engine's exchange calls ---------------------------------
class _Recorder:
    def __init__(self):
        from kog_dist.engine import LocalExchange
        self.inner, self.calls = LocalExchange(), []

    def allreduce(self, kind, x):
        self.calls.append(("allreduce", kind))
        return self.inner.allreduce(kind, x)

    def post(self, kind, x):
        self.calls.append(("post", kind))
        return self.inner.post(kind, x)

    def collect(self, h):
        self.calls.append(("collect", None))
        return self.inner.collect(h)


def _engine_calls(cfg):
    from kog_dist.engine import ReferenceEngine
    rng = np.random.default_rng(0)
    import tempfile
    from kog_dist.checkpoint import Model
    from kog_dist.tiny import write_tiny_checkpoint
    with tempfile.TemporaryDirectory() as d:
        over = {k: getattr(cfg, k) for k in ("num_lanes", "broadcast_delay", "use_comm", "use_early_comm",
                                            "early_layers_to_future", "num_hidden_layers", "num_key_value_heads")}
        write_tiny_checkpoint(d, dtype="F32", seed=1, **over)
        m = Model(d, progress=False)
        rec = _Recorder()
        eng = ReferenceEngine(m.cfg, m.weights, m.embed, exchange=rec)
        eng.prefill([int(rng.integers(3, 500))])
        return [c for c in rec.calls if c[1] != "final"]


def _schedule_calls(cfg):
    out = []
    d = cfg.broadcast_delay
    for i in range(cfg.num_hidden_layers):
        for kind in ("attn", "mlp"):
            if mr.read_now(cfg, i):
                out.append(("allreduce", kind))
            elif mr.posted(cfg, i):
                out.append(("post", kind))
            if i >= d and mr.read_later(cfg, i - d) and not mr.read_now(cfg, i - d):
                out.append(("collect", None))
    return out


@pytest.mark.parametrize("name", list(VARIANTS))
def test_schedule_matches_the_engine_exchange(name):
    cfg = _cfg(**VARIANTS[name])
    assert _schedule_calls(cfg) == _engine_calls(cfg)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_epochs_are_dense_and_per_token(name):
    cfg = _cfg(**VARIANTS[name])
    s = mr.schedule(cfg, e0=5, tokens=3)
    assert [e for _, _, e, _, _ in s] == list(range(5, 5 + 3 * mr.npost(cfg)))
    for _, i, _, reads, ack in s:
        assert reads and ack == max(reads) and all(i <= r < cfg.num_hidden_layers for r in reads)
    assert mr.epochs_run(cfg, 7) == {"attn": 7 * mr.npost(cfg), "mlp": 7 * mr.npost(cfg), "final": 7}


# ---- the kernel's protocol: post_begin (acks of e - depth), delayed wait + ack, publish, early wait + ack
def _program(cfg, tokens):
    """One rank's kccl steps in kernel order: per layer WO (kind 0) producer, W13 consumer, W2 (kind 1)
    producer, next QKV consumer; per token the final exchange."""
    d, NL, npost = cfg.broadcast_delay, cfg.num_hidden_layers, mr.npost(cfg)
    ep = lambda n, i: 1 + n * npost + mr.index(cfg, i)
    prog = []
    for n in range(tokens):
        for i in range(NL):
            for kind in (0, 1):
                if mr.posted(cfg, i):
                    prog.append(("begin", kind, ep(n, i)))
                if i >= d and mr.read_later(cfg, i - d):
                    prog += [("wait", kind, ep(n, i - d)), ("ack", kind, ep(n, i - d))]
                if mr.posted(cfg, i):
                    prog.append(("publish", kind, ep(n, i)))
                if mr.read_now(cfg, i):
                    prog.append(("wait", kind, ep(n, i)))
                    if not mr.read_later(cfg, i):
                        prog.append(("ack", kind, ep(n, i)))
        prog += [("begin", 2, n + 1), ("publish", 2, n + 1), ("wait", 2, n + 1), ("ack", 2, n + 1)]
    return prog


def _simulate(cfg, nranks, depth, tokens=3, seed=0):
    """Random interleaving of the ranks' programs; returns False on a deadlock."""
    rnd = random.Random(seed)
    progs = [_program(cfg, tokens) for _ in range(nranks)]
    pc = [0] * nranks
    flag = [[[0] * nranks for _ in range(nranks)] for _ in range(3)]    # flag[c][dst][src]
    ack = [[[0] * nranks for _ in range(nranks)] for _ in range(3)]     # ack[c][owner][by]
    while True:
        ready = []
        for r in range(nranks):
            if pc[r] == len(progs[r]):
                continue
            op, c, e = progs[r][pc[r]]
            if op == "begin" and not all(ack[c][r][q] >= e - depth for q in range(nranks)):
                continue
            if op == "wait" and not all(flag[c][r][q] >= e for q in range(nranks)):
                continue
            ready.append(r)
        if not ready:
            return all(pc[r] == len(progs[r]) for r in range(nranks))
        r = rnd.choice(ready)
        op, c, e = progs[r][pc[r]]
        if op == "publish":
            for q in range(nranks):
                assert flag[c][q][r] == e - 1 or (c < 2 and flag[c][q][r] < e)
                flag[c][q][r] = e
        elif op == "ack":
            for q in range(nranks):
                ack[c][q][r] = max(ack[c][q][r], e)
        elif op == "begin":
            # the slot's previous tenant was read by every rank
            assert all(ack[c][r][q] >= e - depth for q in range(nranks))
        pc[r] += 1


@pytest.mark.parametrize("name", list(VARIANTS))
@pytest.mark.parametrize("nranks", [2, 4])
def test_depth_is_enough_and_one_less_deadlocks(name, nranks):
    cfg = _cfg(**VARIANTS[name])
    dep = mr.depth(cfg)
    for seed in range(20):
        assert _simulate(cfg, nranks, dep, seed=seed), f"deadlock with depth {dep}"
    need = mr.max_in_flight(cfg)
    if need >= 1 and mr.npost(cfg) > need:
        assert not _simulate(cfg, nranks, need - 1), f"depth {need - 1} should deadlock"
        assert _simulate(cfg, nranks, need), f"depth {need} should be enough"


# ---- slot sizes and the prefill gathers -------------------------------------------------------------
@pytest.mark.parametrize("n", [2, 4, 8])
def test_slot_sizes_2b(n):
    from kog_dist.bench import shape_config
    cfg = shape_config("2b")
    kw = mr.comm_kwargs(cfg, n)
    assert kw["tags"] == ("attn", "mlp", "final") and kw["depth"] >= cfg.broadcast_delay + 1
    lr = cfg.num_lanes // n
    assert 4 * kw["max_floats"] >= 4 * (lr * cfg.hidden_size + 4)      # layer partials and the final rows
    assert mr.final_floats(cfg, n) == lr * cfg.hidden_size + 4
    win = mr.window_bytes(cfg, n)
    assert win < 64 << 20, win          # per rank: 256 KiB slots x (2 + 3 depth) x N sources


@pytest.mark.parametrize("total,piece", [(1, 4), (8, 4), (9, 4), (262144 * 3 + 5, 262144)])
def test_gather_pieces_cover(total, piece):
    p = mr.gather_pieces(total, piece)
    assert p[0][0] == 0 and p[-1][1] == total and all(a < b <= a + piece for a, b in p)
    assert all(p[k][1] == p[k + 1][0] for k in range(len(p) - 1))
    assert all(a % 4 == 0 for a, _ in p)        # 16-byte aligned views (piece a multiple of 4)


# ---- nvcc: the multi-rank kernel compiles (N = 2, 4, 8) --------------------------------------------
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc")
@pytest.mark.parametrize("n", [2, 8])
def test_nvcc_compiles_multirank(n, tmp_path):
    from workers.cuda import build
    cfg = _cfg(num_lanes=8)
    src = tmp_path / "mono.cu"
    src.write_text(build.source())
    defs = build.defines(cfg, "F32", 128 // n, nranks=n)
    cmd = ["nvcc", "-arch=sm_90", "-std=c++17", "-ptx", "-o", str(tmp_path / "m.ptx"), "-x", "cu", str(src)]
    cmd += [f"-D{k}={v}" for k, v in defs.items()]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-4000:]
    ptx = (tmp_path / "m.ptx").read_text()
    assert "pf_combine_mr" in ptx and "st.release.sys" in ptx and "ld.acquire.sys" in ptx


# ---- GPU ------------------------------------------------------------------------------------------
from kccl.cuda_ipc import cupy_missing  # noqa: E402 (imports without CuPy)

_why = cupy_missing()
GEN = 128
PROMPT = [1, 17, 33, 250, 9, 77, 401, 12, 5, 300, 41, 42, 100, 7, 8, 9]

RANK_RUN = r'''
import json, os, sys
import cupy as cp
from mpi4py import MPI
from kccl import Communicator
from kog_dist.config import load_config
from kog_dist.sampling import SamplingParams
from workers.backend import RunCommand
from workers.cuda.backend import CudaBackend
from workers.cuda.multirank import comm_kwargs
world = MPI.COMM_WORLD
cp.cuda.Device(world.rank % cp.cuda.runtime.getDeviceCount()).use()
model, gen, prompt = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
cfg = load_config(model)
comm = Communicator.create(world, transport="cuda_ipc", **comm_kwargs(cfg, world.size, timeout=30.0))
b = CudaBackend(model, max_seq=512, num_slots=2, progress=False, comm=comm)
r1 = b.run(RunCommand(append=prompt, max_new_tokens=gen), ignore_eos=True)
r2 = b.run(RunCommand(slot=0, keep=r1.cached, append=[5, 6, 7], max_new_tokens=16), ignore_eos=True)
r3 = b.run(RunCommand(slot=1, append=prompt[:5], max_new_tokens=32,
                      sampling=SamplingParams(temperature=0.8, top_p=0.9, seed=7)), ignore_eos=True)
print("IDS", world.rank, json.dumps([r1.token_ids, r2.token_ids, r3.token_ids]), flush=True)
print("MS", world.rank, round(b.last_kernel_ms, 2), flush=True)
b.close()
comm.shutdown()
print("OK", world.rank, flush=True)
'''

RANK_KILLED = r'''
import os, signal, sys, time
import cupy as cp
from kccl import Communicator, FileRendezvous, PeerLost, KcclError
from kog_dist.config import load_config
from workers.backend import RunCommand
from workers.cuda.backend import CudaBackend
from workers.cuda.multirank import comm_kwargs
rank, size = int(os.environ["KCCL_RANK"]), int(os.environ["KCCL_SIZE"])
rdv = FileRendezvous(os.environ["KCCL_RENDEZVOUS"], rank, size, timeout=120.0)
cp.cuda.Device(0).use()
model = sys.argv[1]
cfg = load_config(model)
comm = Communicator.create(rdv, transport="cuda_ipc", **comm_kwargs(cfg, size, timeout=60.0))
b = CudaBackend(model, max_seq=4096, num_slots=1, progress=False, comm=comm)
seen = [0]
def on_token(t):
    seen[0] += 1
    if rank == size - 1 and seen[0] == 50:
        os.kill(os.getpid(), signal.SIGKILL)
t0 = time.perf_counter()
try:
    b.run(RunCommand(append=[1, 2, 3], max_new_tokens=3000), on_token=on_token, ignore_eos=True)
    print("NOERROR", rank, flush=True)
    sys.exit(3)
except PeerLost as e:
    print("LOST", rank, e.rank, f"{time.perf_counter() - t0:.2f}", seen[0], str(e), flush=True)
    comm.close()
    sys.exit(1)
except (KcclError, RuntimeError) as e:
    print("ERROR", rank, repr(e), flush=True)
    comm.close()
    sys.exit(2)
'''


@pytest.fixture(scope="module")
def tiny_l8(tmp_path_factory):
    from kog_dist.tiny import write_tiny_checkpoint
    d = str(tmp_path_factory.mktemp("tiny_l8"))
    write_tiny_checkpoint(d, dtype="F32", seed=11, num_lanes=8)
    return d


def _one_rank(model):
    from kog_dist.sampling import SamplingParams
    from workers.backend import RunCommand
    from workers.cuda.backend import CudaBackend
    b = CudaBackend(model, max_seq=512, num_slots=2, progress=False)
    r1 = b.run(RunCommand(append=PROMPT, max_new_tokens=GEN), ignore_eos=True)
    r2 = b.run(RunCommand(slot=0, keep=r1.cached, append=[5, 6, 7], max_new_tokens=16), ignore_eos=True)
    r3 = b.run(RunCommand(slot=1, append=PROMPT[:5], max_new_tokens=32,
                          sampling=SamplingParams(temperature=0.8, top_p=0.9, seed=7)), ignore_eos=True)
    b.close()
    return [r1.token_ids, r2.token_ids, r3.token_ids]


def _numpy_greedy(model, prompt, n):
    from kog_dist.checkpoint import Model
    from kog_dist.engine import ReferenceEngine
    m = Model(model, progress=False)
    eng = ReferenceEngine(m.cfg, m.weights, m.embed)
    logits, toks = eng.prefill(prompt), []
    for _ in range(n):
        toks.append(int(np.argmax(logits)))
        logits = eng.step(toks[-1])
    return toks


@pytest.mark.gpu
@pytest.mark.skipif(_why is not None, reason=f"needs CuPy and a CUDA GPU: {_why}")
@pytest.mark.parametrize("n", [2, 4, 8])
def test_multirank_ids_equal_one_rank(tiny_l8, n):
    sys.path.insert(0, os.path.dirname(__file__))
    from mpi_helpers import have_mpiexec, run_mpi
    if not have_mpiexec():
        pytest.skip("no mpiexec")
    want = _one_rank(tiny_l8)
    assert want[0] == _numpy_greedy(tiny_l8, PROMPT, GEN), "one rank differs from the numpy engine"
    res = run_mpi(n, code=RANK_RUN, args=(tiny_l8, GEN, json.dumps(PROMPT)), timeout=420)
    print(res.stdout[-3000:])
    assert res.returncode == 0, (res.stdout + res.stderr)[-6000:]
    got = {int(line.split()[1]): json.loads(line.split(None, 2)[2])
           for line in res.stdout.splitlines() if line.startswith("IDS ")}
    assert sorted(got) == list(range(n)), res.stdout[-3000:]
    for r, ids in got.items():
        for k, (a, b) in enumerate(zip(ids, want)):
            if a != b:
                i = next(j for j, (x, y) in enumerate(zip(a, b)) if x != y)
                pytest.fail(f"N={n} rank {r} request {k}: first difference at token {i}: {a[i]} vs {b[i]}")


@pytest.mark.gpu
@pytest.mark.skipif(_why is not None, reason=f"needs CuPy and a CUDA GPU: {_why}")
def test_killed_rank_makes_the_others_exit(tiny_l8, tmp_path):
    sys.path.insert(0, os.path.dirname(__file__))
    from mpi_helpers import run_plain
    res = run_plain(4, RANK_KILLED, args=(tiny_l8,), timeout=300, folder=str(tmp_path))   # N divides L = 8
    print(res.output[-4000:])
    lost = [line.split() for line in res.stdout.splitlines() if line.startswith("LOST")]
    assert sorted(int(w[1]) for w in lost) == [0, 1, 2], res.output[-6000:]
    assert all(int(w[2]) == 3 and float(w[3]) < 90 for w in lost), res.output[-6000:]
    assert res.returncodes[:3] == [1, 1, 1] and res.returncodes[3] not in (0, 1, 2, 3), res.returncodes
    assert "NOERROR" not in res.stdout


def test_params_layout_matches_the_backend():
    """monokernel.cu's Params words (each field 8 bytes, arrays of them) against the indices backend.py
    writes: 58 kccl pointer, 59..61 first epochs (attn, mlp, final), 62 yfin; N_PARAMS holds them."""
    import re
    from workers.cuda.backend import N_PARAMS
    src = open(os.path.join(REPO, "workers", "cuda", "monokernel.cu")).read()
    body = src[src.index("struct Params {"):src.index("};", src.index("struct Params {"))]
    words, names, multi = 0, {}, False
    for line in body.splitlines()[1:]:
        t = line.strip()
        if t.startswith("#if KOG_NRANKS > 1"):
            multi = True
            continue
        if t.startswith("#"):
            continue
        m = re.match(r"[\w\s\*]+?[\s\*](\w+)(\[(\d+)\])?;\s*//\s*(\d+)", t)
        if not m:
            continue
        name, count, comment = m.group(1), int(m.group(3) or 1), int(m.group(4))
        assert comment == words, (name, comment, words)      # the comment says the word index
        names[name] = (words, multi)
        words += count
    assert names["rope"] == (57, False) and names["kd"] == (58, True)
    assert names["e0"] == (59, True) and names["yfin"] == (62, True) and words == 63 <= N_PARAMS
    bsrc = open(os.path.join(REPO, "workers", "cuda", "backend.py")).read()
    assert "h[58] = self.comm.dev_ptr" in bsrc and "[59 + j] = self.comm.next_epoch(tag)" in bsrc
    assert 'h[62] = self.buf["yfin"].data.ptr' in bsrc
    assert mr.TAGS == ("attn", "mlp", "final")
