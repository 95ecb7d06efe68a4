"""Encoders for GGML's K-quants (Q4_K, Q5_K, Q6_K), which gguf-py can only decode: float32 rows to
blocks in GGML's exact byte layout, by the method of llama.cpp's quantize_row_q{4,5,6}_K_ref (no
importance matrix), vectorized over every sub-block at once.

Q4_K / Q5_K: a super-block of 256 is 8 sub-blocks of 32 with x ~ d*sc*q - dmin*m (q 4 / 5 bits,
sc and m 6 bits, d and dmin fp16). Each sub-block's (scale, min) is the best weighted least-squares fit
over a sweep of trial scales (make_qkx2_quants); the 6-bit sc and m are those against the super-block's
largest, and the q are then rounded again against the stored scales.
Q6_K: 16 sub-blocks of 16 with x ~ d*sc*(q-32) (q 6 bits, sc int8); each sub-block's scale is the best
of 19 trial scales weighted by x^2 (make_qx_quants), sc against the largest, q rounded again.
"""
from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

QK_K = 256
GROUP_MAX_EPS = 1e-15
FP16_MAX = 65504.0
# qtype -> (nmax, rmin, rdelta, nstep) of make_qkx2_quants in quantize_row_q{4,5}_K_ref
_QKX2 = {GGMLQuantizationType.Q4_K: (15, -1.0, 0.1, 20), GGMLQuantizationType.Q5_K: (31, -0.5, 0.1, 15)}
K_TYPES = (GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q6_K)
# Super-blocks per step: a few MB of temporaries stay in cache (and memory stays flat for big tensors).
CHUNK_BLOCKS = 1024


def quantize_k(a: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """float32 [rows, cols] (cols a multiple of 256) -> uint8 [rows, cols // 256 * type_size]."""
    qtype = GGMLQuantizationType(qtype)
    if qtype not in K_TYPES:
        raise ValueError(f"quantize_k encodes {', '.join(t.name for t in K_TYPES)}, not {qtype.name}")
    a = np.asarray(a, dtype=np.float32)
    if a.ndim != 2 or a.shape[1] % QK_K:
        raise ValueError(f"{qtype.name} needs a 2-D array with rows of a multiple of {QK_K} values, "
                         f"got shape {list(a.shape)}")
    _, tsize = GGML_QUANT_SIZES[qtype]
    rows, cols = a.shape
    out = np.empty((rows, cols // QK_K * tsize), np.uint8)
    x = np.ascontiguousarray(a).reshape(-1, QK_K)
    ob = out.reshape(-1, tsize)
    enc = _q6_k if qtype == GGMLQuantizationType.Q6_K else _q45_k
    with np.errstate(all="ignore"):
        for s in range(0, x.shape[0], CHUNK_BLOCKS):
            xs = x[s:s + CHUNK_BLOCKS]
            if not np.isfinite(xs).all():
                raise ValueError(f"{qtype.name}: the input holds a non-finite value (row "
                                 f"{(s + int(np.argmin(np.isfinite(xs).all(1)))) * QK_K // cols})")
            ob[s:s + CHUNK_BLOCKS] = enc(xs, qtype)
    return out


def _fp16(v: np.ndarray) -> np.ndarray:
    return np.clip(v, -FP16_MAX, FP16_MAX).astype(np.float16)


def _rnd(v: np.ndarray, lo: float, hi: float) -> np.ndarray:
    return np.clip(np.rint(v), lo, hi)


def _dot(a, b):
    """Row sums of a*b for [m, n] arrays, in float64 (einsum: several times faster than (a*b).sum(-1))."""
    return np.einsum("ij,ij->i", a, b).astype(np.float64)


def _qkx2(x, w, nmax, rmin, rdelta, nstep):
    """make_qkx2_quants over sub-blocks x [m, n] with weights w: (scale, the_min), x ~ scale*L - the_min.
    The weighted error of a fit is formed from the sums (no pass over the values per trial)."""
    mn = np.minimum(x.min(-1), 0).astype(np.float64)
    mx = x.max(-1).astype(np.float64)
    wx = w * x
    sw, sx, sxx = w.sum(-1, dtype=np.float64), wx.sum(-1, dtype=np.float64), _dot(wx, x)

    def fit(iscale, m):
        iscale = iscale.astype(np.float32)[:, None]
        lv = _rnd(x * iscale - (m.astype(np.float32)[:, None] * iscale), 0, nmax)
        return _dot(w, lv), _dot(w * lv, lv), _dot(wx, lv)

    def err(s, m, sl, sl2, sxl):     # sum w (s*l + m - x)^2
        return s * s * sl2 + 2 * s * m * sl - 2 * s * sxl + m * m * sw - 2 * m * sx + sxx

    flat = mx <= mn
    iscale = np.where(flat, 0.0, nmax / np.where(flat, 1.0, mx - mn))
    scale = np.where(flat, 0.0, 1 / np.where(flat, 1.0, iscale))
    best = err(scale, mn, *fit(iscale, mn))
    for i in range(nstep + 1):
        iscale = (rmin + rdelta * i + nmax) / (mx - mn)   # mn is the best fit so far, as in llama.cpp
        sl, sl2, sxl = fit(iscale, mn)
        D = sw * sl2 - sl * sl
        ts = (sw * sxl - sx * sl) / D
        tm = (sl2 * sx - sl * sxl) / D
        pos = tm > 0
        tm = np.where(pos, 0.0, tm)
        ts = np.where(pos, sxl / sl2, ts)
        e = err(ts, tm, sl, sl2, sxl)
        better = (D > 0) & (e < best) & ~flat
        best = np.where(better, e, best)
        scale = np.where(better, ts, scale)
        mn = np.where(better, tm, mn)
    return scale, 0.0 - mn                # + 0.0: a min of 0 is +0, never -0


def _q45_k(x: np.ndarray, qtype) -> np.ndarray:
    nmax, rmin, rdelta, nstep = _QKX2[qtype]
    n = x.shape[0]
    xs = x.reshape(n, 8, 32)
    x2 = xs.reshape(n * 8, 32)
    av = np.sqrt(_dot(x2, x2) / 32).astype(np.float32)[:, None]
    scales, mins = _qkx2(x2, av + np.abs(x2), nmax, rmin, rdelta, nstep)
    scales, mins = scales.reshape(n, 8), mins.reshape(n, 8)
    max_s, max_m = np.maximum(scales.max(-1), 0), np.maximum(mins.max(-1), 0)
    inv_s = np.where(max_s > 0, 63 / np.where(max_s > 0, max_s, 1), 0)
    inv_m = np.where(max_m > 0, 63 / np.where(max_m > 0, max_m, 1), 0)
    ls = _rnd(inv_s[:, None] * scales, 0, 63).astype(np.uint8)
    lm = _rnd(inv_m[:, None] * mins, 0, 63).astype(np.uint8)
    d, dmin = _fp16(max_s / 63), _fp16(max_m / 63)
    dj = d.astype(np.float32)[:, None] * ls
    mj = dmin.astype(np.float32)[:, None] * lm
    q = _rnd((xs + mj[..., None]) / np.where(dj == 0, 1, dj)[..., None], 0, nmax)
    q = np.where(dj[..., None] == 0, 0, q).astype(np.uint8)          # [n, 8, 32]

    sc = np.empty((n, 12), np.uint8)
    sc[:, 0:4] = ls[:, :4] | ((ls[:, 4:] >> 4) << 6)
    sc[:, 4:8] = lm[:, :4] | ((lm[:, 4:] >> 4) << 6)
    sc[:, 8:12] = (ls[:, 4:] & 0xF) | ((lm[:, 4:] & 0xF) << 4)
    pairs = q.reshape(n, 4, 2, 32)                                   # sub-blocks 2c, 2c+1 share bytes
    qs = ((pairs[:, :, 0] & 0xF) | ((pairs[:, :, 1] & 0xF) << 4)).reshape(n, 128)
    parts = [d.reshape(n, 1).view(np.uint8), dmin.reshape(n, 1).view(np.uint8), sc]
    if qtype == GGMLQuantizationType.Q5_K:
        bits = (q >> 4).astype(np.uint8) << np.arange(8, dtype=np.uint8)[None, :, None]
        parts.append(np.bitwise_or.reduce(bits, axis=1))             # qh[l]: bit j = high bit of sub-block j
    parts.append(qs)
    return np.concatenate(parts, axis=1)


def _qx(x: np.ndarray, nmax: int) -> np.ndarray:
    """make_qx_quants(rmse_type 1, no importance weights) over sub-blocks x [m, n]: the scale with
    x ~ scale * l, l in [-nmax, nmax - 1]."""
    idx = np.abs(x).argmax(-1)
    mx = np.take_along_axis(x, idx[:, None], -1)[:, 0].astype(np.float64)
    zero = np.abs(mx) < GROUP_MAX_EPS
    mx = np.where(zero, 1.0, mx)
    w = x * x
    wx = w * x

    def sums(iscale):
        lv = _rnd(iscale.astype(np.float32)[:, None] * x, -nmax, nmax - 1)
        return _dot(wx, lv), _dot(w * lv, lv)

    slx, sl2 = sums(-nmax / mx)
    scale = np.where(sl2 > 0, slx / np.where(sl2 > 0, sl2, 1), 0.0)
    best = scale * slx
    for i in range(-9, 10):
        if i == 0:
            continue
        slx, sl2 = sums(-(nmax + 0.1 * i) / mx)
        better = (sl2 > 0) & (slx * slx > best * sl2)
        scale = np.where(better, slx / np.where(better, sl2, 1), scale)
        best = np.where(better, scale * slx, best)
    return np.where(zero, 0.0, scale)


def _q6_k(x: np.ndarray, qtype) -> np.ndarray:
    n = x.shape[0]
    xs = x.reshape(n, 16, 16)
    scales = _qx(x.reshape(n * 16, 16), 32).reshape(n, 16)
    idx = np.abs(scales).argmax(-1)
    max_scale = np.take_along_axis(scales, idx[:, None], -1)[:, 0]
    zero = np.abs(max_scale) < GROUP_MAX_EPS
    iscale = np.where(zero, 0.0, -128 / np.where(zero, 1.0, max_scale))
    d = _fp16(np.where(zero, 0.0, 1 / np.where(zero, 1.0, iscale)))
    sc = _rnd(iscale[:, None] * scales, -128, 127).astype(np.int8)
    dj = d.astype(np.float32)[:, None] * sc
    q = _rnd(xs / np.where(dj == 0, 1, dj)[..., None], -32, 31)
    q = (np.where(dj[..., None] == 0, 0, q) + 32).astype(np.uint8).reshape(n, 2, 4, 32)
    ql = ((q[:, :, 0:2] & 0xF) | ((q[:, :, 2:4] & 0xF) << 4)).reshape(n, 128)
    qh = np.bitwise_or.reduce((q >> 4) << np.array([0, 2, 4, 6], np.uint8)[None, None, :, None], axis=2)
    out = np.concatenate([ql, qh.reshape(n, 64), sc.view(np.uint8), d.reshape(n, 1).view(np.uint8)], axis=1)
    out[zero] = 0                                                    # as llama.cpp writes an all-zero block
    return out
