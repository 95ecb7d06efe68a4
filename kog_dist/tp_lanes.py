"""Tensor parallelism as lanes: a one-lane (Llama-family) model split over N ranks is the N-lane
Laneformer whose every layer is an early all-reduce (spec: broadcast_delay >= num_hidden_layers with
use_early_comm, so layer i adds sum_j p_j to every lane). Every lane then holds the same residual stream,
lane l's partials are rank l's Megatron shard (its query heads and the KV heads they read, its FFN
columns; wo and w2 by columns), and the final norm's lane mean is the one stream's norm. The cuda
backend's multi-rank monokernel runs such a model as it runs any Laneformer (lane partials over kccl LL
words, the LM head split by vocabulary with the greedy token merged from each rank's best candidate):
LaneSource is what it loads.

The function is the one-lane model's; only the summation order of wo and w2 over the heads and FFN
columns (float32 rounding) depends on N, as on the cpu backend's tensor parallelism (kog_dist/tp.py,
whose plan and slice reads this uses).
"""
from __future__ import annotations

import dataclasses

import numpy as np

from .checkpoint import to_float32
from .config import LaneformerConfig
from .tp import _slices, check_tp, read_block, tp_plan


def lanes_config(cfg: LaneformerConfig, n: int) -> LaneformerConfig:
    """The N-lane, all-early Laneformer config of one-lane `cfg` (refused in one line as check_tp does).
    KV heads replicated when ranks outnumber them: one a lane (query heads of lane l read KV head l)."""
    check_tp(cfg, n)
    kv = cfg.kv_heads if cfg.kv_heads % n == 0 else n
    return dataclasses.replace(cfg, num_lanes=n, num_key_value_heads=kv, broadcast_delay=cfg.num_hidden_layers,
                               use_comm=True, use_early_comm=True, early_layers_to_future=False,
                               head_dim_override=cfg.head_dim).validate()


def rank_config(cfg: LaneformerConfig, n: int) -> LaneformerConfig:
    """The config N ranks of the cuda backend run: a one-lane model's lanes_config, a Laneformer as it is."""
    return lanes_config(cfg, n) if cfg.num_lanes == 1 and n > 1 else cfg


class LaneSource:
    """A one-lane tensor source seen as lanes_config(src.cfg, n): lane-first tensors are served as
    [lanes, rows, columns] of each lane's shard (read with the source's block reader: safetensors
    get_slice, GGUF row ranges of whole blocks), the rest as the source serves them."""

    def __init__(self, src, n: int):
        self.src, self.n = src, n
        self.cfg = lanes_config(src.cfg, n)
        self.tp_ranks = n
        self.plans = [tp_plan(src.cfg, r, n) for r in range(n)]

    def __getattr__(self, name):        # name, path, model_dir, gguf_fields, nbytes_read, ...
        return getattr(self.src, name)

    def _lane_first(self, name: str) -> bool:
        return ".layers." in name and _slices(self.plans[0], name) != (None, None)

    def shape(self, name: str) -> tuple[int, ...]:
        if not self._lane_first(name):
            return self.src.shape(name)
        full = self.src.shape(name)[1:]             # the one-lane source's [1, rows(, cols)]: lane axis dropped
        cut = _slices(self.plans[0], name)[:len(full)]
        return (self.n,) + tuple(s.stop - s.start if s is not None else full[k] for k, s in enumerate(cut))

    def raw(self, name: str, lanes: range | None = None, rows=None):
        if not self._lane_first(name):
            return self.src.raw(name, None, rows) if rows is not None else self.src.raw(name)
        if rows is not None:
            raise ValueError(f"{name}: rows of a lane-first tensor")
        parts = [_block(self.src, name, *_slices(self.plans[lane], name))
                 for lane in (range(self.n) if lanes is None else lanes)]
        return np.ascontiguousarray(np.stack([a for a, _ in parts])), parts[0][1]

    def blocks(self, name: str, lanes: range | None = None):
        """A quantized tensor's bytes as the file stores them, as the one-lane source's blocks(name) serves
        them, and its GGML type's name. Lane-first tensors: [lanes, rows, bytes a row] of each lane's shard:
        whole rows of wq / wk / wv / w1 / w3, and of wo / w2 the bytes of the (super-)blocks that make up the
        lane's columns (a ValueError where a lane's cut falls inside a block: kquant_reason says so first)."""
        if not self._lane_first(name):
            return self.src.blocks(name)
        parts = [self.src.blocks(name, *_slices(self.plans[lane], name))
                 for lane in (range(self.n) if lanes is None else lanes)]
        return np.ascontiguousarray(np.stack([b for b, _ in parts])), parts[0][1]

    def column_cuts(self) -> dict[str, int]:
        """The columns of each lane's wo and w2 (heads * head_dim / N, intermediate_size / N): where the
        lanes' cuts fall in those rows."""
        c = self.src.cfg
        return {"wo": c.num_attention_heads * c.head_dim // self.n, "w2": c.intermediate_size // self.n}

    def tensor(self, name: str, lanes: range | None = None, rows=None) -> np.ndarray:
        return to_float32(*self.raw(name, lanes, rows))

    def close(self) -> None:
        self.src.close()


def _block(src, name, rows, cols):
    """(storage bits, dtype) of a one-lane tensor's rows x columns: the source's block reader, or float32."""
    if getattr(src, "block", None) is not None:
        return src.block(name, rows, cols)
    return read_block(src, name, rows, cols), "F32"
