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
#include "common.cuh"
#define NEG_INF __int_as_float(0xff800000)

using namespace cfg;

// ---- several ranks (KOG_NRANKS > 1, docs/monokernel.md "multi-rank"): this kernel is the one-rank
// kernel of the rank's sub-model (CFG_L, CFG_H, CFG_KV, CFG_F are the rank's lanes, heads, kv heads
// and ffn rows; CFG_LG the model's lanes) plus the exchanges of kccl.cuh. Everything it adds is
// inside `#if KOG_NRANKS > 1`: with one rank the compiled code is the measured kernel's.
#ifndef KOG_NRANKS
#define KOG_NRANKS 1
#endif
#if KOG_NRANKS > 1
#include "../../kccl/device/kccl.cuh"
constexpr int NRK = KOG_NRANKS;            // ranks
constexpr int LG = CFG_LG;                 // lanes of the model (L: lanes of this rank)
static_assert(LG == L * NRK, "CFG_LG must be KOG_NRANKS * CFG_L");
static_assert(NRK <= KCCL_MAX_RANKS, "too many ranks for kccl.cuh");
#define SPIN(p, ptr, target) spin_mr(ptr, target)
#else
constexpr int LG = L;
#define SPIN(p, ptr, target) spin_until(ptr, target)
#endif

// ---- units and weight layout (elements of wt), see workers/cuda/README.md -----------------------
constexpr int NCH = (NB / KV) > 0 ? (NB / KV) : 1;         // attention chunks per kv head
constexpr int UPL_QKV = RQKV / 2, U_QKV = L * UPL_QKV;
constexpr int UPL_ATT = KVL * NCH, U_ATT = KV * NCH;
constexpr int NR_WO = (D % CFG_NR_WO == 0) ? CFG_NR_WO : 4, UPL_WO = D / NR_WO, U_WO = L * UPL_WO;
constexpr int UPL_W13 = FL, U_W13 = L * FL;
constexpr int NR_W2 = 2, UPL_W2 = D / NR_W2, U_W2 = L * UPL_W2;
constexpr int U_LM = (V + 1) / 2;
constexpr long long QKV_SZ = (long long)L * RQKV * D, WO_SZ = (long long)L * D * HDL;
constexpr long long W13_SZ = (long long)L * FL * 2 * D, W2_SZ = (long long)L * D * FL;
constexpr long long OFF_QKV = 0, OFF_WO = QKV_SZ, OFF_W13 = OFF_WO + WO_SZ, OFF_W2 = OFF_W13 + W13_SZ;
constexpr long long LAYER_SZ = OFF_W2 + W2_SZ;
constexpr int pow2_at_least(int v) { int p = 1; while (p < v) p <<= 1; return p; }
constexpr int VPOW2 = pow2_at_least(V);
constexpr int ATTP = HD + 2;                                // (acc[HD], m, l) per (unit, head)
// counters (u64): per phase and lane, then ticket, token, token value, stop
enum { C_QKV = 0, C_ATT = 1, C_WO = 2, C_W13 = 3, C_W2 = 4 };
constexpr int C_TICKET = 5 * L, C_TOKEN = 5 * L + 1, C_TOKVAL = 5 * L + 2, C_STOP = 5 * L + 3;
constexpr int CTR_STRIDE = CFG_CTR_STRIDE;                   // u64 words between counters (16: own 128-byte line)
constexpr int NCTR = (5 * L + 4) * CTR_STRIDE;
#define CTR(p, k) ((p).ctr + (long long)(k) * CTR_STRIDE)

// shared memory (floats)
constexpr int cmax(int a, int b) { return a > b ? a : b; }
// most lanes a block touches in a phase of U lane-major units (upl per lane): the staging area holds
// only those (a smaller shared-memory carve-out leaves more L1: +100 KB of it cost 8% on the H200)
constexpr int lanes_spanned(int U, int upl) {
  int m = 1;
  for (int b = 0; b < NB; ++b) {
    const int a = (int)((long long)b * U / NB), e = (int)((long long)(b + 1) * U / NB);
    if (e > a && (e - 1) / upl - a / upl + 1 > m) m = (e - 1) / upl - a / upl + 1;
  }
  return m;
}
constexpr int SM_STAGE = cmax(cmax(lanes_spanned(U_QKV, UPL_QKV) * D, lanes_spanned(U_W13, UPL_W13) * D),
                              cmax(lanes_spanned(U_WO, UPL_WO) * HDL, lanes_spanned(U_W2, UPL_W2) * FL));
constexpr int SM_ATT = G * HD + NW * G * HD + 2 * NW * G;
constexpr int SM_LM = D;
constexpr int CB_ROWS = (L * D + NB - 1) / NB + 2 * NR_WO + 2 * NR_W2;   // rows of a block in WO / W2
constexpr int CB_OFF = cmax(SM_STAGE, SM_ATT);   // WO / W2 combine staging: clear of attention's scratch
constexpr int SM_MAIN = cmax(CB_OFF + 2 * CB_ROWS, SM_LM) + 16 * 8 + 16;
#ifndef CFG_NORM2
#define CFG_NORM2 1
#endif
// stage_norms2 (a block's QKV and W13 units span at most 2 lanes): the norm weights of its lanes in
// shared memory, copied before the block waits for the residual
constexpr bool NORM2 = CFG_NORM2 && lanes_spanned(U_QKV, UPL_QKV) <= 2 && lanes_spanned(U_W13, UPL_W13) <= 2 &&
                       (L < 8 ? L : 8) >= 2 && D % 4 == 0;
constexpr int WBUF_OFF = ((SM_MAIN + 3) / 4) * 4;
constexpr int GS_OFF = WBUF_OFF + PFS / 4;                       // [2][D] norm weights (NORM2)
constexpr int SM_FLOATS = GS_OFF + (NORM2 ? 2 * D : 0);         // + the weight buffer (16-byte aligned)
static_assert(SM_FLOATS * 4 <= 225 * 1024, "shared memory: lower CFG_PFS");
// units' sizes in elements of wt
constexpr int UE_QKV = 2 * D, UE_WO = NR_WO * HDL, UE_W13 = 2 * D, UE_W2 = NR_W2 * FL, UE_LM = 2 * D;
// the first units of the block's range copied into shared memory; returns how many there will be
__device__ __forceinline__ int wbuf_fill(float* sm, const wt* src, int nunits, int ue, bool issue) {
  if (PFS == 0 || nunits <= 0) return 0;
  const int nb = min(nunits, PFS / (ue * (int)sizeof(wt)));
  if (issue) {
    const long long bytes = (long long)nb * ue * sizeof(wt);
    char* dst = reinterpret_cast<char*>(sm + WBUF_OFF);
    for (long long off = (long long)threadIdx.x * 16; off < bytes; off += NT * 16)
      cp_async16(dst + off, reinterpret_cast<const char*>(src) + off);
    cp_async_commit();
  }
  return nb;
}

struct Params {                  // every field 8 bytes; backend.py fills it in this order
  const wt* w;                   // 0  layer weights [NL][QKV|WO|W13|W2]
  const float* norms;            // 1  [NL][2][L][D] (attention_norm, ffn_norm)
  const float* fnorm;            // 2  [L][D]
  const wt* emb;                 // 3  [V][D]
  const wt* lm;                  // 4  [V][D]
  wt* kc;                        // 5  [NL][KV][max_seq][HD]
  wt* vc;                        // 6
  float* q;                      // 7  [H][HD]
  float* attp;                   // 8  [KV][NCH][G][HD+2]
  float* hid;                    // 9  [L][FL]
  float* part;                   // 10 [NL][2][L][D]
  float* hres;                   // 11 [2NL+1][L][D]
  float* logits;                 // 12 [V]
  float* cand_v;                 // 13 [NB]
  int* cand_i;                   // 14 [NB]
  u64* ctr;                      // 15 [NCTR], zero at launch
  u64* sortbuf;                  // 16 [VPOW2]
  float* dbg_logits;             // 17 [max_new][V] or null
  int* ring;                     // 18 host-mapped [max_new] token ids
  int* status;                   // 19 host-mapped [4]: count, reason, done
  const int* cancel;             // 20 host-mapped flag
  long long start_pos;           // 21 position of the first fed token
  long long first_token;         // 22
  long long max_new;             // 23
  long long max_seq;             // 24
  double temperature;            // 25
  double top_p;                  // 26
  long long top_k;               // 27
  u64 seed;                      // 28
  long long n_stop;              // 29
  long long n_eos;               // 30
  long long stop_ids[16];        // 31..46
  long long eos_ids[8];          // 47..54
  u64* timing;                   // 55 [5NL+2][NB][TMARKS] globaltimer marks of one token, or null
  long long timing_token;        // 56
  const float2* rope;            // 57 [max_seq][HD/2] (cos, sin) of position * theta^(-2k/HD)
#if KOG_NRANKS > 1
  const KcclDev* kd;             // 58 CudaCommunicator.dev_ptr
  long long e0[3];               // 59..61 first epoch of this launch on channels attn, mlp, final
  float* yfin;                   // 62 [L*D + 4] this rank's final-norm rows + its cancel word (posted)
#endif
};

__device__ __forceinline__ u64 gtimer() {
  u64 t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}
// phase slot ph (5*i + kind, 5NL: LM, 5NL+1: token wait), mark k (0 entry, 1 inputs ready, 2 done,
// 3 inputs staged, the row loop starts, 4 rows done, before the signal; 3 and 4 in QKV, WO, W13, W2)
constexpr int TMARKS = 5;
__device__ __forceinline__ void tmark(const Params& p, int n, int ph, int k) {
  if (p.timing && n == p.timing_token && threadIdx.x == 0)
    p.timing[((long long)ph * NB + blockIdx.x) * TMARKS + k] = gtimer();
}

#if KOG_NRANKS > 1
// ---- exchanges between ranks (kccl.cuh; docs/monokernel.md "multi-rank") ------------------------
// Channels (CudaCommunicator tags in create order): 1 "attn" (kind 0), 2 "mlp" (kind 1), 3 "final".
// A posted layer's partials travel as LL words (kccl.cuh): the thread that computes row r of own lane
// l stores {value, epoch tag} straight into that row's word in every peer's window, and a reader polls
// the words of the rows it needs: no fence, counter, flag or ack on the per-layer path. Own lanes are
// read from p.part after their counters, as with one rank, and a reader sums all LG lanes in lane
// order: the same bits as the one-rank kernel. Slot reuse needs no ack because a rank's post of
// epoch e implies every reader is past epoch e - MR_DEPTH (MR_DEPTH >= 2 * DELTA + 2; the argument is
// in docs/monokernel.md "multi-rank"). The final rows keep kccl's flag protocol (one post a token).
// Epoch of (kind, token n, layer i): e0[kind] + n * NPOST + mr_index(i); of the final rows: e0[2] + n.
// workers/cuda/multirank.py computes the same schedule on the host (and tests it).
constexpr int MR_DEPTH = CFG_MR_DEPTH;   // ring slots of every channel (multirank.depth)
static_assert(MR_DEPTH >= 2 * DELTA + 2, "multi-rank: LL slots need a ring of 2 * delta + 2");
__shared__ KcclDev kds;          // this rank's KcclDev, copied at launch
__shared__ int mr_flag_s, mr_cancel_s, mr_n_s;
enum { CH_FIN = 3 };
constexpr int FIN_FLOATS = L * D + 4;   // final payload: the rank's L normed rows, then its cancel word
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
static_assert(U_LM >= NB, "multi-rank: every block must own LM rows (it reads the final exchange)");
static_assert(NL > DELTA || !USE_COMM || !USE_EARLY, "multi-rank: the last layer may not be an early all-reduce");
__device__ __forceinline__ u64 mr_epoch(const Params& p, int kind, int n, int i) {
  return (u64)(p.e0[kind] + (long long)n * NPOST + mr_index(i));
}
// this rank failed a kccl wait (device memory: cheap). The host's abort word (a peer died) is
// host-mapped, a PCIe read: only the spins look at it, and they record it here (kccl_fail)
__device__ __forceinline__ bool mr_dead() { return kccl_failed(kds); }
// the monokernel's own counters, polled so that the grid leaves once the rank failed
__device__ __forceinline__ void spin_mr(const u64* ptr, u64 target) {
  for (unsigned it = 1; ld_acquire(ptr) < target; ++it)
    if ((it & 1023u) == 0) {
      if (kds.abort && *(volatile const int*)kds.abort) kccl_fail(kds, KCCL_ERR_ABORTED, -1, 0, 0, 0);
      if (mr_dead()) return;
    }
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
// a producer's row r of own lane l, value v: into every peer's window (off: mr_ll_off(c, rank, e))
__device__ __forceinline__ void mr_put(long long off, unsigned tag, int l, int r, float v) {
#pragma unroll
  for (int q = 0; q < NRK; ++q)
    if (q != (int)kds.rank) kccl_ll_st((u64*)(kds.base[q] + off) + (long long)l * D + r, tag, __float_as_uint(v));
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
// sum over all LG lanes (lane order) of element r; own: lane g's value
__device__ __noinline__ float mr_lane_sum(const MrPart& m, int r, int g, float* own) {
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
#endif

// ---- helpers -----------------------------------------------------------------------------------
#ifndef CFG_XPLANES
#define CFG_XPLANES 1
#endif
// An input vector x of K floats (K = D, HDL or FL) is kept in shared memory in two planes when VEC = 8:
// x[8c .. 8c+3] at 4c, x[8c+4 .. 8c+7] at K/2 + 4c, so that the float4 loads of a warp's 32 consecutive
// 16-byte weight chunks read consecutive addresses (no bank conflicts). VEC = 4 (fp32): as is.
constexpr bool XPL = CFG_XPLANES && VEC == 8;
__device__ __forceinline__ int xp(int d, int K) {
  return XPL ? ((d & 7) >> 2) * (K >> 1) + ((d >> 3) << 2) + (d & 3) : d;
}
// dot of 16 bytes of storage (chunk c of a row of K) with x (shared, K floats, planes as above)
template <int K>
__device__ __forceinline__ float dotx(const uint4& w, const float* xs, int c) {
  if (!XPL) return dot16(w, xs + c * VEC);
  float f[8];
  unpack(w, f);
  const float4 a = *reinterpret_cast<const float4*>(xs + c * 4);
  const float4 b = *reinterpret_cast<const float4*>(xs + (K >> 1) + c * 4);
  float s = 0.f;
  s = fmaf(f[0], a.x, s); s = fmaf(f[1], a.y, s); s = fmaf(f[2], a.z, s); s = fmaf(f[3], a.w, s);
  s = fmaf(f[4], b.x, s); s = fmaf(f[5], b.y, s); s = fmaf(f[6], b.z, s); s = fmaf(f[7], b.w, s);
  return s;
}
__device__ __forceinline__ void brange(int U, int& a, int& b) {
  a = (int)((long long)blockIdx.x * U / NB);
  b = (int)((long long)(blockIdx.x + 1) * U / NB);
}
// count of units of lane l inside [a, b) for a lane-major unit space with upl units per lane
__device__ __forceinline__ int lane_units(int l, int upl, int a, int b) {
  int lo = max(a, l * upl), hi = min(b, (l + 1) * upl);
  return hi > lo ? hi - lo : 0;
}
__device__ __forceinline__ bool fused_step(int s) {   // residual s written by its producer rows
  if (s == 0) return true;
  int i = (s - 1) / 2;
  return !(USE_COMM && USE_EARLY && i < DELTA && LG > 1);
}

__device__ float block_sum(float v, float* red) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  v = warp_sum(v);
  __syncthreads();
  if (lane == 0) red[warp] = v;
  __syncthreads();
  float t = 0.f;
#pragma unroll
  for (int w = 0; w < NW; ++w) t += red[w];
  return t;
}

// NR rows of K columns starting at w (row stride K), dotted with xs (shared, K floats); rows >= nvalid
// are not read. All lanes get the NR sums.
#ifndef CFG_UB_QKV
#define CFG_UB_QKV CFG_UBMAX   // loads in flight per lane in the QKV rows
#endif
#ifndef CFG_UB_WO
#define CFG_UB_WO CFG_UBMAX    // ... in the output projection's rows
#endif
template <int NR, int K, bool SMEM = false, int UBM = CFG_UBMAX>
__device__ __forceinline__ void warp_dot(const wt* __restrict__ w, int nvalid, const float* xs, float* out) {
  constexpr int NCHK = K / VEC;
  constexpr int CPL = (NCHK + 31) / 32;
  constexpr int UB0 = UBM / NR;
  constexpr int UB = UB0 < 1 ? 1 : (UB0 > CPL ? CPL : UB0);
  const int lane = threadIdx.x & 31;
  float acc[NR];
#pragma unroll
  for (int r = 0; r < NR; ++r) acc[r] = 0.f;
#pragma unroll
  for (int b0 = 0; b0 < CPL; b0 += UB) {
    uint4 wv[NR][UB];
#pragma unroll
    for (int r = 0; r < NR; ++r)
#pragma unroll
      for (int u = 0; u < UB; ++u) {
        const int c = (b0 + u) * 32 + lane;
        if (b0 + u < CPL && c < NCHK && r < nvalid)
          wv[r][u] = SMEM ? *reinterpret_cast<const uint4*>(w + (long long)r * K + (long long)c * VEC)
                          : ldw(w + (long long)r * K + (long long)c * VEC);
        else
          wv[r][u] = make_uint4(0u, 0u, 0u, 0u);
      }
#pragma unroll
    for (int r = 0; r < NR; ++r)
#pragma unroll
      for (int u = 0; u < UB; ++u) {
        const int c = (b0 + u) * 32 + lane;
        if (b0 + u < CPL && c < NCHK) acc[r] += dotx<K>(wv[r][u], xs, c);
      }
  }
#pragma unroll
  for (int r = 0; r < NR; ++r) out[r] = warp_sum(acc[r]);
}

// residual of lane l at version s, element d, where version s is in memory (or is the embedding)
__device__ __forceinline__ float hbase(const Params& p, int s, int l, int d, int tok) {
  if (s == 0) return w2f(p.emb[(long long)tok * D + d]);
  return ldf(p.hres + ((long long)s * L + l) * D + d);
}
// residual of lane l at version s computed by its consumer (versions of the early layers with
// use_early_comm, which need every lane's partial of this layer)
__device__ __forceinline__ float hval(const Params& p, int s, int l, int d, int tok) {
  if (fused_step(s)) return hbase(p, s, l, d, tok);
  const int i = (s - 1) / 2, kind = (s - 1) & 1;
#if KOG_NRANKS > 1
  const float tot = mr_lane_sum(mr_part(p, kind, mr_n_s, i), d, 0, nullptr);
#else
  const float* pp = p.part + ((long long)(i * 2 + kind) * L) * D + d;
  float tot = ldf(pp);
#pragma unroll 1
  for (int j = 1; j < L; ++j) tot += ldf(pp + (long long)j * D);
#endif
  return hbase(p, s - 1, l, d, tok) + tot;
}
// dst[k*D + d] = rms(h_{l0+k} at version s) * g[l0+k] for k < nl, all lanes in one pass and one block
// reduction; the writer lanes (bit k of wmask) also store a consumer-computed version to memory
constexpr int MAXL = L < 8 ? L : 8;
constexpr int DPT = (D + NT - 1) / NT;
__device__ void stage_norms(const Params& p, float* dst, int s, int l0, int nl, const float* g, int tok,
                            unsigned wmask, float* red) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int kb = 0; kb < nl; kb += MAXL) {
    __syncthreads();
#pragma unroll 1
    for (int k = 0; k < MAXL; ++k) {
      float ss = 0.f;
      if (kb + k < nl) {
        float v[DPT];
#pragma unroll
        for (int e = 0; e < DPT; ++e) {
          const int d = threadIdx.x + e * NT;
          v[e] = (d < D) ? hval(p, s, l0 + kb + k, d, tok) : 0.f;
        }
#pragma unroll
        for (int e = 0; e < DPT; ++e) {
          const int d = threadIdx.x + e * NT;
          if (d < D) { dst[(kb + k) * D + xp(d, D)] = v[e]; ss += v[e] * v[e]; }
        }
      }
      ss = warp_sum(ss);
      if (lane == 0) red[warp * MAXL + k] = ss;
    }
    __syncthreads();
    for (int k = 0; k < MAXL && kb + k < nl; ++k) {
      float tot = 0.f;
#pragma unroll
      for (int w = 0; w < NW; ++w) tot += red[w * MAXL + k];
      const float inv = 1.0f / sqrtf(tot / (float)D + EPS);
      const int l = l0 + kb + k;
      const bool wr = ((wmask >> (kb + k)) & 1u) && !fused_step(s);
      const float* gl = g + (long long)l * D;
      float* x = dst + (kb + k) * D;
      float gv[DPT];
#pragma unroll
      for (int e = 0; e < DPT; ++e) {
        const int d = threadIdx.x + e * NT;
        gv[e] = d < D ? __ldg(gl + d) : 0.f;
      }
#pragma unroll
      for (int e = 0; e < DPT; ++e) {
        const int d = threadIdx.x + e * NT;
        if (d < D) {
          const float v = x[xp(d, D)];
          if (wr) p.hres[((long long)s * L + l) * D + d] = v;
          x[xp(d, D)] = (v * inv) * gv[e];
        }
      }
    }
  }
  __syncthreads();
}
// The common case (NORM2: a block's QKV and W13 units span at most 2 lanes): the norm weights are copied
// into shared memory before the block waits for the residual (norm_g_load), and both lanes' residual
// loads are in flight at once, so the phase pays one load latency after its wait instead of four. Same
// arithmetic, same bits as stage_norms.
__device__ __forceinline__ void norm_g_load(float* sm, const float* g, int l0, int nl) {
  const int n4 = nl * D / 4;                    // the nl lanes' rows are contiguous in g
  for (int x = threadIdx.x; x < n4; x += NT) cp_async16(sm + GS_OFF + 4 * x, g + (long long)l0 * D + 4 * x);
  cp_async_commit();
}
// dst: the block's shared memory (sm); the weights at sm + GS_OFF (norm_g_load, waited for by the caller's
// cp_async_wait_all, visible after the first barrier below)
__device__ __noinline__ void stage_norms2(const Params& p, float* dst, int s, int l0, int nl, int tok,
                                             unsigned wmask, float* red) {
  const float* gs = dst + GS_OFF;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  float v[2][DPT];
#pragma unroll
  for (int k = 0; k < 2; ++k)
#pragma unroll
    for (int e = 0; e < DPT; ++e) {
      const int d = threadIdx.x + e * NT;
      v[k][e] = (k < nl && d < D) ? hval(p, s, l0 + k, d, tok) : 0.f;
    }
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    if (k >= nl) break;
    float ss = 0.f;
#pragma unroll
    for (int e = 0; e < DPT; ++e)
      if (threadIdx.x + e * NT < D) ss += v[k][e] * v[k][e];
    ss = warp_sum(ss);
    if (lane == 0) red[warp * MAXL + k] = ss;
  }
  __syncthreads();
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    if (k >= nl) break;
    float tot = 0.f;
#pragma unroll
    for (int w = 0; w < NW; ++w) tot += red[w * MAXL + k];
    const float inv = 1.0f / sqrtf(tot / (float)D + EPS);
    const int l = l0 + k;
    const bool wr = ((wmask >> k) & 1u) && !fused_step(s);
#pragma unroll
    for (int e = 0; e < DPT; ++e) {
      const int d = threadIdx.x + e * NT;
      if (d < D) {
        if (wr) p.hres[((long long)s * L + l) * D + d] = v[k][e];
        dst[k * D + xp(d, D)] = (v[k][e] * inv) * gs[k * D + d];
      }
    }
  }
  __syncthreads();
}
// the final norm of every lane (residual version 2NL): into rows ([L][D], global) when given, else
// their lane mean into y (shared): all lanes in batches of MAXL with one block reduction per batch
#ifndef CFG_FNB
#define CFG_FNB 4
#endif
constexpr int FNB = MAXL < CFG_FNB ? MAXL : CFG_FNB;   // lanes per batch (registers: FNB * DPT floats)
__device__ __noinline__ void final_norms(const Params& p, int tok, float* red, float* rows, float* y) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  float acc[DPT];
#pragma unroll
  for (int e = 0; e < DPT; ++e) acc[e] = 0.f;
  for (int kb = 0; kb < L; kb += FNB) {
    float v[FNB][DPT];
#pragma unroll
    for (int k = 0; k < FNB; ++k)
#pragma unroll
      for (int e = 0; e < DPT; ++e) {
        const int d = threadIdx.x + e * NT;
        v[k][e] = (kb + k < L && d < D) ? hval(p, 2 * NL, kb + k, d, tok) : 0.f;
      }
    __syncthreads();
#pragma unroll
    for (int k = 0; k < FNB; ++k) {
      float ss = 0.f;
#pragma unroll
      for (int e = 0; e < DPT; ++e) ss += v[k][e] * v[k][e];
      ss = warp_sum(ss);
      if (lane == 0) red[warp * MAXL + k] = ss;
    }
    __syncthreads();
#pragma unroll
    for (int k = 0; k < FNB; ++k) {
      const int l = kb + k;
      if (l >= L) break;
      float tot = 0.f;
#pragma unroll
      for (int w = 0; w < NW; ++w) tot += red[w * MAXL + k];
      const float inv = 1.0f / sqrtf(tot / (float)D + EPS);
#pragma unroll
      for (int e = 0; e < DPT; ++e) {
        const int d = threadIdx.x + e * NT;
        if (d < D) {
          const float t = (v[k][e] * inv) * __ldg(p.fnorm + (long long)l * D + d);
          if (rows) rows[(long long)l * D + d] = t;
          else acc[e] = l == 0 ? t : acc[e] + t;
        }
      }
    }
  }
  if (y)
#pragma unroll
    for (int e = 0; e < DPT; ++e) {
      const int d = threadIdx.x + e * NT;
      if (d < D) y[xp(d, D)] = acc[e] / (float)L;
    }
  __syncthreads();
}
// the writer mask of a consumer phase: lanes whose first unit this block owns
__device__ __forceinline__ unsigned writer_mask(int l0, int l1, int upl, int ua, int ub) {
  unsigned m = 0;
  for (int l = l0; l <= l1 && l - l0 < 32; ++l)
    if (ua <= l * upl && l * upl < ub) m |= 1u << (l - l0);
  return m;
}
// the producer's combine: the inputs other than this layer's partial (residual base and the delayed
// lanes' term) are staged in shared memory for all the block's rows before the block waits for its
// inputs (they are ready earlier), so the rows' epilogue reads only shared memory.
__device__ __forceinline__ bool has_delayed(int i) {
  return USE_COMM && LG > 1 && i >= DELTA && ((i - DELTA) >= DELTA || EARLY_FUTURE);
}
__device__ void stage_combine(const Params& p, float* cb, int i, int kind, int ua, int ub, int nr, int upl, int tok) {
  const int s = 2 * i + 1 + kind;
  if (!fused_step(s)) return;
  const int n = (ub - ua) * nr;
#if KOG_NRANKS > 1
  const MrPart mr = mr_part(p, kind, mr_n_s, has_delayed(i) ? i - DELTA : i);
#endif
  for (int x = threadIdx.x; x < n; x += NT) {
    const int u = ua + x / nr, l = u / upl, r = (u % upl) * nr + x % nr;
    const float base = hbase(p, s - 1, l, r, tok);
    float dt = 0.f;
    if (has_delayed(i)) {
#if KOG_NRANKS > 1
      float own;
      const float tot = mr_lane_sum(mr, r, (int)kds.rank * L + l, &own);
      dt = tot - own;
#else
      const float* pp = p.part + ((long long)((i - DELTA) * 2 + kind) * L) * D + r;
      float P[L];
#pragma unroll
      for (int j = 0; j < L; ++j) P[j] = ldf(pp + (long long)j * D);
      float tot = P[0], own = P[0];
#pragma unroll
      for (int j = 1; j < L; ++j) {
        tot += P[j];
        if (j == l) own = P[j];
      }
      dt = tot - own;
#endif
    }
    cb[2 * x] = base;
    cb[2 * x + 1] = dt;
  }
}
__device__ __forceinline__ void combine_finish(const Params& p, int i, int kind, int l, int r, float pv, const float* c) {
  const int s = 2 * i + 1 + kind;
  p.part[((long long)(i * 2 + kind) * L + l) * D + r] = pv;
  if (!fused_step(s)) return;
  const float base = c[0];
  float h;
  if (!USE_COMM || i < DELTA) h = (USE_COMM && LG == 1) ? base + pv : base + sqrtf((float)LG) * pv;
  else if (has_delayed(i)) h = base + (pv + c[1]);
  else h = base + pv;
  p.hres[((long long)s * L + l) * D + r] = h;
}
__device__ __forceinline__ float pick(const float* a, int n, int k) {
  float v = a[0];
  for (int r = 1; r < n; ++r)
    if (k == r) v = a[r];
  return v;
}

#ifndef CFG_SIG_FENCE
#define CFG_SIG_FENCE 0   // 1: also a __threadfence before the release (measured 2% slower)
#endif
__device__ __forceinline__ void signal_lanes(const Params& p, int phase, int upl, int a, int b) {
  __syncthreads();
  if (threadIdx.x == 0 && a < b) {
    if (CFG_SIG_FENCE) __threadfence();   // 0: the red.release after the barrier alone (PTX model: enough)
    for (int l = a / upl; l <= (b - 1) / upl; ++l) {
      int n = lane_units(l, upl, a, b);
      if (n) red_release(CTR(p, phase * L + l), (u64)n);
    }
  }
}
__device__ __forceinline__ void wait_lanes(const Params& p, int phase, int l0, int l1, u64 target) {
  for (int l = l0; l <= l1; ++l) SPIN(p, CTR(p, phase * L + l), target);
}
// the delayed partials of layer i - DELTA must be complete before a producer of layer i combines
__device__ __forceinline__ void wait_delayed(const Params& p, int phase, int upl, int n, int i) {
  if (USE_COMM && LG > 1 && i >= DELTA && ((i - DELTA) >= DELTA || EARLY_FUTURE))
    wait_lanes(p, phase, 0, L - 1, (u64)(n * NL + i - DELTA + 1) * upl);   // own lanes (others: LL words)
}

#if KOG_NRANKS > 1
// the final norm's lane mean over every rank: block 0 posts the rank's normed rows (written straight
// into p.yfin) and the host's cancel word; every block sums the LG rows in lane order into y
__device__ void final_norms(const Params& p, int tok, float* red, float* rows, float* y);
__device__ void mr_final(const Params& p, int n, int tok, float* red, float* y) {
  const u64 e = (u64)(p.e0[2] + n);
  if (blockIdx.x == 0) {
    const bool ok = kccl_post_begin(kds, CH_FIN, e);
    final_norms(p, tok, red, p.yfin, nullptr);
    if (threadIdx.x == 0) p.yfin[L * D] = __int_as_float(*(volatile const int*)p.cancel);
    __syncthreads();
    if (ok) {
      kccl_post_chunk(kds, CH_FIN, e, p.yfin, 0, 4LL * FIN_FLOATS);
      kccl_post_end(kds, CH_FIN, e, 1, 4LL * FIN_FLOATS, 3);
    }
  }
  kccl_wait(kds, CH_FIN, e);
  const char* p0 = kccl_slot(kds, CH_FIN, 0, e);                 // rank q's rows: q * st further
  const long long st = (long long)MR_DEPTH * kds.slot_bytes;
  for (int d = threadIdx.x; d < D; d += NT) {
    float a = __ldcg((const float*)p0 + d);
    for (int j = 1; j < LG; ++j) a += __ldcg((const float*)(p0 + (j / L) * st) + (j % L) * D + d);
    y[xp(d, D)] = a / (float)LG;
  }
  if (threadIdx.x == 0) {
    int c = 0;
    for (int r = 0; r < NRK; ++r) c |= __float_as_int(__ldcg((const float*)(p0 + r * st) + L * D));
    mr_cancel_s = c;
  }
  kccl_collect_end(kds, CH_FIN, e, NB);
}
#endif

#ifndef CFG_PF_KV
#define CFG_PF_KV 65536   // bytes of keys (and of values) per attention unit; 0: off (719 vs 728 tok/s)
#endif
// positions [cs, ce) of attention chunk c at position t of layer i
__device__ __forceinline__ void att_chunk(int i, int t, int c, int& cs, int& ce) {
  const int lo = sliding(i) ? max(0, t - SW + 1) : 0;
  const int CH = (t - lo + 1 + NCH - 1) / NCH;
  cs = lo + c * CH;
  ce = min(cs + CH, t + 1);
}
// at the end of QKV's rows: the cached keys and values the block's attention units will read, into L2
__device__ __forceinline__ void prefetch_kv(const Params& p, int i, int t) {
  if (CFG_PF_KV <= 0) return;
  int aa, ab;
  brange(U_ATT, aa, ab);
  for (int u = aa; u < ab; ++u) {
    const int g = u / NCH;
    int cs, ce;
    att_chunk(i, t, u % NCH, cs, ce);
    if (ce <= cs) continue;
    const long long off = (((long long)i * KV + g) * p.max_seq + cs) * HD;
    prefetch_l2(p.kc + off, (long long)(ce - cs) * HD * sizeof(wt), CFG_PF_KV);
    prefetch_l2(p.vc + off, (long long)(ce - cs) * HD * sizeof(wt), CFG_PF_KV);
  }
}

// ---- phases ------------------------------------------------------------------------------------
__device__ void phase_qkv(const Params& p, float* sm, int n, int i, int t, int tok, bool prefilled) {
  int ua, ub;
  const int ph = 5 * i;
  tmark(p, n, ph, 0);
  brange(U_QKV, ua, ub);
  const wt* W = p.w + (long long)i * LAYER_SZ + OFF_QKV;
  const int nbuf = wbuf_fill(sm, W + (long long)ua * UE_QKV, ub - ua, UE_QKV, !prefilled);
  if (!prefilled)
    prefetch_l2(W + (long long)(ua + nbuf) * UE_QKV, (long long)(ub - ua - nbuf) * UE_QKV * sizeof(wt), PF);
  if (ua >= ub) return;
  const int l0 = ua / UPL_QKV, l1 = (ub - 1) / UPL_QKV;
  float* red = sm + SM_MAIN - 16 * 8 - 16;
  const int s = 2 * i;
  if (NORM2) norm_g_load(sm, p.norms + (long long)(i * 2 + 0) * L * D, l0, l1 - l0 + 1);
  if (threadIdx.x == 0 && s > 0) {
    const u64 tgt = (u64)(n * NL + i) * UPL_W2;    // W2 of layer i-1 done
    if (fused_step(s)) wait_lanes(p, C_W2, l0, l1, tgt);
    else wait_lanes(p, C_W2, 0, L - 1, tgt);
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
    else warp_dot<2, D, false, CFG_UB_QKV>(W + ((long long)l * RQKV + row) * D, 2, sm + (l - l0) * D, acc);
    if (lane == 0) {
      float x0 = acc[0], x1 = acc[1];
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

// The output projection's combine inputs (residual base, delayed lanes' term) of the block's WO rows
// [ua, ub), staged into shared memory (CB_OFF) before the rows: with CFG_ATTCB when attention starts
// (they are ready by then; WO itself then waits only for attention), else at WO's entry.
#ifndef CFG_ATTCB
#define CFG_ATTCB 1
#endif
__device__ void wo_stage_combine(const Params& p, float* sm, int n, int i, int tok, int ua, int ub) {
  const int l0 = ua / UPL_WO, l1 = (ub - 1) / UPL_WO;
  if (threadIdx.x == 0) {
    wait_delayed(p, C_WO, UPL_WO, n, i);
    if (i > 0) {   // the residual base h[2i] of the block's lanes: W2(i-1), or the QKV(i) writer block
      if (fused_step(2 * i)) wait_lanes(p, C_W2, l0, l1, (u64)(n * NL + i) * UPL_W2);
      else wait_lanes(p, C_QKV, l0, l1, (u64)(n * NL + i + 1) * UPL_QKV);
    }
  }
  __syncthreads();
  stage_combine(p, sm + CB_OFF, i, 0, ua, ub, NR_WO, UPL_WO, tok);
}

__device__ __noinline__ void phase_att(const Params& p, float* sm, int n, int i, int t, int tok) {
  int ua, ub;
  const int ph = 5 * i + 1;
  tmark(p, n, ph, 0);
  brange(U_ATT, ua, ub);
  {  // the output projection's weights come next: ask L2 for them now
    int wa, wb;
    brange(U_WO, wa, wb);
    const wt* Wo = p.w + (long long)i * LAYER_SZ + OFF_WO;
    const int nb = wbuf_fill(sm, Wo + (long long)wa * UE_WO, wb - wa, UE_WO, true);
    prefetch_l2(Wo + (long long)(wa + nb) * UE_WO, (long long)(wb - wa - nb) * UE_WO * sizeof(wt), PF_ATT);
    if (CFG_ATTCB && wa < wb) wo_stage_combine(p, sm, n, i, tok, wa, wb);
  }
  if (ua >= ub) return;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  float* sq = sm;                        // [G][HD]
  float* wacc = sm + G * HD;             // [NW][G][HD]
  float* wm = wacc + NW * G * HD;        // [NW][G]
  float* wl = wm + NW * G;               // [NW][G]
  const int lo = sliding(i) ? max(0, t - SW + 1) : 0;
  const int nvis = t - lo + 1;
  const int CH = (nvis + NCH - 1) / NCH;
  const float scale = 1.0f / sqrtf((float)HD);
  constexpr int VCH = HD / VEC, S = 32 / VCH;
  const int slot = lane / VCH, ch = lane % VCH;
  int waited = -1;
  for (int u = ua; u < ub; ++u) {
    const int g = u / NCH, c = u % NCH, l = g / KVL;
    if (l != waited) {
      if (threadIdx.x == 0) SPIN(p, CTR(p, C_QKV * L + l), (u64)(n * NL + i + 1) * UPL_QKV);
      waited = l;
    }
    __syncthreads();
    if (u == ua) tmark(p, n, ph, 1);
    for (int x = threadIdx.x; x < G * HD; x += NT) sq[x] = ldf(p.q + (long long)g * G * HD + x);
    __syncthreads();
    const int cs = lo + c * CH, ce = min(cs + CH, t + 1);
    const wt* kb = p.kc + ((long long)i * KV + g) * p.max_seq * HD;
    const wt* vb = p.vc + ((long long)i * KV + g) * p.max_seq * HD;
    float m[G], ls[G], acc[G][VEC];
#pragma unroll
    for (int h = 0; h < G; ++h) {
      m[h] = -1e30f; ls[h] = 0.f;
#pragma unroll
      for (int e = 0; e < VEC; ++e) acc[h][e] = 0.f;
    }
    for (int j0 = cs + warp * 32; j0 < ce; j0 += NW * 32) {
      const int j = j0 + lane;
      const bool valid = j < ce;
      float sc[G];
#pragma unroll
      for (int h = 0; h < G; ++h) sc[h] = 0.f;
      if (valid) {
        uint4 kv[VCH];
#pragma unroll
        for (int cc = 0; cc < VCH; ++cc) kv[cc] = ldc16(kb + (long long)j * HD + cc * VEC);
#pragma unroll
        for (int cc = 0; cc < VCH; ++cc)
#pragma unroll
          for (int h = 0; h < G; ++h) sc[h] += dot16(kv[cc], sq + h * HD + cc * VEC);
      }
      // this group's V rows: all loads in flight before the softmax reductions
      constexpr int NKV = (32 + S - 1) / S;
      uint4 vv[NKV];
#pragma unroll
      for (int q = 0; q < NKV; ++q) {
        const int kk = q * S + slot;
        if (slot < S && kk < 32 && j0 + kk < ce) vv[q] = ldc16(vb + (long long)(j0 + kk) * HD + ch * VEC);
        else vv[q] = make_uint4(0u, 0u, 0u, 0u);
      }
      float pj[G];
#pragma unroll
      for (int h = 0; h < G; ++h) {
        const float sv = valid ? sc[h] * scale : -1e30f;
        const float mn = fmaxf(m[h], warp_max(sv));
        const float corr = expf(m[h] - mn);
        pj[h] = valid ? expf(sv - mn) : 0.f;
        ls[h] = ls[h] * corr + warp_sum(pj[h]);
#pragma unroll
        for (int e = 0; e < VEC; ++e) acc[h][e] *= corr;
        m[h] = mn;
      }
#pragma unroll
      for (int q = 0; q < NKV; ++q) {
        const int kk = q * S + slot;
        float pv[G];
#pragma unroll
        for (int h = 0; h < G; ++h) pv[h] = __shfl_sync(0xffffffffu, pj[h], kk & 31);
        if (slot < S && kk < 32 && j0 + kk < ce) {
          float f[VEC];
          unpack(vv[q], f);
#pragma unroll
          for (int h = 0; h < G; ++h)
#pragma unroll
            for (int e = 0; e < VEC; ++e) acc[h][e] = fmaf(pv[h], f[e], acc[h][e]);
        }
      }
    }
    // slots of a warp -> slot 0
#pragma unroll
    for (int h = 0; h < G; ++h)
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        float tot = acc[h][e];
#pragma unroll
        for (int so = 1; so < S; ++so) tot += __shfl_down_sync(0xffffffffu, acc[h][e], so * VCH);
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
    __syncthreads();
    for (int x = threadIdx.x; x < G * HD; x += NT) {
      const int h = x / HD, d = x % HD;
      float M = -1e30f;
      for (int w = 0; w < NW; ++w) M = fmaxf(M, wm[w * G + h]);
      float A = 0.f, Ls = 0.f;
      for (int w = 0; w < NW; ++w) {
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

__device__ void phase_wo(const Params& p, float* sm, int n, int i, int tok) {
  int ua, ub;
  const int ph = 5 * i + 2;
  tmark(p, n, ph, 0);
  brange(U_WO, ua, ub);
  const wt* W = p.w + (long long)i * LAYER_SZ + OFF_WO;
  const int nbuf = wbuf_fill(sm, W + (long long)ua * UE_WO, ub - ua, UE_WO, false);   // issued by ATT
#if KOG_NRANKS > 1
  const long long mr_off = mr_posted(i) ? mr_ll_off(1 + 0, (int)kds.rank, mr_epoch(p, 0, n, i)) : -1;
  const unsigned mr_tag = (unsigned)mr_epoch(p, 0, n, i);
#endif
  if (ua >= ub) return;
  const int l0 = ua / UPL_WO, l1 = (ub - 1) / UPL_WO;
  float* cb = sm + CB_OFF;
  if (!CFG_ATTCB) wo_stage_combine(p, sm, n, i, tok, ua, ub);
  if (threadIdx.x == 0) wait_lanes(p, C_ATT, l0, l1, (u64)(n * NL + i + 1) * UPL_ATT);
  __syncthreads();
  tmark(p, n, ph, 1);
  // attention outputs of the block's lanes, merged over the position chunks
  for (int l = l0; l <= l1; ++l)
    for (int x = threadIdx.x; x < HDL; x += NT) {
      const int hh = x / HD, d = x % HD, qh = l * HL + hh, g = qh / G, hg = qh % G;
      const float* a = p.attp + ((long long)g * NCH * G + hg) * ATTP;
      float mc[NCH], ac[NCH], lc[NCH];
#pragma unroll
      for (int c = 0; c < NCH; ++c) {
        const float* ach = a + (long long)c * G * ATTP;
        mc[c] = ldf(ach + HD); ac[c] = ldf(ach + d); lc[c] = ldf(ach + HD + 1);
      }
      float M = -1e30f;
#pragma unroll
      for (int c = 0; c < NCH; ++c) M = fmaxf(M, mc[c]);
      float A = 0.f, Ls = 0.f;
#pragma unroll
      for (int c = 0; c < NCH; ++c) {
        const float e = expf(mc[c] - M);
        A += ac[c] * e;
        Ls += lc[c] * e;
      }
      sm[(l - l0) * HDL + xp(x, HDL)] = A / Ls;
    }
  cp_async_wait_all();
  __syncthreads();
  tmark(p, n, ph, 3);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  for (int u = ua + warp; u < ub; u += NW) {
    const int l = u / UPL_WO, r0 = (u % UPL_WO) * NR_WO;
    float acc[NR_WO];
    if (u - ua < nbuf)
      warp_dot<NR_WO, HDL, true>((const wt*)(sm + WBUF_OFF) + (long long)(u - ua) * UE_WO, NR_WO, sm + (l - l0) * HDL, acc);
    else
      warp_dot<NR_WO, HDL, false, CFG_UB_WO>(W + ((long long)l * D + r0) * HDL, NR_WO, sm + (l - l0) * HDL, acc);
    if (lane < NR_WO) {
      const float pv = pick(acc, NR_WO, lane);
      combine_finish(p, i, 0, l, r0 + lane, pv, cb + 2 * ((u - ua) * NR_WO + lane));
#if KOG_NRANKS > 1
      if (mr_off >= 0) mr_put(mr_off, mr_tag, l, r0 + lane, pv);
#endif
    }
  }
  tmark(p, n, ph, 4);
  signal_lanes(p, C_WO, UPL_WO, ua, ub);
  tmark(p, n, ph, 2);
}

__device__ void phase_w13(const Params& p, float* sm, int n, int i, int tok) {
  int ua, ub;
  const int ph = 5 * i + 3;
  tmark(p, n, ph, 0);
  brange(U_W13, ua, ub);
  const wt* W = p.w + (long long)i * LAYER_SZ + OFF_W13;
  const int nbuf = wbuf_fill(sm, W + (long long)ua * UE_W13, ub - ua, UE_W13, true);
  prefetch_l2(W + (long long)(ua + nbuf) * UE_W13, (long long)(ub - ua - nbuf) * UE_W13 * sizeof(wt), PF);
  if (ua >= ub) return;
  const int l0 = ua / UPL_W13, l1 = (ub - 1) / UPL_W13;
  float* red = sm + SM_MAIN - 16 * 8 - 16;
  const int s = 2 * i + 1;
  if (NORM2) norm_g_load(sm, p.norms + (long long)(i * 2 + 1) * L * D, l0, l1 - l0 + 1);
  if (threadIdx.x == 0) {
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
  for (int u = ua + warp; u < ub; u += NW) {
    const int l = u / UPL_W13, j = u % UPL_W13;
    float acc[2];
    if (u - ua < nbuf) warp_dot<2, D, true>((const wt*)(sm + WBUF_OFF) + (long long)(u - ua) * UE_W13, 2, sm + (l - l0) * D, acc);
    else warp_dot<2, D>(W + ((long long)l * FL + j) * 2 * D, 2, sm + (l - l0) * D, acc);
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
  const wt* W = p.w + (long long)i * LAYER_SZ + OFF_W2;
  const int nbuf = wbuf_fill(sm, W + (long long)ua * UE_W2, ub - ua, UE_W2, true);
  prefetch_l2(W + (long long)(ua + nbuf) * UE_W2, (long long)(ub - ua - nbuf) * UE_W2 * sizeof(wt), PF);
#if KOG_NRANKS > 1
  const long long mr_off = mr_posted(i) ? mr_ll_off(1 + 1, (int)kds.rank, mr_epoch(p, 1, n, i)) : -1;
  const unsigned mr_tag = (unsigned)mr_epoch(p, 1, n, i);
#endif
  if (ua >= ub) return;
  const int l0 = ua / UPL_W2, l1 = (ub - 1) / UPL_W2;
  float* cb = sm + CB_OFF;
  if (threadIdx.x == 0) {
    wait_delayed(p, C_W2, UPL_W2, n, i);
    // the residual base h[2i+1] of the block's lanes: WO(i), or the W13(i) writer block
    if (fused_step(2 * i + 1)) wait_lanes(p, C_WO, l0, l1, (u64)(n * NL + i + 1) * UPL_WO);
    else wait_lanes(p, C_W13, l0, l1, (u64)(n * NL + i + 1) * UPL_W13);
  }
  __syncthreads();
  stage_combine(p, cb, i, 1, ua, ub, NR_W2, UPL_W2, tok);
  if (threadIdx.x == 0) wait_lanes(p, C_W13, l0, l1, (u64)(n * NL + i + 1) * UPL_W13);
  __syncthreads();
  tmark(p, n, ph, 1);
  for (int l = l0; l <= l1; ++l)
    for (int x = threadIdx.x; x < FL; x += NT) sm[(l - l0) * FL + xp(x, FL)] = ldf(p.hid + (long long)l * FL + x);
  cp_async_wait_all();
  __syncthreads();
  tmark(p, n, ph, 3);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  for (int u = ua + warp; u < ub; u += NW) {
    const int l = u / UPL_W2, r0 = (u % UPL_W2) * NR_W2;
    float acc[NR_W2];
    if (u - ua < nbuf)
      warp_dot<NR_W2, FL, true>((const wt*)(sm + WBUF_OFF) + (long long)(u - ua) * UE_W2, NR_W2, sm + (l - l0) * FL, acc);
    else
      warp_dot<NR_W2, FL>(W + ((long long)l * D + r0) * FL, NR_W2, sm + (l - l0) * FL, acc);
    if (lane < NR_W2) {
      const float pv = pick(acc, NR_W2, lane);
      combine_finish(p, i, 1, l, r0 + lane, pv, cb + 2 * ((u - ua) * NR_W2 + lane));
#if KOG_NRANKS > 1
      if (mr_off >= 0) mr_put(mr_off, mr_tag, l, r0 + lane, pv);
#endif
    }
  }
  tmark(p, n, ph, 4);
  signal_lanes(p, C_W2, UPL_W2, ua, ub);
  tmark(p, n, ph, 2);
}

// full sampling (temperature / top-k / top-p) by one block; returns the token in every thread
__device__ __noinline__ int sample_full(const Params& p, float* sm, u64 counter) {
  double* dred = reinterpret_cast<double*>(sm);    // [NW + 4]
  int* ired = reinterpret_cast<int*>(sm + 2 * (NW + 8));
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  u64* buf = p.sortbuf;
  // keys: logits descending (= probability descending), then index ascending
  for (int v = tid; v < VPOW2; v += NT) {
    u64 key = 0;
    if (v < V) {
      u32 b = __float_as_uint(ldf(p.logits + v));
      b = (b & 0x80000000u) ? ~b : (b | 0x80000000u);      // orderable
      key = ((u64)b << 32) | (u64)(0xffffffffu - (u32)v);
    }
    buf[v] = key;
  }
  __syncthreads();
  for (int k = 2; k <= VPOW2; k <<= 1)
    for (int j = k >> 1; j > 0; j >>= 1) {
      for (int x = tid; x < VPOW2; x += NT) {
        const int y = x ^ j;
        if (y > x) {
          const u64 a = __ldcg(buf + x), b = __ldcg(buf + y);
          const bool desc = (x & k) == 0;
          if (desc ? (a < b) : (a > b)) { buf[x] = b; buf[y] = a; }
        }
      }
      __syncthreads();
    }
  auto idx_of = [&](u64 key) { return (int)(0xffffffffu - (u32)(key & 0xffffffffu)); };
  const double T = p.temperature;
  const double zmax = (double)ldf(p.logits + idx_of(__ldcg(buf))) / T;
  const int K = (p.top_k > 0 && p.top_k < V) ? (int)p.top_k : V;
  // each thread owns a contiguous segment of the first K sorted candidates
  const int seg = (K + NT - 1) / NT;
  const int a = min(K, tid * seg), b = min(K, a + seg);
  double loc = 0.0;
  for (int x = a; x < b; ++x) loc += exp((double)ldf(p.logits + idx_of(__ldcg(buf + x))) / T - zmax);
  // exclusive scan of the segment sums (thread order = sorted order)
  double incl = loc;
  for (int o = 1; o < 32; o <<= 1) {
    double y = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += y;
  }
  if (lane == 31) dred[warp] = incl;
  __syncthreads();
  if (tid == 0) {
    double run = 0.0;
    for (int w = 0; w < NW; ++w) { double t = dred[w]; dred[w] = run; run += t; }
    dred[NW] = run;
  }
  __syncthreads();
  const double before = dred[warp] + incl - loc;
  const double total = dred[NW];
  int Kp = K;
  double total2 = total;
  if (p.top_p < 1.0) {
    if (tid == 0) ired[0] = K;
    __syncthreads();
    double c = before;
    for (int x = a; x < b; ++x) {
      c += exp((double)ldf(p.logits + idx_of(__ldcg(buf + x))) / T - zmax);
      if (c / total >= p.top_p) { atomicMin(ired, x + 1); break; }
    }
    __syncthreads();
    Kp = ired[0];
    __syncthreads();
    // total of the kept prefix: recompute by the owner of its last element
    if (a < Kp && Kp <= b) {
      double c2 = before;
      for (int x = a; x < Kp; ++x) c2 += exp((double)ldf(p.logits + idx_of(__ldcg(buf + x))) / T - zmax);
      dred[NW + 1] = c2;
    }
    __syncthreads();
    total2 = dred[NW + 1];
  }
  const double u = uniform01(p.seed, counter);
  if (tid == 0) ired[1] = Kp - 1;
  __syncthreads();
  {
    double c = before;
    for (int x = a; x < min(b, Kp); ++x) {
      c += exp((double)ldf(p.logits + idx_of(__ldcg(buf + x))) / T - zmax);
      if (c / total2 > u) { atomicMin(ired + 1, x); break; }
    }
  }
  __syncthreads();
  const int tok = idx_of(__ldcg(buf + ired[1]));
  __syncthreads();
  return tok;
}

// returns false when the generation ends with this token
__device__ void phase_lm(const Params& p, float* sm, int n, int tok) {
  int ua, ub;
  tmark(p, n, 5 * NL, 0);
  brange(U_LM, ua, ub);
  const int nbuf = wbuf_fill(sm, p.lm + (long long)ua * UE_LM, ub - ua, UE_LM, true);
  prefetch_l2(p.lm + (long long)(ua + nbuf) * UE_LM, (long long)(ub - ua - nbuf) * UE_LM * sizeof(wt), PF);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, tid = threadIdx.x;
  float* y = sm;
  float* red = sm + SM_MAIN - 16 * 8 - 16;
  __shared__ float bv[NW];
  __shared__ int bi[NW];
  __shared__ int last;
  float best = NEG_INF;
  int besti = 0x7fffffff;
  if (ua < ub) {
    if (tid == 0) wait_lanes(p, C_W2, 0, L - 1, (u64)(n * NL + NL) * UPL_W2);
    __syncthreads();
    tmark(p, n, 5 * NL, 1);
    cp_async_wait_all();
#if KOG_NRANKS > 1
    mr_final(p, n, tok, red, y);
#else
    final_norms(p, tok, red, nullptr, y);
#endif
    __syncthreads();
    for (int u = ua + warp; u < ub; u += NW) {
      const int r0 = 2 * u;
      float acc[2];
      if (u - ua < nbuf)
        warp_dot<2, D, true>((const wt*)(sm + WBUF_OFF) + (long long)(u - ua) * UE_LM, min(2, V - r0), y, acc);
      else
        warp_dot<2, D>(p.lm + (long long)r0 * D, min(2, V - r0), y, acc);
      if (lane == 0) {
#pragma unroll
        for (int r = 0; r < 2; ++r)
          if (r0 + r < V) {
            p.logits[r0 + r] = acc[r];
            if (p.dbg_logits) p.dbg_logits[(long long)n * V + r0 + r] = acc[r];
            if (acc[r] > best) { best = acc[r]; besti = r0 + r; }
          }
      }
    }
  }
  if (lane == 0) { bv[warp] = best; bi[warp] = besti; }
  __syncthreads();
  tmark(p, n, 5 * NL, 2);
  if (tid == 0) {
    for (int w = 0; w < NW; ++w)
      if (bv[w] > best || (bv[w] == best && bi[w] < besti)) { best = bv[w]; besti = bi[w]; }
    p.cand_v[blockIdx.x] = best;
    p.cand_i[blockIdx.x] = besti;
    __threadfence();
    const u64 tk = atomicAdd(CTR(p, C_TICKET), 1ull);
    last = (tk == (u64)(n + 1) * NB - 1);
    if (last) __threadfence();
  }
  __syncthreads();
  if (!last) return;
  // ---- the last block to finish the LM head samples the token ----
  const bool greedy = p.temperature <= 0.0 || p.top_k == 1;
  const u64 counter = (u64)(p.start_pos + n + 1);
  int next;
  if (greedy) {
    if (tid == 0) {
      float bb = NEG_INF;
      int bidx = 0x7fffffff;
      for (int b = 0; b < NB; ++b) {
        const float v = ldf(p.cand_v + b);
        const int ix = __ldcg(p.cand_i + b);
        if (v > bb || (v == bb && ix < bidx)) { bb = v; bidx = ix; }
      }
      if (bidx == 0x7fffffff) bidx = 0;   // all NaN: a broken model; still return something
      last = bidx;
    }
    __syncthreads();
    next = last;
  } else {
    next = sample_full(p, sm, counter);
  }
#if KOG_NRANKS > 1
  if (mr_bail()) return;                 // an exchange of this token failed: write no token
#endif
  if (tid == 0) {
    volatile int* ring = p.ring;
    volatile int* st = p.status;
    ring[n] = next;
    __threadfence_system();
    st[0] = n + 1;
    int reason = 0;
    for (int k = 0; k < p.n_eos; ++k) if (p.eos_ids[k] == next) reason = 1;
    if (!reason) for (int k = 0; k < p.n_stop; ++k) if (p.stop_ids[k] == next) reason = 2;
    if (!reason && n + 1 >= p.max_new) reason = 3;
#if KOG_NRANKS > 1
    if (!reason && mr_cancel_s) reason = 4;    // any rank's host raised cancel (the same on every rank)
#else
    if (!reason && *(volatile const int*)p.cancel) reason = 4;
#endif
    if (reason) {
      st[1] = reason;
      __threadfence_system();
      st[2] = 1;
    }
    *CTR(p, C_TOKVAL) = (u64)next;
    *CTR(p, C_STOP) = (u64)reason;
    st_release(CTR(p, C_TOKEN), (u64)(n + 1));
  }
  __syncthreads();
}

extern "C" __global__ void __launch_bounds__(NT, 512 / NT) monokernel(const Params* __restrict__ pp) {
  extern __shared__ float4 smem4[];
  float* sm = reinterpret_cast<float*>(smem4);
  __shared__ int tok_s, stop_s;
  __shared__ Params ps;
  for (int x = threadIdx.x; x < (int)(sizeof(Params) / 8); x += blockDim.x)
    reinterpret_cast<u64*>(&ps)[x] = reinterpret_cast<const u64*>(pp)[x];
  __syncthreads();
  const Params& p = ps;
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
      prefetch_l2(p.w + (long long)(ua + nb) * UE_QKV, (long long)(ub - ua - nb) * UE_QKV * sizeof(wt), PF);
      tmark(p, n, 5 * NL + 1, 0);
      if (threadIdx.x == 0) {
        SPIN(p, CTR(p, C_TOKEN), (u64)n);
        tok_s = (int)__ldcg(CTR(p, C_TOKVAL));
        stop_s = (int)__ldcg(CTR(p, C_STOP));
#if KOG_NRANKS > 1
        if (mr_dead()) stop_s = 5;         // a kccl wait failed: the host reads comm.status
#endif
      }
      __syncthreads();
      if (stop_s) return;
      tok = tok_s;
      tmark(p, n, 5 * NL + 1, 1);
    }
    for (int i = 0; i < NL; ++i) {
      phase_qkv(p, sm, n, i, t, tok, n > 0 && i == 0);
      phase_att(p, sm, n, i, t, tok);
      phase_wo(p, sm, n, i, tok);
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
#endif
}
