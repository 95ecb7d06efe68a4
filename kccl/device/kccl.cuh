// kccl.cuh: the device side of the kccl `cuda_ipc` transport (docs/kccl-gpu.md), included by the
// monokernel, by kccl_ops.cu (the host API's kernels) and by kccl_test.cu. No other includes, so it
// compiles the same with nvcc and with NVRTC (CuPy RawModule).
//
// Every rank owns one device "window" (cudaMalloc, exported with cudaIpcGetMemHandle, opened by every
// peer). Window of rank R (offsets in KcclDev, computed by kccl/cuda_ipc.py CudaLayout):
//   header    magic / rank / nranks / layout hash (checked by peers at open)
//   flags     [nch][nranks] u64, one 128-byte line each: flag[c][s] = last epoch rank s published
//             on channel c into R's slots (written by s, polled by R with acquire loads)
//   acks      [nch][nranks] u64, 128-byte lines: ack[c][d] = last epoch of R that rank d consumed
//             on channel c (written by d, polled by R before it reuses a slot in d's window)
//   counters  local only: per (channel, ring slot) arrival counters of R's own blocks (posts, reads)
//   slots     per channel c, per source s, depth[c] slots of slot_bytes: 64-byte meta
//             (epoch, op << 32 | nbytes) then payload_bytes (16-byte aligned)
// Epochs start at 1, only grow, flags are never reset; epoch e lives in ring slot e % depth[c].
// A sender writes epoch e only once every rank acked e - depth[c] (the slot's previous tenant).
//
// Memory order: a post's data stores are followed by __syncthreads + __threadfence_system in each
// writing block, an acq_rel counter add (the last block to arrive publishes), then a system-scope
// fence and `st.release.sys` of the epoch into every rank's flag. A receiver's thread 0 polls with
// `ld.acquire.sys`, then __syncthreads; slot data is read with ld.global.cg (L2, never a stale L1 line
// of an older tenant of the slot).
#pragma once

#ifndef KCCL_MAX_RANKS
#define KCCL_MAX_RANKS 8
#endif
#define KCCL_MAX_CH 8
#define KCCL_MAX_DEPTH 16
#define KCCL_LINE 128
#define KCCL_META_BYTES 64
#define KCCL_MAGIC 0x4B43434C47505531ULL  // "KCCLGPU1"

// status codes (status[0]); the rest: [1] this rank, [2] peer, [3] channel, [4] epoch, [5] seen, [6] block
#define KCCL_OK 0
#define KCCL_ERR_TIMEOUT_FLAG 1   // waited timeout_ns for a peer's epoch
#define KCCL_ERR_TIMEOUT_ACK 2    // waited timeout_ns for a peer to free a slot
#define KCCL_ERR_ABORTED 3        // the host raised *abort (it saw a peer process die)
#define KCCL_ERR_OP_MISMATCH 4    // a peer sent a different op (ranks called ops in different orders)
#define KCCL_ERR_SIZE_MISMATCH 5  // a peer sent a different byte count
#define KCCL_ERR_EPOCH 6          // the slot holds another epoch (protocol bug)
#define KCCL_STATUS_WORDS 8

typedef unsigned long long kccl_u64;

// Filled by kccl/cuda_ipc.py (CudaCommunicator.dev_words(): 36 little-endian 8-byte words, this order).
struct KcclDev {
  char* base[KCCL_MAX_RANKS];        // 0..7   window of rank r as mapped in this process (base[rank]: own)
  long long rank, nranks, nch;       // 8..10
  long long slot_bytes;              // 11     meta + payload, multiple of 128
  long long payload_bytes;           // 12     capacity of one slot's payload
  long long off_flags, off_acks;     // 13, 14
  long long off_cnt;                 // 15     local chunk counters
  int* status;                       // 16     host-mapped int[8], zero = ok
  const int* abort;                  // 17     host-mapped int, nonzero: give up every wait
  long long timeout_ns;              // 18     bound of every wait (globaltimer ns)
  long long magic;                   // 19     KCCL_MAGIC
  long long depth[KCCL_MAX_CH];      // 20..27 ring depth of channel c
  long long slot_off[KCCL_MAX_CH];   // 28..35 offset of channel c's slots in a window
};

// ---- primitives --------------------------------------------------------------------------------
__device__ __forceinline__ kccl_u64 kccl_ld_acquire(const kccl_u64* p) {
  kccl_u64 v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void kccl_st_release(kccl_u64* p, kccl_u64 v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ kccl_u64 kccl_add_acq_rel(kccl_u64* p, kccl_u64 v) {
  kccl_u64 old;
  asm volatile("atom.acq_rel.gpu.global.add.u64 %0, [%1], %2;" : "=l"(old) : "l"(p), "l"(v) : "memory");
  return old;
}
__device__ __forceinline__ kccl_u64 kccl_gtimer() {
  kccl_u64 t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ uint4 kccl_ld_cg(const void* p) {
  uint4 v;
  asm volatile("ld.global.cg.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void kccl_st16(void* p, uint4 v) {
  asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
}
__device__ __forceinline__ float kccl_h2f(unsigned short h) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
}
__device__ __forceinline__ unsigned short kccl_f2h(float f) {
  unsigned short h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
}

// ---- addresses -----------------------------------------------------------------------------------
// flag[c][src] in the window of `dst` (written by src)
__device__ __forceinline__ kccl_u64* kccl_flag(const KcclDev& d, int dst, int c, int src) {
  return (kccl_u64*)(d.base[dst] + d.off_flags + ((long long)c * d.nranks + src) * KCCL_LINE);
}
// ack[c][by] in the window of `owner` (written by rank `by` once it consumed owner's epoch)
__device__ __forceinline__ kccl_u64* kccl_ack(const KcclDev& d, int owner, int c, int by) {
  return (kccl_u64*)(d.base[owner] + d.off_acks + ((long long)c * d.nranks + by) * KCCL_LINE);
}
__device__ __forceinline__ int kccl_ring(const KcclDev& d, int c, kccl_u64 e) { return (int)(e % (kccl_u64)d.depth[c]); }
// the slot (meta first) that holds `src`'s epoch e of channel c in the window of `dst`
__device__ __forceinline__ char* kccl_slot_meta(const KcclDev& d, int dst, int c, int src, kccl_u64 e) {
  return d.base[dst] + d.slot_off[c] + ((long long)src * d.depth[c] + kccl_ring(d, c, e)) * d.slot_bytes;
}
// payload of src's epoch e of channel c as this rank received it (valid after kccl_wait)
__device__ __forceinline__ const char* kccl_slot(const KcclDev& d, int c, int src, kccl_u64 e) {
  return kccl_slot_meta(d, (int)d.rank, c, src, e) + KCCL_META_BYTES;
}
// local counter k (0: chunks posted, 1: chunks read) of ring slot `ring` of channel c
__device__ __forceinline__ kccl_u64* kccl_counter(const KcclDev& d, int k, int c, int ring) {
  return (kccl_u64*)(d.base[d.rank] + d.off_cnt + (((long long)k * KCCL_MAX_CH + c) * KCCL_MAX_DEPTH + ring) * KCCL_LINE);
}
// A ring slot's counters count the blocks that finished their part of the slot's current epoch; the
// last of `nchunks` blocks resets the counter to 0 and then publishes (flag or ack). The next tenant
// of the slot (epoch e + depth) can only start after that publication (posts wait for the acks,
// reads for the flag), so the reset is ordered before its first add, and the number of blocks may
// differ from one epoch to the next.
__device__ __forceinline__ bool kccl_arrive_last(kccl_u64* counter, int nchunks) {
  if (kccl_add_acq_rel(counter, 1ull) + 1 != (kccl_u64)nchunks) return false;
  *(volatile kccl_u64*)counter = 0;
  return true;
}
// local word where the first error of this rank is claimed (window header, byte 256)
__device__ __forceinline__ int* kccl_error_word(const KcclDev& d) { return (int*)(d.base[d.rank] + 256); }

// ---- errors and bounded waits ------------------------------------------------------------------
// The first error of this rank (claimed with an atomic on device memory) is copied into the host-mapped
// status words, code last, so the host sees a complete record once status[0] != 0.
__device__ __forceinline__ void kccl_fail(const KcclDev& d, int code, int peer, int c, kccl_u64 e, kccl_u64 seen) {
  if (atomicCAS(kccl_error_word(d), 0, code) != 0) return;
  volatile int* st = d.status;
  if (!st) return;
  st[1] = (int)d.rank;
  st[2] = peer;
  st[3] = c;
  st[4] = (int)e;
  st[5] = (int)seen;
  st[6] = (int)blockIdx.x;
  __threadfence_system();
  st[0] = code;
  __threadfence_system();
}
__device__ __forceinline__ bool kccl_failed(const KcclDev& d) {
  return *(volatile const int*)kccl_error_word(d) != 0;
}
// spin (one thread) until *p >= target; false after timeout_ns, on *abort or when another block failed
static __device__ __noinline__ bool kccl_spin_ge(const KcclDev& d, const kccl_u64* p, kccl_u64 target, int code,
                                         int peer, int c, kccl_u64 e) {
  kccl_u64 v = kccl_ld_acquire(p);
  if (v >= target) return true;
  const kccl_u64 t0 = kccl_gtimer();
  for (unsigned it = 1;; ++it) {
    v = kccl_ld_acquire(p);
    if (v >= target) return true;
    if ((it & 1023u) == 0) {
      if (d.abort && *(volatile const int*)d.abort) {
        kccl_fail(d, KCCL_ERR_ABORTED, peer, c, e, v);
        return false;
      }
      if (kccl_failed(d)) return false;
      if (kccl_gtimer() - t0 > (kccl_u64)d.timeout_ns) {
        kccl_fail(d, code, peer, c, e, v);
        return false;
      }
    }
  }
}
// block-wide: thread 0's verdict to every thread (one __syncthreads)
__device__ __forceinline__ bool kccl_block_ok(bool ok0) {
  __shared__ int kccl_ok_s;
  if (threadIdx.x == 0) kccl_ok_s = ok0;
  __syncthreads();
  const bool ok = kccl_ok_s;
  __syncthreads();
  return ok;
}

// ---- post ----------------------------------------------------------------------------------------
// Call with every thread of a block. 1) kccl_post_begin: wait until every rank freed the slot of e.
// 2) kccl_post_chunk (any number, disjoint byte ranges). 3) kccl_post_end with the number of blocks
// that post epoch e (each calls begin/chunk/end once); the last of them publishes e to every rank.
__device__ __forceinline__ bool kccl_post_begin(const KcclDev& d, int c, kccl_u64 e) {
  bool ok = true;
  if (threadIdx.x == 0 && e > (kccl_u64)d.depth[c]) {
    const kccl_u64 need = e - (kccl_u64)d.depth[c];
    for (int r = 0; r < d.nranks && ok; ++r)
      ok = kccl_spin_ge(d, kccl_ack(d, (int)d.rank, c, r), need, KCCL_ERR_TIMEOUT_ACK, r, c, e);
  }
  return kccl_block_ok(ok);
}
// copy bytes [off, off + nbytes) of this rank's payload (src points at byte 0 of the payload) into
// its slot of epoch e in every rank's window (own included). 16-byte stores when src + off is 16-byte
// aligned (src 16-aligned and off a multiple of 16), else 4-byte words (off, nbytes multiples of 4),
// else bytes.
__device__ __forceinline__ void kccl_post_chunk(const KcclDev& d, int c, kccl_u64 e, const void* src,
                                                long long off, long long nbytes) {
  const int me = (int)d.rank, n = (int)d.nranks;
  const char* s = (const char*)src + off;
  const bool vec = ((unsigned long long)s & 15) == 0 && (off & 15) == 0;
  if (!vec && (((unsigned long long)s | (unsigned long long)off | (unsigned long long)nbytes) & 3) == 0) {
    for (long long i = threadIdx.x; i < (nbytes >> 2); i += blockDim.x) {
      const unsigned v = *(volatile const unsigned*)(s + 4 * i);
      for (int r = 0; r < n; ++r)
        *(unsigned*)(kccl_slot_meta(d, r, c, me, e) + KCCL_META_BYTES + off + 4 * i) = v;
    }
    return;
  }
  const long long nv = vec ? nbytes >> 4 : 0;
  for (long long i = threadIdx.x; i < nv; i += blockDim.x) {
    const uint4 v = kccl_ld_cg(s + 16 * i);
    for (int r = 0; r < n; ++r)
      kccl_st16(kccl_slot_meta(d, r, c, me, e) + KCCL_META_BYTES + off + 16 * i, v);
  }
  for (long long b = (nv << 4) + threadIdx.x; b < nbytes; b += blockDim.x) {  // tail bytes
    const char v = *(volatile const char*)(s + b);
    for (int r = 0; r < n; ++r) kccl_slot_meta(d, r, c, me, e)[KCCL_META_BYTES + off + b] = v;
  }
}
__device__ __forceinline__ void kccl_post_end(const KcclDev& d, int c, kccl_u64 e, int nchunks,
                                              long long total_bytes, int op) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence_system();
    if (kccl_arrive_last(kccl_counter(d, 0, c, kccl_ring(d, c, e)), nchunks)) {  // last block: publish
      const int me = (int)d.rank, n = (int)d.nranks;
      for (int r = 0; r < n; ++r) {
        volatile kccl_u64* meta = (volatile kccl_u64*)kccl_slot_meta(d, r, c, me, e);
        meta[0] = e;
        meta[1] = ((kccl_u64)(unsigned)op << 32) | (kccl_u64)total_bytes;
      }
      __threadfence_system();
      for (int r = 0; r < n; ++r) kccl_st_release(kccl_flag(d, r, c, me), e);
    }
  }
}
// one block posts the whole payload
__device__ __forceinline__ bool kccl_post(const KcclDev& d, int c, kccl_u64 e, const void* src, long long nbytes,
                                          int op = 0) {
  if (!kccl_post_begin(d, c, e)) return false;
  kccl_post_chunk(d, c, e, src, 0, nbytes);
  kccl_post_end(d, c, e, 1, nbytes, op);
  return true;
}

// ---- LL words: the low-latency path (no fence, no counter, no flag) ---------------------------------
// A payload word travels with its epoch: one 8-byte store {value bits (low 32), tag = (u32)epoch (high
// 32)} straight into the reader's window, and the reader polls the word itself. Aligned 8-byte stores
// and loads are single-copy atomic (also over NVLink: NCCL's LL protocol rests on the same rule), so a
// reader that sees the tag sees the value. The slot of (c, src, e) is the same ring slot as above; it
// holds payload_bytes / 8 words. There are no acks: the caller must know from its own data dependencies
// that every reader is past epoch e - depth[c] before it writes epoch e (the monokernel:
// depth >= 2 * delta + 2, docs/kccl-gpu.md; an all-reduce per round: depth >= 2). Epochs start at 1 and
// slots are zeroed at create, so a word never written carries tag 0 and never matches.
__device__ __forceinline__ kccl_u64* kccl_ll_words(const KcclDev& d, int dst, int c, int src, kccl_u64 e) {
  return (kccl_u64*)(kccl_slot_meta(d, dst, c, src, e) + KCCL_META_BYTES);
}
__device__ __forceinline__ void kccl_ll_st(kccl_u64* p, unsigned tag, unsigned v) {
  asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(p), "l"(((kccl_u64)tag << 32) | v) : "memory");
}
__device__ __forceinline__ kccl_u64 kccl_ll_ld(const kccl_u64* p) {
  kccl_u64 v;
  asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
// (rare) why a poll of an LL word gives up: 0 = keep polling; else the wait failed (recorded)
static __device__ __noinline__ int kccl_ll_giveup(const KcclDev& d, kccl_u64 t0, kccl_u64 seen, unsigned tag,
                                                  int src, int c) {
  if (kccl_failed(d)) return 1;
  if (d.abort && *(volatile const int*)d.abort) {
    kccl_fail(d, KCCL_ERR_ABORTED, src, c, tag, seen >> 32);
    return 1;
  }
  if (kccl_gtimer() - t0 > (kccl_u64)d.timeout_ns) {
    kccl_fail(d, KCCL_ERR_TIMEOUT_FLAG, src, c, tag, seen >> 32);
    return 1;
  }
  return 0;
}
// (one thread) the value bits of word *p once it carries `tag`; src: the rank that writes it. Bounded
// like kccl_spin_ge: 0 after a timeout, an abort or another failure of this rank (kccl_failed).
__device__ __forceinline__ unsigned kccl_ll_get(const KcclDev& d, const kccl_u64* p, unsigned tag, int src, int c) {
  kccl_u64 v = kccl_ll_ld(p);
  if ((unsigned)(v >> 32) == tag) return (unsigned)v;
  if (kccl_failed(d)) return 0u;
  const kccl_u64 t0 = kccl_gtimer();
  for (unsigned it = 1;; ++it) {
    v = kccl_ll_ld(p);
    if ((unsigned)(v >> 32) == tag) return (unsigned)v;
    if ((it & 1023u) == 0 && kccl_ll_giveup(d, t0, v, tag, src, c)) return 0u;
  }
}

// ---- wait / read / ack ---------------------------------------------------------------------------
// Block-wide: until every rank in [r0, r1) published epoch e of channel c (default: all ranks).
__device__ __forceinline__ bool kccl_wait(const KcclDev& d, int c, kccl_u64 e, int r0 = 0, int r1 = -1) {
  bool ok = true;
  if (r1 < 0) r1 = (int)d.nranks;
  if (threadIdx.x == 0)
    for (int s = r0; s < r1 && ok; ++s)
      ok = kccl_spin_ge(d, kccl_flag(d, (int)d.rank, c, s), e, KCCL_ERR_TIMEOUT_FLAG, s, c, e);
  return kccl_block_ok(ok);
}
// thread 0 after kccl_wait: every source's slot meta says epoch e and (op, nbytes) as expected
// (nbytes < 0: any). Reports the first mismatch to status and returns false.
__device__ __forceinline__ bool kccl_check_meta(const KcclDev& d, int c, kccl_u64 e, int op, long long nbytes,
                                                int r0 = 0, int r1 = -1) {
  if (r1 < 0) r1 = (int)d.nranks;
  for (int s = r0; s < r1; ++s) {
    const volatile kccl_u64* meta = (const volatile kccl_u64*)(kccl_slot(d, c, s, e) - KCCL_META_BYTES);
    const kccl_u64 me = meta[0], w = meta[1];
    if (me != e) { kccl_fail(d, KCCL_ERR_EPOCH, s, c, e, me); return false; }
    if ((int)(w >> 32) != op) { kccl_fail(d, KCCL_ERR_OP_MISMATCH, s, c, e, w >> 32); return false; }
    if (nbytes >= 0 && (long long)(w & 0xffffffffull) != nbytes) {
      kccl_fail(d, KCCL_ERR_SIZE_MISMATCH, s, c, e, w & 0xffffffffull);
      return false;
    }
  }
  return true;
}
// Block-wide, after kccl_wait: dst[i] = sum over ranks 0..N-1 (in that order, fp32) of the float32
// payloads of epoch e, for float index i in [i0, i0 + n). Every rank gets the same bits.
__device__ __forceinline__ void kccl_collect_sum_f32(const KcclDev& d, int c, kccl_u64 e, float* dst, long long i0,
                                                     long long n) {
  const int N = (int)d.nranks;
  long long i = i0 + 4 * (long long)threadIdx.x;
  const long long end = i0 + n;
  if ((i0 & 3) == 0 && (((unsigned long long)dst) & 15) == 0) {
    for (; i + 4 <= end; i += 4 * (long long)blockDim.x) {
      uint4 v = kccl_ld_cg(kccl_slot(d, c, 0, e) + 4 * i);
      float4 a = make_float4(__uint_as_float(v.x), __uint_as_float(v.y), __uint_as_float(v.z), __uint_as_float(v.w));
      for (int s = 1; s < N; ++s) {
        v = kccl_ld_cg(kccl_slot(d, c, s, e) + 4 * i);
        a.x += __uint_as_float(v.x); a.y += __uint_as_float(v.y);
        a.z += __uint_as_float(v.z); a.w += __uint_as_float(v.w);
      }
      *(float4*)(dst + i) = a;
    }
    i = i0 + ((n >> 2) << 2) + threadIdx.x;  // tail
  } else {
    i = i0 + threadIdx.x;
  }
  for (; i < end; i += blockDim.x) {
    float a = *(volatile const float*)(kccl_slot(d, c, 0, e) + 4 * i);
    for (int s = 1; s < N; ++s) a += *(volatile const float*)(kccl_slot(d, c, s, e) + 4 * i);
    dst[i] = a;
  }
}
// fp16 payloads (bits as unsigned short): summed in fp32 in rank order; written as fp16 (dst_h, rounded
// once) and/or fp32 (dst_f); either may be null. Element range [i0, i0 + n).
__device__ __forceinline__ void kccl_collect_sum_f16(const KcclDev& d, int c, kccl_u64 e, unsigned short* dst_h,
                                                     float* dst_f, long long i0, long long n) {
  const int N = (int)d.nranks;
  const long long end = i0 + n;
  long long i;
  if ((i0 & 7) == 0 && (((unsigned long long)dst_h) & 15) == 0 && (((unsigned long long)dst_f) & 15) == 0) {
    for (i = i0 + 8 * (long long)threadIdx.x; i + 8 <= end; i += 8 * (long long)blockDim.x) {
      float a[8];
      for (int s = 0; s < N; ++s) {
        const uint4 v = kccl_ld_cg(kccl_slot(d, c, s, e) + 2 * i);
        const unsigned w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int k = 0; k < 8; ++k) {
          const float f = kccl_h2f((unsigned short)(w[k >> 1] >> (16 * (k & 1))));
          a[k] = s == 0 ? f : a[k] + f;
        }
      }
      if (dst_f) {
        *(float4*)(dst_f + i) = make_float4(a[0], a[1], a[2], a[3]);
        *(float4*)(dst_f + i + 4) = make_float4(a[4], a[5], a[6], a[7]);
      }
      if (dst_h) {
        unsigned w[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) w[k] = (unsigned)kccl_f2h(a[2 * k]) | ((unsigned)kccl_f2h(a[2 * k + 1]) << 16);
        *(uint4*)(dst_h + i) = make_uint4(w[0], w[1], w[2], w[3]);
      }
    }
    i = i0 + ((n >> 3) << 3) + threadIdx.x;
  } else {
    i = i0 + threadIdx.x;
  }
  for (; i < end; i += blockDim.x) {
    float a = 0.f;
    for (int s = 0; s < N; ++s) {
      const float f = kccl_h2f(*(volatile const unsigned short*)(kccl_slot(d, c, s, e) + 2 * i));
      a = s == 0 ? f : a + f;
    }
    if (dst_f) dst_f[i] = a;
    if (dst_h) dst_h[i] = kccl_f2h(a);
  }
}
// Block-wide, after this block's last read of epoch e's slots: `nreaders` blocks read epoch e (each
// calls this once); the last of them tells every source (own rank included) that its slot is free.
__device__ __forceinline__ void kccl_collect_end(const KcclDev& d, int c, kccl_u64 e, int nreaders, int r0 = 0,
                                                 int r1 = -1) {
  __syncthreads();
  if (threadIdx.x == 0) {
    if (r1 < 0) r1 = (int)d.nranks;
    if (kccl_arrive_last(kccl_counter(d, 1, c, kccl_ring(d, c, e)), nreaders)) {
      __threadfence_system();
      for (int s = r0; s < r1; ++s) kccl_st_release(kccl_ack(d, s, c, (int)d.rank), e);
    }
  }
}
// one block: wait for epoch e from every rank, sum the fp32 payloads (n floats) into dst, free the slots
__device__ __forceinline__ bool kccl_collect_f32(const KcclDev& d, int c, kccl_u64 e, float* dst, long long n) {
  if (!kccl_wait(d, c, e)) return false;
  kccl_collect_sum_f32(d, c, e, dst, 0, n);
  kccl_collect_end(d, c, e, 1);
  return true;
}
