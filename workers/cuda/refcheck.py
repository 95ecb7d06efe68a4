"""An independent float32 implementation of the spec in CuPy (one token at a time), for checking the
monokernel at shapes where the numpy engine is too slow (the 2B shape). It reads the same device weights
(converted to float32 once; quantized layer matrices dequantized exactly, as the kernel does in
registers), so the only differences from the kernel are the kernel's storage-type rounding of activations
it stores (KV cache) and summation order."""
from __future__ import annotations

import math

import numpy as np


class CupyReference:
    def __init__(self, dw, kernels, max_seq: int):
        import cupy as cp
        from .weights import to_float32
        self.cp, self.cfg = cp, dw.cfg
        cfg = dw.cfg
        self.layers = []
        for i in range(cfg.num_hidden_layers):
            if dw.qtype:   # quantized layer matrices: gguf's dequantization, exactly, in float32
                nb = dw.layer_elems // 32
                flat = cp.empty(dw.layer_elems, dtype=cp.float32)
                kernels.fn["q_to_f32"]((max(1, min(4096, (nb * 4 + 255) // 256)),), (256,),   # a thread per 8 weights
                                       (dw.w, dw.ws, np.int64(i * nb), np.int64(nb), flat))
                self.layers.append(dw.regions(i, flat))
            else:
                self.layers.append({k: to_float32(dw, v, kernels) for k, v in dw.regions(i).items()})
        self.norms = dw.norms
        self.fnorm = dw.fnorm
        self.emb = to_float32(dw, dw.emb, kernels)
        self.lm = self.emb if dw.lm is dw.emb else to_float32(dw, dw.lm, kernels)
        L, hd = cfg.num_lanes, cfg.head_dim
        shape = (cfg.num_hidden_layers, L, cfg.kv_heads_per_lane, max_seq, hd)
        self.kc = cp.zeros(shape, cp.float32)
        self.vc = cp.zeros(shape, cp.float32)
        self.pos = 0
        k = np.arange(hd // 2)
        self.inv_freq = np.array([cfg.rope_theta ** (-2.0 * kk / hd) for kk in k], np.float64)

    def _rms(self, h, g):
        cp = self.cp
        inv = 1.0 / cp.sqrt(cp.mean(h * h, axis=-1, keepdims=True) + cp.float32(self.cfg.norm_eps))
        return (h * inv) * g

    def _rope(self, x, pos):
        cp = self.cp
        ang = pos * self.inv_freq
        c = cp.asarray(np.cos(ang).astype(np.float32))
        s = cp.asarray(np.sin(ang).astype(np.float32))
        x0, x1 = x[..., 0::2], x[..., 1::2]
        out = cp.empty_like(x)
        out[..., 0::2] = x0 * c - x1 * s
        out[..., 1::2] = x0 * s + x1 * c
        return out

    def step(self, tok: int):
        cp, cfg = self.cp, self.cfg
        L, D, hd = cfg.num_lanes, cfg.hidden_size, cfg.head_dim
        HL, KVL, G = cfg.heads_per_lane, cfg.kv_heads_per_lane, cfg.num_attention_heads // cfg.kv_heads
        hdl, kvdl, delta = HL * hd, KVL * hd, cfg.broadcast_delay
        sqrtL = cp.float32(math.sqrt(L))
        t = self.pos
        h = cp.broadcast_to(self.emb[tok], (L, D)).copy()
        hist = {0: {}, 1: {}}

        def combine(kind, i, part):
            if not cfg.use_comm:
                return sqrtL * part
            tot = part.sum(axis=0)
            hist[kind][i] = (tot, part)
            early = i < delta
            if early and cfg.use_early_comm:
                return cp.broadcast_to(tot, part.shape)
            if early:
                return sqrtL * part
            j = i - delta
            if j >= delta or cfg.early_layers_to_future:
                tj, own = hist[kind][j]
                return part + (tj[None] - own)
            return part

        for i, W in enumerate(self.layers):
            n = self._rms(h, self.norms[i, 0])
            qkv = cp.einsum("lrd,ld->lr", W["qkv"], n)
            q = self._rope(qkv[:, :hdl].reshape(L, HL, hd), t)
            k = self._rope(qkv[:, hdl:hdl + kvdl].reshape(L, KVL, hd), t)
            v = qkv[:, hdl + kvdl:].reshape(L, KVL, hd)
            self.kc[i, :, :, t] = k
            self.vc[i, :, :, t] = v
            lo = max(0, t - cfg.sliding_window + 1) if cfg.is_sliding(i) else 0
            K = self.kc[i, :, :, lo:t + 1]                     # [L, KVL, S, hd]
            Vv = self.vc[i, :, :, lo:t + 1]
            qg = q.reshape(L, KVL, G, hd)
            s = cp.einsum("lkgd,lksd->lkgs", qg, K) * cp.float32(1.0 / math.sqrt(hd))
            s = cp.exp(s - s.max(axis=-1, keepdims=True))
            pr = s / s.sum(axis=-1, keepdims=True)
            o = cp.einsum("lkgs,lksd->lkgd", pr, Vv).reshape(L, hdl)
            a = cp.einsum("ldk,lk->ld", W["wo"], o)
            h = h + combine(0, i, a)
            n = self._rms(h, self.norms[i, 1])
            gu = cp.einsum("lfcd,ld->lfc", W["w13"], n)
            gate, up = gu[..., 0], gu[..., 1]
            m = cp.einsum("ldf,lf->ld", W["w2"], gate / (1.0 + cp.exp(-gate)) * up)
            h = h + combine(1, i, m)
        self.pos += 1
        y = self._rms(h, self.fnorm).sum(axis=0) / cp.float32(L)
        return self.lm @ y
