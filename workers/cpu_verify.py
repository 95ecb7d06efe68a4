"""The CPU backend's speculative verify pass: k + 1 positions (the last sampled token and k drafts)
through every layer of a one-lane model in one pass over the weights, logits for every position.

Each position's arithmetic is FastDecoder.layer_one, the function the plain step calls (the same GEMVs
on the same fused float32 matrices, the same RoPE, attention and rms), so row t of the result is bitwise the
logits plain steps give at that position: greedy and seeded ids cannot depend on whether a token
came out of a verify pass, and the KV entries written are the plain path's. What changes is the
loop order: layer outer, position inner, so a layer's matrices (14 MB for SmolLM2-135M, inside a
32 MB L3) come from memory once and from cache for the other k positions, and the tied LM head
(113 MB, larger than any cache) is applied in blocks of rows that do fit. On the 2-core EPYC this
was written on, a GEMV from cache runs at about half a step's time (the kernel, not DRAM, is then the
limit), so a pass costs about 1 + 0.5 k steps. One GEMM over the k + 1 columns would reuse each
weight from registers (measured about 1.7x cheaper at 8 columns, dearer at 2), but OpenBLAS's sgemm
sums in another order than its sgemv, so ids could then differ from plain decoding at near-ties.
"""
from __future__ import annotations

import numpy as np

from .cpu_decode import FastDecoder, set_blas_threads

_F32 = np.float32
HEAD_BLOCK = 1024   # LM head rows per block: 2.4 MB at D 576, in L2/L3 while every position reads it
                    # (faster here than 4096-row blocks); a multiple of the GEMV kernels' row groups,
                    # so the blocks' sums are the whole matrix's


def supports(decoder: FastDecoder | None) -> bool:
    """Whether verify_rows runs for this decoder's model (one lane: the Llama family). Several lanes
    exchange partial sums between layers, and the engine's batched forward does that for a pass."""
    return decoder is not None and decoder.cfg.num_lanes == 1


def verify_rows(decoder: FastDecoder, eng, ids) -> np.ndarray:
    """Logits [T, V] of the T = len(ids) positions after what `eng`'s cache holds, as T calls of
    decoder.step(eng, id) would give them, one after another; the cache then holds all T (the caller
    truncates the rejected ones away, as after engine.forward)."""
    ids = [int(t) for t in ids]
    T, pos0 = len(ids), eng.pos
    if T == 0:
        raise ValueError("a verify pass needs at least one position")
    if pos0 + T > eng.max_seq:
        raise ValueError(f"context of {pos0 + T} tokens exceeds the limit of {eng.max_seq}")
    if not supports(decoder):
        raise ValueError("verify_rows runs one-lane models only")
    for c in eng.caches:
        c.ensure(pos0 + T)
    # the count the decoder's own steps find faster now; these passes are not its samples (longer)
    n = decoder.preferred_threads()
    own = bool(n) and n != decoder.base_threads
    if own:
        set_blas_threads(n)
    try:
        return _rows_one(decoder, eng, ids, pos0)
    finally:
        if own:
            set_blas_threads(decoder.base_threads)


def _rows_one(d: FastDecoder, eng, ids: list[int], pos0: int) -> np.ndarray:
    T = len(ids)
    QKV = np.empty((T, d.nq + 2 * d.nk), _F32)
    GU = np.empty((T, 2 * d.F), _F32)
    vec, t_buf = np.empty(d.cfg.hidden_size, _F32), np.empty(d.F, _F32)
    bufs = [d.one_lane_buffers(QKV[t], GU[t], vec, t_buf) for t in range(T)]
    rots = [d.rope_rotation(pos0 + t) for t in range(T)]
    # one embedding row at a time: the step's own call, so its dequantization is the step's
    H = [d.embed(np.asarray([tok], dtype=np.int64)).astype(_F32)[0] for tok in ids]
    for c, layer in zip(eng.caches, d.one):      # layer outer: its matrices come from memory once
        for t in range(T):
            d.layer_one(H[t], pos0 + t, rots[t], layer, c.k[0], c.v[0], bufs[t])
    eng.pos = pos0 + T
    N = [d.rms(h, d.fw.norm[0]) for h in H]
    head = d.fw.head
    rows = np.empty((T, head.shape[0]), _F32)
    for b in range(0, head.shape[0], HEAD_BLOCK):
        blk = head[b:b + HEAD_BLOCK]
        for t in range(T):
            np.matmul(blk, N[t], out=rows[t, b:b + HEAD_BLOCK])
    return rows
