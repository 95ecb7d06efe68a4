"""open_model on Hugging Face Llama-family directories and Laneformer directories: config mapping,
names, the rotate-half -> interleaved permutation, dtypes, and one-line refusals."""
import json
import os

import numpy as np
import pytest

from kog_dist.checkpoint import CheckpointReader, Model, bf16_bits, save_safetensors, to_float32
from kog_dist.config import LaneformerConfig, rope_inv_freq
from kog_dist.formats import FormatError, open_model
from kog_dist.tiny import write_tiny_checkpoint

from hf_reference import hf_inv_freq, random_hf_tensors, tiny_hf_config, write_hf_dir


def hf_dir(tmp_path, name="m", shards=1, **kw):
    c = tiny_hf_config(**kw)
    t = random_hf_tensors(c, 1)
    return write_hf_dir(str(tmp_path / name), c, t, shards), c, t


def test_config_mapping_llama(tmp_path):
    d, c, _ = hf_dir(tmp_path, eos_token_id=[2, 3], rms_norm_eps=3e-6, rope_theta=5e5,
                     max_position_embeddings=123)
    src = open_model(d)
    cfg = src.cfg
    assert (src.kind, src.path, src.model_dir, src.name, src.gguf_fields) == ("hf", d, d, "m", {})
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.kv_heads,
            cfg.intermediate_size, cfg.vocab_size, cfg.num_lanes) == (64, 3, 4, 2, 128, 96, 1)
    assert (cfg.norm_eps, cfg.rope_theta, cfg.max_position_embeddings) == (3e-6, 5e5, 123)
    assert cfg.eos_token_ids == (2, 3) and cfg.bos_token_ids == (1,)
    assert not cfg.tie_word_embeddings and not cfg.attention_bias and cfg.sliding_window is None
    assert cfg.head_dim == 16 and cfg.head_dim_override is None
    assert src.has("lm_head.weight") and src.quant_type("lm_head.weight") is None
    assert "model.layers.2.feed_forward.w2.weight" in src.names()
    src.close()


@pytest.mark.parametrize("kw,window,n", [
    (dict(model_type="mistral", sliding_window=7), 7, 3),
    (dict(model_type="mistral", sliding_window=None), None, 0),
    (dict(model_type="qwen2", use_sliding_window=False, sliding_window=7), None, 0),
    (dict(model_type="qwen2", use_sliding_window=True, sliding_window=7, max_window_layers=1), 7, -2),
])
def test_sliding_window_mapping(tmp_path, kw, window, n):
    d, _, _ = hf_dir(tmp_path, **kw)
    cfg = open_model(d).cfg
    assert (cfg.sliding_window, cfg.sliding_window_n_layers) == (window, n)
    if window and n == 3:
        assert all(cfg.is_sliding(i) for i in range(3))


def test_permutation_and_shapes(tmp_path):
    """q/k rows (and biases) within each head: new row 2k = old row k, new 2k+1 = old row k + hd/2;
    v, o and the rest unchanged; one leading lane axis on lane-first tensors."""
    d, c, t = hf_dir(tmp_path, model_type="qwen2", head_dim=24)
    src = open_model(d)
    hd, H, KV = 24, 4, 2
    assert src.cfg.head_dim == 24 and src.cfg.head_dim_override == 24
    p = "model.layers.1."
    q = src.tensor(p + "attention.wq.weight")
    assert q.shape == (1, H * hd, 64) and src.tensor(p + "attention.wo.weight").shape == (1, 64, H * hd)
    hq = t[p + "self_attn.q_proj.weight"]
    for h in range(H):
        for k in range(hd // 2):
            assert np.array_equal(q[0, h * hd + 2 * k], hq[h * hd + k])
            assert np.array_equal(q[0, h * hd + 2 * k + 1], hq[h * hd + k + hd // 2])
    bk, hbk = src.tensor(p + "attention.bk.bias")[0], t[p + "self_attn.k_proj.bias"]
    assert bk.shape == (KV * hd,)
    assert np.array_equal(bk[0::2].reshape(KV, -1), hbk.reshape(KV, hd)[:, :hd // 2])
    assert np.array_equal(bk[1::2].reshape(KV, -1), hbk.reshape(KV, hd)[:, hd // 2:])
    assert np.array_equal(src.tensor(p + "attention.bv.bias")[0], t[p + "self_attn.v_proj.bias"])
    assert np.array_equal(src.tensor(p + "attention.wv.weight")[0], t[p + "self_attn.v_proj.weight"])
    assert np.array_equal(src.tensor(p + "attention_norm.weight"), t[p + "input_layernorm.weight"])
    rows = np.array([5, 0, 5, 95])
    assert np.array_equal(src.tensor("model.tok_embeddings.weight", rows=rows),
                          t["model.embed_tokens.weight"][rows])
    assert src.tensor(p + "feed_forward.w1.weight", lanes=range(0, 1)).shape == (1, 128, 64)


def test_bf16_and_fp16_storage(tmp_path):
    c = tiny_hf_config()
    t = random_hf_tensors(c, 2)
    d = str(tmp_path / "bf16")
    os.makedirs(d)
    json.dump(c, open(os.path.join(d, "config.json"), "w"))
    save_safetensors(os.path.join(d, "model.safetensors"), {n: (a, "BF16") for n, a in t.items()})
    src = open_model(d)
    name = "model.layers.0.attention.wk.weight"
    bits, dt = src.raw(name)
    assert dt == "BF16" and bits.dtype == np.uint16 and src.dtype(name) == "BF16"
    want = to_float32(bf16_bits(t["model.layers.0.self_attn.k_proj.weight"]), "BF16")
    assert np.array_equal(src.tensor(name)[0, 1], want[8])        # pair (0, 8) of head 0, hd 16
    emb = src.tensor("model.tok_embeddings.weight", rows=np.array([3, 1]))
    assert np.allclose(emb, t["model.embed_tokens.weight"][[3, 1]], rtol=1e-2, atol=1e-2)
    Model(src, progress=False).close()


def test_sharded_with_index(tmp_path):
    d, c, t = hf_dir(tmp_path, shards=3)
    assert os.path.isfile(os.path.join(d, "model.safetensors.index.json"))
    m = Model(d, progress=False)                     # a path still works (opened with open_model)
    assert m.src.kind == "hf" and m.dir == d
    assert np.array_equal(m.weights["model.layers.2.feed_forward.w2.weight"][0],
                          t["model.layers.2.mlp.down_proj.weight"])
    m.close()


@pytest.mark.parametrize("scaling", [
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 8192},
    {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 16},
    None,
])
@pytest.mark.parametrize("theta,hd", [(500000.0, 64), (10000.0, 16), (1e6, 128)])
def test_rope_inv_freq_equals_hf_init(scaling, theta, hd):
    c = dict(hidden_size=hd * 4, num_attention_heads=4, rope_theta=theta, rope_scaling=scaling)
    cfg = LaneformerConfig(hidden_size=hd * 4, num_attention_heads=4, rope_theta=theta,
                           rope_scaling=scaling).validate()
    np.testing.assert_allclose(rope_inv_freq(cfg), hf_inv_freq(c), rtol=1e-12)


def test_laneformer_directory_is_its_own_source(tmp_path):
    d = str(tmp_path / "lf")
    write_tiny_checkpoint(d)
    src = open_model(d)
    assert isinstance(src, CheckpointReader)
    assert (src.kind, src.path, src.model_dir, src.gguf_fields) == ("laneformer", d, d, {})
    assert src.has("lm_head.weight") and not src.has("nope") and src.quant_type("lm_head.weight") is None
    assert src.cfg.num_lanes == 4
    src.close()


def _refused(path, *words):
    with pytest.raises(FormatError) as e:
        open_model(path)
    msg = str(e.value)
    assert "\n" not in msg and all(w in msg for w in words), msg
    assert isinstance(e.value, ValueError)


def test_refusals(tmp_path):
    d, c, t = hf_dir(tmp_path, "gpt2")
    c["model_type"] = "gpt2"
    json.dump(c, open(os.path.join(d, "config.json"), "w"))
    _refused(d, "'gpt2'", "llama", "mistral", "qwen2", ".gguf")
    bad = ((dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), ("'yarn'", "llama3")),
           (dict(hidden_act="gelu"), ("'gelu'",)),
           (dict(attention_bias=True), ("attention_bias",)))
    for j, (kw, words) in enumerate(bad):
        d2, _, _ = hf_dir(tmp_path, f"bad{j}", **kw)
        _refused(d2, *words)
    # a tensor missing, named in HF terms
    t2 = dict(t)
    del t2["model.layers.1.mlp.up_proj.weight"]
    c["model_type"] = "llama"
    _refused(write_hf_dir(str(tmp_path / "missing"), c, t2), "model.layers.1.mlp.up_proj.weight", "missing")
    # lm_head absent without tie_word_embeddings
    t3 = {k: v for k, v in t.items() if k != "lm_head.weight"}
    _refused(write_hf_dir(str(tmp_path / "nohead"), c, t3), "lm_head.weight")
    # an unexpected bias would be silently dropped: refused
    t4 = dict(t, **{"model.layers.0.self_attn.o_proj.bias": np.zeros(64, np.float32)})
    _refused(write_hf_dir(str(tmp_path / "obias"), c, t4), "o_proj.bias")
    # a wrong shape
    t5 = dict(t, **{"model.norm.weight": np.zeros(63, np.float32)})
    _refused(write_hf_dir(str(tmp_path / "shape"), c, t5), "model.norm.weight", "[63]", "[64]")
    # a truncated shard
    d6 = write_hf_dir(str(tmp_path / "trunc"), c, t)
    f = os.path.join(d6, "model.safetensors")
    open(f, "r+b").truncate(os.path.getsize(f) // 2)
    _refused(d6, "model.safetensors")
    # not a model at all
    _refused(str(tmp_path / "absent"), "does not exist")
    os.makedirs(tmp_path / "empty")
    _refused(str(tmp_path / "empty"), "config.json")
    (tmp_path / "x.bin").write_bytes(b"hello")
    _refused(str(tmp_path / "x.bin"), "not a model file")
    (tmp_path / "y.gguf").write_bytes(b"hello")
    _refused(str(tmp_path / "y.gguf"), "not a GGUF file")
