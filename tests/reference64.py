"""An independent float64 implementation of spec/laneformer.md for the tests: full recompute of the
whole prefix at every step, plain loops over lanes and heads, its own safetensors reader. It shares no
code with kog_dist on purpose."""
from __future__ import annotations

import json
import math
import os
import struct

import numpy as np


def read_safetensors_dir(d: str) -> dict:
    out = {}
    for fn in sorted(os.listdir(d)):
        if not fn.endswith(".safetensors"):
            continue
        with open(os.path.join(d, fn), "rb") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            header = json.loads(f.read(n))
            data = f.read()
        for name, m in header.items():
            if name == "__metadata__":
                continue
            b, e = m["data_offsets"]
            raw = data[b:e]
            if m["dtype"] == "BF16":
                a = (np.frombuffer(raw, np.uint16).astype(np.uint32) << 16).view(np.float32)
            else:
                a = np.frombuffer(raw, {"F32": np.float32, "F16": np.float16}[m["dtype"]])
            out[name] = a.astype(np.float64).reshape(m["shape"])
    return out


class Ref64:
    def __init__(self, model_dir: str):
        with open(os.path.join(model_dir, "config.json")) as f:
            c = json.load(f)
        self.c = c
        self.W = read_safetensors_dir(model_dir)
        self.D, self.N, self.H = c["hidden_size"], c["num_hidden_layers"], c["num_attention_heads"]
        self.KV = c.get("num_key_value_heads") or self.H
        self.L, self.delta = c.get("num_lanes", 1), c.get("broadcast_delay", 1)
        self.hd = self.D // self.H
        self.eps = c.get("norm_eps", 1e-5)
        self.theta = c.get("rope_theta", 10000.0)

    def norm(self, name: str, lane: int):
        rep = self.c.get("replicated_rmsn_scale", True)
        return self.W[name + ".weight"] if rep else self.W[name + ".scale"][lane]

    def sliding(self, i: int) -> bool:
        W, S = self.c.get("sliding_window"), self.c.get("sliding_window_n_layers", 0)
        if W is None:
            return False
        return i < S if S >= 0 else i >= self.N + S

    def rope(self, x):
        """x [T, hd]: pair (x[2k], x[2k+1]) at position t turns by t * theta^(-2k/hd)."""
        t = np.arange(x.shape[0])[:, None]
        a = t * self.theta ** (-2.0 * np.arange(self.hd // 2)[None, :] / self.hd)
        c, s = np.cos(a), np.sin(a)
        out = np.empty_like(x)
        out[:, 0::2] = x[:, 0::2] * c - x[:, 1::2] * s
        out[:, 1::2] = x[:, 0::2] * s + x[:, 1::2] * c
        return out

    def logits(self, ids) -> np.ndarray:
        """Logits [T, V] for every position of `ids`, from scratch."""
        c, L, T, D = self.c, self.L, len(ids), self.D
        E = self.W["model.tok_embeddings.weight"]
        h = [np.array(E[ids]) for _ in range(L)]
        hist = {"attn": {}, "mlp": {}}
        hl, kvl, g = self.H // L, self.KV // L, self.H // self.KV
        for i in range(self.N):
            p = f"model.layers.{i}."
            parts = []
            for l in range(L):
                n = rmsn(h[l], self.norm(p + "attention_norm", l), self.eps)
                q = n @ self.W[p + "attention.wq.weight"][l].T
                k = n @ self.W[p + "attention.wk.weight"][l].T
                v = n @ self.W[p + "attention.wv.weight"][l].T
                heads = np.zeros((T, hl * self.hd))
                for hh in range(hl):
                    kv = hh // g
                    qs = self.rope(q[:, hh * self.hd:(hh + 1) * self.hd])
                    ks = self.rope(k[:, kv * self.hd:(kv + 1) * self.hd])
                    vs = v[:, kv * self.hd:(kv + 1) * self.hd]
                    for t in range(T):
                        js = [j for j in range(t + 1)
                              if not self.sliding(i) or j > t - c["sliding_window"]]
                        sc = np.array([qs[t] @ ks[j] for j in js]) / math.sqrt(self.hd)
                        w = np.exp(sc - sc.max())
                        w /= w.sum()
                        heads[t, hh * self.hd:(hh + 1) * self.hd] = w @ vs[js]
                parts.append(heads @ self.W[p + "attention.wo.weight"][l].T)
            h = self.combine("attn", i, h, parts, hist)
            parts = []
            for l in range(L):
                n = rmsn(h[l], self.norm(p + "ffn_norm", l), self.eps)
                a = n @ self.W[p + "feed_forward.w1.weight"][l].T
                b = n @ self.W[p + "feed_forward.w3.weight"][l].T
                parts.append((a / (1 + np.exp(-a)) * b) @ self.W[p + "feed_forward.w2.weight"][l].T)
            h = self.combine("mlp", i, h, parts, hist)
        y = sum(rmsn(h[l], self.norm("model.norm", l), self.eps) for l in range(L)) / L
        head = self.W["model.tok_embeddings.weight"] if c.get("tie_word_embeddings") else self.W["lm_head.weight"]
        return y @ head.T

    def combine(self, kind, i, h, parts, hist):
        c, L, d = self.c, self.L, self.delta
        hist[kind][i] = parts
        out = []
        for l in range(L):
            if not c.get("use_comm", True):
                out.append(h[l] + math.sqrt(L) * parts[l])
            elif i < d:
                add = sum(parts) if c.get("use_early_comm", True) else math.sqrt(L) * parts[l]
                out.append(h[l] + add)
            else:
                P = hist[kind][i - d]
                late = (sum(P) - P[l]) if (i - d >= d or c.get("early_layers_to_future", True)) else 0.0
                out.append(h[l] + parts[l] + late)
        return out

    def greedy(self, prompt, n):
        ids = list(prompt)
        for _ in range(n):
            ids.append(int(np.argmax(self.logits(ids)[-1])))
        return ids[len(prompt):]


def rmsn(x, g, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * g
