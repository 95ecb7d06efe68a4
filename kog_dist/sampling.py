"""Sampling rules shared by every backend (docs/interfaces.md gives the same steps for the GPU).

Greedy picks the lowest index among equal maxima. Otherwise temperature, top-k, top-p, renormalise,
and one draw from a counter-based generator: uniform(seed, counter), counter being the position the
sampled token will occupy, so the same seed, prompt and parameters give the same tokens on every
backend and rank count, whether the context arrived in one piece or several.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

_M64 = (1 << 64) - 1


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def validate(self) -> "SamplingParams":
        if not (self.temperature >= 0 and np.isfinite(self.temperature)):
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0, got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed <= _M64:
            raise ValueError(f"seed must be an integer in [0, 2^64), got {self.seed}")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0 or self.top_k == 1


def splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _M64
    z = x
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def uniform(seed: int, counter: int) -> float:
    """A float in [0, 1) from (seed, counter): 53 bits of splitmix64(seed ^ splitmix64(counter))."""
    return (splitmix64((seed & _M64) ^ splitmix64(counter & _M64)) >> 11) * (1.0 / (1 << 53))


def argmax_lowest(logits: np.ndarray) -> int:
    return int(np.argmax(logits))  # numpy returns the first (lowest) index among equal maxima


def filtered_distribution(logits: np.ndarray, p: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    """Candidate ids in draw order and their renormalised probabilities, after temperature, top-k, top-p."""
    z = np.asarray(logits, dtype=np.float64) / p.temperature
    w = np.exp(z - z.max())
    order = np.lexsort((np.arange(w.size), -w))  # probability descending, ties by lower index
    if p.top_k > 0:
        order = order[:p.top_k]
    q = w[order]
    q = q / q.sum()
    if p.top_p < 1.0:
        c = np.cumsum(q)
        n = int(np.searchsorted(c, p.top_p, side="left")) + 1  # shortest prefix reaching top_p
        order, q = order[:n], q[:n]
        q = q / q.sum()
    return order, q


def sample(logits: np.ndarray, params: SamplingParams, counter: int) -> int:
    if params.greedy:
        return argmax_lowest(logits)
    order, q = filtered_distribution(logits, params)
    u = uniform(params.seed, counter)
    i = int(np.searchsorted(np.cumsum(q), u, side="right"))  # first cumulative value > u
    return int(order[min(i, order.size - 1)])
