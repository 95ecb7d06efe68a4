// mk_helpers.cuh: part of monokernel.cu (pasted in place after mk_multirank.cuh; not a standalone
// header). Input planes in shared memory (xp, dotx), unit ranges of a block (brange, lane_units),
// fused_step, wait_lanes, block_sum, warp_dot (the weight rows' dot products) and the layer phases'
// prologue (phase_begin).
#pragma once

// ---- helpers -----------------------------------------------------------------------------------
// An input vector x of K floats (K = D, HDL or FL) is kept in shared memory in planes of chunks: with CW
// weights a 16-byte chunk of a row, float4 s of chunk c (x[c CW + 4 s .. + 3]) sits at (s K / CW + c) * 4,
// so that the float4 loads of a warp's 32 consecutive chunks read consecutive addresses (no bank
// conflicts). bf16 / fp16 rows (CW = VEC = 8): x[8c .. 8c+3] at 4c, x[8c+4 .. 8c+7] at K/2 + 4c;
// fp32 (CW = 4): as is; quantized layer rows: CW = QCW (16 or 32). The LM head (in the storage type)
// reads its input in the storage type's planes (xpv) also when the layers are quantized.
constexpr bool XPL = VEC == 8;   // bf16 / fp16 in planes (one plane measured slower: docs/monokernel.md)
constexpr int XCW_W = XPL ? VEC : 4;            // planes of the storage type's rows
constexpr int XCW_L = QW ? QCW : XCW_W;         // planes of the layer matrices' inputs
template <int CW>
__device__ __forceinline__ int xpc(int d, int K) {
  return CW == 4 ? d : ((d % CW) >> 2) * (K / CW) * 4 + (d / CW) * 4 + (d & 3);
}
__device__ __forceinline__ int xp(int d, int K) { return xpc<XCW_L>(d, K); }
__device__ __forceinline__ int xpv(int d, int K) { return xpc<XCW_W>(d, K); }
// Staging an input of K floats four at a time: the thread-linear float4 index q -> {the element x of its
// first float (x % 4 == 0), the float4 slot of the planes (xp) that holds x .. x + 3}. Where a plane has a
// multiple of 8 chunks, a quarter warp takes 8 consecutive chunks of one plane (its 16-byte stores
// contiguous: no bank conflicts, where x = 4q puts the 8 planes of a chunk on the same banks when K / CW
// is a multiple of 8) and a warp's loads are still whole 32-byte sectors; otherwise x = 4q.
template <int K>
__device__ __forceinline__ int2 stage4(int q) {
  constexpr int CW = XCW_L, SP = CW / 4, NC = K / CW;
  if constexpr (CW > 4 && NC % 8 == 0) {
    const int a = q >> 3, s = a % SP, c = (a / SP) * 8 + (q & 7);
    return make_int2(c * CW + 4 * s, s * NC + c);
  } else {
    return make_int2(4 * q, xp(4 * q, K) >> 2);
  }
}
// dot of 16 bytes of storage (chunk c of a row of K) with x (shared, K floats, planes xpv)
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
// dot of one quantized chunk c of a row of K (16 bytes of quants w, its block's scale word sc) with x
// (planes xp): the integers' dot, then times d (plus m times the sum of x for Q4_1)
// at most this many 16-byte loads of quants in flight a lane (24 measured neutral: BENCHMARKS.md)
#ifndef CFG_QUB
#define CFG_QUB 8
#endif
constexpr int QUB = CFG_QUB;
// CFG_QOFS 1 (Q4_*): a nibble q becomes the float (16 + q) / 32 in one permute of (q << 3) under the exponent
// of 0.5, no subtraction: the chunk's dot is 32 S - 16 sx (sx: the sum of the chunk's x, once a chunk for
// all rows of a warp), 2 instructions a weight instead of 3 (permute, subtract, FMA). Its fp32 rounding
// is ~7x the exact values' (5e-7 of a chunk's dot, against 7e-8): far inside the numpy engine's ids.
#ifndef CFG_QOFS
#define CFG_QOFS 1
#endif
constexpr bool QOFS = CFG_QOFS && QW >= 2;
static_assert(!QOFS || QCW == 32, "the offset form reads Q4 chunks of 32 weights");
// A chunk split over lanes: where a row's chunks do not spread evenly over a warp's 32 lanes (SmolLM2's
// K = 576 has 18 Q4 chunks, 14 lanes idle; its K = 1536 48, half the lanes doing two), QLPC<K> lanes share
// each chunk, each taking 16 / QLPC bytes of it (WPL words), where that cuts the busiest lane's words by a
// fifth or more (K = 576: 4 lanes a chunk, 3 words the busiest lane instead of 4; K = 1536: 2, 6 words
// instead of 8). Its products are the same; only the order of the sums across lanes differs.
#ifndef CFG_QLPC
#define CFG_QLPC 4   // the most lanes a chunk (1: a chunk a lane)
#endif
template <int K>
__host__ __device__ constexpr int qlpc() {
  constexpr int NC = K / QCW;
  int best = 1, bw = (NC + 31) / 32 * 4;
  if (CFG_QLPC >= 2 && 5 * ((2 * NC + 31) / 32 * 2) <= 4 * bw) best = 2, bw = (2 * NC + 31) / 32 * 2;
  if (CFG_QLPC >= 4 && 5 * ((4 * NC + 31) / 32) <= 4 * bw) best = 4;
  return best;
}
// sums of t[0 .. WPL): the one-lane chunk's order (t0 + t1) + (t2 + t3) for four
template <int WPL>
__device__ __forceinline__ float sum_words(const float* t) {
  if constexpr (WPL == 4) return (t[0] + t[1]) + (t[2] + t[3]);
  else if constexpr (WPL == 2) return t[0] + t[1];
  else return t[0];
}
// the sum of the inputs of words [q0, q0 + WPL) of chunk c (planes xp), the offset form's correction (0
// where unused)
template <int K, int WPL = 4>
__device__ __forceinline__ float chunk_xsum(const float* xs, int c, int q0 = 0) {
  if constexpr (!QOFS) {
    return 0.f;
  } else {
    constexpr int NC = K / QCW;
    float s[WPL];
#pragma unroll
    for (int i = 0; i < WPL; ++i) {
      const int q = q0 + i;
      const float4 a = *reinterpret_cast<const float4*>(xs + (q * NC + c) * 4);
      const float4 b = *reinterpret_cast<const float4*>(xs + ((4 + q) * NC + c) * 4);
      s[i] = ((a.x + a.y) + (a.z + a.w)) + ((b.x + b.y) + (b.z + b.w));
    }
    return sum_words<WPL>(s);
  }
}
// words [q0, q0 + WPL) of quantized chunk c of a row of K (v: those words of its 16 bytes of quants; sc: its
// block's scale word) dotted with x (planes xp): the integers' dot, then times d (plus m times the sum of x
// for Q4_1); sxc: chunk_xsum of the same words. Every form is linear in the words: the lanes' parts add up.
template <int K, int WPL = 4>
__device__ __forceinline__ float dotq_w(const u32* v, u32 sc, const float* xs, int c, int q0, float sxc) {
  constexpr int NC = K / QCW;
  float t[WPL], sx = 0.f;   // one chain a word: 8 (Q4) or 4 (Q8) dependent FMAs instead of 32 or 16
  if (QW == 1) {   // Q8_0: 16 int8 (bytes + 128 as unsigned), float4 q = word q
#pragma unroll
    for (int i = 0; i < WPL; ++i) {
      const int q = q0 + i;
      const float4 a = *reinterpret_cast<const float4*>(xs + (q * NC + c) * 4);
      const u32 u = v[i] ^ 0x80808080u;
      float s = fmaf(qbyte(u, 0, 8388736.f), a.x, 0.f);
      s = fmaf(qbyte(u, 1, 8388736.f), a.y, s);
      s = fmaf(qbyte(u, 2, 8388736.f), a.z, s); s = fmaf(qbyte(u, 3, 8388736.f), a.w, s);
      t[i] = s;
    }
  } else if (QOFS) {   // Q4_*, offset form: bytes q * 8 (low nibbles: v << 3, high: v >> 1, masked 0x78)
#pragma unroll
    for (int i = 0; i < WPL; ++i) {
      const int q = q0 + i;
      const u32 lo = (v[i] << 3) & 0x78787878u, hi = (v[i] >> 1) & 0x78787878u;
      const float4 a = *reinterpret_cast<const float4*>(xs + (q * NC + c) * 4);
      const float4 b = *reinterpret_cast<const float4*>(xs + ((4 + q) * NC + c) * 4);
      float s = fmaf(qhalf(lo, 0), a.x, 0.f);
      s = fmaf(qhalf(lo, 1), a.y, s);
      s = fmaf(qhalf(lo, 2), a.z, s); s = fmaf(qhalf(lo, 3), a.w, s);
      s = fmaf(qhalf(hi, 0), b.x, s); s = fmaf(qhalf(hi, 1), b.y, s);
      s = fmaf(qhalf(hi, 2), b.z, s); s = fmaf(qhalf(hi, 3), b.w, s);
      t[i] = s;
    }
    const float s = sum_words<WPL>(t);
    const float d = hbits2f(sc & 0xffffu);
    if (QW == 2) return d * fmaf(s, 32.f, -24.f * sxc);                      // sum (q - 8) x = 32 S - 24 sx
    return fmaf(d, fmaf(s, 32.f, -16.f * sxc), hbits2f(sc >> 16) * sxc);    // d sum q x + m sx
  } else {         // Q4_*: word q's low nibbles are elements 4q.., its high nibbles elements 16 + 4q..
    constexpr float MG = QW == 2 ? 8388616.f : 8388608.f;   // Q4_0: q - 8; Q4_1: q
#pragma unroll
    for (int i = 0; i < WPL; ++i) {
      const int q = q0 + i;
      const u32 lo = v[i] & 0x0F0F0F0Fu, hi = (v[i] >> 4) & 0x0F0F0F0Fu;
      const float4 a = *reinterpret_cast<const float4*>(xs + (q * NC + c) * 4);
      const float4 b = *reinterpret_cast<const float4*>(xs + ((4 + q) * NC + c) * 4);
      float s = fmaf(qbyte(lo, 0, MG), a.x, 0.f);
      s = fmaf(qbyte(lo, 1, MG), a.y, s);
      s = fmaf(qbyte(lo, 2, MG), a.z, s); s = fmaf(qbyte(lo, 3, MG), a.w, s);
      s = fmaf(qbyte(hi, 0, MG), b.x, s); s = fmaf(qbyte(hi, 1, MG), b.y, s);
      s = fmaf(qbyte(hi, 2, MG), b.z, s); s = fmaf(qbyte(hi, 3, MG), b.w, s);
      t[i] = s;
      if (QW == 3) sx += ((a.x + a.y) + (a.z + a.w)) + ((b.x + b.y) + (b.z + b.w));
    }
  }
  const float s = sum_words<WPL>(t);
  float r = hbits2f(sc & 0xffffu) * s;
  if (QW == 3) r = fmaf(hbits2f(sc >> 16), sx, r);
  return r;
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

// The first warp waits, lane k on counter l0 + k: several lanes' polls in flight at once, one round trip
// instead of one a lane (thread 0 polling them in turn was slower: docs/monokernel.md, "Serial round trips").
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

// the quantized form of warp_dot: NR rows of K starting at element e (quants at qb, scales at sb)
template <bool SMEM = false>   // SMEM: sb in shared memory
__device__ __forceinline__ u32 ld_scale(const void* sb, long long blk) {
  if (SMEM) return QSB == 4 ? reinterpret_cast<const u32*>(sb)[blk] : (u32)reinterpret_cast<const u16*>(sb)[blk];
  if (QSB == 4) return __ldg(reinterpret_cast<const u32*>(sb) + blk);
  return (u32)__ldg(reinterpret_cast<const u16*>(sb) + blk);
}
// (SMEM: qb and sb in shared memory, the block's copy of wbuf_fill_w)
template <int NR, int K, int UBM = CFG_UBMAX, bool SMEM = false>
__device__ __forceinline__ void warp_dotq(const unsigned char* __restrict__ qb, const void* __restrict__ sb, long long e,
                                          int nvalid, const float* xs, float* out) {
  constexpr int LPC = qlpc<K>(), WPL = 4 / LPC;   // lanes a chunk, words a lane (slot s: chunk s / LPC)
  constexpr int NSLOT = K / QCW * LPC;
  constexpr int CPL = (NSLOT + 31) / 32;
  constexpr int UB0 = UBM / NR;
  constexpr int UB = UB0 < 1 ? 1 : (UB0 > CPL ? CPL : UB0);
  constexpr int CPB = 32 / QCW;   // chunks a block: 2 (Q8_0) or 1
  const int lane = threadIdx.x & 31;
  float acc[NR];
#pragma unroll
  for (int r = 0; r < NR; ++r) acc[r] = 0.f;
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
          const unsigned char* src = qb + er * QBITS / 8 + (long long)c * 16 + q0 * 4;
          if constexpr (!SMEM) {
            ldw_words<WPL>(src, wv[r][u]);
          } else if constexpr (WPL == 4) {
            const uint4 x = *reinterpret_cast<const uint4*>(src);
            wv[r][u][0] = x.x; wv[r][u][1] = x.y; wv[r][u][2] = x.z; wv[r][u][3] = x.w;
          } else if constexpr (WPL == 2) {
            const uint2 x = *reinterpret_cast<const uint2*>(src);
            wv[r][u][0] = x.x; wv[r][u][1] = x.y;
          } else {
            wv[r][u][0] = *reinterpret_cast<const u32*>(src);
          }
          sc[r][u] = ld_scale<SMEM>(sb, er / 32 + c / CPB);
        } else {
#pragma unroll
          for (int i = 0; i < WPL; ++i) wv[r][u][i] = 0u;
          sc[r][u] = 0u;
        }
      }
#pragma unroll
    for (int u = 0; u < UB; ++u) {    // chunk by chunk: one chunk's 16-32 inputs live, shared by the rows
      const int sl = (b0 + u) * 32 + lane, c = sl / LPC, q0 = sl % LPC * WPL;
      if (b0 + u < CPL && sl < NSLOT) {
        const float sxc = chunk_xsum<K, WPL>(xs, c, q0);
#pragma unroll
        for (int r = 0; r < NR; ++r) acc[r] += dotq_w<K, WPL>(wv[r][u], sc[r][u], xs, c, q0, sxc);
      }
    }
  }
#pragma unroll
  for (int r = 0; r < NR; ++r) out[r] = warp_sum(acc[r]);
}
#include "mk_kquant.cuh"
// a layer matrix's rows (element e of p.w's index), in whichever storage the build has
template <int NR, int K, int UBM = CFG_UBMAX>
__device__ __forceinline__ void wdot(const Params& p, long long e, int nvalid, const float* xs, float* out) {
  // quantized: at most QUB loads in flight a lane (each 16-32 weights)
  if constexpr (QW == 4) wdot_k<NR, K, (UBM < QUB ? UBM : QUB)>(p, e, nvalid, xs, out);
  else if constexpr (QW != 0) warp_dotq<NR, K, (UBM < QUB ? UBM : QUB)>(reinterpret_cast<const unsigned char*>(p.w), p.ws, e, nvalid, xs, out);
  else warp_dot<NR, K, false, UBM>(p.w + e, nvalid, xs, out);
}
// bytes of n elements of the layer matrices, and the L2 prefetch of elements [e, e + n) (quants and scales)
__device__ __forceinline__ long long wbytes(long long n) { return QW ? n * QBITS / 8 : n * (long long)sizeof(wt); }
__device__ __forceinline__ void prefetch_w(const Params& p, long long e, long long n, long long limit) {
  if (QW == 4) {
    prefetch_k(p, e, n, limit);
  } else if (QW) {
    prefetch_l2(reinterpret_cast<const unsigned char*>(p.w) + e * QBITS / 8, wbytes(n), limit);
    // the bulk prefetch wants a 16-byte aligned start: from the line's 16 bytes that hold block e / 32
    const long long s0 = e / 32 * QSB, a0 = s0 & ~15ll;
    prefetch_l2(reinterpret_cast<const unsigned char*>(p.ws) + a0, (e + n) / 32 * QSB - a0, limit / 8);
  } else {
    prefetch_l2(p.w + e, wbytes(n), limit);
  }
}

// The block's shared-memory copy of its first units of a layer matrix region, from element e0 (CFG_PFS; the
// storage type: wbuf_fill). Quantized matrices: the nb units' quants (ue * QBITS / 8 bytes each, 16-byte
// multiples), then their scales from the 16-byte piece that holds the first one (cp.async copies aligned
// 16-byte pieces; the scale array has 16 bytes of tail for the last piece). Returns how many there will be.
__device__ __forceinline__ int wbuf_fill_w(const Params& p, float* sm, long long e0, int nunits, int ue, bool issue) {
  static_assert(QW != 4 || PFS == 0, "the K-quants have no shared-memory copy (build.one_lane_units)");
  if constexpr (QW == 0) {
    return wbuf_fill(sm, p.w + e0, nunits, ue, issue);
  } else {
    if (PFS == 0 || nunits <= 0) return 0;
    const int uq = ue * QBITS / 8, us = ue / 32 * QSB;
    const int nb = min(nunits, (PFS - 32) / (uq + us));
    if (issue) {
      char* dst = reinterpret_cast<char*>(sm + WBUF_OFF);
      const char* q = reinterpret_cast<const char*>(p.w) + e0 * QBITS / 8;
      const int qbytes = nb * uq;   // both pieces under CFG_PFS bytes: int offsets
      for (int off = threadIdx.x * 16; off < qbytes; off += NT * 16) cp_async16(dst + off, q + off);
      const long long s0 = e0 / 32 * QSB;
      const int sbytes = ((int)(s0 & 15) + nb * us + 15) & ~15;
      const char* sc = reinterpret_cast<const char*>(p.ws) + (s0 & ~15ll);
      for (int off = threadIdx.x * 16; off < sbytes; off += NT * 16) cp_async16(dst + qbytes + off, sc + off);
      cp_async_commit();
    }
    return nb;
  }
}
// NR rows of unit k (ue elements) of that copy (nbuf units from element e0), as wdot, in the storage type
// (quantized builds with a copy read it through wdotq_unit; without one, nbuf is 0 and this is never called)
template <int NR, int K, int UE>
__device__ __forceinline__ void wdot_buf(const float* sm, long long e0, int nbuf, int k, int nvalid,
                                         const float* xs, float* out) {
  warp_dot<NR, K, true>((const wt*)(sm + WBUF_OFF) + (long long)k * UE, nvalid, xs, out);
}

// Quantized builds with a shared-memory copy (CFG_PFS): NR rows of the phase's unit k from the block's copy
// (k < nbuf units from element E0) or from the matrix (element eg) in ONE dequantizing loop over generic
// pointers chosen per unit: two inlined forms of it (wdot_buf, wdot) made the SmolLM2 Q4_1 build spill 312 /
// 700 bytes and run slower than without the copy. The other builds keep their two loops (the measured kernels).
constexpr bool QCOPY = QW != 0 && PFS != 0;
template <int NR, int K, int UE, int UB = CFG_UBMAX>
__device__ __forceinline__ void wdotq_unit(const Params& p, const float* sm, long long E0, int nbuf, int k, long long eg,
                                           int nvalid, const float* xs, float* out) {
  const unsigned char* cq = reinterpret_cast<const unsigned char*>(sm + WBUF_OFF);
  const bool in = k < nbuf;
  const unsigned char* qb = in ? cq : reinterpret_cast<const unsigned char*>(p.w);
  const void* sb = in ? (const void*)(cq + (long long)nbuf * (UE * QBITS / 8) + ((E0 / 32 * QSB) & 15)) : p.ws;
  warp_dotq<NR, K, (UB < QUB ? UB : QUB), true>(qb, sb, in ? (long long)k * UE : eg, nvalid, xs, out);
}

// The prologue of the layer phases QKV, WO, W13 and W2: the entry mark, the block's units [ua, ub) of the
// phase (U units of UE elements), the element E where layer i's region starts (region offset OFF; p.w and
// p.ws), the first units' weights into shared memory (nbuf of them, wbuf_fill; `issue` false: an earlier phase
// issued the copies) and an L2 prefetch of the rest (`prefetch`). Every block runs it, units or not, so its
// copies and prefetches go out before the phase waits. The early return (ua >= ub) and the lanes l0, l1 stay
// in the phases: computing the lanes here, ahead of the return, or E before the mark, changes nvcc's code
// (bench/ptx_identity.py), and this helper keeps the kernels the GPU measured.
struct PhaseUnits {
  long long E;
  int ua, ub, nbuf;
};
template <int U, int UE, long long OFF>
__device__ __forceinline__ PhaseUnits phase_begin(const Params& p, float* sm, int n, int i, int ph, bool issue,
                                                  bool prefetch) {
  int ua, ub;
  tmark(p, n, ph, 0);
  brange(U, ua, ub);
  const long long E = (long long)i * LAYER_SZ + OFF;
  const int nbuf = wbuf_fill_w(p, sm, E + (long long)ua * UE, ub - ua, UE, issue);
  if (prefetch) prefetch_w(p, E + (long long)(ua + nbuf) * UE, (long long)(ub - ua - nbuf) * UE, PF);
  return PhaseUnits{E, ua, ub, nbuf};
}
