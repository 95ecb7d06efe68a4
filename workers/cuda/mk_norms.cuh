// mk_norms.cuh: part of monokernel.cu (pasted in place after mk_helpers.cuh; not a standalone header).
// The residual as the consumers read it (hbase, hval), the RMS norms of the QKV and W13 inputs
// (stage_norms, and stage_norms2 with norm_g_load), the final norm (final_norms) and writer_mask.
#pragma once

// residual of lane l at version s, element d, where version s is in memory (or is the embedding)
__device__ __forceinline__ float hbase(const Params& p, int s, int l, int d, int tok) {
  if (s == 0) return w2f(p.emb[(long long)tok * D + d]);
  return ldf(p.hres + ((long long)s * L + l) * D + d);
}
// residual of lane l at version s computed by its consumer (versions of the early layers with
// use_early_comm, which need every lane's partial of this layer)
__device__ __forceinline__ float hval(const Params& p, int s, int l, int d, int tok) {
  if (fused_step(s)) return hbase(p, s, l, d, tok);
  const int i = (s - 1) / 2, kind = (s - 1) & 1;
#if KOG_NRANKS > 1
  const float tot = mr_lane_sum(mr_part(p, kind, mr_n_s, i), d, 0, nullptr);
#else
  const float* pp = p.part + ((long long)(i * 2 + kind) * L) * D + d;
  float P[L];   // all L loads in flight, then the sum in lane order (one after another was slower: docs/monokernel.md)
#pragma unroll
  for (int j = 0; j < L; ++j) P[j] = ldf(pp + (long long)j * D);
  float tot = P[0];
#pragma unroll
  for (int j = 1; j < L; ++j) tot += P[j];
#endif
  return hbase(p, s - 1, l, d, tok) + tot;
}
// dst[k*D + d] = rms(h_{l0+k} at version s) * g[l0+k] for k < nl, all lanes in one pass and one block
// reduction; the writer lanes (bit k of wmask) also store a consumer-computed version to memory
constexpr int MAXL = L < 8 ? L : 8;
constexpr int DPT = (D + NT - 1) / NT;
__device__ void stage_norms(const Params& p, float* dst, int s, int l0, int nl, const float* g, int tok,
                            unsigned wmask, float* red) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  // G1: the norm weights loaded with the residual, not after the block's reduction (one L2 round trip
  // on the chain instead of two): one lane and at most two elements a thread (SmolLM2 +2%; Llama-3.2-1B's
  // four a thread lost 1.5%, and a copy into shared memory before the wait lost 1.6-1.7% on both:
  // BENCHMARKS.md "Results of 2026-12-04 (twenty-fourth session)")
  constexpr bool G1 = MAXL == 1 && DPT <= 2;
  float g1[DPT];
  for (int kb = 0; kb < nl; kb += MAXL) {
    __syncthreads();
#pragma unroll 1
    for (int k = 0; k < MAXL; ++k) {
      float ss = 0.f;
      if (kb + k < nl) {
        float v[DPT];
#pragma unroll
        for (int e = 0; e < DPT; ++e) {
          const int d = threadIdx.x + e * NT;
          v[e] = (d < D) ? hval(p, s, l0 + kb + k, d, tok) : 0.f;
          if (G1) g1[e] = d < D ? __ldg(g + (long long)(l0 + kb) * D + d) : 0.f;
        }
#pragma unroll
        for (int e = 0; e < DPT; ++e) {
          const int d = threadIdx.x + e * NT;
          if (d < D) { dst[(kb + k) * D + xp(d, D)] = v[e]; ss += v[e] * v[e]; }
        }
      }
      ss = warp_sum(ss);
      if (lane == 0) red[warp * MAXL + k] = ss;
    }
    __syncthreads();
    for (int k = 0; k < MAXL && kb + k < nl; ++k) {
      float tot = 0.f;
#pragma unroll
      for (int w = 0; w < NW; ++w) tot += red[w * MAXL + k];
      const float inv = 1.0f / sqrtf(tot / (float)D + EPS);
      const int l = l0 + kb + k;
      const bool wr = ((wmask >> (kb + k)) & 1u) && !fused_step(s);
      const float* gl = g + (long long)l * D;
      float* x = dst + (kb + k) * D;
      float gv[DPT];
#pragma unroll
      for (int e = 0; e < DPT; ++e) {
        const int d = threadIdx.x + e * NT;
        gv[e] = G1 ? g1[e] : (d < D ? __ldg(gl + d) : 0.f);
      }
#pragma unroll
      for (int e = 0; e < DPT; ++e) {
        const int d = threadIdx.x + e * NT;
        if (d < D) {
          const float v = x[xp(d, D)];
          if (wr) p.hres[((long long)s * L + l) * D + d] = v;
          x[xp(d, D)] = (v * inv) * gv[e];
        }
      }
    }
  }
  __syncthreads();
}
// The common case (NORM2: a block's QKV and W13 units span at most 2 lanes): the norm weights are copied
// into shared memory before the block waits for the residual (norm_g_load), and both lanes' residual
// loads are in flight at once, so the phase pays one load latency after its wait instead of four. Same
// arithmetic, same bits as stage_norms.
__device__ __forceinline__ void norm_g_load(float* sm, const float* g, int l0, int nl) {
  const int n4 = nl * D / 4;                    // the nl lanes' rows are contiguous in g
  for (int x = threadIdx.x; x < n4; x += NT) cp_async16(sm + GS_OFF + 4 * x, g + (long long)l0 * D + 4 * x);
  cp_async_commit();
}
// dst: the block's shared memory (sm); the weights at sm + GS_OFF (norm_g_load, waited for by the caller's
// cp_async_wait_all, visible after the first barrier below)
__device__ __noinline__ void stage_norms2(const Params& p_, float* dst, int s, int l0, int nl, int tok,
                                             unsigned wmask, float* red) {
  const Params& p = NOINL_PARAMS(p_);
  const float* gs = dst + GS_OFF;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  float v[2][DPT];
  if (KOG_NRANKS == 1 && !fused_step(s)) {
    // the early layers: every lane's residual is its own base plus the same sum of all lanes' partials, so
    // the block's two lanes share one sum (L + 2 loads an element instead of 2L + 2); same bits as hval.
    // All DPT * (L + 2) loads are issued before the first sum: one L2 round trip instead of 2 DPT (one
    // element's loads and sum after another made the staging slower: docs/monokernel.md)
    const int i = (s - 1) / 2, kind = (s - 1) & 1;
    const float* pp = p.part + ((long long)(i * 2 + kind) * L) * D;
    float P[DPT][L], b[DPT][2];
#pragma unroll
    for (int e = 0; e < DPT; ++e) {
      const int d = threadIdx.x + e * NT;
#pragma unroll
      for (int j = 0; j < L; ++j) P[e][j] = d < D ? ldf(pp + (long long)j * D + d) : 0.f;
    }
    if (s - 1 == 0) {   // the base is the embedding row
#pragma unroll
      for (int e = 0; e < DPT; ++e)
#pragma unroll
        for (int k = 0; k < 2; ++k) {
          const int d = threadIdx.x + e * NT;
          b[e][k] = (k < nl && d < D) ? w2f(p.emb[(long long)tok * D + d]) : 0.f;
        }
    } else {
#pragma unroll
      for (int e = 0; e < DPT; ++e)
#pragma unroll
        for (int k = 0; k < 2; ++k) {
          const int d = threadIdx.x + e * NT;
          b[e][k] = (k < nl && d < D) ? ldf(p.hres + ((long long)(s - 1) * L + l0 + k) * D + d) : 0.f;
        }
    }
#pragma unroll
    for (int e = 0; e < DPT; ++e) {
      float tot = P[e][0];
#pragma unroll
      for (int j = 1; j < L; ++j) tot += P[e][j];
#pragma unroll
      for (int k = 0; k < 2; ++k) v[k][e] = k < nl ? b[e][k] + tot : 0.f;
    }
  } else {
#if KOG_NRANKS > 1
    if (!fused_step(s)) {
      // the early layers: both lanes add the same sum of all LG lanes' partials (hval's arithmetic, once an
      // element), MRE elements' loads in flight at once
      const int i = (s - 1) / 2, kind = (s - 1) & 1;
      const MrPart m = mr_part(p, kind, mr_n_s, i);
#pragma unroll
      for (int e = 0; e < DPT; e += MRE) {
        MrRows<MRE> R;
#pragma unroll
        for (int x = 0; x < MRE; ++x) {
          const int d = threadIdx.x + (e + x) * NT;
          R.r[x] = e + x < DPT && d < D ? d : 0;
        }
        const MrSums<MRE> tot = mr_lane_sums<MRE>(m, R, 0);
#pragma unroll
        for (int x = 0; x < MRE; ++x)
#pragma unroll
          for (int k = 0; k < 2; ++k) {
            const int d = threadIdx.x + (e + x) * NT;
            if (e + x < DPT) v[k][e + x] = (k < nl && d < D) ? hbase(p, s - 1, l0 + k, d, tok) + tot.t[x] : 0.f;
          }
      }
    } else
#endif
#pragma unroll
    for (int k = 0; k < 2; ++k)
#pragma unroll
      for (int e = 0; e < DPT; ++e) {
        const int d = threadIdx.x + e * NT;
        v[k][e] = (k < nl && d < D) ? hval(p, s, l0 + k, d, tok) : 0.f;
      }
  }
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    if (k >= nl) break;
    float ss = 0.f;
#pragma unroll
    for (int e = 0; e < DPT; ++e)
      if (threadIdx.x + e * NT < D) ss += v[k][e] * v[k][e];
    ss = warp_sum(ss);
    if (lane == 0) red[warp * MAXL + k] = ss;
  }
  __syncthreads();
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    if (k >= nl) break;
    float tot = 0.f;
#pragma unroll
    for (int w = 0; w < NW; ++w) tot += red[w * MAXL + k];
    const float inv = 1.0f / sqrtf(tot / (float)D + EPS);
    const int l = l0 + k;
    const bool wr = ((wmask >> k) & 1u) && !fused_step(s);
#pragma unroll
    for (int e = 0; e < DPT; ++e) {
      const int d = threadIdx.x + e * NT;
      if (d < D) {
        if (wr) p.hres[((long long)s * L + l) * D + d] = v[k][e];
        dst[k * D + xp(d, D)] = (v[k][e] * inv) * gs[k * D + d];
      }
    }
  }
  __syncthreads();
}
// the final norm of every lane (residual version 2NL): into rows ([L][D], global) when given, else
// their lane mean into y (shared): all lanes in batches of MAXL with one block reduction per batch
// lanes per batch (registers: FNB * DPT floats; batches of 2 measured neutral: docs/lab/benchmarks-2026-11.md)
constexpr int FNB = MAXL < 4 ? MAXL : 4;
// wait_n >= 0: the block waits for each batch's lanes of token wait_n's last W2 before it reads them, so
// the lanes that finish first are normed while the others still stream; wait_n < 0: the caller waited
__device__ __noinline__ void final_norms(const Params& p_, int tok, float* red, float* rows, float* y, int wait_n) {
  const Params& p = NOINL_PARAMS(p_);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  float acc[DPT];
#pragma unroll
  for (int e = 0; e < DPT; ++e) acc[e] = 0.f;
  for (int kb = 0; kb < L; kb += FNB) {
    if (wait_n >= 0) {
      if (WAITER) wait_lanes(p, C_W2, kb, min(kb + FNB, L) - 1, (u64)(wait_n * NL + NL) * UPL_W2);
      __syncthreads();
      if (kb + FNB >= L) tmark(p, wait_n, 5 * NL, 1);
    }
    float v[FNB][DPT];
#pragma unroll
    for (int k = 0; k < FNB; ++k)
#pragma unroll
      for (int e = 0; e < DPT; ++e) {
        const int d = threadIdx.x + e * NT;
        v[k][e] = (kb + k < L && d < D) ? hval(p, 2 * NL, kb + k, d, tok) : 0.f;
      }
    __syncthreads();
#pragma unroll
    for (int k = 0; k < FNB; ++k) {
      float ss = 0.f;
#pragma unroll
      for (int e = 0; e < DPT; ++e) ss += v[k][e] * v[k][e];
      ss = warp_sum(ss);
      if (lane == 0) red[warp * MAXL + k] = ss;
    }
    __syncthreads();
#pragma unroll
    for (int k = 0; k < FNB; ++k) {
      const int l = kb + k;
      if (l >= L) break;
      float tot = 0.f;
#pragma unroll
      for (int w = 0; w < NW; ++w) tot += red[w * MAXL + k];
      const float inv = 1.0f / sqrtf(tot / (float)D + EPS);
#pragma unroll
      for (int e = 0; e < DPT; ++e) {
        const int d = threadIdx.x + e * NT;
        if (d < D) {
          const float t = (v[k][e] * inv) * __ldg(p.fnorm + (long long)l * D + d);
          if (rows) rows[(long long)l * D + d] = t;
          else acc[e] = l == 0 ? t : acc[e] + t;
        }
      }
    }
  }
  if (y)
#pragma unroll
    for (int e = 0; e < DPT; ++e) {
      const int d = threadIdx.x + e * NT;
      if (d < D) y[xpv(d, D)] = acc[e] / (float)L;   // the LM head's input: the storage type's planes
    }
  __syncthreads();
}
// the writer mask of a consumer phase: lanes whose first unit this block owns
__device__ __forceinline__ unsigned writer_mask(int l0, int l1, int upl, int ua, int ub) {
  unsigned m = 0;
  for (int l = l0; l <= l1 && l - l0 < 32; ++l)
    if (ua <= l * upl && l * upl < ub) m |= 1u << (l - l0);
  return m;
}
