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

import os
import sys

import numpy as np

from kog_dist.checkpoint import check_finite, check_finite_bits

from . import kquant

STORAGE_NP = {"BF16": np.uint16, "F16": np.float16, "F32": np.float32}
QTYPES = {"Q8_0": 1, "Q4_0": 2, "Q4_1": 3}          # CFG_QW of each quantized storage of the layer matrices
QBITS = {"Q8_0": 8, "Q4_0": 4, "Q4_1": 4}
QSCALE_BYTES = {"Q8_0": 2, "Q4_0": 2, "Q4_1": 4}     # a block's fp16 d (and fp16 m) in the scale array
LAYER_MATRICES = ("attention.wq", "attention.wk", "attention.wv", "attention.wo",
                  "feed_forward.w1", "feed_forward.w2", "feed_forward.w3")


def split_dtype(dtype: str) -> tuple[str | None, str]:
    """A storage name -> (quantized type of the layer matrices or None, storage type of the rest).
    "BF16" / "F16" / "F32": everything in that type; "Q8_0" / "Q4_0" / "Q4_1": the layer matrices in GGUF
    blocks, embedding, LM head and KV cache in BF16; "Q4_0:F32": the same with the rest in F32 (exact tests)."""
    q, _, base = str(dtype).upper().partition(":")
    if q in QTYPES or kquant.parse(q):
        base = base or "BF16"
        if base not in STORAGE_NP:
            raise ValueError(f"unknown storage type {dtype!r}")
        return q, base
    if q in STORAGE_NP and not base:
        return None, q
    raise ValueError(f"unknown storage type {dtype!r} (known: BF16, F16, F32, Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K, "
                     "Q4_K_M, Q5_K_M, e.g. Q4_0:F32)")


def qw_code(qtype: str | None) -> int:
    """CFG_QW of a quantized storage of the layer matrices (common.cuh): 0 none, 1-3 Q8_0 / Q4_0 / Q4_1, 4 the
    K-quants (kquant.cuh)."""
    if not qtype:
        return 0
    return QTYPES.get(qtype) or 4


def layer_elems(cfg) -> int:
    L, D, hd = cfg.num_lanes, cfg.hidden_size, cfg.head_dim
    rqkv = (cfg.heads_per_lane + 2 * cfg.kv_heads_per_lane) * hd
    hdl, fl = cfg.heads_per_lane * hd, cfg.ffn_per_lane
    return L * rqkv * D + L * D * hdl + L * fl * 2 * D + L * D * fl


def matrix_bytes(n: int, dtype: str) -> int:
    """Bytes of n elements of the layer matrices in storage `dtype` (quants and scales when quantized)."""
    q, base = split_dtype(dtype)
    if q and kquant.parse(q):   # the K-quants: the first (lowest) type's
        return int(n * kquant.bytes_per_weight(kquant.parse(q)[0]))
    if q:
        return n * QBITS[q] // 8 + n // 32 * QSCALE_BYTES[q]
    return n * STORAGE_NP[base]().itemsize


def field_elems(cfg) -> dict[str, int]:
    """Elements of each matrix field of a layer (kquant.MATRIX_FIELDS), all lanes."""
    D, hd = cfg.hidden_size, cfg.head_dim
    H, KV, F = cfg.heads_per_lane * cfg.num_lanes, cfg.kv_heads_per_lane * cfg.num_lanes, cfg.ffn_per_lane * cfg.num_lanes
    return {"attention.wq": H * hd * D, "attention.wk": KV * hd * D, "attention.wv": KV * hd * D,
            "attention.wo": D * H * hd, "feed_forward.w13": 2 * F * D, "feed_forward.w2": D * F}


def streamed_bytes(cfg, dtype: str, ktypes: list | None = None) -> int:
    """Weight bytes read per decoded token: every layer and the LM head (not the embedding table). A rank's
    view (multirank.RankView): its lanes and its share of the LM head rows. K-quants: each matrix in its type
    (`ktypes`, a dict a layer as DeviceWeights.ktypes; by default the storage name's mix)."""
    q, base = split_dtype(dtype)
    isz = STORAGE_NP[base]().itemsize
    lm = getattr(cfg, "lm_rows", cfg.vocab_size) * cfg.hidden_size * isz
    if q and kquant.parse(q):
        N, fe = cfg.num_hidden_layers, field_elems(cfg)
        ktypes = ktypes or [kquant.layer_types(q, i, N) for i in range(N)]
        return int(sum(fe[f] * kquant.bytes_per_weight(t[f]) for t in ktypes for f in fe)) + lm
    return matrix_bytes(layer_elems(cfg), dtype) * cfg.num_hidden_layers + lm


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
        self.qtype, self.base = split_dtype(dtype)
        D, L, N, V = cfg.hidden_size, cfg.num_lanes, cfg.num_hidden_layers, cfg.vocab_size
        st = STORAGE_NP[self.base]
        self.layer_elems = layer_elems(cfg)
        self.kq = bool(self.qtype and kquant.parse(self.qtype))
        self.wh = self.kt = None
        if self.kq:   # kquant.cuh's arrays: nibbles, high bits (Q5_K / Q6_K), a record a super-block, types
            n = N * self.layer_elems
            self.w = cp.zeros(n // 2, dtype=cp.uint8)
            if kquant.parse(self.qtype) != ("Q4_K",):
                self.wh = cp.zeros(n // 4, dtype=cp.uint8)
            self.ws = cp.zeros(-(-n // 256) * kquant.REC + 16, dtype=cp.uint8)
            self.kt = cp.zeros(N, dtype=cp.uint32)
            self.ktypes: list = [None] * N
        elif self.qtype:
            n = N * self.layer_elems
            self.w = cp.empty(n * QBITS[self.qtype] // 8, dtype=cp.uint8)
            # + 16 bytes: a block's shared-memory copy of its scales (wbuf_fill_w) reads whole 16-byte pieces
            self.ws = cp.zeros(n // 32 * QSCALE_BYTES[self.qtype] // 2 + 8, dtype=cp.uint16)
        else:
            self.w = cp.empty(N * self.layer_elems, dtype=st)
            self.ws = None
        self.norms = cp.empty((N, 2, L, D), dtype=cp.float32)
        self.fnorm = cp.empty((L, D), dtype=cp.float32)
        self.emb = cp.empty((V, D), dtype=st)
        # an untied head on one of several ranks holds only the rows that rank computes (multirank.lm_rows);
        # the kernel indexes it by vocabulary id, so lm_ptr() hands it a base lm_row0 rows before the array
        rows = getattr(cfg, "lm_range", range(V))
        self.lm_row0 = rows.start if not cfg.tie_word_embeddings else 0
        self.lm = self.emb if cfg.tie_word_embeddings else cp.empty((len(rows), D), dtype=st)
        rq = (cfg.heads_per_lane + 2 * cfg.kv_heads_per_lane) * cfg.head_dim
        self.bias = cp.zeros((N, L, rq), dtype=cp.float32) if getattr(cfg, "attention_bias", False) else None
        self._scratch = None

    def region_shapes(self):
        cfg = self.cfg
        L, D, hd = cfg.num_lanes, cfg.hidden_size, cfg.head_dim
        rqkv = (cfg.heads_per_lane + 2 * cfg.kv_heads_per_lane) * hd
        hdl, fl = cfg.heads_per_lane * hd, cfg.ffn_per_lane
        return [("qkv", (L, rqkv, D)), ("wo", (L, D, hdl)), ("w13", (L, fl, 2, D)), ("w2", (L, D, fl))]

    def region_offset(self, name: str) -> int:
        off = 0
        for n, shape in self.region_shapes():
            if n == name:
                return off
            off += int(np.prod(shape))
        raise KeyError(name)

    # views of one layer's regions (elements of the storage type; plain storage only)
    def regions(self, i: int, base=None):
        if self.qtype and base is None:
            raise ValueError("quantized layer matrices have no plain views: use layer(i, kernels)")
        w = self.w if base is None else base
        out, off = {}, (i * self.layer_elems if base is None else 0)
        for name, shape in self.region_shapes():
            n = int(np.prod(shape))
            out[name] = w[off:off + n].reshape(shape)
            off += n
        return out

    def field_ranges(self):
        """(field, lane, first element inside a layer, elements) of every matrix field (kquant.MATRIX_FIELDS) of
        each lane: the regions' layout (module docstring)."""
        cfg = self.cfg
        L, D, hd = cfg.num_lanes, cfg.hidden_size, cfg.head_dim
        hdl, kvdl, fl = cfg.heads_per_lane * hd, cfg.kv_heads_per_lane * hd, cfg.ffn_per_lane
        rqkv = hdl + 2 * kvdl
        off = {n: self.region_offset(n) for n in ("wo", "w13", "w2")}
        out = []
        for l in range(L):
            q0 = l * rqkv * D
            out += [("attention.wq", l, q0, hdl * D), ("attention.wk", l, q0 + hdl * D, kvdl * D),
                    ("attention.wv", l, q0 + (hdl + kvdl) * D, kvdl * D),
                    ("attention.wo", l, off["wo"] + l * D * hdl, D * hdl),
                    ("feed_forward.w13", l, off["w13"] + l * fl * 2 * D, fl * 2 * D),
                    ("feed_forward.w2", l, off["w2"] + l * D * fl, D * fl)]
        return out

    def set_ktypes(self, i: int, types: dict[str, str]) -> None:
        self.ktypes[i] = dict(types)
        self.kt[i] = kquant.type_word(types)

    def put_k(self, i: int, e0: int, nib, hi, rec) -> None:
        """Write K-quant arrays (kquant.relayout's, on the device) at element e0 of layer i (a multiple of 256)."""
        e = i * self.layer_elems + e0
        if e % 256:
            raise ValueError("K-quant matrices must start on a super-block (256 elements)")
        self.w[e // 2:e // 2 + nib.size] = nib
        if hi is not None:
            self.wh[e // 4:e // 4 + hi.size] = hi
        r0 = e // 256 * kquant.REC
        self.ws[r0:r0 + rec.size] = rec

    def layer(self, i: int, kernels, slot: int = 0):
        """Layer i's regions in the storage type: views of the weights, or (quantized matrices) their exact
        dequantization into scratch buffer `slot` (0 or 1: the prefill dequantizes the next layer into one
        while the GEMMs read the other), the prefill's GEMM operands. The kernels go on the current stream."""
        if not self.qtype:
            return self.regions(i)
        buf = self.scratch(slot)
        self.dequantize(i, kernels, buf)
        return self.regions(i, buf)

    def scratch(self, slot: int = 0):
        """Scratch buffer `slot` of one layer in the storage type (made on first use, kept)."""
        import cupy as cp
        if self._scratch is None:
            self._scratch = {}
        if slot not in self._scratch:
            self._scratch[slot] = cp.empty(self.layer_elems, dtype=STORAGE_NP[self.base])
        return self._scratch[slot]

    def dequantize(self, i: int, kernels, out) -> None:
        """Layer i's quantized matrices into `out` [layer_elems] (storage type), gguf's values exactly:
        prefill.cu q_to_w / kq_to_w, a thread for each 8 weights (one 16-byte store)."""
        grid = lambda pieces: (int(max(1, min(1 << 20, (pieces + 255) // 256))),)
        if self.kq:
            for field, _, e0, n in self.field_ranges():
                c0 = (i * self.layer_elems + e0) // 32
                kernels.fn["kq_to_w"](grid(n // 8), (256,),
                                      (self.w, self.w if self.wh is None else self.wh, self.ws,
                                       np.int32(kquant.KTYPES[self.ktypes[i][field]]), np.int64(c0),
                                       np.int64(n // 32), out[e0:e0 + n]))
            return
        nb = self.layer_elems // 32
        kernels.fn["q_to_w"](grid(nb * 4), (256,), (self.w, self.ws, np.int64(i * nb), np.int64(nb), out))

    def put(self, i: int, name: str, lane: int | None, values, kernels) -> None:
        """Write float32 device `values` into region `name` of layer i (one lane's slice, or all lanes):
        converted to the storage type, or quantized (gguf.quants' rounding, prefill.cu f32_to_q)."""
        import cupy as cp
        if self.kq:
            raise ValueError("K-quant matrices are written from blocks (put_k), not quantized from floats")
        shape = dict(self.region_shapes())[name]
        per_lane = int(np.prod(shape[1:]))
        e0 = i * self.layer_elems + self.region_offset(name) + (lane or 0) * per_lane
        x = cp.ascontiguousarray(values, dtype=cp.float32).reshape(-1)
        if not self.qtype:
            dst = self.w[e0:e0 + x.size]
            if self.base == "F32":
                dst[...] = x
            else:
                kernels.fn["f32_to_w"]((max(1, min(4096, (x.size + 255) // 256)),), (256,), (x, dst, np.int64(x.size)))
            return
        nb = x.size // 32
        kernels.fn["f32_to_q"]((max(1, min(4096, (nb + 255) // 256)),), (256,),
                               (x, np.int64(e0 // 32), np.int64(nb), self.w, self.ws))

    def lm_ptr(self) -> int:
        """The kernel's p.lm: the address of vocabulary row 0, lm_row0 rows before a rank's own rows."""
        return self.lm.data.ptr - self.lm_row0 * self.cfg.hidden_size * self.lm.itemsize

    @property
    def nbytes(self) -> int:
        n = self.w.nbytes + self.norms.nbytes + self.fnorm.nbytes + self.emb.nbytes
        n += 0 if self.ws is None else self.ws.nbytes
        n += 0 if self.wh is None else self.wh.nbytes
        n += 0 if self.bias is None else self.bias.nbytes
        return n + (0 if self.lm is self.emb else self.lm.nbytes)


def open_source(model, cfg=None):
    """A tensor source for `model`: a source object as it is, or a path opened with
    kog_dist.formats.open_model (every format), or as a Laneformer directory with `cfg` given."""
    if not isinstance(model, (str, os.PathLike)):
        return model
    from kog_dist.checkpoint import CheckpointReader
    if cfg is not None:
        return CheckpointReader(os.fspath(model), cfg)
    try:
        from kog_dist.formats import open_model
    except ImportError:
        return CheckpointReader(os.fspath(model))
    return open_model(os.fspath(model), progress=False)


def default_dtype(src) -> str:
    """The storage of a source's weights when none is asked: a GGUF whose layer matrices are all Q8_0,
    Q4_0 or Q4_1 stays in that type (embedding and LM head in BF16); other quantized types are
    dequantized to BF16 (with a notice); else the checkpoint's own type."""
    cfg = src.cfg
    qt = getattr(src, "quant_type", lambda n: None)
    names = [f"model.layers.{i}.{m}.weight" for i in range(cfg.num_hidden_layers) for m in LAYER_MATRICES]
    kinds = {qt(n) for n in names}
    if len(kinds) == 1 and next(iter(kinds)) in QTYPES:
        return next(iter(kinds))
    why = kquant_reason(src) if kinds <= set(kquant.KTYPES) else None
    if kinds <= set(kquant.KTYPES) and why is None:
        return "+".join(t for t in kquant.KTYPES if t in kinds)
    if why:
        print(f"[kog] cuda backend: K-quant layer matrices dequantized to BF16 at load ({why})",
              file=sys.stderr, flush=True)
        return "BF16"
    if kinds != {None}:
        other = sorted(k for k in kinds if k is not None)
        print(f"[kog] cuda backend: layer matrices of types {', '.join(other)} are dequantized to BF16 at load",
              file=sys.stderr, flush=True)
        return "BF16"
    return src.dtype("model.layers.0.attention.wq.weight")


def kquant_reason(src) -> str | None:
    """Why a source's K-quant layer matrices cannot run as stored (None: they can): rows of whole super-blocks,
    gate and up of one type; split over N ranks (a tp_lanes.LaneSource), each lane's columns of wo and w2
    (heads * head_dim / N, intermediate_size / N) whole super-blocks too."""
    cfg = src.cfg
    dims = {"hidden_size": cfg.hidden_size, "heads * head_dim": cfg.num_attention_heads * cfg.head_dim,
            "intermediate_size": cfg.intermediate_size}
    for name, v in dims.items():
        if v % 256:
            return f"{name}={v} is not a multiple of 256"
    n = getattr(src, "tp_ranks", 1)
    if n > 1:
        cuts = src.column_cuts() if hasattr(src, "column_cuts") else None
        if cuts is None:
            return f"split over {n} ranks by a source that serves no lane blocks"
        what = {"wo": "heads * head_dim", "w2": "intermediate_size"}
        for m, v in cuts.items():
            if v % 256:
                return (f"split over {n} ranks, each rank's {m} columns ({what[m]} / {n} = {v}) are not a "
                        f"multiple of the 256-weight super-blocks")
    if not hasattr(getattr(src, "src", src) if n > 1 else src, "blocks"):
        return "the source serves no raw blocks"
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}.feed_forward."
        if src.quant_type(p + "w1.weight") != src.quant_type(p + "w3.weight"):
            return f"layer {i}'s gate and up are of different types"
    return None


def _load_kquant(dw, src, i: int, lanes: range | None = None) -> None:
    """Layer i's matrices from the file's super-blocks, re-laid on the device (kquant.relayout); W13's gate
    and up rows interleaved as the layout wants. `lanes`: the global lanes of dw's (local) lanes, read from a
    lane view (tp_lanes.LaneSource.blocks: each lane's rows, or its super-block columns of wo / w2); None:
    the one lane of a one-lane source."""
    import cupy as cp
    p = f"model.layers.{i}."
    types, ranges = {}, {(f, j): e0 for f, j, e0, _ in dw.field_ranges()}
    if lanes is None and dw.cfg.num_lanes != 1:
        raise ValueError(f"K-quant blocks of {dw.cfg.num_lanes} lanes need a lane view's blocks")

    def blocks(name, g):
        if lanes is None:
            b, t = src.blocks(p + name + ".weight")
        else:
            b, t = src.blocks(p + name + ".weight", range(g, g + 1))
            b = b[0]
        return kquant.relayout(cp.asarray(b), t, xp=cp), t, b.shape[0]

    for j, g in enumerate(lanes if lanes is not None else (0,)):
        for field in ("attention.wq", "attention.wk", "attention.wv", "attention.wo", "feed_forward.w2"):
            arrs, types[field], _ = blocks(field, g)
            dw.put_k(i, ranges[field, j], *arrs)
        (n1, h1, r1), t, rows = blocks("feed_forward.w1", g)
        (n3, h3, r3), _, _ = blocks("feed_forward.w3", g)
        types["feed_forward.w13"] = t
        pair = lambda a, b: None if a is None else cp.stack([a.reshape(rows, -1), b.reshape(rows, -1)],
                                                            axis=1).reshape(-1)
        dw.put_k(i, ranges["feed_forward.w13", j], pair(n1, n3), pair(h1, h3), pair(r1, r3))
    dw.set_ktypes(i, types)


def load_checkpoint(model, cfg=None, dtype: str | None = None, progress=None, view=None,
                    kernels=None) -> DeviceWeights:
    """Read a checkpoint (a path or a tensor source: kog_dist.formats.open_model, CheckpointReader) and
    upload it in the streaming layout: all lanes, or with `view` (a multirank.RankView of this config) the
    rank's lanes only (the embedding on every rank; of an untied LM head only the rows the rank computes,
    multirank.lm_rows, read as a row range). Quantized storage needs `kernels` (a build of that
    storage: its f32_to_q); plain storage converts on the host. A source passed in stays open."""
    import cupy as cp
    from kog_dist.progress import Progress
    own = isinstance(model, (str, os.PathLike))
    src = open_source(model, cfg)
    cfg = src.cfg
    dtype = dtype or default_dtype(src)
    dw = DeviceWeights(view if view is not None else cfg, dtype)
    if dw.kq and kquant_reason(src):
        raise ValueError(f"{dtype} storage of this checkpoint: {kquant_reason(src)}")
    if dw.qtype and kernels is None:
        raise ValueError("quantized storage is written by the kernels of its build: pass kernels=")
    N, L, D = cfg.num_hidden_layers, dw.cfg.num_lanes, cfg.hidden_size
    lanes = view.lanes if view is not None else None
    base = dw.base

    # a NaN or inf weight is refused with its name (kog_dist.checkpoint.check_finite): storage bits on a
    # sample of rows (a full pass would cost the upload a second read), float32 tensors in full
    def raw(name, lane_first=False, rows=None):
        a, dt = src.raw(name, lanes) if lane_first and lanes is not None else src.raw(name, None, rows)
        return _to_storage(check_finite_bits(name, a, dt, sample=256), dt, base)

    def tensor(name, lane_first=False):
        return check_finite(name, src.tensor(name, lanes) if lane_first and lanes is not None else src.tensor(name))

    def mat(name):   # a lane-first matrix for the layer regions: storage bits, or float32 to quantize
        return tensor(name, True) if dw.qtype else raw(name, True)

    def norm(prefix):
        if cfg.replicated_rmsn_scale:
            return np.broadcast_to(tensor(prefix + ".weight"), (L, D))
        return np.broadcast_to(tensor(prefix + ".scale", True), (L, D))

    def put(i, name, arr):
        if dw.qtype:
            dw.put(i, name, None, cp.asarray(arr), kernels)
        else:
            dw.regions(i)[name][...] = cp.asarray(arr)

    total = N + 2
    if progress is None:
        progress = dw.nbytes > (256 << 20)
    with Progress("uploading weights", total, unit=" parts", enabled=progress) as bar:
        for i in range(N):
            p = f"model.layers.{i}."
            if dw.kq:   # a lane view (tp_lanes.LaneSource): the rank's lanes, or all of them on one rank
                _load_kquant(dw, src, i, (lanes if lanes is not None else range(dw.cfg.num_lanes))
                             if getattr(src, "tp_ranks", 1) > 1 else None)
            else:
                put(i, "qkv", np.concatenate([mat(p + "attention.wq.weight"), mat(p + "attention.wk.weight"),
                                              mat(p + "attention.wv.weight")], axis=1))
                put(i, "wo", mat(p + "attention.wo.weight"))
                put(i, "w13", np.stack([mat(p + "feed_forward.w1.weight"), mat(p + "feed_forward.w3.weight")],
                                       axis=2))
                put(i, "w2", mat(p + "feed_forward.w2.weight"))
            if dw.bias is not None:
                b = [tensor(p + f"attention.b{x}.bias", True) for x in "qkv"]
                dw.bias[i] = cp.asarray(np.concatenate(b, axis=1))
            dw.norms[i, 0] = cp.asarray(norm(p + "attention_norm"))
            dw.norms[i, 1] = cp.asarray(norm(p + "ffn_norm"))
            bar.advance(1)
        dw.fnorm[...] = cp.asarray(norm("model.norm"))
        dw.emb[...] = cp.asarray(raw("model.tok_embeddings.weight"))
        bar.advance(1)
        if not cfg.tie_word_embeddings:   # a rank's rows only (DeviceWeights.lm_row0)
            r = getattr(dw.cfg, "lm_range", None)
            dw.lm[...] = cp.asarray(raw("lm_head.weight", rows=None if r is None else np.arange(r.start, r.stop)))
        bar.advance(1)
    if own:
        src.close()
    cp.cuda.Device().synchronize()
    return dw


_RANDOM_STEP = 1 << 26   # draws a chunk of the random fills (whole blocks of 32 when quantized)


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

    step = _RANDOM_STEP

    def fill(dst, fan_in, rng, scale=1.0, skip=0, total=None):
        # elements [skip, skip + dst.size) of one stream of `total` draws (a rank's LM rows: the values the
        # whole head has there, whatever the rank count)
        flat = dst.reshape(-1)
        total = flat.size if total is None else total
        for a in range(0, min(total, skip + flat.size), step):
            n = min(step, total - a)
            x = rng.standard_normal(n, dtype=cp.float32) * cp.float32(scale / np.sqrt(fan_in))
            lo, hi = max(a, skip), min(a + n, skip + flat.size)
            if lo >= hi:
                continue
            x, out = x[lo - a:hi - a], flat[lo - skip:hi - skip]
            if dw.base == "F32":
                out[...] = x
            else:
                conv((max(1, min(4096, (hi - lo + 255) // 256)),), (256,), (x, out, cp.int64(hi - lo)))

    D, N = cfg.hidden_size, cfg.num_hidden_layers
    fans = {"qkv": D, "wo": cfg.heads_per_lane * cfg.head_dim, "w13": D, "w2": cfg.ffn_per_lane}
    shapes = dict(dw.region_shapes())
    if dw.kq:   # random super-blocks of each matrix's type (kquant.random_blocks), re-laid on the device
        kfan = {"attention.wo": fans["wo"], "feed_forward.w2": fans["w2"]}
        for i in range(N):
            types = kquant.layer_types(dw.qtype, i, N)
            for m, (field, lane, e0, n) in enumerate(dw.field_ranges()):
                if n % 256 or e0 % 256:
                    raise ValueError(f"{dw.qtype} random weights need matrices of whole super-blocks ({field}: {n})")
                blocks = kquant.random_blocks(n // 256, types[field], float(1 / np.sqrt(kfan.get(field, D))),
                                              xp=cp, seed=(seed * 1000003 + i * 64 + m) % (1 << 62))
                dw.put_k(i, e0, *kquant.relayout(blocks, types[field], xp=cp))
                del blocks
            dw.set_ktypes(i, types)
    for i in range(N if not dw.kq else 0):
        for m, (name, fan) in enumerate(fans.items()):
            per_lane = int(np.prod(shapes[name][1:]))
            for j, g in enumerate(lanes):
                rng = rng_of(1, i, m, g)
                # the same draws as one lane-sized fill; chunks of 2^26 (whole blocks of 32 when quantized)
                x = cp.concatenate([rng.standard_normal(min(step, per_lane - a), dtype=cp.float32)
                                    for a in range(0, per_lane, step)]) * cp.float32(1.0 / np.sqrt(fan))
                dw.put(i, name, j, x, kernels)
                del x
    for i in range(N):
        if dw.bias is not None:   # Qwen2-like biases: 0.1 N(0, 1), one generator a layer and lane
            for j, g in enumerate(lanes):
                dw.bias[i, j] = 0.1 * rng_of(6, i, g).standard_normal(dw.bias.shape[-1], dtype=cp.float32)

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
        fill(dw.lm, D, rng_of(5), 2.0, dw.lm_row0 * D, cfg.vocab_size * D)
    cp.cuda.Device().synchronize()
    return dw


def to_float32(dw: DeviceWeights, arr, kernels):
    """A float32 copy of a storage-type device array."""
    import cupy as cp
    if dw.base == "F32":
        return arr.astype(cp.float32)
    out = cp.empty(arr.shape, dtype=cp.float32)
    n = arr.size
    kernels.fn["w_to_f32"]((max(1, min(4096, (n + 255) // 256)),), (256,), (arr, out, cp.int64(n)))
    return out
