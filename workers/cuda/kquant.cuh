// kquant.cuh: the GGUF K-quants (Q4_K, Q5_K, Q6_K) as the kernels keep them (CFG_QW 4), shared by the
// monokernel's row loops (mk_kquant.cuh) and the prefill's dequantizer (prefill.cu). Included after
// common.cuh. The host writes this layout from the file's super-blocks (workers/cuda/kquant.py, a lossless
// re-layout checked bit for bit against gguf.quants on the CPU):
//   p.w   4 bits a weight, the low nibble of every K type, in 32-weight chunks of Q4_0's order: byte j of a
//         chunk holds element j (low nibble) and element j + 16 (high), so a 16-byte load is one chunk
//   p.wh  8 bytes a chunk at e / 32 * 8 (allocated where Q5_K or Q6_K is present): the high bits
//         Q5_K: word 0, byte k: bit q = element 4q + k's 5th bit, bit 4 + q = element 16 + 4q + k's
//         Q6_K: word a, byte k: bits [0,2) element 4(2a) + k's two high bits, [2,4) element 16 + 4(2a) + k's,
//               [4,6) element 4(2a+1) + k's, [6,8) element 16 + 4(2a+1) + k's
//   p.ws  a 20-byte record a super-block (256 weights) at e / 256 * 20: u32 word (Q4_K / Q5_K: fp16 d |
//         fp16 dmin << 16; Q6_K: fp16 d), then u16 a chunk j (Q4_K / Q5_K: 6-bit scale | 6-bit min << 8;
//         Q6_K: its two int8 scales, elements 0-15 low byte, 16-31 high byte)
//   p.kt  a u32 a layer: 4 bits a matrix (KT_*): q, k, v, o, gate and up (one type), down
// A weight's byte under the exponent of 0.5 (qhalf) is 0.5 + b / 256; with b = q << KSH (3, 2, 1 for 4, 5, 6
// bits) a chunk half's sum of q x is G S - G / 2 sx (G = 32, 64, 128; S the sum of those floats times x).
#pragma once

constexpr int KT_Q4K = 0, KT_Q5K = 1, KT_Q6K = 2;
constexpr int KREC = 20;   // bytes of a super-block's record in p.ws
#ifndef CFG_KT_MASK
#define CFG_KT_MASK 1      // the K types a build computes (bit KT_*): its dispatch holds only these
#endif
constexpr int KT_MASK = CFG_KT_MASK;

// word q's bytes of the low (elements 4q..) and high (16 + 4q..) halves of a chunk, as q << KSH
template <int T>
__device__ __forceinline__ void kq_word(u32 v, u32 h, int q, u32& lo, u32& hi) {
  if constexpr (T == KT_Q4K) {
    lo = (v << 3) & 0x78787878u;
    hi = (v >> 1) & 0x78787878u;
  } else if constexpr (T == KT_Q5K) {
    lo = ((v << 2) & 0x3C3C3C3Cu) | (((h >> q) << 6) & 0x40404040u);
    hi = ((v >> 2) & 0x3C3C3C3Cu) | (((h >> (q + 4)) << 6) & 0x40404040u);
  } else {
    const int s = (q & 1) * 4;   // h: word q / 2 of the chunk's high bits
    lo = ((v << 1) & 0x1E1E1E1Eu) | (((h >> s) << 5) & 0x60606060u);
    hi = ((v >> 3) & 0x1E1E1E1Eu) | (((h >> (s + 2)) << 5) & 0x60606060u);
  }
}
template <int T>
__host__ __device__ constexpr float kq_g() { return T == KT_Q4K ? 32.f : (T == KT_Q5K ? 64.f : 128.f); }

// a chunk's coefficients: dot = alo (G S_lo) + blo sx_lo + ahi (G S_hi) + bhi sx_hi
// (Q4_K / Q5_K: y = d sc q - dmin m; Q6_K: y = d sc (q - 32), a scale each half)
template <int T>
__device__ __forceinline__ void kq_coef(u32 w0, u32 sub, float& alo, float& blo, float& ahi, float& bhi) {
  constexpr float G2 = kq_g<T>() * 0.5f;
  if constexpr (T == KT_Q6K) {
    const float d = h2f((u16)(w0 & 0xffffu));
    alo = d * (float)(signed char)(sub & 0xffu);
    ahi = d * (float)(signed char)(sub >> 8);
    blo = -(G2 + 32.f) * alo;
    bhi = -(G2 + 32.f) * ahi;
  } else {
    alo = ahi = h2f((u16)(w0 & 0xffffu)) * (float)(sub & 0x3fu);
    blo = bhi = fmaf(-G2, alo, -h2f((u16)(w0 >> 16)) * (float)((sub >> 8) & 0x3fu));
  }
}

// elements 8p..8p+7 (p = 0..3) of chunk c (global chunk index) as gguf.quants computes them: Q4_K / Q5_K
// (d sc) q - (dmin m), Q6_K (d sc) (q - 32), each product and difference rounded once (no fused
// multiply-add). A piece is one half of a chunk's 16 nibble bytes (p & 1: bytes 8 (p & 1) ..; p >> 1: the
// low nibbles, elements 0-15, or the high ones, 16-31) under one scale (hiq = p >> 1) and one high-bit word
// (Q6_K word p & 1; Q5_K word 0, bits wq + 4 hiq of byte k for element 4 wq + k of a half)
__device__ __forceinline__ void kq_piece(const unsigned char* nib, const unsigned char* hb, const unsigned char* rec,
                                         int t, long long c, int p, float* v) {
  const uint2 w = *reinterpret_cast<const uint2*>(nib + c * 16 + 8 * (p & 1));
  const unsigned char* r = rec + (c >> 3) * KREC;
  const u32 w0 = *reinterpret_cast<const u32*>(r);
  const u32 sub = *reinterpret_cast<const u16*>(r + 4 + 2 * (c & 7));
  const int hiq = p >> 1;
  u32 h = 0;
  if (t == KT_Q5K) h = *reinterpret_cast<const u32*>(hb + c * 8);
  else if (t == KT_Q6K) h = *reinterpret_cast<const u32*>(hb + c * 8 + 4 * (p & 1));
  const float d = h2f((u16)(w0 & 0xffffu));
  float ds, dm = 0.f;
  if (t == KT_Q6K) {
    ds = __fmul_rn(d, (float)(signed char)(hiq ? sub >> 8 : sub & 0xffu));
  } else {
    ds = __fmul_rn(d, (float)(sub & 0x3fu));
    dm = __fmul_rn(h2f((u16)(w0 >> 16)), (float)((sub >> 8) & 0x3fu));
  }
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    const u32 by = ((k < 4 ? w.x : w.y) >> (8 * (k & 3))) & 0xffu;
    int q = (int)(hiq ? by >> 4 : by & 15u);
    const int kb = k & 3, wq = 2 * (p & 1) + (k >> 2);   // element 4 wq + kb of the half
    if (t == KT_Q5K) q |= (int)((h >> (8 * kb + wq + 4 * hiq)) & 1u) << 4;
    else if (t == KT_Q6K) q |= (int)((h >> (8 * kb + 4 * (wq & 1) + 2 * hiq)) & 3u) << 4;
    v[k] = t == KT_Q6K ? __fmul_rn(ds, (float)(q - 32)) : __fsub_rn(__fmul_rn(ds, (float)q), dm);
  }
}
