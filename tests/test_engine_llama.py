"""The numpy engine on Llama-family checkpoints (HF directories and GGUF files, through open_model and
Model) against tests/hf_reference.py: a plain-numpy forward computed the way HF's modeling code does
(rotate-half RoPE, HF names), reading the HF tensors directly. A wrong pair permutation, rope scaling,
bias or window fails these."""
import dataclasses

import numpy as np
import pytest

from kog_dist.checkpoint import Model
from kog_dist.engine import ReferenceEngine
from kog_dist.formats import open_model

from hf_reference import HFLlama, random_hf_tensors, tiny_hf_config, write_hf_dir

PROMPT = [5, 17, 3, 44, 9, 71, 23, 60, 11, 38]
NEW = 6
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}
# Each names what it covers: GQA 2 and 1, tied and untied, sharded, qwen2 biases, mistral's window,
# qwen2's window on the last layers, llama3 rope scaling, head_dim != D / H, fp16 and bf16 storage.
VARIANTS = {
    "llama": dict(),
    "llama_mha_tied": dict(num_key_value_heads=4, tie_word_embeddings=True),
    "llama_sharded": dict(_shards=3),
    "llama3_scaling": dict(rope_scaling=LLAMA3, rope_theta=500000.0),
    "llama_head_dim": dict(head_dim=24),
    "qwen2_bias_tied": dict(model_type="qwen2", tie_word_embeddings=True, _shards=2),
    "qwen2_window": dict(model_type="qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=1),
    "mistral_window": dict(model_type="mistral", sliding_window=3),
    "llama_fp16": dict(_dtype=np.float16),
}


def make_hf(tmp_path, name, seed=0):
    v = dict(VARIANTS[name])
    shards, dtype = v.pop("_shards", 1), v.pop("_dtype", np.float32)
    c = tiny_hf_config(v.pop("model_type", "llama"), **v)
    t = {k: a.astype(dtype) for k, a in random_hf_tensors(c, seed).items()}
    return write_hf_dir(str(tmp_path / name), c, t, shards), c, t


def run_ours(model, prompt=PROMPT, n=NEW, cfg=None):
    """Greedy ids and the logits each was chosen from, prefill then one step per token."""
    cfg = cfg or model.cfg
    e = ReferenceEngine(cfg, model.weights, model.embed)
    lg = e.prefill(prompt)
    ids, logits = [], []
    for _ in range(n):
        logits.append(lg)
        ids.append(int(np.argmax(lg)))
        lg = e.step(ids[-1])
    return ids, logits


def assert_same(ours, ref, tol=2e-4):
    (ids, lg), (rids, rlg) = ours, ref
    for a, b in zip(lg, rlg):
        assert np.max(np.abs(a - b)) <= tol * max(1.0, np.max(np.abs(b))), np.max(np.abs(a - b))
    assert ids == rids


@pytest.mark.parametrize("name", list(VARIANTS))
def test_hf_matches_reference(tmp_path, name):
    d, c, t = make_hf(tmp_path, name)
    m = Model(open_model(d), progress=False)
    assert m.src.kind == "hf" and m.cfg.num_lanes == 1
    assert_same(run_ours(m), HFLlama(c, t).greedy(PROMPT, NEW))
    m.close()


def test_reference_is_sensitive_to_scaling_and_windows(tmp_path):
    """The comparisons above could not pass with rope scaling or the window ignored."""
    for name, change in (("llama3_scaling", dict(rope_scaling=None)),
                         ("mistral_window", dict(sliding_window=None, sliding_window_n_layers=0)),
                         ("qwen2_window", dict(sliding_window=None, sliding_window_n_layers=0))):
        d, c, t = make_hf(tmp_path, name)
        m = Model(d, progress=False)
        _, lg = run_ours(m, cfg=dataclasses.replace(m.cfg, **change))
        _, rlg = HFLlama(c, t).greedy(PROMPT, NEW)
        assert max(np.max(np.abs(a - b)) for a, b in zip(lg, rlg)) > 1e-2, name
        m.close()


def test_reference_is_sensitive_to_the_permutation_and_biases(tmp_path):
    """Unpermuted q/k (HF rows served as they are) or dropped biases give other logits."""
    d, c, t = make_hf(tmp_path, "qwen2_bias_tied")
    m = Model(d, progress=False)
    _, rlg = HFLlama(c, t).greedy(PROMPT, NEW)
    w = m.weights
    saved = {k: w[k] for k in w if ".attention.w" in k or ".attention.b" in k}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        for x, proj in (("q", "q_proj"), ("k", "k_proj")):
            w[p + f"attention.w{x}.weight"] = t[p + f"self_attn.{proj}.weight"][None]
            w[p + f"attention.b{x}.bias"] = t[p + f"self_attn.{proj}.bias"][None]
    _, lg = run_ours(m)
    assert max(np.max(np.abs(a - b)) for a, b in zip(lg, rlg)) > 1e-2
    w.update(saved)
    _, lg = run_ours(m, cfg=dataclasses.replace(m.cfg, attention_bias=False))
    assert max(np.max(np.abs(a - b)) for a, b in zip(lg, rlg)) > 1e-2
    w.update(saved)
    assert_same(run_ours(m), HFLlama(c, t).greedy(PROMPT, NEW))
    m.close()


def test_chunked_prefill_and_truncate_on_a_hf_model(tmp_path):
    d, c, t = make_hf(tmp_path, "qwen2_window")
    m = Model(d, progress=False)
    ref = HFLlama(c, t).forward(PROMPT)
    e = ReferenceEngine(m.cfg, m.weights, m.embed, prefill_chunk=3)
    assert np.allclose(e.prefill(PROMPT), ref[-1], atol=2e-4 * np.abs(ref).max())
    e.truncate(4)
    assert np.allclose(e.prefill(PROMPT[4:7]), ref[6], atol=2e-4 * np.abs(ref).max())
    m.close()


def test_convert_hf_and_gguf_to_laneformer(tmp_path):
    """convert() writes a Laneformer directory that computes the same function, with the tokenizer
    files beside it; it refuses to write into a directory that holds something."""
    from hf_reference import write_gguf
    from kog_dist.formats import FormatError
    from kog_dist.formats.convert import convert

    d, c, t = make_hf(tmp_path, "llama_head_dim")
    with open(f"{d}/tokenizer_config.json", "w") as f:
        f.write('{"add_bos_token": false}')
    out = convert(d, str(tmp_path / "lf"), shard_bytes=40_000)
    assert out["kind"] == "hf" and len(out["files"]) > 1 and "tokenizer_config.json" in out["tokenizer"]
    lf = open_model(str(tmp_path / "lf"))
    assert lf.kind == "laneformer" and lf.cfg.head_dim == 24 and lf.cfg.num_lanes == 1
    m = Model(lf, progress=False)
    assert_same(run_ours(m), HFLlama(c, t).greedy(PROMPT, NEW))
    m.close()
    # qwen2 biases in bf16
    d2, c2, t2 = make_hf(tmp_path, "qwen2_bias_tied")
    convert(d2, str(tmp_path / "lf2"), dtype="BF16")
    lf2 = open_model(str(tmp_path / "lf2"))
    assert lf2.cfg.attention_bias and lf2.dtype("model.layers.0.attention.bq.bias") == "BF16"
    hf2 = open_model(d2)
    b = hf2.tensor("model.layers.0.attention.bq.bias")
    assert np.allclose(lf2.tensor("model.layers.0.attention.bq.bias"), b, rtol=1e-2, atol=1e-2)
    # a quantized GGUF: the exact float32 values, llama.cpp's rope factors kept
    from gguf import GGMLQuantizationType as Q
    c3 = tiny_hf_config(rope_scaling=LLAMA3)
    from hf_reference import llama3_rope_factors
    g = str(tmp_path / "q.gguf")
    held = write_gguf(g, c3, random_hf_tensors(c3, 9), lambda n: Q.Q8_0,
                      extra_tensors={"rope_freqs.weight": (llama3_rope_factors(c3), None)})
    convert(g, str(tmp_path / "lf3"))
    m3 = Model(str(tmp_path / "lf3"), progress=False)
    assert m3.cfg.rope_scaling["rope_type"] == "factors"
    assert_same(run_ours(m3), HFLlama(c3, held).greedy(PROMPT, NEW))
    m3.close()
    with pytest.raises(FormatError, match="not an empty directory"):
        convert(d, str(tmp_path / "lf"))
