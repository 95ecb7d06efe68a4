// kccl_ops.cu: the kernels behind the host API of the cuda_ipc transport (CudaCommunicator.allreduce,
// broadcast, barrier, post, collect on device buffers). One launch per call; blocks split the payload
// in 16-byte units, every block posts/reads its own chunk (the multi-chunk path of kccl.cuh).
#include "kccl.cuh"

#define KCCL_M_POST 1    // send src (send_bytes) as this rank's epoch
#define KCCL_M_WAIT 2    // wait for every rank's epoch and check its meta
#define KCCL_M_SUM 4     // dst = sum over ranks (dtype 0 fp32, 1 fp16) of nbytes
#define KCCL_M_COPY 8    // dst = root's payload (nbytes)
#define KCCL_M_ACK 16    // free the slots (collect end)

// byte range of block b when `nbytes` is split in 16-byte units over `nb` blocks
__device__ __forceinline__ void kccl_block_range(long long nbytes, int b, int nb, long long* lo, long long* hi) {
  const long long units = (nbytes + 15) >> 4, per = (units + nb - 1) / nb;
  long long a = per * b * 16, z = per * (b + 1) * 16;
  if (a > nbytes) a = nbytes;
  if (z > nbytes) z = nbytes;
  *lo = a;
  *hi = z;
}

extern "C" __global__ void kccl_op(const KcclDev* __restrict__ dp, int c, unsigned long long e, int op, int mode,
                                   int root, const char* src, long long send_bytes, char* dst, long long nbytes,
                                   int dtype, long long expect_bytes) {
  const KcclDev& d = *dp;
  if (kccl_failed(d)) return;
  const int nb = gridDim.x, b = blockIdx.x;
  if (mode & KCCL_M_POST) {
    if (!kccl_post_begin(d, c, e)) return;
    long long lo, hi;
    kccl_block_range(send_bytes, b, nb, &lo, &hi);
    if (hi > lo) kccl_post_chunk(d, c, e, src, lo, hi - lo);
    kccl_post_end(d, c, e, nb, send_bytes, op);
  }
  if (!(mode & KCCL_M_WAIT)) return;
  if (!kccl_wait(d, c, e)) return;
  bool ok = true;
  if (threadIdx.x == 0) ok = kccl_check_meta(d, c, e, op, expect_bytes);
  if (!kccl_block_ok(ok)) return;
  if (op == 2 /* broadcast */ && threadIdx.x == 0) {  // root's size is what non-roots receive
    const volatile kccl_u64* meta = (const volatile kccl_u64*)(kccl_slot(d, c, root, e) - KCCL_META_BYTES);
    const long long got = (long long)(meta[1] & 0xffffffffull);
    ok = got == nbytes;
    if (!ok) kccl_fail(d, KCCL_ERR_SIZE_MISMATCH, root, c, e, (kccl_u64)got);
  }
  if (!kccl_block_ok(ok)) return;
  long long lo, hi;
  kccl_block_range(nbytes, b, nb, &lo, &hi);
  if (hi > lo) {
    if (mode & KCCL_M_SUM) {
      if (dtype == 0) kccl_collect_sum_f32(d, c, e, (float*)dst, lo / 4, (hi - lo) / 4);
      else kccl_collect_sum_f16(d, c, e, (unsigned short*)dst, nullptr, lo / 2, (hi - lo) / 2);
    } else if (mode & KCCL_M_COPY) {
      const char* s = kccl_slot(d, c, root, e);
      const long long vend = ((((unsigned long long)dst) & 15) == 0) ? lo + ((hi - lo) >> 4 << 4) : lo;
      for (long long i = lo + 16 * (long long)threadIdx.x; i < vend; i += 16 * (long long)blockDim.x)
        *(uint4*)(dst + i) = kccl_ld_cg(s + i);
      for (long long j = vend + threadIdx.x; j < hi; j += blockDim.x) dst[j] = *(volatile const char*)(s + j);
    }
  }
  if (mode & KCCL_M_ACK) kccl_collect_end(d, c, e, nb);
}

// status/abort helpers for tests: read a peer's flag/ack words as this process maps them
extern "C" __global__ void kccl_peek(const KcclDev* __restrict__ dp, int c, unsigned long long* out) {
  const KcclDev& d = *dp;
  const int n = (int)d.nranks;
  for (int s = threadIdx.x; s < n; s += blockDim.x) {
    out[s] = kccl_ld_acquire(kccl_flag(d, (int)d.rank, c, s));
    out[n + s] = kccl_ld_acquire(kccl_ack(d, (int)d.rank, c, s));
  }
}
