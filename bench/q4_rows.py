#!/usr/bin/env python3
"""How fast one weight matrix streams at batch 1 (y = W x) in each 4-bit matvec form (issue 52): the monokernel's
row loops transplanted (fp32 x in shared memory, the offset form), llama.cpp mmvq's dp4a form (x as 8-bit blocks),
Marlin's lop3 / HFMA2 form (fp16 x), llama.cpp's own mmvq kernel shape, for Q4_0, Q4_K and Q8_0 (and the bf16 row
of the monokernel for scale), over a small sweep of rows a warp (NR), 16-byte loads in flight a lane (UB), threads
a block (NT), blocks an SM (BPS) and pipelined loads (PIPE). Kernels: bench/q4_rows.cu.

    python3 bench/q4_rows.py --out DIR [--shapes 8b.w13,8b.w2,1b.w13,1b.w2] [--quick] [--reps 20] [--budget 170]

Shapes (rows, K): 8b.w13 [28672, 4096], 8b.w2 [4096, 14336] (Llama-3.1-8B), 1b.w13 [16384, 2048], 1b.w2
[2048, 8192] (Llama-3.2-1B). Each is timed as NMAT copies stacked into one tall matrix of >= 320 MB (L2 holds
50 MB: no copy is in L2 when it is read again), one launch streaming them all (launch and staging costs spread
over the copies: the rows' own rate), CUDA events, the median of --reps; GB/s counts the bytes as stored (Q4_0
18, Q8_0 34 a 32-block; Q4_K 148 a 256-block in the monokernel's re-laid form; bf16 2 a weight), against the
copy bandwidth (a device-to-device copy of 1 GB, read + written, measured in the same run) and a read-only
stream. `1-launch` columns: one copy a launch (launch, staging and tail included). Every kernel is checked
first on a 256-row matrix of the shape's K against numpy (gguf.quants' dequantization): `err` against the
form's exact value (dp4a: W . x8, x8 the kernel's 8-bit x), `err32` against W . x (dp4a / fp16 x's own error).
Prints a table and writes DIR/q4_rows.json and DIR/q4_rows.txt.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
CU = os.path.join(HERE, "q4_rows.cu")
OPTIONS = ("-std=c++17",)   # workers/cuda/build.py's NVRTC options (CuPy adds the device's -arch)
FORMS = {"mono": "MONO", "dp4a": "DP4A", "half2": "HALF2", "mmvq": None}   # q4_rows.cu's names
FMTS = {"bf16": "F_BF16", "q8_0": "F_Q8", "q4_0": "F_Q4", "q4_k": "F_QK"}
BPW = {"bf16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32, "q4_k": 148 / 256}   # bytes a weight as stored
SHAPES = {"8b.w13": (2 * 14336, 4096, "w13"), "8b.w2": (4096, 14336, "w2"),
          "1b.w13": (2 * 8192, 2048, "w13"), "1b.w2": (2048, 8192, "w2")}
TALL_BYTES = 320 << 20   # bytes a timed launch streams at least
MC = 256                 # rows of the correctness check
TOL = {"mono": 1e-4, "dp4a": 1e-4, "mmvq": 1e-4, "half2": 2e-2}   # err (half2: fp16 x and sums)


@dataclass(frozen=True)
class Cfg:
    form: str
    fmt: str
    K: int
    nr: int
    ub: int
    nt: int
    bps: int = 1
    pipe: bool = False

    @property
    def name(self) -> str:
        return f"{self.form}_{self.fmt}_k{self.K}_r{self.nr}_u{self.ub}_t{self.nt}_b{self.bps}_p{int(self.pipe)}"

    def smem(self) -> int:   # dynamic shared memory: the staged x (q4_rows.cu stage_*)
        if self.form == "mono":
            return 4 * self.K
        if self.form == "dp4a":
            return self.K + self.K // 32 * 8
        if self.form == "half2":
            return 2 * self.K + (self.K // 32 * 4 if self.fmt == "q4_k" else 0)
        return 0

    def label(self) -> str:
        return f"{self.form} NR{self.nr} UB{self.ub} NT{self.nt}" + (f"x{self.bps}" if self.bps > 1 else "") + \
            (" pipe" if self.pipe else "")


def sweep(shape: str, quick: bool = False) -> list[Cfg]:
    """The configurations of one shape. The monokernel's own: NR 2 (W13's unit: a gate/up pair) or 1 (W2,
    build.one_lane_units), UB = min(CFG_UBMAX 12, CFG_QUB 8) = 8 (bf16: 12), 512 threads, one block an SM."""
    M, K, kind = SHAPES[shape]
    m = 2 if kind == "w13" else 1
    C = lambda form, fmt, nr, ub, nt, bps=1, pipe=False: Cfg(form, fmt, K, nr, ub, nt, bps, pipe)
    out = [C("mono", "bf16", m, 12, 512), C("mono", "q4_0", m, 8, 512), C("mono", "q8_0", m, 8, 512),
           C("mono", "q4_k", m, 8, 512), C("mmvq", "q4_0", 1, 2, 128)]
    if quick:
        return out + [C("dp4a", f, m, 8, 512, pipe=True) for f in ("q4_0", "q4_k", "q8_0")] + \
            [C("half2", f, m, 8, 512, pipe=True) for f in ("q4_0", "q4_k")]
    # (every configuration below is free of ptxas spills for the four shapes: tests/test_q4_rows_compile.py; the
    # monokernel's Q4_0 loop at NR 4 spills with 2 loads a row at K >= 8192, so it gets one there, its Q4_K loop
    # at NR 4 spills at K 8192 with either; 64 registers a thread at 1024 threads an SM (NT 1024, or 2 blocks of
    # 512) hold 4 loads a lane, 2 + 2 pipelined)
    out += [C("mono", "q4_0", 4, 8 if K <= 4096 else 4, 512), C("mono", "q4_0", 3 - m, 8, 512),
            C("mono", "q4_0", m, 8, 1024), C("mono", "q4_0", m, 16, 512)]
    out += [C("mono", "q4_k", 4, 8, 512)] if K <= 4096 else []
    for f in ("q4_0", "q4_k", "q8_0"):
        for nr in (1, 2, 4):
            out += [C("dp4a", f, nr, 8, 512), C("dp4a", f, nr, 16, 512), C("dp4a", f, nr, 8, 512, pipe=True)]
        out += [C("dp4a", f, m, 4, 1024), C("dp4a", f, m, 2, 1024, pipe=True), C("dp4a", f, m, 16, 256, pipe=True),
                C("dp4a", f, m, 4, 512, 2)]
    for f in ("q4_0", "q4_k"):
        for nr in (1, 2):
            out += [C("half2", f, nr, 8, 512), C("half2", f, nr, 8, 512, pipe=True)]
        out += [C("half2", f, 4, 8, 512), C("half2", f, 4, 4, 512, pipe=True), C("half2", f, m, 4, 1024)]
    return list(dict.fromkeys(out))


def wrappers(cfgs) -> str:
    """One extern "C" kernel a configuration (the names Cfg.name), appended to q4_rows.cu."""
    lines = []
    for c in cfgs:
        if c.form == "mmvq":
            body = f"mmvq_body<{c.K}>(q, s, y);"
        else:
            body = (f"rows_body<{FORMS[c.form]}, {FMTS[c.fmt]}, {c.nr}, {c.K}, {c.ub}, {c.nt}, "
                    f"{'true' if c.pipe else 'false'}>(q, s, x, y, M);")
        lines.append(f'extern "C" __global__ void __launch_bounds__({c.nt}, {c.bps}) {c.name}(const u8* __restrict__ q, '
                     f"const u8* __restrict__ s, const float* __restrict__ x, float* __restrict__ y, int M) {{ {body} }}")
    return "\n".join(lines) + "\n"


def ptxas_report(cfgs, jobs: int = 2, nvcc: str = "nvcc") -> dict:
    """name -> {regs, stack, spill_stores, spill_loads}: nvcc -arch=sm_90 -cubin -Xptxas -v of the kernels of
    cfgs (jobs nvcc processes at once; no GPU needed). Raises RuntimeError with nvcc's log if one fails."""
    import re
    import tempfile
    out = {}
    with tempfile.TemporaryDirectory() as t:
        procs = []
        for i, (src, _) in enumerate(module_sources(cfgs, max(1, min(jobs, len(cfgs))))):
            f = os.path.join(t, f"m{i}.cu")
            open(f, "w").write(src)
            procs.append(subprocess.Popen([nvcc, "-arch=sm_90", *OPTIONS, "-cubin", "-Xptxas", "-v", f, "-o",
                                           f + ".cubin"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        for p in procs:
            log = p.communicate()[0]
            if p.returncode:
                raise RuntimeError(log[-4000:])
            for m in re.finditer(r"Function properties for (\w+)\s+(\d+) bytes stack frame, (\d+) bytes spill stores, "
                                 r"(\d+) bytes spill loads\s+ptxas info\s+: Used (\d+) registers", log):
                out[m.group(1)] = {"regs": int(m.group(5)), "stack": int(m.group(2)),
                                   "spill_stores": int(m.group(3)), "spill_loads": int(m.group(4))}
    return out


def module_sources(cfgs, n: int) -> list[tuple[str, list[Cfg]]]:
    base = open(CU).read()
    groups = [cfgs[i::n] for i in range(n)]
    return [(base + wrappers(g), g) for g in groups if g]


# ---- host data: the check's matrices and references ---------------------------------------------------------
def bf16_round(w: np.ndarray) -> np.ndarray:
    u = w.astype(np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def q8_host(x: np.ndarray) -> np.ndarray:
    """x as the kernels quantize it (q4_rows.cu quant32): d = max |x| / 127 a 32-block, q = rint(x / d); -> q d."""
    xb = x.astype(np.float32).reshape(-1, 32)
    d = (np.abs(xb).max(axis=1) / np.float32(127)).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(d[:, None] > 0, np.rint(xb / d[:, None]), 0).astype(np.float64)
    return (q * d.astype(np.float64)[:, None]).reshape(-1)


def check_data(K: int, rng) -> dict:
    """fmt -> (device arrays as bytes {q, s, aos}, dequantized W [MC, K] float64)."""
    import gguf
    from gguf.quants import dequantize, quantize
    sys.path.insert(0, ROOT)
    from workers.cuda import kquant
    T = gguf.GGMLQuantizationType
    W = (rng.standard_normal((MC, K)) * 0.02).astype(np.float32)
    out = {}
    b = bf16_round(W)
    out["bf16"] = ({"q": b.view(np.uint8).reshape(-1)}, (b.astype(np.uint32) << 16).view(np.float32).astype(np.float64))
    for fmt, t, bb in (("q4_0", T.Q4_0, 18), ("q8_0", T.Q8_0, 34)):
        blk = quantize(W, t)                                   # [MC, K / 32 * bb] GGUF bytes
        r = blk.reshape(-1, bb)
        out[fmt] = ({"q": np.ascontiguousarray(r[:, 2:]).reshape(-1), "s": np.ascontiguousarray(r[:, :2]).reshape(-1),
                     "aos": blk.reshape(-1)}, dequantize(blk, t).astype(np.float64))
    blk = kquant.random_blocks(MC * K // 256, "Q4_K", 0.02, seed=int(rng.integers(1 << 30)))
    nib, _, rec = kquant.relayout(blk, "Q4_K")
    out["q4_k"] = ({"q": nib, "s": rec}, dequantize(blk.reshape(MC, -1), T.Q4_K).astype(np.float64))
    return out


def rel(y, r) -> float:
    return float(np.linalg.norm(np.asarray(y, np.float64) - r) / max(np.linalg.norm(r), 1e-30))


# ---- the device run -------------------------------------------------------------------------------------------
def compile_modules(srcs) -> tuple:
    """Every module compiled by NVRTC in its own process at once (filling CuPy's disk cache, as
    workers/cuda/build.prebuild does), then loaded here (cache hits; a module whose child failed compiles here).
    Returns (name -> Function or the error text of its module, the first module)."""
    import tempfile
    import cupy as cp
    with tempfile.TemporaryDirectory() as t:
        procs = []
        for i, (src, g) in enumerate(srcs):
            p = os.path.join(t, f"m{i}.cu")
            open(p, "w").write(src)
            procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), "--compile-module", p, g[0].name],
                                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
        failed = sum(pr.communicate()[1] is not None and pr.returncode != 0 for pr in procs)
    if failed:
        print(f"[q4_rows] {failed} of {len(procs)} compile processes failed: compiling those here",
              file=sys.stderr, flush=True)
    fns, first = {}, None
    for src, g in srcs:
        try:
            mod = cp.RawModule(code=src, options=OPTIONS)
            for c in g:
                fns[c.name] = mod.get_function(c.name)
            first = first or mod
        except Exception as e:   # the whole module: NVRTC's log
            for c in g:
                fns[c.name] = f"{type(e).__name__}: {str(e)[-800:]}"
    return fns, first


class Runner:
    def __init__(self, fns, aux, nsm: int, reps: int):
        import cupy as cp
        self.cp, self.fns, self.aux, self.nsm, self.reps = cp, fns, aux, nsm, reps
        self.e0, self.e1 = cp.cuda.Event(), cp.cuda.Event()

    def launch(self, c: Cfg, arrs: dict, x, y, M: int):
        f = self.fns[c.name]
        if c.form == "mmvq":
            f((M,), (128,), (arrs["aos"], arrs["x8"], x, y, np.int32(M)))
        else:
            f((self.nsm * c.bps,), (c.nt,), (arrs["q"], arrs.get("s", arrs["q"]), x, y, np.int32(M)),
              shared_mem=c.smem())

    def timed(self, fn) -> float:
        """The median of reps launches fn(k), each between two events behind a 40 us spin, so that the host's
        launch cost is not in the time (the GPU is busy while the launch is enqueued)."""
        cp = self.cp
        fn(0)
        fn(1)
        ts = []
        for k in range(self.reps):
            self.aux["spin"]((1,), (32,), (np.int64(40000),))
            self.e0.record()
            fn(k)
            self.e1.record()
            self.e1.synchronize()
            ts.append(cp.cuda.get_elapsed_time(self.e0, self.e1) * 1e-3)
        return statistics.median(ts)


def fill(cp, aux, nbytes: int, seed: int, mask: int):
    a = cp.empty(-(-nbytes // 16) * 16, dtype=cp.uint8)
    w = a.view(cp.uint32)
    aux["fill_words"]((1024,), (256,), (w, np.int64(w.size), np.uint32(seed), np.uint32(mask)))
    return a


def arrays_bytes(fmt: str, rows: int, K: int) -> dict:
    n = rows * K
    if fmt == "bf16":
        return {"q": 2 * n}
    if fmt == "q8_0":
        return {"q": n, "s": n // 16}
    if fmt == "q4_0":
        return {"q": n // 2, "s": n // 16, "aos": n // 32 * 18}
    return {"q": n // 2, "s": n // 256 * 20}


def run_shape(R: Runner, shape: str, cfgs, rng, t_end: float, copy_bw: float, rows: list) -> None:
    """Checks, then times, every configuration of one shape; appends a dict a kernel to rows."""
    cp = R.cp
    M, K, kind = SHAPES[shape]
    xh = rng.standard_normal(K).astype(np.float32)
    x = cp.asarray(xh)
    x8 = cp.zeros(K // 32 * 40, dtype=cp.uint8)
    R.aux["q8_global"](((K // 32 * 32 + 255) // 256,), (256,), (x, x8, np.int32(K // 32)))
    t0 = time.time()
    data = check_data(K, rng)
    x8ref = q8_host(xh)
    print(f"[q4_rows] {shape}: check data in {time.time() - t0:.1f} s", file=sys.stderr, flush=True)
    refs = {f: (W @ xh.astype(np.float64), W @ x8ref) for f, (_, W) in data.items()}
    dev = {f: {k: cp.asarray(v) for k, v in a.items()} for f, (a, _) in data.items()}
    for a in dev.values():
        a["x8"] = x8
    yc = cp.zeros(MC, dtype=cp.float32)
    for c in cfgs:
        row = {"shape": shape, "rows": M, "K": K, "form": c.form, "fmt": c.fmt, "nr": c.nr, "ub": c.ub, "nt": c.nt,
               "bps": c.bps, "pipe": c.pipe, "kernel": c.name, "smem": c.smem()}
        f = R.fns[c.name]
        if isinstance(f, str):
            rows.append({**row, "error": f})
            continue
        if c.form != "mmvq":
            f.max_dynamic_shared_size_bytes = c.smem()
        for k in ("num_regs", "local_size_bytes"):
            try:
                row[k] = int(getattr(f, k))
            except Exception:
                pass
        try:
            yc.fill(np.nan)
            R.launch(c, dev[c.fmt], x, yc, MC)
            y = cp.asnumpy(yc)
            r32, r8 = refs[c.fmt]
            exact = r8 if c.form in ("dp4a", "mmvq") else r32
            row.update(err=rel(y, exact), err32=rel(y, r32))
            row["ok"] = bool(np.isfinite(row["err"]) and row["err"] < TOL[c.form])
        except Exception as e:   # recorded; a sticky CUDA error fails what follows, and main writes what ran
            rows.append({**row, "error": f"check: {type(e).__name__}: {str(e)[:300]}"})
            continue
        rows.append(row)
    dev = None
    # timing: per format, NMAT copies of the shape's matrix stacked into one tall matrix
    for fmt in dict.fromkeys(c.fmt for c in cfgs):
        one = arrays_bytes(fmt, M, K)
        stored = M * K * BPW[fmt]
        nmat = max(2, math.ceil(TALL_BYTES / stored))
        pool = {k: fill(cp, R.aux, v * nmat, 17 + i, 0xFFFFFFFF if k == "q" else 0x3F3F3F3F)
                for i, (k, v) in enumerate(one.items())}
        pool["x8"] = x8
        y = cp.zeros(M * nmat, dtype=cp.float32)
        for row in rows:
            if row["shape"] != shape or row["fmt"] != fmt or "error" in row:
                continue
            c = next(c for c in cfgs if c.name == row["kernel"])
            if time.time() > t_end:
                row["skipped"] = "time budget"
                continue
            if c.form == "mmvq":
                need = {"aos": pool["aos"], "x8": x8}
                per = {"aos": one["aos"]}
            else:
                need = {k: pool[k] for k in ("q", "s") if k in pool}
                per = {k: one[k] for k in need}
            try:
                t_tall = R.timed(lambda k: R.launch(c, need, x, y, M * nmat))
                def single(k):
                    j = k % nmat
                    R.launch(c, {**{a: need[a][j * per[a]:(j + 1) * per[a]] for a in per}, "x8": x8}, x,
                             y[j * M:(j + 1) * M], M)
                t_one = R.timed(single)
            except Exception as e:
                row["error"] = f"timing: {type(e).__name__}: {str(e)[:300]}"
                continue
            row.update(nmat=nmat, bytes=stored, us=t_tall / nmat * 1e6, GBps=stored * nmat / t_tall / 1e9,
                       us_1=t_one * 1e6, GBps_1=stored / t_one / 1e9)
            row["of_copy"] = row["GBps"] * 1e9 / copy_bw
        pool = y = None   # (the closures above are done with them)
        cp.get_default_memory_pool().free_all_blocks()


def table(res: dict) -> str:
    cb = res["copy_GBps"]
    out = [f"device: {res['device']} ({res['sms']} SMs); copy bandwidth {cb:.0f} GB/s (1 GB, read + written); "
           f"read-only stream {res['read_GBps']:.0f} GB/s; {res['elapsed_s']:.0f} s",
           "| shape | fmt | variant | regs | local B | err | err32 | GB/s | % copy | us | 1-launch GB/s | 1-launch us |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    if res.get("fatal"):
        out.insert(1, f"STOPPED (a CUDA error; the rows below ran): {res['fatal']}")
    for r in res["rows"]:
        v = Cfg(r["form"], r["fmt"], r["K"], r["nr"], r["ub"], r["nt"], r["bps"], r["pipe"]).label()
        head = f"| {r['shape']} | {r['fmt']} | {v} | {r.get('num_regs', '')} | {r.get('local_size_bytes', '')} |"
        if "error" in r:
            out.append(f"{head} ERROR {r['error'][:160]!r} |||||||")
            continue
        err = f"{r['err']:.1e}{'' if r['ok'] else ' FAIL'} | {r['err32']:.1e}"
        if "GBps" not in r:
            out.append(f"{head} {err} | {r.get('skipped', '')} |||||")
            continue
        out.append(f"{head} {err} | {r['GBps']:.0f} | {100 * r['of_copy']:.1f}% | {r['us']:.1f} | "
                   f"{r['GBps_1']:.0f} | {r['us_1']:.1f} |")
    out += ["", "best of each (shape, fmt, form):", "| shape | fmt | form | best variant | GB/s | % copy | monokernel's |",
            "|---|---|---|---|---|---|---|"]
    best: dict = {}
    for r in res["rows"]:
        if "GBps" in r and r.get("ok"):
            k = (r["shape"], r["fmt"], r["form"])
            if k not in best or r["GBps"] > best[k]["GBps"]:
                best[k] = r
    mono = {(r["shape"], r["fmt"]): r for r in res["rows"] if r["form"] == "mono" and "GBps" in r
            and r["nt"] == 512 and r["ub"] == (12 if r["fmt"] == "bf16" else 8)
            and r["nr"] == (2 if SHAPES[r["shape"]][2] == "w13" else 1)}
    for (s, f, form), r in best.items():
        m = mono.get((s, f))
        mono_gbps = "" if m is None else f"{m['GBps']:.0f}"
        v = Cfg(r["form"], r["fmt"], r["K"], r["nr"], r["ub"], r["nt"], r["bps"], r["pipe"]).label()
        out.append(f"| {s} | {f} | {form} | {v} | {r['GBps']:.0f} | {100 * r['of_copy']:.1f}% | {mono_gbps} |")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="directory for q4_rows.json and q4_rows.txt")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--quick", action="store_true", help="the monokernel's configurations and one of each form")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--budget", type=float, default=170.0, help="seconds after which the remaining timings are skipped")
    ap.add_argument("--procs", type=int, default=12, help="NVRTC processes (modules)")
    ap.add_argument("--ptxas", action="store_true", help="no GPU: nvcc's registers / spills of every kernel, then exit")
    ap.add_argument("--compile-module", nargs=2, metavar=("CU", "KERNEL"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.ptxas:
        cfgs = [c for s in a.shapes.split(",") for c in sweep(s.strip(), a.quick)]
        rep = ptxas_report(cfgs, jobs=a.procs)
        for c in cfgs:
            r = rep.get(c.name, {})
            print(f"{c.name:44s} regs {r.get('regs', '?'):>3} stack {r.get('stack', '?'):>3} "
                  f"spill st/ld {r.get('spill_stores', '?')}/{r.get('spill_loads', '?')}")
        return 0
    if a.compile_module:   # a child of compile_modules: compile one module into CuPy's cache
        import cupy as cp
        cp.RawModule(code=open(a.compile_module[0]).read(), options=OPTIONS).get_function(a.compile_module[1])
        return 0
    if not a.out:
        ap.error("--out DIR is required")
    t_start = time.time()
    shapes = [s.strip() for s in a.shapes.split(",") if s.strip()]
    for s in shapes:
        if s not in SHAPES:
            ap.error(f"unknown shape {s!r} (known: {', '.join(SHAPES)})")
    os.makedirs(a.out, exist_ok=True)
    import cupy as cp
    sys.path.insert(0, ROOT)
    from workers.cuda.device import cupy_copy_bandwidth, device_name
    dev = cp.cuda.Device()
    nsm = dev.attributes["MultiProcessorCount"]
    cfgs = {s: sweep(s, a.quick) for s in shapes}
    allc = [c for s in shapes for c in cfgs[s]]
    srcs = module_sources(allc, max(1, min(a.procs, len(allc))))
    fns, mod0 = compile_modules(srcs)
    mod0 = mod0 or cp.RawModule(code=open(CU).read(), options=OPTIONS)
    aux = {n: mod0.get_function(n) for n in ("fill_words", "q8_global", "read_stream", "spin")}
    print(f"[q4_rows] {len(allc)} kernels compiled in {time.time() - t_start:.1f} s", file=sys.stderr, flush=True)
    copy_bw = cupy_copy_bandwidth(1 << 30, 10)
    buf = fill(cp, aux, 1 << 30, 5, 0xFFFFFFFF)
    o = cp.zeros(4, dtype=cp.uint32)
    R = Runner(fns, aux, nsm, a.reps)
    t = R.timed(lambda k: aux["read_stream"]((nsm * 4,), (512,), (buf, np.int64(buf.size // 16), o)))
    read_bw = buf.size / t
    buf = None
    cp.get_default_memory_pool().free_all_blocks()
    rng = np.random.default_rng(52)
    rows, fatal = [], None
    try:
        for s in shapes:
            run_shape(R, s, cfgs[s], rng, t_start + a.budget, copy_bw, rows)
    except Exception as e:   # a CUDA error is sticky: write what ran
        fatal = f"{type(e).__name__}: {str(e)[:500]}"
        print(f"[q4_rows] stopped: {fatal}", file=sys.stderr, flush=True)
    res = {"device": device_name(dev.id), "sms": nsm, "copy_GBps": copy_bw / 1e9, "read_GBps": read_bw / 1e9,
           "elapsed_s": time.time() - t_start, "reps": a.reps, "tall_bytes": TALL_BYTES, "check_rows": MC,
           "cupy": cp.__version__, "fatal": fatal, "rows": rows}
    text = table(res)
    print(text, flush=True)
    with open(os.path.join(a.out, "q4_rows.json"), "w") as f:
        json.dump(res, f, indent=1)
    with open(os.path.join(a.out, "q4_rows.txt"), "w") as f:
        f.write(text + "\n")
    bad = [r["kernel"] for r in rows if "error" in r or not r.get("ok", True)]
    if bad:
        print(f"[q4_rows] {len(bad)} kernels failed their check or did not run: {', '.join(bad[:12])}",
              file=sys.stderr)
    return 1 if fatal else 0


if __name__ == "__main__":
    sys.exit(main())
