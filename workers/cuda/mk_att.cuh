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

// ---- the chunks' merge, once a kv head, by the block that ends its chunks last ----------------------
// With more than ATT_MB chunks in use (long contexts: SmolLM2 has 44 a kv head at 3968 positions,
// Llama-3.2-1B 16), WO's merge in every block read all chunks' partials of all heads from L2 (SmolLM2 108 KB a
// block and layer there, Llama-3.2-1B 270 KB), so instead, after attention, the block whose ticket is a kv
// head's last merges that head group's chunks once into p.q (free then: every chunk's block has read its q)
// and marks it done; WO stages p.q. Out of line and called only then (att_long), so that no phase holds its
// registers (inside phase_att, ptxas spilled the kernel's values around each call). spec_att's verify pass
// merges every position with att_merge too, so a pass keeps the plain step's bits.
__device__ __forceinline__ u32 ticket_add(u32* p) {
  u32 v;
  asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;" : "=r"(v) : "l"(p) : "memory");
  return v;
}
constexpr int ATT_MB = NCH < 8 ? NCH : 8;   // chunks a batch of loads (a thread's loads in flight together)
static_assert(HD % 4 == 0 && G * HD / 4 <= NT, "four elements of a head a thread, a head group in one round");
constexpr int QA = G * HD / 4;              // threads of a merge group: four elements of a head group each
// groups, each a share of the chunks, combined by group 0 through the attention scratch (NW G HD floats)
constexpr int MA = cmax(1, cmin(8, cmin(NT / QA, NW / 2 + 1)));
constexpr int MBG = ATT_MB < 4 ? ATT_MB : 4;   // a group's batch: fewer registers
// the chunks [ca, cb) of elements x .. x + 3 (of G HD) of kv head g's query heads in src ([KV][NCH][G][ATTP])
// merged into (M, Ls, A): ATT_MB chunks a batch (their loads in flight together), one rescale a batch
template <int MB = ATT_MB>
__device__ __forceinline__ void merge_range(const float* src, int g, int x, int ca, int cb, float& M, float& Ls,
                                            float4& A) {
  const int hg = x / HD, d = x % HD;
  const float* a = src + ((long long)g * NCH * G + hg) * ATTP;
  for (int c0 = ca; c0 < cb; c0 += MB) {
    float2 ml[MB];
    float4 ac[MB];
#pragma unroll
    for (int k = 0; k < MB; ++k) {
      const float* ach = a + (long long)(c0 + k) * G * ATTP;
      const bool in = c0 + k < cb;
      ml[k] = in ? __ldcg(reinterpret_cast<const float2*>(ach + HD)) : make_float2(-1e30f, 0.f);
      ac[k] = in ? __ldcg(reinterpret_cast<const float4*>(ach + d)) : make_float4(0.f, 0.f, 0.f, 0.f);
    }
    float Mb = M;
#pragma unroll
    for (int k = 0; k < MB; ++k) Mb = fmaxf(Mb, ml[k].x);
    const float r = expf(M - Mb);
    A.x *= r; A.y *= r; A.z *= r; A.w *= r; Ls *= r;
#pragma unroll
    for (int k = 0; k < MB; ++k) {
      const float e = expf(ml[k].x - Mb);
      A.x += ac[k].x * e; A.y += ac[k].y * e; A.z += ac[k].z * e; A.w += ac[k].w * e;
      Ls += ml[k].y * e;
    }
    M = Mb;
  }
}
// kv head g's nj chunks in src merged into dst[g G HD ..] (A / Ls); more than ATT_MB chunks: MA groups
// (scratch: (MA - 1) QA 8 floats), else group 0 alone (then the arithmetic of phase_wo's merge)
__device__ __forceinline__ void att_merge(const float* src, float* dst, int g, int nj, float* scratch) {
  const bool grouped = MA > 1 && nj > ATT_MB;
  const int gi = threadIdx.x / QA, q = threadIdx.x % QA, ng = grouped ? MA : 1;
  const int per = (nj + ng - 1) / ng, ca = min(nj, gi * per), cb = min(nj, ca + per);
  float M = -1e30f, Ls = 0.f;
  float4 A = make_float4(0.f, 0.f, 0.f, 0.f);
  if (gi < ng) {
    if (grouped) merge_range<MBG>(src, g, 4 * q, ca, cb, M, Ls, A);
    else merge_range(src, g, 4 * q, ca, cb, M, Ls, A);
  }
  if (grouped) {
    if (gi > 0 && gi < ng) {
      float* gp = scratch + ((gi - 1) * QA + q) * 8;
      *reinterpret_cast<float4*>(gp) = A;
      *reinterpret_cast<float2*>(gp + 4) = make_float2(M, Ls);
    }
    __syncthreads();
    if (gi == 0) {
      float Mt = M;
      for (int gj = 1; gj < ng; ++gj) Mt = fmaxf(Mt, scratch[((gj - 1) * QA + q) * 8 + 4]);
      const float r = expf(M - Mt);
      A.x *= r; A.y *= r; A.z *= r; A.w *= r; Ls *= r;
      for (int gj = 1; gj < ng; ++gj) {
        const float* gq = scratch + ((gj - 1) * QA + q) * 8;
        const float4 Ag = *reinterpret_cast<const float4*>(gq);
        const float e = expf(gq[4] - Mt);
        A.x += Ag.x * e; A.y += Ag.y * e; A.z += Ag.z * e; A.w += Ag.w * e;
        Ls += gq[5] * e;
      }
    }
  }
  if (gi == 0)
    *reinterpret_cast<float4*>(dst + (long long)g * G * HD + 4 * q) = make_float4(A.x / Ls, A.y / Ls, A.z / Ls, A.w / Ls);
}
// after a block stored its chunk of a kv head (one of nj in use): true in the block that ended them last
__device__ __forceinline__ bool att_last_chunk(u32* ticket, int nj) {
  __shared__ int s_last;
  __syncthreads();
  if (threadIdx.x == 0) {   // release this block's chunk, acquire the others'
    const bool lastc = ticket_add(ticket) == (u32)(nj - 1);
    if (lastc) *ticket = 0u;   // for the next use (ordered after this one by the layers' counters)
    s_last = lastc;
  }
  __syncthreads();
  return s_last;
}
// whether attention at position t of layer i merges in att_merge_step (more chunks than a batch)
__device__ __forceinline__ bool att_long(int i, int t) {
  int lo, CH;
  return att_split(i, t, lo, CH) > ATT_MB;
}
__device__ __forceinline__ void att_merge_step(const Params& p_, float* sm, int n, int i, int t) {
  const Params& p = NOINL_PARAMS(p_);
  static_assert(U_ATT <= NB, "one attention unit a block at most");
  int ua, ub, cs, ce, lo, CH;
  brange(U_ATT, ua, ub);
  if (ua >= ub) return;
  const int g = ua / NCH;
  att_chunk(i, t, ua % NCH, cs, ce);
  if (ce <= cs) return;   // a chunk not in use
  const int nch = att_split(i, t, lo, CH);
  if (!att_last_chunk(ATT_TICKET(p, g), nch)) return;
  att_merge(p.attp, p.q, g, nch, sm + G * HD);
  __syncthreads();
  if (threadIdx.x == 0) st_release(ATT_DONE(p, i, g), (u64)n + 1);
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

