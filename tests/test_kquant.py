"""kog_dist.formats.kquant: K-quant blocks that gguf's own dequantizer reads back close to the input,
byte for byte what GGML's layout says for values the format holds exactly, and sane on edge rows."""
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

import kog_dist.formats.kquant as kq
from kog_dist.formats.kquant import quantize_k

K = (Q.Q4_K, Q.Q5_K, Q.Q6_K)
# rel-RMS bounds on Gaussian rows (measured: 0.072, 0.036, 0.018): a wrong packing or scale gives ~1
BOUND = {Q.Q4_K: 0.08, Q.Q5_K: 0.04, Q.Q6_K: 0.02}


def rel_rms(r, a, axis=None):
    return np.sqrt(np.mean((r - a) ** 2, axis=axis) / np.mean(a * a, axis=axis))


@pytest.mark.parametrize("qtype", K)
def test_gaussian_rows_round_trip_within_bound(qtype):
    a = np.random.default_rng(1).standard_normal((48, 1024)).astype(np.float32)
    b = quantize_k(a, qtype)
    assert b.dtype == np.uint8 and b.shape == (48, 1024 // 256 * GGML_QUANT_SIZES[qtype][1])
    assert rel_rms(dequantize(b, qtype), a) < BOUND[qtype]


def test_k_quants_beat_the_legacy_types_of_more_bits():
    """Q4_K (4.5 bits a weight) is better than round-to-nearest Q4_1 (5 bits), Q5_K (5.5) than Q5_1 (6),
    as in llama.cpp's tables: the per-sub-block least-squares fit is doing its work."""
    a = np.random.default_rng(3).standard_normal((32, 1024)).astype(np.float32)
    for k, legacy in ((Q.Q4_K, Q.Q4_1), (Q.Q5_K, Q.Q5_1)):
        ours = rel_rms(dequantize(quantize_k(a, k), k), a)
        theirs = rel_rms(dequantize(quantize(a, legacy), legacy), a)
        assert ours < 0.98 * theirs, (k.name, ours, theirs)


def test_scale_search_lowers_the_error(monkeypatch):
    a = np.random.default_rng(4).standard_normal((32, 1024)).astype(np.float32)
    searched = {t: rel_rms(dequantize(quantize_k(a, t), t), a) for t in kq._QKX2}
    monkeypatch.setattr(kq, "_QKX2", {t: (n, r, d, -1) for t, (n, r, d, _) in kq._QKX2.items()})
    for t, e in searched.items():
        plain = rel_rms(dequantize(quantize_k(a, t), t), a)
        assert e < 0.97 * plain, (t.name, e, plain)


def _q4k_or_q5k_block(qtype, d, dmin, ls, lm, q):
    """One block written from GGML's block_q4_K / block_q5_K layout: d, dmin (fp16), 12 bytes of 6-bit
    scales and mins (sub-blocks 4..7 split into low nibbles and two high bits), [qh], qs."""
    sc = bytearray(12)
    for j in range(8):
        if j < 4:
            sc[j] |= ls[j]
            sc[j + 4] |= lm[j]
        else:
            sc[j + 4] = (ls[j] & 0xF) | ((lm[j] & 0xF) << 4)
            sc[j - 4] |= (ls[j] >> 4) << 6
            sc[j] |= (lm[j] >> 4) << 6
    out = bytearray(np.array([d, dmin], np.float16).tobytes()) + sc
    L = [v for sub in q for v in sub]
    if qtype == Q.Q5_K:
        qh = bytearray(32)
        for j in range(8):
            for i in range(32):
                if L[32 * j + i] > 15:
                    qh[i] |= 1 << j
        out += qh
    for c in range(4):
        out += bytes((L[64 * c + i] & 0xF) | ((L[64 * c + 32 + i] & 0xF) << 4) for i in range(32))
    return np.frombuffer(bytes(out), np.uint8)


@pytest.mark.parametrize("qtype", (Q.Q4_K, Q.Q5_K))
def test_hand_made_q4k_q5k_block(qtype):
    """Values the format holds exactly (each sub-block uses its whole range, the largest scale and min
    are 63): gguf decodes the hand-made block to them, and the encoder writes the same bytes."""
    nmax = 15 if qtype == Q.Q4_K else 31
    d, dmin = 2.0 ** -6, 2.0 ** -7
    ls = [63, 1, 17, 40, 16, 31, 63, 50]           # j >= 4 above 15: the high bits are used
    lm = [0, 63, 5, 33, 48, 2, 19, 63]
    rng = np.random.default_rng(5)
    q = [rng.permutation(np.resize(np.arange(nmax + 1), 32)) for _ in range(8)]
    x = np.concatenate([d * ls[j] * q[j] - dmin * lm[j] for j in range(8)]).astype(np.float32)
    block = _q4k_or_q5k_block(qtype, d, dmin, ls, lm, q)
    assert block.size == GGML_QUANT_SIZES[qtype][1]
    assert np.array_equal(dequantize(block[None], qtype)[0], x)
    assert np.array_equal(quantize_k(x[None], qtype)[0], block)


def test_hand_made_q6k_block():
    """block_q6_K: ql (low nibbles: quarters 0/2 and 1/3 of each half share bytes), qh (2 high bits of
    each quarter), 16 int8 scales, fp16 d; values d * sc * (q - 32)."""
    d = 2.0 ** -10
    sc = [-128, 1, 127, -3, 64, -64, 100, 7, -1, 2, 90, -90, 33, 12, -128, 55]
    rng = np.random.default_rng(6)
    q = [rng.permutation(np.resize(np.arange(64), 16)) for _ in range(16)]
    for j in range(16):        # |q - 32| is largest at q = 0: the sub-block's scale is found exactly
        q[j][rng.integers(16)] = 0
    L = np.concatenate(q)
    x = np.concatenate([d * sc[j] * (q[j].astype(np.float64) - 32) for j in range(16)]).astype(np.float32)
    ql, qh = bytearray(128), bytearray(64)
    for h in range(2):
        for i in range(32):
            v = [int(L[128 * h + 32 * k + i]) for k in range(4)]
            ql[64 * h + i] = (v[0] & 0xF) | ((v[2] & 0xF) << 4)
            ql[64 * h + 32 + i] = (v[1] & 0xF) | ((v[3] & 0xF) << 4)
            qh[32 * h + i] = sum((v[k] >> 4) << (2 * k) for k in range(4))
    block = np.frombuffer(bytes(ql + qh + np.array(sc, np.int8).tobytes() + np.float16(d).tobytes()), np.uint8)
    assert block.size == GGML_QUANT_SIZES[Q.Q6_K][1]
    assert np.array_equal(dequantize(block[None], Q.Q6_K)[0], x)
    assert np.array_equal(quantize_k(x[None], Q.Q6_K)[0], block)


@pytest.mark.parametrize("qtype", K)
def test_all_zero_rows_are_zero_blocks(qtype):
    b = quantize_k(np.zeros((3, 512), np.float32), qtype)
    assert not b.any()                                 # what llama.cpp writes: every byte 0
    a = np.zeros((2, 512), np.float32)
    a[1, 256 + 40] = 0.5                               # one block of zeros beside one that is not
    r = dequantize(quantize_k(a, qtype), qtype)
    assert not r[0].any() and not r[1, :256].any() and abs(r[1, 296] - 0.5) < 0.01


@pytest.mark.parametrize("qtype", K)
@pytest.mark.parametrize("c", [0.37, -0.37, 1000.0, -0.02])
def test_constant_rows(qtype, c):
    """Every value at the end of its range. Q6_K's d of a small row is an fp16 subnormal, so the scale
    it keeps is a little short and its largest q clips (the format's limit, llama.cpp's too)."""
    r = dequantize(quantize_k(np.full((2, 256), c, np.float32), qtype), qtype)
    assert np.abs(r - c).max() <= (1e-2 if qtype == Q.Q6_K and abs(c) < 0.1 else 2e-3) * abs(c)


@pytest.mark.parametrize("qtype", K)
def test_one_signed_rows_and_rows_of_many_magnitudes(qtype):
    g = np.random.default_rng(7).standard_normal((12, 512)).astype(np.float32)
    for a in (-np.abs(g), np.abs(g), g * np.logspace(-2, 3, 12, dtype=np.float32)[:, None]):
        b = quantize_k(a, qtype)
        assert rel_rms(dequantize(b, qtype), a, axis=1).max() < BOUND[qtype] * 1.2


@pytest.mark.parametrize("qtype", K)
def test_blocks_are_valid(qtype):
    """d and dmin finite fp16 (clipped at fp16's largest for values past its range), Q4_K / Q5_K's
    d and dmin not negative (their 6-bit scales and mins are unsigned)."""
    g = np.random.default_rng(8).standard_normal((4, 512)).astype(np.float32)
    a = np.concatenate([g, g * 1e9, g * 1e-3])
    b = quantize_k(a, qtype).reshape(-1, GGML_QUANT_SIZES[qtype][1])
    heads = b[:, -2:] if qtype == Q.Q6_K else b[:, :4]
    h = np.ascontiguousarray(heads).view(np.float16).astype(np.float32)
    assert np.isfinite(h).all()
    if qtype != Q.Q6_K:
        assert (h >= 0).all()
    assert np.isfinite(dequantize(b, qtype)).all()


def test_refusals():
    a = np.ones((2, 256), np.float32)
    with pytest.raises(ValueError, match="multiple of 256"):
        quantize_k(np.ones((2, 320), np.float32), Q.Q4_K)
    with pytest.raises(ValueError, match="multiple of 256"):
        quantize_k(np.ones(256, np.float32), Q.Q6_K)
    with pytest.raises(ValueError, match="not Q8_0"):
        quantize_k(a, Q.Q8_0)
    a[1, 3] = np.nan
    with pytest.raises(ValueError, match="non-finite value \\(row 1\\)"):
        quantize_k(a, Q.Q5_K)
