"""The PyTorch model's view of the config (:mod:`workers.cuda.torch_model`): short names derived from the
one configuration type, kog_dist.config.LaneformerConfig, which also parses and checks it, and the
checkpoint's tensors (kog_dist.checkpoint.expected_tensors). Plain Python: this module never imports torch.

Public API::

    SHAPE_2B: dict                                # the published 2B dimensions (kog_dist.shapes)
    ModelShape(cfg) / model_shape(cfg); weight_shapes(cfg) -> dict[str, tuple[int, ...]]
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields
from typing import Any

from kog_dist.checkpoint import expected_tensors
from kog_dist.config import LaneformerConfig
from kog_dist.shapes import SHAPES

__all__ = [
    "SHAPE_2B",
    "ModelShape",
    "model_shape",
    "weight_shapes",
]

#: The published 2B dimensions, from kog_dist.shapes (the one definition).
SHAPE_2B: dict = {k: v for k, v in SHAPES["2b"].items() if k not in ("bos_token_id", "eos_token_id")}


def as_config(cfg: Any) -> LaneformerConfig:
    """A LaneformerConfig from one, from a dict of the spec's keys or an object with them as attributes, or
    from a ModelShape (its config)."""
    if isinstance(cfg, LaneformerConfig):
        return cfg.validate()
    if isinstance(cfg, ModelShape):
        return cfg.cfg
    if isinstance(cfg, Mapping):
        return LaneformerConfig.from_dict(dict(cfg))
    # any object with the spec's keys as attributes (a rank's view, a test's config class)
    return LaneformerConfig.from_dict({f.name: getattr(cfg, f.name) for f in fields(LaneformerConfig)
                                       if f.name != "extra" and hasattr(cfg, f.name)})


class ModelShape:
    """The config under the short names the PyTorch model's code uses (D, N, H, KV, hd, Hl, ...)."""

    def __init__(self, cfg: Any):
        c = self.cfg = as_config(cfg)
        self.D, self.N, self.H, self.KV = c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.kv_heads
        self.F, self.V, self.L, self.delay = c.intermediate_size, c.vocab_size, c.num_lanes, c.broadcast_delay
        self.use_comm, self.use_early_comm, self.early_to_future = c.use_comm, c.use_early_comm, c.early_layers_to_future
        self.rope_theta, self.eps = float(c.rope_theta), float(c.norm_eps)
        self.W, self.S = c.sliding_window, c.sliding_window_n_layers
        self.lm_head_type, self.replicated_rmsn_scale = c.lm_head_type, c.replicated_rmsn_scale
        self.max_pos, self.tied = c.max_position_embeddings, c.tie_word_embeddings
        self.hd, self.Hl, self.KVl, self.Fl = c.head_dim, c.heads_per_lane, c.kv_heads_per_lane, c.ffn_per_lane
        self.G = self.H // self.KV

    @property
    def head_dim(self) -> int:
        return self.hd

    def is_sliding(self, layer: int) -> bool:
        return self.cfg.is_sliding(layer)


def model_shape(cfg: Any) -> ModelShape:
    return cfg if isinstance(cfg, ModelShape) else ModelShape(cfg)


def weight_shapes(cfg: Any) -> dict[str, tuple[int, ...]]:
    """Every tensor of the spec's checkpoint layout, name -> shape."""
    return expected_tensors(as_config(cfg))
