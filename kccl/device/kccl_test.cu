// kccl_test.cu: a small persistent kernel that drives kccl.cuh the way the monokernel does, for the
// tests and `python -m kccl.bench --transport cuda_ipc` (kccl/cuda_ipc.py runs it).
//
// Steps s = 0 .. rounds-1+delta: every block of the grid posts its chunk of this rank's fp16 vector
// in[s % in_rounds] as epoch first+s (after an optional pseudo-random delay), then (s >= delta)
// waits for epoch first+s-delta from every rank, sums its chunk in rank order into
// out[(s-delta) % out_rounds] (fp32) and frees the slots. delta = 0 is an all-reduce per round; delta = 2
// is DTP (collect two layers after the post). Block 0 records per step: globaltimer before the post,
// after the post, after the collect (ns), and the same three as clock64.
#include "kccl.cuh"

__device__ __forceinline__ kccl_u64 kccl_test_mix(kccl_u64 x) {  // splitmix64
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
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
      if (max_delay_ns > 0 && threadIdx.x == 0) {
        const kccl_u64 wait = kccl_test_mix(seed ^ ((kccl_u64)d.rank << 48) ^ ((kccl_u64)s << 8) ^ b) %
                              (kccl_u64)max_delay_ns;
        const kccl_u64 t = kccl_gtimer();
        while (kccl_gtimer() - t < wait) {
        }
      }
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
