// mk_multirank.cuh: part of monokernel.cu (pasted in place after mk_layout.cuh; not a standalone
// header). The exchanges between ranks, all under `#if KOG_NRANKS > 1`: epochs, the spin that watches
// the abort word, LL words of the partials (mr_put, mr_part) and their reads (mr_lane_sums). The final rows'
// exchange (mr_final) needs the norms, so it is in mk_combine.cuh; the LM head's, in mk_lm.cuh.
#pragma once

#if KOG_NRANKS > 1
// ---- exchanges between ranks (kccl.cuh; docs/monokernel.md "multi-rank") ------------------------
// Channels (CudaCommunicator tags in create order): 1 "attn" (kind 0), 2 "mlp" (kind 1), 3 "final".
// A posted layer's partials travel as LL words (kccl.cuh): the thread that computes row r of own lane
// l stores {value, epoch tag} straight into that row's word in every peer's window, and a reader polls
// the words of the rows it needs: no fence, counter, flag or ack on the per-layer path. Own lanes are
// read from p.part after their counters, as with one rank, and a reader sums all LG lanes in lane
// order: the same bits as the one-rank kernel. Slot reuse needs no ack because a rank's post of
// epoch e implies every reader is past epoch e - MR_DEPTH (MR_DEPTH >= 2 * DELTA + 2; the argument is
// in docs/monokernel.md "multi-rank"). The final rows (once a token) travel as LL words too (mr_final).
// Epoch of (kind, token n, layer i): e0[kind] + n * NPOST + mr_index(i); of the final rows: e0[2] + n.
// workers/cuda/multirank.py computes the same schedule on the host (and tests it).
constexpr int MR_DEPTH = CFG_MR_DEPTH;   // ring slots of every channel (multirank.depth)
// every layer early (DELTA >= NL: tensor parallelism of a one-lane model, kog_dist/tp_lanes.py): a post of
// (kind, layer j) implies every rank read (kind, layer j - 1), and the final slot's ring wants 6 (mr_final)
constexpr bool MR_ALL_EARLY = USE_COMM && USE_EARLY && DELTA >= NL;
static_assert(MR_ALL_EARLY ? MR_DEPTH >= 6 : MR_DEPTH >= 2 * DELTA + 2,
              "multi-rank: LL slots need a ring of 2 * delta + 2 (6 with every layer early)");
__shared__ KcclDev kds;          // this rank's KcclDev, copied at launch
__shared__ int mr_flag_s, mr_cancel_s, mr_n_s;
enum { CH_FIN = 3 };
constexpr int FIN_FLOATS = L * D + 4;   // p.yfin: the rank's L normed rows, then its cancel word
// LL words of a rank's final slot: the rows and the cancel word (mr_final), the rank's best logit and its
// index (greedy), the logits of the rank's LM rows (sampling past the candidates: every rank samples from all
// V), then the rank's sampling candidates (mk_sample.cuh sample_full_mr: 5 words, SCAND keys of 2 words)
constexpr int SCAND = 4096 / NRK;
constexpr int FW_CAND = L * D + 1, FW_LOGITS = L * D + 3, FW_SCAND = FW_LOGITS + 2 * U_LM,
              FIN_WORDS = FW_SCAND + 5 + 2 * SCAND;
// layers whose partials are posted: read by the early all-reduce and/or DELTA layers later
__host__ __device__ constexpr bool mr_posted(int i) {
  return USE_COMM && ((i < DELTA && USE_EARLY) || (i + DELTA < NL && (i >= DELTA || EARLY_FUTURE)));
}
// the partials of layer i are read again by the producers of layer i + DELTA (== has_delayed(i + DELTA))
__host__ __device__ constexpr bool mr_read_later(int i) {
  return USE_COMM && i + DELTA < NL && (i >= DELTA || EARLY_FUTURE);
}
__host__ __device__ constexpr int mr_index(int i) {
  int k = 0;
  for (int j = 0; j < i; ++j) k += mr_posted(j) ? 1 : 0;
  return k;
}
constexpr int NPOST = mr_index(NL);      // epochs per token and kind
// blocks with at least one unit of a U-unit phase (they post its epoch)
__host__ __device__ constexpr int nposters(int U) {
  int c = 0;
  for (int b = 0; b < NB; ++b) c += ((long long)(b + 1) * U / NB > (long long)b * U / NB) ? 1 : 0;
  return c;
}
__device__ __forceinline__ u64 mr_epoch(const Params& p, int kind, int n, int i) {
  return (u64)(p.e0[kind] + (long long)n * NPOST + mr_index(i));
}
// this rank failed a kccl wait (device memory: cheap). The host's abort word (a peer died) is
// host-mapped, a PCIe read: only the spins look at it, and they record it here (kccl_fail)
__device__ __forceinline__ bool mr_dead() { return kccl_failed(kds); }
// the monokernel's own counters, polled so that the grid leaves once the rank failed
__device__ __forceinline__ u64 spin_mr(const u64* ptr, u64 target) {   // returns the value that passed (0: failed)
  u64 v;
  for (unsigned it = 1; (v = ld_acquire(ptr)) < target; ++it)
    if ((it & 1023u) == 0) {
      if (kds.abort && *(volatile const int*)kds.abort) kccl_fail(kds, KCCL_ERR_ABORTED, -1, 0, 0, 0);
      if (mr_dead()) return 0;
    }
  return v;
}
// block-uniform: leave the kernel?
__device__ __forceinline__ bool mr_bail() {
  __syncthreads();
  if (threadIdx.x == 0) mr_flag_s = mr_dead();
  __syncthreads();
  return mr_flag_s != 0;
}
// byte offset of src's LL words of (channel c, epoch e) in any rank's window
__device__ __forceinline__ long long mr_ll_off(int c, int src, u64 e) {
  return kds.slot_off[c] + ((long long)src * MR_DEPTH + (long long)(e % (u64)MR_DEPTH)) * kds.slot_bytes + KCCL_META_BYTES;
}
// where a producer phase of (layer i, kind) posts its rows: this rank's words in every window (off < 0:
// the layer is not posted)
struct MrPost {
  long long off;
  unsigned tag;
};
__device__ __forceinline__ MrPost mr_post(const Params& p, int kind, int n, int i) {
  const u64 e = mr_epoch(p, kind, n, i);
  return MrPost{mr_posted(i) ? mr_ll_off(1 + kind, (int)kds.rank, e) : -1, (unsigned)e};
}
// a producer's row r of own lane l, value v: into every peer's window
__device__ __forceinline__ void mr_put(const MrPost& m, int l, int r, float v) {
  if (m.off < 0) return;
#pragma unroll
  for (int q = 0; q < NRK; ++q)
    if (q != (int)kds.rank)
      kccl_ll_st((u64*)(kds.base[q] + m.off) + (long long)l * D + r, m.tag, __float_as_uint(v));
}
// The partials of one posted (layer, kind) as a reader sees them: own lanes in p.part, the others'
// LL words in this rank's window.
struct MrPart {
  const float* own;     // p.part of the layer and kind: [L][D]
  const char* ll;       // this rank's window + mr_ll_off(c, 0, e): source q's words at q * stride
  long long stride;
  unsigned tag;
  int c;
};
__device__ __forceinline__ MrPart mr_part(const Params& p, int kind, int n, int i) {
  const u64 e = mr_epoch(p, kind, n, i);
  return MrPart{p.part + (long long)(i * 2 + kind) * L * D, kds.base[kds.rank] + mr_ll_off(1 + kind, 0, e),
                (long long)MR_DEPTH * kds.slot_bytes, (unsigned)e, 1 + kind};
}
// elements whose LG words a reader has in flight at once (2 spilled and ran slower: docs/monokernel.md)
constexpr int MRE = 1;
// Readers issue every word's first load before they check any, so a sum of LG lanes costs one round trip,
// not one per peer lane. If a word is not there yet, the sums are redone by a call that waits for the
// missing words: nothing of the reader's is live across it, and its loop's registers stay off the common
// path (inlined, it spilled loaded words and ran slower: docs/monokernel.md, thirteenth session)
template <int E> struct MrRows { int r[E]; };
template <int E> struct MrSums { float t[E], o[E]; };   // sums over the lanes; lane g's values
__device__ __forceinline__ const u64* mr_word(const MrPart& m, int j, int r) {
  return (const u64*)(m.ll + (j / L) * m.stride) + (j % L) * D + r;
}
__device__ __forceinline__ bool mr_own(const MrPart& m, int j) { return m.own && j / L == (int)kds.rank; }
template <int E>
__device__ __forceinline__ MrSums<E> mr_sums_of(const float (&P)[E][LG], int g) {
  MrSums<E> s;
#pragma unroll
  for (int e = 0; e < E; ++e) {
    float t = P[e][0], o = P[e][0];
#pragma unroll
    for (int j = 1; j < LG; ++j) {
      t += P[e][j];
      if (j == g) o = P[e][j];
    }
    s.t[e] = t;
    s.o[e] = o;
  }
  return s;
}
template <int E>
__device__ __noinline__ MrSums<E> mr_lane_sums_polled(MrPart m, MrRows<E> R, int g) {
  float P[E][LG];
  u64 W[E][LG];
  while (true) {
    bool ready = true;
#pragma unroll
    for (int e = 0; e < E; ++e)
#pragma unroll
      for (int j = 0; j < LG; ++j)
        if (!mr_own(m, j)) W[e][j] = kccl_ll_ld(mr_word(m, j, R.r[e]));
#pragma unroll
    for (int e = 0; e < E; ++e)
#pragma unroll
      for (int j = 0; j < LG; ++j)
        if (!mr_own(m, j)) ready &= (unsigned)(W[e][j] >> 32) == m.tag;
    if (ready || kccl_failed(kds)) break;   // failed: the caller's mr_bail leaves
    // wait on the first missing word alone (one load in flight, bounded by kccl_ll_get), then reload all:
    // re-polling every word each time cost polling traffic (docs/monokernel.md, thirteenth session)
    int q = 0, jj = 0, ee = 0;
#pragma unroll
    for (int e = E - 1; e >= 0; --e)
#pragma unroll
      for (int j = LG - 1; j >= 0; --j)
        if (!mr_own(m, j) && (unsigned)(W[e][j] >> 32) != m.tag) { q = j / L; jj = j; ee = e; }
    kccl_ll_get(kds, mr_word(m, jj, R.r[ee]), m.tag, q, m.c);
  }
#pragma unroll
  for (int e = 0; e < E; ++e)
#pragma unroll
    for (int j = 0; j < LG; ++j)
      P[e][j] = mr_own(m, j) ? ldf(m.own + (j % L) * D + R.r[e]) : __uint_as_float((unsigned)W[e][j]);
  return mr_sums_of<E>(P, g);
}
// sums over all LG lanes (lane order) of the elements R.r[0..E), all E * LG loads in flight at once. m.own
// null: every lane from the LL words (the final rows). Inlined (a call spilled its caller-saved registers
// at every call site and ran slower: docs/monokernel.md, thirteenth session)
template <int E>
__device__ __forceinline__ MrSums<E> mr_lane_sums(const MrPart& m, const MrRows<E>& R, int g) {
  float P[E][LG];
  u64 W[E][LG];
#pragma unroll
  for (int e = 0; e < E; ++e)
#pragma unroll
    for (int j = 0; j < LG; ++j) {
      if (mr_own(m, j)) P[e][j] = ldf(m.own + (j % L) * D + R.r[e]);
      else W[e][j] = kccl_ll_ld(mr_word(m, j, R.r[e]));
    }
  bool ready = true;
#pragma unroll
  for (int e = 0; e < E; ++e)
#pragma unroll
    for (int j = 0; j < LG; ++j)
      if (!mr_own(m, j)) {
        ready &= (unsigned)(W[e][j] >> 32) == m.tag;
        P[e][j] = __uint_as_float((unsigned)W[e][j]);
      }
  if (ready) return mr_sums_of<E>(P, g);
  return mr_lane_sums_polled<E>(m, R, g);
}
// One element (the delayed term of stage_combine, hval): each peer word polled in turn, own lanes from
// p.part. As one batch (mr_lane_sums<1>) the monokernel spilled more and two GPUs decoded slower, most at a
// long context (docs/monokernel.md, fourteenth session)
__device__ __forceinline__ float mr_lane_sum(const MrPart& m, int r, int g, float* own) {
  float P[LG];
  const int me = (int)kds.rank;
#pragma unroll
  for (int j = 0; j < LG; ++j) {
    const int q = j / L;
    P[j] = q == me ? ldf(m.own + (j % L) * D + r)
                   : __uint_as_float(kccl_ll_get(kds, (const u64*)(m.ll + q * m.stride) + (j % L) * D + r, m.tag, q, m.c));
  }
  float tot = P[0], o = P[0];
#pragma unroll
  for (int j = 1; j < LG; ++j) {
    tot += P[j];
    if (j == g) o = P[j];
  }
  if (own) *own = o;
  return tot;
}
#else
struct MrPost {};   // one rank: nothing is posted
__device__ __forceinline__ MrPost mr_post(const Params&, int, int, int) { return MrPost{}; }
__device__ __forceinline__ void mr_put(const MrPost&, int, int, float) {}
#endif
