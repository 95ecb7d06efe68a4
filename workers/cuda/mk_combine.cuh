// mk_combine.cuh: part of monokernel.cu (pasted in place after mk_norms.cuh; not a standalone header).
// The producers' combine into the residual (stage_combine, combine_finish, pick), the per-(phase, lane)
// counters (signal_lanes, wait_delayed), the final rows' exchange between ranks (mr_final,
// KOG_NRANKS > 1) and the KV cache's L2 prefetch for attention (att_chunk, prefetch_kv).
#pragma once

// the producer's combine: the inputs other than this layer's partial (residual base and the delayed
// lanes' term) are staged in shared memory for all the block's rows before the block waits for its
// inputs (they are ready earlier), so the rows' epilogue reads only shared memory.
__device__ __forceinline__ bool has_delayed(int i) {
  return USE_COMM && LG > 1 && i >= DELTA && ((i - DELTA) >= DELTA || EARLY_FUTURE);
}
__device__ void stage_combine(const Params& p, float* cb, int i, int kind, int ua, int ub, int nr, int upl, int tok) {
  const int s = 2 * i + 1 + kind;
  if (!fused_step(s)) return;
  const int n = (ub - ua) * nr;
#if KOG_NRANKS > 1
  const MrPart mr = mr_part(p, kind, mr_n_s, has_delayed(i) ? i - DELTA : i);
#endif
  for (int x = threadIdx.x; x < n; x += NT) {
    const int u = ua + x / nr, l = u / upl, r = (u % upl) * nr + x % nr;
    const float base = hbase(p, s - 1, l, r, tok);
    float dt = 0.f;
    if (has_delayed(i)) {
#if KOG_NRANKS > 1
      float own;
      const float tot = mr_lane_sum(mr, r, (int)kds.rank * L + l, &own);
      dt = tot - own;
#else
      const float* pp = p.part + ((long long)((i - DELTA) * 2 + kind) * L) * D + r;
      float P[L];
#pragma unroll
      for (int j = 0; j < L; ++j) P[j] = ldf(pp + (long long)j * D);
      float tot = P[0], own = P[0];
#pragma unroll
      for (int j = 1; j < L; ++j) {
        tot += P[j];
        if (j == l) own = P[j];
      }
      dt = tot - own;
#endif
    }
    cb[2 * x] = base;
    cb[2 * x + 1] = dt;
  }
}
__device__ __forceinline__ void combine_finish(const Params& p, int i, int kind, int l, int r, float pv, const float* c) {
  const int s = 2 * i + 1 + kind;
  p.part[((long long)(i * 2 + kind) * L + l) * D + r] = pv;
  if (!fused_step(s)) return;
  const float base = c[0];
  float h;
  if (!USE_COMM || i < DELTA) h = (USE_COMM && LG == 1) ? base + pv : base + sqrtf((float)LG) * pv;
  else if (has_delayed(i)) h = base + (pv + c[1]);
  else h = base + pv;
  p.hres[((long long)s * L + l) * D + r] = h;
}
__device__ __forceinline__ float pick(const float* a, int n, int k) {
  float v = a[0];
  for (int r = 1; r < n; ++r)
    if (k == r) v = a[r];
  return v;
}
// A block's units: warp w starts with unit w; each warp that finishes a unit takes the next one not yet
// taken from a shared-memory queue (*q, set to NW by reset_units before the loop), so the block's warps end
// within one unit of each other however the memory system serves them (a fixed stride of NW measured slower).
__shared__ int unit_q;   // the queue of the phase running (W13, WO, W2); each phase ends with a barrier
__device__ __forceinline__ void reset_units() {   // before the barrier that precedes the phase's unit loop
  if (threadIdx.x == 0) unit_q = NW;
}
__device__ __forceinline__ int next_unit(int u, int ua, int* q) {
  int k = 0;
  if ((threadIdx.x & 31) == 0) k = atomicAdd(q, 1);
  return ua + __shfl_sync(0xffffffffu, k, 0);
}
// the row loop of WO (kind 0: K = HDL) and W2 (kind 1: K = FL): units of NR rows, each warp's dot product
// over the block's staged input of the unit's lane (sm + (l - l0) * K), combined into the residual and, with
// several ranks, posted as LL words (mr_put; nothing with one rank). The caller resets the queue (reset_units)
// before the barrier that precedes it.
template <int NR, int K, int UB>
__device__ __forceinline__ void combine_rows(const Params& p, float* sm, long long E, int i, int kind, int ua, int ub,
                                             int nbuf, int l0, const float* cb, const MrPost& mp) {
  constexpr int UPL = D / NR, UE = NR * K;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  for (int u = ua + warp; u < ub; u = next_unit(u, ua, &unit_q)) {
    const int l = u / UPL, r0 = (u % UPL) * NR;
    float acc[NR];
    if constexpr (QCOPY)
      wdotq_unit<NR, K, UE, UB>(p, sm, E + (long long)ua * UE, nbuf, u - ua, E + ((long long)l * D + r0) * K, NR,
                                sm + (l - l0) * K, acc);
    else if (u - ua < nbuf)
      wdot_buf<NR, K, UE>(sm, E + (long long)ua * UE, nbuf, u - ua, NR, sm + (l - l0) * K, acc);
    else
      wdot<NR, K, UB>(p, E + ((long long)l * D + r0) * K, NR, sm + (l - l0) * K, acc);
    if (lane < NR) {
      const float pv = pick(acc, NR, lane);
      combine_finish(p, i, kind, l, r0 + lane, pv, cb + 2 * ((u - ua) * NR + lane));
      mr_put(mp, l, r0 + lane, pv);
    }
  }
}

__device__ __forceinline__ void signal_lanes(const Params& p, int phase, int upl, int a, int b) {
  __syncthreads();
  if (threadIdx.x == 0 && a < b) {
    // the red.release after the barrier alone (PTX memory model: enough; a __threadfence measured slower)
    for (int l = a / upl; l <= (b - 1) / upl; ++l) {
      int n = lane_units(l, upl, a, b);
      if (n) red_release(CTR(p, phase * L + l), (u64)n);
    }
  }
}
// the delayed partials of layer i - DELTA must be complete before a producer of layer i combines
__device__ __forceinline__ void wait_delayed(const Params& p, int phase, int upl, int n, int i) {
  if (USE_COMM && LG > 1 && i >= DELTA && ((i - DELTA) >= DELTA || EARLY_FUTURE))
    wait_lanes(p, phase, 0, L - 1, (u64)(n * NL + i - DELTA + 1) * upl);   // own lanes (others: LL words)
}

#if KOG_NRANKS > 1
// the final norm's lane mean over every rank: block 0 writes the rank's normed rows (straight into p.yfin)
// and the host's cancel word as LL words into every window, its own included; every block sums the LG rows
// in lane order into y. No acks: a rank posts token n + 2's rows only after every block of every rank
// read token n's (each block reads them before its rank's sampler can give token n + 1, which every
// rank's layer words of token n + 1 wait for), and the ring holds MR_DEPTH >= 6 tokens.
__device__ void mr_final(const Params& p, int n, int tok, float* red, float* y) {
  const u64 e = (u64)(p.e0[2] + n);
  const unsigned tag = (unsigned)e;
  if (blockIdx.x == 0) {
    final_norms(p, tok, red, p.yfin, nullptr, -1);
    if (threadIdx.x == 0) p.yfin[L * D] = __int_as_float(*(volatile const int*)p.cancel);
    __syncthreads();
    const long long off = mr_ll_off(CH_FIN, (int)kds.rank, e);
    for (int x = threadIdx.x; x <= L * D; x += NT) {
      const unsigned v = __float_as_uint(p.yfin[x]);
#pragma unroll
      for (int q = 0; q < NRK; ++q) kccl_ll_st((u64*)(kds.base[q] + off) + x, tag, v);
    }
  }
  const u64* w0 = (const u64*)(kds.base[kds.rank] + mr_ll_off(CH_FIN, 0, e));   // rank q's: q * st further
  const long long st = (long long)MR_DEPTH * kds.slot_bytes / 8;
  const MrPart m{nullptr, (const char*)w0, st * 8, tag, CH_FIN};   // every rank's rows, own included
  for (int d0 = threadIdx.x; d0 < D; d0 += MRE * NT) {   // MRE elements' LG words in flight at once
    MrRows<MRE> R;
#pragma unroll
    for (int k = 0; k < MRE; ++k) R.r[k] = d0 + k * NT < D ? d0 + k * NT : 0;
    const MrSums<MRE> a = mr_lane_sums<MRE>(m, R, 0);
#pragma unroll
    for (int k = 0; k < MRE; ++k)
      if (d0 + k * NT < D) y[xpv(d0 + k * NT, D)] = a.t[k] / (float)LG;
  }
  if (threadIdx.x == 0) {
    int c = 0;
    for (int r = 0; r < NRK; ++r) c |= (int)kccl_ll_get(kds, w0 + r * st + L * D, tag, r, CH_FIN);
    mr_cancel_s = c;
  }
}
#endif

// bytes of keys (and of values) per attention unit asked of L2 as QKV's rows begin (off measured
// slower: docs/monokernel.md, third session)
constexpr int PF_KV = 65536;
// the attention chunks at position t of layer i: the first position lo, positions a chunk CH; returns the
// chunks with positions (attention writes those, WO merges those)
__device__ __forceinline__ int att_split(int i, int t, int& lo, int& CH) {
  lo = sliding(i) ? max(0, t - SW + 1) : 0;
  const int nvis = t - lo + 1, nch = min(NCH, (nvis + ATT_MINPOS - 1) / ATT_MINPOS);
  CH = (nvis + nch - 1) / nch;
  return (nvis + CH - 1) / CH;
}
// positions [cs, ce) of attention chunk c at position t of layer i (empty for a chunk not in use)
__device__ __forceinline__ void att_chunk(int i, int t, int c, int& cs, int& ce) {
  int lo, CH;
  att_split(i, t, lo, CH);
  cs = lo + c * CH;
  ce = min(cs + CH, t + 1);
}
// as QKV's rows begin: the cached keys and values the block's attention units will read, into L2
// (CFG_KVPF_W2 1: layer i + 1's at the start of layer i's W2, a phase earlier, QKV asks for layer 0's;
// 0: each layer's in its QKV)
#ifndef CFG_KVPF_W2
#define CFG_KVPF_W2 1
#endif
constexpr bool KVPF_W2 = CFG_KVPF_W2 && L == 1;   // several lanes: -3% (2B at 128 + 512), -7.7% at 3968
__device__ __forceinline__ void prefetch_kv(const Params& p, int i, int t) {
  int aa, ab;
  brange(U_ATT, aa, ab);
  for (int u = aa; u < ab; ++u) {
    const int g = u / NCH;
    int cs, ce;
    att_chunk(i, t, u % NCH, cs, ce);
    if (ce <= cs) continue;
    const long long off = (((long long)i * KV + g) * p.max_seq + cs) * HD;
    prefetch_l2(p.kc + off, (long long)(ce - cs) * HD * sizeof(wt), PF_KV);
    prefetch_l2(p.vc + off, (long long)(ce - cs) * HD * sizeof(wt), PF_KV);
  }
}
// the end of WO (kind 0: K = HDL) and W2 (kind 1: K = FL) once the block's input is staged: its rows,
// combined into the residual, and the lanes' counters released (marks 3, 4, 2)
template <int NR, int K>
__device__ __forceinline__ void combine_phase_end(const Params& p, float* sm, int n, int ph, long long E, int i,
                                                  int kind, int ua, int ub, int nbuf, int l0, const float* cb,
                                                  const MrPost& mp) {
  cp_async_wait_all();
  reset_units();
  __syncthreads();
  tmark(p, n, ph, 3);
  combine_rows<NR, K, CFG_UBMAX>(p, sm, E, i, kind, ua, ub, nbuf, l0, cb, mp);
  tmark(p, n, ph, 4);
  signal_lanes(p, kind == 0 ? C_WO : C_W2, kind == 0 ? UPL_WO : UPL_W2, ua, ub);
  tmark(p, n, ph, 2);
}
