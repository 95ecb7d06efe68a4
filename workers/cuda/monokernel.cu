// monokernel.cu: the whole decode loop of one rank in one persistent kernel (docs/monokernel.md).
// One block per SM, all resident (cooperative launch). Per token and layer five phases:
//   QKV  (attention norm, q/k/v rows, RoPE, KV append)      units: pairs of rows
//   ATT  (attention over the KV cache, split by positions)   units: (kv head, chunk)
//   WO   (output projection + DTP combine into the residual) units: 4 rows
//   W13  (ffn norm, gate/up rows, silu * up)                 units: (w1 row, w3 row)
//   W2   (down projection + DTP combine)                     units: 2 rows
// then LM (final norm and lane mean, LM head rows, the last block samples). No grid-wide barrier:
// each block waits on per-(phase, lane) counters for exactly the lanes it reads, after it has asked
// L2 for the first bytes of its own next weights.
//
// One translation unit in several files: build.py inlines the quoted includes in place (nvcc finds
// them next to this file). Each part uses what comes before it, so the includes' order is the order
// of the definitions:
//   common.cuh        CFG_* configuration, storage types, conversions, memory helpers (with prefill.cu)
//   mk_layout.cuh     rank count, units and weight layout, counters, shared-memory plan, Params, marks
//   mk_multirank.cuh  exchanges between ranks (KOG_NRANKS > 1): epochs, LL words, mr_lane_sum
//   mk_helpers.cuh    input planes, dot products, block ranges, counter wait (wait_lanes), block_sum, warp_dot
//   mk_norms.cuh      residual reads (hval), stage_norms, stage_norms2, final_norms, writer_mask
//   mk_combine.cuh    producers' combine, counter signal, wait_delayed, mr_final, KV prefetch
//   this file         the phase QKV
//   mk_att.cuh        the attention phase (phase_att)
//   this file         the phases WO (with wo_stage_combine), W13, W2
//   mk_lm.cuh         the LM head and sampling (sample_full, phase_lm)
//   this file         the kernel (monokernel) and monokernel_info
#include "common.cuh"
#define NEG_INF __int_as_float(0xff800000)

using namespace cfg;

#include "mk_layout.cuh"
#include "mk_multirank.cuh"
#include "mk_helpers.cuh"
#include "mk_norms.cuh"
#include "mk_combine.cuh"

// Lane skew: the upper half of the lanes (CFG_SKEW_GROUPS 2) starts layer SKEW_I (the first whose residual
// needs no other lane's partial of the same layer) CFG_SKEW_NS later than the lower half. The halves' dependent chains then
// stay apart, so one half's latency-bound steps (norm staging, attention, the small QKV and WO phases) run
// while the other half streams W13 / W2 and the HBM idles less (2B on one H200: +2%, docs/monokernel.md).
#ifndef CFG_SKEW_NS
#define CFG_SKEW_NS 0
#endif
#ifndef CFG_SKEW_GROUPS
#define CFG_SKEW_GROUPS 2   // lane groups g = 0..G-1 (by lane index) start g / (G - 1) * CFG_SKEW_NS late (measured: 2)
#endif
constexpr int SKEW_G = CFG_SKEW_GROUPS < 2 ? 2 : (CFG_SKEW_GROUPS > L ? (L < 2 ? 2 : L) : CFG_SKEW_GROUPS);
constexpr long long SKEW_NS = L >= 2 ? CFG_SKEW_NS : 0;
constexpr int SKEW_I = (USE_COMM && USE_EARLY && LG > 1 && DELTA < NL) ? DELTA : 0;
// ---- phases ------------------------------------------------------------------------------------
__device__ void phase_qkv(const Params& p, float* sm, int n, int i, int t, int tok, bool prefilled) {
  int ua, ub;
  const int ph = 5 * i;
  tmark(p, n, ph, 0);
  brange(U_QKV, ua, ub);
  const long long E = (long long)i * LAYER_SZ + OFF_QKV;   // element index of the region (p.w, p.ws)
  const wt* W = p.w + E;                                    // (plain storage only: wbuf_fill, PFS > 0)
  const int nbuf = wbuf_fill(sm, W + (long long)ua * UE_QKV, ub - ua, UE_QKV, !prefilled);
  if (!prefilled) prefetch_w(p, E + (long long)(ua + nbuf) * UE_QKV, (long long)(ub - ua - nbuf) * UE_QKV, PF);
  if (ua >= ub) return;
  const int l0 = ua / UPL_QKV, l1 = (ub - 1) / UPL_QKV;
  float* red = sm + SM_MAIN - 16 * 8 - 16;
  const int s = 2 * i;
  if (NORM2 && !prefilled) norm_g_load(sm, p.norms + (long long)(i * 2 + 0) * L * D, l0, l1 - l0 + 1);
  if (WAITER && s > 0) {
    const u64 tgt = (u64)(n * NL + i) * UPL_W2;    // W2 of layer i-1 done
    if (fused_step(s)) wait_lanes(p, C_W2, l0, l1, tgt);
    else wait_lanes(p, C_W2, 0, L - 1, tgt);
  }
  if constexpr (SKEW_NS > 0) {
    const int grp = min(SKEW_G - 1, l0 / (L / SKEW_G > 0 ? L / SKEW_G : 1));   // the block's lane group
    if (i == SKEW_I && grp > 0 && threadIdx.x == 0) {
      const u64 wait_ns = (u64)(SKEW_NS * grp / (SKEW_G - 1));
      const u64 t0 = gtimer();
      while (gtimer() - t0 < wait_ns) {}
    }
  }
  __syncthreads();
  tmark(p, n, ph, 1);
  cp_async_wait_all();
  if (NORM2) stage_norms2(p, sm, s, l0, l1 - l0 + 1, tok, writer_mask(l0, l1, UPL_QKV, ua, ub), red);
  else stage_norms(p, sm, s, l0, l1 - l0 + 1, p.norms + (long long)(i * 2 + 0) * L * D, tok,
                   writer_mask(l0, l1, UPL_QKV, ua, ub), red);
  tmark(p, n, ph, 3);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  for (int u = ua + warp; u < ub; u += NW) {
    const int l = u / UPL_QKV, row = 2 * (u % UPL_QKV);
    int r = row, region = 0;
    if (r >= HDL) { r -= HDL; region = 1; if (r >= KVDL) { r -= KVDL; region = 2; } }
    const int hh = r / HD, dd = r % HD;
    float2 cs = make_float2(1.f, 0.f);
    if (lane == 0 && region < 2) cs = p.rope[(long long)t * (HD / 2) + dd / 2];
    float acc[2];
    if (u - ua < nbuf) warp_dot<2, D, true>((const wt*)(sm + WBUF_OFF) + (long long)(u - ua) * UE_QKV, 2, sm + (l - l0) * D, acc);
    else wdot<2, D, CFG_UB_QKV>(p, E + ((long long)l * RQKV + row) * D, 2, sm + (l - l0) * D, acc);
    if (lane == 0) {
      float x0 = acc[0], x1 = acc[1];
      if (CFG_BIAS) {   // Qwen2's q/k/v biases: after the projection, before RoPE
        const float* b = p.bias + ((long long)i * L + l) * RQKV + row;
        x0 += b[0]; x1 += b[1];
      }
      if (region < 2) {
        const float c = cs.x, sn = cs.y;
        const float y0 = x0 * c - x1 * sn, y1 = x0 * sn + x1 * c;
        x0 = y0; x1 = y1;
      }
      if (region == 0) {
        float* q = p.q + (long long)(l * HL + hh) * HD + dd;
        q[0] = x0; q[1] = x1;
      } else {
        const int g = l * KVL + hh;
        wt* c = (region == 1 ? p.kc : p.vc) + (((long long)i * KV + g) * p.max_seq + t) * HD + dd;
        c[0] = f2w(x0); c[1] = f2w(x1);
      }
    }
  }
  prefetch_kv(p, i, t);
  tmark(p, n, ph, 4);
  signal_lanes(p, C_QKV, UPL_QKV, ua, ub);
  tmark(p, n, ph, 2);
}

#include "mk_att.cuh"

// The output projection's combine inputs (residual base, delayed lanes' term) of the block's WO rows
// [ua, ub), staged into shared memory (CB_OFF) at WO's entry, while attention may still run. Staged when
// attention started instead (its wait and round trip then ahead of attention's own), 2B on one H200 ran
// 792.1 / 797.0 / 788.7 tokens/s against 809.4 / 809.5 / 816.7 (sixth session).
__device__ void wo_stage_combine(const Params& p, float* sm, int n, int i, int tok, int ua, int ub) {
  const int l0 = ua / UPL_WO, l1 = (ub - 1) / UPL_WO;
  if (WAITER) {
    wait_delayed(p, C_WO, UPL_WO, n, i);
    if (i > 0) {   // the residual base h[2i] of the block's lanes: W2(i-1), or the QKV(i) writer block
      if (fused_step(2 * i)) wait_lanes(p, C_W2, l0, l1, (u64)(n * NL + i) * UPL_W2);
      else wait_lanes(p, C_QKV, l0, l1, (u64)(n * NL + i + 1) * UPL_QKV);
    }
  }
  __syncthreads();
  stage_combine(p, sm + CB_OFF, i, 0, ua, ub, NR_WO, UPL_WO, tok);
}

__device__ void phase_wo(const Params& p, float* sm, int n, int i, int t, int tok) {
  int ua, ub;
  const int ph = 5 * i + 2;
  tmark(p, n, ph, 0);
  brange(U_WO, ua, ub);
  const long long E = (long long)i * LAYER_SZ + OFF_WO;
  const int nbuf = wbuf_fill(sm, p.w + E + (long long)ua * UE_WO, ub - ua, UE_WO, false);   // issued by ATT
  const MrPost mp = mr_post(p, 0, n, i);
  if (ua >= ub) return;
  const int l0 = ua / UPL_WO, l1 = (ub - 1) / UPL_WO;
  float* cb = sm + CB_OFF;
  wo_stage_combine(p, sm, n, i, tok, ua, ub);
  if (WAITER) wait_lanes(p, C_ATT, l0, l1, (u64)(n * NL + i + 1) * UPL_ATT);
  __syncthreads();
  tmark(p, n, ph, 1);
  // attention outputs of the block's lanes, merged over the position chunks in use (MB a batch: the
  // batch's loads in flight together, one rescale a batch)
  int lo, CH;
  const int nch = att_split(i, t, lo, CH);
  constexpr int MB = NCH < 8 ? NCH : 8;
  for (int l = l0; l <= l1; ++l)
    for (int x = threadIdx.x; x < HDL; x += NT) {
      const int hh = x / HD, d = x % HD, qh = l * HL + hh, g = qh / G, hg = qh % G;
      const float* a = p.attp + ((long long)g * NCH * G + hg) * ATTP;
      float M = -1e30f, A = 0.f, Ls = 0.f;
      for (int c0 = 0; c0 < nch; c0 += MB) {
        float mc[MB], ac[MB], lc[MB];
#pragma unroll
        for (int k = 0; k < MB; ++k) {
          const float* ach = a + (long long)(c0 + k) * G * ATTP;
          const bool in = c0 + k < nch;
          mc[k] = in ? ldf(ach + HD) : -1e30f; ac[k] = in ? ldf(ach + d) : 0.f; lc[k] = in ? ldf(ach + HD + 1) : 0.f;
        }
        float Mb = M;
#pragma unroll
        for (int k = 0; k < MB; ++k) Mb = fmaxf(Mb, mc[k]);
        const float r = expf(M - Mb);
        A *= r; Ls *= r;
#pragma unroll
        for (int k = 0; k < MB; ++k) {
          const float e = expf(mc[k] - Mb);
          A += ac[k] * e;
          Ls += lc[k] * e;
        }
        M = Mb;
      }
      sm[(l - l0) * HDL + xp(x, HDL)] = A / Ls;
    }
  cp_async_wait_all();
  reset_units();
  __syncthreads();
  tmark(p, n, ph, 3);
  combine_rows<NR_WO, HDL, CFG_UB_WO>(p, sm, E, i, 0, ua, ub, nbuf, l0, cb, mp);
  tmark(p, n, ph, 4);
  signal_lanes(p, C_WO, UPL_WO, ua, ub);
  tmark(p, n, ph, 2);
}

__device__ void phase_w13(const Params& p, float* sm, int n, int i, int tok) {
  int ua, ub;
  const int ph = 5 * i + 3;
  tmark(p, n, ph, 0);
  brange(U_W13, ua, ub);
  const long long E = (long long)i * LAYER_SZ + OFF_W13;
  const int nbuf = wbuf_fill(sm, p.w + E + (long long)ua * UE_W13, ub - ua, UE_W13, true);
  prefetch_w(p, E + (long long)(ua + nbuf) * UE_W13, (long long)(ub - ua - nbuf) * UE_W13, PF);
  if (ua >= ub) return;
  const int l0 = ua / UPL_W13, l1 = (ub - 1) / UPL_W13;
  float* red = sm + SM_MAIN - 16 * 8 - 16;
  const int s = 2 * i + 1;
  if (NORM2) norm_g_load(sm, p.norms + (long long)(i * 2 + 1) * L * D, l0, l1 - l0 + 1);
  reset_units();   // read after the barriers below
  if (WAITER) {
    const u64 tgt = (u64)(n * NL + i + 1) * UPL_WO;
    if (fused_step(s)) wait_lanes(p, C_WO, l0, l1, tgt);
    else wait_lanes(p, C_WO, 0, L - 1, tgt);
  }
  __syncthreads();
  tmark(p, n, ph, 1);
  cp_async_wait_all();
  if (NORM2) stage_norms2(p, sm, s, l0, l1 - l0 + 1, tok, writer_mask(l0, l1, UPL_W13, ua, ub), red);
  else stage_norms(p, sm, s, l0, l1 - l0 + 1, p.norms + (long long)(i * 2 + 1) * L * D, tok,
                   writer_mask(l0, l1, UPL_W13, ua, ub), red);
  tmark(p, n, ph, 3);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  for (int u = ua + warp; u < ub; u = next_unit(u, ua, &unit_q)) {
    const int l = u / UPL_W13, j = u % UPL_W13;
    float acc[2];
    if (u - ua < nbuf) warp_dot<2, D, true>((const wt*)(sm + WBUF_OFF) + (long long)(u - ua) * UE_W13, 2, sm + (l - l0) * D, acc);
    else wdot<2, D>(p, E + ((long long)l * FL + j) * 2 * D, 2, sm + (l - l0) * D, acc);
    if (lane == 0) p.hid[(long long)l * FL + j] = acc[0] / (1.0f + expf(-acc[0])) * acc[1];
  }
  tmark(p, n, ph, 4);
  signal_lanes(p, C_W13, UPL_W13, ua, ub);
  tmark(p, n, ph, 2);
}

__device__ void phase_w2(const Params& p, float* sm, int n, int i, int tok) {
  int ua, ub;
  const int ph = 5 * i + 4;
  tmark(p, n, ph, 0);
  brange(U_W2, ua, ub);
  const long long E = (long long)i * LAYER_SZ + OFF_W2;
  const int nbuf = wbuf_fill(sm, p.w + E + (long long)ua * UE_W2, ub - ua, UE_W2, true);
  prefetch_w(p, E + (long long)(ua + nbuf) * UE_W2, (long long)(ub - ua - nbuf) * UE_W2, PF);
  const MrPost mp = mr_post(p, 1, n, i);
  if (ua >= ub) return;
  const int l0 = ua / UPL_W2, l1 = (ub - 1) / UPL_W2;
  float* cb = sm + CB_OFF;
  if (WAITER) {
    wait_delayed(p, C_W2, UPL_W2, n, i);
    // the residual base h[2i+1] of the block's lanes: WO(i), or the W13(i) writer block
    if (fused_step(2 * i + 1)) wait_lanes(p, C_WO, l0, l1, (u64)(n * NL + i + 1) * UPL_WO);
    else wait_lanes(p, C_W13, l0, l1, (u64)(n * NL + i + 1) * UPL_W13);
  }
  __syncthreads();
  stage_combine(p, cb, i, 1, ua, ub, NR_W2, UPL_W2, tok);
  if (WAITER) wait_lanes(p, C_W13, l0, l1, (u64)(n * NL + i + 1) * UPL_W13);
  __syncthreads();
  tmark(p, n, ph, 1);
  for (int l = l0; l <= l1; ++l)
    for (int x = threadIdx.x; x < FL; x += NT) sm[(l - l0) * FL + xp(x, FL)] = ldf(p.hid + (long long)l * FL + x);
  cp_async_wait_all();
  reset_units();
  __syncthreads();
  tmark(p, n, ph, 3);
  combine_rows<NR_W2, FL, CFG_UBMAX>(p, sm, E, i, 1, ua, ub, nbuf, l0, cb, mp);
  tmark(p, n, ph, 4);
  signal_lanes(p, C_W2, UPL_W2, ua, ub);
  tmark(p, n, ph, 2);
}

#include "mk_lm.cuh"

#if CFG_PCONST
extern "C" __global__ void __launch_bounds__(NT, 512 / NT) monokernel(const __grid_constant__ Params pv) {
  const Params* __restrict__ pp = &pv;
#else
extern "C" __global__ void __launch_bounds__(NT, 512 / NT) monokernel(const Params* __restrict__ pp) {
#endif
  extern __shared__ float4 smem4[];
  float* sm = reinterpret_cast<float*>(smem4);
  __shared__ int tok_s, stop_s;
#if CFG_PCONST
  Params& ps = ps_s;
#else
  __shared__ Params ps;
#endif
  for (int x = threadIdx.x; x < (int)(sizeof(Params) / 8); x += blockDim.x)
    reinterpret_cast<u64*>(&ps)[x] = reinterpret_cast<const u64*>(pp)[x];
  __syncthreads();
#if CFG_PCONST
  const Params& p = pv;
#else
  const Params& p = ps;
#endif
#if KOG_NRANKS > 1
  for (int x = threadIdx.x; x < (int)(sizeof(KcclDev) / 8); x += blockDim.x)
    reinterpret_cast<u64*>(&kds)[x] = reinterpret_cast<const u64*>(p.kd)[x];
  if (threadIdx.x == 0) mr_cancel_s = 0;
  __syncthreads();
#endif
  int tok = (int)p.first_token;
  for (int n = 0; n < p.max_new; ++n) {
    const int t = (int)p.start_pos + n;
#if KOG_NRANKS > 1
    if (threadIdx.x == 0) mr_n_s = n;    // read by hval / stage_combine (after the barriers below)
    __syncthreads();
#endif
    if (n > 0) {
      // next token's first weights into L2, then wait for the sampler
      int ua, ub;
      brange(U_QKV, ua, ub);
      const int nb = wbuf_fill(sm, p.w + (long long)ua * UE_QKV, ub - ua, UE_QKV, true);
      prefetch_w(p, (long long)(ua + nb) * UE_QKV, (long long)(ub - ua - nb) * UE_QKV, PF);
      if (NORM2 && ua < ub)   // layer 0's norm weights do not depend on the token
        norm_g_load(sm, p.norms, ua / UPL_QKV, (ub - 1) / UPL_QKV - ua / UPL_QKV + 1);
      tmark(p, n, 5 * NL + 1, 0);
      if (threadIdx.x == 0) {
        const u64 w = SPIN(p, CTR(p, C_TOKVAL), (u64)n << 32);   // the token word: no second round trip
        tok_s = (int)(w & 0xffffffu);
        stop_s = (int)((w >> 24) & 0xffu);
#if KOG_NRANKS > 1
        if (mr_dead()) stop_s = 5;         // a kccl wait failed: the host reads comm.status
#endif
      }
      __syncthreads();
      if (stop_s) { cp_async_wait_all(); return; }
      tok = tok_s;
      tmark(p, n, 5 * NL + 1, 1);
    }
    for (int i = 0; i < NL; ++i) {
      phase_qkv(p, sm, n, i, t, tok, n > 0 && i == 0);
      phase_att(p, sm, n, i, t, tok);
      phase_wo(p, sm, n, i, t, tok);
      phase_w13(p, sm, n, i, tok);
      phase_w2(p, sm, n, i, tok);
#if KOG_NRANKS > 1
      if (mr_bail()) return;
#endif
    }
    phase_lm(p, sm, n, tok);
#if KOG_NRANKS > 1
    if (mr_bail()) return;
#endif
  }
}

extern "C" __global__ void monokernel_info(long long* out) {
  out[0] = SM_FLOATS * 4;   // dynamic shared memory bytes
  out[1] = NCTR;
  out[2] = NCH;
  out[3] = VPOW2;
  out[4] = sizeof(Params);
  out[5] = LAYER_SZ;
#if KOG_NRANKS > 1
  out[6] = NPOST;
  out[7] = FIN_FLOATS;
  out[8] = FIN_WORDS;
#endif
}
