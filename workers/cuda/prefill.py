"""Batched prefill on the GPU: the prompt's tokens go through every layer at once, filling the KV cache.

Projections are cuBLAS strided-batched GEMMs over the lanes (storage type in, fp32 accumulate and out:
bf16 and fp16 on the tensor cores, fp32 as plain SGEMM); norms, RoPE + cache append, attention, SiLU and
the DTP combine are the kernels of prefill.cu. Only the KV cache is the result: the monokernel then feeds
the last prompt token as its first decode step, so the prefill needs no LM head.

Quantized layer matrices are dequantized a layer at a time into a scratch of the storage type (exactly
gguf's values: weights.DeviceWeights.dequantize) for the GEMMs. With `overlap` (the default; the
environment's KOG_PREFILL_OVERLAP=0 turns it off) layer i + 1 is dequantized on a second stream into the
other of two scratch buffers while layer i computes: events order each dequantization after the GEMMs that
last read its buffer, and each layer's GEMMs after its dequantization.
"""
from __future__ import annotations

import os

import numpy as np

CUDA_R_32F, CUDA_R_16F, CUDA_R_16BF = 0, 2, 14
CUBLAS_COMPUTE_32F, CUBLAS_COMPUTE_32F_PEDANTIC = 68, 69
CUBLAS_GEMM_DEFAULT = -1
OP_N, OP_T = 0, 1
DT_CODE = {"BF16": CUDA_R_16BF, "F16": CUDA_R_16F, "F32": CUDA_R_32F}


class Prefill:
    """cfg: the shapes this rank computes (the model's config, or a multirank.RankView). comm (several
    ranks, a kccl CudaCommunicator): each layer's partials of every lane [LG][T][D] live in a
    kccl.cuda_shared.SharedBuffer that every rank maps; a rank's GEMM writes its lanes' rows in place, a
    comm.barrier() orders every rank's writes, and each rank copies the other ranks' lanes straight out of
    their buffers (one copy per peer, over NVLink between GPUs), then pf_combine_mr applies the combine to
    its lanes in lane order (the one-rank arithmetic). A slot of the buffer is written again 2 (delta + 1)
    exchanges later, after every rank has passed the barriers that follow its copies."""

    def __init__(self, cfg, dw, kernels, max_chunk: int = 2048, rope=None, comm=None, max_seq: int | None = None,
                 overlap: bool | None = None):
        import cupy as cp
        self.cfg, self.dw, self.k = cfg, dw, kernels
        self.comm = comm if comm is not None and getattr(comm, "size", 1) > 1 else None
        self.max_chunk = max_chunk
        self.rope = rope
        self.cp = cp
        self._alpha = np.ones(1, np.float32)
        self._beta = np.zeros(1, np.float32)
        self._bufs = {}
        self.wdt = DT_CODE[dw.base]   # quantized layer matrices: their dequantization in this type (dw.layer)
        if overlap is None:
            overlap = os.environ.get("KOG_PREFILL_OVERLAP", "1") != "0"
        self.overlap = bool(dw.qtype) and bool(overlap)
        self._side = None             # (stream, ready events, free events) of the overlapped dequantization
        self.compute = CUBLAS_COMPUTE_32F_PEDANTIC if dw.base == "F32" else CUBLAS_COMPUTE_32F
        self.shared = None   # the multi-rank exchange buffer: made here, at start-up (collective)
        if self.comm is not None:
            from kccl.cuda_shared import SharedBuffer
            self._tcap = min(max_chunk, max_seq or max_chunk)   # the longest chunk; every rank the same
            self.shared = SharedBuffer(self.comm, (cfg.broadcast_delay + 1) * 2 * cfg.full.num_lanes * self._tcap *
                                       cfg.hidden_size * 4)

    def close(self) -> None:
        if self.shared is not None:
            self.shared.close()
            self.shared = None

    def _buf(self, name, shape, dtype):
        cp = self.cp
        b = self._bufs.get(name)
        n = int(np.prod(shape))
        if b is None or b.size < n:
            b = cp.empty(n, dtype=dtype)
            self._bufs[name] = b
        return b[:n].reshape(shape)

    def _gemm(self, W, m, K, X, T, Y):
        """Per lane Y[l] [T, m] (fp32) = X[l] [T, K] @ W[l]^T, W[l] [m, K] (storage type)."""
        from cupy_backends.cuda.libs import cublas
        L = self.cfg.num_lanes
        h = self.cp.cuda.device.get_cublas_handle()
        cublas.gemmStridedBatchedEx(
            h, OP_T, OP_N, m, T, K,
            self._alpha.ctypes.data, W.data.ptr, self.wdt, K, m * K,
            X.data.ptr, self.wdt, K, T * K,
            self._beta.ctypes.data, Y.data.ptr, CUDA_R_32F, m, T * m,
            L, self.compute, CUBLAS_GEMM_DEFAULT)

    def run(self, ids, pos0: int, kc, vc, max_seq: int) -> None:
        for s in range(0, len(ids), self.max_chunk):
            self._chunk(ids[s:s + self.max_chunk], pos0 + s, kc, vc, max_seq)

    def _chunk(self, ids, pos0, kc, vc, max_seq):
        cp, cfg, dw, fn = self.cp, self.cfg, self.dw, self.k.fn
        T = len(ids)
        L, D, N, hd = cfg.num_lanes, cfg.hidden_size, cfg.num_hidden_layers, cfg.head_dim
        hdl, fl = cfg.heads_per_lane * hd, cfg.ffn_per_lane
        rqkv = (cfg.heads_per_lane + 2 * cfg.kv_heads_per_lane) * hd
        delta = cfg.broadcast_delay
        st = dw.emb.dtype
        ids_d = cp.asarray(np.asarray(ids, dtype=np.int32))
        X = self._buf("X", (L, T, D), cp.float32)
        Xn = self._buf("Xn", (L, T, max(D, fl, hdl)), st)
        Y = self._buf("Y", (L, T, max(rqkv, 2 * fl)), cp.float32)
        Q = self._buf("Q", (L, T, hdl), cp.float32)
        parts = self._buf("P", (delta + 1, 2, L, T, D), cp.float32) if self.comm is None else None
        grid = lambda n: (int(max(1, min(65535, (n + 255) // 256))),)
        fn["pf_embed"](grid(T * D), (256,), (dw.emb, ids_d, np.int32(T), X))
        for i, r in self._layers(N):
            # attention
            xn = Xn.reshape(-1)[:L * T * D]
            fn["pf_norm"]((L * T,), (256,), (X, dw.norms[i, 0], xn, np.int32(T)))
            y = Y.reshape(-1)[:L * T * rqkv]
            self._gemm(r["qkv"], rqkv, D, xn, T, y)
            fn["pf_rope"](grid(L * T * rqkv // 2), (256,), (y, np.int32(T), np.int32(pos0), np.int32(i), Q, kc, vc,
                                                          np.int64(max_seq), self.rope,
                                                          dw.bias[i] if dw.bias is not None else np.uint64(0)))
            o = Xn.reshape(-1)[:L * T * hdl]
            nw = T * cfg.num_attention_heads
            fn["pf_attn"](((nw + 7) // 8,), (256,), (Q, kc, vc, np.int32(T), np.int32(pos0), np.int32(i),
                                                     np.int64(max_seq), o))
            self._combine_kind(i, 0, r["wo"], D, hdl, o, T, parts, X)
            # mlp
            fn["pf_norm"]((L * T,), (256,), (X, dw.norms[i, 1], xn, np.int32(T)))
            y = Y.reshape(-1)[:L * T * 2 * fl]
            self._gemm(r["w13"], 2 * fl, D, xn, T, y)
            hb = Xn.reshape(-1)[:L * T * fl]
            fn["pf_silu"](grid(L * T * fl), (256,), (y, hb, np.int64(L * T * fl)))
            self._combine_kind(i, 1, r["w2"], D, fl, hb, T, parts, X)

    def _layers(self, N: int):
        """(i, layer i's GEMM operands) for i = 0 .. N - 1, in the order the caller issues the layers' work on
        the current stream. Plain storage: views of the weights. Quantized, overlapped: layer i + 1's
        dequantization is issued on the side stream into buffer (i + 1) % 2 when layer i is handed out,
        after the free event of that buffer (recorded on the main stream once the caller has issued all of
        layer i - 1's work, which read it; across chunks and prefills alike), and layer i's work waits for
        the ready event of its buffer. An event never recorded is a no-op to wait on (the first uses)."""
        cp, dw = self.cp, self.dw
        if not dw.qtype or not self.overlap:
            for i in range(N):
                yield i, dw.layer(i, self.k)
            return
        if self._side is None:
            ev = lambda: [cp.cuda.Event(block=False, disable_timing=True) for _ in range(2)]
            self._side = (cp.cuda.Stream(non_blocking=True), ev(), ev())
        side, ready, free = self._side
        main = cp.cuda.get_current_stream()

        def issue(j):
            s = j % 2
            side.wait_event(free[s])
            with side:
                r = dw.layer(j, self.k, slot=s)
            ready[s].record(side)
            return r

        nxt = issue(0)
        for i in range(N):
            r = nxt
            main.wait_event(ready[i % 2])
            if i + 1 < N:
                nxt = issue(i + 1)
            try:
                yield i, r
            finally:
                free[i % 2].record(main)

    def _lanes_all(self, slot: int, kind: int, T: int):
        """(byte offset, [LG][T][D] float32 view) of an exchange slot in the shared buffer."""
        LG, D = self.cfg.full.num_lanes, self.cfg.hidden_size
        off = (slot * 2 + kind) * LG * self._tcap * D * 4
        return off, self.shared.view(off, (LG, T, D), np.float32)

    def _exchange(self, off: int, T: int) -> None:
        """Every rank's lanes of the slot at `off` into this rank's buffer (the one-rank [LG][T][D])."""
        L, D = self.cfg.num_lanes, self.cfg.hidden_size
        self.comm.barrier()                 # every rank's GEMM of this slot is done (stream order)
        for q in range(self.comm.size):     # rank q runs lanes [q L, (q + 1) L)
            self.shared.copy_from(q, off + q * L * T * D * 4, L * T * D * 4)

    def _combine_kind(self, i, kind, W, m, K, inp, T, parts, X):
        cfg, fn = self.cfg, self.k.fn
        delta = cfg.broadcast_delay
        if self.comm is not None:
            off, PA = self._lanes_all(i % (delta + 1), kind, T)
            g0 = cfg.lanes.start
            self._gemm(W, m, K, inp, T, PA[g0:g0 + cfg.num_lanes])
            self._exchange(off, T)
            j = i - delta
            old = None
            if cfg.use_comm and j >= 0 and (j >= delta or cfg.early_layers_to_future):
                old = self._lanes_all(j % (delta + 1), kind, T)[1]
            n = T * cfg.hidden_size
            grid = (int(max(1, min(65535, (n + 255) // 256))),)
            fn["pf_combine_mr"](grid, (256,), (X, PA, old if old is not None else np.uint64(0), np.int32(i),
                                              np.int32(T), np.int32(cfg.lanes.start)))
            return
        P = parts[i % (delta + 1), kind]
        self._gemm(W, m, K, inp, T, P)
        old = None
        j = i - delta
        if cfg.use_comm and j >= 0 and (j >= delta or cfg.early_layers_to_future):
            old = parts[j % (delta + 1), kind]
        n = T * cfg.hidden_size
        grid = (int(max(1, min(65535, (n + 255) // 256))),)
        fn["pf_combine"](grid, (256,), (X, P, old if old is not None else np.uint64(0), np.int32(i), np.int32(T)))
