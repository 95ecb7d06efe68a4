"""The GGUF K-quants kept as stored on the GPU (CFG_QW 4; workers/cuda/kquant.cuh): the device re-layout and
dequantizer against gguf.quants bit for bit, and the monokernel's greedy ids on K-quant GGUF files (a
Q4_K_M-like mix of Q4_K and Q6_K, and Q5_K with Q6_K) against the numpy engine on the file's dequantized
values. Runs on the GPU machine (`pytest -m gpu tests/test_cuda_kquant.py`); skips without CuPy or a GPU."""
from __future__ import annotations

import numpy as np
import pytest

try:
    import cupy as cp
    HAVE_GPU = cp.cuda.runtime.getDeviceCount() > 0
except Exception:  # noqa: BLE001 - no CuPy, no driver, no device
    cp, HAVE_GPU = None, False

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAVE_GPU, reason="needs CuPy and a CUDA GPU")]

from gguf import GGMLQuantizationType  # noqa: E402
from gguf.quants import dequantize  # noqa: E402

from hf_reference import gguf_name, random_hf_tensors, tiny_hf_config, write_gguf  # noqa: E402
from workers.cuda import kquant  # noqa: E402

CFG = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
           intermediate_size=512, vocab_size=512, max_position_embeddings=512)
PROMPT = [1, 17, 33, 250, 9, 77, 401, 12, 5, 300, 41, 42, 100, 7, 8, 9]
GEN = 64
HF_MATS = {"self_attn.q_proj.weight": "attention.wq", "self_attn.k_proj.weight": "attention.wk",
           "self_attn.v_proj.weight": "attention.wv", "self_attn.o_proj.weight": "attention.wo",
           "mlp.gate_proj.weight": "feed_forward.w13", "mlp.up_proj.weight": "feed_forward.w13",
           "mlp.down_proj.weight": "feed_forward.w2"}


def write_kquant_gguf(path: str, mix: str, seed: int = 0) -> str:
    """A tiny llama GGUF whose layer matrices are random super-blocks of the mix's types (kquant.layer_types:
    llama.cpp's Q4_K_M / Q5_K_M choice), the rest float32."""
    c = tiny_hf_config(**CFG)
    t = random_hf_tensors(c, seed)
    extra = {}
    n = c["num_hidden_layers"]
    for i in range(n):
        types = kquant.layer_types(mix, i, n)
        for j, (suffix, field) in enumerate(HF_MATS.items()):
            name = f"model.layers.{i}.{suffix}"
            rows, cols = t.pop(name).shape
            scale = 3.0 if "q_proj" in suffix or "k_proj" in suffix else 1.0
            b = kquant.random_blocks(rows * cols // 256, types[field], scale / np.sqrt(cols), seed=seed * 97 + i * 8 + j)
            extra[gguf_name(name)] = (b.reshape(rows, -1), GGMLQuantizationType[types[field]])
    write_gguf(path, c, t, extra_tensors=extra)
    return path


def _cfg():
    from kog_dist.config import LaneformerConfig
    return LaneformerConfig.from_dict(dict(model_type="laneformer_tp", num_lanes=1, broadcast_delay=1,
                                           tie_word_embeddings=True, **CFG))


@pytest.fixture(scope="module", autouse=True)
def _prebuild():
    from workers.cuda.build import prebuild
    from workers.cuda.backend import CudaBackend  # noqa: F401 - import errors before the builds
    import dataclasses
    untied = dataclasses.replace(_cfg(), tie_word_embeddings=False)
    prebuild([(_cfg(), d) for d in ("Q4_K", "Q5_K", "Q6_K")]
             + [(untied, d) for d in ("Q4_K+Q6_K:F32", "Q5_K+Q6_K:F32", "Q4_K_M", "Q6_K")])


@pytest.mark.parametrize("t", ["Q4_K", "Q5_K", "Q6_K"])
def test_device_relayout_and_dequantizer_are_gguf_bit_for_bit(t):
    from workers.cuda.build import build
    b = kquant.random_blocks(64, t, 0.02, seed=3)
    nib, hi, rec = kquant.relayout(b, t)
    dn, dh, dr = kquant.relayout(cp.asarray(b), t, xp=cp)
    assert np.array_equal(cp.asnumpy(dn), nib) and np.array_equal(cp.asnumpy(dr), rec)
    assert hi is None or np.array_equal(cp.asnumpy(dh), hi)
    k = build(_cfg(), t, progress=False)
    out = cp.empty(64 * 256, cp.float32)
    k.fn["kq_to_f32"]((64,), (256,), (dn, dn if dh is None else dh, dr, np.int32(kquant.KTYPES[t]), np.int64(0),
                                      np.int64(64 * 8), out))
    ref = dequantize(b, GGMLQuantizationType[t]).reshape(-1)
    np.testing.assert_array_equal(cp.asnumpy(out).view(np.uint32), ref.view(np.uint32))


def _numpy_greedy(path):
    from kog_dist.checkpoint import Model
    from kog_dist.engine import ReferenceEngine
    m = Model(path, progress=False)
    eng = ReferenceEngine(m.cfg, m.weights, m.embed)
    logits, toks, margins = eng.prefill(PROMPT), [], []
    for _ in range(GEN):
        s = np.sort(logits)
        margins.append(float(s[-1] - s[-2]))
        toks.append(int(np.argmax(logits)))
        logits = eng.step(toks[-1])
    return toks, margins


@pytest.mark.parametrize("mix,stored", [("Q4_K_M", "Q4_K+Q6_K"), ("Q5_K_M", "Q5_K+Q6_K")])
def test_kquant_gguf_greedy_matches_numpy_engine(tmp_path, mix, stored):
    """A K-quant file runs as it is stored (the default storage names its types) and its greedy ids are the
    numpy engine's on gguf's dequantized values; the base type F32 keeps embedding and KV cache exact."""
    from kog_dist.backend import RunCommand
    from kog_dist.formats import open_model
    from workers.cuda.backend import CudaBackend
    from workers.cuda.weights import default_dtype
    path = write_kquant_gguf(str(tmp_path / f"{mix}.gguf"), mix)
    src = open_model(path, progress=False)
    assert default_dtype(src) == stored
    ref, margins = _numpy_greedy(path)
    b = CudaBackend(src, max_seq=256, num_slots=1, progress=False, dtype=stored + ":F32")
    try:
        assert b.dw.kq and b.dw.ktypes[3]["attention.wv"] == "Q6_K" and b.dw.ktypes[1]["attention.wv"] != "Q6_K"
        r = b.run(RunCommand(append=list(PROMPT), max_new_tokens=GEN), ignore_eos=True)
    finally:
        b.close()
        src.close()
    got = r.token_ids
    if got != ref:
        i = next(k for k, (a, c) in enumerate(zip(got, ref)) if a != c)
        pytest.fail(f"{mix}: first difference at token {i}: {got[i]} vs {ref[i]} (margin {margins[i]:.2e})")


def test_random_kquant_weights_decode(tmp_path):
    """`kog bench --shape ... --dtype q4_k_m`'s weights: random super-blocks re-laid on the device decode, the
    same ids twice, and a different mix gives different ids."""
    from kog_dist.backend import RunCommand
    from workers.cuda.backend import CudaBackend
    from workers.cuda.build import build
    from workers.cuda.weights import random_weights
    import dataclasses
    cfg = dataclasses.replace(_cfg(), tie_word_embeddings=False)   # a tied N(0, 1) embedding repeats its input
    ids = {}
    for dt in ("Q4_K_M", "Q6_K", "Q4_K_M"):
        k = build(cfg, dt, progress=False)
        b = CudaBackend(weights=random_weights(cfg, dt, k), max_seq=256, num_slots=1, progress=False)
        try:
            r = b.run(RunCommand(append=list(PROMPT), max_new_tokens=32), ignore_eos=True)
        finally:
            b.close()
        ids.setdefault(dt, []).append(r.token_ids)
    assert ids["Q4_K_M"][0] == ids["Q4_K_M"][1] and ids["Q6_K"][0] != ids["Q4_K_M"][0]
