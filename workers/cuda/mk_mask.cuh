// mk_mask.cuh: part of monokernel.cu (CFG_MASK 1 only, pasted before mk_lm.cuh; not a standalone header).
// Structured outputs (issue 55): the sampler of token n waits until the host has written token n's mask
// (p.mask_ready reaches n + 1; host-mapped words, workers/cuda/mask.py), copies its words into shared memory
// and treats every id whose bit is 0 as -inf. The host computes token n + 1's mask from token n while this
// kernel runs token n + 1's forward, so the wait is usually over at its first read. With several ranks every
// rank's host runs the request's grammar on the same tokens and writes the same mask; each rank's sampler
// applies it to its own rows of the LM head before the ranks' exchange (mask_rows), and a rank whose mask did
// not come says so through the exchange, so that every rank ends the generation at the same token.
#pragma once
static_assert(KOG_NRANKS == 1 || SAMPLE_M > 0, "the token mask on several ranks posts its wait's failure with "
              "the candidates (CFG_SAMPLE_M > 0)");
constexpr int MASK_WORDS = ((V + 31) / 32 + 3) / 4 * 4;   // mask.py mask_words: whole 16-byte loads
static_assert(MASK_WORDS <= SM_FLOATS, "the vocabulary's token mask does not fit the block's shared memory");
enum { MS_WAITS = 0, MS_NS = 1, MS_MAX_NS = 2, MS_TIMEOUTS = 3 };   // p.mask_stat (mask.py STAT_*)

__device__ __forceinline__ int ld_acquire_sys(const int* p) {
  int v;
  asm volatile("ld.acquire.sys.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ uint4 ld_relaxed_sys16(const void* p) {
  uint4 v;
  asm volatile("ld.relaxed.sys.global.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p) : "memory");
  return v;
}

// the last block of token n, every thread: token n's mask into msk (shared memory); false when the wait ended
// without it: the host raised cancel (it decided to stop, or failed) or p.mask_wait_ns passed (counted)
__device__ __noinline__ bool mask_fetch(const Params& p_, u32* msk, int n) {
  const Params& p = NOINL_PARAMS(p_);
  __shared__ int ok_s;
  if (threadIdx.x == 0) {
    int ok = 1;
    // acquire: the words the host wrote before its flag are read after it
    if (ld_acquire_sys(p.mask_ready) < n + 1) {
      const u64 t0 = gtimer();
      while (ld_acquire_sys(p.mask_ready) < n + 1) {
        if (*(volatile const int*)p.cancel) { ok = 0; break; }
        if ((long long)(gtimer() - t0) > p.mask_wait_ns) {
          ok = 0;
          atomicAdd(p.mask_stat + MS_TIMEOUTS, 1ull);
          reinterpret_cast<volatile int*>(p.mask_ready)[1] = 1;   // what the host reads at the -1 in the ring
          break;
        }
      }
      const u64 dt = gtimer() - t0;
      atomicAdd(p.mask_stat + MS_WAITS, 1ull);
      atomicAdd(p.mask_stat + MS_NS, dt);
      atomicMax(p.mask_stat + MS_MAX_NS, dt);
    }
    ok_s = ok;
  }
  __syncthreads();
  const bool ok = ok_s != 0;
  if (ok)   // one 16-byte system-scope load a thread (V = 49152: 384 of them), one round trip over PCIe
    for (int w = threadIdx.x; w < MASK_WORDS / 4; w += NT)
      reinterpret_cast<uint4*>(msk)[w] = ld_relaxed_sys16(p.mask + 4 * w);
  __syncthreads();
  return ok;
}


// every thread's share of the masked argmax over rows [v0, v1): (bb, bidx) updated with the allowed logits it
// reads, 16 bytes at a time where the rows allow and 8 loads in flight (a load only where a bit is set waited for
// each in turn: V / NT round trips to L2); a thread's ids ascend, so the first of equal maxima stays
__device__ __forceinline__ void mask_argmax_rows(const Params& p, const u32* msk, int v0, int v1, float& bb,
                                                 int& bidx) {
  const int tid = threadIdx.x;
  auto allows = [&](int v) { return (msk[v >> 5] >> (v & 31)) & 1u; };
  const int q0 = (v0 + 3) / 4, q1 = v1 / 4;   // whole float4s of the rows
  for (int v = v0 + tid; v < min(4 * q0, v1); v += NT)
    if (allows(v)) {
      const float x = ldf(p.logits + v);
      if (x > bb) { bb = x; bidx = v; }
    }
  const float4* lg4 = reinterpret_cast<const float4*>(p.logits);
#pragma unroll 8
  for (int q = q0 + tid; q < q1; q += NT) {
    const float4 x = __ldcg(lg4 + q);
    const u32 b = msk[q >> 3] >> ((q & 7) * 4);   // ids 4q .. 4q + 3: bits 4q & 31 .. of word 4q >> 5
    if ((b & 1u) && x.x > bb) { bb = x.x; bidx = 4 * q; }
    if ((b & 2u) && x.y > bb) { bb = x.y; bidx = 4 * q + 1; }
    if ((b & 4u) && x.z > bb) { bb = x.z; bidx = 4 * q + 2; }
    if ((b & 8u) && x.w > bb) { bb = x.w; bidx = 4 * q + 3; }
  }
  for (int v = max(4 * q1, 4 * q0) + tid; v < v1; v += NT)
    if (allows(v)) {
      const float x = ldf(p.logits + v);
      if (x > bb) { bb = x; bidx = v; }
    }
}

// token n's mask on rows [v0, v1) of the logits (every thread of the last block; sm: the spent inputs): sampling,
// the forbidden logits set to -inf (sample_full reads them after the barrier); greedy, each thread's share of the
// masked argmax in (bb, bidx) (the blocks' candidates know no mask). False when no mask came (mask_fetch).
__device__ __forceinline__ bool mask_rows(const Params& p, float* sm, int n, bool greedy, int v0, int v1,
                                          float& bb, int& bidx) {
  u32* msk = reinterpret_cast<u32*>(sm);
  if (!mask_fetch(p, msk, n)) return false;
  if (greedy) {
    mask_argmax_rows(p, msk, v0, v1, bb, bidx);
  } else {
    for (int v = v0 + threadIdx.x; v < v1; v += NT)
      if (!((msk[v >> 5] >> (v & 31)) & 1u)) p.logits[v] = NEG_INF;
  }
  __syncthreads();   // sm is the sampler's next
  return true;
}

#if KOG_NRANKS == 1
// the sampler with token n's mask, one rank: greedy, the masked argmax over all the logits; sampling, sample_full
// after the forbidden logits are -inf. The token in every thread, or -1 when no mask came (mask_fetch).
__device__ __forceinline__ int mask_sample(const Params& p, float* sm, int n, bool greedy, u64 counter) {
  float bb = NEG_INF;
  int bidx = 0x7fffffff;
  if (!mask_rows(p, sm, n, greedy, 0, V, bb, bidx)) return -1;
  if (!greedy) return sample_full(p, sm, counter);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  __shared__ float bv[NW];
  __shared__ int bi[NW];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, bb, o);
    const int oi = __shfl_xor_sync(0xffffffffu, bidx, o);
    if (ov > bb || (ov == bb && oi < bidx)) { bb = ov; bidx = oi; }
  }
  if (lane == 0) { bv[warp] = bb; bi[warp] = bidx; }
  __syncthreads();
  if (tid == 0) {
    for (int w = 0; w < NW; ++w)
      if (bv[w] > bb || (bv[w] == bb && bi[w] < bidx)) { bb = bv[w]; bidx = bi[w]; }
    bi[0] = bidx == 0x7fffffff ? 0 : bidx;   // every allowed logit NaN: a broken model; still a token
  }
  __syncthreads();
  const int tok = bi[0];
  __syncthreads();
  return tok;
}
#endif
