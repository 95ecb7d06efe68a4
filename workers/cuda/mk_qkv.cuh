// mk_qkv.cuh: part of monokernel.cu (pasted in place after mk_combine.cuh; not a standalone header).
// The first phase of a layer: attention norm, q/k/v rows, RoPE, KV append (units: pairs of rows), and
// the lane skew that delays the upper lanes' start of layer SKEW_I.
#pragma once

// Lane skew: the upper half of the lanes starts layer SKEW_I (the first whose residual
// needs no other lane's partial of the same layer) CFG_SKEW_NS later than the lower half. The halves' dependent chains then
// stay apart, so one half's latency-bound steps (norm staging, attention, the small QKV and WO phases) run
// while the other half streams W13 / W2 and the HBM idles less (docs/monokernel.md, "Lane skew").
#ifndef CFG_SKEW_NS
#define CFG_SKEW_NS 0
#endif
// lane groups g = 0..G-1 (by lane index) start g / (G - 1) * SKEW_NS late: two halves (4 groups measured
// neutral: docs/lab/benchmarks-2026-11.md)
constexpr int SKEW_G = 2;
constexpr long long SKEW_NS = L >= 2 ? CFG_SKEW_NS : 0;
constexpr int SKEW_I = (USE_COMM && USE_EARLY && LG > 1 && DELTA < NL) ? DELTA : 0;
__device__ void phase_qkv(const Params& p, float* sm, int n, int i, int t, int tok, bool prefilled) {
  const int ph = 5 * i;
  // prefilled: the token loop issued layer 0's copies and prefetch during the token wait
  const auto [E, ua, ub, nbuf] = phase_begin<U_QKV, UE_QKV, OFF_QKV>(p, sm, n, i, ph, !prefilled, !prefilled);
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
  if (!KVPF_W2 || i == 0) prefetch_kv(p, i, t);   // before the rows: after them, the blocks with attention units ended QKV last
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
    if constexpr (QCOPY) wdotq_unit<2, D, UE_QKV, CFG_UB_QKV>(p, sm, E + (long long)ua * UE_QKV, nbuf, u - ua,
                                                         E + ((long long)l * RQKV + row) * D, 2, sm + (l - l0) * D, acc);
    else if (u - ua < nbuf) wdot_buf<2, D, UE_QKV>(sm, E + (long long)ua * UE_QKV, nbuf, u - ua, 2, sm + (l - l0) * D, acc);
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
  tmark(p, n, ph, 4);
  signal_lanes(p, C_QKV, UPL_QKV, ua, ub);
  tmark(p, n, ph, 2);
}
