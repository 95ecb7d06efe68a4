// mk_lm.cuh: part of monokernel.cu (pasted in place after mk_w2.cuh, the layers' last phase; not a
// standalone header). The LM head phase (final norm, LM rows, each block's best candidate; the last block picks
// or samples the token (mk_sample.cuh), writes it to the host's ring, checks the stops).
#pragma once

// L2 prefetch of the block's LM head rows before it waits for the last layer (with the lane skew the
// lanes that finish first wait longest): PF as the layers' phases (more measured neutral: docs/monokernel.md)
constexpr long long PF_LM = PF;
// returns false when the generation ends with this token
__device__ void phase_lm(const Params& p, float* sm, int n, int tok) {
  int ua, ub;
  tmark(p, n, 5 * NL, 0);
  brange(U_LM, ua, ub);
#if KOG_NRANKS > 1
  const int u0 = (int)kds.rank * U_LM;   // the rank's share of the rows (U_LM units a rank, the last one fewer)
  ua = min(ua + u0, U_LMG);
  ub = min(ub + u0, U_LMG);
  const bool greedy = p.temperature <= 0.0 || p.top_k == 1;
  const u64 fe = (u64)(p.e0[2] + n);   // the final slot's epoch (mr_final)
  const unsigned ftag = (unsigned)fe;
  const long long foff = mr_ll_off(CH_FIN, (int)kds.rank, fe);
#endif
  const int nbuf = wbuf_fill(sm, p.lm + (long long)ua * UE_LM, ub - ua, UE_LM, true);
  prefetch_l2(p.lm + (long long)(ua + nbuf) * UE_LM, (long long)(ub - ua - nbuf) * UE_LM * sizeof(wt), PF_LM);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, tid = threadIdx.x;
  float* y = sm;
  float* red = sm + SM_MAIN - 16 * 8 - 16;
  __shared__ float bv[NW];
  __shared__ int bi[NW];
  __shared__ int last;
  float best = NEG_INF;
  int besti = 0x7fffffff;
#if KOG_NRANKS == 1
  // the host's cancel flag: read here, off the sampler's path (a read of host memory is a PCIe round trip),
  // by one thread of the grid (a read by every block serializes on PCIe: docs/monokernel.md), not a
  // waiter, and handed to the sampler through its ticket
  if (blockIdx.x == 0 && tid == 32) *CTR(p, C_CANCEL) = (u64)*(volatile const int*)p.cancel;
#endif
#if KOG_NRANKS > 1
  {  // every block reads the final exchange, rows or not: it orders the tokens (mk_multirank.cuh)
    if (WAITER) wait_lanes(p, C_W2, 0, L - 1, (u64)(n * NL + NL) * UPL_W2);
    __syncthreads();
    tmark(p, n, 5 * NL, 1);
    cp_async_wait_all();
    mr_final(p, n, tok, red, y);
#else
  if (ua < ub) {
    cp_async_wait_all();
    final_norms(p, tok, red, nullptr, y, n);   // waits for each batch of lanes
#endif
    __syncthreads();
    for (int u = ua + warp; u < ub; u += NW) {
      const int r0 = 2 * u;
      float acc[2];
      if (u - ua < nbuf)
        warp_dot<2, D, true>((const wt*)(sm + WBUF_OFF) + (long long)(u - ua) * UE_LM, min(2, V - r0), y, acc);
      else
        warp_dot<2, D>(p.lm + (long long)r0 * D, min(2, V - r0), y, acc);
      if (lane == 0) {
#pragma unroll
        for (int r = 0; r < 2; ++r)
          if (r0 + r < V) {
            p.logits[r0 + r] = acc[r];
            if (p.dbg_logits) p.dbg_logits[(long long)n * V + r0 + r] = acc[r];
            if (acc[r] > best) { best = acc[r]; besti = r0 + r; }
          }
      }
    }
  }
  if (lane == 0) { bv[warp] = best; bi[warp] = besti; }
  __syncthreads();
  tmark(p, n, 5 * NL, 2);
  if (tid == 0) {
    for (int w = 0; w < NW; ++w)
      if (bv[w] > best || (bv[w] == best && bi[w] < besti)) { best = bv[w]; besti = bi[w]; }
    p.cand_v[blockIdx.x] = best;
    p.cand_i[blockIdx.x] = besti;
    u64 tk;   // one acq_rel atomic. Release: the block's candidates and logits (ordered by the barrier above);
              // acquire: everyone's (no SC fences around it)
    asm volatile("atom.acq_rel.gpu.global.add.u64 %0, [%1], 1;" : "=l"(tk) : "l"(CTR(p, C_TICKET)) : "memory");
    last = (tk == (u64)(n + 1) * NB - 1);
  }
  __syncthreads();
  if (!last) return;
#if KOG_NRANKS == 1
  int cancel = 0;
  if (tid == 0) cancel = (int)__ldcg(CTR(p, C_CANCEL));   // its latency under the candidates' reduction
#endif
  // ---- the last block to finish the LM head samples the token (with several ranks: one a rank, the same) ----
#if KOG_NRANKS == 1
  const bool greedy = p.temperature <= 0.0 || p.top_k == 1;
#endif
  const u64 counter = (u64)(p.start_pos + n + 1);
  int next;
#if CFG_MASK && KOG_NRANKS == 1
  next = mask_sample(p, sm, n, greedy, counter);   // the host's mask applied (mk_mask.cuh); -1: none came
#else
#if CFG_MASK
  // several ranks: the mask on the rank's rows (greedy: its masked argmax); a rank without its mask posts that in
  // the exchange below, and every rank then ends at this token with no token (-1)
  const int2 mrows = mr_vocab_rows((int)kds.rank);
  float mbest = NEG_INF;
  int mbesti = 0x7fffffff;
  const bool have_mask = mask_rows(p, sm, n, greedy, mrows.x, mrows.y, mbest, mbesti);
#endif
  if (greedy) {
    float bb = NEG_INF;
    int bidx = 0x7fffffff;
#if CFG_MASK
    bb = mbest;
    bidx = mbesti;
#else
    // (max logit, lowest index) over the blocks' candidates: every thread one load, a warp then a block
    // reduction (thread 0 alone took 16 rounds of loads)
    for (int b = tid; b < NB; b += NT) {
      const float v = ldf(p.cand_v + b);
      const int ix = __ldcg(p.cand_i + b);
      if (v > bb || (v == bb && ix < bidx)) { bb = v; bidx = ix; }
    }
#endif
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float ov = __shfl_xor_sync(0xffffffffu, bb, o);
      const int oi = __shfl_xor_sync(0xffffffffu, bidx, o);
      if (ov > bb || (ov == bb && oi < bidx)) { bb = ov; bidx = oi; }
    }
    if (lane == 0) { bv[warp] = bb; bi[warp] = bidx; }   // thread 0 read them before the ticket's barrier
    __syncthreads();
    if (tid == 0) {
      for (int w = 0; w < NW; ++w)
        if (bv[w] > bb || (bv[w] == bb && bi[w] < bidx)) { bb = bv[w]; bidx = bi[w]; }
#if KOG_NRANKS > 1
      // the rank's best to every peer, then theirs: (max logit, lowest index) over all V, as with one rank
#if CFG_MASK
      bool none = !have_mask;
#endif
      for (int q = 0; q < NRK; ++q)
        if (q != (int)kds.rank) {
          u64* w = (u64*)(kds.base[q] + foff) + FW_CAND;
          kccl_ll_st(w, ftag, __float_as_uint(bb));
#if CFG_MASK
          kccl_ll_st(w + 1, ftag, (unsigned)(have_mask ? bidx : MASK_NONE));
#else
          kccl_ll_st(w + 1, ftag, (unsigned)bidx);
#endif
        }
      const u64* w0 = (const u64*)(kds.base[kds.rank] + mr_ll_off(CH_FIN, 0, fe)) + FW_CAND;
      const long long st = (long long)MR_DEPTH * kds.slot_bytes / 8;
      for (int q = 0; q < NRK; ++q)
        if (q != (int)kds.rank) {
          const float ov = __uint_as_float(kccl_ll_get(kds, w0 + q * st, ftag, q, CH_FIN));
          const int oi = (int)kccl_ll_get(kds, w0 + q * st + 1, ftag, q, CH_FIN);
#if CFG_MASK
          if (oi == MASK_NONE) { none = true; continue; }
#endif
          if (ov > bb || (ov == bb && oi < bidx)) { bb = ov; bidx = oi; }
        }
#endif
      if (bidx == 0x7fffffff) bidx = 0;   // all NaN: a broken model; still return something
#if CFG_MASK
      if (none) bidx = -1;
#endif
      last = bidx;
    }
    __syncthreads();
    next = last;
  } else {
#if KOG_NRANKS > 1 && CFG_MASK
    next = sample_full_mr(p, sm, counter, n, !have_mask);   // -1 on every rank when one had no mask
#elif KOG_NRANKS > 1
    next = sample_full_mr(p, sm, counter, n);   // from every rank's candidates (mk_sample.cuh)
#else
    next = sample_full(p, sm, counter);
#endif
  }
#endif
#if KOG_NRANKS > 1
  if (mr_bail()) return;                 // an exchange of this token failed: write no token
#endif
  if (tid == 0) {
    int reason = 0;
    for (int k = 0; k < p.n_eos; ++k) if (p.eos_ids[k] == next) reason = 1;
    if (!reason) for (int k = 0; k < p.n_stop; ++k) if (p.stop_ids[k] == next) reason = 2;
    if (!reason && n + 1 >= p.max_new) reason = 3;
#if KOG_NRANKS > 1
    if (!reason && mr_cancel_s) reason = 4;    // any rank's host raised cancel (the same on every rank)
#else
    if (!reason && cancel) reason = 4;
#endif
#if CFG_MASK
    const bool none = next < 0;   // no mask came (mask_fetch): the generation ends with no token, -1 in the ring
    if (none) { reason = 4; next = 0; }
#endif
    // the blocks first (the embedding row they read next into L2), then the host's ring and status, whose
    // system fence waits for the ring's write over PCIe: off the blocks' path
    prefetch_l2(p.emb + (long long)next * D, (long long)D * sizeof(wt), D * sizeof(wt));
    *CTR(p, C_TOKEN) = (u64)(n + 1);
    *CTR(p, C_STOP) = (u64)reason;
    st_release(CTR(p, C_TOKVAL), ((u64)(n + 1) << 32) | ((u64)reason << 24) | (u64)next);
    volatile int* ring = p.ring;
    volatile int* st = p.status;
    ring[n] = next;
#if CFG_MASK
    if (none) ring[n] = -1;
#endif
    __threadfence_system();
    st[0] = n + 1;
    if (reason) {
      st[1] = reason;
      __threadfence_system();
      st[2] = 1;
    }
  }
  __syncthreads();
}
