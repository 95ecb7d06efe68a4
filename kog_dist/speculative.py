"""Speculative decoding by prompt lookup (spec: "Sampling"; docs/interfaces.md).

Agents rewrite what is already in their context, so a draft copied from the context after the longest
earlier match of its last tokens is often right. One forward pass over the last sampled token and k
draft tokens gives k + 1 rows of logits; position i's token is drawn exactly as the plain sampler
draws it (sampling.sample with counter = its position), and draft token i is accepted while it equals
that draw. With a point-mass draft this is speculative sampling's accept / resample rule (accept with
probability p(d), else a draw from p without d), and more: the tokens are the plain decode's tokens,
one for one, greedy or sampled under a seed, so every backend gives the same ids with or without it.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .sampling import SamplingParams, sample

MAX_DRAFT = 8
MAX_NGRAM = 4
# The draft length a command uses when not told (`--speculative` of kog generate / chat / serve / kog-worker),
# by backend: on only where it is lossless (always) and measured not slower on free text (the free story row of
# `kog bench --speculative 8` at >= 0.98x). On for the cpu backend: its story row drafts nothing (each step is
# the plain step plus one NgramIndex push), 1.00x wall / 0.99x CPU time at reps 7, with the edits at 1.92x /
# 1.08x / 2.13x / 0.99x (BENCHMARKS.md "Speculation on by default on the cpu backend"). Off for cuda: the
# monokernel's free-story rows were 0.95-1.02x in bf16 and 0.93x for the default model's own Q4_1 (2026-12-04,
# H200); a backend made to speculate runs its plain steps at 384 threads. A request's `speculative` field and
# the flags override it.
DEFAULT_DRAFT = {"cpu": MAX_DRAFT, "cuda": 0}


def default_draft(backend: str) -> int:
    """The default draft length for a backend kind ("cpu", "cuda"; anything else: off)."""
    return DEFAULT_DRAFT.get(backend, 0)


@dataclass(frozen=True)
class SpecParams:
    method: str = "prompt_lookup"
    k: int = MAX_DRAFT          # draft tokens per step at most (0: off)
    ngram: int = MAX_NGRAM      # longest suffix looked up

    def validate(self) -> "SpecParams":
        if self.method != "prompt_lookup":
            raise ValueError(f"speculative method {self.method!r} is not supported (prompt_lookup)")
        if isinstance(self.k, bool) or not isinstance(self.k, int) or not 0 <= self.k <= MAX_DRAFT:
            raise ValueError(f"speculative k must be an integer in [0, {MAX_DRAFT}], got {self.k!r}")
        if isinstance(self.ngram, bool) or not isinstance(self.ngram, int) or not 1 <= self.ngram <= 8:
            raise ValueError(f"speculative ngram must be an integer in [1, 8], got {self.ngram!r}")
        return self


def lookup(context, k: int, max_ngram: int = MAX_NGRAM, min_ngram: int = 1) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the context's last n tokens,
    n = max_ngram down to min_ngram (the longest match wins; ties: the latest)."""
    ctx = np.asarray(context, dtype=np.int64)
    T = ctx.size
    if k <= 0 or T < 2:
        return []
    for n in range(min(max_ngram, T - 1), max(1, min_ngram) - 1, -1):
        tail = ctx[T - n:]
        # windows ctx[s:s+n] for s in [0, T-n): an earlier occurrence with at least one token after it
        win = np.lib.stride_tricks.sliding_window_view(ctx[:T - 1], n)
        hits = np.flatnonzero((win == tail).all(axis=1))
        if hits.size:
            s = int(hits[-1]) + n
            return [int(t) for t in ctx[s:s + k]]
    return []


class NgramIndex:
    """lookup() kept up to date as tokens arrive: the latest start of every n-gram (min_ngram..max_ngram) that
    has a token after it, so a draft costs O(max_ngram) instead of a scan of the context (lookup() over 4,000
    tokens: ~0.55 ms on the 2-core CI machine, 2% of a cpu token, paid at every drafting step). The same
    answers as lookup(ctx, k, max_ngram, min_ngram) for the tokens pushed so far."""

    def __init__(self, max_ngram: int = MAX_NGRAM, min_ngram: int = 1, tokens=()):
        self.ctx: list[int] = []
        self.starts = {n: {} for n in range(max_ngram, max(1, min_ngram) - 1, -1)}   # longest first
        self.extend(tokens)

    def push(self, tok: int) -> None:
        T, ctx = len(self.ctx), self.ctx
        for n, latest in self.starts.items():   # the n-grams that end at T - 1 now have a token after them
            if T >= n:
                latest[tuple(ctx[T - n:T])] = T - n
        ctx.append(int(tok))

    def extend(self, tokens) -> None:
        for t in tokens:
            self.push(t)

    def sync(self, context) -> None:
        """Push what `context` has beyond the tokens pushed so far (it must extend them)."""
        self.extend(context[len(self.ctx):])

    def lookup(self, k: int) -> list[int]:
        ctx, T = self.ctx, len(self.ctx)
        if k <= 0 or T < 2:
            return []
        for n, latest in self.starts.items():
            if n <= T - 1:
                s = latest.get(tuple(ctx[T - n:]))
                if s is not None:
                    return ctx[s + n:s + n + k]
        return []


class AdaptiveDraft:
    """How many draft tokens to ask for next: fewer while drafts are rejected, none after a run of
    rejections (then a one-token probe every `probe_every` steps, twice as far apart after each probe
    that fails, up to `max_probe_every`: on free text, where lookups keep missing, a rejected probe
    still costs a pass wider than one token), back to k as they are accepted."""

    def __init__(self, k: int, probe_every: int = 8, max_probe_every: int = 32, start: int | None = None):
        """start: the first draft's size (None: k); a backend whose verify positions are dear starts
        lower and doubles up to k as drafts are accepted."""
        self.k_max = k
        self.k = k if start is None else max(0, min(k, start))
        self.base_probe = self.probe_every = probe_every
        self.max_probe_every = max(probe_every, max_probe_every)
        self.misses, self.since_probe = 0, 0

    def size(self) -> int:
        if self.k > 0:
            return self.k
        self.since_probe += 1
        return 1 if self.since_probe >= self.probe_every else 0

    def update(self, drafted: int, accepted: int) -> None:
        if drafted == 0:
            return
        self.since_probe = 0
        if accepted == 0:
            if self.k == 0:            # a probe that failed
                self.probe_every = min(self.max_probe_every, 2 * self.probe_every)
            self.misses += 1
            self.k = 0 if self.misses >= 3 else max(1, self.k // 2)
            return
        self.probe_every, self.misses = self.base_probe, 0
        if accepted == drafted:
            self.k = min(self.k_max, max(1, self.k) * 2)
        else:
            self.k = max(1, accepted + 1)


def verify(logits_rows: np.ndarray, draft, params: SamplingParams, counter0: int) -> tuple[list[int], int]:
    """Tokens for the k + 1 positions of one verify pass: rows[i] are the logits after the last
    sampled token and draft[:i]; token i is drawn as the plain sampler draws it at counter0 + i.
    Returns (tokens, accepted drafts): every accepted draft token, then the first token that differs
    from its draft (or the bonus token after a fully accepted draft)."""
    out = []
    for i in range(len(draft) + 1):
        t = sample(logits_rows[i], params, counter=counter0 + i)
        out.append(t)
        if i == len(draft) or t != draft[i]:
            return out, i
    raise AssertionError("unreachable")


def step(engine, last: int, context, params: SamplingParams, draft_len: int,
         max_ngram: int = MAX_NGRAM, forward=None, min_ngram: int = 1,
         draft: list[int] | None = None) -> tuple[list[int], int, int]:
    """One verify pass on a reference engine whose cache holds `context` minus `last` (the last
    sampled token, not yet fed). Returns (tokens, drafted, accepted); the cache is left holding `last`
    and the accepted drafts, i.e. everything but the final token, as after plain steps. A caller that
    stops early (EOS, stop id, max tokens) after token j truncates the cache to its position.
    forward(engine, ids) -> logits [len(ids), V], appending the ids to the cache (a backend's faster
    pass); None: the engine's own batched forward. min_ngram: the shortest match that drafts. draft: the
    lookup's answer, where the caller keeps an NgramIndex (context is then not read)."""
    if draft is None:
        draft = lookup(context, draft_len, max_ngram, min_ngram)
    start = engine.pos
    ids = np.asarray([last] + draft, dtype=np.int64)
    rows = forward(engine, ids) if forward else engine.forward(ids, all_logits=True)
    tokens, accepted = verify(rows, draft, params, counter0=start + 1)
    engine.truncate(start + len(tokens))
    return tokens, len(draft), accepted
