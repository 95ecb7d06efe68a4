"""The CPU backend's decode step: one new token through the local lanes, the same function as
ReferenceEngine.forward on one id, written for speed.

At one token per step the time is the float32 weights streamed from memory (about 538 MB a token for
SmolLM2-135M, its tied 49152 x 576 LM head included), so what is left to win is Python and numpy
overhead around the GEMVs: the q/k/v rows are one matrix and gate/up another (one GEMV each instead
of three and two), the step runs on 1-D vectors per lane with plain matmuls (no einsum, no [T, ...]
axis), attention reads the cache through views, and small buffers are made once.

The decoder works on a ReferenceEngine's own KV caches and position, so prefill stays on the
engine (batched, the executable spec) and the two can be interleaved freely on one slot. Exchange
calls (tags, order, payload shapes [1, D]) are the engine's, so ranks running this step interoperate
with ranks running the engine's.
"""
from __future__ import annotations

import ctypes
import math
import time
from collections import deque

import numpy as np

from kog_dist.config import rope_inv_freq

_F32 = np.float32


def _find_openblas():
    """(set, get) of the OpenBLAS thread count numpy runs on, or None (another BLAS, not Linux): the
    decoder sets its own count per step and gives the process's back after it."""
    try:
        with open("/proc/self/maps") as f:
            paths = {ln.split()[-1] for ln in f if "openblas" in ln.lower() and ".so" in ln}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for pre, suf in (("scipy_openblas", "64_"), ("scipy_openblas", ""), ("openblas", "64_"), ("openblas", "")):
            setter = getattr(lib, f"{pre}_set_num_threads{suf}", None)
            getter = getattr(lib, f"{pre}_get_num_threads{suf}", None)
            if setter is not None and getter is not None:
                setter.argtypes, setter.restype, getter.restype = [ctypes.c_int], None, ctypes.c_int
                return setter, getter
    return None


_BLAS = _find_openblas()


def blas_threads() -> int | None:
    """The BLAS thread count now (None: not known)."""
    return int(_BLAS[1]()) if _BLAS else None


def set_blas_threads(n: int) -> None:
    if _BLAS and n >= 1:
        _BLAS[0](int(n))


class ThreadChooser:
    """Picks a BLAS thread count per decode step from the step times seen so far: each choice is tried
    once, then the one with the lower median of its last `keep` step times runs, and every `explore`-th
    step tries another again (contention on the cores comes and goes). The median lets one step that
    another process delayed pass without a switch."""

    def __init__(self, choices: list[int], explore: int = 24, keep: int = 3):
        self.choices = list(dict.fromkeys(choices))
        self.times: dict[int, deque] = {c: deque(maxlen=keep) for c in self.choices}
        self.runs = {c: 0 for c in self.choices}      # steps run with each (reports)
        self.explore, self.steps = explore, 0

    def best(self) -> int | None:
        """The count that is faster now, by what has been seen (None before every choice has run)."""
        if not all(self.times.values()):
            return None
        return min(self.choices, key=lambda c: float(np.median(self.times[c])))

    def pick(self) -> int:
        self.steps += 1
        untried = [c for c in self.choices if not self.times[c]]
        if untried:
            return untried[0]
        best = self.best()
        if len(self.choices) > 1 and self.steps % self.explore == 0:
            others = [c for c in self.choices if c != best]
            return others[(self.steps // self.explore) % len(others)]
        return best

    def record(self, choice: int, seconds: float) -> None:
        self.runs[choice] += 1
        self.times[choice].append(seconds)


class FusedWeights:
    """Per layer: W_qkv [nl, q+k+v, D], W_o [nl, D, q], W_gu [nl, 2F, D], W_down [nl, D, F] (float32,
    C-contiguous), the q/k/v bias [nl, q+k+v] when the model has one, and the norm scales.

    `share=True` puts views of the fused matrices back into `weights` in place of the separate
    ones (same values), so the reference engine's prefill and this step use one copy in memory."""

    def __init__(self, cfg, weights, share: bool = True):
        self.cfg = cfg
        self.layers = []
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}."
            a, f = p + "attention.", p + "feed_forward."
            qkv = _fuse(weights, [a + "wq.weight", a + "wk.weight", a + "wv.weight"], share)
            gu = _fuse(weights, [f + "w1.weight", f + "w3.weight"], share)
            bias = None
            if cfg.attention_bias:
                bias = np.concatenate([weights[a + f"b{x}.bias"] for x in "qkv"], axis=1).astype(_F32)
            self.layers.append(dict(
                qkv=qkv, bias=bias, o=_c32(weights[a + "wo.weight"]), gu=gu, down=_c32(weights[f + "w2.weight"]),
                attn_norm=_c32(weights[p + "attention_norm.weight"]), ffn_norm=_c32(weights[p + "ffn_norm.weight"])))
        self.norm = _c32(weights["model.norm.weight"])
        head = weights["lm_head.weight"] if "lm_head.weight" in weights else weights["model.tok_embeddings.weight"]
        self.head = _c32(head)


def _c32(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=_F32)


def _fuse(weights, names: list[str], share: bool) -> np.ndarray:
    fused = np.concatenate([np.asarray(weights[n], dtype=_F32) for n in names], axis=1)
    if share:
        off = 0
        for n in names:
            rows = weights[n].shape[1]
            weights[n] = fused[:, off:off + rows]
            off += rows
    return fused


class FastDecoder:
    """`step(engine, token_id) -> logits [V]`: what `engine.step(token_id)` returns (within float32
    rounding of a different summation order), advancing the engine's cache and position the same way."""

    def __init__(self, cfg, fused: FusedWeights, embed, threads: int | str | None = "auto"):
        """threads: BLAS threads of the step's GEMVs; None: the process's (OPENBLAS_NUM_THREADS);
        "auto": the faster of one thread and the process's count, chosen from the steps' own times
        (ThreadChooser), as two threads win on an idle 2-core machine and lose badly when other
        processes hold a core."""
        nl = fused.layers[0]["qkv"].shape[0]          # the local lanes
        self.base_threads = blas_threads()             # restored after each step (prefill runs on it)
        self.chooser = None
        if threads == "auto":
            if self.base_threads and self.base_threads > 1:
                self.chooser = ThreadChooser([1, min(2, self.base_threads)])
            threads = None
        self.threads = threads or self.base_threads
        self.cfg, self.fw, self.embed, self.nl = cfg, fused, embed, nl
        # tensor parallel (workers.cpu_tp): the sum over the ranks of a partial [D] (wo's, w2's)
        self.reduce = None
        hd, hl, kvl = cfg.head_dim, cfg.heads_per_lane, cfg.kv_heads_per_lane
        self.hd, self.hl, self.kvl, self.g = hd, hl, kvl, hl // kvl
        self.nq, self.nk = hl * hd, kvl * hd
        self.inv_freq = rope_inv_freq(cfg)
        self.scale = _F32(1.0 / math.sqrt(hd))
        self.sqrtL = _F32(math.sqrt(cfg.num_lanes))
        self.eps = _F32(cfg.norm_eps)
        F = cfg.ffn_per_lane
        self.F = F
        self.qkv = np.empty((nl, self.nq + 2 * self.nk), _F32)
        self.gu = np.empty((nl, 2 * F), _F32)
        self.vec = np.empty((nl, cfg.hidden_size), _F32)
        self.tmp = np.empty(F, _F32)
        # the one-lane step's per-layer operands as plain 2-D / 1-D arrays, bound once
        self.one = [(L["qkv"][0], None if L["bias"] is None else L["bias"][0], L["o"][0], L["gu"][0],
                     L["down"][0], L["attn_norm"][0], L["ffn_norm"][0],
                     cfg.sliding_window if cfg.is_sliding(i) else 0) for i, L in enumerate(fused.layers)]

    def _rms(self, x: np.ndarray, g: np.ndarray) -> np.ndarray:
        """As engine.rms, on x [nl, D]."""
        inv = 1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.eps)
        return (x * inv) * g

    def preferred_threads(self) -> int | None:
        """The BLAS thread count the steps find faster now (what the backend's prefill runs on)."""
        return (self.chooser.best() or self.base_threads) if self.chooser else self.threads

    def step(self, eng, token_id: int) -> np.ndarray:
        pos = eng.pos
        if pos + 1 > eng.max_seq:
            raise ValueError(f"context of {pos + 1} tokens exceeds the limit of {eng.max_seq}")
        for c in eng.caches:
            c.ensure(pos + 1)
        n = self.chooser.pick() if self.chooser else self.threads
        own = n != self.base_threads
        if own:
            set_blas_threads(n)
        t0 = time.perf_counter()
        try:
            if self.cfg.num_lanes == 1:
                return self._step_one(eng, token_id, pos)
            return self._step_lanes(eng, token_id, pos)
        finally:
            if self.chooser:
                self.chooser.record(n, time.perf_counter() - t0)
            if own:
                set_blas_threads(self.base_threads)

    def one_lane_buffers(self, qkv, gu, vec, t) -> tuple:
        """The work vectors of one position of a one-lane layer (layer_one) with their views."""
        nq, nk, F, hd = self.nq, self.nk, self.F, self.hd
        return (qkv, qkv[:nq].reshape(self.kvl, self.g, hd), qkv[:nq + nk].view(np.complex64).reshape(-1, hd // 2),
                gu, gu[:F], gu[F:], vec, t)

    def rope_rotation(self, pos: int) -> np.ndarray:
        rot = np.empty(self.hd // 2, np.complex64)
        ang = pos * self.inv_freq                     # float64 angles, then float32, as the engine's
        rot.real, rot.imag = np.cos(ang), np.sin(ang)
        return rot

    def rms(self, h: np.ndarray, weight: np.ndarray) -> np.ndarray:
        n = h * (1.0 / math.sqrt(float(np.dot(h, h)) / self.cfg.hidden_size + float(self.cfg.norm_eps)))
        n *= weight                                   # rms: the scalar in float64
        return n

    def layer_one(self, h, pos: int, rot, layer, K, V, bufs) -> None:
        """One layer of a one-lane model at position pos, in place on the residual h: the combine rule is
        the plain residual (one lane's sum is its own partial, so the delayed term is exactly 0). The one
        place this arithmetic is written: the step and workers.cpu_verify's passes both call it, so a
        verify pass's logits and KV entries are bitwise a step's."""
        wqkv, bias, wo, wgu, wdown, g_attn, g_ffn, window = layer
        qkv, q, zqk, gu, gate, up, vec, t = bufs
        nq, nk = self.nq, self.nk
        np.matmul(wqkv, self.rms(h, g_attn), out=qkv)
        if bias is not None:
            qkv += bias
        zqk *= rot                                    # (x0 c - x1 s, x0 s + x1 c) per pair
        K[:, pos] = qkv[nq:nq + nk].reshape(self.kvl, self.hd)
        V[:, pos] = qkv[nq + nk:].reshape(self.kvl, self.hd)
        S = pos + 1
        lo = max(0, S - window) if window else 0
        s = np.matmul(q, K[:, lo:S].transpose(0, 2, 1))                # [kvl, g, S']
        s *= self.scale
        s -= s.max(axis=-1, keepdims=True)
        np.exp(s, out=s)
        s /= s.sum(axis=-1, keepdims=True)
        att = np.matmul(s, V[:, lo:S])                                  # [kvl, g, hd]
        np.matmul(wo, att.reshape(nq), out=vec)
        h += vec if self.reduce is None else self.reduce(vec)
        np.matmul(wgu, self.rms(h, g_ffn), out=gu)
        np.negative(gate, out=t)                      # gate / (1 + exp(-gate)) * up
        np.exp(t, out=t)
        t += _F32(1.0)
        np.divide(gate, t, out=t)
        t *= up
        np.matmul(wdown, t, out=vec)
        h += vec if self.reduce is None else self.reduce(vec)

    def _step_one(self, eng, token_id: int, pos: int) -> np.ndarray:
        """One lane in all (a Llama-family model): everything is a 1-D vector (layer_one)."""
        bufs = self.one_lane_buffers(self.qkv[0], self.gu[0], self.vec[0], self.tmp)
        rot = self.rope_rotation(pos)
        h = self.embed(np.asarray([token_id], dtype=np.int64)).astype(_F32)[0]
        for c, layer in zip(eng.caches, self.one):
            self.layer_one(h, pos, rot, layer, c.k[0], c.v[0], bufs)
        eng.pos = pos + 1
        return np.matmul(self.fw.head, self.rms(h, self.fw.norm[0]))

    def _step_lanes(self, eng, token_id: int, pos: int) -> np.ndarray:
        cfg, fw, nl = self.cfg, self.fw, self.nl
        ex = eng.ex
        N = cfg.num_hidden_layers
        hd, kvl, g, nq, nk = self.hd, self.kvl, self.g, self.nq, self.nk
        x = self.embed(np.asarray([token_id], dtype=np.int64)).astype(_F32)[0]
        h = np.repeat(x[None], nl, axis=0)                       # [nl, D]
        ang = pos * self.inv_freq                                # float64 angles, as the engine's
        cos, sin = np.cos(ang).astype(_F32), np.sin(ang).astype(_F32)
        pending = {"attn": deque(), "mlp": deque()}
        qkv, gu, vec = self.qkv, self.gu, self.vec
        S = pos + 1
        for i in range(N):
            L = fw.layers[i]
            n = self._rms(h, L["attn_norm"])
            for l in range(nl):
                np.matmul(L["qkv"][l], n[l], out=qkv[l])
            if L["bias"] is not None:
                qkv += L["bias"]
            # RoPE on q and k together: interleaved pairs of every head, the engine's arithmetic
            qk = qkv[:, :nq + nk].reshape(nl, -1, hd // 2, 2)
            x0, x1 = qk[..., 0], qk[..., 1]
            r1 = x0 * sin + x1 * cos
            qk[..., 0] = x0 * cos - x1 * sin
            qk[..., 1] = r1
            c = eng.caches[i]
            c.k[:, :, pos] = qkv[:, nq:nq + nk].reshape(nl, kvl, hd)
            c.v[:, :, pos] = qkv[:, nq + nk:].reshape(nl, kvl, hd)
            lo = max(0, pos + 1 - cfg.sliding_window) if cfg.is_sliding(i) else 0
            q = qkv[:, :nq].reshape(nl, kvl, g, hd)
            s = np.matmul(q, c.k[:, :, lo:S].transpose(0, 1, 3, 2)) * self.scale    # [nl, kvl, g, S']
            s = np.exp(s - s.max(axis=-1, keepdims=True))
            s /= s.sum(axis=-1, keepdims=True)
            att = np.matmul(s, c.v[:, :, lo:S]).reshape(nl, nq)
            for l in range(nl):
                np.matmul(L["o"][l], att[l], out=vec[l])
            h = h + self._combine(ex, "attn", i, vec, pending)
            n = self._rms(h, L["ffn_norm"])
            for l in range(nl):
                np.matmul(L["gu"][l], n[l], out=gu[l])
            gate, up = gu[:, :self.F], gu[:, self.F:]
            act = gate / (1.0 + np.exp(-gate)) * up
            for l in range(nl):
                np.matmul(L["down"][l], act[l], out=vec[l])
            h = h + self._combine(ex, "mlp", i, vec, pending)
        eng.pos = pos + 1
        y_local = self._rms(h, fw.norm).sum(axis=0, keepdims=True)            # [1, D]
        y = ex.allreduce("final", y_local) / _F32(cfg.num_lanes)
        return np.matmul(fw.head, y[0])

    def _combine(self, ex, kind: str, i: int, part: np.ndarray, pending: dict) -> np.ndarray:
        """engine._combine on part [nl, D] (a buffer reused by the next GEMV: what is kept is copied)."""
        cfg, delta, N = self.cfg, self.cfg.broadcast_delay, self.cfg.num_hidden_layers
        if not cfg.use_comm:
            return self.sqrtL * part
        early = i < delta
        needed_later = i + delta < N and (not early or cfg.early_layers_to_future)
        if early and cfg.use_early_comm:
            total = ex.allreduce(kind, part.sum(axis=0, keepdims=True))
            if needed_later:
                pending[kind].append((i, total, None, part.copy()))
            return total                                                     # broadcasts over the lanes
        if needed_later:
            pending[kind].append((i, None, ex.post(kind, part.sum(axis=0, keepdims=True)), part.copy()))
        if early:
            return self.sqrtL * part
        if pending[kind] and pending[kind][0][0] == i - delta:
            _, total, handle, own = pending[kind].popleft()
            if total is None:
                total = ex.collect(handle)
            return part + (total - own)                                    # the other lanes, δ layers late
        return part
