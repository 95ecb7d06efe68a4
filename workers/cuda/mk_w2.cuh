// mk_w2.cuh: part of monokernel.cu (pasted in place after mk_w13.cuh; not a standalone header).
// The down projection (units: NR_W2 rows) and the DTP combine into the residual.
#pragma once

__device__ void phase_w2(const Params& p, float* sm, int n, int i, int t, int tok) {
  const int ph = 5 * i + 4;
  const auto [E, ua, ub, nbuf] = phase_begin<U_W2, UE_W2, OFF_W2>(p, sm, n, i, ph, true, true);
  if (KVPF_W2 && i + 1 < NL) prefetch_kv(p, i + 1, t);   // the next layer's cached keys and values into L2
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
    for (int q = threadIdx.x; q < FL / 4; q += NT) {   // four floats a thread: one load round, not FL / NT
      const int2 xs = stage4<FL>(q);
      *reinterpret_cast<float4*>(sm + (l - l0) * FL + 4 * xs.y) =
          __ldcg(reinterpret_cast<const float4*>(p.hid + (long long)l * FL + xs.x));
    }
  combine_phase_end<NR_W2, FL>(p, sm, n, ph, E, i, 1, ua, ub, nbuf, l0, cb, mp);
}
