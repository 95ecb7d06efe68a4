// prefill.cu: the element-wise and attention kernels of the batched prefill (prefill.py runs the
// projections as cuBLAS strided-batched GEMMs over lanes, in the storage type, accumulating in fp32).
// Activations: X [L][T][D] fp32 residuals; GEMM inputs in the storage type.
#include "common.cuh"
#include "kquant.cuh"

using namespace cfg;

extern "C" __global__ void pf_embed(const wt* __restrict__ emb, const int* __restrict__ ids, int T, float* X) {
  const long long n = (long long)T * D;
  for (long long x = blockIdx.x * (long long)blockDim.x + threadIdx.x; x < n; x += (long long)gridDim.x * blockDim.x) {
    const int t = (int)(x / D), d = (int)(x % D);
    const float v = w2f(emb[(long long)ids[t] * D + d]);
    for (int l = 0; l < L; ++l) X[((long long)l * T) * D + x] = v;
  }
}

// one block (256 threads) per (lane, token) row: Xn = rms(X) * g[l]
extern "C" __global__ void pf_norm(const float* __restrict__ X, const float* __restrict__ g, wt* Xn, int T) {
  const int row = blockIdx.x, l = row / T;
  const float* x = X + (long long)row * D;
  __shared__ float red[32];
  float ss = 0.f;
  for (int d = threadIdx.x; d < D; d += blockDim.x) ss += x[d] * x[d];
  ss = warp_sum(ss);
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = ss;
  __syncthreads();
  float tot = 0.f;
  for (int w = 0; w < (int)(blockDim.x >> 5); ++w) tot += red[w];
  const float inv = 1.0f / sqrtf(tot / (float)D + EPS);
  for (int d = threadIdx.x; d < D; d += blockDim.x) Xn[(long long)row * D + d] = f2w((x[d] * inv) * g[(long long)l * D + d]);
}

// Y [L][T][RQKV] -> rotated q [L][T][HDL] fp32, rotated k and v into the cache at pos0 + t
// bias: the layer's q/k/v biases [L][RQKV] (CFG_BIAS), added before the rotation
extern "C" __global__ void pf_rope(const float* __restrict__ Y, int T, int pos0, int layer, float* Q, wt* kc, wt* vc,
                                   long long max_seq, const float2* __restrict__ rope, const float* __restrict__ bias) {
  const long long n = (long long)L * T * (RQKV / 2);
  for (long long x = blockIdx.x * (long long)blockDim.x + threadIdx.x; x < n; x += (long long)gridDim.x * blockDim.x) {
    const int pr = (int)(x % (RQKV / 2));
    const long long lt = x / (RQKV / 2);
    const int t = (int)(lt % T), l = (int)(lt / T);
    const int row = 2 * pr;
    float x0 = Y[lt * RQKV + row], x1 = Y[lt * RQKV + row + 1];
    if (CFG_BIAS) {
      x0 += bias[(long long)l * RQKV + row];
      x1 += bias[(long long)l * RQKV + row + 1];
    }
    int r = row, region = 0;
    if (r >= HDL) { r -= HDL; region = 1; if (r >= KVDL) { r -= KVDL; region = 2; } }
    const int hh = r / HD, dd = r % HD;
    const int pos = pos0 + t;
    if (region < 2) {
      const float2 cs = rope[(long long)pos * (HD / 2) + dd / 2];
      const float c = cs.x, sn = cs.y;
      const float y0 = x0 * c - x1 * sn, y1 = x0 * sn + x1 * c;
      x0 = y0; x1 = y1;
    }
    if (region == 0) {
      float* q = Q + lt * HDL + hh * HD + dd;
      q[0] = x0; q[1] = x1;
    } else {
      const int g = l * KVL + hh;
      wt* c = (region == 1 ? kc : vc) + (((long long)layer * KV + g) * max_seq + pos) * HD + dd;
      c[0] = f2w(x0); c[1] = f2w(x1);
    }
  }
}

// one warp per (token, query head), online softmax over the visible cache positions
constexpr int PF_DPL = (HD + 31) / 32;
extern "C" __global__ void pf_attn(const float* __restrict__ Q, const wt* __restrict__ kc, const wt* __restrict__ vc,
                                   int T, int pos0, int layer, long long max_seq, wt* O) {
  const int gw = (int)((blockIdx.x * (long long)blockDim.x + threadIdx.x) >> 5);
  const int lane = threadIdx.x & 31, wib = threadIdx.x >> 5;
  __shared__ __align__(16) float qs[8][HD];
  if (gw >= T * H) return;
  const int t = gw / H, qh = gw % H, l = qh / HL, hh = qh % HL, g = qh / G;
  const long long lt = (long long)l * T + t;
  for (int d = lane; d < HD; d += 32) qs[wib][d] = Q[lt * HDL + hh * HD + d];
  __syncwarp();
  const int pos = pos0 + t;
  const int lo = sliding(layer) ? max(0, pos - SW + 1) : 0;
  const wt* kb = kc + ((long long)layer * KV + g) * max_seq * HD;
  const wt* vb = vc + ((long long)layer * KV + g) * max_seq * HD;
  const float scale = 1.0f / sqrtf((float)HD);
  float m = -1e30f, ls = 0.f, acc[PF_DPL];
#pragma unroll
  for (int k = 0; k < PF_DPL; ++k) acc[k] = 0.f;
  constexpr int VCH = HD / VEC;
  for (int j0 = lo; j0 <= pos; j0 += 32) {
    const int j = j0 + lane;
    const bool valid = j <= pos;
    float s = 0.f;
    if (valid) {
      const uint4* kr = reinterpret_cast<const uint4*>(kb + (long long)j * HD);
#pragma unroll
      for (int c = 0; c < VCH; ++c) s += dot16(kr[c], qs[wib] + c * VEC);
    }
    const float sv = valid ? s * scale : -1e30f;
    const float mn = fmaxf(m, warp_max(sv));
    const float corr = expf(m - mn);
    const float pj = valid ? expf(sv - mn) : 0.f;
    ls = ls * corr + warp_sum(pj);
#pragma unroll
    for (int k = 0; k < PF_DPL; ++k) acc[k] *= corr;
    m = mn;
    const int nk = min(32, pos - j0 + 1);
    for (int kk = 0; kk < nk; ++kk) {
      const float pv = __shfl_sync(0xffffffffu, pj, kk);
      const wt* vr = vb + (long long)(j0 + kk) * HD;
#pragma unroll
      for (int k = 0; k < PF_DPL; ++k) {
        const int d = lane + 32 * k;
        if (d < HD) acc[k] = fmaf(pv, w2f(vr[d]), acc[k]);
      }
    }
  }
#pragma unroll
  for (int k = 0; k < PF_DPL; ++k) {
    const int d = lane + 32 * k;
    if (d < HD) O[lt * HDL + hh * HD + d] = f2w(acc[k] / ls);
  }
}

// the DTP combine of one layer's partials P [L][T][D] (old: the same kind, layer - DELTA, or null)
extern "C" __global__ void pf_combine(float* X, const float* __restrict__ P, const float* __restrict__ Pold, int layer,
                                      int T) {
  const long long n = (long long)T * D, LS = (long long)T * D;
  const float sqrtL = sqrtf((float)L);
  for (long long x = blockIdx.x * (long long)blockDim.x + threadIdx.x; x < n; x += (long long)gridDim.x * blockDim.x) {
    const bool early = layer < DELTA;
    if (!USE_COMM) {
      for (int l = 0; l < L; ++l) X[l * LS + x] += sqrtL * P[l * LS + x];
    } else if (early && USE_EARLY) {
      float tot = P[x];
      for (int l = 1; l < L; ++l) tot += P[l * LS + x];
      for (int l = 0; l < L; ++l) X[l * LS + x] += tot;
    } else if (early) {
      for (int l = 0; l < L; ++l) X[l * LS + x] += sqrtL * P[l * LS + x];
    } else {
      float tot = 0.f;
      if (Pold) {
        tot = Pold[x];
        for (int l = 1; l < L; ++l) tot += Pold[l * LS + x];
      }
      for (int l = 0; l < L; ++l) {
        const float dt = Pold ? tot - Pold[l * LS + x] : 0.f;
        X[l * LS + x] += P[l * LS + x] + dt;
      }
    }
  }
}

#if KOG_NRANKS > 1
// several ranks: P and Pold hold EVERY lane's partials [LG][T][D] (gathered by the host between the
// GEMMs), X this rank's lanes [L][T][D]; lane l of X is lane g0 + l of the model. The arithmetic of
// pf_combine with L = LG, for the rank's lanes only (lane-order sums: the one-rank bits).
extern "C" __global__ void pf_combine_mr(float* X, const float* __restrict__ P, const float* __restrict__ Pold,
                                         int layer, int T, int g0) {
  constexpr int LG = CFG_LG;
  const long long n = (long long)T * D, LS = (long long)T * D;
  const float sqrtL = sqrtf((float)LG);
  for (long long x = blockIdx.x * (long long)blockDim.x + threadIdx.x; x < n; x += (long long)gridDim.x * blockDim.x) {
    const bool early = layer < DELTA;
    if (!USE_COMM || (early && !USE_EARLY)) {
      for (int l = 0; l < L; ++l) X[l * LS + x] += sqrtL * P[(g0 + l) * LS + x];
    } else if (early) {
      float tot = P[x];
      for (int j = 1; j < LG; ++j) tot += P[j * LS + x];
      for (int l = 0; l < L; ++l) X[l * LS + x] += tot;
    } else {
      float tot = 0.f;
      if (Pold) {
        tot = Pold[x];
        for (int j = 1; j < LG; ++j) tot += Pold[j * LS + x];
      }
      for (int l = 0; l < L; ++l) {
        const float dt = Pold ? tot - Pold[(g0 + l) * LS + x] : 0.f;
        X[l * LS + x] += P[(g0 + l) * LS + x] + dt;
      }
    }
  }
}
#endif

// Y [L][T][FL][2] (gate, up interleaved) -> silu(gate) * up in the storage type [L][T][FL]
extern "C" __global__ void pf_silu(const float* __restrict__ Y, wt* Hd, long long n) {
  for (long long x = blockIdx.x * (long long)blockDim.x + threadIdx.x; x < n; x += (long long)gridDim.x * blockDim.x) {
    const float a = Y[2 * x], b = Y[2 * x + 1];
    Hd[x] = f2w(a / (1.0f + expf(-a)) * b);
  }
}

// final norm and lane mean of the last position: y [D] (used by max_new_tokens == 0 checks and tests)
extern "C" __global__ void f32_to_w(const float* __restrict__ in, wt* out, long long n) {
  for (long long x = blockIdx.x * (long long)blockDim.x + threadIdx.x; x < n; x += (long long)gridDim.x * blockDim.x)
    out[x] = f2w(in[x]);
}
extern "C" __global__ void w_to_f32(const wt* __restrict__ in, float* out, long long n) {
  for (long long x = blockIdx.x * (long long)blockDim.x + threadIdx.x; x < n; x += (long long)gridDim.x * blockDim.x)
    out[x] = w2f(in[x]);
}

// ---- quantized layer matrices (CFG_QW, common.cuh's layout) ---------------------------------------
// The prefill's GEMM operands: a layer's matrices dequantized into a scratch of the storage type (or fp32),
// value for value gguf.quants' dequantization. A thread makes one piece of 8 consecutive weights (a quarter
// of a 32-weight block) from one 8-byte load of quants and its block's scale, and stores them in 16 bytes
// (32 in fp32): a warp's stores are 512 contiguous bytes and its loads 256 (Q8_0) or 128 (Q4_*), where one
// thread a block (32 weights, 64 bytes of stores 64 bytes apart) left most of every store transaction unused.

// 8 weights as the storage type (or fp32): one 16-byte store (two in fp32)
template <typename T>
__device__ __forceinline__ void st_piece(T* out, const float* v) {
  if constexpr (sizeof(T) == 4) {
    reinterpret_cast<float4*>(out)[0] = make_float4(v[0], v[1], v[2], v[3]);
    reinterpret_cast<float4*>(out)[1] = make_float4(v[4], v[5], v[6], v[7]);
  } else {
    uint4 r;
    r.x = (u32)f2w(v[0]) | ((u32)f2w(v[1]) << 16);
    r.y = (u32)f2w(v[2]) | ((u32)f2w(v[3]) << 16);
    r.z = (u32)f2w(v[4]) | ((u32)f2w(v[5]) << 16);
    r.w = (u32)f2w(v[6]) | ((u32)f2w(v[7]) << 16);
    *reinterpret_cast<uint4*>(out) = r;
  }
}
// weights 8p..8p+7 of block b: Q8_0 d q, Q4_0 d (q - 8), Q4_1 d q + m (no fused multiply-add). Q4_*: block
// byte j holds weight j (low nibble) and j + 16 (high), so piece p reads bytes 8 (p & 1) .. and takes the
// low nibbles (p < 2) or the high ones
__device__ __forceinline__ void q_piece(const unsigned char* __restrict__ qb, const void* __restrict__ sb, long long b,
                                        int p, float* v) {
  const u32 sc = QSB == 4 ? reinterpret_cast<const u32*>(sb)[b] : (u32)reinterpret_cast<const u16*>(sb)[b];
  const float d = h2f((u16)(sc & 0xffffu)), m = h2f((u16)(sc >> 16));
  if (QW == 1) {
    const uint2 w = *reinterpret_cast<const uint2*>(qb + b * 32 + 8 * p);
#pragma unroll
    for (int k = 0; k < 8; ++k)
      v[k] = __fmul_rn(d, (float)(signed char)(((k < 4 ? w.x : w.y) >> (8 * (k & 3))) & 0xffu));
  } else {
    const uint2 w = *reinterpret_cast<const uint2*>(qb + b * 16 + 8 * (p & 1));
    const int sh = p < 2 ? 0 : 4;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const int q = (int)((((k < 4 ? w.x : w.y) >> (8 * (k & 3))) >> sh) & 15u);
      v[k] = QW == 2 ? __fmul_rn(d, (float)(q - 8)) : __fadd_rn(__fmul_rn(d, (float)q), m);
    }
  }
}
// blocks [b0, b0 + nb) into out [nb * 32]: piece x is weights 8x.. of out (block b0 + x / 4, piece x % 4)
template <typename T>
__device__ __forceinline__ void q_pieces(const unsigned char* __restrict__ qb, const void* __restrict__ sb, long long b0,
                                         long long nb, T* __restrict__ out) {
  for (long long x = blockIdx.x * (long long)blockDim.x + threadIdx.x; x < nb * 4; x += (long long)gridDim.x * blockDim.x) {
    float v[8];
    q_piece(qb, sb, b0 + (x >> 2), (int)(x & 3), v);
    st_piece(out + x * 8, v);
  }
}
extern "C" __global__ void q_to_w(const unsigned char* __restrict__ qb, const void* __restrict__ sb, long long b0,
                                  long long nb, wt* __restrict__ out) {
  q_pieces<wt>(qb, sb, b0, nb, out);
}
extern "C" __global__ void q_to_f32(const unsigned char* __restrict__ qb, const void* __restrict__ sb, long long b0,
                                    long long nb, float* __restrict__ out) {
  q_pieces<float>(qb, sb, b0, nb, out);
}
// K-quant chunks [c0, c0 + nc) of type t (kquant.cuh's layout; chunk c is elements 32c..) into out [nc * 32],
// a piece of 8 weights a thread (kq_piece), value for value gguf.quants' dequantization
template <typename T>
__device__ __forceinline__ void kq_pieces(const unsigned char* __restrict__ nib, const unsigned char* __restrict__ hb,
                                          const unsigned char* __restrict__ rec, int t, long long c0, long long nc,
                                          T* __restrict__ out) {
  for (long long x = blockIdx.x * (long long)blockDim.x + threadIdx.x; x < nc * 4; x += (long long)gridDim.x * blockDim.x) {
    float v[8];
    kq_piece(nib, hb, rec, t, c0 + (x >> 2), (int)(x & 3), v);
    st_piece(out + x * 8, v);
  }
}
extern "C" __global__ void kq_to_w(const unsigned char* nib, const unsigned char* hb, const unsigned char* rec, int t,
                                   long long c0, long long nc, wt* out) {
  kq_pieces<wt>(nib, hb, rec, t, c0, nc, out);
}
extern "C" __global__ void kq_to_f32(const unsigned char* nib, const unsigned char* hb, const unsigned char* rec, int t,
                                     long long c0, long long nc, float* out) {
  kq_pieces<float>(nib, hb, rec, t, c0, nc, out);
}
__device__ __forceinline__ float roundf_away(float n) {   // gguf.quants.np_roundf: half away from zero
  const float a = fabsf(n), fl = floorf(a);
  return copysignf(fl + floorf(2.f * (a - fl)), n) * (n != 0.f ? 1.f : 0.f);
}
// fp32 x [nb * 32] -> blocks [b0, b0 + nb): round to nearest exactly as gguf.quants' quantize_blocks does
// (its float32 operations one by one, so the bits are the reference's)
extern "C" __global__ void f32_to_q(const float* __restrict__ x, long long b0, long long nb, unsigned char* qb, void* sb) {
  for (long long bx = blockIdx.x * (long long)blockDim.x + threadIdx.x; bx < nb; bx += (long long)gridDim.x * blockDim.x) {
    const float* v = x + bx * 32;
    const long long b = b0 + bx;
    if (QW == 1) {
      float amax = 0.f;
      for (int j = 0; j < 32; ++j) amax = fmaxf(amax, fabsf(v[j]));
      const float d = __fdiv_rn(amax, 127.f), id = d == 0.f ? 0.f : __fdiv_rn(1.f, d);
      for (int j = 0; j < 32; ++j) qb[b * 32 + j] = (unsigned char)(signed char)(int)roundf_away(__fmul_rn(v[j], id));
      reinterpret_cast<u16*>(sb)[b] = f2h(d);
    } else if (QW == 2) {
      float amax = 0.f, mx = 0.f;
      for (int j = 0; j < 32; ++j)
        if (fabsf(v[j]) > amax) { amax = fabsf(v[j]); mx = v[j]; }   // the first of the largest magnitude
      const float d = __fdiv_rn(mx, -8.f), id = d == 0.f ? 0.f : __fdiv_rn(1.f, d);
      unsigned char q[32];
      for (int j = 0; j < 32; ++j) {
        const float t = truncf(__fadd_rn(__fmul_rn(v[j], id), 8.5f));
        q[j] = (unsigned char)min(15, (int)(unsigned char)(int)t);
      }
      for (int j = 0; j < 16; ++j) qb[b * 16 + j] = (unsigned char)(q[j] | (q[j + 16] << 4));
      reinterpret_cast<u16*>(sb)[b] = f2h(d);
    } else {
      float mx = v[0], mn = v[0];
      for (int j = 1; j < 32; ++j) { mx = fmaxf(mx, v[j]); mn = fminf(mn, v[j]); }
      const float d = __fdiv_rn(__fsub_rn(mx, mn), 15.f), id = d == 0.f ? 0.f : __fdiv_rn(1.f, d);
      unsigned char q[32];
      for (int j = 0; j < 32; ++j) {
        const float t = truncf(__fadd_rn(__fmul_rn(__fsub_rn(v[j], mn), id), 0.5f));
        q[j] = (unsigned char)min(15, (int)(unsigned char)(int)t);
      }
      for (int j = 0; j < 16; ++j) qb[b * 16 + j] = (unsigned char)(q[j] | (q[j + 16] << 4));
      reinterpret_cast<u32*>(sb)[b] = (u32)f2h(d) | ((u32)f2h(mn) << 16);
    }
  }
}
