// mk_att.cuh: part of monokernel.cu (pasted in place after mk_qkv.cuh; not a standalone header).
// The attention phase: units (kv head g, position chunk c); each block's warps split the chunk's positions,
// keep an online softmax each, and the block merges them into (acc[HD], max, sum) per head in p.attp; WO
// merges the chunks.
//
// Registers, not round trips: a warp takes PPW positions a pass, KL lanes a key row (KC 16-byte chunks
// each) and VCH lanes a value row, so one pass's keys and values are KC + VQ 16-byte loads a lane, all in
// flight together. The first pass is loaded before the block waits for QKV (every position but t, which
// this token's QKV appends), the next pass while the current one computes. With 32 positions a warp the
// 2B shape's 48 + 64 registers of loads came back in four waves of L2 round trips after the wait.
#pragma once

constexpr int VS = 32 / VCH, VQ = (PPW + VS - 1) / VS;          // value slots (lane = slot * VCH + chunk); rows a slot
struct AttRows {
  uint4 k[KC];
  uint4 v[VQ];
};
// the keys and values of positions [j0, j0 + PPW) below ce a lane holds; `only`: just position `only`
// (>= 0), `skip`: all but position `skip`
__device__ __forceinline__ void att_load(const wt* kb, const wt* vb, int j0, int ce, int skip, int only, AttRows& r) {
  const int lane = threadIdx.x & 31;
  const int jk = j0 + lane / KL, kc0 = (lane % KL) * KC;
  if (jk < ce && jk != skip && (only < 0 || jk == only)) {
#pragma unroll
    for (int c = 0; c < KC; ++c) r.k[c] = ldc16(kb + (long long)jk * HD + (kc0 + c) * VEC);
  } else if (only < 0) {
#pragma unroll
    for (int c = 0; c < KC; ++c) r.k[c] = make_uint4(0u, 0u, 0u, 0u);
  }
  const int slot = lane / VCH, ch = lane % VCH;
#pragma unroll
  for (int q = 0; q < VQ; ++q) {
    const int pos = slot * VQ + q, jv = j0 + pos;
    if (slot < VS && pos < PPW && jv < ce && jv != skip && (only < 0 || jv == only))
      r.v[q] = ldc16(vb + (long long)jv * HD + ch * VEC);
    else if (only < 0)
      r.v[q] = make_uint4(0u, 0u, 0u, 0u);
  }
}
// one pass: scores of the warp's PPW positions, the online softmax update, values into acc (lane's chunk)
__device__ __forceinline__ void att_pass(const AttRows& r, const float* sq, int j0, int ce, float scale, float* m,
                                         float* ls, float (*acc)[VEC]) {
  const int lane = threadIdx.x & 31;
  const int kc0 = (lane % KL) * KC;
  const bool valid = j0 + lane / KL < ce;
  float sc[G];
#pragma unroll
  for (int h = 0; h < G; ++h) {
    sc[h] = 0.f;
#pragma unroll
    for (int c = 0; c < KC; ++c) sc[h] += dot16(r.k[c], sq + h * HD + (kc0 + c) * VEC);
#pragma unroll
    for (int o = 1; o < KL; o <<= 1) sc[h] += __shfl_xor_sync(0xffffffffu, sc[h], o);
  }
  float pj[G];
#pragma unroll
  for (int h = 0; h < G; ++h) {
    const float sv = valid ? sc[h] * scale : -1e30f;
    float mx = sv;
#pragma unroll
    for (int o = KL; o < 32; o <<= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    const float mn = fmaxf(m[h], mx);
    const float corr = expf(m[h] - mn);
    pj[h] = valid ? expf(sv - mn) : 0.f;
    float s = pj[h];
#pragma unroll
    for (int o = KL; o < 32; o <<= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    ls[h] = ls[h] * corr + s;
#pragma unroll
    for (int e = 0; e < VEC; ++e) acc[h][e] *= corr;
    m[h] = mn;
  }
  const int slot = lane / VCH;
#pragma unroll
  for (int q = 0; q < VQ; ++q) {
    const int pos = slot * VQ + q;
    float pv[G];
#pragma unroll
    for (int h = 0; h < G; ++h) pv[h] = __shfl_sync(0xffffffffu, pj[h], (pos < PPW ? pos : 0) * KL);
    if (slot < VS && pos < PPW && j0 + pos < ce) {
      float f[VEC];
      unpack(r.v[q], f);
#pragma unroll
      for (int h = 0; h < G; ++h)
#pragma unroll
        for (int e = 0; e < VEC; ++e) acc[h][e] = fmaf(pv[h], f[e], acc[h][e]);
    }
  }
}

__device__ __noinline__ void phase_att(const Params& p_, float* sm, int n, int i, int t, int tok) {
  const Params& p = NOINL_PARAMS(p_);
  int ua, ub;
  const int ph = 5 * i + 1;
  tmark(p, n, ph, 0);
  brange(U_ATT, ua, ub);
  {  // the output projection's weights come next: ask L2 for them now
    int wa, wb;
    brange(U_WO, wa, wb);
    const long long Eo = (long long)i * LAYER_SZ + OFF_WO;
    const int nb = wbuf_fill_w(p, sm, Eo + (long long)wa * UE_WO, wb - wa, UE_WO, true);
    prefetch_w(p, Eo + (long long)(wa + nb) * UE_WO, (long long)(wb - wa - nb) * UE_WO, PF_ATT);
  }
  if (ua >= ub) return;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  float* sq = sm;                        // [G][HD]
  float* wacc = sm + G * HD;             // [NW][G][HD]
  float* wm = wacc + NW * G * HD;        // [NW][G]
  float* wl = wm + NW * G;               // [NW][G]
  const float scale = 1.0f / sqrtf((float)HD);
  const int ch = lane % VCH;
  int waited = -1;
  for (int u = ua; u < ub; ++u) {
    const int g = u / NCH, c = u % NCH, l = g / KVL;
    int cs, ce;
    att_chunk(i, t, c, cs, ce);
    if (ce <= cs) continue;                 // a chunk not in use at this position (its unit still counts)
    const wt* kb = p.kc + ((long long)i * KV + g) * p.max_seq * HD;
    const wt* vb = p.vc + ((long long)i * KV + g) * p.max_seq * HD;
    constexpr int STEP = NW * PPW;
    int j0 = cs + warp * PPW;
    AttRows cur, nxt;
    att_load(kb, vb, j0, ce, t, -1, cur);   // before the wait: all but position t (this token's QKV writes it)
    if (l != waited) {
      if (threadIdx.x == 0) SPIN(p, CTR(p, C_QKV * L + l), (u64)(n * NL + i + 1) * UPL_QKV);
      waited = l;
    }
    __syncthreads();
    if (u == ua) tmark(p, n, ph, 1);
    if (j0 <= t && t < j0 + PPW) att_load(kb, vb, j0, ce, -1, t, cur);
    for (int x = threadIdx.x; x < G * HD; x += NT) sq[x] = ldf(p.q + (long long)g * G * HD + x);
    __syncthreads();
    float m[G], ls[G], acc[G][VEC];
#pragma unroll
    for (int h = 0; h < G; ++h) {
      m[h] = -1e30f; ls[h] = 0.f;
#pragma unroll
      for (int e = 0; e < VEC; ++e) acc[h][e] = 0.f;
    }
    const int nact = max(0, min(NW, (ce - cs + PPW - 1) / PPW));   // warps with positions
    for (; j0 < ce; j0 += STEP) {
      const bool more = j0 + STEP < ce;
      if (more) att_load(kb, vb, j0 + STEP, ce, -1, -1, nxt);
      att_pass(cur, sq, j0, ce, scale, m, ls, acc);
      if (more) cur = nxt;
    }
    if (warp < nact) {
#pragma unroll
      for (int h = 0; h < G; ++h)   // slots of a warp -> slot 0
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
          float tot = acc[h][e];
#pragma unroll
          for (int so = 1; so < VS; ++so) tot += __shfl_down_sync(0xffffffffu, acc[h][e], so * VCH);
          acc[h][e] = tot;
        }
      if (lane < VCH) {
#pragma unroll
        for (int h = 0; h < G; ++h)
#pragma unroll
          for (int e = 0; e < VEC; ++e) wacc[(warp * G + h) * HD + ch * VEC + e] = acc[h][e];
      }
      if (lane == 0) {
#pragma unroll
        for (int h = 0; h < G; ++h) { wm[warp * G + h] = m[h]; wl[warp * G + h] = ls[h]; }
      }
    }
    __syncthreads();
    for (int x = threadIdx.x; x < G * HD; x += NT) {
      const int h = x / HD, d = x % HD;
      float M = -1e30f;
      for (int w = 0; w < nact; ++w) M = fmaxf(M, wm[w * G + h]);
      float A = 0.f, Ls = 0.f;
      for (int w = 0; w < nact; ++w) {
        const float e = expf(wm[w * G + h] - M);
        A += wacc[(w * G + h) * HD + d] * e;
        Ls += wl[w * G + h] * e;
      }
      float* o = p.attp + ((long long)(g * NCH + c) * G + h) * ATTP;
      o[d] = A;
      if (d == 0) { o[HD] = M; o[HD + 1] = Ls; }
    }
  }
  signal_lanes(p, C_ATT, UPL_ATT, ua, ub);
  tmark(p, n, ph, 2);
}

