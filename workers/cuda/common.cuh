// common.cuh: configuration, storage types, conversions and memory helpers shared by the monokernel
// and the prefill kernels. Every model dimension is a compile-time constant (CFG_* macros, given by
// build.py as -D options); the defaults below are the Laneformer 2B shape in bf16, so that
// `nvcc -arch=sm_90 -c monokernel.cu` compiles the file as it is.
#pragma once

#ifndef CFG_WT
#define CFG_WT 1            // storage type of weights and KV cache: 0 fp32, 1 bf16, 2 fp16
#endif
#ifndef CFG_QW
#define CFG_QW 0            // layer matrices: 0 in the storage type, 1 Q8_0, 2 Q4_0, 3 Q4_1 (GGUF blocks, below), 4 the K-quants (kquant.cuh)
#endif
#ifndef CFG_BIAS
#define CFG_BIAS 0          // q/k/v biases (Qwen2): fp32 [NL][L][RQKV], added before RoPE
#endif
#ifndef CFG_D
#define CFG_D 3072
#define CFG_NL 15
#define CFG_H 32
#define CFG_KV 16
#define CFG_HD 96
#define CFG_F 12288
#define CFG_V 32000
#define CFG_L 8
#define CFG_DELTA 2
#define CFG_USE_COMM 1
#define CFG_USE_EARLY 1
#define CFG_EARLY_FUTURE 1
#define CFG_SW 2048         // sliding window (0: none)
#define CFG_SWN 10          // sliding_window_n_layers (negative: the last -SWN layers)
#define CFG_THETA 10000.0
#define CFG_EPS 1e-5f
#endif
#ifndef CFG_NB
#define CFG_NB 132          // blocks = multiprocessors (one block per SM, all resident)
#endif
#ifndef CFG_NT
#define CFG_NT 512          // threads per block (256: two blocks per SM, with twice the blocks)
#endif
#ifndef CFG_PF
#define CFG_PF 65536        // bytes of its next weights each block prefetches into L2 before it waits
#endif
#ifndef CFG_PFS
#define CFG_PFS 0           // bytes of its next weights each block copies into shared memory before it waits:
                            // none when the weights stream (reading them from shared memory is then the slower
                            // path, docs/monokernel.md); build.one_lane_units sets it for small one-lane models
#endif
#ifndef CFG_NR_WO
#define CFG_NR_WO 4         // rows per warp unit in the output projection
#endif
#ifndef CFG_NR_W2
#define CFG_NR_W2 2         // rows per warp unit in the down projection
#endif
#ifndef CFG_UBMAX
#define CFG_UBMAX 12        // 16-byte loads in flight per lane in a row dot (over all its rows)
#endif

typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

#if CFG_WT == 0
typedef float wt;
#else
typedef u16 wt;
#endif

namespace cfg {
constexpr int D = CFG_D, NL = CFG_NL, H = CFG_H, KV = CFG_KV, HD = CFG_HD, F = CFG_F, V = CFG_V, L = CFG_L;
constexpr int DELTA = CFG_DELTA;
constexpr bool USE_COMM = CFG_USE_COMM, USE_EARLY = CFG_USE_EARLY, EARLY_FUTURE = CFG_EARLY_FUTURE;
constexpr int SW = CFG_SW, SWN = CFG_SWN;
constexpr int HL = H / L, KVL = KV / L, G = H / KV, HDL = HL * HD, KVDL = KVL * HD, FL = F / L;
constexpr int RQKV = HDL + 2 * KVDL;
constexpr int VEC = 16 / (int)sizeof(wt);
// Quantized layer matrices (CFG_QW): GGUF's blocks of 32 weights along a row, split into two arrays over
// the same element index e as the plain layout: quants at byte e * QBITS / 8 (Q8_0: 32 int8 a block; Q4_*:
// GGUF's 16 bytes a block, byte j = element j (low nibble) and element j + 16 (high)), scales at block
// e / 32 (Q8_0 / Q4_0: the fp16 d; Q4_1: one word, fp16 d low and fp16 m high). A 16-byte load of quants
// is QCW weights: a half block (Q8_0) or one block (Q4_*), so every lane needs one scale a chunk.
constexpr int QW = CFG_QW;
constexpr int QBITS = QW == 1 ? 8 : 4;
constexpr int QCW = QW == 0 ? VEC : (QW == 1 ? 16 : 32);   // weights a 16-byte chunk of a matrix row
constexpr int QSB = QW == 3 ? 4 : 2;                        // bytes of a block's scale (and min)
typedef unsigned long long qoff;
constexpr int NB = CFG_NB, NT = CFG_NT, NW = NT / 32;
constexpr int PF = CFG_PF;
// bytes of its WO rows each block asks L2 for when attention starts: all of them, since attention leaves
// the memory idle and WO comes next (off measured slower: docs/lab/benchmarks-2026-11.md)
constexpr long long PF_ATT = 1ll << 30;
constexpr int PFS = CFG_PFS;
constexpr float EPS = CFG_EPS;
static_assert(H % L == 0 && KV % L == 0 && F % L == 0 && H % KV == 0, "lane divisibility");
static_assert(HD % 2 == 0, "RoPE needs an even head_dim");
static_assert(D % VEC == 0 && HDL % VEC == 0 && FL % VEC == 0 && HD % VEC == 0, "16-byte rows");
static_assert(HD / VEC <= 32, "head_dim too large for one warp");
static_assert(D % 4 == 0, "hidden size must be a multiple of 4");
static_assert(QW == 0 || (D % 32 == 0 && HDL % 32 == 0 && FL % 32 == 0), "quantized rows: multiples of 32");
__host__ __device__ constexpr bool sliding(int i) {
  return SW > 0 && (SWN >= 0 ? i < SWN : i >= NL + SWN);
}
}  // namespace cfg

// ---- conversions -------------------------------------------------------------------------------
__device__ __forceinline__ float bf2f(u32 bits16) { return __uint_as_float(bits16 << 16); }
__device__ __forceinline__ float h2f(u16 x) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x));
  return f;
}
__device__ __forceinline__ u16 f2bf(float f) {
  u16 r;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(f));
  return r;
}
__device__ __forceinline__ u16 f2h(float f) {
  u16 r;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(f));
  return r;
}
__device__ __forceinline__ float w2f(wt x) {
#if CFG_WT == 0
  return x;
#elif CFG_WT == 1
  return bf2f((u32)x);
#else
  return h2f(x);
#endif
}
__device__ __forceinline__ wt f2w(float f) {
#if CFG_WT == 0
  return f;
#elif CFG_WT == 1
  return f2bf(f);
#else
  return f2h(f);
#endif
}
// 16 bytes of storage -> VEC floats
__device__ __forceinline__ void unpack(const uint4& v, float* o) {
#if CFG_WT == 0
  o[0] = __uint_as_float(v.x); o[1] = __uint_as_float(v.y);
  o[2] = __uint_as_float(v.z); o[3] = __uint_as_float(v.w);
#elif CFG_WT == 1
  o[0] = __uint_as_float(v.x << 16); o[1] = __uint_as_float(v.x & 0xffff0000u);
  o[2] = __uint_as_float(v.y << 16); o[3] = __uint_as_float(v.y & 0xffff0000u);
  o[4] = __uint_as_float(v.z << 16); o[5] = __uint_as_float(v.z & 0xffff0000u);
  o[6] = __uint_as_float(v.w << 16); o[7] = __uint_as_float(v.w & 0xffff0000u);
#else
  o[0] = h2f((u16)(v.x & 0xffff)); o[1] = h2f((u16)(v.x >> 16));
  o[2] = h2f((u16)(v.y & 0xffff)); o[3] = h2f((u16)(v.y >> 16));
  o[4] = h2f((u16)(v.z & 0xffff)); o[5] = h2f((u16)(v.z >> 16));
  o[6] = h2f((u16)(v.w & 0xffff)); o[7] = h2f((u16)(v.w >> 16));
#endif
}
// dot of 16 bytes of storage with VEC floats of shared memory (16-byte aligned)
__device__ __forceinline__ float dot16(const uint4& w, const float* x) {
  float f[cfg::VEC];
  unpack(w, f);
  float s = 0.f;
#pragma unroll
  for (int e = 0; e < cfg::VEC; e += 4) {
    float4 a = *reinterpret_cast<const float4*>(x + e);
    s = fmaf(f[e], a.x, s);
    s = fmaf(f[e + 1], a.y, s);
    s = fmaf(f[e + 2], a.z, s);
    s = fmaf(f[e + 3], a.w, s);
  }
  return s;
}

// ---- quantized chunks: 16 bytes of quants -> floats without a conversion instruction: a byte b placed
// under the exponent of 2^23 is the float 2^23 + b exactly, so one byte permute and one subtraction
// (of 2^23 plus the type's offset) give the weight's integer exactly
__device__ __forceinline__ float qbyte(u32 v, int k, float magic) {
  return __int_as_float(__byte_perm(v, 0x4B00u, 0x5440u + (u32)k)) - magic;
}
// CFG_QOFS's nibble: byte k of t (q * 8, q < 16) under the exponent of 0.5: the float (16 + q) / 32
__device__ __forceinline__ float qhalf(u32 t, int k) { return __int_as_float(__byte_perm(t, 0x3F00u, 0x5044u + ((u32)k << 8))); }
__device__ __forceinline__ float hbits2f(u32 bits16) { return h2f((u16)bits16); }

// ---- memory ------------------------------------------------------------------------------------
// weights: read once per token, never written by the kernel: non-coherent path, no L1 allocation
__device__ __forceinline__ uint4 ldw(const void* p) {
  uint4 r;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
      : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
  return r;
}
// WPL words (4, 2 or 1) of weights at p, the same path (quantized rows split a chunk over lanes: mk_helpers.cuh)
template <int WPL>
__device__ __forceinline__ void ldw_words(const void* p, u32* v) {
  if constexpr (WPL == 4) {
    const uint4 r = ldw(p);
    v[0] = r.x; v[1] = r.y; v[2] = r.z; v[3] = r.w;
  } else if constexpr (WPL == 2) {
    asm("ld.global.nc.L1::no_allocate.v2.u32 {%0,%1}, [%2];" : "=r"(v[0]), "=r"(v[1]) : "l"(p));
  } else {
    asm("ld.global.nc.L1::no_allocate.u32 %0, [%1];" : "=r"(v[0]) : "l"(p));
  }
}
// data written by other blocks of the same launch: L2 only (no stale L1 lines)
__device__ __forceinline__ float ldf(const float* p) { return __ldcg(p); }
__device__ __forceinline__ uint4 ldc16(const void* p) { return __ldcg(reinterpret_cast<const uint4*>(p)); }

__device__ __forceinline__ u64 ld_acquire(const u64* p) {
  u64 v;
  asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void red_release(u64* p, u64 v) {
  asm volatile("red.release.gpu.global.add.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ void st_release(u64* p, u64 v) {
  asm volatile("st.release.gpu.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ u64 spin_until(const u64* p, u64 target) {   // returns the value that passed
  u64 v;
  while ((v = ld_acquire(p)) < target) {
  }
  return v;
}
__device__ __forceinline__ void prefetch_l2(const void* base, long long bytes, long long limit) {
  long long n = bytes < limit ? bytes : limit;
  if (threadIdx.x == 0) {
    n &= ~15ll;
    for (long long off = 0; off < n; off += 32768) {
      const unsigned sz = (unsigned)(n - off < 32768 ? n - off : 32768);
      asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"((const char*)base + off), "r"(sz) : "memory");
    }
  }
}
// asynchronous 16-byte copies global -> shared (completed by cp_async_wait_all + a barrier)
__device__ __forceinline__ void cp_async16(void* smem_dst, const void* gsrc) {
  asm volatile("{\n .reg .u64 sa;\n cvta.to.shared.u64 sa, %0;\n cp.async.cg.shared.global [sa], [%1], 16;\n}"
               ::"l"(smem_dst), "l"(gsrc) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;" ::: "memory"); }

// ---- reductions --------------------------------------------------------------------------------
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// ---- counter-based RNG (docs/interfaces.md) ------------------------------------------------------
__device__ __forceinline__ u64 splitmix64(u64 x) {
  x += 0x9E3779B97F4A7C15ull;
  u64 z = x;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
__device__ __forceinline__ double uniform01(u64 seed, u64 counter) {
  return (double)(splitmix64(seed ^ splitmix64(counter)) >> 11) * (1.0 / 9007199254740992.0);
}
