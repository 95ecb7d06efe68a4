// mk_spec_lm.cuh: part of monokernel.cu (pasted in place after mk_spec.cuh when CFG_SPEC > 0). The verify
// pass's end and the speculative token loop: the final norm and LM head for np positions, then the last
// block to finish draws each position's token as the plain sampler would (greedy, or sample_full with the
// position's counter), accepts draft tokens while they equal those draws, writes the tokens to the host's
// ring, and drafts the next pass from the context on the device: the tokens that followed the latest
// earlier match of the context's last n tokens (n = 4 down to min_ngram), as kog_dist.speculative.lookup,
// sized by kog_dist.speculative.AdaptiveDraft's rule.
#pragma once

// words of p.spec (int32; the host reads the counts after the launch: host.py SPEC_WORDS)
enum {
  SW_IDS = 0,         // [SP] the next pass's ids: the last token given, then the draft
  SW_NP = 16,         // positions of the next pass
  SW_T = 17,          // its first position
  SW_M = 18,          // tokens given so far
  SW_K = 19,          // AdaptiveDraft: k, misses, probe_every, since_probe
  SW_MISS = 20,
  SW_PROBE = 21,
  SW_SINCE = 22,
  SW_STEPS = 23,      // verify passes that checked a draft, draft tokens, accepted
  SW_DRAFTED = 24,
  SW_ACCEPTED = 25,
};
static_assert(SP <= 16, "p.spec holds 16 ids");
static_assert(NW >= SP, "the greedy pick takes a warp a position");
constexpr int SPEC_PROBE = 8, SPEC_MAX_PROBE = 32, SPEC_NGRAM = 4;   // kog_dist.speculative's defaults

// AdaptiveDraft.update and .size, in p.spec's words (one thread)
__device__ __forceinline__ void draft_update(volatile int* st, int drafted, int accepted, int kmax) {
  if (drafted == 0) return;
  st[SW_SINCE] = 0;
  if (accepted == 0) {
    if (st[SW_K] == 0) st[SW_PROBE] = min(SPEC_MAX_PROBE, 2 * st[SW_PROBE]);
    st[SW_MISS] += 1;
    st[SW_K] = st[SW_MISS] >= 3 ? 0 : max(1, st[SW_K] / 2);
    return;
  }
  st[SW_PROBE] = SPEC_PROBE;
  st[SW_MISS] = 0;
  if (accepted == drafted) st[SW_K] = min(kmax, max(1, st[SW_K]) * 2);
  else st[SW_K] = max(1, accepted + 1);
}
__device__ __forceinline__ int draft_size(volatile int* st) {
  if (st[SW_K] > 0) return st[SW_K];
  st[SW_SINCE] += 1;
  return st[SW_SINCE] >= st[SW_PROBE] ? 1 : 0;
}

// the latest end e < T - 1 of the longest match (up to SPEC_NGRAM, at least min_ngram) of ctx[T - n .. T)
// at ctx[e - n + 1 .. e]; the whole block; -1 if none. ctx is written by whichever block ran the last pass:
// read through L2.
__device__ int draft_lookup(const int* ctx, int T, int min_ngram, int* best_s) {
  if (threadIdx.x == 0) *best_s = -1;
  int tail[SPEC_NGRAM];
#pragma unroll
  for (int k = 0; k < SPEC_NGRAM; ++k) tail[k] = T - 1 - k >= 0 ? __ldcg(ctx + T - 1 - k) : -1;
  __syncthreads();
  const int nmax = min(SPEC_NGRAM, T - 1);
  int best = -1;
  for (int e = T - 2 - (int)threadIdx.x; e >= 0; e -= NT) {
    int ml = 0;
#pragma unroll
    for (int k = 0; k < SPEC_NGRAM; ++k)
      if (ml == k && k < nmax && e - k >= 0 && __ldcg(ctx + e - k) == tail[k]) ml = k + 1;
    if (ml >= min_ngram && ml > 0) {
      const int key = (ml << 24) | e;
      if (key > best) best = key;
      if (ml == nmax) break;   // later e of this thread came first: the latest full match
    }
  }
  if (best >= 0) atomicMax(best_s, best);
  __syncthreads();
  const int r = *best_s;
  __syncthreads();
  return r < 0 ? -1 : (r & 0xffffff);
}

__shared__ int s_ids[SP];
__shared__ int s_tok[SP];
__shared__ int s_ctl[8];   // np, t, then the last block's: given, reason, draft size, lookup scratch

// the final norm of position j's residual into y (planes xpv), final_norms' arithmetic for one lane
__device__ void spec_final_norms(const Params& p, float* sm, int np) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  float* red = sm + S_RED;
  float* inv = red + NW * SP;        // (as spec_norms)
  float v[SP][DPT];
#pragma unroll
  for (int j = 0; j < SP; ++j)
#pragma unroll
    for (int e = 0; e < DPT; ++e) {
      const int d = threadIdx.x + e * NT;
      v[j][e] = (j < np && d < D) ? ldf(s_hres(p, j, 2 * NL) + d) : 0.f;
    }
  float gv[DPT];
#pragma unroll
  for (int e = 0; e < DPT; ++e) {
    const int d = threadIdx.x + e * NT;
    gv[e] = d < D ? __ldg(p.fnorm + d) : 0.f;
  }
  float ss[SP];
#pragma unroll
  for (int j = 0; j < SP; ++j) {
    ss[j] = 0.f;
#pragma unroll
    for (int e = 0; e < DPT; ++e) ss[j] += v[j][e] * v[j][e];
  }
#pragma unroll
  for (int j = 0; j < SP; ++j) ss[j] = warp_sum(ss[j]);
  __syncthreads();
  if (lane == 0)
#pragma unroll
    for (int j = 0; j < SP; ++j)
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
  for (int j = 0; j < SP; ++j) {
    if (j >= np) break;
    const float r = inv[j];
#pragma unroll
    for (int e = 0; e < DPT; ++e) {
      const int d = threadIdx.x + e * NT;
      if (d < D) {
        const float t = (v[j][e] * r) * gv[e];
        sm[j * KMAX + xpv(d, D)] = t / (float)L;
      }
    }
  }
  __syncthreads();
}

// the LM head for np positions; the last block draws, accepts, gives the tokens and drafts the next pass
SPEC_PHASE void spec_lm(const Params& p_, float* sm, int n, int t, int np) {
  const Params& p = SPEC_PARAMS(p_);
  int ua, ub;
  tmark(p, n, 5 * NL, 0);
  brange(U_LM, ua, ub);
  prefetch_l2(p.lm + (long long)ua * UE_LM, (long long)(ub - ua) * UE_LM * sizeof(wt), PF_LM);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, tid = threadIdx.x;
  const bool greedy = p.temperature <= 0.0 || p.top_k == 1;
  const bool keep = !greedy || p.dbg_logits;   // every logit of every position kept
  __shared__ float bv[NW][SP];
  __shared__ int bi[NW][SP];
  __shared__ int last;
  float best[SP];
  int besti[SP];
#pragma unroll
  for (int j = 0; j < SP; ++j) { best[j] = NEG_INF; besti[j] = 0x7fffffff; }
  if (blockIdx.x == 0 && tid == 32) *CTR(p, C_CANCEL) = (u64)*(volatile const int*)p.cancel;
  if (ua < ub) {
    if (WAITER) wait_lanes(p, C_W2, 0, 0, (u64)(n * NL + NL) * UPL_W2);
    __syncthreads();
    tmark(p, n, 5 * NL, 1);
    spec_final_norms(p, sm, np);
    for (int u = ua + warp; u < ub; u += NW) {
      const int r0 = 2 * u;
      float acc[SP][2];
      lmdot_p<2>(p.lm + (long long)r0 * D, min(2, V - r0), sm, np, acc);
      if (lane == 0)
#pragma unroll
        for (int j = 0; j < SP; ++j)
#pragma unroll
          for (int r = 0; r < 2; ++r)
            if (j < np && r0 + r < V) {
              if (keep) p.spec_logits[(long long)j * V + r0 + r] = acc[j][r];
              if (acc[j][r] > best[j]) { best[j] = acc[j][r]; besti[j] = r0 + r; }
            }
    }
  }
  if (lane == 0)
#pragma unroll
    for (int j = 0; j < SP; ++j) { bv[warp][j] = best[j]; bi[warp][j] = besti[j]; }
  __syncthreads();
  if (tid < np) {
    float b = NEG_INF;
    int x = 0x7fffffff;
    for (int w = 0; w < NW; ++w)
      if (bv[w][tid] > b || (bv[w][tid] == b && bi[w][tid] < x)) { b = bv[w][tid]; x = bi[w][tid]; }
    p.cand_v[tid * NB + blockIdx.x] = b;
    p.cand_i[tid * NB + blockIdx.x] = x;
  }
  __syncthreads();
  if (tid == 0) {
    u64 tk;
    asm volatile("atom.acq_rel.gpu.global.add.u64 %0, [%1], 1;" : "=l"(tk) : "l"(CTR(p, C_TICKET)) : "memory");
    last = (tk == (u64)(n + 1) * NB - 1);
  }
  __syncthreads();
  tmark(p, n, 5 * NL, 2);
  if (!last) return;
  // ---- the last block: each position's token, the accepted drafts, the ring, the next pass's draft ----
  volatile int* st = p.spec;   // another block's last pass wrote it: never from this SM's L1
  if (greedy) {
    // (max logit, lowest index) over the blocks' candidates, warp j for position j
    if (warp < np) {
      float bb = NEG_INF;
      int bidx = 0x7fffffff;
      for (int b = lane; b < NB; b += 32) {
        const float v = ldf(p.cand_v + warp * NB + b);
        const int ix = __ldcg(p.cand_i + warp * NB + b);
        if (v > bb || (v == bb && ix < bidx)) { bb = v; bidx = ix; }
      }
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, bb, o);
        const int oi = __shfl_xor_sync(0xffffffffu, bidx, o);
        if (ov > bb || (ov == bb && oi < bidx)) { bb = ov; bidx = oi; }
      }
      if (lane == 0) s_tok[warp] = bidx == 0x7fffffff ? 0 : bidx;
    }
    __syncthreads();
  } else {
    // position by position while the drafts hold: its logits into p.logits, the plain sampler's draw
    for (int j = 0; j < np; ++j) {
      for (int v = tid; v < V; v += NT) p.logits[v] = __ldcg(p.spec_logits + (long long)j * V + v);
      __syncthreads();
      const int y = sample_full(p, sm, (u64)(t + j + 1));
      if (tid == 0) s_tok[j] = y;
      __syncthreads();
      if (j + 1 < np && y != s_ids[j + 1]) break;
    }
  }
  if (tid == 0) {
    const int cancel = (int)__ldcg(CTR(p, C_CANCEL));
    int m = st[SW_M], given = 0, reason = 0, acc = 0;
    while (acc + 1 < np && s_tok[acc] == s_ids[acc + 1]) ++acc;   // the drafts accepted
    for (int j = 0; j <= acc; ++j) {
      const int y = s_tok[j];
      p.ctx[t + j + 1] = y;
      ++m;
      ++given;
      for (int k = 0; k < p.n_eos; ++k) if (p.eos_ids[k] == y) reason = 1;
      if (!reason) for (int k = 0; k < p.n_stop; ++k) if (p.stop_ids[k] == y) reason = 2;
      if (!reason && m >= p.max_new) reason = 3;
      if (!reason && cancel) reason = 4;
      if (reason) break;
    }
    if (np > 1) {
      st[SW_STEPS] += 1;
      st[SW_DRAFTED] += np - 1;
      st[SW_ACCEPTED] += acc;
    }
    draft_update(st, np - 1, acc, (int)p.spec_k);
    const int tn = t + given;   // the next pass's first position (the last token given, not yet fed)
    int k = 0;
    if (!reason) {
      k = p.spec_fixed > 0 ? (int)p.spec_fixed : (p.spec_fixed < 0 ? 0 : draft_size(st));
      k = min(min(k, (int)p.max_new - m - 1), (int)p.max_seq - tn - 1);
      k = min(k, SP - 1);
    }
    s_ctl[2] = given;
    s_ctl[3] = reason;
    s_ctl[4] = k;
    s_ctl[6] = m - given;
    st[SW_M] = m;
    st[SW_T] = tn;
    st[SW_IDS] = s_tok[given - 1];
    st[SW_NP] = 1;
  }
  __syncthreads();
  const int given = s_ctl[2], reason = s_ctl[3], k = s_ctl[4];
  const int m0 = s_ctl[6];          // tokens given before this pass
  if (p.dbg_logits)                  // the rows of the tokens given, by their index
    for (int j = 0; j < given; ++j)
      for (int v = tid; v < V; v += NT)
        p.dbg_logits[(long long)(m0 + j) * V + v] = __ldcg(p.spec_logits + (long long)j * V + v);
  if (k > 0 && p.spec_fixed > 0) {   // a pass of a given size (benchmarks): the context's last k tokens
    const int T = t + given + 1;
    if (tid == 0) {
      for (int x = 0; x < k; ++x) st[SW_IDS + 1 + x] = __ldcg(p.ctx + max(0, T - 1 - k + x));
      st[SW_NP] = 1 + k;
    }
  } else if (k > 0) {
    const int T = t + given + 1;
    const int e = draft_lookup(p.ctx, T, (int)p.spec_min_ngram, &s_ctl[5]);
    if (tid == 0 && e >= 0) {
      const int nd = min(k, T - 1 - e);
      for (int x = 0; x < nd; ++x) st[SW_IDS + 1 + x] = __ldcg(p.ctx + e + 1 + x);
      st[SW_NP] = 1 + nd;
    }
  }
  if (tid == 0) {
    const int next = st[SW_IDS];
    prefetch_l2(p.emb + (long long)next * D, (long long)D * sizeof(wt), D * sizeof(wt));
    *CTR(p, C_TOKEN) = (u64)(m0 + given);
    *CTR(p, C_STOP) = (u64)reason;
    st_release(CTR(p, C_TOKVAL), ((u64)(n + 1) << 32) | ((u64)reason << 24) | (u64)next);
    volatile int* ring = p.ring;
    volatile int* status = p.status;
    for (int j = 0; j < given; ++j) ring[m0 + j] = s_tok[j];
    __threadfence_system();
    status[0] = m0 + given;
    if (reason) {
      status[1] = reason;
      __threadfence_system();
      status[2] = 1;
    }
  }
  __syncthreads();
}

// the speculative token loop: pass n feeds s_ids[0 .. np) at positions t .. t + np - 1
__device__ void spec_loop(const Params& p, float* sm) {
  int t = (int)p.start_pos, np = 1;
  if (threadIdx.x == 0) s_ids[0] = (int)p.first_token;
  __syncthreads();
  for (int n = 0;; ++n) {
    if (n > 0) {
      int ua, ub;
      brange(U_QKV, ua, ub);
      prefetch_w(p, (long long)ua * UE_QKV, (long long)(ub - ua) * UE_QKV, PF);
      tmark(p, n, 5 * NL + 1, 0);
      if (threadIdx.x == 0) {
        const u64 w = SPIN(p, CTR(p, C_TOKVAL), (u64)n << 32);
        s_ctl[3] = (int)((w >> 24) & 0xffu);
        s_ctl[0] = __ldcg(p.spec + SW_NP);
        s_ctl[1] = __ldcg(p.spec + SW_T);
        for (int j = 0; j < SP; ++j) s_ids[j] = __ldcg(p.spec + SW_IDS + j);
      }
      __syncthreads();
      if (s_ctl[3]) return;
      tmark(p, n, 5 * NL + 1, 1);
      np = s_ctl[0];
      t = s_ctl[1];
      __syncthreads();   // s_ctl is rewritten by the last block of this pass
    }
    // a pass of one position is a plain step: the plain phases (their buffers are position 0's here, their
    // weight copies complete within the pass), so a pass without a draft costs what a plain token costs
    if (np == 1)
      for (int i = 0; i < NL; ++i) {
        const int tok = s_ids[0];
        phase_qkv(p, sm, n, i, t, tok, false);
        phase_att(p, sm, n, i, t, tok);
        if (ATT_MERGE && att_long(i, t)) att_merge_step(p, sm, n, i, t);
        phase_wo(p, sm, n, i, t, tok);
        phase_w13(p, sm, n, i, tok);
        phase_w2(p, sm, n, i, t, tok);
      }
    else
      for (int i = 0; i < NL; ++i) {
        spec_qkv(p, sm, n, i, t, np, s_ids);
        spec_att(p, sm, n, i, t, np);
        spec_wo(p, sm, n, i, t, np, s_ids);
        spec_w13(p, sm, n, i, np, s_ids);
        spec_w2(p, sm, n, i, np, s_ids);
      }
    spec_lm(p, sm, n, t, np);
  }
}
