"""CI without a GPU for bench/q4_rows.py (issue 52's matvec microbenchmark): every kernel of its sweep compiles
with nvcc for sm_90 and ptxas reports no spills (skipped where nvcc is not on PATH); the check's arrays decode,
read as the kernels read them, to the matrix of the numpy reference; the fp16 magic numbers of the lop3 form
give the weights exactly. The GPU run itself: `python3 bench/q4_rows.py --out DIR` on a device."""
from __future__ import annotations

import os
import shutil
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import q4_rows as q4  # noqa: E402


def test_sweep_names_are_unique_and_hold_the_monokernels_configurations():
    for s, (M, K, kind) in q4.SHAPES.items():
        cfgs = q4.sweep(s)
        assert len({c.name for c in cfgs}) == len(cfgs)
        nr = 2 if kind == "w13" else 1
        for fmt in ("bf16", "q4_0", "q8_0", "q4_k"):
            assert q4.Cfg("mono", fmt, K, nr, 12 if fmt == "bf16" else 8, 512) in cfgs
        assert all(M % c.nr == 0 and c.smem() <= 227 * 1024 for c in cfgs)
        assert set(q4.sweep(s, quick=True)) <= set(cfgs)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")
def test_every_kernel_compiles_for_sm90_without_spills():
    # the quick sweep in CI (each form and knob once a shape); `python3 bench/q4_rows.py --ptxas` reports all
    cfgs = sorted({c for s in q4.SHAPES for c in q4.sweep(s, quick=True)}, key=lambda c: c.name)
    rep = q4.ptxas_report(cfgs, jobs=2)
    assert set(rep) >= {c.name for c in cfgs}
    spills = {n: r for n, r in rep.items() if r["spill_stores"] or r["spill_loads"]}
    for c in cfgs:   # the record (pytest -s): registers and stack of each kernel
        r = rep[c.name]
        print(f"{c.name:44s} regs {r['regs']:>3} stack {r['stack']:>3} spills {r['spill_stores']}/{r['spill_loads']}")
    assert not spills, spills
    assert all(rep[c.name]["regs"] <= 65536 // (c.nt * c.bps) for c in cfgs)


def _nibbles(q: np.ndarray) -> np.ndarray:
    """[n, 16] bytes of Q4_0's order -> [n, 32] values: byte j = element j (low nibble), j + 16 (high)."""
    return np.concatenate([q & 15, q >> 4], axis=1).astype(np.float64)


def test_check_arrays_decode_to_the_reference_matrix():
    K = 512
    data = q4.check_data(K, np.random.default_rng(1))
    MC = q4.MC
    a, W = data["q4_0"]
    d = a["s"].view(np.float16).astype(np.float64)
    got = (_nibbles(a["q"].reshape(-1, 16)) - 8) * d[:, None]
    assert np.array_equal(got.reshape(MC, K), W)
    aos = a["aos"].reshape(-1, 18)
    assert np.array_equal(aos[:, 2:].reshape(-1), a["q"]) and np.array_equal(aos[:, :2].reshape(-1), a["s"])
    a, W = data["q8_0"]
    d = a["s"].view(np.float16).astype(np.float64)
    got = a["q"].view(np.int8).reshape(-1, 32).astype(np.float64) * d[:, None]
    assert np.array_equal(got.reshape(MC, K), W)
    a, W = data["q4_k"]   # the kernels' arithmetic: (d sc) q - dmin m from the 20-byte record a super-block
    rec = a["s"].reshape(-1, 20)
    dd = rec[:, 0:2].copy().view(np.float16).astype(np.float32)
    dm = rec[:, 2:4].copy().view(np.float16).astype(np.float32)
    sub = rec[:, 4:].reshape(-1, 8, 2).astype(np.float32)
    A, B = dd[:, :, None] * sub[..., :1], dm[:, :, None] * sub[..., 1:]
    got = A * _nibbles(a["q"].reshape(-1, 16)).reshape(-1, 8, 32) - B
    assert np.allclose(got.reshape(MC, K), W, rtol=1e-6, atol=1e-7)
    a, W = data["bf16"]
    assert np.array_equal((a["q"].view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(MC, K), W)


def test_q8_of_x_is_within_half_a_step():
    x = np.random.default_rng(2).standard_normal(1024).astype(np.float32)
    x8 = q4.q8_host(x)
    step = np.repeat(np.abs(x.reshape(-1, 32)).max(axis=1) / 127, 32)
    assert np.all(np.abs(x8 - x) <= 0.5 * step * (1 + 1e-6))


def test_lop3_magic_numbers_give_the_weights():
    """q4_rows.cu chunk_dot, HALF2: (v & 0x000F000F) | 0x64006400 is the fp16 pair 1024 + q, (v & 0x00F000F0) |
    0x64006400 the pair 1024 + 16 q; minus 1032 / times 1/16 minus 72 give Q4_0's q - 8, minus 1024 / minus 64
    Q4_K's q, in fp16 arithmetic (each step exact)."""
    h = lambda bits: np.array([bits], np.uint16).view(np.float16)[0]
    q = np.arange(16, dtype=np.uint16)
    lo = (q | 0x6400).view(np.float16)
    hi = ((q << 4) | 0x6400).view(np.float16)
    assert np.array_equal(lo - h(0x6408), (q.astype(np.float16) - np.float16(8)))
    assert np.array_equal(hi * h(0x2C00) + h(0xD480), (q.astype(np.float16) - np.float16(8)))
    assert np.array_equal(lo - h(0x6400), q.astype(np.float16))
    assert np.array_equal(hi * h(0x2C00) + h(0xD400), q.astype(np.float16))
