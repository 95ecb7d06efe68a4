"""Sampling rules shared by every backend (docs/interfaces.md gives the same steps for the GPU).

Greedy picks the lowest index among equal maxima. Otherwise temperature, top-k, top-p, renormalise,
and one draw from a counter-based generator: uniform(seed, counter), counter being the position the
sampled token will occupy, so the same seed, prompt and parameters give the same tokens on every
backend and rank count, whether the context arrived in one piece or several.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

_M64 = (1 << 64) - 1

# The valid range of every sampling parameter: the protocol (kog_dist.protocol) checks requests
# against these at the edge and SamplingParams.validate() again, so a backend never sees anything else
# (docs/protocol.md has the same table).
MAX_TEMPERATURE = 1e6
MAX_TOP_K = 1 << 31
# Below this a temperature is greedy: logits / T overflows (5e-324 gives inf, then NaN), and long
# before that the draw is decided by float32 rounding of the logits, not by their order. Normalised
# here, in __post_init__, so every backend (numpy and the GPU kernel) gets temperature 0.
MIN_TEMPERATURE = 1e-6


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _is_num(x) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, (bool, np.bool_))


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self):
        t = self.temperature
        if _is_num(t) and 0 < t < MIN_TEMPERATURE:
            object.__setattr__(self, "temperature", 0.0)

    def validate(self) -> "SamplingParams":
        t, k, p, s = self.temperature, self.top_k, self.top_p, self.seed
        if not (_is_num(t) and math.isfinite(t) and 0 <= t <= MAX_TEMPERATURE):
            raise ValueError(f"temperature must be a number in [0, {MAX_TEMPERATURE:g}], got {t!r}")
        if not (_is_int(k) and 0 <= k <= MAX_TOP_K):
            raise ValueError(f"top_k must be an integer in [0, 2^31], got {k!r}")
        if not (_is_num(p) and math.isfinite(p) and 0.0 < p <= 1.0):
            raise ValueError(f"top_p must be a number in (0, 1], got {p!r}")
        if not (_is_int(s) and 0 <= s <= _M64):
            raise ValueError(f"seed must be an integer in [0, 2^64), got {s!r}")
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
    x = np.asarray(logits, dtype=np.float64)
    # subtract the maximum before dividing: (x - max) / T is <= 0 and at worst -inf, never inf - inf
    w = np.exp((x - x.max()) / p.temperature)
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


def draw(logits: np.ndarray, params: SamplingParams, counter: int) -> tuple[int, float]:
    """The sampled token and u's distance to the nearest end of its interval of the cumulative distribution
    (how far the logits could move before another token is drawn: tests of rank counts, bench/tp_draw_margin.py)."""
    order, q = filtered_distribution(logits, params)
    u = uniform(params.seed, counter)
    c = np.cumsum(q)
    k = min(int(np.searchsorted(c, u, side="right")), order.size - 1)  # first cumulative value > u
    return int(order[k]), float(min(u - (c[k - 1] if k else 0.0), c[k] - u))


def sample(logits: np.ndarray, params: SamplingParams, counter: int) -> int:
    if params.greedy:
        return argmax_lowest(logits)
    return draw(logits, params, counter)[0]
