"""Structured outputs on the cuda backend (issue 55): the host's half of the token mask that the monokernel's
CFG_MASK build applies before it samples (mk_mask.cuh).

The first token's mask is written before the launch (`start`). Then the host thread that reads the tokens from
the ring advances the grammar by token n and writes token n + 1's mask (`advance`) while the kernel runs token
n + 1's forward: llguidance writes the words straight into the host-mapped buffer, then the host stores the count
of masks written, which the sampler polls (an acquire) before it reads the words. That count is an aligned 4-byte
store made after llguidance's call has returned; on x86-64 (TSO) stores become visible in program order, so it
is a release (kccl/communicator.py relies on the same; weakly ordered CPUs would need a fence that Python cannot
issue). One buffer is enough: the host writes token n + 1's mask only after it has read token n, which the
kernel writes to the ring after it has read token n's mask.
"""
from __future__ import annotations

import time

import numpy as np

STAT_WAITS, STAT_NS, STAT_MAX_NS, STAT_TIMEOUTS = range(4)   # mk_mask.cuh MS_*: the sampler's waits
STAT_WORDS = 4


def mask_words(vocab_size: int) -> int:
    """u32 words of the kernel's mask (mk_mask.cuh MASK_WORDS): a bit a token, rounded up to 16-byte loads."""
    return ((vocab_size + 31) // 32 + 3) // 4 * 4


def kernel_allows(words, vocab_size: int) -> np.ndarray:
    """The ids the kernel treats as allowed (bool [vocab_size]): bit v & 31 of word v >> 5 (mk_mask.cuh)."""
    w = np.asarray(words).view(np.uint32)
    v = np.arange(vocab_size)
    return ((w[v >> 5] >> (v & 31).astype(np.uint32)) & 1).astype(bool)


def masked_build(b, matcher) -> "DeviceMask":
    """CudaBackend b's token-mask build (CFG_MASK: compiled at the first constrained request, as the speculative
    one; the plain build's defines otherwise) and its mapped words, holding the request's first mask."""
    if b.km is None:
        from .build import build
        dtype, prefetch, extra, progress = b._spec_build
        marks = str(b.k.defines.get("CFG_MARKS", 0)) == "1"
        b.km = build(b.cfg, dtype, b.nblocks, prefetch, progress=progress, extra={**extra, "CFG_MASK": 1},
                     nranks=b.nranks, marks=marks)
        b.dmask = DeviceMask(b.cfg.vocab_size, stat=b.cp.zeros(STAT_WORDS, b.cp.uint64))
    b.dmask.start(matcher)
    return b.dmask


class DeviceMask:
    """The mapped words and flags of one backend, reused by its constrained requests. `alloc(n, dtype)` gives
    host-mapped memory (host._Mapped: `.a`, `.ptr`, `.free()`); `stat`: the kernel's wait counters (a device
    array of STAT_WORDS u64) or None."""

    def __init__(self, vocab_size: int, alloc=None, stat=None):
        if alloc is None:
            from .host import _Mapped as alloc
        self.vocab_size = int(vocab_size)
        self.words = alloc(mask_words(vocab_size), np.uint32)
        self.ready = alloc(2, np.int32)        # [0] masks written (token n's: n + 1), [1] the kernel timed out
        self.stat = stat
        self.g = None
        self.host_s = 0.0                      # the host's time a request in advance(): take the token, write the mask

    def start(self, matcher) -> None:
        """A request's first mask, before the launch (GrammarError when its grammar allows nothing)."""
        if matcher.bits.size > self.words.a.size:
            raise ValueError(f"the grammar's vocabulary ({matcher.grammar.lltok.vocab_size}) is larger than the "
                             f"model's ({self.vocab_size})")
        self.g, self.host_s = matcher, 0.0
        self.words.a[:] = 0                    # ids past the tokenizer's stay forbidden
        self.ready.a[:] = 0
        if self.stat is not None:
            self.stat.fill(0)
        matcher.mask_into(self.words.a)
        self.ready.a[0] = 1

    def advance(self, tok: int, more: bool) -> None:
        """Token n came back: the grammar takes it (as the cpu backend's draw does, the last token too); `more`
        (the host goes on reading): token n + 1's mask, then the count that publishes it."""
        t = time.perf_counter()
        if not self.g.accept(tok):     # the mask allowed it, so only a broken grammar gets here
            raise ValueError(f"the grammar refused token {tok} that its mask allowed")
        if more:
            self.g.mask_into(self.words.a)
            self.ready.a[0] += 1
        self.host_s += time.perf_counter() - t

    def params(self, p, wait_s: float) -> None:
        p["mask"], p["mask_ready"] = self.words.ptr, self.ready.ptr
        p["mask_stat"] = self.stat.data.ptr if self.stat is not None else 0
        p["mask_wait_ns"] = int(wait_s * 1e9)

    def timed_out(self) -> bool:
        return bool(self.ready.a[1])

    def finish(self, res) -> None:
        res.grammar_ms = self.g.mask_s * 1e3
        if self.stat is not None:
            st = self.stat.get()
            res.mask_waits, res.mask_wait_ms = int(st[STAT_WAITS]), float(st[STAT_NS]) / 1e6
            self.last_stat = [int(x) for x in st]

    def free(self) -> None:
        self.words.free()
        self.ready.free()
