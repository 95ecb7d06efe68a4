"""`kog checkpoint tiny`: named shapes, GGUF files in every storage type (llama.cpp's K-quant mixes
among them) that decode as the HF-style reference does on what gguf's reader finds in them, the fast
fill of big models, streamed writing with a progress bar, and one-line refusals."""
import dataclasses
import json
import os

import gguf
import numpy as np
import pytest

import kog_dist.tiny as tiny
from kog_cli.cli import main as kog
from kog_dist.checkpoint import Model
from kog_dist.config import rope_inv_freq
from kog_dist.formats import open_model
from kog_dist.shapes import shape_config
from kog_dist.tokenizer import load_tokenizer

from hf_reference import HFLlama, gguf_name, k_quant_mix, random_hf_tensors, read_gguf_as_hf
from test_engine_llama import NEW, PROMPT, assert_same, run_ours

SMALL = dict(num_hidden_layers=8, hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=512, vocab_size=300)


def hf_config(cfg, model_type="llama") -> dict:
    """The HF config.json of a one-lane config, written out by hand for the reference."""
    c = dict(model_type=model_type, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_hidden_layers,
             num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.kv_heads,
             intermediate_size=cfg.intermediate_size, vocab_size=cfg.vocab_size, rms_norm_eps=cfg.norm_eps,
             rope_theta=cfg.rope_theta, max_position_embeddings=cfg.max_position_embeddings,
             tie_word_embeddings=cfg.tie_word_embeddings)
    if cfg.rope_scaling:
        c["rope_scaling"] = dict(cfg.rope_scaling)
    return c


def check_against_reference(path, cfg, model_type="llama"):
    c = hf_config(cfg, model_type)
    src = open_model(path)
    m = Model(src, progress=False)
    assert_same(run_ours(m), HFLlama(c, read_gguf_as_hf(path, c)).greedy(PROMPT, NEW))
    m.close()
    return open_model(path)


def types_of(path):
    return {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}


@pytest.mark.parametrize("dtype", ["q4_k_m", "q5_k_m", "q6_k", "bf16", "q8_0"])
def test_gguf_of_a_llama3_shape_runs_as_the_reference(tmp_path, dtype):
    """llama3.1-8b cut down: llama3 rope scaling travels as rope_freqs, which the reference replaces by
    HF's own llama3 formula on the config."""
    path = str(tmp_path / "m.gguf")
    cfg = tiny.write_tiny_checkpoint(path, shape="llama3.1-8b", fmt="gguf", dtype=dtype, **SMALL)
    assert cfg.rope_scaling["rope_type"] == "llama3" and not cfg.tie_word_embeddings
    assert (cfg.bos_token_id, cfg.eos_token_ids) == (1, (2,))   # the shape's ids lie past this vocabulary
    types = types_of(path)
    assert types["rope_freqs.weight"] == "F32" and types["blk.0.attn_norm.weight"] == "F32"
    if dtype.endswith("_m"):      # the same choices as the reference's independent copy of llama.cpp's rule
        mix = k_quant_mix(hf_config(cfg), dtype)
        for hf in random_hf_tensors(hf_config(cfg)):
            if hf.endswith("weight") and "norm" not in hf:
                assert types[gguf_name(hf)] == mix(hf).name, hf
    else:
        assert types["blk.3.ffn_down.weight"] == dtype.upper()
    src = check_against_reference(path, cfg)
    assert src.cfg.rope_scaling["rope_type"] == "factors"       # (positions this short barely feel it)
    assert np.allclose(rope_inv_freq(src.cfg), rope_inv_freq(cfg), rtol=1e-6, atol=0)
    assert not np.allclose(rope_inv_freq(src.cfg), rope_inv_freq(dataclasses.replace(cfg, rope_scaling=None)))


def test_gguf_of_a_qwen2_shape_runs_as_the_reference(tmp_path):
    path = str(tmp_path / "q.gguf")
    cfg = tiny.write_tiny_checkpoint(path, shape="qwen2.5-7b", fmt="gguf", dtype="f16", seed=3, **SMALL)
    assert types_of(path)["blk.2.attn_k.bias"] == "F32"
    src = check_against_reference(path, cfg, "qwen2")
    assert src.cfg.attention_bias and src.cfg.rope_theta == 1e6 and np.isclose(src.cfg.norm_eps, 1e-6)


def test_gguf_tokenizer_writes_text_as_bytes(tmp_path):
    path = str(tmp_path / "t.gguf")
    tiny.write_tiny_checkpoint(path, fmt="gguf", num_lanes=1, vocab_size=300)
    tok = load_tokenizer(open_model(path))
    assert tok.encode("ab", add_bos=False) == [ord("a") + 3, ord("b") + 3]
    assert tok.decode(tok.encode("héllo wörld", add_bos=False)) == "héllo wörld"


def test_named_8b_shapes_have_the_published_sizes():
    """Parameter counts of the public checkpoints: a wrong D, F, V, head or bias count changes them."""
    n = {k: sum(int(np.prod(s)) for s in tiny.expected_tensors(shape_config(k)).values())
         for k in ("llama3.1-8b", "qwen2.5-7b")}
    assert n == {"llama3.1-8b": 8_030_261_248, "qwen2.5-7b": 7_615_616_512}
    q = shape_config("qwen2.5-7b")
    assert (q.head_dim, q.kv_heads, q.attention_bias, q.eos_token_ids) == (128, 4, True, (151645,))


@pytest.mark.parametrize("dtype", ["q4_k_m", "bf16"])
def test_fast_fill_makes_valid_seeded_models(tmp_path, monkeypatch, dtype):
    """Big models are filled from a pool (forced here for a small one): the same file for the same
    seed, another for another seed, values of the intended scale, and a model that still decodes as
    the reference does on what the file holds."""
    monkeypatch.setattr(tiny, "FAST_PARAMS", 0)
    monkeypatch.setattr(tiny, "POOL", 1 << 16)
    paths = [str(tmp_path / f"{i}.gguf") for i in range(3)]
    for p, seed in zip(paths, (5, 5, 6)):
        cfg = tiny.write_tiny_checkpoint(p, fmt="gguf", dtype=dtype, seed=seed, shape="llama3.1-8b", **SMALL)
    data = [open(p, "rb").read() for p in paths]
    assert data[0] == data[1] and data[0] != data[2]
    src = check_against_reference(paths[0], cfg)
    w = src.tensor("model.layers.4.feed_forward.w3.weight")[0]
    assert abs(w.std() * np.sqrt(256) - 1) < 0.1 and abs(w.mean()) < 0.01
    assert not np.array_equal(w, src.tensor("model.layers.5.feed_forward.w3.weight")[0])
    n = src.tensor("model.norm.weight")
    assert abs(n.mean() - 1) < 0.05 and 0.05 < n.std() < 0.15


def test_laneformer_fast_fill_and_progress(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(tiny, "FAST_PARAMS", 0)
    d = str(tmp_path / "lf")
    tiny.write_tiny_checkpoint(d, dtype="BF16", shards=2, shape="qwen2.5-7b", progress=True, **SMALL)
    err = capsys.readouterr().err
    assert "writing weights: done" in err and "100%" in err
    with open(os.path.join(d, "config.json")) as f:
        c = json.load(f)
    assert c["attention_bias"] and c["torch_dtype"] == "bfloat16"
    m = open_model(d)
    e = m.tensor("model.tok_embeddings.weight")
    assert e.shape == (300, 256) and abs(e.std() - 1) < 0.05
    ids, _ = run_ours(Model(m, progress=False))
    assert len(ids) == NEW


@pytest.mark.parametrize("argv, msg", [
    (["--format", "gguf", "--lanes", "2"], "one-lane model"),
    (["--dtype", "q4_k"], "needs --format gguf"),
    (["--shape", "llama9"], "unknown --shape 'llama9'"),
    (["--format", "gguf", "--window", "8"], "no sliding window"),
    (["--format", "gguf", "--shards", "2"], "one file"),
    (["--format", "gguf", "--dtype", "q8_0", "--hidden", "96", "--heads", "4", "--kv-heads", "4", "--ffn", "100"],
     "multiple of Q8_0's 32"),
])
def test_refusals_are_one_line(tmp_path, capsys, argv, msg):
    out = str(tmp_path / "x.gguf")
    assert kog(["checkpoint", "tiny", out, *argv]) == 2
    err = capsys.readouterr().err
    assert msg in err and len(err.strip().splitlines()) == 1 and not os.path.exists(out)


def test_cli_writes_a_k_quant_gguf(tmp_path, capsys):
    out = str(tmp_path / "m.gguf")
    assert kog(["checkpoint", "tiny", out, "--format", "gguf", "--dtype", "q4_k_m", "--shape", "llama3.1-8b",
                "--layers", "2", "--hidden", "256", "--heads", "2", "--kv-heads", "1", "--ffn", "512",
                "--vocab", "512"]) == 0
    assert "q4_k_m, GGUF" in capsys.readouterr().out
    t = types_of(out)
    # of 2 layers llama.cpp's use_more_bits picks the last only
    assert [t[n] for n in ("token_embd.weight", "output.weight", "blk.0.attn_v.weight", "blk.1.attn_v.weight",
                           "blk.1.ffn_down.weight", "blk.1.ffn_up.weight")] == \
        ["Q4_K", "Q6_K", "Q4_K", "Q6_K", "Q6_K", "Q4_K"]


def test_bf16_bits_in_slices_rounds_as_the_whole_array():
    """The sliced bf16_bits (big tensors) against the plain formula, across slice boundaries, on every
    kind of float32 bit pattern, ties to even among them."""
    from kog_dist.checkpoint import bf16_bits
    rng = np.random.default_rng(0)
    u = rng.integers(0, 2 ** 32, size=(3, 1_000_003), dtype=np.uint64).astype(np.uint32)
    u[0, :4] = [0x3F808000, 0x3F818000, 0x7F800000, 0xFF7FFFFF]      # ties down and up, inf, -max
    x = u.view(np.float32)
    w = u.astype(np.uint64)
    assert np.array_equal(bf16_bits(x), ((w + 0x7FFF + ((w >> 16) & 1)) >> 16).astype(np.uint16))
    assert list(bf16_bits(x[0, :3])) == [0x3F80, 0x3F82, 0x7F80]
