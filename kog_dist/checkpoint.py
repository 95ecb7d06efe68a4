"""Checkpoints in the spec's layout: safetensors files (one, or sharded with an index), validated
against the config before any compute, readable one lane slice at a time.

The files are memory-mapped and parsed here (the format is an 8-byte header length, a JSON header and
raw little-endian data), so a rank that owns lanes [a, b) touches only those bytes of each lane-first
tensor, and bf16 needs no extra package.
"""
from __future__ import annotations

import json
import math
import mmap
import os
import struct

import numpy as np

from .config import ConfigError, LaneformerConfig, load_config
from .progress import Progress

DTYPES = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype("<u2")}
ITEMSIZE = {"F32": 4, "F16": 2, "BF16": 2}


class CheckpointError(ValueError):
    """A checkpoint that does not match its config or the format; the message is one line."""


# -- names and shapes -------------------------------------------------------------------------------
LANE_TENSORS = ("attention.wq", "attention.wk", "attention.wv", "attention.wo",
                "feed_forward.w1", "feed_forward.w3", "feed_forward.w2",
                "attention.bq", "attention.bk", "attention.bv")


def expected_tensors(cfg: LaneformerConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the spec requires, with its shape."""
    D, L, hd, V = cfg.hidden_size, cfg.num_lanes, cfg.head_dim, cfg.vocab_size
    q, kv, f = cfg.heads_per_lane * hd, cfg.kv_heads_per_lane * hd, cfg.ffn_per_lane
    norm = (lambda n: (f"{n}.weight", (D,))) if cfg.replicated_rmsn_scale else (lambda n: (f"{n}.scale", (L, D)))
    out = {"model.tok_embeddings.weight": (V, D)}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        for n in ("attention_norm", "ffn_norm"):
            name, shape = norm(p + n)
            out[name] = shape
        out[p + "attention.wq.weight"] = (L, q, D)
        out[p + "attention.wk.weight"] = (L, kv, D)
        out[p + "attention.wv.weight"] = (L, kv, D)
        out[p + "attention.wo.weight"] = (L, D, q)
        if cfg.attention_bias:
            out[p + "attention.bq.bias"] = (L, q)
            out[p + "attention.bk.bias"] = (L, kv)
            out[p + "attention.bv.bias"] = (L, kv)
        out[p + "feed_forward.w1.weight"] = (L, f, D)
        out[p + "feed_forward.w3.weight"] = (L, f, D)
        out[p + "feed_forward.w2.weight"] = (L, D, f)
    name, shape = norm("model.norm")
    out[name] = shape
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = (V, D)
    return out


def is_lane_first(name: str) -> bool:
    return any(f".{t}." in name for t in LANE_TENSORS) or (name.endswith(".scale"))


# -- reading ----------------------------------------------------------------------------------------
MAX_HEADER = 100 << 20      # safetensors' own limit on the JSON header
MAX_DIMS = 8


def _no_duplicates(pairs):
    d = {}
    for k, v in pairs:
        if k in d:
            raise ValueError(f"the key {k!r} appears twice")
        d[k] = v
    return d


def _is_count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def inside_dir(fname, where: str) -> str:
    """`fname` (a weight_map value) if it names a file inside the model directory; a CheckpointError
    otherwise, raised before anything outside is touched, and saying nothing about what is there."""
    if not isinstance(fname, str) or not fname or "\0" in fname:
        raise CheckpointError(f"{where}: a weight_map entry is not a file name ({str(fname)[:60]!r})")
    parts = fname.replace("\\", "/").split("/")
    if os.path.isabs(fname) or ".." in parts or fname.startswith("~"):
        raise CheckpointError(f"{where}: weight_map names {fname[:80]!r}, outside the model directory "
                              f"(shard files must be inside it): refused")
    return fname


class _File:
    """One safetensors file, its header checked entry by entry before any tensor is read: dtype known,
    shape a list of non-negative ints, data_offsets two ints inside the data section whose length
    matches the shape, no two tensors sharing bytes."""

    def __init__(self, path: str):
        self.path = path
        self.mm = None
        try:
            self._f = open(path, "rb")
        except OSError as e:
            raise CheckpointError(f"cannot open {path}: {e.strerror}") from None
        try:
            self._parse(path)
        except BaseException:
            self.close()
            raise

    def _parse(self, path: str) -> None:
        size = os.fstat(self._f.fileno()).st_size
        if size < 8:
            raise CheckpointError(f"{path} is truncated ({size} bytes): not a safetensors file")
        (hlen,) = struct.unpack("<Q", self._f.read(8))
        if hlen < 2 or hlen > min(size - 8, MAX_HEADER):
            raise CheckpointError(f"{path} is truncated or not safetensors (header of {hlen} bytes "
                                  f"in a file of {size})")
        try:
            self.header = json.loads(self._f.read(hlen), object_pairs_hook=_no_duplicates)
        except (ValueError, RecursionError) as e:
            raise CheckpointError(f"{path} has a malformed safetensors header: "
                                  f"{(str(e).splitlines() or ['not JSON'])[0][:100]}") from None
        if not isinstance(self.header, dict):
            raise CheckpointError(f"{path} has a malformed safetensors header (not a JSON object)")
        self.data_start = 8 + hlen
        self.size = size
        data = size - self.data_start
        meta = self.header.get("__metadata__")
        if meta is not None and not isinstance(meta, dict):
            raise CheckpointError(f"{path}: __metadata__ must be an object")
        spans = []
        for name, m in self.header.items():
            if name == "__metadata__":
                continue
            where = f"{path}: tensor {name[:100]}"
            if not isinstance(m, dict) or not {"dtype", "shape", "data_offsets"} <= set(m):
                raise CheckpointError(f"{where} has a malformed header entry (needs dtype, shape, data_offsets)")
            dtype, shape, offs = m["dtype"], m["shape"], m["data_offsets"]
            if not isinstance(dtype, str) or dtype not in DTYPES:
                raise CheckpointError(f"{where} has unsupported dtype {str(dtype)[:20]} "
                                      f"(supported: {', '.join(DTYPES)})")
            if (not isinstance(shape, list) or len(shape) > MAX_DIMS
                    or not all(_is_count(x) for x in shape)):
                raise CheckpointError(f"{where} has shape {str(shape)[:60]}: not a list of at most "
                                      f"{MAX_DIMS} non-negative integers")
            if not isinstance(offs, list) or len(offs) != 2 or not all(_is_count(x) for x in offs):
                raise CheckpointError(f"{where} has data_offsets {str(offs)[:60]}: not a list of two "
                                      f"non-negative integers")
            b, e = offs
            if b > e:
                raise CheckpointError(f"{where} has data_offsets [{b}, {e}]: the end is before the start")
            if e > data:
                raise CheckpointError(f"{path} is truncated: tensor {name[:100]} ends at byte "
                                      f"{self.data_start + e} of {size}")
            n = math.prod(shape) * ITEMSIZE[dtype]      # Python ints: no overflow
            if e - b != n:
                raise CheckpointError(f"{where} has {e - b} bytes for shape {shape} {dtype} ({n} needed)")
            spans.append((b, e, name))
        spans.sort()
        for (b0, e0, n0), (b1, e1, n1) in zip(spans, spans[1:]):
            if b1 < e0:
                raise CheckpointError(f"{path}: tensors {n0[:80]} and {n1[:80]} overlap (bytes "
                                      f"{b1}..{min(e0, e1)} of the data section belong to both)")
        self.mm = mmap.mmap(self._f.fileno(), 0, access=mmap.ACCESS_READ)

    def tensors(self):
        return [n for n in self.header if n != "__metadata__"]

    def close(self):
        if self.mm is not None:
            self.mm.close()
            self.mm = None
        self._f.close()


class CheckpointReader:
    """Opens a checkpoint, checks every expected tensor, then serves lane slices on demand.

    It is also the tensor source of a Laneformer directory (kog_dist.formats.open_model's "laneformer"
    kind): the same attributes and methods as the HF and GGUF sources."""

    kind = "laneformer"
    gguf_fields: dict = {}

    def __init__(self, model_dir: str, cfg: LaneformerConfig | None = None):
        if not os.path.isdir(model_dir):
            raise CheckpointError(f"model directory {model_dir} does not exist")
        self.dir = model_dir
        self.path = os.path.abspath(model_dir)
        self.model_dir = self.path
        self.name = os.path.basename(self.path.rstrip(os.sep)) or self.path
        self.gguf_fields = {}
        self._closed = False
        try:
            self.cfg = cfg or load_config(model_dir)
        except ConfigError as e:
            raise CheckpointError(str(e)) from None
        self.files: dict[str, _File] = {}
        self.where: dict[str, _File] = {}
        self.nbytes_read = 0
        try:
            self._open_files(model_dir)
            self._validate()
        except BaseException:
            self.close()
            raise

    def _open_files(self, model_dir: str) -> None:
        index = os.path.join(model_dir, "model.safetensors.index.json")
        wmap = None
        if os.path.isfile(index):
            try:
                with open(index, "rb") as f:
                    wmap = json.loads(f.read())["weight_map"]
                assert isinstance(wmap, dict)
            except (ValueError, KeyError, TypeError, AssertionError, RecursionError):
                raise CheckpointError(f"{index} is malformed (needs a 'weight_map' object)") from None
            names = sorted({inside_dir(v, index) for v in wmap.values()})
        else:
            names = sorted(n for n in os.listdir(model_dir) if n.endswith(".safetensors"))
            if not names:
                raise CheckpointError(f"no .safetensors files in {model_dir}")
        for fname in names:
            self.files[fname] = _File(os.path.join(model_dir, fname))
        for fname, f in self.files.items():
            for name in f.tensors():
                if name in self.where:
                    raise CheckpointError(f"tensor {name[:100]} is in both {self.where[name].path} "
                                          f"and {f.path}")
                self.where[name] = f
        if wmap is not None:
            for name, fname in wmap.items():
                if name not in self.files[fname].header:
                    raise CheckpointError(f"{index} puts tensor {name[:100]} in {fname}, which does not hold it")

    def _validate(self) -> None:
        want = expected_tensors(self.cfg)
        for name, shape in want.items():
            f = self.where.get(name)
            if f is None:
                raise CheckpointError(f"tensor {name} is missing from the checkpoint in {self.dir}")
            got = tuple(f.header[name]["shape"])
            if got != shape:
                raise CheckpointError(f"tensor {name} has shape {list(got)}, the config needs {list(shape)}")
        extra = sorted(set(self.where) - set(want))
        if extra:
            c = self.cfg
            layers = sorted({int(p[2]) for p in (n.split(".") for n in extra)
                             if len(p) > 3 and p[:2] == ["model", "layers"] and p[2].isdigit()})
            why = (f": config.json says num_hidden_layers={c.num_hidden_layers} but the checkpoint has "
                   f"layer {layers[-1]}" if layers and layers[-1] >= c.num_hidden_layers else
                   " (the config does not describe this checkpoint)")
            raise CheckpointError(f"tensor {extra[0][:100]} in {self.where[extra[0]].path} is not part of "
                                  f"the model{why}" + (f"; {len(extra) - 1} more" if len(extra) > 1 else ""))

    def dtype(self, name: str) -> str:
        return self.where[name].header[name]["dtype"]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.where[name].header[name]["shape"])

    def has(self, name: str) -> bool:
        return name in self.where

    def names(self) -> list[str]:
        return sorted(self.where)

    def quant_type(self, name: str) -> str | None:
        return None

    def raw(self, name: str, lanes: range | None = None, rows: np.ndarray | None = None):
        """The storage bits of a tensor (or of lanes [a, b) of a lane-first one, or some rows of a
        2-D one) and the dtype name. BF16 comes back as a uint16 view."""
        f = self.where[name]
        meta = f.header[name]
        dt, shape = meta["dtype"], tuple(meta["shape"])
        np_dt = DTYPES[dt]
        start = f.data_start + meta["data_offsets"][0]
        arr = np.frombuffer(f.mm, dtype=np_dt, count=int(np.prod(shape)), offset=start).reshape(shape)
        if lanes is not None and is_lane_first(name):
            arr = arr[lanes.start:lanes.stop]
        if rows is not None:
            arr = arr[rows]
        out = np.array(arr, copy=True)  # copies only the pages of the selected slice
        self.nbytes_read += out.nbytes
        return out, dt

    def tensor(self, name: str, lanes: range | None = None, rows: np.ndarray | None = None) -> np.ndarray:
        return to_float32(*self.raw(name, lanes, rows))

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            for f in self.files.values():
                f.close()


def to_float32(arr: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "BF16":
        return (arr.astype(np.uint32) << 16).view(np.float32)
    return arr.astype(np.float32)


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bits, rounding to nearest even. In slices: the uint64 temporaries of a whole
    embedding (525M values for Llama 3's) would take 17 GB."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    out = np.empty(x.shape, np.uint16)
    src, dst = x.reshape(-1).view(np.uint32), out.reshape(-1)
    step = 1 << 20
    for s in range(0, src.size, step):
        u = src[s:s + step].astype(np.uint64)
        dst[s:s + step] = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return out


class Weights(dict):
    """name -> float32 array; lane-first tensors hold only `lanes`. Norm scales are always [L_local, D]."""
    lanes: range
    nbytes_stored: int = 0


def load_weights(src, lanes: range | None = None, progress: bool | None = None,
                 cfg: LaneformerConfig | None = None, store: str | None = None):
    """Read the config and the (lane-sliced) weights as float32. `src` is a tensor source
    (kog_dist.formats.open_model) or a path, opened here. Returns (cfg, Weights, source).
    The embedding table stays in the source: rows are read on demand. `store` ("BF16", "F16", "Q8_0",
    "Q4_0", "Q4_1"): the layer matrices take the values they have once stored so (`--dtype`), as the
    GPU stores them, so every backend computes the same function."""
    if isinstance(src, (str, os.PathLike)):
        if cfg is not None:
            src = CheckpointReader(os.fspath(src), cfg)
        else:
            # formats builds on this module (its sources reuse the safetensors reader): imported here
            # to keep the import one-way at module level.
            from .formats import open_model
            src = open_model(os.fspath(src), progress=progress)
    cfg = src.cfg
    lanes = lanes if lanes is not None else range(cfg.num_lanes)
    names = [n for n in expected_tensors(cfg) if n != "model.tok_embeddings.weight"]
    total = sum(_slice_bytes(src, n, lanes, cfg) for n in names)
    if progress is None:
        progress = getattr(src, "progress", None)
    if progress is None:
        progress = total > (256 << 20)
    w = Weights()
    w.lanes = lanes
    with Progress("loading weights", total, enabled=progress) as bar:
        for n in names:
            a = src.tensor(n, lanes)
            check_finite(n, a)
            if store not in (None, "F32") and is_lane_first(n) and not n.endswith(".bias"):
                a = stored_values(a, store)
            if n.endswith("_norm.weight") or n == "model.norm.weight":
                a = np.broadcast_to(a, (len(lanes), cfg.hidden_size)).copy()
            key = n.replace(".scale", ".weight")
            w[key] = a
            w.nbytes_stored += a.nbytes
            bar.advance(_slice_bytes(src, n, lanes, cfg))
    if cfg.tie_word_embeddings:
        w["lm_head.weight"] = check_finite("model.tok_embeddings.weight",
                                           src.tensor("model.tok_embeddings.weight"))
    else:   # the table stays on disk: a sample of its rows now, each row read later (Model.embed)
        V = cfg.vocab_size
        rows = np.unique(np.linspace(0, V - 1, min(V, 64)).astype(np.int64))
        check_finite("model.tok_embeddings.weight", src.tensor("model.tok_embeddings.weight", rows=rows))
        w.nbytes_stored += w["lm_head.weight"].nbytes
    return cfg, w, src


def stored_values(a: np.ndarray, store: str) -> np.ndarray:
    """float32 values of `a` after storage as `store` (round to nearest even for BF16 and F16; GGUF's
    round to nearest and exact dequantization for the quantized types)."""
    if store == "BF16":
        return to_float32(bf16_bits(a), "BF16")
    if store == "F16":
        return a.astype(np.float16).astype(np.float32)
    from .formats.quant import round_trip      # see load_weights
    return round_trip(a, store)


class Model:
    """What a rank needs of a checkpoint: config, its lanes' weights, embedding rows on demand.
    `src`: a tensor source from kog_dist.formats.open_model, or a path (opened here). The Model owns
    the source from then on: close() closes it. `store`: see load_weights."""

    def __init__(self, src, lanes: range | None = None, progress: bool | None = None, store: str | None = None):
        if isinstance(src, (str, os.PathLike)):
            from .formats import open_model    # see load_weights
            src = open_model(os.fspath(src), progress=progress)
        try:
            self.cfg, self.weights, self.reader = load_weights(src, lanes, progress, store=store)
        except BaseException:       # the source is the Model's from the start: a failed load closes it
            src.close()
            raise
        self.src = self.reader
        self.dir = self.reader.model_dir
        self.lanes = self.weights.lanes

    def embed(self, ids) -> np.ndarray:
        ids = np.asarray(ids, dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= self.cfg.vocab_size):
            raise ValueError(f"token id outside the vocabulary (0..{self.cfg.vocab_size - 1})")
        return check_finite("model.tok_embeddings.weight",
                            self.reader.tensor("model.tok_embeddings.weight", rows=ids), ids)

    def close(self) -> None:
        self.reader.close()


def check_finite(name: str, a: np.ndarray, rows=None) -> np.ndarray:
    """`a` if every value is finite; a CheckpointError naming the tensor (and its first bad row)
    otherwise: a NaN or inf weight makes every later logit NaN, which decodes as token 0 forever.
    `rows`: the tensor rows `a` holds, for the message. About 10 ms per 100 MB of float32."""
    a = np.asarray(a)
    if a.dtype.kind == "f" and not np.isfinite(a).all():
        bad = ~np.isfinite(a.reshape(a.shape[0], -1) if a.ndim > 1 else a.reshape(-1, 1))
        first = int(np.argmax(bad.any(axis=1)))
        row = int(np.asarray(rows).reshape(-1)[first]) if rows is not None else first
        raise CheckpointError(f"tensor {name} holds non-finite values (NaN or inf; {int(bad.sum())} of "
                              f"{a.size}, the first in row {row}): the checkpoint is damaged")
    return a


# exponent bits all ones: inf or NaN, for the 16-bit storage types (no conversion to float32 needed)
_NONFINITE_MASK = {"F16": 0x7C00, "BF16": 0x7F80}


def check_finite_bits(name: str, bits: np.ndarray, dtype: str, sample: int | None = None) -> np.ndarray:
    """check_finite on storage bits as raw() serves them ("F32" float32, "F16" float16, "BF16" uint16
    bits). `sample`: check only that many rows spread over the tensor (an upload path that must not
    pay a full pass: a NaN layer is still caught). Returns `bits`."""
    a, rows = np.asarray(bits), None
    if a.ndim > 1 and sample is not None:
        flat = a.reshape(-1, a.shape[-1])      # rows of the last axis, counted over the leading ones
        rows = np.unique(np.linspace(0, len(flat) - 1, min(len(flat), sample)).astype(np.int64))
        a = flat[rows]
    if dtype in _NONFINITE_MASK:
        m = _NONFINITE_MASK[dtype]
        if ((a.view(np.uint16) & m) == m).any():
            check_finite(name, to_float32(a.view(np.uint16) if dtype == "BF16" else a, dtype), rows)
        return bits
    check_finite(name, a, rows)
    return bits


def _slice_bytes(src, name: str, lanes: range, cfg: LaneformerConfig) -> int:
    n = int(np.prod(src.shape(name), dtype=np.int64)) * ITEMSIZE[src.dtype(name)]
    return n * len(lanes) // cfg.num_lanes if is_lane_first(name) else n


# -- writing ----------------------------------------------------------------------------------------
def save_safetensors(path: str, tensors: dict[str, tuple[np.ndarray, str]], metadata: dict | None = None):
    """Write tensors given as (array of storage bits or float32, dtype name) in the safetensors format."""
    header, blobs, off = {}, [], 0
    for name, (arr, dt) in tensors.items():
        if dt == "BF16" and arr.dtype != np.uint16:
            arr = bf16_bits(arr)
        elif dt != "BF16":
            arr = np.asarray(arr, dtype=DTYPES[dt])
        b = np.ascontiguousarray(arr).tobytes()
        header[name] = {"dtype": dt, "shape": list(arr.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    with open(path, "wb") as f:
        _write_header(f, header, metadata)
        for b in blobs:
            f.write(b)


def _write_header(f, header: dict, metadata: dict | None) -> None:
    """safetensors' header: its 8-byte length, then the JSON (tensors and __metadata__), padded to 8 bytes."""
    if metadata:
        header["__metadata__"] = {k: str(v) for k, v in metadata.items()}
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    f.write(struct.pack("<Q", len(h)))
    f.write(h)


def write_safetensors_stream(path: str, specs: list[tuple[str, str, tuple]], produce, metadata: dict | None = None,
                             done=None):
    """save_safetensors for models too big to hold: `specs` [(name, dtype, shape)] fix the header,
    then produce(name) gives each tensor in that order, one at a time: its storage bits (or float32),
    or an iterable of flat pieces of its storage bits; done(nbytes) is called as they are written."""
    header, off = {}, 0
    for name, dt, shape in specs:
        nb = math.prod(shape) * ITEMSIZE[dt]
        header[name] = {"dtype": dt, "shape": list(shape), "data_offsets": [off, off + nb]}
        off += nb
    with open(path, "wb") as f:
        _write_header(f, header, metadata)
        for name, dt, shape in specs:
            arr = produce(name)
            if isinstance(arr, np.ndarray):
                if dt == "BF16" and arr.dtype != np.uint16:
                    arr = bf16_bits(arr)
                elif dt != "BF16":
                    arr = np.asarray(arr, dtype=DTYPES[dt])
                if tuple(arr.shape) != tuple(shape):
                    raise ValueError(f"{name}: produced shape {list(arr.shape)}, the header says {list(shape)}")
                arr = [arr]
            n = 0
            for piece in arr:
                f.write(memoryview(np.ascontiguousarray(piece)).cast("B"))
                n += piece.nbytes
                if done is not None:
                    done(piece.nbytes)
            want = header[name]["data_offsets"][1] - header[name]["data_offsets"][0]
            if n != want:
                raise ValueError(f"{name}: produced {n} bytes, the header says {want}")
