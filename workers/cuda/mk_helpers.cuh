// mk_helpers.cuh: part of monokernel.cu (pasted in place after mk_multirank.cuh; not a standalone
// header). Input planes in shared memory (xp, dotx), unit ranges of a block (brange, lane_units),
// fused_step, wait_lanes, block_sum and warp_dot (the weight rows' dot products).
#pragma once

// ---- helpers -----------------------------------------------------------------------------------
#ifndef CFG_XPLANES
#define CFG_XPLANES 1
#endif
// An input vector x of K floats (K = D, HDL or FL) is kept in shared memory in two planes when VEC = 8:
// x[8c .. 8c+3] at 4c, x[8c+4 .. 8c+7] at K/2 + 4c, so that the float4 loads of a warp's 32 consecutive
// 16-byte weight chunks read consecutive addresses (no bank conflicts). VEC = 4 (fp32): as is.
constexpr bool XPL = CFG_XPLANES && VEC == 8;
__device__ __forceinline__ int xp(int d, int K) {
  return XPL ? ((d & 7) >> 2) * (K >> 1) + ((d >> 3) << 2) + (d & 3) : d;
}
// dot of 16 bytes of storage (chunk c of a row of K) with x (shared, K floats, planes as above)
template <int K>
__device__ __forceinline__ float dotx(const uint4& w, const float* xs, int c) {
  if (!XPL) return dot16(w, xs + c * VEC);
  float f[8];
  unpack(w, f);
  const float4 a = *reinterpret_cast<const float4*>(xs + c * 4);
  const float4 b = *reinterpret_cast<const float4*>(xs + (K >> 1) + c * 4);
  float s = 0.f;
  s = fmaf(f[0], a.x, s); s = fmaf(f[1], a.y, s); s = fmaf(f[2], a.z, s); s = fmaf(f[3], a.w, s);
  s = fmaf(f[4], b.x, s); s = fmaf(f[5], b.y, s); s = fmaf(f[6], b.z, s); s = fmaf(f[7], b.w, s);
  return s;
}
__device__ __forceinline__ void brange(int U, int& a, int& b) {
  a = (int)((long long)blockIdx.x * U / NB);
  b = (int)((long long)(blockIdx.x + 1) * U / NB);
}
// count of units of lane l inside [a, b) for a lane-major unit space with upl units per lane
__device__ __forceinline__ int lane_units(int l, int upl, int a, int b) {
  int lo = max(a, l * upl), hi = min(b, (l + 1) * upl);
  return hi > lo ? hi - lo : 0;
}
__device__ __forceinline__ bool fused_step(int s) {   // residual s written by its producer rows
  if (s == 0) return true;
  int i = (s - 1) / 2;
  return !(USE_COMM && USE_EARLY && i < DELTA && LG > 1);
}

// The first warp waits, lane k on counter l0 + k: several lanes' polls in flight at once (thread 0 polling
// them one after another ran 732-744 tokens/s against 767-770, fifth session).
#define WAITER (threadIdx.x < 32)   // the threads that call wait_lanes
__device__ __forceinline__ void wait_lanes(const Params& p, int phase, int l0, int l1, u64 target) {
  for (int l = l0 + (int)(threadIdx.x & 31); l <= l1; l += 32) SPIN(p, CTR(p, phase * L + l), target);
}

__device__ float block_sum(float v, float* red) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  v = warp_sum(v);
  __syncthreads();
  if (lane == 0) red[warp] = v;
  __syncthreads();
  float t = 0.f;
#pragma unroll
  for (int w = 0; w < NW; ++w) t += red[w];
  return t;
}

// NR rows of K columns starting at w (row stride K), dotted with xs (shared, K floats); rows >= nvalid
// are not read. All lanes get the NR sums.
#ifndef CFG_UB_QKV
#define CFG_UB_QKV CFG_UBMAX   // loads in flight per lane in the QKV rows (build.qkv_loads: 24 for one and two ranks)
#endif
#ifndef CFG_UB_WO
#define CFG_UB_WO CFG_UBMAX    // ... in the output projection's rows
#endif
template <int NR, int K, bool SMEM = false, int UBM = CFG_UBMAX>
__device__ __forceinline__ void warp_dot(const wt* __restrict__ w, int nvalid, const float* xs, float* out) {
  constexpr int NCHK = K / VEC;
  constexpr int CPL = (NCHK + 31) / 32;
  constexpr int UB0 = UBM / NR;
  constexpr int UB = UB0 < 1 ? 1 : (UB0 > CPL ? CPL : UB0);
  const int lane = threadIdx.x & 31;
  float acc[NR];
#pragma unroll
  for (int r = 0; r < NR; ++r) acc[r] = 0.f;
#pragma unroll
  for (int b0 = 0; b0 < CPL; b0 += UB) {
    uint4 wv[NR][UB];
#pragma unroll
    for (int r = 0; r < NR; ++r)
#pragma unroll
      for (int u = 0; u < UB; ++u) {
        const int c = (b0 + u) * 32 + lane;
        if (b0 + u < CPL && c < NCHK && r < nvalid)
          wv[r][u] = SMEM ? *reinterpret_cast<const uint4*>(w + (long long)r * K + (long long)c * VEC)
                          : ldw(w + (long long)r * K + (long long)c * VEC);
        else
          wv[r][u] = make_uint4(0u, 0u, 0u, 0u);
      }
#pragma unroll
    for (int r = 0; r < NR; ++r)
#pragma unroll
      for (int u = 0; u < UB; ++u) {
        const int c = (b0 + u) * 32 + lane;
        if (b0 + u < CPL && c < NCHK) acc[r] += dotx<K>(wv[r][u], xs, c);
      }
  }
#pragma unroll
  for (int r = 0; r < NR; ++r) out[r] = warp_sum(acc[r]);
}
