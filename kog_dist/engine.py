"""The numpy reference engine: the whole Laneformer function of spec/laneformer.md, for a set of lanes.

With all lanes local (one process) this is the executable form of the spec that every faster path is
compared with. A rank of a distributed job runs the same code on its own lanes, with an `exchange`
that carries the lane sums to and from the other ranks (DTP: post now, collect δ layers later).
Computation is float32 whatever the storage dtype.
"""
from __future__ import annotations

import math
from collections import deque

import numpy as np

from .config import LaneformerConfig, rope_inv_freq


class LocalExchange:
    """Every lane is in this process: the sum over all lanes is the sum over the local ones."""

    def allreduce(self, tag: str, x: np.ndarray) -> np.ndarray:
        return x

    def post(self, tag: str, x: np.ndarray):
        return x

    def collect(self, handle) -> np.ndarray:
        return handle


def rms(x: np.ndarray, g: np.ndarray, eps: float) -> np.ndarray:
    """x [nl, T, D], g [nl, D]."""
    inv = 1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + np.float32(eps))
    return (x * inv) * g[:, None, :]


def matvec(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Per lane x @ w^T: x [nl, T, in], w [nl, out, in] -> [nl, T, out]."""
    return np.matmul(x, w.transpose(0, 2, 1))


class KVCache:
    """One layer's keys and values for the local lanes, grown by doubling: [nl, KVl, cap, hd]."""

    def __init__(self, nl: int, kvl: int, hd: int, cap: int = 64):
        self.k = np.zeros((nl, kvl, cap, hd), np.float32)
        self.v = np.zeros_like(self.k)

    def ensure(self, n: int) -> None:
        cap = self.k.shape[2]
        if n > cap:
            new = max(n, 2 * cap)
            for name in ("k", "v"):
                old = getattr(self, name)
                grown = np.zeros(old.shape[:2] + (new,) + old.shape[3:], np.float32)
                grown[:, :, :cap] = old
                setattr(self, name, grown)


class ReferenceEngine:
    def __init__(self, cfg: LaneformerConfig, weights, embed, lanes: range | None = None,
                 exchange=None, max_seq: int | None = None, prefill_chunk: int | None = None,
                 tp: bool = False):
        """`weights`: kog_dist.checkpoint.Weights for `lanes`; `embed(ids) -> [T, D]` float32 rows of the
        embedding table; `lm_head` [V, D] is in weights (or the embedding table when tied).
        tp: this rank holds a tensor-parallel shard of a one-lane model (kog_dist.tp; cfg is the shard's):
        every attention and MLP partial is summed over the ranks by `exchange.allreduce`, and the
        logits returned are those of the rank's vocabulary rows."""
        self.cfg = cfg
        self.w = weights
        self.embed = embed
        self.lanes = lanes if lanes is not None else range(cfg.num_lanes)
        self.ex = exchange or LocalExchange()
        self.max_seq = min(max_seq or cfg.max_position_embeddings, cfg.max_position_embeddings)
        nl = len(self.lanes)
        self.caches = [KVCache(nl, cfg.kv_heads_per_lane, cfg.head_dim) for _ in range(cfg.num_hidden_layers)]
        self.inv_freq = rope_inv_freq(cfg)                      # rope_scaling applied there
        self.pos = 0
        self.prefill_chunk = prefill_chunk   # tokens per forward pass (bounds the exchange payload)
        self.tp = tp

    # -- state -----------------------------------------------------------------------------------
    def truncate(self, n: int) -> None:
        """Forget cached positions >= n (the cache keeps the first n)."""
        if not 0 <= n <= self.pos:
            raise ValueError(f"cannot keep {n} positions of a cache holding {self.pos}")
        self.pos = n

    def prefill(self, ids) -> np.ndarray:
        """Run the prompt (batched) after what the cache holds; logits [V] of its last position."""
        ids = np.asarray(ids, dtype=np.int64)
        c = self.prefill_chunk or len(ids)
        for s in range(0, len(ids), c):               # causal: chunks after one another are exact
            logits = self.forward(ids[s:s + c])
        return logits[-1]

    def step(self, token_id: int) -> np.ndarray:
        return self.forward(np.asarray([token_id], dtype=np.int64))[-1]

    # -- the model ----------------------------------------------------------------------------------
    def forward(self, ids: np.ndarray, all_logits: bool = False) -> np.ndarray:
        cfg, w = self.cfg, self.w
        T = len(ids)
        if T == 0:
            raise ValueError("nothing to run: empty token list")
        if self.pos + T > self.max_seq:
            raise ValueError(f"context of {self.pos + T} tokens exceeds the limit of {self.max_seq}")
        pos = np.arange(self.pos, self.pos + T)
        nl, N, delta = len(self.lanes), cfg.num_hidden_layers, cfg.broadcast_delay
        sqrtL = np.float32(math.sqrt(cfg.num_lanes))
        x = self.embed(ids).astype(np.float32)
        h = np.repeat(x[None], nl, axis=0)                      # every lane starts from the embedding
        cos, sin = self._rope(pos)
        pending = {"attn": deque(), "mlp": deque()}   # (layer, known sum or None, exchange handle, own partials)
        for i in range(N):
            p = f"model.layers.{i}."
            a = self._attention(i, rms(h, w[p + "attention_norm.weight"], cfg.norm_eps), pos, cos, sin)
            h = h + self._combine("attn", i, a, pending, sqrtL)
            n = rms(h, w[p + "ffn_norm.weight"], cfg.norm_eps)
            gate = matvec(n, w[p + "feed_forward.w1.weight"])
            up = matvec(n, w[p + "feed_forward.w3.weight"])
            m = matvec(gate / (1.0 + np.exp(-gate)) * up, w[p + "feed_forward.w2.weight"])
            h = h + self._combine("mlp", i, m, pending, sqrtL)
        self.pos += T
        y_local = rms(h if all_logits else h[:, -1:], w["model.norm.weight"], cfg.norm_eps).sum(axis=0)
        # tensor parallel: every rank holds the whole residual stream already
        y = y_local if self.tp else self.ex.allreduce("final", y_local) / np.float32(cfg.num_lanes)
        head = w["lm_head.weight"] if "lm_head.weight" in w else w["model.tok_embeddings.weight"]
        return y @ head.T

    def _combine(self, kind: str, i: int, part: np.ndarray, pending: dict, sqrtL) -> np.ndarray:
        """The spec's combine rule for this layer's partials `part` [nl, T, D] of the local lanes."""
        cfg, delta, N = self.cfg, self.cfg.broadcast_delay, self.cfg.num_hidden_layers
        if self.tp:      # one lane split by heads / FFN columns: the partials of every rank, now
            return self.ex.allreduce(kind, part[0])[None]
        if not cfg.use_comm:
            return sqrtL * part
        early = i < delta
        needed_later = i + delta < N and (not early or cfg.early_layers_to_future)
        if early and cfg.use_early_comm:
            total = self.ex.allreduce(kind, part.sum(axis=0))
            if needed_later:
                pending[kind].append((i, total, None, part))
            return np.broadcast_to(total, part.shape)
        if needed_later:
            pending[kind].append((i, None, self.ex.post(kind, part.sum(axis=0)), part))
        delta_term = 0.0
        if not early and pending[kind] and pending[kind][0][0] == i - delta:
            _, total, handle, own = pending[kind].popleft()
            if total is None:
                total = self.ex.collect(handle)
            delta_term = total[None] - own                      # the other lanes, δ layers late
        return (sqrtL * part) if early else part + delta_term

    def _attention(self, i: int, n: np.ndarray, pos: np.ndarray, cos, sin) -> np.ndarray:
        cfg, w = self.cfg, self.w
        p = f"model.layers.{i}.attention."
        nl, T, _ = n.shape
        hd, hl, kvl = cfg.head_dim, cfg.heads_per_lane, cfg.kv_heads_per_lane
        q, k, v = (matvec(n, w[p + f"w{x}.weight"]) for x in "qkv")
        if cfg.attention_bias:                  # Qwen2: after the projection, before RoPE
            q, k, v = (y + w[p + f"b{x}.bias"][:, None, :] for x, y in zip("qkv", (q, k, v)))
        q = _rope(q.reshape(nl, T, hl, hd), cos, sin)
        k = _rope(k.reshape(nl, T, kvl, hd), cos, sin)
        v = v.reshape(nl, T, kvl, hd)
        c = self.caches[i]
        S = int(pos[-1]) + 1
        c.ensure(S)
        c.k[:, :, pos[0]:S] = k.transpose(0, 2, 1, 3)
        c.v[:, :, pos[0]:S] = v.transpose(0, 2, 1, 3)
        j = np.arange(S)
        visible = j[None, :] <= pos[:, None]
        if cfg.is_sliding(i):
            visible &= j[None, :] > pos[:, None] - cfg.sliding_window
        g = hl // kvl
        qg = q.reshape(nl, T, kvl, g, hd)
        scores = np.einsum("ltkgd,lksd->lkgts", qg, c.k[:, :, :S]) * np.float32(1.0 / math.sqrt(hd))
        scores = np.where(visible, scores, -np.inf)
        scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
        probs = scores / scores.sum(axis=-1, keepdims=True)
        out = np.einsum("lkgts,lksd->ltkgd", probs, c.v[:, :, :S]).reshape(nl, T, hl * hd)
        return matvec(out.astype(np.float32), w[p + "wo.weight"])

    def _rope(self, pos: np.ndarray):
        ang = pos[:, None].astype(np.float64) * self.inv_freq[None, :]   # angles in float64, then float32
        return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


def _rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate interleaved pairs (x[2k], x[2k+1]) of x [nl, T, heads, hd] by the angles of each position."""
    x0, x1 = x[..., 0::2], x[..., 1::2]
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    out = np.empty_like(x)
    out[..., 0::2] = x0 * c - x1 * s
    out[..., 1::2] = x0 * s + x1 * c
    return out
