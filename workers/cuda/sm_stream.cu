// sm_stream.cu: how fast a few SMs stream weights (workers/cuda/sm_stream.py runs it; docs/monokernel.md,
// eighth session). One block of 512 threads per active SM streams its own 12 KB units (two bf16 rows of 3072,
// a W13 unit) and dots them with a vector in shared memory, as the monokernel's W13 rows do, in one of two ways:
//   reg<UB>     each warp loads UB 16-byte chunks of both rows into registers, then computes (warp_dot)
//   tma<NS,SB>  each warp streams its units through NS shared-memory slots of SB bytes, each filled by one
//               cp.async.bulk (the copy engine) and completed on an mbarrier; lane 0 refills a slot once the
//               warp has read it
// The question it answers: with half the SMs in latency-bound steps, can the other half still draw the
// memory's bandwidth, and does a copy-engine ring draw more of it per SM than register loads?
typedef unsigned long long u64;
#define D 3072
#define NT 512
#define NW 16

__device__ __forceinline__ uint4 ldw(const void* p) {
  uint4 r;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
      : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
  return r;
}
// 16 bytes of bf16 dotted with x in two planes (the monokernel's layout: no bank conflicts)
__device__ __forceinline__ float dotx(const uint4& w, const float* xs, int c) {
  const float4 a = *reinterpret_cast<const float4*>(xs + c * 4);
  const float4 b = *reinterpret_cast<const float4*>(xs + (D >> 1) + c * 4);
  float s = 0.f;
  s = fmaf(__uint_as_float(w.x << 16), a.x, s); s = fmaf(__uint_as_float(w.x & 0xffff0000u), a.y, s);
  s = fmaf(__uint_as_float(w.y << 16), a.z, s); s = fmaf(__uint_as_float(w.y & 0xffff0000u), a.w, s);
  s = fmaf(__uint_as_float(w.z << 16), b.x, s); s = fmaf(__uint_as_float(w.z & 0xffff0000u), b.y, s);
  s = fmaf(__uint_as_float(w.w << 16), b.z, s); s = fmaf(__uint_as_float(w.w & 0xffff0000u), b.w, s);
  return s;
}
__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ void unit_out(float* out, long long u, float a0, float a1) {
  out[u] = a0 / (1.f + expf(-a0)) * a1;   // silu(gate) * up, as W13
}
__device__ void load_x(float* xs, const float* x) {
  for (int i = threadIdx.x; i < D; i += NT) xs[i] = x[i];
}

// ---- register loads ----------------------------------------------------------------------------------
template <int UB>
__device__ void reg_loop(const unsigned short* W, float* out, const float* xs, int upb) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  constexpr int CPL = D / 8 / 32;   // 16-byte chunks of a row per lane
  for (int u = warp; u < upb; u += NW) {
    const long long gu = (long long)blockIdx.x * upb + u;
    const unsigned short* w = W + gu * 2 * D;
    float acc0 = 0.f, acc1 = 0.f;
#pragma unroll
    for (int b0 = 0; b0 < CPL; b0 += UB) {
      uint4 wv[2][UB];
#pragma unroll
      for (int r = 0; r < 2; ++r)
#pragma unroll
        for (int k = 0; k < UB; ++k) wv[r][k] = ldw(w + (long long)r * D + ((b0 + k) * 32 + lane) * 8);
#pragma unroll
      for (int k = 0; k < UB; ++k) {
        acc0 += dotx(wv[0][k], xs, (b0 + k) * 32 + lane);
        acc1 += dotx(wv[1][k], xs, (b0 + k) * 32 + lane);
      }
    }
    acc0 = warp_sum(acc0);
    acc1 = warp_sum(acc1);
    if (lane == 0) unit_out(out, gu, acc0, acc1);
  }
}
template <int UB>
__device__ void reg_kernel(const unsigned short* W, float* out, const float* x, int upb, int reps) {
  extern __shared__ float4 sm4[];
  float* xs = reinterpret_cast<float*>(sm4);
  load_x(xs, x);
  __syncthreads();
  for (int r = 0; r < reps; ++r) reg_loop<UB>(W, out, xs, upb);
}
extern "C" __global__ void __launch_bounds__(NT, 1) reg6(const unsigned short* W, float* out, const float* x, int upb, int reps) { reg_kernel<6>(W, out, x, upb, reps); }
extern "C" __global__ void __launch_bounds__(NT, 1) reg12(const unsigned short* W, float* out, const float* x, int upb, int reps) { reg_kernel<12>(W, out, x, upb, reps); }

// ---- copy-engine ring (cp.async.bulk + mbarrier), one per warp -----------------------------------------
__device__ __forceinline__ unsigned sa(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void mb_init(u64* b) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(sa(b)) : "memory");
}
__device__ __forceinline__ void bulk_load(void* dst, const void* src, unsigned bytes, u64* bar) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(sa(bar)), "r"(bytes) : "memory");
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               ::"r"(sa(dst)), "l"(src), "r"(bytes), "r"(sa(bar)) : "memory");
}
__device__ __forceinline__ void mb_wait(u64* b, unsigned parity) {
  asm volatile("{\n .reg .pred p;\n W: mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n @!p bra W;\n}"
               ::"r"(sa(b)), "r"(parity) : "memory");
}
template <int NS, int SB>
__device__ void tma_loop(const unsigned short* W, float* out, const float* xs, int upb, char* ring, u64* bars) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  constexpr int PPU = 12288 / SB;   // pieces of a unit
  constexpr int CPP = SB / 16;      // 16-byte chunks of a piece
  char* myring = ring + (long long)warp * NS * SB;
  u64* mybar = bars + warp * NS;
  const int npieces = (upb - warp + NW - 1) / NW * PPU;
  auto src_of = [&](int c) -> const char* {
    const long long gu = (long long)blockIdx.x * upb + warp + NW * (c / PPU);
    return reinterpret_cast<const char*>(W + gu * 2 * D) + (long long)(c % PPU) * SB;
  };
  if (lane == 0)
    for (int c = 0; c < NS && c < npieces; ++c) bulk_load(myring + c * SB, src_of(c), SB, mybar + c);
  float acc0 = 0.f, acc1 = 0.f;
  for (int c = 0; c < npieces; ++c) {
    const int s = c % NS, piece = c % PPU;
    mb_wait(mybar + s, (c / NS) & 1);
    const uint4* wp = reinterpret_cast<const uint4*>(myring + s * SB);
#pragma unroll
    for (int k = 0; k < (CPP + 31) / 32; ++k) {
      const int cc = k * 32 + lane;
      if (cc < CPP) {
        const int chunk = piece * CPP + cc;   // 16-byte chunk of the unit: row 0 is 0..383
        const uint4 w = wp[cc];
        if (chunk < D / 8) acc0 += dotx(w, xs, chunk);
        else acc1 += dotx(w, xs, chunk - D / 8);
      }
    }
    __syncwarp();
    if (lane == 0 && c + NS < npieces) bulk_load(myring + s * SB, src_of(c + NS), SB, mybar + s);
    if (piece == PPU - 1) {
      const float a0 = warp_sum(acc0), a1 = warp_sum(acc1);
      if (lane == 0) unit_out(out, (long long)blockIdx.x * upb + warp + NW * (c / PPU), a0, a1);
      acc0 = acc1 = 0.f;
    }
  }
}
template <int NS, int SB>
__device__ void tma_kernel(const unsigned short* W, float* out, const float* x, int upb, int reps) {
  extern __shared__ float4 sm4[];
  float* xs = reinterpret_cast<float*>(sm4);
  u64* bars = reinterpret_cast<u64*>(xs + D);
  char* ring = reinterpret_cast<char*>(((unsigned long long)(bars + NW * NS) + 127) & ~127ull);
  load_x(xs, x);
  for (int r = 0; r < reps; ++r) {
    if (threadIdx.x < NW * NS) mb_init(bars + threadIdx.x);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    __syncthreads();
    tma_loop<NS, SB>(W, out, xs, upb, ring, bars);
    __syncthreads();
    if (threadIdx.x < NW * NS) asm volatile("mbarrier.inval.shared::cta.b64 [%0];" ::"r"(sa(bars + threadIdx.x)) : "memory");
  }
}
#define TMA(NAME, NS, SB)                                                                                    \
  extern "C" __global__ void __launch_bounds__(NT, 1) NAME(const unsigned short* W, float* out, const float* x, \
                                                          int upb, int reps) { tma_kernel<NS, SB>(W, out, x, upb, reps); }
TMA(tma2x6k, 2, 6144)
TMA(tma3x4k, 3, 4096)
TMA(tma4x3k, 4, 3072)
TMA(tma6x2k, 6, 2048)
