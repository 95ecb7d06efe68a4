// mk_spec_rows.cuh: part of monokernel.cu (pasted in place after mk_spec.cuh's layout, when CFG_SPEC > 0;
// not a standalone header). The verify pass's row loops: warp_dot / warp_dotq for P positions at once, each
// weight chunk loaded and unpacked once and dotted with every position's input in the plain loops' order.
#pragma once

// ---- the row loops: warp_dot / warp_dotq with P inputs (planes KMAX floats apart), P a compile-time count
// (a pass's np rounded up: PSIZE), so that the loops have no per-position branch (with one, a pass of one
// position ran its rows 5-8x slower than the plain kernel's); positions past np dot whatever their planes
// hold and are not used
// dotx on weights already unpacked: the same products and sums in the same order
template <int K>
__device__ __forceinline__ float dotx_f(const float* f, const float* xs, int c) {
  float s = 0.f;
  if (!XPL) {
    const float* x = xs + c * VEC;
#pragma unroll
    for (int e = 0; e < VEC; e += 4) {
      float4 a = *reinterpret_cast<const float4*>(x + e);
      s = fmaf(f[e], a.x, s);
      s = fmaf(f[e + 1], a.y, s);
      s = fmaf(f[e + 2], a.z, s);
      s = fmaf(f[e + 3], a.w, s);
    }
    return s;
  }
  const float4 a = *reinterpret_cast<const float4*>(xs + c * 4);
  const float4 b = *reinterpret_cast<const float4*>(xs + (K >> 1) + c * 4);
  s = fmaf(f[0], a.x, s); s = fmaf(f[1], a.y, s); s = fmaf(f[2], a.z, s); s = fmaf(f[3], a.w, s);
  s = fmaf(f[4], b.x, s); s = fmaf(f[5], b.y, s); s = fmaf(f[6], b.z, s); s = fmaf(f[7], b.w, s);
  return s;
}
template <int NR, int K, int UBM, int P>
__device__ __forceinline__ void warp_dot_p(const wt* __restrict__ w, int nvalid, const float* xs, float (*out)[NR]) {
  constexpr int NCHK = K / VEC;
  constexpr int CPL = (NCHK + 31) / 32;
  constexpr int UB0 = UBM / NR;
  constexpr int UB = UB0 < 1 ? 1 : (UB0 > CPL ? CPL : UB0);
  const int lane = threadIdx.x & 31;
  float acc[P][NR];
#pragma unroll
  for (int j = 0; j < P; ++j)
#pragma unroll
    for (int r = 0; r < NR; ++r) acc[j][r] = 0.f;
#pragma unroll
  for (int b0 = 0; b0 < CPL; b0 += UB) {
    uint4 wv[NR][UB];
#pragma unroll
    for (int r = 0; r < NR; ++r)
#pragma unroll
      for (int u = 0; u < UB; ++u) {
        const int c = (b0 + u) * 32 + lane;
        if (b0 + u < CPL && c < NCHK && r < nvalid)
          wv[r][u] = ldw(w + (long long)r * K + (long long)c * VEC);
        else
          wv[r][u] = make_uint4(0u, 0u, 0u, 0u);
      }
#pragma unroll
    for (int u = 0; u < UB; ++u) {   // a chunk's weights unpacked once, each position's inputs read once
      const int c = (b0 + u) * 32 + lane;
      if (b0 + u < CPL && c < NCHK) {
        float f[NR][VEC];
#pragma unroll
        for (int r = 0; r < NR; ++r) unpack(wv[r][u], f[r]);
#pragma unroll
        for (int j = 0; j < P; ++j)
#pragma unroll
          for (int r = 0; r < NR; ++r) acc[j][r] += dotx_f<K>(f[r], xs + j * KMAX, c);
      }
    }
  }
#pragma unroll
  for (int j = 0; j < P; ++j)
#pragma unroll
    for (int r = 0; r < NR; ++r) out[j][r] = warp_sum(acc[j][r]);
}
template <int NR, int K, int UBM, int P>
__device__ __forceinline__ void warp_dotq_p(const unsigned char* __restrict__ qb, const void* __restrict__ sb,
                                            long long e, int nvalid, const float* xs, float (*out)[NR]) {
  constexpr int LPC = qlpc<K>(), WPL = 4 / LPC;   // warp_dotq's slots: the same sums in the same order
  constexpr int NSLOT = K / QCW * LPC;
  constexpr int CPL = (NSLOT + 31) / 32;
  constexpr int UB0 = UBM / NR;
  constexpr int UB = UB0 < 1 ? 1 : (UB0 > CPL ? CPL : UB0);
  constexpr int CPB = 32 / QCW;
  const int lane = threadIdx.x & 31;
  float acc[P][NR];
#pragma unroll
  for (int j = 0; j < P; ++j)
#pragma unroll
    for (int r = 0; r < NR; ++r) acc[j][r] = 0.f;
#pragma unroll
  for (int b0 = 0; b0 < CPL; b0 += UB) {
    u32 wv[NR][UB][WPL];
    u32 sc[NR][UB];
#pragma unroll
    for (int r = 0; r < NR; ++r)
#pragma unroll
      for (int u = 0; u < UB; ++u) {
        const int sl = (b0 + u) * 32 + lane, c = sl / LPC, q0 = sl % LPC * WPL;
        if (b0 + u < CPL && sl < NSLOT && r < nvalid) {
          const long long er = e + (long long)r * K;
          ldw_words<WPL>(qb + er * QBITS / 8 + (long long)c * 16 + q0 * 4, wv[r][u]);
          sc[r][u] = ld_scale(sb, er / 32 + c / CPB);
        } else {
#pragma unroll
          for (int i = 0; i < WPL; ++i) wv[r][u][i] = 0u;
          sc[r][u] = 0u;
        }
      }
#pragma unroll
    for (int u = 0; u < UB; ++u) {
      const int sl = (b0 + u) * 32 + lane, c = sl / LPC, q0 = sl % LPC * WPL;
      if (b0 + u < CPL && sl < NSLOT) {
        float sxc[P];
#pragma unroll
        for (int j = 0; j < P; ++j) sxc[j] = chunk_xsum<K, WPL>(xs + j * KMAX, c, q0);
#pragma unroll
        for (int r = 0; r < NR; ++r)
#pragma unroll
          for (int j = 0; j < P; ++j) acc[j][r] += dotq_w<K, WPL>(wv[r][u], sc[r][u], xs + j * KMAX, c, q0, sxc[j]);
      }
    }
  }
#pragma unroll
  for (int j = 0; j < P; ++j)
#pragma unroll
    for (int r = 0; r < NR; ++r) out[j][r] = warp_sum(acc[j][r]);
}
// a pass's positions rounded up to the sizes the row loops are compiled for: 1, 2, 4, SP
constexpr int PS2 = SP < 2 ? SP : 2, PS4 = SP < 4 ? SP : 4;
__device__ __forceinline__ int psize(int np) { return np <= 1 ? 1 : (np <= PS2 ? PS2 : (np <= PS4 ? PS4 : SP)); }
// loads in flight a lane: the one-token loops' (UB1) for one position, fewer for more (the P accumulators a
// row share the registers)
template <int P, int UB1>
struct UbP { static constexpr int v = P == 1 ? UB1 : (P <= 2 ? 12 : 8); };
template <int NR, int K, int P, int UB1>
__device__ __forceinline__ void wdot_pp(const Params& p, long long e, int nvalid, const float* xs, float (*out)[NR]) {
  if constexpr (QW != 0)
    warp_dotq_p<NR, K, (UbP<P, UB1>::v < QUB ? UbP<P, UB1>::v : QUB), P>(reinterpret_cast<const unsigned char*>(p.w),
                                                                         p.ws, e, nvalid, xs, out);
  else warp_dot_p<NR, K, UbP<P, UB1>::v, P>(p.w + e, nvalid, xs, out);
}
// NR rows from element e for np positions: out[j][r], j < np
template <int NR, int K, int UB1 = CFG_UBMAX>
__device__ __forceinline__ void wdot_p(const Params& p, long long e, int nvalid, const float* xs, int np,
                                       float (*out)[NR]) {
  const int ps = psize(np);
  if (ps == 1) wdot_pp<NR, K, 1, UB1>(p, e, nvalid, xs, out);
  else if (ps == PS2) wdot_pp<NR, K, PS2, UB1>(p, e, nvalid, xs, out);
  else if (ps == PS4) wdot_pp<NR, K, PS4, UB1>(p, e, nvalid, xs, out);
  else wdot_pp<NR, K, SP, UB1>(p, e, nvalid, xs, out);
}
// the LM head's rows (the storage type) for np positions
template <int NR>
__device__ __forceinline__ void lmdot_p(const wt* w, int nvalid, const float* xs, int np, float (*out)[NR]) {
  const int ps = psize(np);
  if (ps == 1) warp_dot_p<NR, D, CFG_UBMAX, 1>(w, nvalid, xs, out);
  else if (ps == PS2) warp_dot_p<NR, D, 12, PS2>(w, nvalid, xs, out);
  else if (ps == PS4) warp_dot_p<NR, D, 8, PS4>(w, nvalid, xs, out);
  else warp_dot_p<NR, D, 8, SP>(w, nvalid, xs, out);
}
