// kccl_test.cu: a small persistent kernel that drives kccl.cuh the way the monokernel does, for the
// tests and `python -m kccl.bench --transport cuda_ipc` (kccl/cuda_ipc.py runs it).
//
// Steps s = 0 .. rounds-1+delta: every block of the grid posts its chunk of this rank's fp16 vector
// in[s % in_rounds] as epoch first+s (after an optional pseudo-random delay), then (s >= delta)
// waits for epoch first+s-delta from every rank, sums its chunk in rank order into
// out[(s-delta) % out_rounds] (fp32) and frees the slots. delta = 0 is an all-reduce per round; delta = 2
// is DTP (collect two layers after the post). Block 0 records per step: globaltimer before the post,
// after the post, after the collect (ns), and the same three as clock64.
// kccl_test_ll_rounds (below, same arguments, delta 0): the all-reduce rounds through LL words.
#include "kccl.cuh"

__device__ __forceinline__ kccl_u64 kccl_test_mix(kccl_u64 x) {  // splitmix64
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// thread 0: the optional pseudo-random delay of block b in step s (max_delay_ns 0: none)
__device__ __forceinline__ void kccl_test_delay(const KcclDev& d, long long max_delay_ns, kccl_u64 seed, int s,
                                                int b) {
  if (max_delay_ns > 0 && threadIdx.x == 0) {
    const kccl_u64 wait = kccl_test_mix(seed ^ ((kccl_u64)d.rank << 48) ^ ((kccl_u64)s << 8) ^ b) %
                          (kccl_u64)max_delay_ns;
    const kccl_u64 t = kccl_gtimer();
    while (kccl_gtimer() - t < wait) {
    }
  }
}

extern "C" __global__ void kccl_test_rounds(const KcclDev* __restrict__ dp, int c, unsigned long long first,
                                            int rounds, int delta, const unsigned short* in, int in_rounds,
                                            float* out, int out_rounds, int n, unsigned long long* times,
                                            long long max_delay_ns, unsigned long long seed) {
  const KcclDev& d = *dp;
  const int nb = gridDim.x, b = blockIdx.x;
  // this block's element range, in whole 16-byte units (8 halves)
  const int units = (n + 7) / 8, per = (units + nb - 1) / nb;
  int lo = per * b * 8, hi = per * (b + 1) * 8;
  if (lo > n) lo = n;
  if (hi > n) hi = n;
  for (int s = 0; s < rounds + delta; ++s) {
    kccl_u64 g0 = 0, c0 = 0, g1 = 0, c1 = 0;
    if (s < rounds) {
      kccl_test_delay(d, max_delay_ns, seed, s, b);
      __syncthreads();
      g0 = kccl_gtimer();
      c0 = clock64();
      const kccl_u64 e = first + s;
      if (!kccl_post_begin(d, c, e)) return;
      if (hi > lo) kccl_post_chunk(d, c, e, in + (long long)(s % in_rounds) * n, 2LL * lo, 2LL * (hi - lo));
      kccl_post_end(d, c, e, nb, 2LL * n, 4);
      __syncthreads();
      g1 = kccl_gtimer();
      c1 = clock64();
    }
    if (s >= delta) {
      const int r = s - delta;
      const kccl_u64 e = first + r;
      if (s >= rounds) {
        g1 = kccl_gtimer();
        c1 = clock64();
      }
      if (!kccl_wait(d, c, e)) return;
      if (hi > lo)
        kccl_collect_sum_f16(d, c, e, nullptr, out + (long long)(r % out_rounds) * n, lo, hi - lo);
      kccl_collect_end(d, c, e, nb);
      __syncthreads();
    }
    if (b == 0 && threadIdx.x == 0 && times) {
      const kccl_u64 g2 = kccl_gtimer(), c2 = clock64();
      if (s < rounds) {
        times[6LL * s + 0] = g0;
        times[6LL * s + 1] = g1;
        times[6LL * s + 3] = c0;
        times[6LL * s + 4] = c1;
      }
      if (s >= delta) {  // collect of round s - delta: its own step's post end .. now
        const int r = s - delta;
        times[6LL * r + 2] = g2 - g1;
        times[6LL * r + 5] = c2 - c1;
      }
    }
  }
}

// ---- LL all-reduce (kccl_test_ll_rounds) -----------------------------------------------------------
// Round s (epoch e = first + s, tag (unsigned)e) is one all-reduce of in[s % in_rounds]: its n halves
// travel as n / 2 LL words (kccl.cuh "LL words": two fp16 in the low 32 bits, the tag in the high 32).
// Block b owns words [lo, hi) (the same on every rank: every rank runs the same n and block count). It
// stores them with kccl_ll_st into this rank's slot of (c, e) in every other rank's window, then sums
// them over ranks 0..N-1 in fp32 (own words from the input, the others' polled with kccl_ll_get in this
// rank's window) into out[s % out_rounds]. No fence, counter, flag or ack.
//
// Ring safety without acks (depth >= 2): block b of rank A stores its words of epoch e + 1 into B's
// window, ring slot (e + 1) % depth, which held A's epoch e + 1 - depth <= e - 1. It does so only after
// it read its words of epoch e from every rank, B's included; B's block b stored those only after it
// had read its words of epoch e - 1 from every rank, A's included (the round ends with
// __syncthreads_or: no thread of a block stores round e + 1 before every thread of it read round e).
// Block b owns the same words on every rank, so B had read every word A overwrites. Across launches: a
// kernel ends on a rank once it read epoch L from every rank, so every block of every rank posted L and
// had read L - 1, whatever the block counts; the next launch starts at L + 1. A word of an older epoch
// carries another tag and a zeroed one tag 0, so the reader never takes stale data for epoch e (as
// long as the channel carries only LL words: the host keeps the flag protocol off LL tags).
#define KCCL_TEST_LL_BATCH 4  // words per thread whose loads are in flight together

// one thread: cnt (<= KCCL_TEST_LL_BATCH) words p[0], p[step], ... of rank src once they carry `tag`
// (0 after a failure). All loads go out before the first check, so a round costs one trip to L2 for
// the batch, not one per word; kccl_ll_get polls the words that were not there yet.
__device__ __forceinline__ void kccl_test_ll_fetch(const KcclDev& d, const kccl_u64* p, int step, int cnt,
                                                   unsigned tag, int src, int c, unsigned* v) {
  kccl_u64 w[KCCL_TEST_LL_BATCH];
#pragma unroll
  for (int k = 0; k < KCCL_TEST_LL_BATCH; ++k) w[k] = k < cnt ? kccl_ll_ld(p + (long long)k * step) : 0ull;
#pragma unroll
  for (int k = 0; k < KCCL_TEST_LL_BATCH; ++k) {
    if (k >= cnt) v[k] = 0u;
    else if ((unsigned)(w[k] >> 32) == tag) v[k] = (unsigned)w[k];
    else v[k] = kccl_ll_get(d, p + (long long)k * step, tag, src, c);
  }
}

// block-wide: words [lo, hi) of x (this rank's input) as epoch e into every other rank's window, peers
// in the order me + 1, me + 2, ... (the ranks do not all start on the same peer)
__device__ __forceinline__ void kccl_test_ll_post(const KcclDev& d, int c, kccl_u64 e, const unsigned* x, int lo,
                                                  int hi) {
  const int me = (int)d.rank, n = (int)d.nranks;
  const long long off = (const char*)kccl_ll_words(d, me, c, me, e) - d.base[me];  // same in every window
  for (int k = 1; k < n; ++k) {
    kccl_u64* w = (kccl_u64*)(d.base[(me + k) % n] + off);
    for (int i = lo + (int)threadIdx.x; i < hi; i += (int)blockDim.x) kccl_ll_st(w + i, (unsigned)e, x[i]);
  }
}

// block-wide: out[2i], out[2i + 1] = rank-order fp32 sums of the two halves of word i of epoch e, i in
// [lo, hi). True when a wait failed (kccl_ll_get gave 0 and the rank's error word is set).
__device__ __forceinline__ bool kccl_test_ll_sum(const KcclDev& d, int c, kccl_u64 e, const unsigned* x, float* out,
                                                 int lo, int hi) {
  const int me = (int)d.rank, n = (int)d.nranks, step = (int)blockDim.x;
  const char* w0 = (const char*)kccl_ll_words(d, me, c, 0, e);  // rank 0's words of e in this window
  const long long stride = d.depth[c] * d.slot_bytes;            // from one source's ring to the next
  bool zero = false;
  for (int i = lo + (int)threadIdx.x; i < hi; i += KCCL_TEST_LL_BATCH * step) {
    const int left = (hi - i + step - 1) / step, cnt = left < KCCL_TEST_LL_BATCH ? left : KCCL_TEST_LL_BATCH;
    float a[2 * KCCL_TEST_LL_BATCH];
    for (int src = 0; src < n; ++src) {
      unsigned v[KCCL_TEST_LL_BATCH];
      if (src == me) {
#pragma unroll
        for (int k = 0; k < KCCL_TEST_LL_BATCH; ++k) v[k] = k < cnt ? x[i + k * step] : 0u;
      } else {
        kccl_test_ll_fetch(d, (const kccl_u64*)(w0 + src * stride) + i, step, cnt, (unsigned)e, src, c, v);
#pragma unroll
        for (int k = 0; k < KCCL_TEST_LL_BATCH; ++k) zero |= k < cnt && v[k] == 0u;
      }
#pragma unroll
      for (int k = 0; k < KCCL_TEST_LL_BATCH; ++k) {
        const float f0 = kccl_h2f((unsigned short)v[k]), f1 = kccl_h2f((unsigned short)(v[k] >> 16));
        a[2 * k] = src == 0 ? f0 : a[2 * k] + f0;
        a[2 * k + 1] = src == 0 ? f1 : a[2 * k + 1] + f1;
      }
    }
#pragma unroll
    for (int k = 0; k < KCCL_TEST_LL_BATCH; ++k)
      if (k < cnt) *(float2*)(out + 2LL * (i + k * step)) = make_float2(a[2 * k], a[2 * k + 1]);
  }
  return zero && kccl_failed(d);  // a word may be 0 for real: only then is the error word read
}

// block 0, thread 0: one round's six times as kccl_test_rounds records them (delta 0)
__device__ __forceinline__ void kccl_test_times(kccl_u64* t, kccl_u64 g0, kccl_u64 g1, kccl_u64 c0, kccl_u64 c1) {
  const kccl_u64 g2 = kccl_gtimer(), c2 = clock64();
  t[0] = g0;
  t[1] = g1;
  t[2] = g2 - g1;
  t[3] = c0;
  t[4] = c1;
  t[5] = c2 - c1;
}

// Same arguments as kccl_test_rounds; delta must be 0 and n even (the host refuses anything else: the
// kernel then does nothing).
extern "C" __global__ void kccl_test_ll_rounds(const KcclDev* __restrict__ dp, int c, unsigned long long first,
                                               int rounds, int delta, const unsigned short* in, int in_rounds,
                                               float* out, int out_rounds, int n, unsigned long long* times,
                                               long long max_delay_ns, unsigned long long seed) {
  const KcclDev& d = *dp;
  if (delta != 0 || (n & 1)) return;
  const int nb = gridDim.x, b = blockIdx.x, words = n / 2, per = (words + nb - 1) / nb;
  const int lo = per * b < words ? per * b : words, hi = lo + per < words ? lo + per : words;
  for (int s = 0; s < rounds; ++s) {
    kccl_test_delay(d, max_delay_ns, seed, s, b);
    __syncthreads();
    const kccl_u64 g0 = kccl_gtimer(), c0 = clock64();
    const kccl_u64 e = first + s;
    const unsigned* x = (const unsigned*)(in + (long long)(s % in_rounds) * n);
    kccl_test_ll_post(d, c, e, x, lo, hi);
    __syncthreads();
    const kccl_u64 g1 = kccl_gtimer(), c1 = clock64();
    if (__syncthreads_or(kccl_test_ll_sum(d, c, e, x, out + (long long)(s % out_rounds) * n, lo, hi))) return;
    if (b == 0 && threadIdx.x == 0 && times) kccl_test_times(times + 6LL * s, g0, g1, c0, c1);
  }
}
