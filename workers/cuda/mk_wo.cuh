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

// attention's chunks [ca, cb) of lane l's elements x .. x + 3 (of HDL), merged into (M, Ls, A): WO_MB chunks
// a batch (the batch's loads in flight together, one rescale a batch)
constexpr int WO_MB = NCH < 8 ? NCH : 8;
__device__ __forceinline__ void wo_merge_range(const Params& p, int x, int l, int ca, int cb, float& M, float& Ls,
                                               float4& A) {
  const int hh = x / HD, d = x % HD, qh = l * HL + hh, g = qh / G, hg = qh % G;
  const float* a = p.attp + ((long long)g * NCH * G + hg) * ATTP;
  for (int c0 = ca; c0 < cb; c0 += WO_MB) {
    float2 ml[WO_MB];
    float4 ac[WO_MB];
#pragma unroll
    for (int k = 0; k < WO_MB; ++k) {
      const float* ach = a + (long long)(c0 + k) * G * ATTP;
      const bool in = c0 + k < cb;
      ml[k] = in ? __ldcg(reinterpret_cast<const float2*>(ach + HD)) : make_float2(-1e30f, 0.f);
      ac[k] = in ? __ldcg(reinterpret_cast<const float4*>(ach + d)) : make_float4(0.f, 0.f, 0.f, 0.f);
    }
    float Mb = M;
#pragma unroll
    for (int k = 0; k < WO_MB; ++k) Mb = fmaxf(Mb, ml[k].x);
    const float r = expf(M - Mb);
    A.x *= r; A.y *= r; A.z *= r; A.w *= r; Ls *= r;
#pragma unroll
    for (int k = 0; k < WO_MB; ++k) {
      const float e = expf(ml[k].x - Mb);
      A.x += ac[k].x * e; A.y += ac[k].y * e; A.z += ac[k].z * e; A.w += ac[k].w * e;
      Ls += ml[k].y * e;
    }
    M = Mb;
  }
}

__device__ void phase_wo(const Params& p, float* sm, int n, int i, int t, int tok) {
  const int ph = 5 * i + 2;
  const auto [E, ua, ub, nbuf] = phase_begin<U_WO, UE_WO, OFF_WO>(p, sm, n, i, ph, false, false);   // issued by ATT
  const MrPost mp = mr_post(p, 0, n, i);
  if (ua >= ub) return;
  const int l0 = ua / UPL_WO, l1 = (ub - 1) / UPL_WO;
  float* cb = sm + CB_OFF;
  wo_stage_combine(p, sm, n, i, tok, ua, ub);
  if (WAITER) wait_lanes(p, C_ATT, l0, l1, (u64)(n * NL + i + 1) * UPL_ATT);
  __syncthreads();
  tmark(p, n, ph, 1);
  // attention outputs of the block's lanes, merged over the position chunks in use, four elements of a
  // head a thread: HDL / 4 threads, one round of loads where HDL > NT; more than MB chunks (one lane): MG
  // groups of threads a share each (mk_layout.cuh), combined by group 0
  int lo, CH;
  const int nch = att_split(i, t, lo, CH);
  constexpr int QN = HDL / 4;
  if (MG > 1 && nch > WO_MB) {
    const int QT = NT / MG, gi = threadIdx.x / QT, q = threadIdx.x % QT;
    const bool act = gi < MG && q < QN;
    float* const gpart = sm + HDL;   // [MG - 1][QN][8]: a group's float4 acc, then (m, l)
    int2 xs = make_int2(0, 0);
    float M = -1e30f, Ls = 0.f;
    float4 A = make_float4(0.f, 0.f, 0.f, 0.f);
    if (act) {
      xs = stage4<HDL>(q);
      int ca, cb_;
      mg_share(nch, gi, ca, cb_);
      wo_merge_range(p, xs.x, 0, ca, cb_, M, Ls, A);
      if (gi > 0) {
        float* gp = gpart + ((gi - 1) * QN + q) * 8;
        *reinterpret_cast<float4*>(gp) = A;
        *reinterpret_cast<float2*>(gp + 4) = make_float2(M, Ls);
      }
    }
    __syncthreads();
    if (act && gi == 0) {
      float Mt = M;
#pragma unroll
      for (int gj = 1; gj < MG; ++gj) Mt = fmaxf(Mt, gpart[((gj - 1) * QN + q) * 8 + 4]);
      const float r = expf(M - Mt);
      A.x *= r; A.y *= r; A.z *= r; A.w *= r; Ls *= r;
#pragma unroll
      for (int gj = 1; gj < MG; ++gj) {
        const float* gq = gpart + ((gj - 1) * QN + q) * 8;
        const float4 Ag = *reinterpret_cast<const float4*>(gq);
        const float e = expf(gq[4] - Mt);
        A.x += Ag.x * e; A.y += Ag.y * e; A.z += Ag.z * e; A.w += Ag.w * e;
        Ls += gq[5] * e;
      }
      *reinterpret_cast<float4*>(sm + 4 * xs.y) = make_float4(A.x / Ls, A.y / Ls, A.z / Ls, A.w / Ls);
    }
  } else {
    for (int l = l0; l <= l1; ++l)
      for (int q = threadIdx.x; q < QN; q += NT) {
        const int2 xs = stage4<HDL>(q);
        float M = -1e30f, Ls = 0.f;
        float4 A = make_float4(0.f, 0.f, 0.f, 0.f);
        wo_merge_range(p, xs.x, l, 0, nch, M, Ls, A);
        *reinterpret_cast<float4*>(sm + (l - l0) * HDL + 4 * xs.y) = make_float4(A.x / Ls, A.y / Ls, A.z / Ls, A.w / Ls);
      }
  }
  combine_phase_end<NR_WO, HDL>(p, sm, n, ph, E, i, 0, ua, ub, nbuf, l0, cb, mp);
}
