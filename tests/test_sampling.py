"""Sampling as the spec says: greedy ties, seeds, top-k, top-p and temperature, checked statistically."""
import numpy as np
import pytest

from kog_dist.backend import RunCommand
from kog_dist.sampling import (MAX_TEMPERATURE, MIN_TEMPERATURE, SamplingParams, filtered_distribution, sample,
                               splitmix64, uniform)


def test_splitmix64_known_values():
    # First outputs of the reference splitmix64 stream seeded with 0 (Vigna's published generator).
    assert splitmix64(0) == 0xE220A8397B1DCDAF
    assert splitmix64(0x9E3779B97F4A7C15) == 0x6E789E6AA1B965F4


def test_uniform_in_range_and_spread():
    u = np.array([uniform(7, c) for c in range(20000)])
    assert u.min() >= 0 and u.max() < 1
    assert abs(u.mean() - 0.5) < 0.01
    assert np.histogram(u, bins=10)[0].min() > 1800


def test_greedy_lowest_index_among_ties():
    logits = np.array([0.0, 3.0, 1.0, 3.0])
    assert sample(logits, SamplingParams(), 0) == 1
    assert sample(logits, SamplingParams(temperature=1.0, top_k=1, seed=3), 0) == 1


def test_top_k_1_equals_greedy_on_random_logits():
    rng = np.random.default_rng(1)
    for c in range(50):
        lg = rng.standard_normal(100)
        assert sample(lg, SamplingParams(temperature=0.7, top_k=1, seed=c), c) == int(np.argmax(lg))


def test_same_seed_same_ids_other_seed_other_ids():
    lg = np.random.default_rng(2).standard_normal(50)
    p = SamplingParams(temperature=1.0, seed=11)
    a = [sample(lg, p, c) for c in range(64)]
    assert a == [sample(lg, p, c) for c in range(64)]
    assert a != [sample(lg, SamplingParams(temperature=1.0, seed=12), c) for c in range(64)]


def draws(lg, p, n=20000):
    return np.bincount([sample(lg, p, c) for c in range(n)], minlength=lg.size) / n


def test_temperature_distribution_matches_softmax():
    lg = np.array([2.0, 1.0, 0.5, 0.0, -1.0])
    for t in (0.5, 1.0, 2.0):
        want = np.exp(lg / t) / np.exp(lg / t).sum()
        got = draws(lg, SamplingParams(temperature=t, seed=4))
        assert np.abs(got - want).max() < 0.015, (t, got, want)


def test_top_k_keeps_k_and_renormalises():
    lg = np.array([3.0, 2.0, 1.0, 0.0, -1.0])
    got = draws(lg, SamplingParams(temperature=1.0, top_k=2, seed=5))
    w = np.exp(lg[:2])
    assert got[2:].sum() == 0
    assert np.abs(got[:2] - w / w.sum()).max() < 0.015


def test_top_p_keeps_the_shortest_prefix_reaching_p():
    probs = np.array([0.5, 0.3, 0.15, 0.05])
    lg = np.log(probs)
    order, q = filtered_distribution(lg, SamplingParams(temperature=1.0, top_p=0.79))
    assert list(order) == [0, 1]                       # 0.5 + 0.3 reaches 0.79
    np.testing.assert_allclose(q, [0.625, 0.375])
    order, _ = filtered_distribution(lg, SamplingParams(temperature=1.0, top_p=0.81))
    assert list(order) == [0, 1, 2]
    got = draws(lg, SamplingParams(temperature=1.0, top_p=0.79, seed=6))
    assert got[2:].sum() == 0 and abs(got[0] - 0.625) < 0.015


def test_ties_in_probability_order_by_lower_index():
    order, _ = filtered_distribution(np.array([1.0, 2.0, 2.0, 1.0]), SamplingParams(temperature=1.0))
    assert list(order) == [1, 2, 0, 3]


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-2),
                                 dict(seed=-1), dict(temperature=float("nan")), dict(temperature=float("inf")),
                                 dict(temperature=MAX_TEMPERATURE * 2), dict(temperature="1"), dict(top_k=True),
                                 dict(top_k=(1 << 31) + 1), dict(top_k=2.0), dict(top_p=float("nan")), dict(top_p="1"),
                                 dict(seed=1 << 64), dict(seed=1.0)])
def test_bad_params_refused(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad).validate()


@pytest.mark.parametrize("t", [5e-324, 1e-310, 1e-300, 1e-30, MIN_TEMPERATURE / 2])
def test_tiny_temperature_is_greedy(t):
    """logits / 5e-324 overflows to inf (then inf - inf = NaN); such temperatures are normalised to
    greedy when the params are made, so every backend (and the wire form the ranks get) sees 0."""
    rng = np.random.default_rng(8)
    p = SamplingParams(temperature=t, seed=9).validate()
    assert p.temperature == 0.0 and p.greedy
    assert RunCommand.from_wire(RunCommand(sampling=SamplingParams(temperature=t)).to_wire()).sampling.greedy
    for c in range(20):
        lg = rng.standard_normal(300).astype(np.float32) * 30
        lg[5] = lg.max()                              # a tie: greedy takes the lower index
        assert sample(lg, p, c) == int(np.argmax(lg))


def test_small_temperature_above_the_floor_is_finite_and_near_greedy():
    # just above the floor the draw is computed, never NaN, and picks the maximum of well-separated logits
    lg = np.array([1e4, -1e4, 9999.0, 3.0])
    p = SamplingParams(temperature=MIN_TEMPERATURE * 2, seed=1).validate()
    assert p.temperature > 0 and not p.greedy
    order, q = filtered_distribution(lg, p)
    assert np.isfinite(q).all() and order[0] == 0 and q[0] == 1.0
    assert all(sample(lg, p, c) == 0 for c in range(50))
    # the largest temperature: nearly uniform, still a distribution
    order, q = filtered_distribution(lg, SamplingParams(temperature=MAX_TEMPERATURE))
    assert np.isfinite(q).all() and abs(q.sum() - 1) < 1e-12 and q.min() > 0.2
