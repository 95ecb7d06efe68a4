"""The multi-rank `cuda` backend (workers/cuda/multirank.py, monokernel.cu `#if KOG_NRANKS > 1`).

CPU (always run): the lane ranges and the rank's sub-model, the build's defines (one rank: exactly the
measured build's), the epoch schedule against the calls the numpy engine makes to its exchange, the
LL ring depth against a model of the kernel's per-lane posts and reads under random interleavings (no
overwrite of a word still to be read; a ring shorter than 2 * delta does overwrite one), slot sizes, the prefill gather pieces, and nvcc compiles of
the multi-rank kernel for N = 2, 4, 8 (when nvcc is installed).

GPU (marker gpu; skipped without CuPy, a GPU or mpiexec, and where ranks would share a GPU without MPS;
tests/gpu_multirank.sh runs them on the H200 under MPS): N = 2, 4, 8 ranks give the one-rank greedy ids (and the numpy engine's) for 128 tokens of an
fp32 tiny checkpoint with 8 lanes, a second request continues the slot and the kccl epochs, seeded
sampling gives the one-rank ids (KOG_TEST_DEFINES="CFG_X=1"
builds every rank's kernel with a tuning variant's defines, as in test_cuda_backend.py); a rank SIGKILLed mid-decode,
or between two requests, makes the others raise PeerLost (or KcclTimeout naming it) within the kccl
timeout (5 s here, env KOG_KILL_TIMEOUT) plus a few seconds, and exit non-zero instead of spinning.

Also CPU: `kog-worker --backend auto|cuda|cpu` picks the same backend on every rank (factory.choose).
"""
from __future__ import annotations

import json
import os
import random
import shutil
import signal
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
    "L4_all_early": dict(num_hidden_layers=5, broadcast_delay=5, early_layers_to_future=False),
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
    # every layer early (tensor parallelism, kog_dist/tp_lanes.py): a ring of 6 whatever the delay
    mr.check(_cfg(num_lanes=4, num_hidden_layers=2, broadcast_delay=2), 2)
    assert mr.depth(_cfg(num_lanes=4, num_hidden_layers=30, broadcast_delay=30, early_layers_to_future=False)) == 6
    with pytest.raises(ValueError, match="16 at most"):
        mr.check(_cfg(num_lanes=4, num_hidden_layers=40, broadcast_delay=8), 2)
    mr.check(_cfg(num_lanes=4, num_hidden_layers=40, broadcast_delay=7), 2)


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


# ---- the kernel's LL exchange: no acks, so the ring depth must follow from the data dependencies -----
def _lane_program(cfg, tokens):
    """One lane's exchange steps in kernel order, per layer: WO (reads the attention partials of layer
    i - delta, posts layer i), W13 (the early all-reduce of layer i reads every lane's current attention
    partials), W2 (the same for the MLP), the next QKV (the early MLP all-reduce); per token the final
    exchange, which every lane of every rank passes together."""
    d, NL, npost = cfg.broadcast_delay, cfg.num_hidden_layers, mr.npost(cfg)
    ep = lambda n, i: 1 + n * npost + mr.index(cfg, i)
    prog = []
    for n in range(tokens):
        for i in range(NL):
            for kind in (0, 1):
                if i >= d and mr.read_later(cfg, i - d):
                    prog.append(("read", kind, ep(n, i - d)))
                if mr.posted(cfg, i):
                    prog.append(("post", kind, ep(n, i)))
                if mr.read_now(cfg, i):
                    prog.append(("read", kind, ep(n, i)))
        prog.append(("final", None, n))
    return prog


def _simulate_ll(cfg, nranks, depth, tokens=3, seed=0):
    """Random interleaving of every (rank, lane)'s program with LL slots of `depth` epochs. A read waits
    until every lane of every rank posted the epoch (other ranks' words carry its tag); a post overwrites
    the ring slot e % depth in every other rank's window. Returns "ok", "deadlock", or "hazard" (a post
    overwrote a word some lane has still to read, or a reader found a newer tag: the kernel would hang)."""
    rnd = random.Random(seed)
    lr = cfg.num_lanes // nranks
    units = [(r, l) for r in range(nranks) for l in range(lr)]
    prog = _lane_program(cfg, tokens)
    pc = {u: 0 for u in units}
    posted = {u: set() for u in units}
    slot = {}                                   # (kind, dst, src, lane, ring) -> epoch
    finals = [k for k, op in enumerate(prog) if op[0] == "final"]

    def pending(r, kind, e):                    # a lane of rank r has still to read (kind, e)
        return any(("read", kind, e) in prog[pc[(r, l)]:] for l in range(lr))

    while True:
        ready = []
        for u in units:
            if pc[u] == len(prog):
                continue
            op, kind, e = prog[pc[u]]
            if op == "read":
                for v in units:
                    if v[0] == u[0]:
                        if e not in posted[v]:
                            break
                    else:
                        have = slot.get((kind, u[0], v[0], v[1], e % depth), 0)
                        if have > e:
                            return "hazard"
                        if have != e:
                            break
                else:
                    ready.append(u)
            elif op == "final":
                if all(pc[v] >= pc[u] for v in units):
                    ready.append(u)
            else:
                ready.append(u)
        if not ready:
            return "ok" if all(pc[u] == len(prog) for u in units) else "deadlock"
        u = rnd.choice(ready)
        op, kind, e = prog[pc[u]]
        if op == "post":
            posted[u].add(e)
            for q in range(nranks):
                if q == u[0]:
                    continue
                key = (kind, q, u[0], u[1], e % depth)
                old = slot.get(key, 0)
                if old and pending(q, kind, old):
                    return "hazard"
                slot[key] = e
        pc[u] += 1
    assert finals


@pytest.mark.parametrize("name", list(VARIANTS))
@pytest.mark.parametrize("nranks", [2, 4])
def test_ll_depth_is_enough_and_a_short_ring_breaks(name, nranks):
    cfg = _cfg(**VARIANTS[name])
    dep = mr.depth(cfg)
    assert dep == (6 if mr.all_early(cfg) else 2 * cfg.broadcast_delay + 2)
    for seed in range(20):
        assert _simulate_ll(cfg, nranks, dep, seed=seed) == "ok", f"seed {seed}, depth {dep}"
    # the model needs 2 * delta (a lane posting layer j has read layer j - delta from every lane, so
    # every lane has read layer j - 2 * delta); the kernel's blocks own rows, not lanes, which costs one
    # more layer (multirank.depth), and one of margin
    short = 2 * cfg.broadcast_delay - 1
    if any(op == "read" and e > 1 for op, _, e in _lane_program(cfg, 1)) and mr.npost(cfg) > short >= 1:
        got = {_simulate_ll(cfg, nranks, short, seed=seed) for seed in range(20)}
        assert "hazard" in got, f"a ring of {short} should break: {got}"


# ---- slot sizes and the prefill gathers -------------------------------------------------------------
@pytest.mark.parametrize("n", [2, 4, 8])
def test_slot_sizes_2b(n):
    from kog_dist.shapes import shape_config
    cfg = shape_config("2b")
    kw = mr.comm_kwargs(cfg, n)
    assert kw["tags"] == ("attn", "mlp", "final") and kw["depth"] >= cfg.broadcast_delay + 1
    lr = cfg.num_lanes // n
    assert 4 * kw["max_floats"] >= 4 * (lr * cfg.hidden_size + 4)      # layer partials and the final rows
    assert mr.final_floats(cfg, n) == lr * cfg.hidden_size + 4
    win = mr.window_bytes(cfg, n)
    assert 4 * kw["max_floats"] >= 8 * (lr * cfg.hidden_size + 1)      # final rows + cancel as LL words
    # ... then the best logit, its index, the rank's share of the logits and its sampling candidates
    # (mk_multirank.cuh FIN_WORDS: 5 words and 4096 / N keys of 2)
    assert mr.fin_words(cfg, n) == lr * cfg.hidden_size + 3 + 2 * mr.lm_units(cfg, n) + 5 + 2 * (4096 // n)
    assert 4 * kw["max_floats"] >= 8 * mr.fin_words(cfg, n)
    assert win <= (n * 40 + 1) << 20, win   # per rank: 2 MiB slots x (2 + 3 tags x 6 depth) x N sources


@pytest.mark.parametrize("vocab", [512, 32000, 32001, 7])
@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_lm_rows_split_the_vocabulary(vocab, n):
    """Every vocabulary row is computed by exactly one rank, in rank order (mk_lm.cuh phase_lm), and a
    rank's streamed bytes count its share of the LM head only."""
    from workers.cuda.weights import streamed_bytes
    cfg = _cfg(num_lanes=8, vocab_size=vocab)
    rows = [mr.lm_rows(cfg, r, n) for r in range(n)]
    assert [v for r in rows for v in r] == list(range(vocab))
    assert all(len(r) <= 2 * mr.lm_units(cfg, n) for r in rows)
    if 8 % n == 0:   # ranks that divide the lanes: their weight bytes add up to the model's, none twice
        views = [mr.RankView(cfg, r, n) for r in range(n)]
        assert [v.lm_rows for v in views] == [len(r) for r in rows]
        assert sum(streamed_bytes(v, "BF16") for v in views) == streamed_bytes(cfg, "BF16")


def _numpy_for_cupy(monkeypatch):
    """CuPy stood in for by numpy (the arrays the weights code makes, on the host)."""
    monkeypatch.setitem(sys.modules, "cupy", np)
    monkeypatch.setattr(np, "cuda", type("C", (), {"Device": lambda *a: type("D", (), {"synchronize": lambda s: None})()}),
                        raising=False)


@pytest.mark.parametrize("fmt", ["hf", "gguf_q6k_head"])
@pytest.mark.parametrize("n", [2, 4])
def test_rank_weights_hold_only_their_lm_rows(tmp_path, monkeypatch, fmt, n):
    """An untied LM head split over n ranks: each rank's upload (load_checkpoint of its view) holds exactly the
    file's rows lm_rows(rank) (an odd vocabulary: the last rank one row short), lm_row0 is their first id, so
    lm_ptr() addresses vocabulary id v at row v - lm_row0; one rank holds the whole head at row 0. GGUF: a
    Q6_K head, only the rank's rows dequantized."""
    from hf_reference import random_hf_tensors, read_gguf_as_hf, tiny_hf_config, write_gguf, write_hf_dir
    from kog_dist.formats import open_model
    from kog_dist.tp_lanes import LaneSource
    import gguf
    _numpy_for_cupy(monkeypatch)
    from workers.cuda.weights import load_checkpoint
    c = tiny_hf_config(hidden_size=256, intermediate_size=512, vocab_size=97, num_hidden_layers=1)
    t = random_hf_tensors(c, 3)
    if fmt == "hf":
        path, head = write_hf_dir(str(tmp_path / "m"), c, t), t["lm_head.weight"]
    else:
        path = str(tmp_path / "m.gguf")
        write_gguf(path, c, t, qtype=lambda hf: gguf.GGMLQuantizationType.Q6_K if hf == "lm_head.weight" else None)
        head = read_gguf_as_hf(path, c)["lm_head.weight"]
    one = load_checkpoint(open_model(path, progress=False), None, "F32", False)
    assert one.lm_row0 == 0 and one.lm.shape == (97, 256)
    np.testing.assert_array_equal(one.lm, head.astype(np.float32))
    got = []
    for r in range(n):
        lv = LaneSource(open_model(path, progress=False), n)
        dw = load_checkpoint(lv, lv.cfg, "F32", False, view=mr.RankView(lv.cfg, r, n))
        rows = mr.lm_rows(lv.cfg, r, n)
        assert dw.lm_row0 == rows.start and dw.lm.shape == (len(rows), 256)
        np.testing.assert_array_equal(dw.lm, head[rows.start:rows.stop].astype(np.float32), err_msg=f"rank {r}")
        got.append(dw.lm)
        lv.close()
    np.testing.assert_array_equal(np.concatenate(got), one.lm)


def test_random_rank_lm_rows_are_the_whole_heads(monkeypatch):
    """random_weights of a rank's view: its LM rows are the one-rank model's rows there (one stream of
    draws over the whole head, chunked), so N ranks decode the one-rank model's head."""
    _numpy_for_cupy(monkeypatch)
    from workers.cuda import weights
    monkeypatch.setattr(weights, "_RANDOM_STEP", 1000)   # chunks that cut rows and ranks
    cfg = LaneformerConfig(**{**TINY_DEFAULTS, "num_lanes": 2, "vocab_size": 301, "tie_word_embeddings": False})
    stub = type("K", (), {"fn": {"f32_to_w": None}})()
    whole = weights.random_weights(cfg, "F32", stub, seed=5).lm
    parts = [weights.random_weights(mr.RankView(cfg, r, 2), "F32", stub, seed=5) for r in range(2)]
    assert [p.lm_row0 for p in parts] == [0, 152]
    np.testing.assert_array_equal(np.concatenate([p.lm for p in parts]), whole)


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
    assert "pf_combine_mr" in ptx
    assert "st.relaxed.sys.global.u64" in ptx and "ld.relaxed.sys.global.u64" in ptx      # LL words
    assert "st.release.sys" not in ptx      # no flag protocol left on the decode path (final rows: LL too)


# ---- backend choice of kog-worker (factory.choose: every rank passes the same `everywhere`) ----------
def test_backend_choice():
    from workers.factory import choose
    cfg = _cfg(num_lanes=8)
    # a CPU machine (no rank sees a GPU): auto is cpu, with one rank or several; cuda is refused
    assert choose("auto", 1, False, False, cfg) == ("cpu", None)
    assert choose("auto", 4, False, False, cfg) == ("cpu", None)
    assert choose("cpu", 4, True, True, cfg) == ("cpu", None)
    with pytest.raises(ValueError, match="this machine has none"):
        choose("cuda", 1, False, False, cfg)
    with pytest.raises(ValueError, match="on every rank, and another rank sees none"):
        choose("cuda", 2, True, False, cfg)
    # every rank sees a GPU: auto is cuda, for one rank and for several (the multi-rank kernel)
    assert choose("auto", 1, True, True, cfg) == ("cuda", None)
    kind, note = choose("auto", 4, True, True, cfg)
    assert kind == "cuda" and "cuda backend on 4 ranks" in note
    assert choose("cuda", 8, True, True, cfg)[0] == "cuda"
    # some ranks without a GPU: auto falls back to cpu on all of them, and says so
    kind, note = choose("auto", 2, True, False, cfg)
    assert kind == "cpu" and "not every one of the 2 ranks" in note
    # a model the multi-rank kernel refuses: auto is cpu (with the reason), cuda is an error
    deep = _cfg(num_lanes=4, num_hidden_layers=40, broadcast_delay=8)
    kind, note = choose("auto", 2, True, True, deep)
    assert kind == "cpu" and "16 at most" in note
    with pytest.raises(ValueError, match="16 at most"):
        choose("cuda", 2, True, True, deep)
    with pytest.raises(ValueError, match="unknown backend"):
        choose("gpu", 1, True, True, cfg)


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
from kog_dist.backend import RunCommand
from workers.cuda.backend import CudaBackend
from workers.cuda.multirank import comm_kwargs
world = MPI.COMM_WORLD
cp.cuda.Device(world.rank % cp.cuda.runtime.getDeviceCount()).use()
model, gen, prompt = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
cfg = load_config(model)
comm = Communicator.create(world, transport="cuda_ipc", **comm_kwargs(cfg, world.size, timeout=30.0))
defines = dict(d.split("=", 1) for d in os.environ.get("KOG_TEST_DEFINES", "").split())   # a tuning variant
dtype = os.environ.get("KOG_TEST_DTYPE") or None                                         # a storage type
b = CudaBackend(model, max_seq=512, num_slots=2, progress=False, comm=comm, extra_defines=defines, dtype=dtype)
r1 = b.run(RunCommand(append=prompt, max_new_tokens=gen), ignore_eos=True)
r2 = b.run(RunCommand(slot=0, keep=r1.cached, append=[5, 6, 7], max_new_tokens=16), ignore_eos=True)
r3 = b.run(RunCommand(slot=1, append=prompt[:5], max_new_tokens=32,
                      sampling=SamplingParams(temperature=0.8, top_p=0.9, seed=7)), ignore_eos=True)
with open(os.path.join(sys.argv[4], f"ids_{world.rank}.json"), "w") as f:   # not stdout: mpirun interleaves long lines
    json.dump([r1.token_ids, r2.token_ids, r3.token_ids], f)
print("MS", world.rank, round(b.last_kernel_ms, 2), flush=True)
b.close()
comm.shutdown()
print("OK", world.rank, flush=True)
'''

RANK_KILLED = r'''
import os, signal, sys, time
import cupy as cp
from kccl import Communicator, FileRendezvous, KcclTimeout, PeerLost
from kog_dist.config import load_config
from kog_dist.backend import RunCommand
from workers.cuda.backend import CudaBackend
from workers.cuda.multirank import comm_kwargs
rank, size = int(os.environ["KCCL_RANK"]), int(os.environ["KCCL_SIZE"])
folder = os.environ["KCCL_RENDEZVOUS"]
model, when, timeout = sys.argv[1], sys.argv[2], float(sys.argv[3])
victim = rank == size - 1
rdv = FileRendezvous(folder, rank, size, timeout=90.0)
cp.cuda.Device(0).use()
cfg = load_config(model)
comm = Communicator.create(rdv, transport="cuda_ipc", **comm_kwargs(cfg, size, timeout=timeout))
b = CudaBackend(model, max_seq=cfg.max_position_embeddings, num_slots=1, progress=False, comm=comm)
KILLED_AT = os.path.join(folder, "killed_at")

def die():
    with open(KILLED_AT + ".tmp", "w") as f:
        f.write(repr(time.time()))
    os.replace(KILLED_AT + ".tmp", KILLED_AT)
    os.kill(os.getpid(), signal.SIGKILL)

def since_kill():
    try:
        with open(KILLED_AT) as f:
            return f"{time.time() - float(f.read()):.2f}"
    except (OSError, ValueError):
        return "nan"

seen = [0]
def on_token(t):
    seen[0] += 1
    if victim and seen[0] == 50:
        die()

gen = b.max_seq - 8          # far more tokens than run before the kill lands (max_position 16384)
try:
    if when == "between":
        # one request together, then the victim dies; the others start the next one without a prefill
        # (one appended token), so their monokernels wait inside the kernel for the victim's partials
        r1 = b.run(RunCommand(append=[1, 2, 3], max_new_tokens=8), ignore_eos=True)
        if victim:
            die()
        b.run(RunCommand(slot=0, keep=r1.cached, append=[r1.token_ids[-1]], max_new_tokens=gen), ignore_eos=True)
    else:
        b.run(RunCommand(append=[1, 2, 3], max_new_tokens=gen), on_token=on_token, ignore_eos=True)
    print("NOERROR", rank, seen[0], flush=True)
    code = 3
except PeerLost as e:
    print("LOST", rank, e.rank, since_kill(), seen[0], str(e), flush=True)
    code, failure = 1, e
except KcclTimeout as e:
    print("TIMEOUT", rank, -1, since_kill(), seen[0], str(e), flush=True)
    code, failure = 1, e
except Exception as e:  # noqa: BLE001 - a CUDA error (e.g. a fault writing into the dead rank's window)
    print("ERROR", rank, -1, since_kill(), seen[0], repr(e)[:800], flush=True)
    code, failure = 2, e
# `failure` holds the error (and the failed run's frames) to the os._exit below, as kog-worker exits
# inside its except: releasing them would destroy CuPy objects, each printing a traceback in a
# faulted context
comm.close()                 # as kog-worker does after an error: not collective (a peer is gone)
print("CLOSED", rank, since_kill(), flush=True)
sys.stdout.flush()
os._exit(code)               # as kog-worker: no interpreter teardown after a failure
'''


@pytest.fixture(scope="module")
def tiny_l8(tmp_path_factory):
    from kog_dist.tiny import write_tiny_checkpoint
    d = str(tmp_path_factory.mktemp("tiny_l8"))
    write_tiny_checkpoint(d, dtype="F32", seed=11, num_lanes=8)
    return d


@pytest.fixture(scope="module")
def tiny_l4(tmp_path_factory):
    """Four lanes whose per-lane widths are multiples of 32 (the quantized storage types' blocks)."""
    from kog_dist.tiny import write_tiny_checkpoint
    d = str(tmp_path_factory.mktemp("tiny_l4"))
    write_tiny_checkpoint(d, dtype="F32", seed=12, num_lanes=4)
    return d


def _one_rank(model, dtype=None):
    from kog_dist.sampling import SamplingParams
    from kog_dist.backend import RunCommand
    from workers.cuda.backend import CudaBackend
    b = CudaBackend(model, max_seq=512, num_slots=2, progress=False, dtype=dtype)
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


@pytest.fixture(scope="module")
def one_rank_ids(tiny_l8):
    """The one-rank kernel's ids (computed once for N = 2, 4, 8), checked against the numpy engine."""
    want = _one_rank(tiny_l8)
    assert want[0] == _numpy_greedy(tiny_l8, PROMPT, GEN), "one rank differs from the numpy engine"
    return want


@pytest.mark.gpu
@pytest.mark.skipif(_why is not None, reason=f"needs CuPy and a CUDA GPU: {_why}")
@pytest.mark.parametrize("n", [2, 4, 8])
def test_multirank_ids_equal_one_rank(tiny_l8, one_rank_ids, n, tmp_path):
    sys.path.insert(0, os.path.dirname(__file__))
    from mpi_helpers import have_mpiexec, run_mpi, shared_gpu_reason
    if not have_mpiexec():
        pytest.skip("no mpiexec")
    why = shared_gpu_reason(n)
    if why:
        pytest.skip(why)
    want = one_rank_ids
    res = run_mpi(n, code=RANK_RUN, args=(tiny_l8, GEN, json.dumps(PROMPT), str(tmp_path)), timeout=75)
    print(res.stdout[-3000:])
    assert res.returncode == 0, (res.stdout + res.stderr)[-6000:]
    got = {r: json.loads((tmp_path / f"ids_{r}.json").read_text())
           for r in range(n) if (tmp_path / f"ids_{r}.json").exists()}
    assert sorted(got) == list(range(n)), f"no ids from ranks {sorted(set(range(n)) - set(got))}; " \
        f"stderr: {res.stderr[-1500:]}"
    for r, ids in got.items():
        for k, (a, b) in enumerate(zip(ids, want)):
            if a != b:
                i = next(j for j, (x, y) in enumerate(zip(a, b)) if x != y)
                pytest.fail(f"N={n} rank {r} request {k}: first difference at token {i}: {a[i]} vs {b[i]}")


@pytest.mark.gpu
@pytest.mark.skipif(_why is not None, reason=f"needs CuPy and a CUDA GPU: {_why}")
@pytest.mark.parametrize("dtype", ["Q8_0:F32", "Q4_0:F32", "Q4_1:F32"])
def test_multirank_quantized_ids_equal_one_rank(tiny_l4, dtype, tmp_path):
    """Multi-rank builds take the quantized storage types (issue 31): two ranks of a four-lane model with
    its layer matrices quantized at load give the one-rank kernel's ids (greedy, a continued session, a
    sampled request); the one-rank ids against the numpy engine are test_cuda_llama.py's."""
    sys.path.insert(0, os.path.dirname(__file__))
    from mpi_helpers import have_mpiexec, run_mpi, shared_gpu_reason
    if not have_mpiexec():
        pytest.skip("no mpiexec")
    why = shared_gpu_reason(2)
    if why:
        pytest.skip(why)
    want = _one_rank(tiny_l4, dtype)
    res = run_mpi(2, code=RANK_RUN, args=(tiny_l4, GEN, json.dumps(PROMPT), str(tmp_path)), timeout=75,
                  env={"KOG_TEST_DTYPE": dtype})
    assert res.returncode == 0, (res.stdout + res.stderr)[-6000:]
    for r in range(2):
        got = json.loads((tmp_path / f"ids_{r}.json").read_text())
        for k, (a, b) in enumerate(zip(got, want)):
            assert a == b, f"{dtype} rank {r} request {k}: first difference at token " \
                f"{next(j for j, (x, y) in enumerate(zip(a, b)) if x != y)}"


@pytest.mark.gpu
@pytest.mark.skipif(_why is not None, reason=f"needs CuPy and a CUDA GPU: {_why}")
def test_generate_np2_gives_the_one_rank_ids(tiny_l8, one_rank_ids):
    """The user's path on two GPUs: `kog generate --np 2 --backend cuda` (launcher, kog-worker's bootstrap,
    the kccl windows, the control plane). Twice: the window setup once raced (a peer read a header whose
    copy had not landed) and failed only here, while the backend-level ids test passed."""
    sys.path.insert(0, os.path.dirname(__file__))
    from mpi_helpers import have_mpiexec, mpi_env
    import cupy as cp
    if not have_mpiexec():
        pytest.skip("no mpiexec")
    if cp.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs 2 GPUs (two cooperative kernels on one GPU need MPS)")
    n = 64
    want = one_rank_ids[0][:n]
    for attempt in range(2):
        r = subprocess.run([sys.executable, "-m", "kog_cli", "generate", "--np", "2", "--backend", "cuda",
                            "--model", tiny_l8, "--prompt-ids", ",".join(map(str, PROMPT)), "-n", str(n),
                            "--json"], capture_output=True, text=True, timeout=120, env=mpi_env())
        assert r.returncode == 0, f"attempt {attempt}: {r.stderr[-3000:]}"
        out = json.loads(r.stdout)
        assert out["ranks"] == 2 and out["backend"] == "cuda"
        ids = out["token_ids"]
        assert ids == want[:len(ids)], f"attempt {attempt}: {ids} vs {want}"
        assert len(ids) == n or out["stats"]["stop_reason"] == "eos"


KILL_TIMEOUT = float(os.environ.get("KOG_KILL_TIMEOUT", "5"))   # the ranks' kccl timeout in this test (s)


@pytest.mark.gpu
@pytest.mark.gpu_fault
@pytest.mark.skipif(_why is not None, reason=f"needs CuPy and a CUDA GPU: {_why}")
@pytest.mark.parametrize("when", ["mid", "between"])
def test_killed_rank_makes_the_others_exit(tmp_path, when):
    """4 plain processes (N divides L = 8; no launcher that would kill the survivors), kccl timeout
    KILL_TIMEOUT. Rank 3 SIGKILLs itself at its 50th token of a 16000-token decode ("mid"), or after a
    first request, while the others start a second one that begins inside the kernel ("between"). Every
    survivor must raise PeerLost naming rank 3 (its host saw the pid gone and raised the abort word) or
    KcclTimeout naming rank 3 (the in-kernel bound), within KILL_TIMEOUT + 5 s of the kill, then close
    the communicator and exit 1; nothing may hang (run_plain kills everything at 100 s). Under MPS the
    dead rank's memory goes away and the survivors' kernels fault (cudaErrorIllegalAddress, which their
    event queries did not report for 20 s on the H200): kccl's check_kernel finds the faulted context
    and reports PeerLost of the dead rank. A kernel that is still running 2 s after the abort word
    (reported so by check_kernel) fails the test. After such a fault the MPS server refuses new clients
    until every client of the faulted GPU has exited and it has recovered: marked gpu_fault, the test
    runs before any other of the session (tests/conftest.py: before the pytest process holds a CUDA
    context of its own, which would keep the server waiting), and waits before its ranks start and
    again after them until a fresh process can use every GPU (mpi_helpers.wait_gpus_ready)."""
    sys.path.insert(0, os.path.dirname(__file__))
    from kog_dist.tiny import write_tiny_checkpoint
    from mpi_helpers import run_plain, shared_gpu_reason, wait_gpus_ready
    why = shared_gpu_reason(4)
    if why:
        pytest.skip(why)
    not_ready = wait_gpus_ready()
    assert not_ready is None, f"before the ranks start: {not_ready}"
    model, rdv = tmp_path / "model", tmp_path / "rdv"
    rdv.mkdir()
    # the tiny_l8 shape (the same kernel build: max_position_embeddings is not a compile constant)
    write_tiny_checkpoint(str(model), dtype="F32", seed=11, num_lanes=8, max_position_embeddings=16384)
    try:
        res = run_plain(4, RANK_KILLED, args=(str(model), when, KILL_TIMEOUT), timeout=100, folder=str(rdv))
    finally:
        not_ready = wait_gpus_ready()
    print(res.output[-4000:])
    _check_killed(res, KILL_TIMEOUT)
    assert not_ready is None, f"after the ranks ended: {not_ready}"


def _check_killed(res, timeout):
    """The killed-rank test's verdict on the ranks' output (also checked on the CPU, below)."""
    out = res.output[-6000:]
    assert "NOERROR" not in res.stdout, f"the survivors decoded to the end: the kill did not stop them\n{out}"
    assert res.returncodes[3] == -signal.SIGKILL, (res.returncodes, out)
    got = {}
    for line in res.stdout.splitlines():
        w = line.split(None, 5)
        if len(w) == 6 and w[0] in ("LOST", "TIMEOUT", "ERROR"):
            got[int(w[1])] = w
    assert sorted(got) == [0, 1, 2], f"survivors that reported: {sorted(got)}\n{out}"
    # a survivor may notice another survivor that already left (after its own PeerLost) before it
    # notices rank 3: the peer it names must be rank 3 or such a survivor, and someone must name rank 3
    named3 = False
    for r, w in got.items():
        what, peer, after, msg = w[0], int(w[2]), float(w[3]), w[5]
        assert what != "ERROR", f"rank {r} failed with another error than PeerLost/KcclTimeout: {msg}\n{out}"
        # the host gave up on a kernel that neither left on the abort word / its failed wait nor
        # faulted (kccl check_kernel): a kernel that ignores them, a real hang
        assert "still running" not in msg, f"rank {r}'s kernel did not leave: {msg}\n{out}"
        if what == "LOST":
            assert peer == 3 or (peer in got and peer != r and float(got[peer][3]) <= after), (r, w)
            named3 = named3 or peer == 3
        else:
            assert "rank" in msg, (r, w)
            named3 = named3 or "rank 3" in msg
        assert after < timeout + 5, f"rank {r} reported {after} s after the kill\n{out}"
    assert named3, f"no survivor named rank 3\n{out}"
    closed = {int(w[1]): float(w[2]) for w in (line.split() for line in res.stdout.splitlines())
              if len(w) == 3 and w[0] == "CLOSED"}
    assert sorted(closed) == [0, 1, 2] and max(closed.values()) < timeout + 10, (closed, out)
    assert res.returncodes[:3] == [1, 1, 1], (res.returncodes, out)


def test_killed_rank_verdict():
    """_check_killed on made-up outputs: what passes, and that a hang-free but wrong outcome fails."""
    sys.path.insert(0, os.path.dirname(__file__))
    from mpi_helpers import PlainResult
    lost = "".join(f"LOST {r} 3 0.2{r} 50 rank 3 (pid 99) exited (noticed by rank {r} in decode)\nCLOSED {r} 0.3\n"
                   for r in range(3))
    _check_killed(PlainResult([1, 1, 1, -9], lost, "", 9.0), 5.0)
    mixed = lost.replace("LOST 1 3 0.21 50 rank 3 (pid 99) exited (noticed by rank 1 in decode)",
                         "TIMEOUT 1 -1 5.02 50 rank 1 timed out after 5 s waiting for rank 3's data on channel 'attn'")
    _check_killed(PlainResult([1, 1, 1, -9], mixed, "", 9.0), 5.0)
    chain = lost.replace("LOST 0 3 0.20", "LOST 0 1 0.30")     # rank 0 saw rank 1 leave first (H200 run)
    _check_killed(PlainResult([1, 1, 1, -9], chain, "", 9.0), 5.0)
    faulted = lost.replace("in decode)", "in decode; then this rank's CUDA context failed: cudaErrorIllegalAddress: "
                                         "an illegal memory access was encountered)")    # MPS: the H200 run
    _check_killed(PlainResult([1, 1, 1, -9], faulted, "", 9.0), 5.0)
    bad = [PlainResult([1, 1, 3, -9], lost.replace("LOST 2", "NOERROR 2"), "", 9.0),          # finished
           PlainResult([1, 1, 2, -9], lost.replace("LOST 2 3", "ERROR 2 -1"), "", 9.0),        # CUDA error
           PlainResult([1, 1, 1, -9], lost.replace("0.22", "11.0"), "", 20.0),                # too late
           PlainResult([1, 1, 1, -9], lost.replace("CLOSED 2 0.3\n", ""), "", 20.0),          # close hung
           PlainResult([1, 1, 1, -9], lost.replace("LOST 0 3", "LOST 0 1").replace("0.21", "0.50"), "", 9.0),  # a peer that left later
           PlainResult([1, 1, 1, -9], lost.replace("LOST 0 3", "LOST 0 1").replace("LOST 1 3", "LOST 1 0")
                       .replace("LOST 2 3", "LOST 2 0"), "", 9.0),                                   # nobody names rank 3
           PlainResult([1, 1, 1, 0], lost, "", 9.0),                                         # victim lived
           PlainResult([1, 1, 1, -9], lost.replace("in decode)", "in decode; its kernel is still running 2 s "
                                                   "after the abort word)", 1), "", 9.0)]     # kernel stuck
    for res in bad:
        with pytest.raises(AssertionError):
            _check_killed(res, 5.0)


def test_params_layout_matches_the_backend():
    """The kernel's Params words (each field 8 bytes, arrays of them) against the indices backend.py
    writes: 58 quantized scales, 59 biases, 60..65 the speculative passes' (spec, ctx, spec_logits, spec_k,
    spec_min_ngram, spec_fixed), 66 / 67 the K-quants' high bits and types, 68 kccl pointer, 69..71 first epochs
    (attn, mlp, final), 72 yfin; N_PARAMS holds them.
    Read from the inlined source (build.source): Params is in one of monokernel.cu's headers."""
    import re
    from workers.cuda.backend import N_PARAMS
    from workers.cuda.build import source
    src = source()
    body = src[src.index("struct Params {"):src.index("};", src.index("struct Params {"))]
    words, names, multi, mask = 0, {}, False, {}
    for line in body.splitlines()[1:]:
        t = line.strip()
        if t.startswith("#if KOG_NRANKS > 1"):
            multi = True
            continue
        if t.startswith("#if CFG_MASK"):    # the one-rank build of structured outputs: its fields in their place
            multi, end, words = "mask", words, 68
            continue
        if t.startswith("#"):
            continue
        m = re.match(r"[\w\s\*]+?[\s\*](\w+)(\[(\d+)\])?;\s*//\s*(\d+)", t)
        if not m:
            continue
        name, count, comment = m.group(1), int(m.group(3) or 1), int(m.group(4))
        assert comment == words, (name, comment, words)      # the comment says the word index
        (mask if multi == "mask" else names)[name] = (words, multi)
        words += count
    assert list(mask) == ["mask", "mask_ready", "mask_stat", "mask_wait_ns"] and words == 72
    words = end
    assert names["rope"] == (57, False) and names["ws"] == (58, False) and names["bias"] == (59, False)
    assert names["spec"] == (60, False) and names["spec_min_ngram"] == (64, False)
    assert names["wh"] == (66, False) and names["kt"] == (67, False)
    assert names["kd"] == (68, True) and names["e0"] == (69, True) and names["yfin"] == (72, True)
    assert words == 73 <= N_PARAMS
    # the host packs by these names, read from the same struct (workers/cuda/params.py)
    from workers.cuda.params import LAYOUT, ParamWords
    assert {k: v[0] for k, v in LAYOUT.items()} == {k: w for k, (w, _) in names.items()}
    p = ParamWords(N_PARAMS)
    p["temperature"], p["top_k"], p["seed"], p["e0"], p["yfin"] = 0.5, 7, (1 << 64) - 1, [3, 4, 5], 0xdead
    assert p.words.view(np.float64)[25] == 0.5 and p.words.view(np.int64)[27] == 7
    assert p.words[28] == (1 << 64) - 1 and list(p.words.view(np.int64)[69:72]) == [3, 4, 5] and p.words[72] == 0xdead
    with pytest.raises(ValueError):
        p["stop_ids"] = list(range(17))                  # 16 words
    bsrc = open(os.path.join(REPO, "workers", "cuda", "backend.py")).read()
    assert "ParamWords(N_PARAMS, layout)" in bsrc and "h[" not in bsrc    # no word written by index
    assert mr.TAGS == ("attn", "mlp", "final")
