"""GGUF files of the llama architecture as one-lane Laneformers, read through gguf.GGUFReader
(memory-mapped). Quantized tensors are dequantized exactly, one tensor at a time as it is read.

GGUF stores a 2-D tensor with its fastest dimension first; the reader gives it as [rows, columns],
which is the spec's [out, in]. q/k rows are already in interleaved RoPE order (llama.cpp's converter
permuted them), so nothing is permuted here.
"""
from __future__ import annotations

import os
import sys

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader

from ..checkpoint import expected_tensors, is_lane_first
from ..config import ConfigError, LaneformerConfig
from .base import FormatError, ModelSource, select
from .quant import DEQUANTIZED_ONLY, SUPPORTED_NAMES, served_dtype, storage_bits, supported

GGUF_MAGIC = b"GGUF"

# GGUF suffix (after blk.{i}.) -> Laneformer suffix (after model.layers.{i}.)
LAYER_NAMES = {
    "attn_norm.weight": "attention_norm.weight",
    "attn_q.weight": "attention.wq.weight",
    "attn_k.weight": "attention.wk.weight",
    "attn_v.weight": "attention.wv.weight",
    "attn_output.weight": "attention.wo.weight",
    "attn_q.bias": "attention.bq.bias",
    "attn_k.bias": "attention.bk.bias",
    "attn_v.bias": "attention.bv.bias",
    "ffn_norm.weight": "ffn_norm.weight",
    "ffn_gate.weight": "feed_forward.w1.weight",
    "ffn_up.weight": "feed_forward.w3.weight",
    "ffn_down.weight": "feed_forward.w2.weight",
}
GLOBAL_NAMES = {"token_embd.weight": "model.tok_embeddings.weight", "output_norm.weight": "model.norm.weight",
                "output.weight": "lm_head.weight"}
ROPE_FREQS = "rope_freqs.weight"   # llama.cpp's form of Llama-3 rope scaling: one factor per pair


def laneformer_name(gname: str) -> str | None:
    if gname in GLOBAL_NAMES:
        return GLOBAL_NAMES[gname]
    parts = gname.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in LAYER_NAMES:
        return f"model.layers.{parts[1]}.{LAYER_NAMES[parts[2]]}"
    return None


class _Reader(GGUFReader):
    """GGUFReader with a cheaper _get: the stock one makes a numpy.memmap view per value (about
    250,000 for a 49,152-token vocabulary: 2.3 s of the SmolLM2 file's open); plain ndarray views of
    the same map read the same bytes in a third of the time."""

    def _get(self, offset, dtype, count=1, override_order=None):
        base = self.__dict__.get("_plain")
        if base is None:
            base = self._plain = self.data.view(np.ndarray)
        dt = np.dtype(dtype)
        count = int(count)
        arr = base[offset:offset + dt.itemsize * count].view(dt)[:count]
        if len(arr) != count:
            raise ValueError(f"the file ends inside a value at byte {offset}")
        return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))


def read_fields(r: GGUFReader) -> dict:
    out = {}
    for key, f in r.fields.items():
        v = f.contents()
        out[key] = v.item() if isinstance(v, np.generic) else v
    return out


class GGUFSource(ModelSource):
    kind = "gguf"

    def __init__(self, path: str):
        size = os.path.getsize(path)
        try:
            r = _Reader(path)
            fields = read_fields(r)
        except (ValueError, KeyError, IndexError, OverflowError, TypeError, UnicodeDecodeError) as e:
            msg = str(e).splitlines()[0] if str(e) else type(e).__name__
            if "GGMLQuantizationType" in msg:   # gguf's enum refuses a type number GGML does not define
                raise FormatError(f"{path}: a tensor has an unknown GGML type ({msg.split(' is ')[0]}; "
                                  f"supported: {', '.join(SUPPORTED_NAMES)})") from None
            raise FormatError(f"{path} is not a readable GGUF file (truncated or corrupt: {msg})") from None
        self._r = r
        arch = fields.get("general.architecture")
        if arch != "llama":
            raise FormatError(f"{path}: GGUF architecture {arch!r} is not supported (supported: llama)")
        tensors = {}
        for t in r.tensors:
            if t.data_offset + t.n_bytes > size:
                raise FormatError(f"{path} is truncated: tensor {t.name} ends at byte "
                                  f"{t.data_offset + t.n_bytes} of {size}")
            if t.name in tensors:
                raise FormatError(f"{path}: tensor {t.name[:100]} appears twice")
            tensors[t.name] = t
        spans = sorted((int(t.data_offset), int(t.data_offset) + int(t.n_bytes), t.name) for t in r.tensors)
        for (b0, e0, n0), (b1, e1, n1) in zip(spans, spans[1:]):
            if b1 < e0:
                raise FormatError(f"{path}: tensors {n0[:80]} and {n1[:80]} overlap (bad tensor offsets)")
        cfg = gguf_config(fields, tensors, path)
        name = fields.get("general.name")
        super().__init__(path, cfg, name=name if isinstance(name, str) and name else os.path.basename(path),
                         model_dir=os.path.dirname(os.path.abspath(path)))
        self.gguf_fields = fields
        self._t: dict[str, object] = {}
        want = expected_tensors(cfg)
        for gname, t in tensors.items():
            if gname == ROPE_FREQS:
                continue
            name = laneformer_name(gname)
            if name is None or name not in want:
                raise FormatError(f"{path}: tensor {gname} is not part of a llama model this runtime computes")
            if not supported(t.tensor_type):
                raise FormatError(f"{path}: tensor {gname} has type {t.tensor_type.name} "
                                  f"(supported: {', '.join(SUPPORTED_NAMES)})")
            self._t[name] = t
        for name, shape in want.items():
            t = self._t.get(name)
            if t is None:
                raise FormatError(f"{path}: tensor {_gguf_name(name)} is missing "
                                  f"({len(tensors)} tensors found)")
            got = tuple(int(x) for x in reversed(t.shape.tolist()))
            lane = is_lane_first(name)
            if ((1,) + got if lane else got) != shape:
                raise FormatError(f"{path}: tensor {t.name} has shape {list(got)}, the config needs "
                                  f"{list(shape[1:] if lane else shape)}")
            self._shapes[name] = shape
            self._dtypes[name] = served_dtype(t.tensor_type)
        only = sorted({t.tensor_type.name for t in self._t.values() if t.tensor_type in DEQUANTIZED_ONLY})
        if only:
            print(f"[kog] {os.path.basename(path)}: {', '.join(only)} tensors are not kept quantized by any "
                  f"backend; they load dequantized", file=sys.stderr, flush=True)

    def quant_type(self, name: str) -> str | None:
        t = self._t[name]
        return None if t.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16,
                                         GGMLQuantizationType.BF16) else t.tensor_type.name

    def blocks(self, name: str, rows: slice | None = None, cols: slice | None = None) -> tuple[np.ndarray, str]:
        """A quantized tensor's bytes as the file stores them ([rows, bytes a row], a view of the map) and its
        GGML type's name: what a backend that keeps the blocks (the cuda backend's K-quants) reads. `rows`:
        only those rows; `cols`: of each row only the bytes of the blocks (super-blocks) that make up those
        columns, which must start and end on the type's block boundaries (ValueError otherwise)."""
        t = self._t[name]
        data = np.asarray(t.data)
        data = data.reshape(data.shape[0], -1) if data.ndim > 1 else data.reshape(1, -1)
        if rows is not None:
            data = data[rows]
        if cols is not None and data.dtype != np.uint8:   # F32 / F16 tensors are served as their elements
            data = data[:, cols]
        elif cols is not None:
            bs, ts = GGML_QUANT_SIZES[t.tensor_type]
            if cols.start % bs or cols.stop % bs:
                raise ValueError(f"{name}: columns {cols.start}..{cols.stop} do not fall on the "
                                 f"{bs}-weight blocks of {t.tensor_type.name}")
            data = data[:, cols.start // bs * ts:cols.stop // bs * ts]
        self.nbytes_read += data.nbytes
        return data, t.tensor_type.name

    def raw(self, name: str, lanes: range | None = None, rows: np.ndarray | None = None):
        t = self._t[name]
        lane = is_lane_first(name)
        if rows is not None and not lane:
            # rows are whole blocks in every GGML type: only the asked rows are dequantized
            out = storage_bits(t.data[np.asarray(rows, dtype=np.int64)], t.tensor_type)
        else:
            shape = self._shapes[name][1:] if lane else self._shapes[name]
            out = select(storage_bits(t.data, t.tensor_type).reshape(shape), lane, lanes, rows)
        if self.quant_type(name) is None:
            out = np.array(out, copy=True)          # plain types are views of the map until copied
        self.nbytes_read += out.nbytes
        return np.ascontiguousarray(out), self._dtypes[name]

    def block(self, name: str, rows: slice | None = None, cols: slice | None = None):
        """(storage bits, dtype) of rows x cols of a tensor as served without its lane axis: only those
        rows are dequantized, and of each row only the whole blocks that cover the columns."""
        t = self._t[name]
        data = t.data
        if rows is not None:
            data = data[rows]
        qtype = t.tensor_type
        if cols is not None and self.quant_type(name) is not None:
            bs, ts = GGML_QUANT_SIZES[qtype]
            b0, b1 = cols.start // bs, -(-cols.stop // bs)
            out = storage_bits(data[:, b0 * ts:b1 * ts], qtype)[:, cols.start - b0 * bs:cols.stop - b0 * bs]
        else:
            out = storage_bits(data, qtype)
            if cols is not None:
                out = out[:, cols]
        out = np.array(out, copy=True)
        self.nbytes_read += out.nbytes
        return np.ascontiguousarray(out), self._dtypes[name]

    def close(self) -> None:
        self._t = {}
        self._r = None


def _gguf_name(name: str) -> str:
    for g, n in GLOBAL_NAMES.items():
        if n == name:
            return g
    i, rest = name.split(".", 3)[2], name.split(".", 3)[3]
    return f"blk.{i}." + next(g for g, n in LAYER_NAMES.items() if n == rest)


def _typed(f: dict, key: str, kind, path: str):
    """Metadata value `key` if it has the type the key holds (int: an integer; float: a number; str);
    a FormatError naming the key otherwise."""
    v = f[key]
    ok = (isinstance(v, str) if kind is str else
          isinstance(v, (int, np.integer)) and not isinstance(v, bool) if kind is int else
          isinstance(v, (int, float, np.number)) and not isinstance(v, bool))
    if not ok:
        want = {int: "an integer", float: "a number", str: "a string"}[kind]
        raise FormatError(f"{path}: GGUF metadata {key} must be {want}, got {type(v).__name__} "
                          f"{str(v)[:40]!r}")
    return int(v) if kind is int else float(v) if kind is float else v


def gguf_config(f: dict, tensors: dict, path: str) -> LaneformerConfig:
    """llama.* metadata as the equivalent one-lane Laneformer (spec, "Llama-family checkpoints")."""
    def need(key):
        if key not in f:
            raise FormatError(f"{path}: GGUF metadata lacks {key}")
        return _typed(f, key, int, path)

    def get(key, default, kind=int):
        return _typed(f, key, kind, path) if key in f else default

    if get("llama.expert_count", 0):
        raise FormatError(f"{path}: a mixture-of-experts llama (llama.expert_count = "
                          f"{f['llama.expert_count']}) is not supported")
    D, H = need("llama.embedding_length"), need("llama.attention.head_count")
    hd_default = D // H if isinstance(D, int) and isinstance(H, int) and H and D % H == 0 else None
    hd = get("llama.attention.key_length", hd_default)
    if get("llama.attention.value_length", hd) != hd:
        raise FormatError(f"{path}: key_length {hd} != value_length {f['llama.attention.value_length']} "
                          f"is not supported")
    rot = get("llama.rope.dimension_count", hd)
    if rot != hd:
        raise FormatError(f"{path}: RoPE over {rot} of {hd} head dimensions is not supported")
    stype = get("llama.rope.scaling.type", "none", str)
    if stype not in ("none", None):
        raise FormatError(f"{path}: rope scaling type {stype!r} is not supported "
                          f"(supported: llama3, given as the {ROPE_FREQS} tensor)")
    scaling = None
    if ROPE_FREQS in tensors:
        t = tensors[ROPE_FREQS]
        if t.tensor_type != GGMLQuantizationType.F32:
            raise FormatError(f"{path}: {ROPE_FREQS} must be F32, got {t.tensor_type.name}")
        scaling = {"rope_type": "factors", "factors": [float(x) for x in np.asarray(t.data).reshape(-1)]}
    tokens = f.get("tokenizer.ggml.tokens")
    if tokens is not None and not (isinstance(tokens, list) and all(isinstance(x, str) for x in tokens)):
        raise FormatError(f"{path}: GGUF metadata tokenizer.ggml.tokens is not a list of strings")
    V = len(tokens) if tokens is not None else get("llama.vocab_size", None)
    n_vocab = get("llama.vocab_size", None)
    if tokens is not None and n_vocab is not None and n_vocab != len(tokens):
        raise FormatError(f"{path}: llama.vocab_size is {n_vocab} but the tokenizer lists {len(tokens)} tokens")
    if V is None:
        raise FormatError(f"{path}: GGUF metadata has neither tokenizer.ggml.tokens nor llama.vocab_size")
    kw = dict(
        hidden_size=D, num_hidden_layers=need("llama.block_count"), num_attention_heads=H,
        num_key_value_heads=get("llama.attention.head_count_kv", H),
        intermediate_size=need("llama.feed_forward_length"), vocab_size=V, num_lanes=1,
        rope_theta=float(get("llama.rope.freq_base", 10000.0, float)),
        norm_eps=float(get("llama.attention.layer_norm_rms_epsilon", 1e-5, float)),
        max_position_embeddings=get("llama.context_length", 2048),
        tie_word_embeddings="output.weight" not in tensors,
        bos_token_id=get("tokenizer.ggml.bos_token_id", None), eos_token_id=get("tokenizer.ggml.eos_token_id", None),
        attention_bias="blk.0.attn_q.bias" in tensors, rope_scaling=scaling,
    )
    if hd != hd_default:
        kw["head_dim_override"] = hd
    try:
        return LaneformerConfig(**kw, extra={"gguf_architecture": "llama"}).validate()
    except (ConfigError, TypeError) as e:
        raise FormatError(f"{path}: {e}") from None
