// mk_w13.cuh: part of monokernel.cu (pasted in place after mk_wo.cuh; not a standalone header).
// The ffn's first phase: ffn norm, gate/up rows, silu(gate) * up (units: one (w1 row, w3 row) pair).
#pragma once

__device__ void phase_w13(const Params& p, float* sm, int n, int i, int tok) {
  const int ph = 5 * i + 3;
  const auto [E, ua, ub, nbuf] = phase_begin<U_W13, UE_W13, OFF_W13>(p, sm, n, i, ph, true, true);
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
    if constexpr (QCOPY) wdotq_unit<2, D, UE_W13>(p, sm, E + (long long)ua * UE_W13, nbuf, u - ua,
                                                  E + ((long long)l * FL + j) * 2 * D, 2, sm + (l - l0) * D, acc);
    else if (u - ua < nbuf) wdot_buf<2, D, UE_W13>(sm, E + (long long)ua * UE_W13, nbuf, u - ua, 2, sm + (l - l0) * D, acc);
    else wdot<2, D>(p, E + ((long long)l * FL + j) * 2 * D, 2, sm + (l - l0) * D, acc);
    if (lane == 0) p.hid[(long long)l * FL + j] = acc[0] / (1.0f + expf(-acc[0])) * acc[1];
  }
  tmark(p, n, ph, 4);
  signal_lanes(p, C_W13, UPL_W13, ua, ub);
  tmark(p, n, ph, 2);
}
