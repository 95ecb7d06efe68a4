"""The whole PyTorch model of the Laneformer in one file (nanoGPT style): weights, the decode step, the
float32 reference. The config and the checkpoint's names and shapes are :mod:`workers.cuda.torch_config`
(re-exported here). :mod:`workers.cuda.torch_baseline` times it (and re-exports it).

The model function is /work/shared/spec/laneformer.md, computed with all lanes on one device and the
lane as a batch dimension: every lane has its own residual stream (``h`` is ``[L, T, D]``), the
per-lane projections are batched matmuls over lanes, and the DTP combine with delay ``δ`` is done on
the ``[L, T, D]`` partials. The residual stream, norms, RoPE, softmax and the combine run in float32
(float64 when the weights are float64); the matmuls take the storage dtype (bf16 / fp16 / fp32)
and accumulate in float32 as cuBLAS does.

The KV cache is static and preallocated: ``k_cache`` / ``v_cache`` are ``[N, L, KV/L, max_seq, hd]``
in the KV dtype (the weight dtype unless told). A step takes the token and its position as device
tensors and derives the RoPE rows and the attention masks from them, so one decode step contains no
host synchronisation and no shape that depends on the position: it can be captured in a CUDA graph
as it is (``cuda_graph`` mode), or compiled by torch.compile first (``compile`` mode). Greedy decoding
keeps the token on the device (argmax, position += 1 are part of the captured step).

PyTorch is imported lazily: this module imports without torch; using the model without it raises
:class:`TorchUnavailableError`.

Public API::

    torch_available() -> bool
    SHAPE_2B: dict                                # the published 2B dimensions (spec keys)
    ModelShape(cfg) / model_shape(cfg); weight_shapes(cfg) -> dict[str, tuple[int, ...]]
                                                  # (these from torch_config, re-exported)
    random_weights(cfg, device="cuda", dtype="bfloat16", seed=0, std=0.02) -> dict[str, Tensor]
    LaneformerTorch(cfg, weights=None, *, device="cuda", dtype=None, max_seq=None,
                    kv_dtype=None, seed=0)        # alias Laneformer2bTorch
        .prefill(ids, start_pos=0, all_logits=False) -> Tensor [V] (or [T, V]) float32
        .decode_step(token, pos) -> Tensor [V] float32   (ints or 1-element device long tensors)
        .greedy_generate(ids, gen_len) -> list[int]
    reference_logits_fp32(cfg, weights, ids, device="cuda") -> Tensor [T, V] float32
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from typing import Any

from .torch_config import SHAPE_2B, ModelShape, model_shape, weight_shapes

__all__ = [
    "TorchUnavailableError",
    "torch_available",
    "SHAPE_2B",
    "ModelShape",
    "model_shape",
    "weight_shapes",
    "random_weights",
    "LaneformerTorch",
    "Laneformer2bTorch",
    "reference_logits_fp32",
]


class TorchUnavailableError(RuntimeError):
    """PyTorch is not importable, and the PyTorch baseline needs it."""


def _import_torch():
    try:
        import torch  # noqa: PLC0415  (lazy on purpose)
    except Exception as e:  # ImportError, or a broken install
        raise TorchUnavailableError(
            f"the PyTorch baseline needs PyTorch, which cannot be imported here ({type(e).__name__}: {e}); "
            "install it (pip install torch) or skip the baseline"
        ) from None
    return torch


def torch_available() -> bool:
    try:
        _import_torch()
    except TorchUnavailableError:
        return False
    return True


# ---------------------------------------------------------------------------------------------------------
# Weights (the config and the checkpoint's names and shapes: workers/cuda/torch_config.py)


def _torch_dtype(torch, dtype):
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    names = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16,
             "float16": torch.float16, "half": torch.float16, "fp32": torch.float32,
             "float32": torch.float32, "float": torch.float32, "fp64": torch.float64,
             "float64": torch.float64, "double": torch.float64}
    try:
        return names[str(dtype).lower().replace("torch.", "")]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}") from None


def random_weights(cfg: Any, device="cuda", dtype="bfloat16", seed: int = 0, std: float = 0.02) -> dict:
    """Random weights in the spec's names and shapes, created on ``device`` (no host copy).

    Matrices are normal(0, std) (std 0.02 keeps the 2B shape's activations of order 1 through all its
    layers: every projection sees an RMS-normalised input), norm scales 1 + normal(0, std)."""
    torch = _import_torch()
    c = model_shape(cfg)
    dt = _torch_dtype(torch, dtype)
    dev = torch.device(device)
    gen = torch.Generator(device=dev)
    gen.manual_seed(int(seed))
    out = {}
    for name, shape in weight_shapes(c).items():
        t = torch.randn(shape, generator=gen, device=dev, dtype=dt)
        t.mul_(std)
        if "norm." in name:
            t.add_(1.0)
        out[name] = t
    return out


# ---------------------------------------------------------------------------------------------------------
# The model (torch classes are built on first use so that importing this module never imports torch)


@functools.lru_cache(maxsize=None)
def _core_classes():
    torch = _import_torch()
    nn = torch.nn
    F = torch.nn.functional

    def rms(x, g, eps):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * g

    def rope(x, cos, sin):
        # x [L, T, nh, hd]; cos/sin [1, T, 1, hd/2]; interleaved pairs (x[2k], x[2k+1])
        xp = x.reshape(*x.shape[:-1], x.shape[-1] // 2, 2)
        x0, x1 = xp[..., 0], xp[..., 1]
        return torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).reshape(x.shape)

    class Layer(nn.Module):
        def __init__(self, wqkv, wo, w13, w2, attn_norm, ffn_norm):
            super().__init__()
            self.register_buffer("wqkv", wqkv, persistent=False)        # [L, (Hl+2KVl)*hd, D]
            self.register_buffer("wo", wo, persistent=False)            # [L, D, Hl*hd]
            self.register_buffer("w13", w13, persistent=False)          # [L, 2*Fl, D]  (gate; up)
            self.register_buffer("w2", w2, persistent=False)            # [L, D, Fl]
            self.register_buffer("attn_norm", attn_norm, persistent=False)  # [L, 1, D] act dtype
            self.register_buffer("ffn_norm", ffn_norm, persistent=False)    # [L, 1, D] act dtype

    class LaneformerCore(nn.Module):
        """forward(ids [T] long, positions [T] long, all_logits) -> logits [T or 1, V] (act dtype).

        Writes the T positions' keys and values into the static cache; attends over the whole cache
        with masks derived from ``positions`` (so T = 1 has shapes independent of the position)."""

        def __init__(self, c: ModelShape, layers, embed, norm, lm_head, max_seq, kv_dtype, act_dtype):
            super().__init__()
            self.c = c
            self.max_seq = max_seq
            self.act_dtype = act_dtype
            self.w_dtype = embed.dtype
            self.kv_dtype = kv_dtype
            self.sqrtL = math.sqrt(c.L)
            dev = embed.device
            self.layers = nn.ModuleList(layers)
            self.register_buffer("embed", embed, persistent=False)
            self.register_buffer("norm", norm, persistent=False)            # [L, 1, D] act dtype
            self.register_buffer("lm_head", lm_head, persistent=False)      # [V, D]
            cache_shape = (c.N, c.L, c.KVl, max_seq, c.hd)
            self.register_buffer("k_cache", torch.zeros(cache_shape, dtype=kv_dtype, device=dev), persistent=False)
            self.register_buffer("v_cache", torch.zeros(cache_shape, dtype=kv_dtype, device=dev), persistent=False)
            # RoPE table computed in float64: angle t * theta^(-2k/hd)
            t = torch.arange(max_seq, dtype=torch.float64)
            inv = c.rope_theta ** (-2.0 * torch.arange(c.hd // 2, dtype=torch.float64) / c.hd)
            ang = t[:, None] * inv[None, :]
            self.register_buffer("rope_cos", torch.cos(ang).to(device=dev, dtype=act_dtype), persistent=False)
            self.register_buffer("rope_sin", torch.sin(ang).to(device=dev, dtype=act_dtype), persistent=False)
            self.register_buffer("seq_idx", torch.arange(max_seq, device=dev), persistent=False)

        def _combine(self, h, p, hist, i):
            c = self.c
            if not c.use_comm:
                return h + self.sqrtL * p
            if i < c.delay:
                if c.use_early_comm:
                    return h + p.sum(0, keepdim=True)
                return h + self.sqrtL * p
            if (i - c.delay) < c.delay and not c.early_to_future:
                return h + p
            P = p if c.delay == 0 else hist[i - c.delay]
            return h + p + (P.sum(0, keepdim=True) - P)

        def forward(self, ids, positions, all_logits: bool = False):
            c = self.c
            L, D, hd, Hl, KVl, G, Fl = c.L, c.D, c.hd, c.Hl, c.KVl, c.G, c.Fl
            T = ids.shape[0]
            act, wdt, kvdt = self.act_dtype, self.w_dtype, self.kv_dtype
            x = self.embed.index_select(0, ids).to(act)                     # [T, D]
            h = x.unsqueeze(0).expand(L, T, D)
            cos = self.rope_cos.index_select(0, positions).view(1, T, 1, hd // 2)
            sin = self.rope_sin.index_select(0, positions).view(1, T, 1, hd // 2)
            j = self.seq_idx.view(1, -1)
            pq = positions.view(T, 1)
            full = j <= pq                                                  # [T, S]
            slide = full & (j > pq - c.W) if c.W is not None else full
            # the G query heads of one KV head become G*T query rows: row g*T + t
            full_m = full.repeat(G, 1) if G > 1 else full
            slide_m = slide.repeat(G, 1) if G > 1 else slide
            attn_hist = [None] * c.N
            mlp_hist = [None] * c.N
            nq, nk = Hl * hd, KVl * hd
            for i, layer in enumerate(self.layers):
                # attention
                n = rms(h, layer.attn_norm, c.eps).to(wdt)
                qkv = torch.bmm(n, layer.wqkv.transpose(1, 2)).to(act)     # [L, T, nq + 2 nk]
                q = rope(qkv[..., :nq].reshape(L, T, Hl, hd), cos, sin)
                k = rope(qkv[..., nq:nq + nk].reshape(L, T, KVl, hd), cos, sin)
                v = qkv[..., nq + nk:].reshape(L, T, KVl, hd)
                kc, vc = self.k_cache[i], self.v_cache[i]                   # [L, KVl, S, hd]
                kc.index_copy_(2, positions, k.permute(0, 2, 1, 3).to(kvdt))
                vc.index_copy_(2, positions, v.permute(0, 2, 1, 3).to(kvdt))
                qh = q.to(kvdt).reshape(L, T, KVl, G, hd).permute(0, 2, 3, 1, 4).reshape(L, KVl, G * T, hd)
                o = F.scaled_dot_product_attention(qh, kc, vc, attn_mask=slide_m if c.is_sliding(i) else full_m)
                o = o.reshape(L, KVl, G, T, hd).permute(0, 3, 1, 2, 4).reshape(L, T, nq)
                a = torch.bmm(o.to(wdt), layer.wo.transpose(1, 2)).to(act)  # [L, T, D]
                h = self._combine(h, a, attn_hist, i)
                attn_hist[i] = a
                # MLP
                n = rms(h, layer.ffn_norm, c.eps).to(wdt)
                gu = torch.bmm(n, layer.w13.transpose(1, 2)).to(act)       # [L, T, 2 Fl]
                m = F.silu(gu[..., :Fl]) * gu[..., Fl:]
                mo = torch.bmm(m.to(wdt), layer.w2.transpose(1, 2)).to(act)
                h = self._combine(h, mo, mlp_hist, i)
                mlp_hist[i] = mo
            hf = h if all_logits else h[:, T - 1:, :]
            y = rms(hf, self.norm, c.eps).mean(0)                          # [T', D]
            return F.linear(y.to(wdt), self.lm_head).to(act)               # [T', V]

    return LaneformerCore, Layer


def _to_tensor(torch, t, device, dtype):
    if not isinstance(t, torch.Tensor):
        import numpy as np  # noqa: PLC0415
        t = torch.from_numpy(np.ascontiguousarray(t))
    return t.to(device=device, dtype=dtype)


def _weights_dtype(torch, weights):
    t = weights.get("model.tok_embeddings.weight")
    if t is None:
        raise KeyError("weights lack model.tok_embeddings.weight")
    if isinstance(t, torch.Tensor):
        return t.dtype
    return torch.from_numpy(t[:1].copy()).dtype


class _GreedyRunner:
    """Greedy decode kept on the device: static token / position / sequence tensors; ``step()`` feeds the
    token at the position, takes the argmax (lowest index among equal maxima) as the next token, and
    advances the position. No host synchronisation: this is what gets captured in a CUDA graph."""

    def __init__(self, model: "LaneformerTorch", step_fn):
        torch = model.torch
        self.torch = torch
        self.step_fn = step_fn
        dev = model.device
        self.token = torch.zeros(1, dtype=torch.long, device=dev)
        self.pos = torch.zeros(1, dtype=torch.long, device=dev)
        self.seq = torch.zeros(model.max_seq + 1, dtype=torch.long, device=dev)
        self.logits = None

    def reset(self, last_logits, pos: int):
        """The next token is the argmax of ``last_logits`` (the prefill's), placed at ``pos``."""
        torch = self.torch
        with torch.no_grad():
            first = torch.argmax(last_logits.reshape(-1)).view(1)
            self.token.copy_(first)
            self.pos.fill_(int(pos))
            self.seq.index_copy_(0, self.pos, first)

    def step(self):
        torch = self.torch
        with torch.no_grad():
            logits = self.step_fn(self.token, self.pos)                 # [1, V]
            nxt = torch.argmax(logits[0]).view(1)
            self.seq.index_copy_(0, self.pos + 1, nxt)
            self.token.copy_(nxt)
            self.pos.add_(1)
            self.logits = logits

    def generated(self, start: int, n: int) -> list[int]:
        return [int(x) for x in self.seq[start:start + n].tolist()]


class LaneformerTorch:
    """The Laneformer function in PyTorch, all lanes on one device (lane = batch dimension).

    ``cfg``: dict of the spec's keys, or an object with those attributes (``LaneformerConfig``).
    ``weights``: None (random on the device, see :func:`random_weights`) or a mapping from the spec's
    tensor names to tensors / numpy arrays of the spec's shapes. ``dtype``: storage dtype of the weights
    (default bf16 for random weights, else the embedding's dtype); the activations are float32
    (float64 when dtype is float64). ``max_seq``: KV cache length (default min(max_position_embeddings,
    4096)). The given tensors are copied into fused per-layer tensors (wq|wk|wv, w1|w3); the caller may
    drop its dict afterwards."""

    def __init__(self, cfg: Any, weights: Mapping | None = None, *, device="cuda", dtype=None,
                 max_seq: int | None = None, kv_dtype=None, seed: int = 0):
        torch = _import_torch()
        self.torch = torch
        c = self.c = model_shape(cfg)
        self.device = torch.device(device)
        if weights is None:
            wdt = _torch_dtype(torch, dtype) or torch.bfloat16
            weights = random_weights(c, self.device, wdt, seed)
        else:
            wdt = _torch_dtype(torch, dtype) or _weights_dtype(torch, weights)
        self.dtype = wdt
        act = torch.float64 if wdt == torch.float64 else torch.float32
        kvdt = _torch_dtype(torch, kv_dtype) or wdt
        self.max_seq = int(max_seq) if max_seq else min(c.max_pos, 4096)
        if self.max_seq <= 0:
            raise ValueError(f"max_seq {self.max_seq} <= 0")

        shapes = weight_shapes(c)
        missing = [n for n in shapes if n not in weights]
        if missing:
            raise KeyError(f"weights lack {len(missing)} tensors, e.g. {missing[0]}")

        def get(name, dt=wdt):
            t = weights[name]
            if tuple(t.shape) != shapes[name]:
                raise ValueError(f"{name}: shape {tuple(t.shape)}, expected {shapes[name]}")
            return _to_tensor(torch, t, self.device, dt)

        def norm(prefix):
            if c.replicated_rmsn_scale:
                g = get(prefix + ".weight", act).view(1, c.D).expand(c.L, c.D)
            else:
                g = get(prefix + ".scale", act)
            return g.reshape(c.L, 1, c.D).contiguous()

        Core, Layer = _core_classes()
        layers = []
        with torch.no_grad():
            for i in range(c.N):
                p = f"model.layers.{i}."
                wqkv = torch.cat([get(p + "attention.wq.weight"), get(p + "attention.wk.weight"),
                                  get(p + "attention.wv.weight")], dim=1).contiguous()
                w13 = torch.cat([get(p + "feed_forward.w1.weight"), get(p + "feed_forward.w3.weight")],
                                dim=1).contiguous()
                layers.append(Layer(wqkv, get(p + "attention.wo.weight").contiguous(), w13,
                                    get(p + "feed_forward.w2.weight").contiguous(),
                                    norm(p + "attention_norm"), norm(p + "ffn_norm")))
            embed = get("model.tok_embeddings.weight").contiguous()
            lm_head = embed if c.tied else get("lm_head.weight").contiguous()
            self.core = Core(c, layers, embed, norm("model.norm"), lm_head, self.max_seq, kvdt, act)
        self.core.eval()
        self.core.requires_grad_(False)

    # -- host-level API ---------------------------------------------------------------------------------
    def _ids(self, ids):
        torch = self.torch
        if isinstance(ids, torch.Tensor):
            return ids.to(device=self.device, dtype=torch.long).reshape(-1)
        return torch.tensor(list(ids), dtype=torch.long, device=self.device).reshape(-1)

    def prefill(self, ids, start_pos: int = 0, all_logits: bool = False):
        """Runs the prompt (batched over its positions) from ``start_pos``, filling the KV cache.
        Returns the last position's logits [V] (or [T, V] with all_logits), float32."""
        torch = self.torch
        ids_t = self._ids(ids)
        T = ids_t.shape[0]
        if T == 0 or start_pos < 0 or start_pos + T > self.max_seq:
            raise ValueError(f"prefill of {T} tokens at {start_pos} does not fit max_seq {self.max_seq}")
        pos = torch.arange(start_pos, start_pos + T, dtype=torch.long, device=self.device)
        with torch.no_grad():
            out = self.core(ids_t, pos, all_logits)
        return out if all_logits else out[0]

    def decode_step(self, token, pos):
        """One decode step: ``token`` at position ``pos`` (ints, or 1-element long tensors on the device,
        which keeps the step free of host synchronisation). Returns logits [V], float32."""
        torch = self.torch
        if not isinstance(pos, torch.Tensor):
            if not 0 <= int(pos) < self.max_seq:
                raise ValueError(f"position {pos} outside the KV cache (max_seq {self.max_seq})")
            pos = torch.tensor([int(pos)], dtype=torch.long, device=self.device)
        if not isinstance(token, torch.Tensor):
            token = torch.tensor([int(token)], dtype=torch.long, device=self.device)
        with torch.no_grad():
            return self.core(token.reshape(1), pos.reshape(1))[0]

    def greedy_generate(self, ids, gen_len: int) -> list[int]:
        """Prefill ``ids`` then greedy-decode: returns gen_len new ids (the first from the prefill's
        logits). Uses the device-side step that the graph modes capture."""
        ids_t = self._ids(ids)
        T = ids_t.shape[0]
        if T + gen_len > self.max_seq + 1:
            raise ValueError(f"{T} + {gen_len} tokens do not fit max_seq {self.max_seq}")
        logits = self.prefill(ids_t)
        runner = _GreedyRunner(self, self.core)
        runner.reset(logits, T)
        for _ in range(gen_len - 1):
            runner.step()
        return runner.generated(T, gen_len)


Laneformer2bTorch = LaneformerTorch


def reference_logits_fp32(cfg: Any, weights: Mapping, ids, device="cuda"):
    """Teacher-forced float32 logits [T, V] of ``ids`` from position 0 (weights upcast to float32,
    TF32 off): the "float32 computation" to compare a bf16 run against."""
    torch = _import_torch()
    ids_list = ids.tolist() if hasattr(ids, "tolist") else list(ids)
    prev = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    try:
        m = LaneformerTorch(cfg, weights, device=device, dtype=torch.float32,
                            max_seq=-(-len(ids_list) // 16) * 16)
        out = m.prefill(ids_list, all_logits=True)
        del m
        return out
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = prev
