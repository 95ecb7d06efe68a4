// handoff.cu: what one grid-wide hand-off costs, the step a one-lane model's monokernel takes five times a
// layer (every block of a phase signals, every block of the next waits for all of them: docs/monokernel.md).
// One launch runs `iters` hand-offs back to back with no work between them; block 0 times the last
// iters - warmup of them with %globaltimer. The ways to signal and wait (`mode`):
//   0  one counter, every block red.release.gpu.add 1 after its barrier, lane 0 of the first warp polls it
//      with ld.acquire.gpu (the monokernel's signal_lanes / wait_lanes with one lane)
//   1  ns counters on their own 128-byte lines, block b adds to counter b % ns, lanes 0 .. ns - 1 of the
//      first warp poll one each (fewer atomics on one address, the same single round trip to wait)
//   2  a flag word a block (st.release.gpu of the hand-off's number), words packed 16 to a line; lane k of the
//      first warp polls words k, k + 32, ... with relaxed loads, all in flight, then one fence.acq_rel.gpu
//   3  as 2 with every word on its own 128-byte line
//   4  as 0, polled with relaxed loads and one fence.acq_rel.gpu after (no acquire on every poll)
// `wfloats` > 0: each block first stores that many floats of its own (a phase's outputs), which the release
// must order before the signal, as the monokernel's rows are.
#include "common.cuh"   // ld_acquire, red_release, st_release (handoff.py inlines it)
#define HO_WPL 5          // flag words a lane polls: up to 160 blocks (handoff.py checks)

__device__ __forceinline__ u64 ho_ld_relaxed(const u64* p) {
  u64 v;
  asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void ho_fence() { asm volatile("fence.acq_rel.gpu;" ::: "memory"); }
__device__ __forceinline__ u64 ho_now() {
  u64 t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

extern "C" __global__ void handoff(u64* words, float* outs, int iters, int warmup, int mode, int ns, int wfloats,
                                   u64* elapsed_ns) {
  const int nb = gridDim.x, b = blockIdx.x, lane = threadIdx.x & 31;
  u64 t0 = 0;
  for (int it = 0; it < iters; ++it) {
    if (it == warmup) t0 = ho_now();
    for (int x = threadIdx.x; x < wfloats; x += blockDim.x) outs[(long long)b * wfloats + x] = (float)it;
    __syncthreads();   // the block's part of the phase is done
    const u64 want = (u64)it + 1;
    if (threadIdx.x == 0) {
      if (mode == 0 || mode == 4) red_release(words, 1);
      else if (mode == 1) red_release(words + (b % ns) * 16, 1);
      else st_release(words + (long long)b * (mode == 2 ? 1 : 16), want);
    }
    if (threadIdx.x < 32) {
      if (mode == 0) {
        if (lane == 0) while (ld_acquire(words) < want * nb) {}
      } else if (mode == 4) {
        if (lane == 0) {
          while (ho_ld_relaxed(words) < want * nb) {}
          ho_fence();
        }
      } else if (mode == 1) {
        if (lane < ns) {
          const u64 per = (u64)((nb - lane + ns - 1) / ns);   // blocks b with b % ns == lane
          while (ld_acquire(words + lane * 16) < want * per) {}
        }
      } else {
        const int stride = mode == 2 ? 1 : 16;
        bool ok;
        do {   // a lane's words loaded first, then compared: all in flight at once (issue is in order)
          u64 v[HO_WPL];
#pragma unroll
          for (int j = 0; j < HO_WPL; ++j) {
            const int k = lane + 32 * j;
            v[j] = k < nb ? ho_ld_relaxed(words + (long long)k * stride) : ~0ull;
          }
          ok = true;
#pragma unroll
          for (int j = 0; j < HO_WPL; ++j) ok &= v[j] >= want;
        } while (!__all_sync(0xffffffffu, ok));
        ho_fence();
      }
    }
    __syncthreads();   // the next phase starts
  }
  if (b == 0 && threadIdx.x == 0) *elapsed_ns = ho_now() - t0;
}
