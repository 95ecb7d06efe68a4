// bench/q4_rows.cu: the kernels of bench/q4_rows.py (y = W x at batch 1 for one weight matrix, streamed from
// HBM). No headers (CuPy's NVRTC compiles it as the monokernel is compiled, and nvcc in
// tests/test_q4_rows_compile.py); the script appends one extern "C" wrapper a configuration (q4_rows.wrappers).
//
// Every row kernel: a block stages the input x (fp32, global) into shared memory in its form's layout, then its
// warps take units of NR consecutive rows from the block's contiguous range of units (brange), the first unit
// ua + warp, the next from a shared-memory queue (the monokernel's next_unit). Forms (FORM):
//   MONO  the monokernel's loops transplanted (workers/cuda/mk_helpers.cuh warp_dot / warp_dotq / dotq_w /
//         chunk_xsum with CFG_QOFS 1, mk_kquant.cuh warp_dotk for Q4_K), fp32 x in planes, a chunk a lane
//   DP4A  x quantized to 8 bits a 32-block in shared memory (fp32 d, int sum of the quants), __dp4a
//         integer dots, one float FMA a chunk (llama.cpp mmvq's arithmetic on the monokernel's layout)
//   HALF2 nibbles to fp16 pairs by the 0x6400 magic number (lop3, Marlin's dequantizer), HFMA2 against fp16
//         x pairs, fp32 accumulation a 32-weight chunk
//   MMVQ  llama.cpp's mul_mat_vec_q for one column, as its kernel is shaped: 4 warps a block, one row a
//         block, GGUF's 18-byte Q4_0 blocks read as 2-byte halves, x in global memory as 8-bit blocks
// Weight layouts (FMT, the monokernel's CFG_QW codes): the monokernel's upload (workers/cuda/weights.py,
// common.cuh): Q8_0 / Q4_0 quants at byte e * bits / 8 of element e (a Q4_0 block's 16 bytes: byte j = element
// j low nibble, element j + 16 high), fp16 scales apart at block e / 32; Q4_K kquant.cuh's (Q4_0-ordered
// nibbles, a 20-byte record a super-block: fp16 d | fp16 dmin << 16, then a u16 a chunk: scale | min << 8).

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;

constexpr int F_BF16 = 0, F_Q8 = 1, F_Q4 = 2, F_QK = 4;                  // weight formats
constexpr int MONO = 0, DP4A = 1, HALF2 = 2;   // forms of rows_body (MMVQ: mmvq_body)
__host__ __device__ constexpr int cmin(int a, int b) { return a < b ? a : b; }
__host__ __device__ constexpr int cmax(int a, int b) { return a > b ? a : b; }

// ---- the monokernel's helpers (common.cuh) ----------------------------------------------------------------
__device__ __forceinline__ float h2f(u16 x) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x));
  return f;
}
__device__ __forceinline__ float hbits2f(u32 bits16) { return h2f((u16)bits16); }
__device__ __forceinline__ u16 f2h(float f) {
  u16 r;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(f));
  return r;
}
__device__ __forceinline__ float qbyte(u32 v, int k, float magic) {
  return __int_as_float(__byte_perm(v, 0x4B00u, 0x5440u + (u32)k)) - magic;
}
__device__ __forceinline__ float qhalf(u32 t, int k) { return __int_as_float(__byte_perm(t, 0x3F00u, 0x5044u + ((u32)k << 8))); }
__device__ __forceinline__ uint4 ldw(const void* p) {
  uint4 r;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
      : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
  return r;
}
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
__device__ __forceinline__ int warp_isum(int v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ void brange(int U, int& a, int& b) {
  a = (int)((long long)blockIdx.x * U / gridDim.x);
  b = (int)((long long)(blockIdx.x + 1) * U / gridDim.x);
}
__device__ __forceinline__ int next_unit(int ua, int* q) {
  int k = 0;
  if ((threadIdx.x & 31) == 0) k = atomicAdd(q, 1);
  return ua + __shfl_sync(0xffffffffu, k, 0);
}
template <int N>   // a[k] with k a lane's runtime index (unrolled: no local copy of a)
__device__ __forceinline__ float pick(const float (&a)[N], int k) {
  float v = a[0];
#pragma unroll
  for (int r = 1; r < N; ++r)
    if (k == r) v = a[r];
  return v;
}
// the other instructions, as PTX (no cuda_fp16.h under NVRTC)
__device__ __forceinline__ int dp4a(u32 a, u32 b, int c) {
  int d;
  asm("dp4a.s32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}
__device__ __forceinline__ u32 lop_and_or(u32 a, u32 b, u32 c) {   // (a & b) | c
  u32 d;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}
__device__ __forceinline__ u32 hfma2(u32 a, u32 b, u32 c) {
  u32 d;
  asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}
__device__ __forceinline__ u32 hsub2(u32 a, u32 b) {
  u32 d;
  asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}
__device__ __forceinline__ u32 hadd2(u32 a, u32 b) {
  u32 d;
  asm("add.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}
__device__ __forceinline__ float h2sum(u32 v) {   // lo + hi of a half2, in fp32
  float a, b;
  asm("{.reg .b16 l, h;\n mov.b32 {l, h}, %2;\n cvt.f32.f16 %0, l;\n cvt.f32.f16 %1, h;\n}" : "=f"(a), "=f"(b) : "r"(v));
  return a + b;
}

// ---- staging x into shared memory ------------------------------------------------------------------------
// fp32 planes of CW-weight chunks (mk_helpers.cuh xpc): float4 s of chunk c at (s K / CW + c) * 4
template <int CW>
__device__ __forceinline__ int xpc(int d, int K) {
  return CW == 4 ? d : ((d % CW) >> 2) * (K / CW) * 4 + (d / CW) * 4 + (d & 3);
}
template <int CW, int K, int NT>
__device__ __forceinline__ void stage_f32(const float* __restrict__ x, float* xs) {
  constexpr int N4 = K / 4, NPT = (N4 + NT - 1) / NT;
  float4 v[NPT];   // all loads first: one round trip, not NPT
#pragma unroll
  for (int i = 0; i < NPT; ++i) {
    const int k = threadIdx.x + i * NT;
    if (k < N4) v[i] = __ldg(reinterpret_cast<const float4*>(x) + k);
  }
#pragma unroll
  for (int i = 0; i < NPT; ++i) {
    const int k = threadIdx.x + i * NT;
    if (k < N4) *reinterpret_cast<float4*>(xs + xpc<CW>(4 * k, K)) = v[i];
  }
}
// x[32 b + lane] of one 32-block -> its 8-bit quant (returned), d = max |x| / 127 and the block's quant sum
__device__ __forceinline__ int quant32(float v, float& d, int& s) {
  const float amax = warp_max(fabsf(v));
  d = amax / 127.f;
  const int q = amax > 0.f ? __float2int_rn(v / d) : 0;
  s = warp_isum(q);
  return q;
}
// DP4A: bytes [0, K): the quants, planar for Q4 chunks (16-byte piece p of chunk c at (p K / 32 + c) * 16),
// in element order for Q8 (a 16-byte chunk's piece c at c * 16); then int2 {d bits, sum} a 32-block
template <int FMT, int K, int NT>
__device__ __forceinline__ void stage_q8(const float* __restrict__ x, u8* xs) {
  constexpr int NB32 = K / 32, NW = NT / 32, NBW = (NB32 + NW - 1) / NW;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  float v[NBW];
#pragma unroll
  for (int i = 0; i < NBW; ++i) {
    const int b = warp + i * NW;
    v[i] = b < NB32 ? __ldg(x + 32 * b + lane) : 0.f;
  }
  int2* xd = reinterpret_cast<int2*>(xs + K);
#pragma unroll
  for (int i = 0; i < NBW; ++i) {
    const int b = warp + i * NW;
    if (b < NB32) {
      float d;
      int s;
      const int q = quant32(v[i], d, s);
      const int a = FMT == F_Q8 ? 32 * b + lane : ((lane >> 4) * NB32 + b) * 16 + (lane & 15);
      xs[a] = (u8)(signed char)q;
      if (lane == 0) xd[b] = make_int2(__float_as_int(d), s);
    }
  }
}
// HALF2: 16-byte piece w (word w of a chunk's quants) of chunk c at (w K / 32 + c) * 16: the fp16 pairs
// (x[4w], x[4w+2]), (x[4w+1], x[4w+3]), (x[16+4w], x[16+4w+2]), (x[16+4w+1], x[16+4w+3]) of the chunk, the
// order lop3 leaves a word's nibbles in; Q4_K: then a float a chunk, the sum of its x (fp32)
__device__ __forceinline__ u32 pack_h2(float lo, float hi) { return (u32)f2h(lo) | ((u32)f2h(hi) << 16); }
template <int FMT, int K, int NT>
__device__ __forceinline__ void stage_h2(const float* __restrict__ x, u8* xs) {
  constexpr int NC = K / 32, NP = 4 * NC, NPT = (NP + NT - 1) / NT;
  const float4* x4 = reinterpret_cast<const float4*>(x);
  float4 a[NPT], b[NPT];
#pragma unroll
  for (int i = 0; i < NPT; ++i) {
    const int p = threadIdx.x + i * NT, w = p / NC, c = p % NC;
    if (p < NP) {
      a[i] = __ldg(x4 + 8 * c + w);
      b[i] = __ldg(x4 + 8 * c + 4 + w);
    }
  }
#pragma unroll
  for (int i = 0; i < NPT; ++i) {
    const int p = threadIdx.x + i * NT;
    if (p < NP)
      reinterpret_cast<uint4*>(xs)[p] = make_uint4(pack_h2(a[i].x, a[i].z), pack_h2(a[i].y, a[i].w),
                                                   pack_h2(b[i].x, b[i].z), pack_h2(b[i].y, b[i].w));
  }
  if constexpr (FMT == F_QK) {
    float* sx = reinterpret_cast<float*>(xs + 2 * K);
    for (int c = threadIdx.x; c < NC; c += NT) {
      float s = 0.f;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const float4 t = __ldg(x4 + 8 * c + j);
        s += (t.x + t.y) + (t.z + t.w);
      }
      sx[c] = s;
    }
  }
}

// ---- MONO: the monokernel's row loops (a chunk a lane: qlpc() is 1 for every K of the bench) ---------------
// bf16 rows (warp_dot / dotx, XPL planes: x[8c .. 8c+3] at 4c, x[8c+4 .. 8c+7] at K/2 + 4c)
template <int NR, int K, int UBM>
__device__ __forceinline__ void mono_bf16(const u16* __restrict__ w, const float* xs, float* out) {
  constexpr int NCHK = K / 8, CPL = (NCHK + 31) / 32, UB0 = UBM / NR;
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
        wv[r][u] = (b0 + u < CPL && c < NCHK) ? ldw(w + (long long)r * K + (long long)c * 8) : make_uint4(0u, 0u, 0u, 0u);
      }
#pragma unroll
    for (int r = 0; r < NR; ++r)
#pragma unroll
      for (int u = 0; u < UB; ++u) {
        const int c = (b0 + u) * 32 + lane;
        if (b0 + u < CPL && c < NCHK) {
          const uint4 v = wv[r][u];
          const float4 a = *reinterpret_cast<const float4*>(xs + c * 4);
          const float4 b = *reinterpret_cast<const float4*>(xs + (K >> 1) + c * 4);
          float s = 0.f;
          s = fmaf(__uint_as_float(v.x << 16), a.x, s); s = fmaf(__uint_as_float(v.x & 0xffff0000u), a.y, s);
          s = fmaf(__uint_as_float(v.y << 16), a.z, s); s = fmaf(__uint_as_float(v.y & 0xffff0000u), a.w, s);
          s = fmaf(__uint_as_float(v.z << 16), b.x, s); s = fmaf(__uint_as_float(v.z & 0xffff0000u), b.y, s);
          s = fmaf(__uint_as_float(v.w << 16), b.z, s); s = fmaf(__uint_as_float(v.w & 0xffff0000u), b.w, s);
          acc[r] += s;
        }
      }
  }
#pragma unroll
  for (int r = 0; r < NR; ++r) out[r] = warp_sum(acc[r]);
}
// chunk_xsum (QOFS): the sum of the inputs of quantized chunk c (planes of 32)
template <int K>
__device__ __forceinline__ float chunk_xsum(const float* xs, int c) {
  constexpr int NC = K / 32;
  float s[4];
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const float4 a = *reinterpret_cast<const float4*>(xs + (q * NC + c) * 4);
    const float4 b = *reinterpret_cast<const float4*>(xs + ((4 + q) * NC + c) * 4);
    s[q] = ((a.x + a.y) + (a.z + a.w)) + ((b.x + b.y) + (b.z + b.w));
  }
  return (s[0] + s[1]) + (s[2] + s[3]);
}
// dotq_w (QW 1: Q8_0; QW 2: Q4_0 in the offset form), WPL 4
template <int QW, int K>
__device__ __forceinline__ float dotq_w(const u32* v, u32 sc, const float* xs, int c, float sxc) {
  constexpr int QCW = QW == 1 ? 16 : 32, NC = K / QCW;
  float t[4];
  if constexpr (QW == 1) {
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const float4 a = *reinterpret_cast<const float4*>(xs + (q * NC + c) * 4);
      const u32 u = v[q] ^ 0x80808080u;
      float s = fmaf(qbyte(u, 0, 8388736.f), a.x, 0.f);
      s = fmaf(qbyte(u, 1, 8388736.f), a.y, s);
      s = fmaf(qbyte(u, 2, 8388736.f), a.z, s); s = fmaf(qbyte(u, 3, 8388736.f), a.w, s);
      t[q] = s;
    }
    return hbits2f(sc & 0xffffu) * ((t[0] + t[1]) + (t[2] + t[3]));
  } else {
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const u32 lo = (v[q] << 3) & 0x78787878u, hi = (v[q] >> 1) & 0x78787878u;
      const float4 a = *reinterpret_cast<const float4*>(xs + (q * NC + c) * 4);
      const float4 b = *reinterpret_cast<const float4*>(xs + ((4 + q) * NC + c) * 4);
      float s = fmaf(qhalf(lo, 0), a.x, 0.f);
      s = fmaf(qhalf(lo, 1), a.y, s);
      s = fmaf(qhalf(lo, 2), a.z, s); s = fmaf(qhalf(lo, 3), a.w, s);
      s = fmaf(qhalf(hi, 0), b.x, s); s = fmaf(qhalf(hi, 1), b.y, s);
      s = fmaf(qhalf(hi, 2), b.z, s); s = fmaf(qhalf(hi, 3), b.w, s);
      t[q] = s;
    }
    const float s = (t[0] + t[1]) + (t[2] + t[3]);
    return hbits2f(sc & 0xffffu) * fmaf(s, 32.f, -24.f * sxc);   // sum (q - 8) x = 32 S - 24 sx
  }
}
// warp_dotq: NR rows of K from element e (quants qb, u16 scales sb), UBM loads in flight a lane
template <int QW, int NR, int K, int UBM>
__device__ __forceinline__ void mono_dotq(const u8* __restrict__ qb, const u16* __restrict__ sb, long long e,
                                          const float* xs, float* out) {
  constexpr int QCW = QW == 1 ? 16 : 32, QBITS = QW == 1 ? 8 : 4, NSLOT = K / QCW, CPL = (NSLOT + 31) / 32;
  constexpr int UB0 = UBM / NR, UB = UB0 < 1 ? 1 : (UB0 > CPL ? CPL : UB0), CPB = 32 / QCW;
  const int lane = threadIdx.x & 31;
  float acc[NR];
#pragma unroll
  for (int r = 0; r < NR; ++r) acc[r] = 0.f;
#pragma unroll
  for (int b0 = 0; b0 < CPL; b0 += UB) {
    u32 wv[NR][UB][4];
    u32 sc[NR][UB];
#pragma unroll
    for (int r = 0; r < NR; ++r)
#pragma unroll
      for (int u = 0; u < UB; ++u) {
        const int c = (b0 + u) * 32 + lane;
        if (b0 + u < CPL && c < NSLOT) {
          const long long er = e + (long long)r * K;
          const uint4 x = ldw(qb + er * QBITS / 8 + (long long)c * 16);
          wv[r][u][0] = x.x; wv[r][u][1] = x.y; wv[r][u][2] = x.z; wv[r][u][3] = x.w;
          sc[r][u] = (u32)__ldg(sb + er / 32 + c / CPB);
        } else {
#pragma unroll
          for (int i = 0; i < 4; ++i) wv[r][u][i] = 0u;
          sc[r][u] = 0u;
        }
      }
#pragma unroll
    for (int u = 0; u < UB; ++u) {
      const int c = (b0 + u) * 32 + lane;
      if (b0 + u < CPL && c < NSLOT) {
        const float sxc = QW == 2 ? chunk_xsum<K>(xs, c) : 0.f;
#pragma unroll
        for (int r = 0; r < NR; ++r) acc[r] += dotq_w<QW, K>(wv[r][u], sc[r][u], xs, c, sxc);
      }
    }
  }
#pragma unroll
  for (int r = 0; r < NR; ++r) out[r] = warp_sum(acc[r]);
}
// warp_dotk for Q4_K (kq_word / kq_coef of kquant.cuh at T = KT_Q4K): nibbles qb, 20-byte records rb
template <int NR, int K, int UBM>
__device__ __forceinline__ void mono_dotk(const u8* __restrict__ qb, const u8* __restrict__ rb, long long e,
                                          const float* xs, float* out) {
  constexpr int NC = K / 32, CPL = (NC + 31) / 32, UB0 = UBM / NR;
  constexpr int UB = UB0 < 1 ? 1 : (UB0 > CPL ? CPL : UB0);
  constexpr float G = 32.f, G2 = 16.f;
  const int lane = threadIdx.x & 31;
  float acc[NR];
#pragma unroll
  for (int r = 0; r < NR; ++r) acc[r] = 0.f;
#pragma unroll
  for (int b0 = 0; b0 < CPL; b0 += UB) {
    u32 wv[NR][UB][4], w0[NR][UB], sb[NR][UB];
#pragma unroll
    for (int r = 0; r < NR; ++r)
#pragma unroll
      for (int u = 0; u < UB; ++u) {
        const int c = (b0 + u) * 32 + lane;
        if (b0 + u < CPL && c < NC) {
          const long long ch = (e + (long long)r * K) / 32 + c;
          const uint4 x = ldw(qb + ch * 16);
          wv[r][u][0] = x.x; wv[r][u][1] = x.y; wv[r][u][2] = x.z; wv[r][u][3] = x.w;
          const u8* rec = rb + (ch >> 3) * 20;
          w0[r][u] = __ldg(reinterpret_cast<const u32*>(rec));
          sb[r][u] = (u32)__ldg(reinterpret_cast<const u16*>(rec + 4) + (ch & 7));
        } else {
#pragma unroll
          for (int i = 0; i < 4; ++i) wv[r][u][i] = 0u;
          w0[r][u] = sb[r][u] = 0u;
        }
      }
#pragma unroll
    for (int u = 0; u < UB; ++u) {
      const int c = (b0 + u) * 32 + lane;
      if (b0 + u < CPL && c < NC) {
        float xlo = 0.f, xhi = 0.f;
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          const float4 a = *reinterpret_cast<const float4*>(xs + (q * NC + c) * 4);
          const float4 b = *reinterpret_cast<const float4*>(xs + ((4 + q) * NC + c) * 4);
          xlo += (a.x + a.y) + (a.z + a.w);
          xhi += (b.x + b.y) + (b.z + b.w);
        }
#pragma unroll
        for (int r = 0; r < NR; ++r) {
          float slo = 0.f, shi = 0.f;
#pragma unroll
          for (int q = 0; q < 4; ++q) {
            const u32 v = wv[r][u][q], lo = (v << 3) & 0x78787878u, hi = (v >> 1) & 0x78787878u;
            const float4 a = *reinterpret_cast<const float4*>(xs + (q * NC + c) * 4);
            const float4 b = *reinterpret_cast<const float4*>(xs + ((4 + q) * NC + c) * 4);
            float s = fmaf(qhalf(lo, 0), a.x, 0.f);
            s = fmaf(qhalf(lo, 1), a.y, s); s = fmaf(qhalf(lo, 2), a.z, s); s = fmaf(qhalf(lo, 3), a.w, s);
            float t = fmaf(qhalf(hi, 0), b.x, 0.f);
            t = fmaf(qhalf(hi, 1), b.y, t); t = fmaf(qhalf(hi, 2), b.z, t); t = fmaf(qhalf(hi, 3), b.w, t);
            slo += s;
            shi += t;
          }
          const float al = h2f((u16)(w0[r][u] & 0xffffu)) * (float)(sb[r][u] & 0x3fu);
          const float bl = fmaf(-G2, al, -h2f((u16)(w0[r][u] >> 16)) * (float)((sb[r][u] >> 8) & 0x3fu));
          acc[r] += fmaf(al, G * (slo + shi), bl * (xlo + xhi));
        }
      }
    }
  }
#pragma unroll
  for (int r = 0; r < NR; ++r) out[r] = warp_sum(acc[r]);
}

// ---- DP4A / HALF2: one loop, a chunk's weights and x per format and form -----------------------------------
struct WC {   // one chunk as loaded: 16 bytes of quants, the scale word(s)
  uint4 q;
  u32 s0, s1;
};
struct XC {   // one chunk's x as a lane reads it from shared memory (the form's fields only)
  uint4 p[4];
  int2 ds;
  float sx;
};
template <int FMT, int K>
__device__ __forceinline__ WC load_chunk(const u8* __restrict__ qb, const u8* __restrict__ sb, long long row, int c) {
  WC w;
  if constexpr (FMT == F_Q8) {   // 16 int8 (half a block), its block's fp16 d
    w.q = ldw(qb + row * K + (long long)c * 16);
    w.s0 = (u32)__ldg(reinterpret_cast<const u16*>(sb) + row * (K / 32) + (c >> 1));
    w.s1 = 0u;
  } else if constexpr (FMT == F_Q4) {   // one block's 16 bytes, its fp16 d
    w.q = ldw(qb + row * (K / 2) + (long long)c * 16);
    w.s0 = (u32)__ldg(reinterpret_cast<const u16*>(sb) + row * (K / 32) + c);
    w.s1 = 0u;
  } else {   // Q4_K: chunk ch's nibbles, its super-block's d | dmin and its u16 (through L1: 8 lanes a record)
    const long long ch = row * (K / 32) + c;
    w.q = ldw(qb + ch * 16);
    const u8* rec = sb + (ch >> 3) * 20;
    w.s0 = __ldg(reinterpret_cast<const u32*>(rec));
    w.s1 = (u32)__ldg(reinterpret_cast<const u16*>(rec + 4) + (ch & 7));
  }
  return w;
}
template <int FORM, int FMT, int K>
__device__ __forceinline__ void load_x(const u8* xs, int c, XC& x) {
  if constexpr (FORM == DP4A) {
    const uint4* q = reinterpret_cast<const uint4*>(xs);
    const int2* xd = reinterpret_cast<const int2*>(xs + K);
    if constexpr (FMT == F_Q8) {
      x.p[0] = q[c];
      x.ds = xd[c >> 1];
    } else {
      x.p[0] = q[c];
      x.p[1] = q[K / 32 + c];
      x.ds = xd[c];
    }
  } else {
    const uint4* h = reinterpret_cast<const uint4*>(xs);
#pragma unroll
    for (int w = 0; w < 4; ++w) x.p[w] = h[w * (K / 32) + c];
    if constexpr (FMT == F_QK) x.sx = reinterpret_cast<const float*>(xs + 2 * K)[c];
  }
}
__device__ __forceinline__ u32 word(const uint4& v, int i) { return i == 0 ? v.x : (i == 1 ? v.y : (i == 2 ? v.z : v.w)); }
// Q4_K's coefficients of chunk (w0, sub): y = A q - B
__device__ __forceinline__ void qk_coef(u32 w0, u32 sub, float& A, float& B) {
  A = h2f((u16)(w0 & 0xffffu)) * (float)(sub & 0x3fu);
  B = h2f((u16)(w0 >> 16)) * (float)((sub >> 8) & 0x3fu);
}
template <int FORM, int FMT>
__device__ __forceinline__ float chunk_dot(const WC& w, const XC& x, float acc) {
  if constexpr (FORM == DP4A) {
    const float dx = __int_as_float(x.ds.x);
    if constexpr (FMT == F_Q8) {
      int si = 0;
#pragma unroll
      for (int i = 0; i < 4; ++i) si = dp4a(word(w.q, i), word(x.p[0], i), si);
      return fmaf(hbits2f(w.s0) * dx, (float)si, acc);
    } else {
      int si = FMT == F_Q4 ? -8 * x.ds.y : 0;   // Q4_0's -8 offset: -8 times the sum of x's quants
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const u32 v = word(w.q, i);
        si = dp4a(v & 0x0F0F0F0Fu, word(x.p[0], i), si);          // elements 4i .. 4i+3
        si = dp4a((v >> 4) & 0x0F0F0F0Fu, word(x.p[1], i), si);   // elements 16+4i ..
      }
      if constexpr (FMT == F_Q4) return fmaf(hbits2f(w.s0) * dx, (float)si, acc);
      float A, B;
      qk_coef(w.s0, w.s1, A, B);
      return fmaf(dx, fmaf(A, (float)si, -B * (float)x.ds.y), acc);
    }
  } else {   // HALF2: (1024 + q) from lop3; Q4_0 q - 8 = lo - 1032, (1024 + 16 q) / 16 - 72; Q4_K q = lo - 1024, hi / 16 - 64
    constexpr u32 MASK_LO = 0x000F000Fu, MASK_HI = 0x00F000F0u, EX = 0x64006400u, SIXTEENTH = 0x2C002C00u;
    constexpr u32 SUB_LO = FMT == F_Q4 ? 0x64086408u : 0x64006400u, ADD_HI = FMT == F_Q4 ? 0xD480D480u : 0xD400D400u;
    u32 h[2] = {0u, 0u};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const u32 v = word(w.q, i), v8 = v >> 8;
      const u32 l0 = hsub2(lop_and_or(v, MASK_LO, EX), SUB_LO), l1 = hsub2(lop_and_or(v8, MASK_LO, EX), SUB_LO);
      const u32 g0 = hfma2(lop_and_or(v, MASK_HI, EX), SIXTEENTH, ADD_HI);
      const u32 g1 = hfma2(lop_and_or(v8, MASK_HI, EX), SIXTEENTH, ADD_HI);
      u32 a = h[i & 1];
      a = hfma2(l0, x.p[i].x, a);
      a = hfma2(l1, x.p[i].y, a);
      a = hfma2(g0, x.p[i].z, a);
      a = hfma2(g1, x.p[i].w, a);
      h[i & 1] = a;
    }
    const float s = h2sum(hadd2(h[0], h[1]));
    if constexpr (FMT == F_Q4) return fmaf(hbits2f(w.s0), s, acc);
    float A, B;
    qk_coef(w.s0, w.s1, A, B);
    return fmaf(A, s, fmaf(-B, x.sx, acc));
  }
}
// a batch: UBR chunks (b UBR .. + UBR - 1 of each row's CPL a lane) of the NR rows of unit u
template <int FMT, int NR, int K, int UBR>
__device__ __forceinline__ void load_batch(const u8* __restrict__ qb, const u8* __restrict__ sb, int u, int b,
                                           WC (&w)[NR][UBR]) {
  constexpr int NC = K / (FMT == F_Q8 ? 16 : 32), CPL = (NC + 31) / 32;
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int r = 0; r < NR; ++r)
#pragma unroll
    for (int j = 0; j < UBR; ++j) {
      const int cc = b * UBR + j;
      if (CPL % UBR == 0 || cc < CPL) w[r][j] = load_chunk<FMT, K>(qb, sb, (long long)u * NR + r, cc * 32 + lane);
    }
}
// x read once a chunk for the NR rows
template <int FORM, int FMT, int NR, int K, int UBR>
__device__ __forceinline__ void dot_batch(const WC (&w)[NR][UBR], int b, const u8* xs, float (&acc)[NR]) {
  constexpr int NC = K / (FMT == F_Q8 ? 16 : 32), CPL = (NC + 31) / 32;
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int j = 0; j < UBR; ++j) {
    const int cc = b * UBR + j;
    if (CPL % UBR == 0 || cc < CPL) {
      XC xv;
      load_x<FORM, FMT, K>(xs, cc * 32 + lane, xv);
#pragma unroll
      for (int r = 0; r < NR; ++r) acc[r] = chunk_dot<FORM, FMT>(w[r][j], xv, acc[r]);
    }
  }
}
// The rows of the block's units, a batch a step (a runtime loop: its registers do not grow with K): UB
// 16-byte loads a lane a batch over the unit's NR rows (UB / NR a row, at most the CPL chunks a lane of a row).
// PIPE: a step loads the next step's batch (this unit's next, or the next unit's first) before its arithmetic,
// into the other of two buffers, so a warp always has a batch in flight (twice the registers).
template <int FORM, int FMT, int NR, int K, int UB, bool PIPE>
__device__ __forceinline__ void stream_rows(const u8* __restrict__ qb, const u8* __restrict__ sb, const u8* xs,
                                            float* __restrict__ y, int M, int* uq) {
  constexpr int NC = K / (FMT == F_Q8 ? 16 : 32), CPL = (NC + 31) / 32;
  constexpr int UBR = cmax(1, cmin(UB / NR, CPL)), NBAT = (CPL + UBR - 1) / UBR;
  static_assert(NC % 32 == 0, "the bench's K: whole chunks for every lane");
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int ua, ub;
  brange(M / NR, ua, ub);
  int u = ua + warp;
  if (u >= ub) return;
  float acc[NR];
#pragma unroll
  for (int r = 0; r < NR; ++r) acc[r] = 0.f;
  auto finish = [&]() {
#pragma unroll
    for (int r = 0; r < NR; ++r) acc[r] = warp_sum(acc[r]);
    if (lane < NR) y[(long long)u * NR + lane] = pick(acc, lane);
#pragma unroll
    for (int r = 0; r < NR; ++r) acc[r] = 0.f;
  };
  WC w0[NR][UBR];
  if constexpr (!PIPE) {
#pragma unroll 1
    while (true) {
#pragma unroll 1
      for (int b = 0; b < NBAT; ++b) {
        load_batch<FMT, NR, K, UBR>(qb, sb, u, b, w0);
        dot_batch<FORM, FMT, NR, K, UBR>(w0, b, xs, acc);
      }
      finish();
      u = next_unit(ua, uq);
      if (u >= ub) break;
    }
  } else {
    WC w1[NR][UBR];
    int b = 0, un = next_unit(ua, uq);
    load_batch<FMT, NR, K, UBR>(qb, sb, u, 0, w0);
    auto step = [&](const WC (&cur)[NR][UBR], WC (&nxt)[NR][UBR]) -> bool {   // true: the warp's last step
      const bool last = b + 1 == NBAT;
      const int u1 = last ? un : u, b1 = last ? 0 : b + 1;
      if (u1 < ub) load_batch<FMT, NR, K, UBR>(qb, sb, u1, b1, nxt);
      dot_batch<FORM, FMT, NR, K, UBR>(cur, b, xs, acc);
      if (last) {
        finish();
        if (u1 >= ub) return true;
        un = next_unit(ua, uq);
      }
      u = u1;
      b = b1;
      return false;
    };
#pragma unroll 1
    while (true) {
      if (step(w0, w1)) break;
      if (step(w1, w0)) break;
    }
  }
}

// ---- the kernels' bodies (q4_rows.wrappers instantiates them) --------------------------------------------
// q, s: the format's arrays (bf16 rows / quants / nibbles; scales / records); x: fp32 [K]; y: [M]
template <int FORM, int FMT, int NR, int K, int UB, int NT, bool PIPE>
__device__ __forceinline__ void rows_body(const u8* __restrict__ q, const u8* __restrict__ s,
                                          const float* __restrict__ x, float* __restrict__ y, int M) {
  extern __shared__ __align__(16) u8 smem[];
  __shared__ int uq;
  if (threadIdx.x == 0) uq = NT / 32;
  if constexpr (FORM == MONO) stage_f32<FMT == F_BF16 ? 8 : (FMT == F_Q8 ? 16 : 32), K, NT>(x, reinterpret_cast<float*>(smem));
  else if constexpr (FORM == DP4A) stage_q8<FMT, K, NT>(x, smem);
  else stage_h2<FMT, K, NT>(x, smem);
  __syncthreads();
  if constexpr (FORM == MONO) {
    const float* xs = reinterpret_cast<const float*>(smem);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int ua, ub;
    brange(M / NR, ua, ub);
    for (int u = ua + warp; u < ub; u = next_unit(ua, &uq)) {
      float acc[NR];
      const long long e = (long long)u * NR * K;
      if constexpr (FMT == F_BF16) mono_bf16<NR, K, UB>(reinterpret_cast<const u16*>(q) + e, xs, acc);
      else if constexpr (FMT == F_QK) mono_dotk<NR, K, UB>(q, s, e, xs, acc);
      else mono_dotq<FMT, NR, K, UB>(q, reinterpret_cast<const u16*>(s), e, xs, acc);
      if (lane < NR) y[(long long)u * NR + lane] = pick(acc, lane);
    }
  } else {
    stream_rows<FORM, FMT, NR, K, UB, PIPE>(q, s, smem, y, M, &uq);
  }
}

// MMVQ: llama.cpp's mul_mat_vec_q at one column (calc_nwarps 4, calc_rows_per_block 1, vdr 2, qi 4): a block of
// 128 threads a row, thread t on block t / 2 of every 64, ints 2 (t % 2) .. + 1 of its quants (2-byte loads:
// an 18-byte block is 2-byte aligned), the x block's ints from global memory (L1); then the block's sum.
// w: GGUF's Q4_0 blocks (fp16 d, 16 bytes); xq: 40-byte blocks (fp32 d, int sum, 32 int8: q8_global's).
template <int K>
__device__ __forceinline__ void mmvq_body(const u8* __restrict__ w, const u8* __restrict__ xq, float* __restrict__ y) {
  constexpr int NB32 = K / 32, QI = 4, VDR = 2, BPI = VDR * 128 / QI;
  const int tid = threadIdx.x, row = blockIdx.x;
  float tmp = 0.f;
  for (int kb = tid / (QI / VDR); kb < NB32; kb += BPI) {
    const int kqs = VDR * (tid % (QI / VDR));
    const u8* b = w + ((long long)row * NB32 + kb) * 18;
    const u16* q16 = reinterpret_cast<const u16*>(b + 2);
    const u8* xb = xq + kb * 40;
    const int* xi = reinterpret_cast<const int*>(xb + 8);
    int si = 0;
#pragma unroll
    for (int i = 0; i < VDR; ++i) {
      const u32 v = (u32)__ldg(q16 + 2 * (kqs + i)) | ((u32)__ldg(q16 + 2 * (kqs + i) + 1) << 16);
      si = dp4a(v & 0x0F0F0F0Fu, (u32)__ldg(xi + kqs + i), si);
      si = dp4a((v >> 4) & 0x0F0F0F0Fu, (u32)__ldg(xi + kqs + i + QI), si);
    }
    const float dx = __ldg(reinterpret_cast<const float*>(xb));
    const int sq = __ldg(reinterpret_cast<const int*>(xb + 4));
    tmp = fmaf(h2f(__ldg(reinterpret_cast<const u16*>(b))) * dx, (float)(si - (8 * VDR / QI) * sq), tmp);
  }
  __shared__ float part[3][32];
  const int warp = tid >> 5, lane = tid & 31;
  if (warp > 0) part[warp - 1][lane] = tmp;
  __syncthreads();
  if (warp > 0) return;
  tmp += (part[0][lane] + part[1][lane]) + part[2][lane];
  tmp = warp_sum(tmp);
  if (lane == 0) y[row] = tmp;
}

// ---- plain kernels ----------------------------------------------------------------------------------------
// x [K] -> 40-byte blocks for MMVQ (the same quantization as stage_q8); one warp a block
extern "C" __global__ void q8_global(const float* __restrict__ x, u8* __restrict__ out, int nb32) {
  const int b = (int)((blockIdx.x * blockDim.x + threadIdx.x) >> 5), lane = threadIdx.x & 31;
  if (b >= nb32) return;
  float d;
  int s;
  const int q = quant32(x[32 * b + lane], d, s);
  out[(long long)b * 40 + 8 + lane] = (u8)(signed char)q;
  if (lane == 0) {
    *reinterpret_cast<float*>(out + (long long)b * 40) = d;
    *reinterpret_cast<int*>(out + (long long)b * 40 + 4) = s;
  }
}
// n words of splitmix-like hash bits (and mask): the timing matrices' contents
extern "C" __global__ void fill_words(u32* __restrict__ p, long long n, u32 seed, u32 mask) {
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
    unsigned long long z = (unsigned long long)i * 0x9E3779B97F4A7C15ull + seed;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    p[i] = (u32)(z ^ (z >> 31)) & mask;
  }
}
// one thread waiting ns nanoseconds (%globaltimer): keeps the GPU busy while the host enqueues a timed launch
extern "C" __global__ void spin(long long ns) {
  if (threadIdx.x != 0) return;
  unsigned long long t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  } while ((long long)(t - t0) < ns);
}
// the read bandwidth: every 16 bytes of [p, p + n16) once, 8 loads in flight a thread
extern "C" __global__ void __launch_bounds__(512) read_stream(const uint4* __restrict__ p, long long n16, u32* out) {
  u32 acc = 0u;
  const long long stride = (long long)gridDim.x * blockDim.x;
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n16; i += 8 * stride) {
    uint4 v[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) v[k] = i + k * stride < n16 ? ldw(p + i + k * stride) : make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
    for (int k = 0; k < 8; ++k) acc ^= v[k].x ^ v[k].y ^ v[k].z ^ v[k].w;
  }
  if (acc == 0x9E3779B9u) out[0] = acc;   // never in practice: keeps the loads
}
