"""The prefill of quantized layer matrices (issue 52): its dequantizers (prefill.cu q_to_w / q_to_f32 for Q8_0,
Q4_0, Q4_1 and kq_to_w / kq_to_f32 for the K-quants, a thread for each 8 weights) write bit for bit the numpy
engine's values (kog_dist.formats.quant.dequantize_rows, gguf's dequantizer), fp32 and bf16 alike, from any
first block and with grids smaller than the work; and after a 600-token prompt the greedy ids are the numpy
engine's on small quantized GGUF models, with the prompt in one chunk or in chunks of 256, the dequantization
overlapped on a second stream or not, and on a backend that prefilled another prompt before; and in the bf16
production storage the overlapped prefill leaves the KV cache bit for bit as the one-stream one. Runs on the GPU
machine: `pytest -m gpu tests/test_cuda_prefill_quant.py` (bench/ttft_gpu.sh runs it); skips without CuPy."""
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
from gguf.quants import quantize  # noqa: E402

from hf_reference import k_quant_mix, random_hf_tensors, tiny_hf_config, write_gguf  # noqa: E402
from kog_dist.checkpoint import bf16_bits  # noqa: E402
from kog_dist.formats.quant import dequantize_rows  # noqa: E402
from workers.cuda import kquant  # noqa: E402

# one lane, every matrix of whole K super-blocks (D, H * hd, F multiples of 256), room for 600 + GEN positions
CFG = dict(hidden_size=256, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
           intermediate_size=512, vocab_size=512, max_position_embeddings=1024)
QUANT = ("Q8_0", "Q4_0", "Q4_1")
MIXES = {"Q4_K_M": "Q4_K+Q6_K", "Q5_K_M": "Q5_K+Q6_K"}   # file's mix -> the storage it runs as (default_dtype)
PROMPT_LEN, GEN = 600, 32
BUILDS = [q + b for q in QUANT + tuple(MIXES.values()) for b in ("", ":F32")]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """name -> (GGUF path, the storage it runs as with fp32 embedding / head / cache): the layer matrices of
    Q8_0 / Q4_0 / Q4_1 (gguf.quants from random floats) or of llama.cpp's Q4_K_M / Q5_K_M mixes."""
    c = tiny_hf_config(**CFG)
    d = tmp_path_factory.mktemp("prefill_quant")
    out = {}
    for seed, name in enumerate(QUANT + tuple(MIXES)):
        if name in MIXES:
            qtype, stored = k_quant_mix(c, name.lower()), MIXES[name]
        else:
            qt = GGMLQuantizationType[name]
            qtype, stored = (lambda hf, qt=qt: qt if hf.startswith("model.layers.") else None), name
        path = str(d / f"{name}.gguf")
        write_gguf(path, c, random_hf_tensors(c, seed=100 + seed), qtype=qtype)
        out[name] = (path, stored)
    return out


@pytest.fixture(scope="module")
def cfg(models):
    from kog_dist.formats import open_model
    src = open_model(models["Q8_0"][0], progress=False)
    try:
        return src.cfg
    finally:
        src.close()


@pytest.fixture(scope="module", autouse=True)
def _prebuild(cfg):
    from workers.cuda.backend import CudaBackend  # noqa: F401 - import errors before the builds
    from workers.cuda.build import prebuild
    prebuild([(cfg, d) for d in BUILDS])


def _build(cfg, dtype):
    from workers.cuda.build import build
    return build(cfg, dtype, progress=False)


def _check(what, fn, n_pieces, args, exp, first):
    """The kernel over n_pieces pieces (8 weights each; its output is the last argument) with a full grid and
    with 3 blocks (a grid-stride loop of many rounds): each time its bits equal exp's (a numpy array of the
    output's type). first: the block / chunk of the output's first weight, for the message."""
    out = args[-1]
    iv = np.uint32 if out.dtype.itemsize == 4 else np.uint16
    exp = np.asarray(exp, out.dtype)
    for grid in ((n_pieces + 255) // 256, 3):
        out[...] = 0
        fn((grid,), (256,), args)
        got = cp.asnumpy(out)
        bad = np.nonzero(got.view(iv) != exp.view(iv))[0]
        assert bad.size == 0, (f"{what}, grid {grid}: {bad.size} of {got.size} weights differ, first at "
                               f"{bad[0]} (block {first + bad[0] // 32}): {got[bad[0]]} vs {exp[bad[0]]}")


@pytest.mark.parametrize("base", ["F32", "BF16"])
@pytest.mark.parametrize("q", QUANT)
def test_dequantizer_writes_the_numpy_engines_values(cfg, q, base):
    """q_to_w (the storage type: fp32 or bf16, the GEMM's operand) and q_to_f32 of blocks [b0, b0 + nb) of
    gguf.quants' blocks split into the device's quants and scales: bit for bit dequantize_rows' floats
    (bf16: their round to nearest even, kog_dist.checkpoint.bf16_bits), from an odd first block, a count
    that is no multiple of the 1024 blocks a full 256-thread block of the grid covers, and edge blocks (all
    zero, the largest magnitude negative, constant: Q4_1's d = 0)."""
    k = _build(cfg, q if base == "BF16" else f"{q}:F32")
    qt = GGMLQuantizationType[q]
    rng = np.random.default_rng(52)
    nb = 3001
    x = (rng.standard_normal((nb, 32)) * rng.uniform(0.01, 3.0, (nb, 1))).astype(np.float32)
    x[0] = 0.0
    x[1, 5] = -np.abs(x[1]).max() * 2
    x[2, :] = 1.5
    blocks = quantize(x, qt).reshape(nb, -1)                    # gguf's bytes: scale(s), then quants
    ref = dequantize_rows(blocks, qt).reshape(nb, 32)           # what the numpy engine computes with
    sb = 4 if q == "Q4_1" else 2
    dq = cp.asarray(np.ascontiguousarray(blocks[:, sb:]).reshape(-1))
    ds = cp.asarray(np.ascontiguousarray(blocks[:, :sb]).reshape(-1).view(np.uint16))
    b0, n = 7, nb - 7 - 2
    want = ref[b0:b0 + n].reshape(-1)
    wt = np.float32 if base == "F32" else np.uint16
    for name, dt, exp in (("q_to_w", wt, want if base == "F32" else bf16_bits(want)), ("q_to_f32", np.float32, want)):
        out = cp.empty(n * 32, dt)
        _check(f"{q} {base} {name}", k.fn[name], n * 4, (dq, ds, np.int64(b0), np.int64(n), out), exp, b0)


@pytest.mark.parametrize("base", ["F32", "BF16"])
@pytest.mark.parametrize("t", ["Q4_K", "Q5_K", "Q6_K"])
def test_kquant_dequantizer_writes_the_numpy_engines_values(cfg, t, base):
    """kq_to_w / kq_to_f32 of chunks [c0, c0 + nc) of random super-blocks re-laid on the device
    (kquant.relayout): bit for bit dequantize_rows' floats (bf16: rounded to nearest even), from a chunk
    inside a super-block. The build's mix holds Q4_K and Q6_K; the dequantizer takes any type at run time."""
    k = _build(cfg, "Q4_K+Q6_K" + (":F32" if base == "F32" else ""))
    nsb = 97
    b = kquant.random_blocks(nsb, t, 0.02, seed=52)
    ref = dequantize_rows(b, GGMLQuantizationType[t]).reshape(-1)
    nib, hi, rec = kquant.relayout(cp.asarray(b), t, xp=cp)
    c0, nc = 8 * 3 + 5, 8 * nsb - 8 * 3 - 5 - 3
    want = ref[c0 * 32:(c0 + nc) * 32]
    wt = np.float32 if base == "F32" else np.uint16
    for name, dt, exp in (("kq_to_w", wt, want if base == "F32" else bf16_bits(want)),
                          ("kq_to_f32", np.float32, want)):
        out = cp.empty(nc * 32, dt)
        args = (nib, nib if hi is None else hi, rec, np.int32(kquant.KTYPES[t]), np.int64(c0), np.int64(nc), out)
        _check(f"{t} {base} {name}", k.fn[name], nc * 4, args, exp, c0)


def _prompt(seed, n=PROMPT_LEN):
    return [int(x) for x in np.random.default_rng(seed).integers(3, CFG["vocab_size"], n)]


def _numpy_greedy(path, prompt, n=GEN):
    from kog_dist.checkpoint import Model
    from kog_dist.engine import ReferenceEngine
    m = Model(path, progress=False)
    eng = ReferenceEngine(m.cfg, m.weights, m.embed)
    logits, toks, margins = eng.prefill(prompt), [], []
    for _ in range(n):
        s = np.sort(logits)
        margins.append(float(s[-1] - s[-2]))
        toks.append(int(np.argmax(logits)))
        logits = eng.step(toks[-1])
    return toks, margins


@pytest.mark.parametrize("name", list(QUANT) + list(MIXES))
def test_long_prompt_greedy_matches_numpy_engine(models, name):
    """A 600-token prompt prefilled through the dequantized layers (fp32 embedding, head and cache: exact
    storage), then 32 greedy tokens: the numpy engine's ids on the file's dequantized values, for the prompt
    in one chunk with the dequantization overlapped, in chunks of 256 (overlapped and not), and on a backend
    that prefilled another prompt first (its scratch buffers reused)."""
    from kog_dist.backend import RunCommand
    from kog_dist.formats import open_model
    from workers.cuda.backend import CudaBackend
    path, stored = models[name]
    prompt = _prompt(1)
    ref, margins = _numpy_greedy(path, prompt)
    src = open_model(path, progress=False)
    try:
        for chunk, overlap, warm in ((2048, True, False), (256, True, True), (256, False, False)):
            b = CudaBackend(src, max_seq=PROMPT_LEN + GEN + 8, num_slots=1, progress=False, dtype=stored + ":F32",
                            prefill_chunk=chunk)
            try:
                assert b.dw.qtype and (b.dw.kq == (name in MIXES))
                b.prefill.overlap = overlap
                if warm:
                    b.run(RunCommand(slot=0, keep=0, append=_prompt(2, 300), max_new_tokens=2), ignore_eos=True)
                r = b.run(RunCommand(slot=0, keep=0, append=prompt, max_new_tokens=GEN), ignore_eos=True)
            finally:
                b.close()
            got = r.token_ids
            if got != ref:
                i = next(j for j, (a, c) in enumerate(zip(got, ref)) if a != c)
                pytest.fail(f"{name} (chunks of {chunk}, overlap {overlap}, after another prompt {warm}): first "
                            f"difference at token {i}: {got[i]} vs {ref[i]} (reference margin {margins[i]:.2e})")
    finally:
        src.close()


@pytest.mark.parametrize("name", list(QUANT) + list(MIXES))
def test_overlapped_prefill_writes_the_serial_ones_cache(models, name):
    """The production storage (bf16 embedding, head and cache; the GEMMs on bf16 dequantized weights): a
    600-token prefill with the dequantization overlapped on the second stream leaves the KV cache bit for bit
    as the one-stream prefill does (no layer read a buffer while the next layer was written into it), in one
    chunk and in chunks of 256, each on a backend that prefilled before."""
    from kog_dist.backend import RunCommand
    from kog_dist.formats import open_model
    from workers.cuda.backend import CudaBackend
    path, stored = models[name]
    src = open_model(path, progress=False)
    b = CudaBackend(src, max_seq=PROMPT_LEN + 8, num_slots=1, progress=False, dtype=stored)
    try:
        assert b.dw.base == "BF16" and b.dw.qtype
        caches = {}
        for chunk in (2048, 256):
            for overlap in (True, False, True):
                b.prefill.max_chunk, b.prefill.overlap = chunk, overlap
                r = b.run(RunCommand(slot=0, keep=0, append=_prompt(1), max_new_tokens=0))
                assert r.cached == PROMPT_LEN
                kc, vc = b.caches[0]
                got = (cp.asnumpy(kc), cp.asnumpy(vc))
                first = caches.setdefault(chunk, got)
                for a, e, what in zip(got, first, "kv"):
                    assert np.array_equal(a, e), (f"{name}, chunks of {chunk}: the {what} cache of the prefill with "
                                                  f"overlap {overlap} differs at {np.argwhere(a != e)[:4].tolist()}")
    finally:
        b.close()
        src.close()


def test_the_long_prompt_matters(models):
    """The ids above depend on the prompt's early positions (what the prefill's KV cache holds): its first
    half changed, the numpy engine's ids differ, so a prefill that wrote wrong keys or values would fail."""
    path = models["Q4_0"][0]
    a, _ = _numpy_greedy(path, _prompt(1))
    p = _prompt(1)
    b, _ = _numpy_greedy(path, _prompt(3, PROMPT_LEN // 2) + p[PROMPT_LEN // 2:])
    assert a != b
