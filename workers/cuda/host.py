"""Host-side pieces of the cuda backend (backend.py): the words it shares with the monokernel's layouts
(speculative pass state, Params, counters, the hang report's reading of them and the report itself), the RoPE
table and host-mapped memory."""
from __future__ import annotations

import ctypes

import numpy as np

REASONS = {1: "eos", 2: "stop", 3: "length", 4: "cancel"}
# words of the speculative pass state (mk_spec_lm.cuh SW_*), then the attention's tickets (mk_spec.cuh)
SW_K, SW_PROBE, SW_STEPS, SW_DRAFTED, SW_ACCEPTED = 19, 21, 23, 24, 25
SPEC_TICKETS, SPEC_MAX_TICKETS = 64, 1024
SPEC_WORDS = SPEC_TICKETS + SPEC_MAX_TICKETS
SPEC_PROBE = 8        # kog_dist.speculative.AdaptiveDraft's probe_every
SPEC_MIN_NGRAM = 3    # the shortest context match that drafts, and the first draft's size (AdaptiveDraft's start;
SPEC_START = 4        # it doubles up to k while accepted): bench/spec_replay.py chose 3:4, bench/spec_policy.py
#                       measured it (BENCHMARKS.md "Speculative verify passes")
N_PARAMS = 78   # words of the host copy of Params (mk_layout.cuh's struct: 68, 73 with several ranks, 77 with their mask)
MAX_STOP, MAX_EOS = 16, 8
# CuPy events of launches that failed with a CUDA error, or with several ranks (a peer lost, a kccl
# error; the context may have faulted): kept to the process's end, since destroying them in a faulted
# context prints an "Exception ignored" traceback each
_KEEP: list = []


def _cuda_error(exc) -> bool:
    return type(exc).__name__ in ("CUDARuntimeError", "CUDADriverError")


def rope_table(cfg, max_seq: int):
    """(cos, sin) float32 [max_seq, hd/2] of position * theta^(-2k/hd), computed in float64 as the numpy
    engine does, so RoPE on the device uses exactly the reference's rounded values."""
    import cupy as cp
    from kog_dist.config import rope_inv_freq
    ang = np.arange(max_seq, dtype=np.float64)[:, None] * rope_inv_freq(cfg)[None, :]
    t = np.stack([np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)], axis=-1)
    return cp.asarray(np.ascontiguousarray(t))


class _Mapped:
    """Pinned host memory mapped into the device's address space (UVA: same pointer on both sides)."""

    def __init__(self, n: int, dtype=np.int32):
        import cupy as cp
        self.nbytes = int(n * np.dtype(dtype).itemsize)
        self.ptr = cp.cuda.runtime.hostAlloc(self.nbytes, 2)   # cudaHostAllocMapped
        buf = (ctypes.c_byte * self.nbytes).from_address(self.ptr)
        self.a = np.frombuffer(buf, dtype=dtype, count=n)

    def free(self):
        import cupy as cp
        if self.ptr:
            cp.cuda.runtime.freeHost(self.ptr)
            self.ptr = 0


CTR_STRIDE = 16   # mk_layout.cuh: u64 words between counters


def counter_lines(ctr: np.ndarray, lanes: int) -> list[str]:
    """The monokernel's counters as the hang report prints them. mk_layout.cuh: 5 phases x lanes, then the
    sampler's ticket, C_TOKEN and C_STOP (written, read by no kernel code), the token word {n + 1, stop,
    token} and the cancel word, each CTR_STRIDE words apart."""
    c = np.asarray(ctr, np.uint64)[::CTR_STRIDE][:5 * lanes + 5]   # attention's tickets may follow
    out = [f"  {name}: {[int(v) for v in c[ph * lanes:(ph + 1) * lanes]]}"
           for ph, name in enumerate(("qkv", "att", "wo", "w13", "w2"))]
    w = int(c[5 * lanes + 2])
    out.append(f"  ticket {int(c[5 * lanes])}; token word: {w >> 32} tokens given, stop {(w >> 24) & 0xff}, "
               f"last token {w & 0xffffff}; cancel {int(c[5 * lanes + 4])}")
    return out


def hang_report(b, seen: int) -> None:
    """CudaBackend b's kernel made no progress for hang_s: if the CUDA context faulted, raise that (several
    ranks: the communicator's verdict, PeerLost when a peer died); else print the kernel's counters
    (read on another stream while it runs) and end the process, since a stuck kernel holds the
    device. Raw runtime calls: no CuPy stream whose destructor would print in a faulted context."""
    import os
    import sys

    from kccl.cuda_ipc import context_error, one_line
    exc = context_error(b.cp.cuda.runtime.getDevice())
    if exc is not None:
        if b.comm is not None:
            raise b.comm.fault(exc, "decode") from exc
        raise RuntimeError(f"monokernel: CUDA error after {seen} tokens: {one_line(exc)}") from exc
    rt = b.cp.cuda.runtime
    host = np.zeros(b.ctr.size, np.uint64)
    try:
        s = rt.streamCreateWithFlags(1)
        rt.memcpyAsync(host.ctypes.data, b.ctr.data.ptr, host.nbytes, 2, s)
        rt.streamSynchronize(s)
        rt.streamDestroy(s)
    except Exception as e:  # noqa: BLE001
        print(f"monokernel hang: counters unreadable: {e}", file=sys.stderr)
    print(f"monokernel hang after {seen} tokens; status {list(b.status.a)}", file=sys.stderr)
    print("\n".join(counter_lines(host, b.rcfg.num_lanes)), file=sys.stderr, flush=True)
    os._exit(17)
