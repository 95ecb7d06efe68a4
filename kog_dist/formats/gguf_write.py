"""Writing one-lane Laneformers as GGUF files of the llama architecture (what gguf_file reads), tensor by
tensor, in any storage type gguf_file loads: plain, legacy quants, the K-quants (kquant's encoder) and
llama.cpp's Q4_K_M / Q5_K_M mixes."""
from __future__ import annotations

import math

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize

from ..checkpoint import bf16_bits, is_lane_first
from ..config import LaneformerConfig, rope_inv_freq
from .gguf_file import GLOBAL_NAMES, LAYER_NAMES, ROPE_FREQS
from .kquant import K_TYPES, quantize_k

Q = GGMLQuantizationType
# --dtype name -> the type of the layer matrices (the mixes: their base type; see tensor_type)
GGUF_DTYPES = {"f32": Q.F32, "f16": Q.F16, "bf16": Q.BF16, "q8_0": Q.Q8_0, "q4_0": Q.Q4_0, "q4_1": Q.Q4_1,
               "q5_0": Q.Q5_0, "q5_1": Q.Q5_1, "q4_k": Q.Q4_K, "q5_k": Q.Q5_K, "q6_k": Q.Q6_K,
               "q4_k_m": Q.Q4_K, "q5_k_m": Q.Q5_K}
MIXES = ("q4_k_m", "q5_k_m")
# llama.cpp's tensor_type_fallback for rows that are not whole blocks of the chosen type
_FALLBACK = {Q.Q4_K: Q.Q5_0, Q.Q5_K: Q.Q5_1, Q.Q6_K: Q.Q8_0}


def gguf_name(name: str) -> str:
    for g, n in GLOBAL_NAMES.items():
        if n == name:
            return g
    _, _, i, rest = name.split(".", 3)
    return f"blk.{i}." + next(g for g, n in LAYER_NAMES.items() if n == rest)


def use_more_bits(i_layer: int, n_layers: int) -> bool:
    """llama.cpp's layers whose attn_v / ffn_down get Q6_K in the _M mixes."""
    return i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8 or (i_layer - n_layers // 8) % 3 == 2


def tensor_type(gname: str, shape: tuple[int, ...], cfg: LaneformerConfig, dtype: str) -> GGMLQuantizationType:
    """The GGML type of tensor `gname` ([rows, cols] or 1-D) under --dtype `dtype`: 1-D tensors stay F32
    (as llama.cpp keeps them); a mix follows llama.cpp's llama_tensor_get_type for LLAMA_FTYPE_MOSTLY_
    Q4_K_M / Q5_K_M (no experts): Q6_K for output.weight (token_embd when tied) and for attn_v /
    ffn_down in the use_more_bits layers, the base K type elsewhere."""
    if len(shape) < 2:
        return Q.F32
    t = GGUF_DTYPES[dtype]
    if dtype in MIXES:
        if gname == "output.weight" or (gname == "token_embd.weight" and cfg.tie_word_embeddings):
            t = Q.Q6_K
        elif gname.endswith(("attn_v.weight", "ffn_down.weight")):
            if use_more_bits(int(gname.split(".")[1]), cfg.num_hidden_layers):
                t = Q.Q6_K
    block = GGML_QUANT_SIZES[t][0]
    if shape[-1] % block:
        if t not in _FALLBACK and block > 1:
            raise ValueError(f"--dtype {dtype}: tensor {gname} has rows of {shape[-1]} values, not a "
                             f"multiple of {t.name}'s {block}")
        t = _FALLBACK.get(t, t)
        if shape[-1] % GGML_QUANT_SIZES[t][0]:
            t = Q.F16                        # llama.cpp's last resort too
    return t


PLAIN_ITEMSIZE = {Q.F32: 4, Q.F16: 2, Q.BF16: 2}


def byte_shape(shape: tuple[int, ...], qtype: GGMLQuantizationType) -> tuple[int, ...]:
    """The shape of the stored array: elements for the plain types, bytes of blocks for the quants."""
    if qtype in PLAIN_ITEMSIZE:
        return tuple(shape)
    block, tsize = GGML_QUANT_SIZES[qtype]
    return (*shape[:-1], shape[-1] // block * tsize)


def encode(a: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """float32 values -> the array GGUF stores for `qtype` (typed for F32 / F16, BF16 bits as uint16,
    blocks as uint8 [rows, bytes])."""
    if qtype == Q.F32:
        return np.ascontiguousarray(a, dtype=np.float32)
    if qtype == Q.F16:
        return np.ascontiguousarray(a, dtype=np.float16)
    if qtype == Q.BF16:
        return bf16_bits(np.asarray(a, dtype=np.float32))
    flat = np.asarray(a, dtype=np.float32).reshape(-1, a.shape[-1])
    return quantize_k(flat, qtype) if qtype in K_TYPES else quantize(flat, qtype)


def rope_factors(cfg: LaneformerConfig) -> np.ndarray | None:
    """llama.cpp's rope_freqs.weight for a llama3-scaled config: each pair's plain frequency over the
    scaled one."""
    if not cfg.rope_scaling:
        return None
    hd = cfg.head_dim
    plain = cfg.rope_theta ** (-2.0 * np.arange(hd // 2) / hd)
    return (plain / rope_inv_freq(cfg)).astype(np.float32)


def _byte_chars() -> list[str]:
    """GPT-2's byte-level alphabet: byte b as one printable character."""
    keep = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    extra = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(extra)) for b in range(256)]


def add_byte_tokenizer(w: GGUFWriter, cfg: LaneformerConfig) -> None:
    """A gpt2-model tokenizer that writes text as bytes (ids from 3 on, as ByteTokenizer does), bos and
    eos as control tokens, the rest of the vocabulary as filler: enough for `kog generate --prompt` on a
    random model. Needs a vocabulary of 260 or more."""
    V = cfg.vocab_size
    tokens = [f"<|filler{i}|>" for i in range(V)]
    types = [1] * V
    specials = {i for i in (cfg.bos_token_id, *(cfg.eos_token_ids or ())) if i is not None and 0 <= i < V}
    for i in specials:
        tokens[i], types[i] = f"<|special{i}|>", 3
    free = [i for i in range(3, V) if i not in specials]
    for i, ch in zip(free, _byte_chars()):
        tokens[i] = ch
    tokens[free[256]] = "\u0120t"                # one merge: gpt2's tokenizer needs at least one
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(["\u0120 t"])


class GGUFModelWriter:
    """`w = GGUFModelWriter(path, cfg, types)`; then w.write(gguf_name, stored_array) in the order of
    `types` ({gguf name: (numpy shape, GGML type)}); w.close(). Only one tensor is held at a time."""

    def __init__(self, path: str, cfg: LaneformerConfig, types: dict, name: str = "kog tiny"):
        if cfg.num_lanes != 1:
            raise ValueError(f"a GGUF file holds a one-lane model (llama); this one has {cfg.num_lanes} lanes")
        if cfg.sliding_window:
            raise ValueError("a GGUF llama file has no sliding window: drop --window")
        w = self._w = GGUFWriter(path, "llama")
        w.add_name(name)
        w.add_block_count(cfg.num_hidden_layers)
        w.add_context_length(cfg.max_position_embeddings)
        w.add_embedding_length(cfg.hidden_size)
        w.add_feed_forward_length(cfg.intermediate_size)
        w.add_head_count(cfg.num_attention_heads)
        w.add_head_count_kv(cfg.kv_heads)
        w.add_rope_dimension_count(cfg.head_dim)
        if cfg.head_dim * cfg.num_attention_heads != cfg.hidden_size:
            w.add_key_length(cfg.head_dim)
            w.add_value_length(cfg.head_dim)
        w.add_rope_freq_base(cfg.rope_theta)
        w.add_layer_norm_rms_eps(cfg.norm_eps)
        w.add_vocab_size(cfg.vocab_size)
        if cfg.bos_token_id is not None:
            w.add_bos_token_id(cfg.bos_token_id)
        if cfg.eos_token_ids:
            w.add_eos_token_id(cfg.eos_token_ids[0])
        if cfg.vocab_size >= 260:
            add_byte_tokenizer(w, cfg)
        self.types = dict(types)
        for gname, (shape, qt) in self.types.items():
            np_dtype = {Q.F32: np.float32, Q.F16: np.float16, Q.BF16: np.uint16}.get(qt, np.uint8)
            bshape = byte_shape(shape, qt)
            nbytes = math.prod(bshape) * np.dtype(np_dtype).itemsize
            w.add_tensor_info(gname, bshape, np.dtype(np_dtype), nbytes,
                              raw_dtype=None if qt in (Q.F32, Q.F16) else qt)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        self._order = list(self.types)
        self._f = w.fout[0]

    def write(self, gname: str, arr) -> int:
        """Write the next tensor: its stored array, or an iterable of flat pieces of it. Returns its bytes."""
        want = self._order.pop(0)
        if gname != want:
            raise ValueError(f"GGUF tensors must come in order: expected {want}, got {gname}")
        self._w.write_padding(self._f, self._f.tell())
        n = 0
        for piece in ([arr] if isinstance(arr, np.ndarray) else arr):
            self._f.write(memoryview(np.ascontiguousarray(piece)).cast("B"))
            n += piece.nbytes
        shape, qt = self.types[gname]
        if n != math.prod(byte_shape(shape, qt)) * PLAIN_ITEMSIZE.get(qt, 1):
            raise ValueError(f"GGUF tensor {gname}: {n} bytes written, its shape and type need "
                             f"{math.prod(byte_shape(shape, qt)) * PLAIN_ITEMSIZE.get(qt, 1)}")
        self._w.write_padding(self._f, n)
        return n

    def close(self) -> None:
        if self._order:
            raise ValueError(f"{len(self._order)} GGUF tensors were not written (first: {self._order[0]})")
        self._w.close()


def gguf_layout(cfg: LaneformerConfig, tensors: dict[str, tuple[int, ...]], dtype: str) -> dict:
    """{Laneformer name: (gguf name, numpy shape without the lane axis, GGML type)}, plus rope_freqs."""
    if dtype not in GGUF_DTYPES:
        raise ValueError(f"--dtype {dtype} is not a GGUF storage type (known: {', '.join(GGUF_DTYPES)})")
    out = {}
    for name, shape in tensors.items():
        s = tuple(shape[1:]) if is_lane_first(name) else tuple(shape)
        g = gguf_name(name)
        out[name] = (g, s, tensor_type(g, s, cfg, dtype))
    f = rope_factors(cfg)
    if f is not None:
        out[ROPE_FREQS] = (ROPE_FREQS, f.shape, Q.F32)
    return out
