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
constexpr int SM_SAMPLE_HEAD = 8 * (NW + 8) + 4 * (SBINS + 8) + 4 * 48;   // bytes before the keys: dred, hist,
                                                                         // words, the ranks' headers
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
  // rounding: the last kept key; past the keys: none here (INT_MAX, so that the atomicMin below can lower it)
  if (tid == 0) ired[1] = Kp <= nk ? Kp - 1 : 0x7fffffff;
  __syncthreads();
  {
    double c = before;
    for (int x = a; x < min(b, Kp); ++x) {
      c += exp((double)logit(x) / T - zmax);
      if (c / total2 > u) { atomicMin(ired + 1, x); break; }
    }
  }
  __syncthreads();
  const int r = ired[1] == 0x7fffffff ? -1 : ired[1];
  __syncthreads();
  return r;
}

// One shard's candidates (rows [v0, v1) of p.logits; every row with one rank): its largest logit m, the sum z
// of its weights exp(l / T - m / T) (float64 where a weight is above e^-20 of the largest, the rest in float,
// 2e-16 of it each), its rows within the nearest bins of (m - l) / T that fit `cap` keys as keys (unsorted),
// and c, the largest logit left out (-inf: none). Every row left out is below every key (the bin is monotone
// in the logit). n < 0: no finite maximum or sum (NaN, inf): the full sort decides. Every thread.
struct Shard {
  int n;
  float m, c;
  double z;
};
__device__ __forceinline__ Shard shard_candidates(const Params& p, float* sm, int v0, int v1, int cap, u64* keys) {
  double* dred = reinterpret_cast<double*>(sm);                         // [NW + 8]
  int* hist = reinterpret_cast<int*>(sm + 2 * (NW + 8));                // [SBINS]
  int* ired = hist + SBINS;                                             // [8]
  const int tid = threadIdx.x, lane = tid & 31;
  const double T = p.temperature;
  const float invT = (float)(1.0 / T);
  for (int i = tid; i < SBINS; i += NT) hist[i] = 0;
  float mx = NEG_INF;   // 1: the largest logit (NaN ignored)
  for (int v = v0 + tid; v < v1; v += NT) mx = fmaxf(mx, ldf(p.logits + v));
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
  if (lane == 0) reinterpret_cast<float*>(dred)[threadIdx.x >> 5] = mx;
  __syncthreads();
  for (int w = 0; w < NW; ++w) mx = fmaxf(mx, reinterpret_cast<float*>(dred)[w]);
  __syncthreads();
  if (!(mx > NEG_INF) || isinf(mx)) return Shard{-1, mx, mx, 0.0};
  const double zmax = (double)mx / T;
  // 2: the bins (a warp's lanes of one bin add once) and the sum
  double z = 0.0;
  for (int v = v0 + tid; v - lane < v1; v += NT) {   // whole warps: lanes past v1 take part in the vote
    const float l = v < v1 ? ldf(p.logits + v) : NEG_INF;
    const float d = (mx - l) * invT;
    const int bin = d < SBINS / 4.f ? (int)(d * 4.f) : -1;   // NaN: -1
    const unsigned grp = __match_any_sync(0xffffffffu, bin);
    if (bin >= 0 && lane == __ffs(grp) - 1) atomicAdd(hist + bin, __popc(grp));
    if (v < v1) z += d < 20.f ? exp((double)l / T - zmax) : (double)__expf(-d);
  }
  z = block_sum_d(z, dred);
  if (tid == 0) {   // the most bins whose keys fit
    int nb = 0, c = 0;
    while (nb < SBINS && c + hist[nb] <= cap) c += hist[nb++];
    ired[2] = nb;
    ired[3] = 0;
  }
  __syncthreads();
  const int nbins = ired[2];
  if (!isfinite(z)) return Shard{-1, mx, mx, z};
  // 3: the keys (a warp's at once) and the largest logit left out
  const float dcut = nbins * 0.25f;   // d < dcut <=> (int)(4 d) < nbins: 4 d is exact
  float out = NEG_INF;
  for (int v = v0 + tid; v - lane < v1; v += NT) {
    const float l = v < v1 ? ldf(p.logits + v) : NEG_INF;
    const bool c = (mx - l) * invT < dcut;
    if (!c) out = fmaxf(out, l);
    const unsigned m = __ballot_sync(0xffffffffu, c);
    int base = 0;
    if (lane == 0 && m) base = atomicAdd(ired + 3, __popc(m));
    base = __shfl_sync(0xffffffffu, base, 0);
    if (c) keys[base + __popc(m & ((1u << lane) - 1u))] = sample_key(l, v);
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) out = fmaxf(out, __shfl_xor_sync(0xffffffffu, out, o));
  if (lane == 0) reinterpret_cast<float*>(dred)[threadIdx.x >> 5] = out;
  __syncthreads();
  for (int w = 0; w < NW; ++w) out = fmaxf(out, reinterpret_cast<float*>(dred)[w]);
  const int n = ired[3];
  __syncthreads();
  return Shard{n, mx, out, z};
}
// keys [0, n) sorted descending in place, bitonic over the next power of two P <= the keys' room (the padding,
// key 0, sorts last); every thread
__device__ __forceinline__ void sort_keys(u64* keys, int n) {
  int P = 2;
  while (P < n) P <<= 1;
  for (int x = n + threadIdx.x; x < P; x += NT) keys[x] = 0ull;
  __syncthreads();
  for (int k = 2; k <= P; k <<= 1)
    for (int j = k >> 1; j > 0; j >>= 1) {
      for (int x = threadIdx.x; x < P; x += NT) {
        const int y = x ^ j;
        if (y > x) {
          const u64 a = keys[x], b = keys[y];
          const bool desc = (x & k) == 0;
          if (desc ? (a < b) : (a > b)) { keys[x] = b; keys[y] = a; }
        }
      }
      __syncthreads();
    }
}
// the draw from n sorted keys that are the first n of the full order, or -1 (past them); every thread
__device__ __forceinline__ int draw_candidates(const Params& p, float* sm, const u64* keys, int n, float mx,
                                               double z, u64 counter) {
  double* dred = reinterpret_cast<double*>(sm);
  int* ired = reinterpret_cast<int*>(sm + 2 * (NW + 8)) + SBINS + 4;
  const int K = (p.top_k > 0 && p.top_k < V) ? (int)p.top_k : V;
  if (n <= 0 || (K < V && K > n)) return -1;   // top-k beyond the keys (below V)
  const int r = draw_from_sorted(p, dred, ired, n, false, (double)mx / p.temperature, z, counter,
                                 [&](int x) { return key_logit(keys[x]); });
  const int tok = r < 0 ? -1 : key_index(keys[r]);
  __syncthreads();
  return tok;
}
// the candidates' path with one rank (see the top): the token, or -1 where the full sort must decide
__device__ __forceinline__ int sample_candidates(const Params& p, float* sm, u64 counter) {
  u64* keys = reinterpret_cast<u64*>(reinterpret_cast<char*>(sm) + SM_SAMPLE_HEAD);   // [SAMPLE_M]
  const Shard sh = shard_candidates(p, sm, 0, V, SAMPLE_M, keys);
  if (sh.n <= 0) return -1;
  sort_keys(keys, sh.n);
  return draw_candidates(p, sm, keys, sh.n, sh.m, sh.z, counter);
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


#if KOG_NRANKS > 1
// ---- sampling over the ranks' vocabulary shards (tensor parallelism) --------------------------------------
// Each rank's last block posts its shard's candidates (shard_candidates, at most MR_KEYS), its largest logit,
// the largest it left out and its weights' sum to every peer (FW_SCAND of the final slot); every rank merges
// all of them, in rank order, so every rank takes the same decision. The merged keys above the largest logit
// any rank left out are the first of the full order, so the draw from them is one rank's draw. Past them
// (rare: a flat distribution, a tail draw) every rank posts its shard's logits and samples from all V.
constexpr int MR_KEYS = SAMPLE_M / NRK < SCAND ? SAMPLE_M / NRK : SCAND;
// rank rk's rows of the LM head, [x, y) (phase_lm: U_LM units a rank, two rows a unit)
__device__ __forceinline__ int2 mr_vocab_rows(int rk) {
  return make_int2(min(V, 2 * rk * U_LM), min(V, 2 * (rk + 1) * U_LM));
}
#if CFG_MASK
constexpr int MASK_NONE = -2;   // the count (or greedy's index) a rank posts when its mask did not come
#endif
__device__ __forceinline__ u32 shard_word(const Shard& sh, const u64* keys, int x) {   // word x of the post
  if (x >= 5) {
    const u64 k = keys[(x - 5) >> 1];
    return ((x - 5) & 1) ? (u32)(k >> 32) : (u32)k;
  }
  const unsigned long long zb = (unsigned long long)__double_as_longlong(sh.z);
  return x == 0 ? (u32)sh.n : x == 1 ? __float_as_uint(sh.m) : x == 2 ? __float_as_uint(sh.c)
       : x == 3 ? (u32)zb : (u32)(zb >> 32);
}
// nomask (CFG_MASK): this rank's token mask did not come; posted as the shard's count, every rank returns -1
#if CFG_MASK
__device__ __noinline__ int sample_full_mr(const Params& p_, float* sm, u64 counter, int n, bool nomask) {
#else
__device__ __noinline__ int sample_full_mr(const Params& p_, float* sm, u64 counter, int n) {
#endif
  const Params& p = NOINL_PARAMS(p_);
  const int tid = threadIdx.x, rk = (int)kds.rank;
  const int2 rows = mr_vocab_rows(rk);
  const int v0 = rows.x, v1 = rows.y;
  const u64 fe = (u64)(p.e0[2] + n);
  const unsigned ftag = (unsigned)fe;
  const long long foff = mr_ll_off(CH_FIN, rk, fe);
  const u64* w0 = (const u64*)(kds.base[rk] + mr_ll_off(CH_FIN, 0, fe));   // rank q's words: q * st further
  const long long st = (long long)MR_DEPTH * kds.slot_bytes / 8;
  int tok = -1;
  if constexpr (SAMPLE_M > 0) {
    u32* hdr = reinterpret_cast<u32*>(reinterpret_cast<char*>(sm) + 8 * (NW + 8) + 4 * (SBINS + 8));   // [NRK][5]
    int* cnt = reinterpret_cast<int*>(hdr + 40);
    u64* keys = reinterpret_cast<u64*>(reinterpret_cast<char*>(sm) + SM_SAMPLE_HEAD);   // [NRK][MR_KEYS]
    u64* mine = keys + rk * MR_KEYS;
    Shard sh = shard_candidates(p, sm, v0, v1, MR_KEYS, mine);
#if CFG_MASK
    // a shard the mask forbids entirely is no candidate (its weights are 0), not a reason for the full sort
    if (sh.n < 0 && sh.m == NEG_INF) sh = Shard{0, NEG_INF, NEG_INF, 0.0};
    if (nomask) sh.n = MASK_NONE;
#endif
    const int nw = 5 + 2 * max(sh.n, 0);   // [n (< 0: no finite maximum or sum), m, c, z lo, z hi], keys (lo, hi)
    for (int x = tid; x < nw; x += NT) {
      const u32 v = shard_word(sh, mine, x);
      for (int q = 0; q < NRK; ++q)
        if (q != rk) kccl_ll_st((u64*)(kds.base[q] + foff) + FW_SCAND + x, ftag, v);
    }
    if (tid < NRK * 5) {
      const int q = tid / 5, x = tid % 5;
      hdr[tid] = q == rk ? shard_word(sh, mine, x) : kccl_ll_get(kds, w0 + q * st + FW_SCAND + x, ftag, q, CH_FIN);
    }
    if (tid == 0) *cnt = 0;
    __syncthreads();
    bool ok = true;
#if CFG_MASK
    bool none = false;
#endif
    float M = NEG_INF, C = NEG_INF;
    for (int q = 0; q < NRK; ++q) {
      const int nq = (int)hdr[5 * q];
      if (nq < 0) ok = false;
#if CFG_MASK
      if (nq == MASK_NONE) none = true;
#endif
      M = fmaxf(M, __uint_as_float(hdr[5 * q + 1]));
      C = fmaxf(C, __uint_as_float(hdr[5 * q + 2]));
      if (q != rk)
        for (int k = tid; k < nq; k += NT) {
          const u64* w = w0 + q * st + FW_SCAND + 5 + 2 * k;
          const u32 lo = kccl_ll_get(kds, w, ftag, q, CH_FIN), hi = kccl_ll_get(kds, w + 1, ftag, q, CH_FIN);
          keys[q * MR_KEYS + k] = ((u64)hi << 32) | lo;
        }
      for (int k = max(nq, 0) + tid; k < MR_KEYS; k += NT) keys[q * MR_KEYS + k] = 0ull;
    }
    double Z = 0.0;   // the shards' sums at the common maximum, in rank order
    for (int q = 0; q < NRK; ++q) {
      const double zq = __longlong_as_double((long long)(((unsigned long long)hdr[5 * q + 4] << 32) | hdr[5 * q + 3]));
      Z += zq * exp((double)__uint_as_float(hdr[5 * q + 1]) / p.temperature - (double)M / p.temperature);
    }
    __syncthreads();
#if CFG_MASK
    if (none) return -1;   // the same headers on every rank: every rank leaves here, before the logits' exchange
#endif
    if (ok && M > NEG_INF) {
      sort_keys(keys, NRK * MR_KEYS);
      int valid = 0;   // the keys above every rank's largest logit left out (padding, key 0, reads as NaN)
      for (int x = tid; x < NRK * MR_KEYS; x += NT) valid += key_logit(keys[x]) > C;
      atomicAdd(cnt, valid);
      __syncthreads();
      tok = draw_candidates(p, sm, keys, *cnt, M, Z, counter);
    }
  }
  if (tok >= 0) return tok;
  // past the candidates: every rank's logits into p.logits (own rows: written by this rank's blocks)
  for (int v = v0 + tid; v < v1; v += NT) {
    const u32 b = __float_as_uint(ldf(p.logits + v));
    for (int q = 0; q < NRK; ++q)
      if (q != rk) kccl_ll_st((u64*)(kds.base[q] + foff) + FW_LOGITS + (v - v0), ftag, b);
  }
  for (int v = tid; v < V; v += NT) {
    const int q = v / (2 * U_LM);
    if (q != rk) p.logits[v] = __uint_as_float(kccl_ll_get(kds, w0 + q * st + FW_LOGITS + (v - q * 2 * U_LM), ftag, q, CH_FIN));
  }
  __syncthreads();
  return sample_full(p, sm, counter);
}
#endif
