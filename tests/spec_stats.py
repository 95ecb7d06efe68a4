"""The statistics of issue 33's sampled check, shared by the CPU and GPU tests: the exact distribution of the
first few tokens a sampler draws after a context (from plain forwards of the numpy engine, the filter of
kog_dist.sampling), and Pearson's chi-square of drawn counts against it, with a bound that a correct sampler
exceeds with probability about 1e-4. The seeds are fixed, so a test built on it gives the same verdict every
run; whether it can fail is checked by the same counts against a distribution a little off (another
temperature), which must exceed the bound."""
from __future__ import annotations

import dataclasses
import math
from collections import Counter

from kog_dist.backend import RunCommand
from kog_dist.sampling import SamplingParams, filtered_distribution

Z_1E4 = 3.719              # the standard normal's upper 1e-4 quantile


def exact_sequences(engine, context, params, depth: int) -> dict[tuple, float]:
    """P(first `depth` tokens = s | context) for every s the filter allows: a tree of plain forwards on a
    ReferenceEngine (its cache is left holding `context`)."""
    engine.truncate(0)
    root = engine.prefill(list(context))
    base = engine.pos
    out: dict[tuple, float] = {}

    def walk(logits, prefix, prob):
        order, q = filtered_distribution(logits, params)
        for t, p in zip(order.tolist(), q.tolist()):
            seq = prefix + (int(t),)
            if len(seq) == depth:
                out[seq] = out.get(seq, 0.0) + prob * p
            else:
                engine.truncate(base + len(prefix))
                walk(engine.step(int(t)), seq, prob * p)

    walk(root, (), 1.0)
    engine.truncate(base)
    return out


def chi_square(samples, probs: dict[tuple, float], min_expected: float = 5.0) -> tuple[float, int]:
    """Pearson's statistic of the samples (tuples) against probs, sequences expected fewer than
    min_expected times pooled into one cell; (statistic, degrees of freedom)."""
    n = len(samples)
    counts = Counter(samples)
    cells, pool_obs, pool_exp = [], 0, 0.0
    for seq, p in probs.items():
        if n * p >= min_expected:
            cells.append((counts.get(seq, 0), n * p))
        else:
            pool_obs, pool_exp = pool_obs + counts.get(seq, 0), pool_exp + n * p
    pool_obs += sum(c for s, c in counts.items() if s not in probs)   # drawn but impossible: counted
    if pool_exp > 0 or pool_obs:
        cells.append((pool_obs, max(pool_exp, 1e-12)))
    stat = sum((o - e) ** 2 / e for o, e in cells)
    return stat, max(1, len(cells) - 1)


def chi_square_bound(df: int, z: float = Z_1E4) -> float:
    """The chi-square quantile at the normal quantile z (Wilson-Hilferty; within 1% for df >= 3)."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * math.sqrt(a)) ** 3


def assert_follows(samples, probs, what: str) -> None:
    stat, df = chi_square(samples, probs)
    bound = chi_square_bound(df)
    assert stat <= bound, f"{what}: chi-square {stat:.1f} over {df} df exceeds {bound:.1f} (p < 1e-4)"
    assert df >= 5, f"{what}: only {df + 1} cells: too few samples or too flat a distribution for a test"


def assert_departs(samples, probs, what: str) -> None:
    stat, df = chi_square(samples, probs)
    assert stat > chi_square_bound(df), f"{what}: the test cannot tell a wrong distribution ({stat:.1f}, {df} df)"



def draws_after_echo(b, prompt, params: SamplingParams, n: int, k: int = 8):
    """The first three tokens a backend samples after prompt + what it says after the prompt (12 greedy tokens)
    + the prompt again (the lookups then draft what followed the prompt): with speculation (up to k drafts) on
    seeds 0..n-1 and without on seeds n..2n-1, from one cached context in slot 1. Returns (context, speculative
    samples, plain samples, drafted, accepted)."""
    said = b.run(RunCommand(slot=0, append=prompt, max_new_tokens=12), ignore_eos=True).token_ids
    ctx = list(prompt) + said + list(prompt)
    b.run(RunCommand(slot=1, append=ctx, max_new_tokens=0))

    def draws(seeds, k):
        out, drafted, accepted = [], 0, 0
        for s in seeds:
            r = b.run(RunCommand(slot=1, keep=len(ctx) - 1, append=ctx[-1:], max_new_tokens=3, speculative=k,
                                 sampling=dataclasses.replace(params, seed=s)), ignore_eos=True)
            out.append(tuple(r.token_ids))
            drafted, accepted = drafted + r.spec_drafted, accepted + r.spec_accepted
        return out, drafted, accepted

    spec, drafted, accepted = draws(range(n), k)
    plain, _, _ = draws(range(n, 2 * n), 0)
    return ctx, spec, plain, drafted, accepted


def assert_sampler_follows(engine, ctx, params: SamplingParams, spec, plain, drafted: int, accepted: int) -> None:
    """Drafts were accepted and rejected; both samples follow the exact distribution after ctx (engine: a
    ReferenceEngine of the model); the speculative one departs from 1.15 times the temperature's."""
    probs = exact_sequences(engine, ctx, params, 3)
    assert 0 < accepted < drafted, (accepted, drafted)
    assert_follows(spec, probs, "speculative")
    assert_follows(plain, probs, "plain")
    off = dataclasses.replace(params, temperature=params.temperature * 1.15)
    assert_departs(spec, exact_sequences(engine, ctx, off, 3), "T x 1.15")
