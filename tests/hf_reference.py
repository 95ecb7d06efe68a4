"""An independent Llama-family forward in plain numpy, computed the way Hugging Face's modeling code
does (HF tensor names, rotate_half RoPE, HF's llama3 rope init, Qwen2 q/k/v biases, Mistral / Qwen2
sliding windows, repeat_kv), in float64, reading HF tensors directly; and writers of tiny random HF
directories and GGUF files for the format tests. Nothing here imports kog_dist, except write_gguf's
K-quant encoder (gguf-py has none); what a file holds is read back with gguf's own dequantizer."""
from __future__ import annotations

import json
import math
import os

import numpy as np
from safetensors.numpy import save_file

# -- the model ---------------------------------------------------------------------------------------


def hf_inv_freq(c: dict) -> np.ndarray:
    """transformers' _compute_default_rope_parameters / _compute_llama3_parameters."""
    D, H = c["hidden_size"], c["num_attention_heads"]
    dim = c.get("head_dim") or D // H
    base = c.get("rope_theta", 10000.0)
    inv_freq = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    rs = c.get("rope_scaling")
    if not rs or rs.get("rope_type", rs.get("type")) in (None, "default"):
        return inv_freq
    assert rs["rope_type"] == "llama3"
    factor, lo, hi = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
    old = rs["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old / lo, old / hi
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * inv_freq_llama / factor + smooth * inv_freq_llama
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return np.where(is_medium, smoothed, inv_freq_llama)


def _rotate_half(x):
    h = x.shape[-1] // 2
    return np.concatenate([-x[..., h:], x[..., :h]], axis=-1)


def _rmsnorm(x, w, eps):
    return w * (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps))


def _sliding_layers(c: dict) -> set[int]:
    N = c["num_hidden_layers"]
    if c["model_type"] == "mistral" and c.get("sliding_window"):
        return set(range(N))
    if c["model_type"] == "qwen2" and c.get("use_sliding_window") and c.get("sliding_window"):
        return {i for i in range(N) if i >= c.get("max_window_layers", N)}
    return set()


class HFLlama:
    """config.json dict + {HF name: array}; forward(ids) -> logits [T, V] (float64)."""

    def __init__(self, c: dict, t: dict[str, np.ndarray]):
        self.c = c
        self.t = {k: np.asarray(v, dtype=np.float64) for k, v in t.items()}

    def forward(self, ids) -> np.ndarray:
        c, t = self.c, self.t
        D, H = c["hidden_size"], c["num_attention_heads"]
        KV = c.get("num_key_value_heads") or H
        hd = c.get("head_dim") or D // H
        eps = c.get("rms_norm_eps", 1e-6)
        T = len(ids)
        pos = np.arange(T, dtype=np.float64)
        freqs = np.outer(pos, hf_inv_freq(c))
        emb = np.concatenate([freqs, freqs], axis=-1)
        cos, sin = np.cos(emb)[None], np.sin(emb)[None]          # [1, T, hd]
        h = t["model.embed_tokens.weight"][np.asarray(ids)]
        sliding = _sliding_layers(c)
        i_ = np.arange(T)[:, None]
        j_ = np.arange(T)[None, :]
        for L in range(c["num_hidden_layers"]):
            p = f"model.layers.{L}."
            x = _rmsnorm(h, t[p + "input_layernorm.weight"], eps)

            def proj(n):
                y = x @ t[p + f"self_attn.{n}.weight"].T
                b = t.get(p + f"self_attn.{n}.bias")
                return y if b is None else y + b
            q = proj("q_proj").reshape(T, H, hd).transpose(1, 0, 2)
            k = proj("k_proj").reshape(T, KV, hd).transpose(1, 0, 2)
            v = proj("v_proj").reshape(T, KV, hd).transpose(1, 0, 2)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            k = np.repeat(k, H // KV, axis=0)                       # repeat_kv
            v = np.repeat(v, H // KV, axis=0)
            mask = j_ <= i_
            if L in sliding:
                mask &= j_ > i_ - c["sliding_window"]
            s = q @ k.transpose(0, 2, 1) / math.sqrt(hd)
            s = np.where(mask[None], s, -np.inf)
            s = np.exp(s - s.max(-1, keepdims=True))
            a = (s / s.sum(-1, keepdims=True)) @ v                  # [H, T, hd]
            h = h + a.transpose(1, 0, 2).reshape(T, H * hd) @ t[p + "self_attn.o_proj.weight"].T
            x = _rmsnorm(h, t[p + "post_attention_layernorm.weight"], eps)
            g = x @ t[p + "mlp.gate_proj.weight"].T
            u = x @ t[p + "mlp.up_proj.weight"].T
            h = h + (g / (1 + np.exp(-g)) * u) @ t[p + "mlp.down_proj.weight"].T
        h = _rmsnorm(h, t["model.norm.weight"], eps)
        head = t.get("lm_head.weight")
        if head is None or c.get("tie_word_embeddings"):
            head = t["model.embed_tokens.weight"]
        return h @ head.T

    def greedy(self, ids, n: int) -> tuple[list[int], list[np.ndarray]]:
        """n greedy tokens after prompt `ids`, and the logits each was chosen from."""
        seq, out, logits = list(ids), [], []
        for _ in range(n):
            lg = self.forward(seq)[-1]
            logits.append(lg)
            nxt = int(np.argmax(lg))
            out.append(nxt)
            seq.append(nxt)
        return out, logits


# -- tiny random checkpoints --------------------------------------------------------------------------

def tiny_hf_config(model_type: str = "llama", **kw) -> dict:
    c = dict(model_type=model_type, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, intermediate_size=128, vocab_size=96, rms_norm_eps=1e-5,
             rope_theta=10000.0, max_position_embeddings=256, tie_word_embeddings=False,
             hidden_act="silu", bos_token_id=1, eos_token_id=2)
    c.update(kw)
    return c


def random_hf_tensors(c: dict, seed: int = 0) -> dict[str, np.ndarray]:
    """Random weights in HF's layout and names (q/k rows in rotate-half order, as HF computes them)."""
    rng = np.random.default_rng(seed)
    D, H, F, V = c["hidden_size"], c["num_attention_heads"], c["intermediate_size"], c["vocab_size"]
    KV = c.get("num_key_value_heads") or H
    hd = c.get("head_dim") or D // H

    def mat(o, i, scale=1.0):
        return (rng.standard_normal((o, i)) * scale / math.sqrt(i)).astype(np.float32)

    t = {"model.embed_tokens.weight": rng.standard_normal((V, D)).astype(np.float32),
         "model.norm.weight": (1 + 0.1 * rng.standard_normal(D)).astype(np.float32)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = (1 + 0.1 * rng.standard_normal(D)).astype(np.float32)
        t[p + "post_attention_layernorm.weight"] = (1 + 0.1 * rng.standard_normal(D)).astype(np.float32)
        # q/k large enough that attention is far from uniform: a wrong RoPE shows in the logits
        t[p + "self_attn.q_proj.weight"] = mat(H * hd, D, 3.0)
        t[p + "self_attn.k_proj.weight"] = mat(KV * hd, D, 3.0)
        t[p + "self_attn.v_proj.weight"] = mat(KV * hd, D)
        t[p + "self_attn.o_proj.weight"] = mat(D, H * hd)
        if c["model_type"] == "qwen2":
            for n, rows in (("q_proj", H * hd), ("k_proj", KV * hd), ("v_proj", KV * hd)):
                t[p + f"self_attn.{n}.bias"] = (0.5 * rng.standard_normal(rows)).astype(np.float32)
        t[p + "mlp.gate_proj.weight"] = mat(F, D)
        t[p + "mlp.up_proj.weight"] = mat(F, D)
        t[p + "mlp.down_proj.weight"] = mat(D, F)
    if not c.get("tie_word_embeddings"):
        t["lm_head.weight"] = mat(V, D, 4.0)
    return t


def write_hf_dir(path: str, c: dict, t: dict[str, np.ndarray], shards: int = 1) -> str:
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(c, f)
    names = sorted(t)
    if shards == 1:
        save_file({n: t[n] for n in names}, os.path.join(path, "model.safetensors"), {"format": "pt"})
        return path
    wmap = {}
    for s, idx in enumerate(np.array_split(np.arange(len(names)), shards)):
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        save_file({names[i]: t[names[i]] for i in idx}, os.path.join(path, fname), {"format": "pt"})
        wmap.update({names[i]: fname for i in idx})
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": wmap}, f)
    return path


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: HF q/k rows to GGUF's interleaved order."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_factors(c: dict) -> np.ndarray:
    """convert_hf_to_gguf.py's rope_freqs.weight of a Llama 3.x model."""
    rs, D, H = c["rope_scaling"], c["hidden_size"], c["num_attention_heads"]
    dim = c.get("head_dim") or D // H
    freqs = 1.0 / (c.get("rope_theta", 10000.0) ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor, lo, hi = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
    old = rs["original_max_position_embeddings"]
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / hi:
            out.append(1)
        elif wavelen > old / lo:
            out.append(factor)
        else:
            smooth = (old / wavelen - lo) / (hi - lo)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float32)


# HF name suffix -> GGUF name suffix (llama.cpp's tensor names)
_GGUF = {"input_layernorm.weight": "attn_norm.weight", "self_attn.q_proj.weight": "attn_q.weight",
         "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
         "self_attn.o_proj.weight": "attn_output.weight", "self_attn.q_proj.bias": "attn_q.bias",
         "self_attn.k_proj.bias": "attn_k.bias", "self_attn.v_proj.bias": "attn_v.bias",
         "post_attention_layernorm.weight": "ffn_norm.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
         "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight"}
_GGUF_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight"}


def gguf_name(hf: str) -> str:
    if hf in _GGUF_GLOBAL:
        return _GGUF_GLOBAL[hf]
    _, _, i, rest = hf.split(".", 3)
    return f"blk.{i}.{_GGUF[rest]}"


def use_more_bits(i_layer: int, n_layers: int) -> bool:
    """llama.cpp's choice of the layers whose attn_v / ffn_down get more bits in the _M mixes."""
    return i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8 or (i_layer - n_layers // 8) % 3 == 2


def k_quant_mix(c: dict, ftype: str = "q4_k_m"):
    """write_gguf's qtype for llama.cpp's LLAMA_FTYPE_MOSTLY_Q4_K_M / Q5_K_M on a llama model (its
    llama_tensor_get_type, no experts, not the 70B rule): the ftype's K type everywhere, Q6_K for
    attn_v and ffn_down in the use_more_bits layers and for output.weight (token_embd when tied),
    and llama.cpp's fallbacks for rows that are not a multiple of 256 (Q4_K -> Q5_0, Q5_K -> Q5_1,
    Q6_K -> Q8_0)."""
    import gguf
    Q = gguf.GGMLQuantizationType
    base = {"q4_k_m": Q.Q4_K, "q5_k_m": Q.Q5_K}[ftype]
    N = c["num_hidden_layers"]
    H = c["num_attention_heads"]
    hd = c.get("head_dim") or c["hidden_size"] // H
    fallback = {Q.Q4_K: Q.Q5_0, Q.Q5_K: Q.Q5_1, Q.Q6_K: Q.Q8_0}

    def qtype(hf: str):
        cols = (c["intermediate_size"] if hf.endswith("down_proj.weight") else
                H * hd if hf.endswith("o_proj.weight") else c["hidden_size"])
        if hf == "lm_head.weight" or (hf == "model.embed_tokens.weight" and c.get("tie_word_embeddings")):
            return Q.Q6_K if cols % 256 == 0 else Q.Q8_0
        t = base
        if hf.endswith("v_proj.weight") or hf.endswith("down_proj.weight"):
            if use_more_bits(int(hf.split(".")[2]), N):
                t = Q.Q6_K
        return t if cols % 256 == 0 else fallback[t]
    return qtype


def write_gguf(path: str, c: dict, t: dict[str, np.ndarray], qtype=None, arch: str = "llama",
               fields: dict | None = None, extra_tensors: dict | None = None) -> dict[str, np.ndarray]:
    """Write HF tensors `t` as a llama.cpp-style GGUF (q/k permuted as its converter does; 2-D weights
    quantized with gguf.quants to `qtype(hf_name)`, a GGMLQuantizationType or None for F32). Returns
    the float32 values the file holds, in HF layout and names (what an exact dequantizer gives)."""
    import gguf
    from gguf.quants import dequantize, quantize

    from kog_dist.formats.kquant import K_TYPES as K_QUANTS
    from kog_dist.formats.kquant import quantize_k
    H = c["num_attention_heads"]
    KV = c.get("num_key_value_heads") or H
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(c["num_hidden_layers"])
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(H)
    w.add_head_count_kv(KV)
    hd = c.get("head_dim") or c["hidden_size"] // H
    w.add_rope_dimension_count(hd)
    if c.get("head_dim"):
        w.add_key_length(hd)
        w.add_value_length(hd)
    w.add_rope_freq_base(c.get("rope_theta", 10000.0))
    w.add_layer_norm_rms_eps(c.get("rms_norm_eps", 1e-6))
    w.add_token_list([f"<t{i}>" for i in range(c["vocab_size"])])
    w.add_bos_token_id(c["bos_token_id"])
    w.add_eos_token_id(c["eos_token_id"])
    for k, v in (fields or {}).items():
        (w.add_uint32 if isinstance(v, int) else w.add_string)(k, v)
    held = {}
    for hf, a in t.items():
        if hf == "lm_head.weight" and c.get("tie_word_embeddings"):
            continue
        a = np.asarray(a, dtype=np.float32)
        if hf.endswith("q_proj.weight") or hf.endswith("q_proj.bias"):
            a = llama_cpp_permute(a, H)
        elif hf.endswith("k_proj.weight") or hf.endswith("k_proj.bias"):
            a = llama_cpp_permute(a, KV)
        qt = qtype(hf) if (qtype and a.ndim == 2) else None
        if qt is None:
            w.add_tensor(gguf_name(hf), a)
            held[hf] = a
        elif qt == gguf.GGMLQuantizationType.F16:
            w.add_tensor(gguf_name(hf), a.astype(np.float16))
            held[hf] = a.astype(np.float16).astype(np.float32)
        else:
            q = quantize_k(a, qt) if qt in K_QUANTS else quantize(a, qt)
            w.add_tensor(gguf_name(hf), q, raw_dtype=qt)
            held[hf] = dequantize(q, qt)
    for name, (a, qt) in (extra_tensors or {}).items():
        w.add_tensor(name, a, raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    # back to HF's order: the reference computes rotate-half on HF rows
    for hf in list(held):
        a = held[hf]
        n = H if ("q_proj" in hf) else KV if ("k_proj" in hf) else None
        if n:
            held[hf] = a.reshape(n, a.shape[0] // n // 2, 2, *a.shape[1:]).swapaxes(1, 2).reshape(a.shape)
    return held


def read_gguf_as_hf(path: str, c: dict) -> dict[str, np.ndarray]:
    """A llama GGUF's tensors as float32 in HF names and layout (gguf's reader and dequantizer; q/k rows
    back from GGUF's interleaved order to rotate-half): what the reference computes with."""
    import gguf
    from gguf.quants import dequantize
    H = c["num_attention_heads"]
    KV = c.get("num_key_value_heads") or H
    names = {v: k for k, v in _GGUF_GLOBAL.items()}
    out = {}
    for t in gguf.GGUFReader(path).tensors:
        if t.name == "rope_freqs.weight":
            continue
        if t.name in names:
            hf = names[t.name]
        else:
            _, i, rest = t.name.split(".", 2)
            hf = f"model.layers.{i}." + next(k for k, v in _GGUF.items() if v == rest)
        a = dequantize(t.data, t.tensor_type).astype(np.float32).reshape([int(x) for x in reversed(t.shape)])
        n = H if "q_proj" in hf else KV if "k_proj" in hf else None
        if n:
            a = a.reshape(n, a.shape[0] // n // 2, 2, *a.shape[1:]).swapaxes(1, 2).reshape(a.shape)
        out[hf] = a
    return out
