"""Hugging Face Llama-family directories (model_type llama, mistral, qwen2) as one-lane Laneformers.

config.json is mapped as spec/laneformer.md's "Llama-family checkpoints" says; tensors keep their HF
files and are renamed, given the lane axis and, for q_proj / k_proj (and their biases), permuted from
HF's rotate-half pair order to the spec's interleaved pairs, as they are read.
"""
from __future__ import annotations

import json
import os

import numpy as np
from safetensors import SafetensorError, safe_open

from ..checkpoint import DTYPES, CheckpointError, _File, expected_tensors, inside_dir, is_lane_first
from ..config import ConfigError, LaneformerConfig
from .base import FormatError, ModelSource, select

HF_MODEL_TYPES = ("llama", "mistral", "qwen2")
# HF's own defaults where a config.json leaves a key out (transformers' LlamaConfig, MistralConfig,
# Qwen2Config).
_DEFAULT_CONTEXT = {"llama": 2048, "mistral": 4096 * 32, "qwen2": 32768}

# Laneformer suffix (after model.layers.{i}.) -> HF suffix (after model.layers.{i}.)
LAYER_NAMES = {
    "attention_norm.weight": "input_layernorm.weight",
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention.bq.bias": "self_attn.q_proj.bias",
    "attention.bk.bias": "self_attn.k_proj.bias",
    "attention.bv.bias": "self_attn.v_proj.bias",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
}
GLOBAL_NAMES = {"model.tok_embeddings.weight": "model.embed_tokens.weight",
                "model.norm.weight": "model.norm.weight", "lm_head.weight": "lm_head.weight"}
# HF tensors that carry nothing the model computes (old checkpoints saved RoPE's table).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def hf_name(name: str) -> str:
    """The HF name of a Laneformer tensor name."""
    if name in GLOBAL_NAMES:
        return GLOBAL_NAMES[name]
    parts = name.split(".", 3)
    if len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[3] in LAYER_NAMES:
        return f"model.layers.{parts[2]}.{LAYER_NAMES[parts[3]]}"
    raise KeyError(name)


def rotate_half_to_interleaved(heads: int, hd: int) -> np.ndarray:
    """Row order that turns HF's rotate-half rows into the spec's interleaved pairs, within each head:
    new row 2k = old row k, new row 2k+1 = old row k + hd/2."""
    k = np.arange(hd // 2)
    one = np.empty(hd, np.int64)
    one[0::2] = k
    one[1::2] = k + hd // 2
    return (np.arange(heads)[:, None] * hd + one[None, :]).reshape(-1)


def hf_config(d: dict, where: str) -> LaneformerConfig:
    """config.json of a llama / mistral / qwen2 model as the equivalent one-lane Laneformer."""
    mt = d.get("model_type")
    if mt not in HF_MODEL_TYPES:
        raise FormatError(f"{where}: model_type {mt!r} is not supported (supported: {', '.join(HF_MODEL_TYPES)})")
    act = d.get("hidden_act", "silu")
    if act != "silu":
        raise FormatError(f"{where}: hidden_act {act!r} is not supported (Llama-family models use 'silu')")
    if d.get("mlp_bias"):
        raise FormatError(f"{where}: mlp_bias is not supported (no MLP biases in the Llama family)")
    if mt != "qwen2" and d.get("attention_bias"):
        raise FormatError(f"{where}: attention_bias (q/k/v/o biases) is not supported; "
                          f"only Qwen2's q/k/v biases are")
    rp = d.get("rope_parameters") if isinstance(d.get("rope_parameters"), dict) else {}
    theta = rp.get("rope_theta", d.get("rope_theta", 10000.0))
    scaling = d.get("rope_scaling", rp if rp.get("rope_type", "default") != "default" else None)
    if isinstance(scaling, dict):
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind == "default":
            scaling = None
        elif kind == "llama3":
            scaling = {"rope_type": "llama3", **{k: scaling.get(k) for k in
                       ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}}
        else:
            raise FormatError(f"{where}: rope_scaling type {kind!r} is not supported (supported: llama3)")
    N = d.get("num_hidden_layers")
    H = d.get("num_attention_heads")
    D = d.get("hidden_size")
    window, n_sliding = _sliding(mt, d, N, where)
    kw = dict(
        hidden_size=D, num_hidden_layers=N, num_attention_heads=H,
        num_key_value_heads=d.get("num_key_value_heads"),
        intermediate_size=d.get("intermediate_size"), vocab_size=d.get("vocab_size"),
        num_lanes=1, rope_theta=theta, norm_eps=d.get("rms_norm_eps", 1e-6),
        max_position_embeddings=d.get("max_position_embeddings", _DEFAULT_CONTEXT[mt]),
        tie_word_embeddings=False if d.get("tie_word_embeddings") is None else d["tie_word_embeddings"],
        eos_token_id=d.get("eos_token_id"), bos_token_id=d.get("bos_token_id"),
        sliding_window=window, sliding_window_n_layers=n_sliding,
        attention_bias=(mt == "qwen2"), rope_scaling=scaling,
    )
    hd = d.get("head_dim")
    if hd is not None and not (isinstance(D, int) and isinstance(H, int) and H > 0 and D % H == 0
                               and hd == D // H):
        kw["head_dim_override"] = hd
    missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                           "vocab_size") if d.get(k) is None]
    if missing:
        raise FormatError(f"{where} lacks {', '.join(missing)}")
    try:
        return LaneformerConfig(**kw, extra={"hf_model_type": mt}).validate()
    except (ConfigError, TypeError) as e:
        raise FormatError(f"{where}: {e}") from None


def _sliding(mt: str, d: dict, N, where: str) -> tuple[int | None, int]:
    """(window, the spec's sliding_window_n_layers) of a Mistral or Qwen2 config."""
    if mt == "mistral":
        w = d.get("sliding_window")
        return (w, N) if w else (None, 0)       # Mistral slides every layer
    if mt == "qwen2" and d.get("use_sliding_window") and d.get("sliding_window"):
        first = d.get("max_window_layers", N)   # HF Qwen2: layers i >= max_window_layers slide
        if not isinstance(first, int) or not isinstance(N, int) or first >= N:
            return None, 0
        return d["sliding_window"], -(N - max(first, 0))
    return None, 0


class HFSource(ModelSource):
    """A Hugging Face directory read through safetensors' safe_open / get_slice."""

    kind = "hf"

    def __init__(self, path: str, d: dict):
        cpath = os.path.join(path, "config.json")
        super().__init__(path, hf_config(d, cpath))
        self._closed = False
        self._open: dict[str, object] = {}        # file -> safe_open handle
        self._raw_files: dict[str, _File] = {}     # file -> our mmap reader (BF16 only)
        self._where: dict[str, str] = {}           # HF name -> file
        self._hf_meta: dict[str, tuple[str, tuple]] = {}
        self._hf_names: dict[str, str] = {}        # Laneformer name -> HF name
        try:
            self._index(path)
            self._check()
        except BaseException:
            self.close()
            raise

    def _index(self, path: str) -> None:
        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.isfile(index):
            try:
                with open(index) as f:
                    wmap = json.load(f)["weight_map"]
                assert isinstance(wmap, dict) and all(isinstance(v, str) for v in wmap.values())
            except (ValueError, KeyError, TypeError, AssertionError, RecursionError):
                raise FormatError(f"{index} is malformed (needs a 'weight_map' object)") from None
            try:   # a shard named outside the directory is refused before anything there is touched
                files = sorted({inside_dir(v, index) for v in wmap.values()})
            except CheckpointError as e:
                raise FormatError(str(e)) from None
        else:
            files = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
            if not files:
                raise FormatError(f"no .safetensors files in {path} (found: "
                                  f"{', '.join(sorted(os.listdir(path))[:8]) or 'nothing'})")
        for fname in files:
            fpath = os.path.join(path, fname)
            if not os.path.isfile(fpath):
                raise FormatError(f"{fpath} is missing (named in the index)")
            try:
                h = safe_open(fpath, framework="numpy")
                keys = list(h.keys())
                for k in keys:
                    if k in self._where:
                        raise FormatError(f"tensor {k[:100]} is in both {self._where[k]} and {fname}")
                    sl = h.get_slice(k)
                    self._hf_meta[k] = (sl.get_dtype(), tuple(sl.get_shape()))
                    self._where[k] = fname
            except (SafetensorError, OSError, ValueError) as e:
                raise FormatError(f"{fpath} is not a readable safetensors file: "
                                  f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
            self._open[fname] = h

    def _check(self) -> None:
        cfg, d = self.cfg, self.path
        want = expected_tensors(cfg)
        mapped = set()
        for name, shape in want.items():
            hn = hf_name(name)
            if hn not in self._hf_meta:
                raise FormatError(f"tensor {hn} is missing from {d} ({len(self._hf_meta)} tensors found; "
                                  f"a {cfg.extra['hf_model_type']} model needs {len(want)})")
            dt, hshape = self._hf_meta[hn]
            lane = is_lane_first(name)
            served = (1,) + hshape if lane else hshape
            if served != shape:
                raise FormatError(f"tensor {hn} has shape {list(hshape)}, the config needs "
                                  f"{list(shape[1:] if lane else shape)}")
            if dt not in DTYPES:
                raise FormatError(f"tensor {hn} has dtype {dt} (supported: {', '.join(DTYPES)})")
            self._shapes[name], self._dtypes[name] = shape, dt
            self._hf_names[name] = hn
            mapped.add(hn)
        for hn in self._hf_meta:
            if hn not in mapped and not hn.endswith(_IGNORED_SUFFIXES) and \
                    not (hn == "lm_head.weight" and cfg.tie_word_embeddings):
                raise FormatError(f"tensor {hn} in {d} is not part of a {cfg.extra['hf_model_type']} model "
                                  f"this runtime computes")

    def _read(self, hn: str, rows) -> np.ndarray:
        """HF tensor `hn` (or some of its rows) as storage bits."""
        dt, shape = self._hf_meta[hn]
        fname = self._where[hn]
        if dt == "BF16":
            # numpy has no bfloat16, so safetensors' numpy reader refuses BF16 tensors: the bits come
            # through the project's memory-mapped reader.
            arr = self._read_view(hn)
            return np.array(arr if rows is None else arr[rows], copy=True)
        sl = self._open[fname].get_slice(hn)
        if rows is None:
            return sl[:]
        rows = np.asarray(rows, dtype=np.int64).reshape(-1)
        if len(rows) > 1 and rows[-1] - rows[0] == len(rows) - 1 and np.all(np.diff(rows) == 1):
            return sl[int(rows[0]):int(rows[-1]) + 1]      # a range (a rank's LM head rows): one read
        # one small read per distinct row: a prompt's ids are scattered over a vocabulary of 10^5 rows
        uniq, inv = np.unique(rows, return_inverse=True)
        got = np.stack([sl[int(r):int(r) + 1][0] for r in uniq]) if len(uniq) else \
            np.zeros((0,) + shape[1:], DTYPES[dt])
        return got[inv]

    def raw(self, name: str, lanes: range | None = None, rows: np.ndarray | None = None):
        hn = self._hf_names[name]
        dt = self._dtypes[name]
        cfg = self.cfg
        perm = None
        if name.endswith(("attention.wq.weight", "attention.bq.bias")):
            perm = rotate_half_to_interleaved(cfg.num_attention_heads, cfg.head_dim)
        elif name.endswith(("attention.wk.weight", "attention.bk.bias")):
            perm = rotate_half_to_interleaved(cfg.kv_heads, cfg.head_dim)
        direct_rows = rows if (perm is None and not is_lane_first(name)) else None
        arr = self._read(hn, direct_rows)
        if perm is not None:
            arr = arr[perm]
        out = np.ascontiguousarray(select(arr, is_lane_first(name), lanes,
                                          None if direct_rows is not None else rows))
        self.nbytes_read += out.nbytes
        return out, dt

    def block(self, name: str, rows: slice | None = None, cols: slice | None = None):
        """(storage bits, dtype) of rows x cols of a tensor as served without its lane axis, reading
        only those bytes (get_slice; BF16 through the mapped file). q/k rows: `rows` must start and
        end on head boundaries (the permutation stays within each head)."""
        hn, dt, cfg = self._hf_names[name], self._dtypes[name], self.cfg
        shape = self._hf_meta[hn][1]
        r = rows or slice(0, shape[0])
        c = cols or slice(0, shape[1]) if len(shape) > 1 else None
        perm = None
        if name.endswith(("attention.wq.weight", "attention.bq.bias", "attention.wk.weight", "attention.bk.bias")):
            hd = cfg.head_dim
            if r.start % hd or r.stop % hd:
                raise ValueError(f"{name}: rows {r.start}..{r.stop} do not fall on heads of {hd}")
            perm = rotate_half_to_interleaved((r.stop - r.start) // hd, hd)
        key = (r,) if c is None else (r, c)
        if dt == "BF16":
            full = self._read_view(hn)
            arr = np.array(full[key], copy=True)
        else:
            arr = self._open[self._where[hn]].get_slice(hn)[key]
        if perm is not None:
            arr = arr[perm]
        out = np.ascontiguousarray(arr)
        self.nbytes_read += out.nbytes
        return out, dt

    def _read_view(self, hn: str) -> np.ndarray:
        """A BF16 tensor as a uint16 view of the mapped file (nothing read until sliced)."""
        dt, shape = self._hf_meta[hn]
        fname = self._where[hn]
        f = self._raw_files.get(fname)
        if f is None:
            try:
                f = self._raw_files[fname] = _File(os.path.join(self.path, fname))
            except CheckpointError as e:
                raise FormatError(str(e)) from None
        meta = f.header[hn]
        return np.frombuffer(f.mm, dtype=DTYPES[dt], count=int(np.prod(shape, dtype=np.int64)),
                             offset=f.data_start + meta["data_offsets"][0]).reshape(shape)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for f in self._raw_files.values():
            f.close()
        self._open.clear()
