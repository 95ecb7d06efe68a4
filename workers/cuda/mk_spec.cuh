// mk_spec.cuh: part of monokernel.cu (pasted in place after mk_lm.cuh when CFG_SPEC > 0; not a standalone
// header). The verify pass of speculative decoding (issue 33, docs/monokernel.md "A verify pass of P
// positions"): the layers' phases of the token loop for up to SP positions at once (the last sampled token
// and its draft tokens), one lane, one rank. Every weight row streams once a pass and is dotted with the
// SP inputs while its 16 bytes sit in registers. Each position's arithmetic is the plain phases' (the same
// dot products in the same order, the same norms, attention split and merge), so a position's logits are
// bitwise those plain steps give there and the ids cannot depend on the drafts (tests/test_cuda_spec.py).
// The row loops: mk_spec_rows.cuh; the LM head, the acceptance and the drafting: mk_spec_lm.cuh.
#pragma once

static_assert(L == 1 && KOG_NRANKS == 1, "speculative verify passes: one-lane models on one rank");
// CFG_SPEC_NOINL 1: the pass's phases out of line (reading Params from the shared copy, as phase_att does), so
// that the plain phases a pass of one runs keep the plain build's registers (with them inline the kernel's
// spills grow several-fold and a Llama-3.2-1B pass of one costs 1.36 plain tokens). Llama-3.2-1B shape,
// 2026-12-03, one run: passes of 1 / 2 / 6 at 1.39 / 1.50 / 2.48x against 1.37 / 1.71 / 2.63x inline; SmolLM2,
// 2026-12-04: 13-22% dearer out of line at every size, so a knob, off (BENCHMARKS.md, "Results of 2026-12-04").
#ifndef CFG_SPEC_NOINL
#define CFG_SPEC_NOINL 0
#endif
#if CFG_SPEC_NOINL
#define SPEC_PHASE __device__ __noinline__
#define SPEC_PARAMS(x) NOINL_PARAMS(x)
#else
#define SPEC_PHASE __device__
#define SPEC_PARAMS(x) x
#endif
constexpr int SP = CFG_SPEC;                                 // positions a pass at most
constexpr int KMAX = cmax(cmax(D, HDL), FL);                 // a position's input plane (floats)
constexpr int S_CB = cmax(SP * KMAX, SM_ATT);                // [SP][CB_ROWS] residual bases of the block's rows
constexpr int S_RED = S_CB + SP * CB_ROWS;                   // [NW][SP] norm sums, then [SP] 1 / rms
constexpr int SPEC_FLOATS = cmax(S_RED + NW * SP + 32, SM_FLOATS);   // (a pass of one runs the plain phases)
static_assert(SPEC_FLOATS * 4 <= 225 * 1024, "shared memory: fewer speculative positions (CFG_SPEC)");
constexpr long long S_ATT = (long long)KV * NCH * G * ATTP;  // a position's attention partials
// the residual of position j at version s (SP copies of the one-token hres)
__device__ __forceinline__ float* s_hres(const Params& p, int j, int s) {
  return p.hres + ((long long)j * (2 * NL + 1) + s) * D;
}
__device__ __forceinline__ float s_hbase(const Params& p, int s, int j, int d, const int* ids) {
  if (s == 0) return w2f(p.emb[(long long)ids[j] * D + d]);
  return ldf(s_hres(p, j, s) + d);
}

#include "mk_spec_rows.cuh"

// ---- the norms of np residuals at version s (stage_norms' arithmetic, one block reduction for all) -----
// (every position's loads in flight at once: one L2 round trip, not one a position; the positions' warp sums
// interleaved; thread j sums position j's warp totals in stage_norms' order and shares its 1 / rms, instead of
// every thread summing every position's one after another)
template <int P>
__device__ void spec_norms_p(const Params& p, float* sm, int s, int np, const int* ids, const float* g) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  float* red = sm + S_RED;
  float* inv = red + NW * SP;        // [SP] each position's 1 / rms
  __syncthreads();   // the waiter's wait for the residual
  float v[P][DPT];
#pragma unroll
  for (int j = 0; j < P; ++j)
#pragma unroll
    for (int e = 0; e < DPT; ++e) {
      const int d = threadIdx.x + e * NT;
      v[j][e] = (j < np && d < D) ? s_hbase(p, s, j, d, ids) : 0.f;
    }
  float gv[DPT];
#pragma unroll
  for (int e = 0; e < DPT; ++e) {
    const int d = threadIdx.x + e * NT;
    gv[e] = d < D ? __ldg(g + d) : 0.f;
  }
  float ss[P];
#pragma unroll
  for (int j = 0; j < P; ++j) {
    ss[j] = 0.f;
#pragma unroll
    for (int e = 0; e < DPT; ++e)
      if (threadIdx.x + e * NT < D) ss[j] += v[j][e] * v[j][e];
  }
#pragma unroll
  for (int j = 0; j < P; ++j) ss[j] = warp_sum(ss[j]);
  __syncthreads();   // the previous user of red and of the planes is done
  if (lane == 0)
#pragma unroll
    for (int j = 0; j < P; ++j)
      if (j < np) red[warp * SP + j] = ss[j];
  __syncthreads();
  if (threadIdx.x < np) {
    float tot = 0.f;
#pragma unroll
    for (int w = 0; w < NW; ++w) tot += red[w * SP + threadIdx.x];
    inv[threadIdx.x] = 1.0f / sqrtf(tot / (float)D + EPS);
  }
  __syncthreads();
#pragma unroll
  for (int j = 0; j < P; ++j) {
    if (j >= np) break;
    const float r = inv[j];
#pragma unroll
    for (int e = 0; e < DPT; ++e) {
      const int d = threadIdx.x + e * NT;
      if (d < D) sm[j * KMAX + xp(d, D)] = (v[j][e] * r) * gv[e];
    }
  }
  __syncthreads();
}
// a pass's positions rounded up as the row loops' (psize): a pass of two does two warp sums, not SP
__device__ void spec_norms(const Params& p, float* sm, int s, int np, const int* ids, const float* g) {
  const int ps = psize(np);
  if (ps <= PS2) spec_norms_p<PS2>(p, sm, s, np, ids, g);
  else if (ps <= PS4) spec_norms_p<PS4>(p, sm, s, np, ids, g);
  else spec_norms_p<SP>(p, sm, s, np, ids, g);
}

// ---- QKV: attention norm, q/k/v rows, RoPE at each position, KV append at t + j ----------------------
SPEC_PHASE void spec_qkv(const Params& p_, float* sm, int n, int i, int t, int np, const int* ids) {
  const Params& p = SPEC_PARAMS(p_);
  int ua, ub;
  tmark(p, n, 5 * i, 0);
  brange(U_QKV, ua, ub);
  const long long E = (long long)i * LAYER_SZ + OFF_QKV;
  if (!(n > 0 && i == 0)) prefetch_w(p, E + (long long)ua * UE_QKV, (long long)(ub - ua) * UE_QKV, PF);
  if (ua >= ub) return;
  if (WAITER && i > 0) wait_lanes(p, C_W2, 0, 0, (u64)(n * NL + i) * UPL_W2);
  tmark(p, n, 5 * i, 1);
  spec_norms(p, sm, 2 * i, np, ids, p.norms + (long long)(i * 2 + 0) * L * D);
  tmark(p, n, 5 * i, 3);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  for (int u = ua + warp; u < ub; u += NW) {
    const int row = 2 * u;
    int r = row, region = 0;
    if (r >= HDL) { r -= HDL; region = 1; if (r >= KVDL) { r -= KVDL; region = 2; } }
    const int hh = r / HD, dd = r % HD;
    float acc[SP][2];
    wdot_p<2, D, CFG_UB_QKV>(p, E + (long long)row * D, 2, sm, np, acc);
    if (lane == 0)
      for (int j = 0; j < np; ++j) {
        float x0 = acc[j][0], x1 = acc[j][1];
        if (CFG_BIAS) {
          const float* b = p.bias + (long long)i * RQKV + row;
          x0 += b[0]; x1 += b[1];
        }
        if (region < 2) {
          const float2 cs = p.rope[(long long)(t + j) * (HD / 2) + dd / 2];
          const float c = cs.x, sn = cs.y;
          const float y0 = x0 * c - x1 * sn, y1 = x0 * sn + x1 * c;
          x0 = y0; x1 = y1;
        }
        if (region == 0) {
          float* q = p.q + (long long)j * H * HD + (long long)hh * HD + dd;
          q[0] = x0; q[1] = x1;
        } else {
          wt* c = (region == 1 ? p.kc : p.vc) + (((long long)i * KV + hh) * p.max_seq + t + j) * HD + dd;
          c[0] = f2w(x0); c[1] = f2w(x1);
        }
      }
  }
  tmark(p, n, 5 * i, 4);
  signal_lanes(p, C_QKV, UPL_QKV, ua, ub);
  tmark(p, n, 5 * i, 2);
}

// ---- ATT: items (position j, kv head g, chunk c) for the chunks in use at t + j, spread evenly over the
// blocks with a unit (U_ATT <= NB: one each); an item is phase_att's unit at that position. The block that
// finishes the last chunk of (j, g) (a ticket a pair) merges them as phase_wo does and writes the heads'
// outputs over their queries in p.q, so WO reads np inputs in one round trip instead of merging np times.
constexpr int SPEC_TICKETS = 64;   // p.spec words before the (position, kv head) tickets (host.py SPEC_WORDS)
static_assert(SP * KV <= 1024, "p.spec holds 1024 attention tickets");
__device__ __noinline__ void spec_att(const Params& p_, float* sm, int n, int i, int t, int np) {
  const Params& p = NOINL_PARAMS(p_);
  int ua, ub;
  tmark(p, n, 5 * i + 1, 0);
  brange(U_ATT, ua, ub);
  {
    int wa, wb;
    brange(U_WO, wa, wb);
    const long long Eo = (long long)i * LAYER_SZ + OFF_WO;
    prefetch_w(p, Eo + (long long)wa * UE_WO, (long long)(wb - wa) * UE_WO, PF_ATT);
  }
  if (ua >= ub) return;
  static_assert(U_ATT <= NB, "one attention unit a block at most");
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  float* sq = sm;
  float* wacc = sm + G * HD;
  float* wm = wacc + NW * G * HD;
  float* wl = wm + NW * G;
  const float scale = 1.0f / sqrtf((float)HD);
  const int ch = lane % VCH;
  int W = 0;
  for (int j = 0; j < np; ++j) {
    int lo, CH;
    W += KV * att_split(i, t + j, lo, CH);
  }
  const int q0 = (int)((long long)ua * W / U_ATT), q1 = (int)((long long)(ua + 1) * W / U_ATT);
  if (threadIdx.x == 0) SPIN(p, CTR(p, C_QKV * L), (u64)(n * NL + i + 1) * UPL_QKV);
  __syncthreads();
  tmark(p, n, 5 * i + 1, 1);
  for (int it = q0; it < q1; ++it) {
    int j = 0, r = it, nj;
    for (;;) {   // the item's position: items run position by position, kv head by kv head
      int lo, CH;
      nj = att_split(i, t + j, lo, CH);
      if (r < KV * nj || j == np - 1) break;
      r -= KV * nj;
      ++j;
    }
    const int g = r / nj, c = r % nj, tj = t + j;
    int cs, ce;
    att_chunk(i, tj, c, cs, ce);
    const wt* kb = p.kc + ((long long)i * KV + g) * p.max_seq * HD;
    const wt* vb = p.vc + ((long long)i * KV + g) * p.max_seq * HD;
    constexpr int STEP = NW * PPW;
    int j0 = cs + warp * PPW;
    AttRows cur, nxt;
    att_load(kb, vb, j0, ce, -1, -1, cur);
    __syncthreads();   // the previous item's merge reads of sq / the scratch
    for (int x = threadIdx.x; x < G * HD; x += NT) sq[x] = ldf(p.q + (long long)j * H * HD + (long long)g * G * HD + x);
    __syncthreads();
    float m[G], ls[G], acc[G][VEC];
#pragma unroll
    for (int h = 0; h < G; ++h) {
      m[h] = -1e30f; ls[h] = 0.f;
#pragma unroll
      for (int e = 0; e < VEC; ++e) acc[h][e] = 0.f;
    }
    const int nact = max(0, min(NW, (ce - cs + PPW - 1) / PPW));
    for (; j0 < ce; j0 += STEP) {
      const bool more = j0 + STEP < ce;
      if (more) att_load(kb, vb, j0 + STEP, ce, -1, -1, nxt);
      att_pass(cur, sq, j0, ce, scale, m, ls, acc);
      if (more) cur = nxt;
    }
    if (warp < nact) {
#pragma unroll
      for (int h = 0; h < G; ++h)
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
    float* const aj = p.attp + j * S_ATT;
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
      float* o = aj + ((long long)(g * NCH + c) * G + h) * ATTP;
      o[d] = A;
      if (d == 0) { o[HD] = M; o[HD + 1] = Ls; }
    }
    // the last chunk block merges them, as att_merge_step does past ATT_MB chunks and phase_wo below that
    // (the same arithmetic, mk_att.cuh att_merge): the plain step's bits
    if (att_last_chunk(reinterpret_cast<u32*>(p.spec) + SPEC_TICKETS + j * KV + g, nj))
      att_merge(aj, p.q + (long long)j * H * HD, g, nj, wacc);
  }
  signal_lanes(p, C_ATT, UPL_ATT, ua, ub);
  tmark(p, n, 5 * i + 1, 2);
}

// ---- WO and W2: the block's rows for np inputs, each added to its position's residual -----------------
// bases of the block's rows [ua, ub) (NR rows a unit) at version s - 1 into cb[j * CB_ROWS + x]
__device__ __forceinline__ void spec_stage_bases(const Params& p, float* cb, int s, int ua, int ub, int nr, int np,
                                                 const int* ids) {
  const int nx = (ub - ua) * nr;
  for (int x = threadIdx.x; x < nx; x += NT) {
    float b[SP];
#pragma unroll
    for (int j = 0; j < SP; ++j) b[j] = j < np ? s_hbase(p, s - 1, j, ua * nr + x, ids) : 0.f;
#pragma unroll
    for (int j = 0; j < SP; ++j)
      if (j < np) cb[j * CB_ROWS + x] = b[j];
  }
}
// a position-major input of K floats a position (global, rows `stride` apart) into the planes of sm
template <int K>
__device__ __forceinline__ void spec_stage_input(float* sm, const float* src, long long stride, int np) {
  for (int q = threadIdx.x; q < K / 4; q += NT) {   // four floats a thread (stage4): fewer load rounds
    const int2 xs = stage4<K>(q);
    float4 v[SP];
#pragma unroll
    for (int j = 0; j < SP; ++j)
      v[j] = j < np ? __ldcg(reinterpret_cast<const float4*>(src + j * stride + xs.x)) : make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int j = 0; j < SP; ++j)
      if (j < np) *reinterpret_cast<float4*>(sm + j * KMAX + 4 * xs.y) = v[j];
  }
}
template <int NR, int K>
__device__ __forceinline__ void spec_rows(const Params& p, const float* sm, long long E, int s, int ua, int ub, int np) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const float* cb = sm + S_CB;
  for (int u = ua + warp; u < ub; u = next_unit(u, ua, &unit_q)) {
    const int r0 = u * NR;
    float acc[SP][NR];
    wdot_p<NR, K>(p, E + (long long)r0 * K, NR, sm, np, acc);
    if (lane < NR)
      for (int j = 0; j < np; ++j) {
        const float pv = pick(acc[j], NR, lane);
        s_hres(p, j, s)[r0 + lane] = cb[j * CB_ROWS + (u - ua) * NR + lane] + pv;
      }
  }
}
SPEC_PHASE void spec_wo(const Params& p_, float* sm, int n, int i, int t, int np, const int* ids) {
  const Params& p = SPEC_PARAMS(p_);
  int ua, ub;
  tmark(p, n, 5 * i + 2, 0);
  brange(U_WO, ua, ub);
  if (ua >= ub) return;
  const long long E = (long long)i * LAYER_SZ + OFF_WO;
  if (WAITER && i > 0) wait_lanes(p, C_W2, 0, 0, (u64)(n * NL + i) * UPL_W2);
  __syncthreads();
  spec_stage_bases(p, sm + S_CB, 2 * i + 1, ua, ub, NR_WO, np, ids);
  if (WAITER) wait_lanes(p, C_ATT, 0, 0, (u64)(n * NL + i + 1) * UPL_ATT);
  __syncthreads();
  tmark(p, n, 5 * i + 2, 1);
  spec_stage_input<HDL>(sm, p.q, (long long)H * HD, np);   // attention's outputs, merged by spec_att
  reset_units();
  __syncthreads();
  tmark(p, n, 5 * i + 2, 3);
  spec_rows<NR_WO, HDL>(p, sm, E, 2 * i + 1, ua, ub, np);
  tmark(p, n, 5 * i + 2, 4);
  signal_lanes(p, C_WO, UPL_WO, ua, ub);
  tmark(p, n, 5 * i + 2, 2);
}

// ---- W13: ffn norm, gate/up rows, silu(gate) * up for np positions -----------------------------------
SPEC_PHASE void spec_w13(const Params& p_, float* sm, int n, int i, int np, const int* ids) {
  const Params& p = SPEC_PARAMS(p_);
  int ua, ub;
  tmark(p, n, 5 * i + 3, 0);
  brange(U_W13, ua, ub);
  const long long E = (long long)i * LAYER_SZ + OFF_W13;
  prefetch_w(p, E + (long long)ua * UE_W13, (long long)(ub - ua) * UE_W13, PF);
  if (ua >= ub) return;
  if (WAITER) wait_lanes(p, C_WO, 0, 0, (u64)(n * NL + i + 1) * UPL_WO);
  tmark(p, n, 5 * i + 3, 1);
  reset_units();
  spec_norms(p, sm, 2 * i + 1, np, ids, p.norms + (long long)(i * 2 + 1) * L * D);
  tmark(p, n, 5 * i + 3, 3);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  for (int u = ua + warp; u < ub; u = next_unit(u, ua, &unit_q)) {
    float acc[SP][2];
    wdot_p<2, D>(p, E + (long long)u * 2 * D, 2, sm, np, acc);
    if (lane == 0)
      for (int j = 0; j < np; ++j) p.hid[(long long)j * FL + u] = acc[j][0] / (1.0f + expf(-acc[j][0])) * acc[j][1];
  }
  tmark(p, n, 5 * i + 3, 4);
  signal_lanes(p, C_W13, UPL_W13, ua, ub);
  tmark(p, n, 5 * i + 3, 2);
}

SPEC_PHASE void spec_w2(const Params& p_, float* sm, int n, int i, int np, const int* ids) {
  const Params& p = SPEC_PARAMS(p_);
  int ua, ub;
  tmark(p, n, 5 * i + 4, 0);
  brange(U_W2, ua, ub);
  const long long E = (long long)i * LAYER_SZ + OFF_W2;
  prefetch_w(p, E + (long long)ua * UE_W2, (long long)(ub - ua) * UE_W2, PF);
  if (ua >= ub) return;
  if (WAITER) wait_lanes(p, C_WO, 0, 0, (u64)(n * NL + i + 1) * UPL_WO);
  __syncthreads();
  spec_stage_bases(p, sm + S_CB, 2 * i + 2, ua, ub, NR_W2, np, ids);
  if (WAITER) wait_lanes(p, C_W13, 0, 0, (u64)(n * NL + i + 1) * UPL_W13);
  __syncthreads();
  tmark(p, n, 5 * i + 4, 1);
  spec_stage_input<FL>(sm, p.hid, FL, np);
  reset_units();
  __syncthreads();
  tmark(p, n, 5 * i + 4, 3);
  spec_rows<NR_W2, FL>(p, sm, E, 2 * i + 2, ua, ub, np);
  tmark(p, n, 5 * i + 4, 4);
  signal_lanes(p, C_W2, UPL_W2, ua, ub);
  tmark(p, n, 5 * i + 4, 2);
}
