"""Random checkpoints in the spec's layout (config.json + safetensors), for tests, demos and benchmarks,
and the built-in default model that `kog generate` uses when no --model is given."""
from __future__ import annotations

import json
import os
import shutil

import numpy as np

from .checkpoint import expected_tensors, save_safetensors
from .config import LaneformerConfig

TINY_DEFAULTS = dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=8,
                     intermediate_size=256, vocab_size=512, num_lanes=4, broadcast_delay=2,
                     max_position_embeddings=4096, bos_token_id=1, eos_token_id=2)
DEFAULT_MODEL_VERSION = "tiny-v1"


def write_tiny_checkpoint(out_dir: str, *, dtype: str = "F32", shards: int = 1, seed: int = 0,
                          **config) -> LaneformerConfig:
    """Write a random Laneformer. `config` takes the spec's keys; missing ones take TINY_DEFAULTS."""
    d = dict(TINY_DEFAULTS)
    d.update({k: v for k, v in config.items() if v is not None or k in ("num_key_value_heads", "sliding_window")})
    d["model_type"] = "laneformer_tp"
    cfg = LaneformerConfig.from_dict(d)
    if dtype not in ("F32", "F16", "BF16"):
        raise ValueError(f"dtype must be F32, F16 or BF16, got {dtype}")
    rng = np.random.default_rng(seed)
    D = cfg.hidden_size
    tensors = {}
    for name, shape in expected_tensors(cfg).items():
        if "norm" in name:
            a = 1.0 + 0.1 * rng.standard_normal(shape)
        elif "tok_embeddings" in name:
            a = rng.standard_normal(shape)
        else:
            fan_in = shape[-1]
            a = rng.standard_normal(shape) * (1.0 / np.sqrt(fan_in))
            if name == "lm_head.weight":
                a *= 2.0  # logits of order a few units: sampling has something to choose between
        tensors[name] = (a.astype(np.float32), dtype)
    os.makedirs(out_dir, exist_ok=True)
    for f in os.listdir(out_dir):
        if f.endswith(".safetensors") or f == "model.safetensors.index.json":
            os.remove(os.path.join(out_dir, f))
    cd = cfg.to_dict()
    cd["torch_dtype"] = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}[dtype]
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cd, f, indent=2)
    names = list(tensors)
    shards = max(1, min(shards, len(names)))
    if shards == 1:
        save_safetensors(os.path.join(out_dir, "model.safetensors"), tensors, {"format": "pt"})
    else:
        groups = np.array_split(np.arange(len(names)), shards)
        wmap = {}
        for s, idx in enumerate(groups):
            fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
            part = {names[i]: tensors[names[i]] for i in idx}
            save_safetensors(os.path.join(out_dir, fname), part, {"format": "pt"})
            wmap.update({n: fname for n in part})
        total = sum(a.size * (4 if dt == "F32" else 2) for a, dt in tensors.values())
        with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": wmap}, f, indent=1)
    return cfg


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
