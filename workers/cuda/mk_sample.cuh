// mk_sample.cuh: part of monokernel.cu (pasted in place before mk_mask.cuh and mk_lm.cuh; not a standalone
// header). Sampling by the last block of a token (temperature / top-k / top-p, the draw uniform(seed, counter)),
// as kog_dist/sampling.py does: candidates in (probability desc, index asc) order, top-k, renormalised
// top-p prefix, the first cumulative weight above u.
#pragma once

// The candidates: the logits within 32 T of the largest ((max - logit) / T in bins of 0.25), as many of the
// nearest bins as SAMPLE_M keys hold, sorted in shared memory. They are a prefix of the full order (the bin
// is monotone in the logit), so the draw is the full sort's whenever it lands among them; otherwise (the
// kept top-k or top-p prefix or the draw reaches past them: a flat distribution, a tail draw) the whole
// vocabulary is sorted as before. The full sort of V = 49152 (VPOW2 keys, 136 passes over global scratch by
// one block) cost more than a SmolLM2 token; the candidates' path reads the logits three times.
#ifndef CFG_SAMPLE_M
#define CFG_SAMPLE_M 4096   // candidate keys at most (tests build 4 to take the fallback; 0: the full sort only)
#endif
constexpr int pow2_floor(int x) {
  int r = 1;
  while (2 * r <= x) r *= 2;
  return r;
}
constexpr int SBINS = 128;
constexpr int SM_SAMPLE_HEAD = 8 * (NW + 8) + 4 * (SBINS + 8);   // bytes: dred, hist and words before the keys
constexpr int SAMPLE_M = CFG_SAMPLE_M <= 0 ? 0 : cmin(CFG_SAMPLE_M, pow2_floor((SM_FLOATS * 4 - SM_SAMPLE_HEAD) / 8));
static_assert(CFG_SAMPLE_M <= 0 || SAMPLE_M >= 2, "shared memory: no room for the sampler's candidates");

__device__ __forceinline__ u64 sample_key(float l, int v) {
  u32 b = __float_as_uint(l);
  b = (b & 0x80000000u) ? ~b : (b | 0x80000000u);      // orderable
  return ((u64)b << 32) | (u64)(0xffffffffu - (u32)v);
}
__device__ __forceinline__ int key_index(u64 key) { return (int)(0xffffffffu - (u32)(key & 0xffffffffu)); }
__device__ __forceinline__ float key_logit(u64 key) {
  const u32 b = (u32)(key >> 32);
  return __uint_as_float((b & 0x80000000u) ? (b & 0x7fffffffu) : ~b);
}
__device__ __forceinline__ double block_sum_d(double v, double* dred) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  __syncthreads();
  if (lane == 0) dred[warp] = v;
  __syncthreads();
  double s = 0.0;
  for (int w = 0; w < NW; ++w) s += dred[w];
  __syncthreads();
  return s;
}

// The draw from n sorted keys (n >= 1; logit(x) reads key x's logit): top-k K (n >= min(K, V) unless
// `whole` is false), the total over the first K (or `ztot`, the sum over all V, when K covers the
// vocabulary and the keys do not), top-p, the first cumulative weight above u. Returns the key's position,
// or -1 where the answer lies past the n keys (only when `whole` is false). Every thread.
template <class LogitAt>
__device__ __forceinline__ int draw_from_sorted(const Params& p, double* dred, int* ired, int n, bool whole,
                                                double zmax, double ztot, u64 counter, LogitAt logit) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const double T = p.temperature;
  const int K = (p.top_k > 0 && p.top_k < V) ? (int)p.top_k : V;
  const int nk = min(K, n);
  // each thread owns a contiguous segment of the first nk sorted keys
  const int seg = (nk + NT - 1) / NT;
  const int a = min(nk, tid * seg), b = min(nk, a + seg);
  double loc = 0.0;
  for (int x = a; x < b; ++x) loc += exp((double)logit(x) / T - zmax);
  // exclusive scan of the segment sums (thread order = sorted order)
  double incl = loc;
  for (int o = 1; o < 32; o <<= 1) {
    double y = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += y;
  }
  if (lane == 31) dred[warp] = incl;
  __syncthreads();
  if (tid == 0) {
    double run = 0.0;
    for (int w = 0; w < NW; ++w) { double t = dred[w]; dred[w] = run; run += t; }
    dred[NW] = run;
  }
  __syncthreads();
  const double before = dred[warp] + incl - loc;
  const double mass = dred[NW];                       // of the nk keys
  const bool all_k = whole || nk == K;                // the keys hold the whole top-k
  const double total = all_k ? mass : ztot;           // not all_k: K = V (the caller checked) and ztot is V's
  int Kp = all_k ? nk : V;
  double total2 = total;
  if (p.top_p < 1.0) {
    if (!all_k && mass / total < p.top_p) return -1;  // the top-p prefix reaches past the keys
    if (tid == 0) ired[0] = nk;
    __syncthreads();
    double c = before;
    for (int x = a; x < b; ++x) {
      c += exp((double)logit(x) / T - zmax);
      if (c / total >= p.top_p) { atomicMin(ired, x + 1); break; }
    }
    __syncthreads();
    Kp = ired[0];
    __syncthreads();
    // total of the kept prefix: recompute by the owner of its last element
    if (a < Kp && Kp <= b) {
      double c2 = before;
      for (int x = a; x < Kp; ++x) c2 += exp((double)logit(x) / T - zmax);
      dred[NW + 1] = c2;
    }
    __syncthreads();
    total2 = dred[NW + 1];
  }
  const double u = uniform01(p.seed, counter);
  if (tid == 0) ired[1] = Kp <= nk ? Kp - 1 : -1;   // rounding: the last kept key; past the keys: none here
  __syncthreads();
  {
    double c = before;
    for (int x = a; x < min(b, Kp); ++x) {
      c += exp((double)logit(x) / T - zmax);
      if (c / total2 > u) { atomicMin(ired + 1, x); break; }
    }
  }
  __syncthreads();
  const int r = ired[1];
  __syncthreads();
  return r;
}

// the candidates' path (see the top): the token, or -1 where the full sort must decide. Every thread.
__device__ __forceinline__ int sample_candidates(const Params& p, float* sm, u64 counter) {
  double* dred = reinterpret_cast<double*>(sm);                         // [NW + 8]
  int* hist = reinterpret_cast<int*>(sm + 2 * (NW + 8));                // [SBINS]
  int* ired = hist + SBINS;                                             // [8]
  u64* keys = reinterpret_cast<u64*>(reinterpret_cast<char*>(sm) + SM_SAMPLE_HEAD);   // [SAMPLE_M]
  const int tid = threadIdx.x, lane = tid & 31;
  const double T = p.temperature;
  const float invT = (float)(1.0 / T);
  for (int i = tid; i < SBINS; i += NT) hist[i] = 0;
  // 1: the largest logit (NaN ignored)
  float mx = NEG_INF;
  for (int v = tid; v < V; v += NT) mx = fmaxf(mx, ldf(p.logits + v));
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
  if (lane == 0) reinterpret_cast<float*>(dred)[threadIdx.x >> 5] = mx;
  __syncthreads();
  for (int w = 0; w < NW; ++w) mx = fmaxf(mx, reinterpret_cast<float*>(dred)[w]);
  __syncthreads();
  if (!(mx > NEG_INF) || isinf(mx)) return -1;       // no finite logit: the full sort's answer
  const double zmax = (double)mx / T;
  // 2: bins of (max - logit) / T (a warp's lanes of one bin add once) and the sum of all V weights: float64 as
  // the full sort's total, where a weight is above e^-20 of the largest (the rest in float, 2e-16 of it each)
  double z = 0.0;
  for (int v = tid; v - lane < V; v += NT) {   // whole warps: lanes past V take part in the vote
    const float l = v < V ? ldf(p.logits + v) : NEG_INF;
    const float d = (mx - l) * invT;
    const int bin = d < SBINS / 4.f ? (int)(d * 4.f) : -1;   // NaN: -1
    const unsigned grp = __match_any_sync(0xffffffffu, bin);
    if (bin >= 0 && lane == __ffs(grp) - 1) atomicAdd(hist + bin, __popc(grp));
    if (v < V) z += d < 20.f ? exp((double)l / T - zmax) : (double)__expf(-d);
  }
  z = block_sum_d(z, dred);
  if (tid == 0) {   // the most bins whose keys fit
    int nb = 0, c = 0;
    while (nb < SBINS && c + hist[nb] <= SAMPLE_M) c += hist[nb++];
    ired[2] = nb;
    ired[3] = 0;
  }
  __syncthreads();
  const int nbins = ired[2];
  if (nbins == 0 || !isfinite(z)) return -1;
  // 3: the candidates' keys (a warp's at once), then a bitonic sort of the next power of two (descending;
  // the padding, key 0, sorts last)
  const float dcut = nbins * 0.25f;   // d < dcut <=> (int)(4 d) < nbins: 4 d is exact
  for (int v = tid; v - lane < V; v += NT) {
    const float l = v < V ? ldf(p.logits + v) : NEG_INF;
    const bool c = (mx - l) * invT < dcut;
    const unsigned m = __ballot_sync(0xffffffffu, c);
    int base = 0;
    if (lane == 0 && m) base = atomicAdd(ired + 3, __popc(m));
    base = __shfl_sync(0xffffffffu, base, 0);
    if (c) keys[base + __popc(m & ((1u << lane) - 1u))] = sample_key(l, v);
  }
  __syncthreads();
  const int n = ired[3];
  int P = 2;
  while (P < n) P <<= 1;
  for (int x = n + tid; x < P; x += NT) keys[x] = 0ull;
  __syncthreads();
  for (int k = 2; k <= P; k <<= 1)
    for (int j = k >> 1; j > 0; j >>= 1) {
      for (int x = tid; x < P; x += NT) {
        const int y = x ^ j;
        if (y > x) {
          const u64 a = keys[x], b = keys[y];
          const bool desc = (x & k) == 0;
          if (desc ? (a < b) : (a > b)) { keys[x] = b; keys[y] = a; }
        }
      }
      __syncthreads();
    }
  // 4: the draw; past the candidates (top-k beyond them below V, or the prefix or the draw in the tail): -1
  const int K = (p.top_k > 0 && p.top_k < V) ? (int)p.top_k : V;
  if (K < V && K > n) return -1;
  const int r = draw_from_sorted(p, dred, ired + 4, n, false, zmax, z, counter,
                                 [&](int x) { return key_logit(keys[x]); });
  const int tok = r < 0 ? -1 : key_index(keys[r]);
  __syncthreads();
  return tok;
}

// ---- the whole vocabulary sorted: every case, the candidates' fallback ----------------------------------------
// keys (logit desc, index asc) of all V in global scratch, bitonic (VPOW2 keys); then the same draw
__device__ __forceinline__ int sample_sorted(const Params& p, float* sm, u64 counter) {
  double* dred = reinterpret_cast<double*>(sm);    // [NW + 8]
  int* ired = reinterpret_cast<int*>(sm + 2 * (NW + 8));
  const int tid = threadIdx.x;
  u64* buf = p.sortbuf;
  // keys: logits descending (= probability descending), then index ascending
  for (int v = tid; v < VPOW2; v += NT) {
    buf[v] = v < V ? sample_key(ldf(p.logits + v), v) : 0ull;
  }
  __syncthreads();
  for (int k = 2; k <= VPOW2; k <<= 1)
    for (int j = k >> 1; j > 0; j >>= 1) {
      for (int x = tid; x < VPOW2; x += NT) {
        const int y = x ^ j;
        if (y > x) {
          const u64 a = __ldcg(buf + x), b = __ldcg(buf + y);
          const bool desc = (x & k) == 0;
          if (desc ? (a < b) : (a > b)) { buf[x] = b; buf[y] = a; }
        }
      }
      __syncthreads();
    }
  const double zmax = (double)key_logit(__ldcg(buf)) / p.temperature;
  const int r = draw_from_sorted(p, dred, ired, V, true, zmax, 0.0, counter,
                                 [&](int x) { return key_logit(__ldcg(buf + x)); });
  const int tok = key_index(__ldcg(buf + r));
  __syncthreads();
  return tok;
}

// full sampling (temperature / top-k / top-p) by one block; returns the token in every thread
__device__ __noinline__ int sample_full(const Params& p_, float* sm, u64 counter) {
  const Params& p = NOINL_PARAMS(p_);
  if constexpr (SAMPLE_M == 0) return sample_sorted(p, sm, counter);
  const int tok = sample_candidates(p, sm, counter);
  __syncthreads();
  return tok >= 0 ? tok : sample_sorted(p, sm, counter);
}

