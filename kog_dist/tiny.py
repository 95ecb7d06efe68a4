"""Random checkpoints, for tests, demos and benchmarks: in the spec's layout (config.json + safetensors)
or, for one-lane models, as a GGUF file in any storage type gguf_file loads (K-quant mixes included);
and the built-in default model that `kog generate` uses when no --model is given.

Tensors are made and written one at a time (an 8B model never sits in memory). Small models take
seeded standard normals, the values they always had; past FAST_PARAMS the values come from a pool of
seeded normals, encoded once in the storage type (elements, or whole quant blocks) and copied in runs
from random offsets: numpy's generator makes some 10^8 normals a second, too slow for 8B weights."""
from __future__ import annotations

import json
import math
import os
import shutil

import numpy as np
from gguf import GGML_QUANT_SIZES

from .checkpoint import ITEMSIZE, bf16_bits, expected_tensors, write_safetensors_stream
from .config import LaneformerConfig
from .formats.gguf_write import (PLAIN_ITEMSIZE, ROPE_FREQS, GGUFModelWriter, byte_shape, encode, gguf_layout,
                                 rope_factors)
from .progress import Progress
from .shapes import SHAPES

TINY_DEFAULTS = dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=8,
                     intermediate_size=256, vocab_size=512, num_lanes=4, broadcast_delay=2,
                     max_position_embeddings=4096, bos_token_id=1, eos_token_id=2)
DEFAULT_MODEL_VERSION = "tiny-v1"
FAST_PARAMS = 300_000_000
POOL = 1 << 23                      # values in a pool: runs of up to half of it are copied
PROGRESS_BYTES = 256 << 20


def _recipe(name: str, shape) -> tuple[float, float, float]:
    """A tensor's values are off + (scale * normal) * gain."""
    if "norm" in name:
        return 1.0, 0.1, 1.0
    if "tok_embeddings" in name:
        return 0.0, 1.0, 1.0
    # lm_head: logits of order a few units, so sampling has something to choose between
    return 0.0, 1.0 / np.sqrt(shape[-1]), 2.0 if name == "lm_head.weight" else 1.0


class _Values:
    """The stored form of each tensor, made on demand: encode(float32 array) -> stored array."""

    def __init__(self, seed: int, fast: bool):
        self.rng = np.random.default_rng(seed)
        self.fast = fast
        self.pools: dict = {}

    def make(self, name: str, shape, encode, key, out_shape=None, unit: int = 1):
        """encode(float32 values of `shape`): one array (small models), or for a fast fill pieces of the
        stored array, flat, which together have `out_shape` (default: `shape`): runs of whole `unit`s (a
        quant block's bytes) out of the pool of (key, recipe), written as they are (no copy is made)."""
        off, scale, gain = _recipe(name, shape)
        if not self.fast:
            return encode((off + (scale * self.rng.standard_normal(shape)) * gain).astype(np.float32))
        scale *= gain
        pool = self.pools.get((key, off, float(scale)))
        if pool is None:
            v = off + scale * self.rng.standard_normal((POOL // 256, 256), dtype=np.float32)
            pool = self.pools[(key, off, float(scale))] = np.ascontiguousarray(encode(v)).reshape(-1)
        return self._runs(pool, math.prod(shape if out_shape is None else out_shape), unit)

    def _runs(self, pool, total, unit):
        run = (pool.size // 2) // unit * unit
        at = 0
        while at < total:
            n = min(run, total - at)
            o = int(self.rng.integers(0, (pool.size - n) // unit + 1)) * unit
            yield pool[o:o + n]
            at += n


def tiny_config(shape: str | None = None, **config) -> LaneformerConfig:
    d = dict(TINY_DEFAULTS) if shape is None else dict(SHAPES[shape]) if shape in SHAPES else None
    if d is None:
        raise ValueError(f"unknown shape {shape!r} (known: {', '.join(SHAPES)})")
    d.update({k: v for k, v in config.items() if v is not None or k in ("num_key_value_heads", "sliding_window")})
    d["model_type"] = "laneformer_tp"
    for k in ("bos_token_id", "eos_token_id"):     # a named shape cut to a small vocabulary
        if k not in config and isinstance(d.get(k), int) and d[k] >= d["vocab_size"]:
            d[k] = TINY_DEFAULTS[k]
    return LaneformerConfig.from_dict(d)


def write_tiny_checkpoint(out: str, *, dtype: str = "F32", shards: int = 1, seed: int = 0, shape: str | None = None,
                          fmt: str = "laneformer", progress: bool | None = None, **config) -> LaneformerConfig:
    """Write a random model. `config` takes the spec's keys; missing ones come from the named `shape`
    (kog_dist.shapes) or TINY_DEFAULTS. fmt "laneformer": a directory `out`, dtype F32 / F16 / BF16;
    fmt "gguf": a file `out` (a one-lane model), dtype any of gguf_write.GGUF_DTYPES."""
    cfg = tiny_config(shape, **config)
    tensors = expected_tensors(cfg)
    nparams = sum(math.prod(s) for s in tensors.values())
    vals = _Values(seed, fast=nparams > FAST_PARAMS)
    if fmt == "gguf":
        _write_gguf(out, cfg, tensors, dtype.lower(), vals, progress)
        return cfg
    if fmt != "laneformer":
        raise ValueError(f"format must be laneformer or gguf, got {fmt!r}")
    dtype = dtype.upper()
    if dtype not in ("F32", "F16", "BF16"):
        raise ValueError(f"dtype must be F32, F16 or BF16 (a Laneformer directory), got {dtype}")
    os.makedirs(out, exist_ok=True)
    for f in os.listdir(out):
        if f.endswith(".safetensors") or f == "model.safetensors.index.json":
            os.remove(os.path.join(out, f))
    cd = cfg.to_dict()
    cd["torch_dtype"] = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}[dtype]
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cd, f, indent=2)
    enc = {"F32": lambda a: a, "F16": lambda a: a.astype(np.float16), "BF16": bf16_bits}[dtype]
    names = list(tensors)
    total = nparams * ITEMSIZE[dtype]
    groups = np.array_split(np.arange(len(names)), max(1, min(shards, len(names))))
    wmap = {}
    with Progress("writing weights", total, enabled=total > PROGRESS_BYTES if progress is None else progress) as bar:
        for s, idx in enumerate(groups):
            fname = "model.safetensors" if len(groups) == 1 else f"model-{s + 1:05d}-of-{len(groups):05d}.safetensors"
            part = [names[i] for i in idx]

            def produce(n):
                a = vals.make(n, tensors[n], enc, dtype)
                return a.reshape(tensors[n]) if isinstance(a, np.ndarray) else a
            write_safetensors_stream(os.path.join(out, fname), [(n, dtype, tensors[n]) for n in part], produce,
                                     {"format": "pt"}, bar.advance)
            wmap.update({n: fname for n in part})
    if len(groups) > 1:
        with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": wmap}, f, indent=1)
    return cfg


def _write_gguf(path, cfg, tensors, dtype, vals, progress) -> None:
    layout = gguf_layout(cfg, tensors, dtype)
    types = {g: (s, qt) for g, s, qt in layout.values()}
    total = sum(math.prod(byte_shape(s, qt)) * PLAIN_ITEMSIZE.get(qt, 1) for s, qt in types.values())
    if os.path.isdir(path):
        raise ValueError(f"{path} is a directory: --format gguf writes one file")
    tmp = f"{path}.tmp{os.getpid()}"
    ok = False
    try:
        w = GGUFModelWriter(tmp, cfg, types)
        on = total > PROGRESS_BYTES if progress is None else progress
        with Progress("writing weights", total, enabled=on) as bar:
            for name, (g, s, qt) in layout.items():
                if g == ROPE_FREQS:
                    a = rope_factors(cfg)
                else:
                    unit = 1 if qt in PLAIN_ITEMSIZE else GGML_QUANT_SIZES[qt][1]
                    a = vals.make(name, s, lambda v, qt=qt: encode(v, qt), qt.name, byte_shape(s, qt), unit)
                bar.advance(w.write(g, a))
        w.close()
        os.replace(tmp, path)
        ok = True
    finally:
        if not ok and os.path.exists(tmp):
            os.remove(tmp)


def default_model_dir() -> str:
    """The built-in default model: a small random Laneformer (8 lanes, δ 2, sliding layers), written once
    into the user's cache so a fresh machine can decode with nothing downloaded."""
    root = os.environ.get("KOG_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "kog_dist")
    path = os.path.join(root, DEFAULT_MODEL_VERSION)
    if not os.path.isfile(os.path.join(path, "model.safetensors")):
        tmp = f"{path}.tmp{os.getpid()}"
        write_tiny_checkpoint(tmp, hidden_size=256, num_hidden_layers=6, num_attention_heads=16,
                              num_key_value_heads=8, intermediate_size=1024, vocab_size=512, num_lanes=8,
                              broadcast_delay=2, sliding_window=64, sliding_window_n_layers=3, seed=1234)
        try:
            os.replace(tmp, path)
        except OSError:  # another process won the race
            shutil.rmtree(tmp, ignore_errors=True)
    return path
