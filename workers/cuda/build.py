"""Compile the monokernel and the prefill kernels for one model shape and storage type.

Every model dimension is a compile-time constant (CFG_* defines), so loops unroll fully and register
arrays stay in registers. The .cuh headers are inlined into one source string, so CuPy's on-disk
compile cache (keyed by source and options) is invalidated by any change of any file. A progress line
is printed while NVRTC and the driver compile (several seconds for the 2B shape).
"""
from __future__ import annotations

import os
import sys
import time

from kccl.cuda_source import inline_sources

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCES = ("monokernel.cu", "prefill.cu")
WT_CODE = {"F32": 0, "BF16": 1, "F16": 2}   # CFG_WT of the storage type (weights.split_dtype's second part)
_cache: dict = {}


def source() -> str:
    return inline_sources([os.path.join(HERE, f) for f in SOURCES])


def defines(cfg, dtype: str, nblocks: int, prefetch: int | None = None, extra: dict | None = None,
            nranks: int = 1, marks: bool = False) -> dict:
    """-D options of one build. nranks > 1: the kernel of one of nranks ranks (multirank.defines: the
    rank's lanes/heads/kv heads/ffn rows, CFG_LG, KOG_NRANKS); nranks == 1 gives the measured build's.
    prefetch None: prefetch_bytes(nranks, lanes). marks: compile the per-phase clock marks in (CFG_MARKS, for
    `kog bench --profile`; 1.4% slower on one H200, so the decode build leaves them out)."""
    sw = cfg.sliding_window or 0
    if prefetch is None:
        from .weights import split_dtype
        prefetch = prefetch_bytes(nranks, cfg.num_lanes, split_dtype(dtype)[0] is not None)
    if nranks > 1:
        from .multirank import defines as mr_defines
        d = defines(cfg, dtype, nblocks, prefetch, None, marks=marks)
        d.update(mr_defines(cfg, nranks), CFG_SKEW_NS=skew_ns(cfg, dtype, nranks), CFG_UB_QKV=qkv_loads(nranks))
        return {**d, **(extra or {})}
    from . import kquant
    from .weights import qw_code, split_dtype
    qtype, base = split_dtype(dtype)
    kmask = {"CFG_KT_MASK": kquant.type_mask(qtype)} if qw_code(qtype) == 4 else {}
    return {
        "CFG_WT": WT_CODE[base], "CFG_QW": qw_code(qtype), **kmask,
        "CFG_BIAS": int(bool(getattr(cfg, "attention_bias", False))), "CFG_D": cfg.hidden_size, "CFG_NL": cfg.num_hidden_layers,
        "CFG_H": cfg.num_attention_heads, "CFG_KV": cfg.kv_heads, "CFG_HD": cfg.head_dim,
        "CFG_F": cfg.intermediate_size, "CFG_V": cfg.vocab_size, "CFG_L": cfg.num_lanes,
        "CFG_DELTA": cfg.broadcast_delay, "CFG_USE_COMM": int(cfg.use_comm),
        "CFG_USE_EARLY": int(cfg.use_early_comm), "CFG_EARLY_FUTURE": int(cfg.early_layers_to_future),
        "CFG_SW": sw, "CFG_SWN": cfg.sliding_window_n_layers if sw else 0,
        "CFG_THETA": repr(float(cfg.rope_theta)), "CFG_EPS": repr(float(cfg.norm_eps)) + "f",
        "CFG_NB": nblocks, "CFG_PF": prefetch, "CFG_SKEW_NS": skew_ns(cfg, dtype),
        "CFG_UB_QKV": qkv_loads(nranks), "CFG_MARKS": int(marks),
        "CFG_PCONST": 1, **one_lane_units(cfg, qtype, base, nblocks), **(extra or {}),
    }


def one_lane_units(cfg, qtype, base: str, nblocks: int, spec: bool = False) -> dict:
    """One-lane models (Llama-family checkpoints, one rank): every phase waits for all blocks of the one
    before, so a phase must keep every warp busy: one-row units in W2 (CFG_NR_W2; 2 for several lanes) and
    one- or two-row units in WO (CFG_NR_WO; 4 for several lanes); and a small model's next weights copied
    into shared memory before each wait (CFG_PFS, where a block's share of a layer is at most 128 KB; not for
    larger layers, which stream: there the copy was slower). Quantized layer matrices: where a block's share
    of a layer is at most 128 KB of quants and scales, 384 threads a block (168 registers a thread instead of
    128, fewer spills: SmolLM2 Q4_1 +3.0%, Qwen2.5-0.5B Q4_0 +4.8%; Llama-3.2-1B Q4_0, whose blocks stream
    253 KB, -2.4%: kept at 512) and the copy too, read by one loop over generic pointers (mk_helpers.cuh
    wdotq_unit; Qwen2.5-0.5B Q4_0 +1.4%, SmolLM2 Q4_1 neutral; with two loops it spilled and lost 10%). The
    A backend that speculates (spec: its plain and speculative builds, which must run the same thread count
    to give the same bits) runs 384 threads there in bf16 too: at 512 the verify phases' registers spilled
    into the plain phases (SmolLM2 shape: a pass of one 1.07x a plain token, 0.98x at 384; passes of 2 / 5 / 9
    1.35 / 2.29 / 2.73x against 1.19 / 2.16 / 2.56x), while a plain build alone is 0.8% faster at 512 on the
    shape's random weights (the real model's plain decode: 2016 at 384 against 2002-2009 tokens/s at 512);
    Llama-3.2-1B, whose blocks stream, is slower at 384 in both and keeps 512.
    Query groups of more than 4 heads a KV head (Qwen2.5: 7, 6 or 8) run 384 threads in every build: the
    attention's per-head accumulators spill at 128 registers (Qwen2.5-0.5B bf16: 1.5 KB of spill loads at
    512, 0.5 KB at 384; 1384 against 1200 tokens/s).
    The runs of each choice: BENCHMARKS.md "Results of 2026-12-02", "Quantized one-lane builds", "2026-12-03",
    "2026-12-04"."""
    from . import kquant
    from .weights import layer_elems, matrix_bytes
    if cfg.num_lanes != 1:
        return {}
    out = {"CFG_NR_WO": 1 if cfg.hidden_size <= 1024 else 2, "CFG_NR_W2": 1}
    if matrix_bytes(layer_elems(cfg), qtype or base) / nblocks <= 128 * 1024:
        # (the K-quants have no shared-memory copy: their rows read three arrays, mk_kquant.cuh)
        out["CFG_PFS"] = 0 if qtype and kquant.parse(qtype) else 65536
        if qtype or spec:
            out["CFG_NT"] = 384
    if cfg.num_attention_heads // cfg.kv_heads > 4:
        out["CFG_NT"] = 384
    return out


def speculating_defines(cfg, dtype: str, nblocks: int | None = None) -> dict:
    """The defines of both builds of a backend made to speculate (one lane, one rank), where they differ from
    the plain build's best: 384 threads a block (one_lane_units' spec) and, for quantized layers, a chunk a
    lane (CFG_QLPC 1: with chunks split over lanes the SmolLM2 Q4_1 speculative build's pass of one cost
    587.7 us against 541.8, while its plain step gained only 527.3 -> 522.0 us)."""
    from .weights import split_dtype
    if nblocks is None:
        import cupy as cp
        nblocks = default_blocks(cfg, cp.cuda.Device().attributes["MultiProcessorCount"])
    qtype, base = split_dtype(dtype)
    out = {"CFG_NT": int(one_lane_units(cfg, qtype, base, nblocks, spec=True).get("CFG_NT", 512))}
    if qtype:
        out["CFG_QLPC"] = 1
    return out


def qkv_loads(nranks: int = 1) -> int:
    """CFG_UB_QKV: 16-byte loads in flight per lane in a QKV unit (two rows of D). At 24 a unit's two 6 KB
    rows (12 loads a lane each for D = 3072 in bf16) go out in one batch, one round trip, instead of two
    batches at the 12 of the other phases: faster on the 2B shape with one and two ranks (the runs:
    docs/monokernel.md, docs/lab/benchmarks-2026-11.md). Four and eight ranks keep 12 (no such machine was
    lent to measure them)."""
    return 24 if nranks <= 2 else 12


def prefetch_bytes(nranks: int = 1, num_lanes: int = 8, quantized: bool = False) -> int:
    """CFG_PF: bytes of its next weights each block asks L2 for before it waits. A rank's phases are 1/N of
    the model's, so a rank of several needs less. Measured (the sizes tried and their runs:
    docs/lab/benchmarks-2026-11.md for the 2B shape, BENCHMARKS.md "Results of 2026-12-05 (twenty-ninth
    session)" for one lane):
    - one rank of several lanes (the 2B shape): 64 KB (smaller and larger sizes were slower, none most);
    - one-lane models: 32 KB (Llama-3.2-1B bf16 +2.8%, Q4_0 +1.7% against 64 KB; 16-24 KB level, 48 KB
      between; SmolLM2-135M level from 32 to 256 KB);
    - two ranks, one GPU each: 32 KB (48 / 64 KB and none slower, 16 / 24 KB level);
    - more ranks: 64 KB as before, since no machine of 4 or 8 GPUs was lent to measure a smaller size;
    - one-lane models with quantized layer matrices: none (H100, 2026-12-07, against 32 KB: llama3.1-8b Q4_0
      +4.7%, Q4_K_M +2.5-3.7%, llama3.2-1b Q4_0 +1.0%, Q4_K_M +2.3%, SmolLM2 Q4_1 +1.0%; bf16 8B -2.1%, so
      bf16 keeps 32 KB)."""
    if nranks == 1 and num_lanes == 1 and quantized:
        return 0
    return 32768 if nranks == 2 or (nranks == 1 and num_lanes == 1) else 65536


def skew_ns(cfg, dtype: str, nranks: int = 1) -> int:
    """The lane skew (monokernel.cu, CFG_SKEW_NS): the upper half of a rank's lanes starts layer delta this
    many ns late. Only for models that stream at least 1 GB a token over several lanes a rank (for a small
    model it would only add its delay to every token), and only for the rank counts it was measured with
    on the 2B shape (the delays tried and their runs: docs/monokernel.md, fourth and fifth sessions):
    - one rank: 10 us;
    - two ranks (4 lanes each, one GPU each): 30 us;
    - more ranks: none (unmeasured; with 8 lanes, 4 ranks have 2 lanes each and 8 ranks one)."""
    from .weights import streamed_bytes
    if cfg.num_lanes // max(1, nranks) < 2 or streamed_bytes(cfg, dtype) < 1 << 30:
        return 0
    return {1: 10000, 2: 30000}.get(nranks, 0)


def default_blocks(cfg, sms: int) -> int:
    """One block per SM, rounded down to a multiple of the lane count when that keeps >= 85% of the SMs:
    then every block works on exactly one lane in every phase (no block straddles two lanes, no lane waits
    for a straddling block). On the H200 (132 SMs, 8 lanes): 128 blocks, faster than 132 (docs/monokernel.md,
    "Versions")."""
    nb = sms - sms % cfg.num_lanes
    return nb if nb >= 0.85 * sms else sms


def check_shape(cfg, dtype: str, nblocks: int | None = None) -> None:
    """The kernel's layout rules, refused with a one-line reason."""
    from .weights import split_dtype
    qtype, base = split_dtype(dtype)
    vec = 4 if base == "F32" else 8
    hd, L = cfg.head_dim, cfg.num_lanes
    dims = {"hidden_size": cfg.hidden_size, "head_dim": hd,
            "heads per lane * head_dim": cfg.heads_per_lane * hd, "intermediate_size / num_lanes": cfg.ffn_per_lane}
    for name, v in dims.items():
        if v % vec:
            raise ValueError(f"cuda backend: {name}={v} must be a multiple of {vec} for {dtype} storage")
    if qtype:
        for name, v in dims.items():
            if name != "head_dim" and v % 32:
                raise ValueError(f"cuda backend: {name}={v} must be a multiple of 32 for {qtype} storage")
    if hd // vec > 32:
        raise ValueError(f"cuda backend: head_dim={hd} is too large ({32 * vec} at most for {dtype})")
    if cfg.hidden_size % 4:
        raise ValueError("cuda backend: hidden_size must be a multiple of 4")
    if nblocks is not None and smem_bytes(cfg, dtype, nblocks) > SMEM_LIMIT:
        raise ValueError(f"cuda backend: hidden_size / intermediate_size too large: a block would need "
                         f"{smem_bytes(cfg, dtype, nblocks)} bytes of shared memory ({SMEM_LIMIT} at most)")


SMEM_LIMIT = 225 * 1024
SPEC_MAX = 9   # positions of a verify pass at most: the last token and kog_dist.speculative.MAX_DRAFT drafts


def spec_positions(cfg, dtype: str, nblocks: int, nranks: int = 1, nthreads: int | None = None) -> int:
    """CFG_SPEC of the speculative build (mk_spec.cuh): the most positions, up to SPEC_MAX, whose inputs a
    block stages in shared memory at once (SP planes of the largest input, SP residual bases of its rows,
    the attention scratch); 0 where there is no verify pass (several lanes or ranks)."""
    from .weights import split_dtype
    if cfg.num_lanes != 1 or nranks != 1:
        return 0
    qtype, base = split_dtype(dtype)
    units = one_lane_units(cfg, qtype, base, nblocks)
    nr_wo, nr_w2 = units.get("CFG_NR_WO", 4), units.get("CFG_NR_W2", 2)
    nw = (nthreads or units.get("CFG_NT", 512)) // 32
    D, HD = cfg.hidden_size, cfg.head_dim
    G = cfg.num_attention_heads // cfg.kv_heads
    kmax = max(D, cfg.num_attention_heads * HD, cfg.intermediate_size)
    att = G * HD + nw * G * HD + 2 * nw * G
    cb_rows = -(-D // nblocks) + 2 * nr_wo + 2 * nr_w2
    for sp in range(SPEC_MAX, 1, -1):
        if (max(sp * kmax, att) + sp * cb_rows + nw * sp + 32) * 4 <= SMEM_LIMIT and sp <= nw:
            return sp
    return 0


def smem_bytes(cfg, dtype: str, nblocks: int, nthreads: int = 512, norm2: bool = True) -> int:
    """The monokernel's dynamic shared memory (mk_layout.cuh SM_FLOATS * 4; the build's defaults): the inputs of
    the lanes a block touches in a phase (its staging area), the combine staging of its rows, the
    attention scratch, the LM head's input; plus the norm weights of stage_norms2 (NORM2)."""
    from .weights import split_dtype
    qtype, base = split_dtype(dtype)
    units = one_lane_units(cfg, qtype, base, nblocks)
    nr_wo, nr_w2, pfs = units.get("CFG_NR_WO", 4), units.get("CFG_NR_W2", 2), units.get("CFG_PFS", 0)
    D, L, HD, nw = cfg.hidden_size, cfg.num_lanes, cfg.head_dim, units.get("CFG_NT", nthreads) // 32
    hdl, fl = cfg.heads_per_lane * HD, cfg.ffn_per_lane
    rq = hdl + 2 * (cfg.kv_heads // L) * HD
    G = cfg.num_attention_heads // cfg.kv_heads
    nr_wo, nr_w2 = (nr_wo if D % nr_wo == 0 else 4), (nr_w2 if D % nr_w2 == 0 else 2)

    def spanned(U, upl):
        m = 1
        for b in range(nblocks):
            a, e = b * U // nblocks, (b + 1) * U // nblocks
            if e > a:
                m = max(m, (e - 1) // upl - a // upl + 1)
        return m

    stage = max(spanned(L * rq // 2, rq // 2) * D, spanned(L * fl, fl) * D,
                spanned(L * D // nr_wo, D // nr_wo) * hdl, spanned(L * D // nr_w2, D // nr_w2) * fl)
    cb_rows = -(-L * D // nblocks) + 2 * nr_wo + 2 * nr_w2
    att = G * HD + nw * G * HD + 2 * nw * G
    main = max(max(stage, att) + 2 * cb_rows, D) + 144
    norm2 = (norm2 and spanned(L * rq // 2, rq // 2) <= 2 and spanned(L * fl, fl) <= 2 and min(L, 8) >= 2
             and D % 4 == 0)
    return (-(-main // 4) * 4 + pfs // 4 + (2 * D if norm2 else 0)) * 4


class Kernels:
    def __init__(self, module, defs: dict, seconds: float):
        self.module = module
        self.defines = defs
        self.compile_s = seconds
        self.mono = module.get_function("monokernel")
        import cupy as cp
        info = cp.zeros(9, dtype=cp.int64)
        module.get_function("monokernel_info")((1,), (1,), (info,))
        self.info = [int(x) for x in info.get()]
        self.smem_bytes, self.nctr, self.nch, self.vpow2, self.params_bytes, self.layer_elems = self.info[:6]
        self.nranks = int(defs.get("KOG_NRANKS", 1))
        self.nthreads = int(defs.get("CFG_NT", 512))
        self.npost, self.fin_floats, self.fin_words = self.info[6:9] if self.nranks > 1 else (0, 0, 0)
        self.mono.max_dynamic_shared_size_bytes = self.smem_bytes
        self.fn = {n: module.get_function(n) for n in
                   ("pf_embed", "pf_norm", "pf_rope", "pf_attn", "pf_combine", "pf_silu", "f32_to_w", "w_to_f32",
                    "q_to_w", "q_to_f32", "f32_to_q", "kq_to_w", "kq_to_f32")}
        if self.nranks > 1:
            self.fn["pf_combine_mr"] = module.get_function("pf_combine_mr")


def build(cfg, dtype: str, nblocks: int | None = None, prefetch: int | None = None, progress: bool = True,
          extra: dict | None = None, nranks: int = 1, marks: bool = False, spec: int = 0) -> Kernels:
    """extra: more CFG_* defines (tuning variants, docs/monokernel.md: CFG_PF, CFG_PFS, CFG_NR_WO, CFG_NR_W2,
    CFG_UBMAX, CFG_UB_QKV, CFG_NT, CFG_SKEW_NS, CFG_ATT_MINPOS, CFG_ATT_MERGE, CFG_KVPF_W2, CFG_PCONST);
    the defaults are what the backend uses.
    nranks > 1: the kernel of one rank of the multi-rank backend (cfg: the model's config; nblocks: given
    by the backend).
    spec > 1: the speculative build, verify passes of up to `spec` positions (one lane, one rank;
    spec_positions)."""
    import cupy as cp
    if spec:
        extra = {**(extra or {}), "CFG_SPEC": int(spec)}
    shape = cfg
    if nranks > 1:
        from .multirank import RankView, check
        check(cfg, nranks)
        shape = RankView(cfg, 0, nranks)
    if nblocks is None:
        nblocks = default_blocks(cfg, cp.cuda.Device().attributes["MultiProcessorCount"])
    check_shape(shape, dtype, nblocks)
    defs = defines(cfg, dtype, nblocks, prefetch, extra, nranks, marks)
    key = tuple(sorted(defs.items()))
    if key in _cache:
        return _cache[key]
    opts = ("-std=c++17",) + tuple(f"-D{k}={v}" for k, v in defs.items())
    t0 = time.perf_counter()
    if progress:
        what = f", verify passes of {spec}" if spec else ""
        print(f"[kog] compiling monokernel ({dtype}, D={cfg.hidden_size}, layers={cfg.num_hidden_layers}, "
              f"lanes={cfg.num_lanes}, blocks={nblocks}{what}) ...", end="", file=sys.stderr, flush=True)
    try:
        mod = cp.RawModule(code=source(), options=opts, backend="nvrtc")
        k = Kernels(mod, defs, 0.0)
    except Exception:
        if progress:
            print(" failed", file=sys.stderr, flush=True)
        raise
    k.compile_s = time.perf_counter() - t0
    if progress:
        print(f" done in {k.compile_s:.1f} s", file=sys.stderr, flush=True)
    _cache[key] = k
    return k


_PREBUILD = r"""
import json, sys
from kog_dist.config import LaneformerConfig
from workers.cuda.build import build
cfg = LaneformerConfig.from_dict(json.loads(sys.argv[1]))
build(cfg, sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), progress=False, spec=int(sys.argv[5]),
      extra=json.loads(sys.argv[6]) or None)
"""


def prebuild(items, nblocks: int | None = None, prefetch: int | None = None, progress: bool = True) -> None:
    """Compile several (cfg, dtype), (cfg, dtype, spec) or (cfg, dtype, spec, extra defines) variants at once,
    one process each, to fill CuPy's disk cache; later build() calls then only load the cached binaries.
    prefetch None: each build's default (prefetch_bytes: 32 KB for one lane since c508057; a fixed 65536
    compiled one-lane variants no later build() asked for). Failures surface at the later build()."""
    import subprocess
    import json
    import cupy as cp
    from .weights import split_dtype
    t0 = time.perf_counter()
    root = os.path.dirname(os.path.dirname(HERE))
    env = dict(os.environ)
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    procs = [subprocess.Popen([sys.executable, "-c", _PREBUILD, json.dumps(it[0].to_dict()), it[1],
                               str(nblocks or default_blocks(it[0], sms)),
                               str(prefetch if prefetch is not None else
                                   prefetch_bytes(1, it[0].num_lanes, split_dtype(it[1])[0] is not None)),
                               str(it[2] if len(it) > 2 else 0),
                               json.dumps(it[3] if len(it) > 3 else {})],
                              env=env)
             for it in items]
    for p in procs:
        p.wait()
    if progress:
        print(f"[kog] prebuilt {len(items)} monokernel variants in {time.perf_counter() - t0:.1f} s",
              file=sys.stderr, flush=True)
