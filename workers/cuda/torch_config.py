"""The spec's config and checkpoint layout for the PyTorch model (:mod:`workers.cuda.torch_model`):
the published 2B dimensions, the config normalised and checked (:class:`ModelShape`), and every tensor's
name and shape. Plain Python: this module never imports torch. :mod:`workers.cuda.torch_model` (and so
:mod:`workers.cuda.torch_baseline`) re-exports its public names.

Public API::

    SHAPE_2B: dict                                # the published 2B dimensions (spec keys)
    ModelShape(cfg) / model_shape(cfg); weight_shapes(cfg) -> dict[str, tuple[int, ...]]
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

from kog_dist.shapes import SHAPES

__all__ = [
    "SHAPE_2B",
    "ModelShape",
    "model_shape",
    "weight_shapes",
]


# ---------------------------------------------------------------------------------------------------------
# Config

#: The published Laneformer 2B dimensions (spec: "The 2B checkpoint").
#: The published 2B dimensions, from kog_dist.shapes (the one definition).
SHAPE_2B: dict = {k: v for k, v in SHAPES["2b"].items() if k not in ("bos_token_id", "eos_token_id")}

_DEFAULTS = {
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": None,
    "intermediate_size": 16384,
    "vocab_size": 128256,
    "num_lanes": 1,
    "broadcast_delay": 1,
    "use_comm": True,
    "use_early_comm": True,
    "early_layers_to_future": True,
    "rope_theta": 10000.0,
    "norm_eps": 1e-5,
    "sliding_window": None,
    "sliding_window_n_layers": 0,
    "lm_head_type": "replicate",
    "replicated_rmsn_scale": True,
    "max_position_embeddings": 131072,
    "tie_word_embeddings": False,
}


def _cfg_get(cfg: Any, key: str):
    if isinstance(cfg, Mapping):
        v = cfg.get(key)
    else:
        v = getattr(cfg, key, None)
    return _DEFAULTS[key] if v is None else v


class ModelShape:
    """The spec's config, normalised: from a dict of the spec's keys or any object with those attributes
    (e.g. ``kog_dist.config.LaneformerConfig``)."""

    def __init__(self, cfg: Any):
        g = functools.partial(_cfg_get, cfg)
        self.D = int(g("hidden_size"))
        self.N = int(g("num_hidden_layers"))
        self.H = int(g("num_attention_heads"))
        kv = g("num_key_value_heads")
        self.KV = self.H if kv is None else int(kv)
        self.F = int(g("intermediate_size"))
        self.V = int(g("vocab_size"))
        self.L = int(g("num_lanes"))
        self.delay = int(g("broadcast_delay"))
        self.use_comm = bool(g("use_comm"))
        self.use_early_comm = bool(g("use_early_comm"))
        self.early_to_future = bool(g("early_layers_to_future"))
        self.rope_theta = float(g("rope_theta"))
        self.eps = float(g("norm_eps"))
        w = g("sliding_window")
        self.W = None if w is None else int(w)
        self.S = int(g("sliding_window_n_layers"))
        self.lm_head_type = str(g("lm_head_type"))
        self.replicated_rmsn_scale = bool(g("replicated_rmsn_scale"))
        self.max_pos = int(g("max_position_embeddings"))
        self.tied = bool(g("tie_word_embeddings"))
        if self.H <= 0 or self.D % self.H:
            raise ValueError(f"hidden_size {self.D} is not a multiple of num_attention_heads {self.H}")
        self.hd = self.D // self.H
        if self.hd % 2:
            raise ValueError(f"head_dim {self.hd} is odd; RoPE rotates pairs")
        for name, v in (("num_attention_heads", self.H), ("num_key_value_heads", self.KV),
                        ("intermediate_size", self.F)):
            if self.L <= 0 or v % self.L:
                raise ValueError(f"{name} {v} is not a multiple of num_lanes {self.L}")
        if self.H % self.KV:
            raise ValueError(f"num_attention_heads {self.H} is not a multiple of num_key_value_heads {self.KV}")
        if self.delay < 0:
            raise ValueError(f"broadcast_delay {self.delay} < 0")
        if self.lm_head_type != "replicate":
            raise ValueError(f"lm_head_type {self.lm_head_type!r} is not supported (only 'replicate')")
        self.Hl = self.H // self.L
        self.KVl = self.KV // self.L
        self.Fl = self.F // self.L
        self.G = self.H // self.KV

    @property
    def head_dim(self) -> int:
        return self.hd

    def is_sliding(self, layer: int) -> bool:
        if self.W is None:
            return False
        if self.S >= 0:
            return layer < self.S
        return layer >= self.N + self.S


def model_shape(cfg: Any) -> ModelShape:
    return cfg if isinstance(cfg, ModelShape) else ModelShape(cfg)


def weight_shapes(cfg: Any) -> dict[str, tuple[int, ...]]:
    """Every tensor of the spec's checkpoint layout, name -> shape."""
    c = model_shape(cfg)
    L, D, hd = c.L, c.D, c.hd
    shapes: dict[str, tuple[int, ...]] = {"model.tok_embeddings.weight": (c.V, D)}
    norm_suffix, norm_shape = ("weight", (D,)) if c.replicated_rmsn_scale else ("scale", (L, D))
    for i in range(c.N):
        p = f"model.layers.{i}."
        shapes[p + "attention_norm." + norm_suffix] = norm_shape
        shapes[p + "attention.wq.weight"] = (L, c.Hl * hd, D)
        shapes[p + "attention.wk.weight"] = (L, c.KVl * hd, D)
        shapes[p + "attention.wv.weight"] = (L, c.KVl * hd, D)
        shapes[p + "attention.wo.weight"] = (L, D, c.Hl * hd)
        shapes[p + "ffn_norm." + norm_suffix] = norm_shape
        shapes[p + "feed_forward.w1.weight"] = (L, c.Fl, D)
        shapes[p + "feed_forward.w3.weight"] = (L, c.Fl, D)
        shapes[p + "feed_forward.w2.weight"] = (L, D, c.Fl)
    shapes["model.norm." + norm_suffix] = norm_shape
    if not c.tied:
        shapes["lm_head.weight"] = (c.V, D)
    return shapes
