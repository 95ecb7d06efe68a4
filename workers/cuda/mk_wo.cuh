// mk_wo.cuh: part of monokernel.cu (pasted in place after mk_att.cuh; not a standalone header).
// The output projection: the merge of attention's position chunks, WO rows (units: NR_WO rows) and the
// DTP combine into the residual.
#pragma once

// The output projection's combine inputs (residual base, delayed lanes' term) of the block's WO rows
// [ua, ub), staged into shared memory (CB_OFF) at WO's entry, while attention may still run. Staged when
// attention started instead, its wait and round trip came ahead of attention's own and the kernel ran
// slower (docs/monokernel.md, sixth session).
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
  const int ph = 5 * i + 2;
  const auto [E, ua, ub, nbuf] = phase_begin<U_WO, UE_WO, OFF_WO>(p, sm, n, i, ph, false, false);   // issued by ATT
  const MrPost mp = mr_post(p, 0, n, i);
  if (ua >= ub) return;
  const int l0 = ua / UPL_WO, l1 = (ub - 1) / UPL_WO;
  float* cb = sm + CB_OFF;
  wo_stage_combine(p, sm, n, i, tok, ua, ub);
  const bool merged = ATT_MERGE && att_long(i, t);   // by att_merge_step, into p.q
  if (merged) {
    for (int g = threadIdx.x; g < KV; g += NT) SPIN(p, ATT_DONE(p, i, g), (u64)n + 1);
  } else if (WAITER) {
    wait_lanes(p, C_ATT, l0, l1, (u64)(n * NL + i + 1) * UPL_ATT);
  }
  __syncthreads();
  tmark(p, n, ph, 1);
  // attention outputs of the block's lanes, merged over the position chunks in use (mk_att.cuh merge_range),
  // four elements of a head a thread: HDL / 4 threads, one round of loads where HDL > NT; or merged already
  if (merged) {
    for (int q = threadIdx.x; q < HDL / 4; q += NT) {
      const int2 xs = stage4<HDL>(q);
      *reinterpret_cast<float4*>(sm + 4 * xs.y) = __ldcg(reinterpret_cast<const float4*>(p.q + xs.x));
    }
  } else {
    int lo, CH;
    const int nch = att_split(i, t, lo, CH);
    for (int l = l0; l <= l1; ++l)
      for (int q = threadIdx.x; q < HDL / 4; q += NT) {
        const int2 xs = stage4<HDL>(q);
        const int qh = l * HL + xs.x / HD;
        float M = -1e30f, Ls = 0.f;
        float4 A = make_float4(0.f, 0.f, 0.f, 0.f);
        merge_range(p.attp, qh / G, (qh % G) * HD + xs.x % HD, 0, nch, M, Ls, A);
        *reinterpret_cast<float4*>(sm + (l - l0) * HDL + 4 * xs.y) = make_float4(A.x / Ls, A.y / Ls, A.z / Ls, A.w / Ls);
      }
  }
  combine_phase_end<NR_WO, HDL>(p, sm, n, ph, E, i, 0, ua, ub, nbuf, l0, cb, mp);
}
