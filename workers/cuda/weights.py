"""Weights on the GPU in the layout the monokernel streams (workers/cuda/README.md describes it).

Per layer, one contiguous block of the storage type (bf16, fp16 or fp32), lane-major inside:
  QKV  [L][RQKV][D]   rows of wq[l], wk[l], wv[l] one after another (RQKV = (H+2KV)/L * hd)
  WO   [L][D][H/L*hd] wo[l] as stored
  W13  [L][F/L][2][D] w1[l] row j then w3[l] row j (gate, up), so one warp reads both
  W2   [L][D][F/L]    w2[l] as stored
Layers follow one another in one allocation, so each phase's rows of a block are one contiguous range
(what the L2 prefetch asks for). Norm scales are fp32 [NL][2][L][D] (broadcast when replicated), the
final norm fp32 [L][D]; embedding and LM head [V][D] in the storage type (one buffer when tied).
"""
from __future__ import annotations

import numpy as np

STORAGE_NP = {"BF16": np.uint16, "F16": np.float16, "F32": np.float32}


def layer_elems(cfg) -> int:
    L, D, hd = cfg.num_lanes, cfg.hidden_size, cfg.head_dim
    rqkv = (cfg.heads_per_lane + 2 * cfg.kv_heads_per_lane) * hd
    hdl, fl = cfg.heads_per_lane * hd, cfg.ffn_per_lane
    return L * rqkv * D + L * D * hdl + L * fl * 2 * D + L * D * fl


def streamed_bytes(cfg, dtype: str) -> int:
    """Weight bytes read per decoded token: every layer and the LM head (not the embedding table). A rank's
    view (multirank.RankView): its lanes and its share of the LM head rows."""
    isz = 4 if dtype == "F32" else 2
    return (layer_elems(cfg) * cfg.num_hidden_layers + getattr(cfg, "lm_rows", cfg.vocab_size) * cfg.hidden_size) * isz


def _to_storage(arr: np.ndarray, dt: str, target: str) -> np.ndarray:
    from kog_dist.checkpoint import bf16_bits, to_float32
    if dt == target:
        return arr
    f = to_float32(arr, dt)
    if target == "BF16":
        return bf16_bits(f)
    return f.astype(STORAGE_NP[target])


class DeviceWeights:
    def __init__(self, cfg, dtype: str):
        import cupy as cp
        self.cfg, self.dtype = cfg, dtype
        D, L, N, V = cfg.hidden_size, cfg.num_lanes, cfg.num_hidden_layers, cfg.vocab_size
        st = STORAGE_NP[dtype]
        self.layer_elems = layer_elems(cfg)
        self.w = cp.empty(N * self.layer_elems, dtype=st)
        self.norms = cp.empty((N, 2, L, D), dtype=cp.float32)
        self.fnorm = cp.empty((L, D), dtype=cp.float32)
        self.emb = cp.empty((V, D), dtype=st)
        self.lm = self.emb if cfg.tie_word_embeddings else cp.empty((V, D), dtype=st)

    # views of one layer's regions (elements of the storage type)
    def regions(self, i: int):
        cfg = self.cfg
        L, D, hd = cfg.num_lanes, cfg.hidden_size, cfg.head_dim
        rqkv = (cfg.heads_per_lane + 2 * cfg.kv_heads_per_lane) * hd
        hdl, fl = cfg.heads_per_lane * hd, cfg.ffn_per_lane
        base = i * self.layer_elems
        sizes = [("qkv", (L, rqkv, D)), ("wo", (L, D, hdl)), ("w13", (L, fl, 2, D)), ("w2", (L, D, fl))]
        out, off = {}, base
        for name, shape in sizes:
            n = int(np.prod(shape))
            out[name] = self.w[off:off + n].reshape(shape)
            off += n
        return out

    @property
    def nbytes(self) -> int:
        n = self.w.nbytes + self.norms.nbytes + self.fnorm.nbytes + self.emb.nbytes
        return n + (0 if self.lm is self.emb else self.lm.nbytes)


def load_checkpoint(model_dir: str, cfg=None, dtype: str | None = None, progress=None, view=None) -> DeviceWeights:
    """Read a checkpoint and upload it in the streaming layout: all lanes, or with `view` (a
    multirank.RankView of this config) the rank's lanes only (the embedding and the whole LM head are
    uploaded on every rank; each computes only its share of the head's rows, multirank.lm_rows)."""
    import cupy as cp
    from kog_dist.checkpoint import CheckpointReader
    from kog_dist.progress import Progress
    reader = CheckpointReader(model_dir, cfg)
    cfg = reader.cfg
    src_dt = reader.dtype("model.layers.0.attention.wq.weight")
    dtype = dtype or src_dt
    dw = DeviceWeights(view if view is not None else cfg, dtype)
    N, L, D = cfg.num_hidden_layers, dw.cfg.num_lanes, cfg.hidden_size
    lanes = view.lanes if view is not None else None

    def raw(name, lane_first=False):
        a, dt = reader.raw(name, lanes) if lane_first and lanes is not None else reader.raw(name)
        return _to_storage(a, dt, dtype)

    def norm(prefix):
        if cfg.replicated_rmsn_scale:
            return np.broadcast_to(reader.tensor(prefix + ".weight"), (L, D))
        return np.broadcast_to(reader.tensor(prefix + ".scale", lanes), (L, D))

    total = N + 2
    if progress is None:
        progress = dw.nbytes > (256 << 20)
    with Progress("uploading weights", total, unit=" parts", enabled=progress) as bar:
        for i in range(N):
            p = f"model.layers.{i}."
            r = dw.regions(i)
            qkv = np.concatenate([raw(p + "attention.wq.weight", True), raw(p + "attention.wk.weight", True),
                                  raw(p + "attention.wv.weight", True)], axis=1)
            r["qkv"][...] = cp.asarray(qkv)
            r["wo"][...] = cp.asarray(raw(p + "attention.wo.weight", True))
            r["w13"][...] = cp.asarray(np.stack([raw(p + "feed_forward.w1.weight", True),
                                                 raw(p + "feed_forward.w3.weight", True)], axis=2))
            r["w2"][...] = cp.asarray(raw(p + "feed_forward.w2.weight", True))
            dw.norms[i, 0] = cp.asarray(norm(p + "attention_norm"))
            dw.norms[i, 1] = cp.asarray(norm(p + "ffn_norm"))
            bar.advance(1)
        dw.fnorm[...] = cp.asarray(norm("model.norm"))
        dw.emb[...] = cp.asarray(raw("model.tok_embeddings.weight"))
        bar.advance(1)
        if not cfg.tie_word_embeddings:
            dw.lm[...] = cp.asarray(raw("lm_head.weight"))
        bar.advance(1)
    reader.close()
    cp.cuda.Device().synchronize()
    return dw


def random_weights(cfg, dtype: str, kernels, seed: int = 0, std: float | None = None) -> DeviceWeights:
    """Random weights created on the device (no host copy): N(0, 1/fan_in) matrices, norms 1 + 0.1 N(0,1),
    embedding N(0, 1). For benchmarks at a published shape with nothing downloaded. Every lane's slices
    come from a generator of its own (seed, layer, matrix, global lane), so a rank's view (a
    multirank.RankView: `cfg.lanes` its global lanes) gets exactly those lanes of the one-rank model and
    N ranks decode the same model as one."""
    import cupy as cp
    dw = DeviceWeights(cfg, dtype)
    conv = kernels.fn["f32_to_w"]
    lanes = list(getattr(cfg, "lanes", range(cfg.num_lanes)))

    def rng_of(*key):
        h = seed
        for k in key:
            h = (h * 1000003 + k + 1) % (1 << 62)
        return cp.random.default_rng(h)

    def fill(dst, fan_in, rng, scale=1.0):
        flat = dst.reshape(-1)
        step = 1 << 26
        for a in range(0, flat.size, step):
            n = min(step, flat.size - a)
            x = rng.standard_normal(n, dtype=cp.float32) * cp.float32(scale / np.sqrt(fan_in))
            if dtype == "F32":
                flat[a:a + n] = x
            else:
                conv((max(1, min(4096, (n + 255) // 256)),), (256,), (x, flat[a:a + n], cp.int64(n)))

    D, N = cfg.hidden_size, cfg.num_hidden_layers
    fans = {"qkv": D, "wo": cfg.heads_per_lane * cfg.head_dim, "w13": D, "w2": cfg.ffn_per_lane}
    for i in range(N):
        r = dw.regions(i)
        for m, (name, fan) in enumerate(fans.items()):
            for j, g in enumerate(lanes):
                fill(r[name][j], fan, rng_of(1, i, m, g))

    def norm_rows(shape_lead, key):   # 1 + 0.1 N(0, 1): one row per global lane, or one shared row
        if cfg.replicated_rmsn_scale:
            row = 1.0 + 0.1 * rng_of(*key).standard_normal(D, dtype=cp.float32)
            return cp.broadcast_to(row, shape_lead + (len(lanes), D))
        rows = [1.0 + 0.1 * rng_of(*key, g).standard_normal(D, dtype=cp.float32) for g in lanes]
        return cp.broadcast_to(cp.stack(rows), shape_lead + (len(lanes), D))

    for i in range(N):
        for kind in range(2):
            dw.norms[i, kind] = norm_rows((), (2, i, kind))
    dw.fnorm[...] = norm_rows((), (3,))
    fill(dw.emb, 1, rng_of(4))
    if dw.lm is not dw.emb:
        fill(dw.lm, D, rng_of(5), 2.0)
    cp.cuda.Device().synchronize()
    return dw


def to_float32(dw: DeviceWeights, arr, kernels):
    """A float32 copy of a storage-type device array."""
    import cupy as cp
    if dw.dtype == "F32":
        return arr.astype(cp.float32)
    out = cp.empty(arr.shape, dtype=cp.float32)
    n = arr.size
    kernels.fn["w_to_f32"]((max(1, min(4096, (n + 255) // 256)),), (256,), (arr, out, cp.int64(n)))
    return out
