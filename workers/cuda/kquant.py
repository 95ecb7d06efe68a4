"""The GGUF K-quants (Q4_K, Q5_K, Q6_K) as the monokernel keeps them (kquant.cuh has the layout): a lossless
re-layout of the file's super-blocks, written for numpy and CuPy alike (`xp`), so a file's blocks are
re-laid on the GPU at load and the same code is checked bit for bit against gguf.quants on the CPU.

A matrix [rows, K] (K a multiple of 256) becomes three byte arrays over its element index: `nib` (K / 2 bytes
a row: the low nibbles, 32-weight chunks in Q4_0's order), `hi` (K / 4 bytes a row: 8 bytes a chunk of the
high bits; Q5_K and Q6_K only) and `rec` (K / 256 * 20 bytes a row: a record a super-block: d (| dmin), a u16
a chunk of its scales). Also the per-tensor mixes that name a storage (`Q4_K_M`, ...) and random blocks."""
from __future__ import annotations

import numpy as np

from kog_dist.formats.gguf_write import use_more_bits   # llama.cpp's layers with more bits

KTYPES = {"Q4_K": 0, "Q5_K": 1, "Q6_K": 2}           # kquant.cuh KT_*
BLOCK_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}  # GGML's super-block of 256 weights
REC = 20                                             # kquant.cuh KREC
MIXES = {"Q4_K_M": ("Q4_K", "Q6_K"), "Q5_K_M": ("Q5_K", "Q6_K")}
MATRIX_FIELDS = ("attention.wq", "attention.wk", "attention.wv", "attention.wo", "feed_forward.w13",
                 "feed_forward.w2")                  # the 4-bit fields of p.kt's word, in order


def parse(name: str) -> tuple[str, ...] | None:
    """A storage name of the K-quants -> the types it holds, or None: "Q4_K", "Q6_K", "Q4_K_M" (llama.cpp's
    mix: Q4_K, with Q6_K where it puts more bits), or a file's set "Q4_K+Q6_K"."""
    n = str(name).upper()
    if n in MIXES:
        return MIXES[n]
    parts = tuple(sorted(set(n.split("+")), key=list(KTYPES).index)) if all(
        p in KTYPES for p in n.split("+")) else None
    return parts


def type_mask(name: str) -> int:
    return sum(1 << KTYPES[t] for t in parse(name))


def bytes_per_weight(t: str) -> float:
    """Bytes streamed a weight of type t in this layout (the file's: 144 / 176 / 210 per 256)."""
    return 0.5 + (0.25 if t != "Q4_K" else 0.0) + REC / 256


def layer_types(name: str, i: int, n: int) -> dict[str, str]:
    """The type of each matrix field of layer i of n for a storage name: a mix as llama.cpp's quantizer makes
    it (attn_v and ffn_down Q6_K in the use_more_bits layers), a single type everywhere, a file's set: its
    first type (random weights only; a file's own types are read from it)."""
    n_ = str(name).upper()
    if n_ in MIXES:
        low, high = MIXES[n_]
        more = use_more_bits(i, n)
        return {f: (high if more and f in ("attention.wv", "feed_forward.w2") else low) for f in MATRIX_FIELDS}
    return {f: parse(name)[0] for f in MATRIX_FIELDS}


def type_word(types: dict[str, str]) -> int:
    return sum(KTYPES[types[f]] << (4 * j) for j, f in enumerate(MATRIX_FIELDS))


def _scale_min(xp, s):
    """gguf.quants.Q4_K.get_scale_min on [n, 12] bytes -> 6-bit scales and mins [n, 8]."""
    d, m, md = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = xp.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=1)
    mn = xp.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=1)
    return sc, mn


def _pack_nibbles(xp, q):
    """q [n, 8, 32] values 0..15 -> [n, 8, 16]: byte j = element j | element j + 16 << 4."""
    return (q[..., :16] | (q[..., 16:] << 4)).astype(xp.uint8)


def _bits_word(xp, h, bits):
    """High parts h [n, 8, 32] (bits wide each) -> their bytes [n, 8, 8] (kquant.cuh's p.wh)."""
    n = h.shape[0]
    lo = h[..., :16].reshape(n, 8, 4, 4).astype(xp.uint8)   # [word q][byte k]: element 4q + k
    hh = h[..., 16:].reshape(n, 8, 4, 4).astype(xp.uint8)   # element 16 + 4q + k
    out = xp.zeros((n, 8, 8), xp.uint8)
    if bits == 1:
        for q in range(4):
            out[..., :4] |= (lo[:, :, q, :] << q) | (hh[:, :, q, :] << (4 + q))
    else:
        for q in range(4):
            a, s = q >> 1, (q & 1) * 4
            out[..., 4 * a:4 * a + 4] |= (lo[:, :, q, :] << s) | (hh[:, :, q, :] << (s + 2))
    return out


def relayout(blocks, t: str, xp=np):
    """A K-quant tensor's bytes as GGUF stores them ([rows, K / 256 * block bytes], or flat) -> (nib, hi, rec)
    flat uint8 arrays in element order (hi None for Q4_K)."""
    b = xp.ascontiguousarray(blocks).reshape(-1, BLOCK_BYTES[t])
    n = b.shape[0]
    rec = xp.zeros((n, REC), xp.uint8)
    hi = None
    if t in ("Q4_K", "Q5_K"):
        rec[:, 0:4] = b[:, 0:4]                               # fp16 d, fp16 dmin
        sc, mn = _scale_min(xp, b[:, 4:16])
        rec[:, 4:] = xp.stack([sc, mn], axis=2).reshape(n, 16)   # u16 a chunk: scale | min << 8
        qs = b[:, 16:144] if t == "Q4_K" else b[:, 48:176]
        q4 = xp.stack([qs.reshape(n, 4, 32) & 0x0F, qs.reshape(n, 4, 32) >> 4], axis=2).reshape(n, 8, 32)
        if t == "Q5_K":
            qh = b[:, 16:48]
            h = xp.stack([(qh >> j) & 1 for j in range(8)], axis=1)   # [n, 8 (chunk), 32]
            hi = _bits_word(xp, h, 1)
    else:
        ql, qh, scales = b[:, 0:128], b[:, 128:192], b[:, 192:208]
        rec[:, 0:2] = b[:, 208:210]                           # fp16 d
        rec[:, 4:] = scales                                   # u16 a chunk: its two int8 scales
        q4 = xp.stack([ql.reshape(n, 2, 64) & 0x0F, ql.reshape(n, 2, 64) >> 4], axis=2).reshape(n, 8, 32)
        h = xp.stack([(qh.reshape(n, 2, 32) >> (2 * u)) & 3 for u in range(4)], axis=2).reshape(n, 8, 32)
        hi = _bits_word(xp, h, 2)
    nib = _pack_nibbles(xp, q4)
    return nib.reshape(-1), None if hi is None else hi.reshape(-1), rec.reshape(-1)


def decode(nib: np.ndarray, hi, rec: np.ndarray, t: str) -> np.ndarray:
    """The float32 values of this layout (kquant.cuh kq_piece; numpy's float32 operations one by one, as
    gguf.quants computes them)."""
    n = rec.size // REC
    r = rec.reshape(n, REC)
    by = nib.reshape(n, 8, 16)
    q = np.concatenate([by & 0x0F, by >> 4], axis=2).astype(np.int32)    # [n, 8, 32]
    if t != "Q4_K":
        h = hi.reshape(n, 8, 8)
        j = np.arange(32)
        k, w, half = j & 3, (j & 15) >> 2, (j >= 16).astype(np.int32)
        if t == "Q5_K":
            bits = (h[:, :, k].astype(np.int32) >> (w + 4 * half)) & 1
        else:
            bits = (h[:, :, 4 * (w >> 1) + k].astype(np.int32) >> (4 * (w & 1) + 2 * half)) & 3
        q = q | (bits << 4)
    d = r[:, 0:2].copy().view(np.float16).astype(np.float32)              # [n, 1]
    sub = r[:, 4:].reshape(n, 8, 2)
    if t == "Q6_K":
        sc = sub.view(np.int8).astype(np.float32)                          # [n, 8, 2]
        ds = (d[:, :, None] * sc)                                          # [n, 8, 2]
        ds = np.repeat(ds, 16, axis=2)                                     # [n, 8, 32]
        return (ds * (q - 32).astype(np.float32)).reshape(-1)
    dmin = r[:, 2:4].copy().view(np.float16).astype(np.float32)
    ds = d[:, :, None] * sub[..., 0].astype(np.float32)[..., None]
    dm = dmin[:, :, None] * sub[..., 1].astype(np.float32)[..., None]
    return (ds * q.astype(np.float32) - dm).reshape(-1)


def random_blocks(n: int, t: str, std: float, xp=np, seed: int = 0):
    """n random super-blocks of type t in GGUF's bytes, their weights of about `std` around 0: random quants,
    6-bit scales in [8, 15] (Q6_K: int8 in [4, 15]) and d (and dmin) chosen for the spread. For benchmarks
    and test files; every byte pattern of the quants is a valid block."""
    if xp is np:
        gen = np.random.default_rng(seed)
        ints = lambda lo, hi, size: gen.integers(lo, hi, size=size, dtype=np.int32)
    else:   # CuPy's legacy generator: its default_rng has no integers() in every version
        rs = xp.random.RandomState(seed % (1 << 32))
        ints = lambda lo, hi, size: rs.randint(lo, hi, size=size, dtype=xp.int32)
    b = ints(0, 256, (n, BLOCK_BYTES[t])).astype(xp.uint8)
    sc = (8 + ints(0, 8, (n, 8))).astype(xp.uint8)
    if t == "Q6_K":
        d = xp.full((n, 1), std / (18.5 * 10.0), xp.float32).astype(xp.float16)
        b[:, 192:208] = (4 + ints(0, 12, (n, 16))).astype(xp.uint8)
        b[:, 208:210] = d.view(xp.uint8)
        return b
    half = 7.5 if t == "Q4_K" else 15.5
    d = xp.full((n, 1), std / ((4.6 if t == "Q4_K" else 9.2) * 11.7), xp.float32)
    b[:, 0:2] = d.astype(xp.float16).view(xp.uint8)
    b[:, 2:4] = (d * half).astype(xp.float16).view(xp.uint8)
    # scales = mins (y = d sc (q - half)): bytes 0-3 and 4-7 hold scale / min 0-3 in 6 bits, 8-11 the low
    # nibbles of 4-7 (their top bits in the top 2 bits of 0-7)
    s = xp.zeros((n, 12), xp.uint8)
    s[:, 0:4] = sc[:, 0:4]
    s[:, 4:8] = sc[:, 0:4]
    s[:, 8:12] = (sc[:, 4:8] & 0x0F) | ((sc[:, 4:8] & 0x0F) << 4)
    b[:, 4:16] = s
    return b
