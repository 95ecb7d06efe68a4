// mk_kquant.cuh: part of monokernel.cu (pasted into mk_helpers.cuh before wdot; not a standalone header).
// The row loop of the K-quants (CFG_QW 4; the layout: kquant.cuh): warp_dotq's slots and batches, a
// chunk's words dequantized by kq_word under the offset form, its super-block's record read through L1
// (the 8 chunks of a super-block share it), and the type of a matrix looked up per unit (ktype).
#pragma once

// the K type of the rows that start at element e (p.kt: 4 bits a matrix of a layer)
__device__ __forceinline__ int ktype(const Params& p, long long e) {
  const long long i = e / LAYER_SZ, off = e - i * LAYER_SZ;
  int f;
  if (off < OFF_WO) {
    const int row = (int)((off / D) % RQKV);
    f = row < HDL ? 0 : (row < HDL + KVDL ? 1 : 2);
  } else {
    f = off < OFF_W13 ? 3 : (off < OFF_W2 ? 4 : 5);
  }
  return (int)((__ldg(p.kt + i) >> (4 * f)) & 15u);
}

// NR rows of K columns from element e of type T dotted with xs (planes xp), as warp_dotq
template <int NR, int K, int UBM, int T>
__device__ __forceinline__ void warp_dotk(const Params& p, long long e, int nvalid, const float* xs, float* out) {
  constexpr int LPC = qlpc<K>(), WPL = 4 / LPC;   // lanes a chunk, words a lane (slot s: chunk s / LPC)
  constexpr int NC = K / 32, NSLOT = NC * LPC;
  constexpr int CPL = (NSLOT + 31) / 32;
  constexpr int UB0 = UBM / NR;
  constexpr int UB = UB0 < 1 ? 1 : (UB0 > CPL ? CPL : UB0);
  constexpr float G = kq_g<T>();
  const unsigned char* qb = reinterpret_cast<const unsigned char*>(p.w);
  const unsigned char* rb = reinterpret_cast<const unsigned char*>(p.ws);
  const unsigned char* hb = reinterpret_cast<const unsigned char*>(p.wh);
  const int lane = threadIdx.x & 31;
  float acc[NR];
#pragma unroll
  for (int r = 0; r < NR; ++r) acc[r] = 0.f;
#pragma unroll
  for (int b0 = 0; b0 < CPL; b0 += UB) {
    constexpr int HW = (T == KT_Q6K && WPL == 4) ? 2 : 1;   // high words a lane: Q6_K's words 0-3 need both
    u32 wv[NR][UB][WPL], hv[NR][UB][HW], w0[NR][UB], sb[NR][UB];
#pragma unroll
    for (int r = 0; r < NR; ++r)
#pragma unroll
      for (int u = 0; u < UB; ++u) {
        const int sl = (b0 + u) * 32 + lane, c = sl / LPC, q0 = sl % LPC * WPL;
#pragma unroll
        for (int i = 0; i < HW; ++i) hv[r][u][i] = 0u;
        if (b0 + u < CPL && sl < NSLOT && r < nvalid) {
          const long long ch = (e + (long long)r * K) / 32 + c;   // the chunk's global index
          ldw_words<WPL>(qb + ch * 16 + q0 * 4, wv[r][u]);
          if constexpr (T == KT_Q5K) ldw_words<1>(hb + ch * 8, hv[r][u]);
          if constexpr (T == KT_Q6K) ldw_words<HW>(hb + ch * 8 + (q0 >> 1) * 4, hv[r][u]);
          const unsigned char* rec = rb + (ch >> 3) * KREC;
          w0[r][u] = __ldg(reinterpret_cast<const u32*>(rec));
          sb[r][u] = (u32)__ldg(reinterpret_cast<const u16*>(rec + 4) + (ch & 7));
        } else {
#pragma unroll
          for (int i = 0; i < WPL; ++i) wv[r][u][i] = 0u;
          w0[r][u] = sb[r][u] = 0u;
        }
      }
#pragma unroll
    for (int u = 0; u < UB; ++u) {
      const int sl = (b0 + u) * 32 + lane, c = sl / LPC, q0 = sl % LPC * WPL;
      if (b0 + u < CPL && sl < NSLOT) {
        float xlo = 0.f, xhi = 0.f;   // the sums of the lane's inputs, once for all rows
#pragma unroll
        for (int i = 0; i < WPL; ++i) {
          const int q = q0 + i;
          const float4 a = *reinterpret_cast<const float4*>(xs + (q * NC + c) * 4);
          const float4 b = *reinterpret_cast<const float4*>(xs + ((4 + q) * NC + c) * 4);
          xlo += (a.x + a.y) + (a.z + a.w);
          xhi += (b.x + b.y) + (b.z + b.w);
        }
#pragma unroll
        for (int r = 0; r < NR; ++r) {
          float slo = 0.f, shi = 0.f;
#pragma unroll
          for (int i = 0; i < WPL; ++i) {
            const int q = q0 + i;
            u32 lo, hi;
            kq_word<T>(wv[r][u][i], hv[r][u][HW == 2 ? i >> 1 : 0], q, lo, hi);
            const float4 a = *reinterpret_cast<const float4*>(xs + (q * NC + c) * 4);
            const float4 b = *reinterpret_cast<const float4*>(xs + ((4 + q) * NC + c) * 4);
            float s = fmaf(qhalf(lo, 0), a.x, 0.f);
            s = fmaf(qhalf(lo, 1), a.y, s); s = fmaf(qhalf(lo, 2), a.z, s); s = fmaf(qhalf(lo, 3), a.w, s);
            float t = fmaf(qhalf(hi, 0), b.x, 0.f);
            t = fmaf(qhalf(hi, 1), b.y, t); t = fmaf(qhalf(hi, 2), b.z, t); t = fmaf(qhalf(hi, 3), b.w, t);
            slo += s;
            shi += t;
          }
          float alo, blo, ahi, bhi;
          kq_coef<T>(w0[r][u], sb[r][u], alo, blo, ahi, bhi);
          if constexpr (T == KT_Q6K)
            acc[r] += fmaf(alo, G * slo, fmaf(blo, xlo, fmaf(ahi, G * shi, bhi * xhi)));
          else
            acc[r] += fmaf(alo, G * (slo + shi), blo * (xlo + xhi));
        }
      }
    }
  }
#pragma unroll
  for (int r = 0; r < NR; ++r) out[r] = warp_sum(acc[r]);
}

// the K-quant rows from element e: one loop a type the build holds (KT_MASK), the type read per unit
template <int NR, int K, int UBM>
__device__ __forceinline__ void wdot_k(const Params& p, long long e, int nvalid, const float* xs, float* out) {
  if constexpr (KT_MASK == (1 << KT_Q4K)) {
    warp_dotk<NR, K, UBM, KT_Q4K>(p, e, nvalid, xs, out);
  } else if constexpr (KT_MASK == (1 << KT_Q5K)) {
    warp_dotk<NR, K, UBM, KT_Q5K>(p, e, nvalid, xs, out);
  } else if constexpr (KT_MASK == (1 << KT_Q6K)) {
    warp_dotk<NR, K, UBM, KT_Q6K>(p, e, nvalid, xs, out);
  } else {
    const int t = ktype(p, e);
    if ((KT_MASK & (1 << KT_Q4K)) && t == KT_Q4K) warp_dotk<NR, K, UBM, KT_Q4K>(p, e, nvalid, xs, out);
    else if ((KT_MASK & (1 << KT_Q5K)) && t == KT_Q5K) warp_dotk<NR, K, UBM, KT_Q5K>(p, e, nvalid, xs, out);
    else warp_dotk<NR, K, UBM, KT_Q6K>(p, e, nvalid, xs, out);
  }
}
// the L2 prefetch of K-quant elements [e, e + n): nibbles, high bits where the type has them, records
__device__ __forceinline__ void prefetch_k(const Params& p, long long e, long long n, long long limit) {
  prefetch_l2(reinterpret_cast<const unsigned char*>(p.w) + e / 2, n / 2, limit);
  if (KT_MASK != (1 << KT_Q4K) && n > 0 && ktype(p, e) != KT_Q4K)
    prefetch_l2(reinterpret_cast<const unsigned char*>(p.wh) + e / 32 * 8, n / 32 * 8, limit / 2);
  const long long s0 = e / 256 * KREC, a0 = s0 & ~15ll;
  prefetch_l2(reinterpret_cast<const unsigned char*>(p.ws) + a0, (e + n + 255) / 256 * KREC - a0, limit / 8);
}
