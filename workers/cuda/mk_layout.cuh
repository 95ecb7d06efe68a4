// mk_layout.cuh: part of monokernel.cu (pasted where monokernel.cu includes it; not a standalone header:
// it relies on common.cuh and `using namespace cfg` before it). The rank count (KOG_NRANKS, LG, SPIN),
// the units and the weight layout, the counters, the shared-memory plan, wbuf_fill, the Params struct
// the host fills (backend.py writes its words by index) and the timer marks.
#pragma once

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
constexpr int NCH = (NB / KV) > 0 ? (NB / KV) : 1;         // attention chunks per kv head (at most)
// attention (mk_att.cuh): a warp takes PPW positions a pass, KL lanes a key row (KC 16-byte chunks each)
constexpr int VCH = HD / VEC;                                  // 16-byte chunks of a key / value row
constexpr int KL = VCH % 4 == 0 ? 4 : (VCH % 2 == 0 ? 2 : 1);  // lanes of a key row
constexpr int KC = VCH / KL, PPW = 32 / KL;                     // its chunks a lane; positions a warp and pass
#ifndef CFG_ATT_MINPOS
#define CFG_ATT_MINPOS 0   // positions a chunk has at least (0: one lane NW * PPW / 2, else 1)
#endif
// With one lane, chunks in use at a position: about what half the block's warps take in one pass, so
// that WO, whose every block merges all chunks of all heads, merges few (every chunk of a few positions each
// made the merge a large part of a layer). With several lanes every chunk (the 2B shape's 8 a kv head)
// is in use, as before: fewer there measured neutral (docs/monokernel.md, "One lane").
constexpr int ATT_MINPOS = CFG_ATT_MINPOS > 0 ? CFG_ATT_MINPOS : (L == 1 ? NW * PPW / 2 : 1);
constexpr int UPL_QKV = RQKV / 2, U_QKV = L * UPL_QKV;
constexpr int UPL_ATT = KVL * NCH, U_ATT = KV * NCH;
constexpr int NR_WO = (D % CFG_NR_WO == 0) ? CFG_NR_WO : 4, UPL_WO = D / NR_WO, U_WO = L * UPL_WO;
constexpr int UPL_W13 = FL, U_W13 = L * FL;
constexpr int NR_W2 = (D % CFG_NR_W2 == 0) ? CFG_NR_W2 : 2, UPL_W2 = D / NR_W2, U_W2 = L * UPL_W2;
#if KOG_NRANKS > 1
// the LM head's units split between the ranks: rank r computes units [r * U_LM, (r + 1) * U_LM) of U_LMG
constexpr int U_LMG = (V + 1) / 2, U_LM = (U_LMG + KOG_NRANKS - 1) / KOG_NRANKS;
#else
constexpr int U_LM = (V + 1) / 2;
#endif
constexpr long long QKV_SZ = (long long)L * RQKV * D, WO_SZ = (long long)L * D * HDL;
constexpr long long W13_SZ = (long long)L * FL * 2 * D, W2_SZ = (long long)L * D * FL;
constexpr long long OFF_QKV = 0, OFF_WO = QKV_SZ, OFF_W13 = OFF_WO + WO_SZ, OFF_W2 = OFF_W13 + W13_SZ;
constexpr long long LAYER_SZ = OFF_W2 + W2_SZ;
constexpr int pow2_at_least(int v) { int p = 1; while (p < v) p <<= 1; return p; }
constexpr int VPOW2 = pow2_at_least(V);
constexpr int ATTP = HD + 4;   // (acc[HD], m, l, 2 unused) per (unit, head): 16-byte rows for WO's float4 merge
// counters (u64): per phase and lane, then ticket, token, token word, stop, cancel. The token word is
// {n + 1, stop reason, token} (32, 8, 24 bits): the blocks poll it and have the token in the same load.
static_assert(V < (1 << 24), "the token word holds a token in 24 bits");
enum { C_QKV = 0, C_ATT = 1, C_WO = 2, C_W13 = 3, C_W2 = 4 };
constexpr int C_TICKET = 5 * L, C_TOKEN = 5 * L + 1, C_TOKVAL = 5 * L + 2, C_STOP = 5 * L + 3, C_CANCEL = 5 * L + 4;
// u64 words between counters: each on its own 128-byte line, so a lane's polls do not share a line with
// another lane's releases (unpadded measured within the spread: docs/monokernel.md, "Versions")
constexpr int CTR_STRIDE = 16;
constexpr int NCTR = (5 * L + 5) * CTR_STRIDE;
static_assert(C_CANCEL + 1 == NCTR / CTR_STRIDE, "the cancel word is the last counter (host.py counter_lines: the hang report)");
// attention's merge by the last chunk block of each kv head (mk_att.cuh att_merge_step; one lane, one rank):
// a ticket a kv head (the low half of its word), then a done word a (layer, kv head) holding n + 1 once token
// n's merge is in p.q; CTR_STRIDE words apart after the counters, zero at launch too
#ifndef CFG_ATT_MERGE
#define CFG_ATT_MERGE 1
#endif
constexpr bool ATT_MERGE = L == 1 && KOG_NRANKS == 1 && CFG_ATT_MERGE;
#define ATT_TICKET(p, g) reinterpret_cast<u32*>((p).ctr + NCTR + (long long)(g) * CTR_STRIDE)
#define ATT_DONE(p, i, g) ((p).ctr + NCTR + (long long)(KV + (i) * KV + (g)) * CTR_STRIDE)
constexpr int NCTR_ALL = NCTR + (ATT_MERGE ? (KV + NL * KV) * CTR_STRIDE : 0);   // the words backend.py allocates
#define CTR(p, k) ((p).ctr + (long long)(k) * CTR_STRIDE)

// shared memory (floats)
constexpr int cmax(int a, int b) { return a > b ? a : b; }
constexpr int cmin(int a, int b) { return a < b ? a : b; }
// most lanes a block touches in a phase of U lane-major units (upl per lane): the staging area holds
// only those (a smaller shared-memory carve-out leaves more L1: docs/monokernel.md, second session)
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
// stage_norms2 (a block's QKV and W13 units span at most 2 lanes): the norm weights of its lanes in
// shared memory, copied before the block waits for the residual (docs/monokernel.md, third session);
// otherwise (one lane, or blocks spanning more lanes) stage_norms
constexpr bool NORM2 = lanes_spanned(U_QKV, UPL_QKV) <= 2 && lanes_spanned(U_W13, UPL_W13) <= 2 &&
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

#ifndef CFG_MASK
#define CFG_MASK 0   // 1: structured outputs, the sampler applies the host's token mask (mk_mask.cuh; one rank)
#endif
struct Params {   // every field 8 bytes; the one list: params.py reads it and the host packs by name
  const wt* w;                   // 0  layer weights [NL][QKV|WO|W13|W2]
  const float* norms;            // 1  [NL][2][L][D] (attention_norm, ffn_norm)
  const float* fnorm;            // 2  [L][D]
  const wt* emb;                 // 3  [V][D]
  const wt* lm;                  // 4  [V][D]
  wt* kc;                        // 5  [NL][KV][max_seq][HD]
  wt* vc;                        // 6
  float* q;                      // 7  [H][HD]
  float* attp;                   // 8  [KV][NCH][G][HD+4]
  float* hid;                    // 9  [L][FL]
  float* part;                   // 10 [NL][2][L][D]
  float* hres;                   // 11 [2NL+1][L][D]
  float* logits;                 // 12 [V]
  float* cand_v;                 // 13 [NB]
  int* cand_i;                   // 14 [NB]
  u64* ctr;                      // 15 [NCTR_ALL], zero at launch
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
  const void* ws;                // 58 scales of quantized layer matrices (CFG_QW; common.cuh), or null
  const float* bias;             // 59 q/k/v biases [NL][L][RQKV] (CFG_BIAS), or null
  int* spec;                     // 60 speculative passes (CFG_SPEC, mk_spec_lm.cuh SW_*): next ids, counts, or null
  int* ctx;                      // 61 [max_seq + 16] the context's ids (CFG_SPEC): the cache's, then each token given
  float* spec_logits;            // 62 [CFG_SPEC][V] each position's logits (CFG_SPEC: sampling, dbg_logits)
  long long spec_k;              // 63 draft tokens a pass at most (CFG_SPEC)
  long long spec_min_ngram;      // 64 the shortest context match that drafts (CFG_SPEC)
  long long spec_fixed;          // 65 > 0: every pass drafts this many tokens, the context's last; < 0: none (benchmarks)
  const void* wh;                // 66 the K-quants' high bits (CFG_QW 4; kquant.cuh), or null
  const u32* kt;                 // 67 the K-quants' types, a word a layer (CFG_QW 4), or null
#if KOG_NRANKS > 1
  const KcclDev* kd;             // 68 CudaCommunicator.dev_ptr
  long long e0[3];               // 69..71 first epoch of this launch on channels attn, mlp, final
  float* yfin;                   // 72 [L*D + 4] this rank's final-norm rows + its cancel word (posted)
#endif
#if CFG_MASK
  const u32* mask;               // 68 host-mapped [MASK_WORDS] the token's allowed ids: bit v & 31 of word v >> 5
  int* mask_ready;               // 69 host-mapped [2]: masks the host has written (token n's at n + 1); 1 after a timeout
  u64* mask_stat;                // 70 [4] the sampler's waits for the mask: count, ns, longest ns, timeouts
  long long mask_wait_ns;        // 71 a wait longer than this ends the generation (as a cancel)
#endif
};
// CFG_PCONST 1: the kernel takes Params by value (__grid_constant__: the words are constant-bank operands
// of the instructions that use them, no load on the chain; docs/monokernel.md) instead of a pointer whose words
// each block copies into shared memory and reads from there (0). The out-of-line functions read a shared
// copy (ps_s): a pointer to a parameter is a generic one, read through L1.
#ifndef CFG_PCONST
#define CFG_PCONST 1
#endif
#if CFG_PCONST
__shared__ Params ps_s;
#define NOINL_PARAMS(x) ps_s
#else
#define NOINL_PARAMS(x) x
#endif

__device__ __forceinline__ u64 gtimer() {
  u64 t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}
// phase slot ph (5*i + kind, 5NL: LM, 5NL+1: token wait), mark k (0 entry, 1 inputs ready, 2 done,
// 3 inputs staged, the row loop starts, 4 rows done, before the signal; 3 and 4 in QKV, WO, W13, W2)
// CFG_MARKS 1 compiles the marks in (build.py marks=True, `kog bench --profile`); without them the kernel
// has no branch on p.timing at every mark, less machine code and runs faster (docs/monokernel.md)
#ifndef CFG_MARKS
#define CFG_MARKS 0
#endif
constexpr int TMARKS = 5;
static_assert(TMARKS == 5, "backend.py allocates the marks as [5 NL + 2][NB][5]");
__device__ __forceinline__ void tmark(const Params& p, int n, int ph, int k) {
#if CFG_MARKS
  if (p.timing && n == p.timing_token && threadIdx.x == 0)
    p.timing[((long long)ph * NB + blockIdx.x) * TMARKS + k] = gtimer();
#endif
}
