"""The cuda backend's K-quant layout (workers/cuda/kquant.py, kquant.cuh): the re-layout of GGUF's Q4_K /
Q5_K / Q6_K super-blocks is lossless (its values are gguf.quants' bit for bit), the per-tensor mixes follow
llama.cpp's quantizer, and the builds' defines and byte counts follow from the storage name. CPU only."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from workers.cuda import kquant

TYPES = ("Q4_K", "Q5_K", "Q6_K")


def _blocks(t: str, n: int, seed: int) -> np.ndarray:
    """n super-blocks of random bytes (every quant, scale and min pattern) with finite d / dmin."""
    rng = np.random.default_rng(seed)
    b = rng.integers(0, 256, size=(n, kquant.BLOCK_BYTES[t]), dtype=np.uint8)
    d = rng.uniform(-0.05, 0.05, size=(n, 2)).astype(np.float16).view(np.uint8)
    if t == "Q6_K":
        b[:, 208:210] = d[:, 0:2]
    else:
        b[:, 0:4] = d
    return b


@pytest.mark.parametrize("t", TYPES)
def test_relayout_is_gguf_bit_for_bit(t):
    b = _blocks(t, 3 * 7, seed=TYPES.index(t))
    ref = dequantize(b.reshape(3, -1), GGMLQuantizationType[t]).reshape(-1)
    nib, hi, rec = kquant.relayout(b.reshape(3, -1), t)
    assert nib.size == ref.size // 2 and rec.size == ref.size // 256 * kquant.REC
    assert (hi is None) == (t == "Q4_K") and (hi is None or hi.size == ref.size // 4)
    got = kquant.decode(nib, hi, rec, t)
    np.testing.assert_array_equal(got.view(np.uint32), ref.view(np.uint32))


def test_relayout_puts_a_chunk_in_q4_0_order():
    """Byte j of a chunk holds element j (low nibble) and j + 16 (high): a Q4_K super-block whose quants are
    q(e) = e % 16 for sub-block 0 reads back in that order."""
    b = _blocks("Q4_K", 1, seed=9)
    qs = np.zeros(128, np.uint8)
    qs[:32] = np.arange(32) % 16            # group 0 low nibbles: sub-block 0, elements 0..31
    b[0, 16:144] = qs
    nib, _, _ = kquant.relayout(b, "Q4_K")
    assert list(nib[:16] & 15) == list(range(16)) and list(nib[:16] >> 4) == list(range(16))


@pytest.mark.parametrize("t", TYPES)
def test_random_blocks_have_the_asked_spread(t):
    v = dequantize(kquant.random_blocks(2000, t, 0.02), GGMLQuantizationType[t])
    assert np.isfinite(v).all() and abs(v.mean()) < 2e-3 and 0.015 < v.std() < 0.025


def test_q4_k_m_mix_is_llama_cpps():
    """attn_v and ffn_down get Q6_K in the first and last eighth and every third layer between (llama.cpp's
    use_more_bits), everything else Q4_K."""
    n = 32
    more = [i for i in range(n) if kquant.layer_types("Q4_K_M", i, n)["attention.wv"] == "Q6_K"]
    assert more == [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]
    t = kquant.layer_types("Q4_K_M", 0, n)
    assert t["feed_forward.w2"] == "Q6_K" and t["attention.wq"] == t["feed_forward.w13"] == "Q4_K"
    assert kquant.layer_types("Q5_K_M", 5, n)["feed_forward.w2"] == "Q5_K"
    assert set(kquant.layer_types("Q6_K", 5, n).values()) == {"Q6_K"}
    w = kquant.type_word(t)
    assert [(w >> (4 * j)) & 15 for j in range(6)] == [0, 0, 2, 0, 0, 2]


def test_storage_names_and_bytes():
    from kog_dist.shapes import shape_config
    from workers.cuda.build import defines
    from workers.cuda.weights import field_elems, split_dtype, streamed_bytes
    assert split_dtype("Q4_K_M") == ("Q4_K_M", "BF16") and split_dtype("q4_k+q6_k:f32") == ("Q4_K+Q6_K", "F32")
    assert kquant.parse("Q6_K+Q4_K") == ("Q4_K", "Q6_K") and kquant.parse("Q4_K+Q8_0") is None
    with pytest.raises(ValueError, match="unknown storage"):
        split_dtype("Q3_K")
    cfg = shape_config("llama3.2-1b")
    d = defines(cfg, "Q4_K_M", 132)
    assert d["CFG_QW"] == 4 and d["CFG_KT_MASK"] == 0b101 and d.get("CFG_PFS", 0) == 0
    assert defines(cfg, "Q4_0", 132)["CFG_QW"] == 2 and "CFG_KT_MASK" not in defines(cfg, "Q4_0", 132)
    fe, lm = field_elems(cfg), cfg.vocab_size * cfg.hidden_size * 2
    q4 = sum(fe.values()) * cfg.num_hidden_layers * (0.5 + 20 / 256)
    assert streamed_bytes(cfg, "Q4_K") == int(q4) + lm
    mixed = streamed_bytes(cfg, "Q4_K_M") - lm
    n6 = sum(kquant.use_more_bits(i, 16) for i in range(16))
    assert mixed == int(q4 + n6 * (fe["attention.wv"] + fe["feed_forward.w2"]) * 0.25)


def test_cpu_backend_refuses_k_storage_in_one_line(tmp_path):
    from kog_dist.tiny import write_tiny_checkpoint
    from workers.factory import make_backend
    write_tiny_checkpoint(str(tmp_path), num_lanes=1, broadcast_delay=1)
    with pytest.raises(ValueError, match="cpu backend stores"):
        make_backend("cpu", str(tmp_path), dtype="q4_k_m")
