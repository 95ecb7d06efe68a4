// monokernel.cu: the whole decode loop of one rank in one persistent kernel (docs/monokernel.md).
// One block per SM, all resident (cooperative launch). Per token and layer five phases:
//   QKV  (attention norm, q/k/v rows, RoPE, KV append)      units: pairs of rows
//   ATT  (attention over the KV cache, split by positions)   units: (kv head, chunk)
//   WO   (output projection + DTP combine into the residual) units: NR_WO rows
//   W13  (ffn norm, gate/up rows, silu * up)                 units: (w1 row, w3 row)
//   W2   (down projection + DTP combine)                     units: NR_W2 rows
// then LM (final norm and lane mean, LM head rows, the last block samples). No grid-wide barrier:
// each block waits on per-(phase, lane) counters for exactly the lanes it reads, after it has asked
// L2 for the first bytes of its own next weights.
//
// One translation unit in several files: build.py inlines the quoted includes in place (nvcc finds
// them next to this file). Each part uses what comes before it, so the includes' order is the order
// of the definitions; the phases come one to a file in the order a token runs them:
//   common.cuh        CFG_* configuration, storage types, conversions, memory helpers (with prefill.cu)
//   mk_layout.cuh     rank count, units and weight layout, counters, shared-memory plan, Params, marks
//   mk_multirank.cuh  exchanges between ranks (KOG_NRANKS > 1): epochs, LL words, mr_lane_sum
//   mk_helpers.cuh    input planes, dot products, block ranges, counter wait (wait_lanes), block_sum, warp_dot,
//                     the layer phases' prologue (phase_begin)
//   mk_norms.cuh      residual reads (hval), stage_norms, stage_norms2, final_norms, writer_mask
//   mk_combine.cuh    producers' combine, counter signal, wait_delayed, mr_final, KV prefetch
//   mk_qkv.cuh        phase QKV (phase_qkv) and the lane skew
//   mk_att.cuh        phase ATT (phase_att)
//   mk_wo.cuh         phase WO (wo_stage_combine, phase_wo)
//   mk_w13.cuh        phase W13 (phase_w13)
//   mk_w2.cuh         phase W2 (phase_w2)
//   mk_sample.cuh     sampling by the last block: the candidates near the max sorted in shared memory, else all V
//   mk_mask.cuh       CFG_MASK 1: the host's token mask, waited for and applied by the sampler (structured outputs)
//   mk_lm.cuh         the LM head (phase_lm)
//   mk_spec.cuh       CFG_SPEC > 0: the layers' phases of a verify pass of up to CFG_SPEC positions (its row
//                     loops in mk_spec_rows.cuh, included by it)
//   mk_spec_lm.cuh    CFG_SPEC > 0: its LM head, acceptance, drafting on the device, the pass loop (spec_loop)
//   this file         the kernel (monokernel: the token loop) and monokernel_info
#include "common.cuh"
#include "kquant.cuh"
#define NEG_INF __int_as_float(0xff800000)

using namespace cfg;

#include "mk_layout.cuh"
#include "mk_multirank.cuh"
#include "mk_helpers.cuh"
#include "mk_norms.cuh"
#include "mk_combine.cuh"
#include "mk_qkv.cuh"
#include "mk_att.cuh"
#include "mk_wo.cuh"
#include "mk_w13.cuh"
#include "mk_w2.cuh"
#include "mk_sample.cuh"
#if CFG_MASK
#include "mk_mask.cuh"
#endif
#include "mk_lm.cuh"
#ifndef CFG_SPEC
#define CFG_SPEC 0          // > 0: the speculative verify passes of up to CFG_SPEC positions (mk_spec.cuh)
#endif
static_assert(!(CFG_SPEC && CFG_MASK), "a constrained request decodes a token at a time (no verify pass)");
#if CFG_SPEC
static_assert(QW != 4, "the K-quants have no verify pass (the host decodes them without speculation)");
#include "mk_spec.cuh"
#include "mk_spec_lm.cuh"
#endif

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
#if CFG_SPEC
  spec_loop(p, sm);
#else
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
      const int nb = wbuf_fill_w(p, sm, (long long)ua * UE_QKV, ub - ua, UE_QKV, true);
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
      if (ATT_MERGE && att_long(i, t)) att_merge_step(p, sm, n, i, t);
      phase_wo(p, sm, n, i, t, tok);
      phase_w13(p, sm, n, i, tok);
      phase_w2(p, sm, n, i, t, tok);
#if KOG_NRANKS > 1
      if (mr_bail()) return;
#endif
    }
    phase_lm(p, sm, n, tok);
#if KOG_NRANKS > 1
    if (mr_bail()) return;
#endif
  }
#endif
}

extern "C" __global__ void monokernel_info(long long* out) {
#if CFG_SPEC
  out[0] = SPEC_FLOATS * 4;  // dynamic shared memory bytes
#else
  out[0] = SM_FLOATS * 4;    // dynamic shared memory bytes
#endif
  out[1] = NCTR_ALL;
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
