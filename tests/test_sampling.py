"""Positional LSH sampling: partitions are exact, and E[M(h)] = L* statistically."""
import math

import numpy as np
import pytest

from poslsh_cli.numerics.operators import LaplacianKernel, MeanMask
from poslsh_cli.numerics.sampling import (standard_alibi_slopes, block_length_pmf, derive_seed, sample_partitions,
                                 width_max_cdf, width_max_quantile)


@pytest.mark.parametrize("n,sigma", [(2, 0.5), (37, 0.3), (500, 4.0), (1000, 64.0), (50, 1e4)])
def test_partitions_are_contiguous_and_follow_width_and_shift(n, sigma, rng):
    p = sample_partitions(n, sigma, 20, rng)
    bins = p.bins()
    assert bins.shape == (20, n)
    for k in range(20):
        delta, u = p.widths[k], p.shifts[k]
        assert 0 <= u < delta
        expected = np.floor((np.arange(n) + u) / delta).astype(np.int64)
        np.testing.assert_array_equal(bins[k], expected - expected[0])
        assert bins[k][0] == 0
        assert np.all(np.diff(bins[k]) >= 0)  # contiguous: ids never go back
        off = p.offsets[k]
        assert off[0] == 0 and off[-1] == n and np.all(np.diff(off) > 0)
        lengths = np.diff(off)
        # every position lies in exactly one block, and block ids change exactly at offsets
        assert lengths.sum() == n
        assert np.all(bins[k][off[1:-1]] != bins[k][off[1:-1] - 1])
        # interior blocks hold floor(delta) or ceil(delta) positions (1 when delta < 1)
        inner = lengths[1:-1]
        if inner.size:
            lo, hi = max(1, math.floor(delta)), max(1, math.ceil(delta))
            assert np.all((inner == lo) | (inner == hi)), (delta, np.unique(inner))
        assert np.all(lengths <= max(1, math.ceil(delta)))


def test_sampling_is_reproducible_and_seeded_explicitly():
    a = sample_partitions(100, 3.0, 8, np.random.default_rng(7))
    b = sample_partitions(100, 3.0, 8, np.random.default_rng(7))
    c = sample_partitions(100, 3.0, 8, np.random.default_rng(8))
    np.testing.assert_array_equal(a.bins(), b.bins())
    assert not np.array_equal(a.widths, c.widths)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("sigma", [1.5, 6.0])
def test_mean_mask_is_unbiased_for_laplacian_kernel(seed, sigma):
    """E[M(h)] = L*: every entry of the mean of s masks is Binomial(s, L*_ij) / s.

    Exact binomial tails per entry (the normal approximation fails where L* is tiny), with a
    Bonferroni correction over the n(n-1)/2 distinct off-diagonal entries: the test fails by
    chance with probability < 1e-3.
    """
    from scipy.stats import binom

    n, s = 48, 20000
    p = sample_partitions(n, sigma, s, np.random.default_rng(seed))
    mean = MeanMask(p).dense()
    L = LaplacianKernel(n, sigma).dense()
    iu = np.triu_indices(n, 1)
    counts = np.rint(mean[iu] * s)
    prob = L[iu]
    tail = np.minimum(binom.sf(counts - 1, s, prob), binom.cdf(counts, s, prob))
    assert (2 * tail).min() * len(prob) > 1e-3
    sd = np.sqrt(L * (1 - L) / s)
    # no systematic bias: the mean residual per diagonal is far inside its standard error
    # (entries on one diagonal are positively correlated, so bound by the entrywise sd)
    for r in range(0, n, 7):
        resid = np.diagonal(mean - L, r)
        assert abs(resid.mean()) < 5.5 * np.diagonal(sd, r).max() + 1e-15
    np.testing.assert_array_equal(np.diag(mean), 1.0)  # every position shares a block with itself


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_largest_width_follows_exact_law(seed):
    """Kolmogorov-Smirnov distance of the sampler's max_k delta_k against (1 - e^{-t/s}(1+t/s))^s.

    The widths come from :func:`sample_partitions` itself (an exponential or a Gamma(1) sampler
    fails this at these sizes)."""
    sigma, s, reps = 5.0, 16, 3000
    g = np.random.default_rng(seed)
    maxima = np.array([sample_partitions(64, sigma, s, g).widths.max() for _ in range(reps)])
    x = np.sort(maxima)
    cdf = width_max_cdf(x, sigma, s)
    ecdf_hi = np.arange(1, reps + 1) / reps
    ecdf_lo = np.arange(0, reps) / reps
    ks = max(np.max(ecdf_hi - cdf), np.max(cdf - ecdf_lo))
    assert ks < 1.95 / math.sqrt(reps)  # alpha = 0.001
    med = width_max_quantile(0.5, sigma, s)
    assert width_max_cdf(med, sigma, s) == pytest.approx(0.5, abs=1e-9)


@pytest.mark.parametrize("n,sigma,s,seed", [(16384, 4.0, 8, 0), (4096, 16.0, 10, 1),
                                               pytest.param(65536, 1.0, 12, 2, marks=pytest.mark.slow)])
def test_largest_block_follows_its_law(n, sigma, s, seed):
    """The realised largest block (positions, the b_max of block-stats) against
    P(b_max <= L) = (1 - e^{-L/s}(1 + L/s))^s at every integer L: the DKW bound at alpha = 0.001."""
    from poslsh_cli.numerics.sampling import block_max_cdf, block_max_quantile

    reps = 2000
    g = np.random.default_rng(seed)
    b = np.array([sample_partitions(n, sigma, s, g).b_max for _ in range(reps)])
    L = np.arange(1, b.max() + 1)
    emp = np.searchsorted(np.sort(b), L, side="right") / reps
    assert np.abs(emp - block_max_cdf(L, sigma, s)).max() < math.sqrt(math.log(2 / 1e-3) / (2 * reps))
    q = block_max_quantile(0.5, sigma, s)
    assert block_max_cdf(q, sigma, s) >= 0.5 > block_max_cdf(q - 1, sigma, s)


def test_offsets_equal_the_bin_array_boundaries(rng):
    """Offsets come from the bin edges in O(n / delta); they equal the boundaries of bins_of."""
    from poslsh_cli.numerics.sampling import Partitions

    cases = [sample_partitions(int(rng.integers(1, 3000)), float(10 ** rng.uniform(-2, 3.5)), 3, rng) for _ in range(400)]
    cases += [Partitions(997, 1.0, np.array([w]), np.array([u])) for w in (1.0, 2.0, 3.0, 0.5, 1 / 3, 7.0, 2.5)
              for u in (0.0, 0.5 * w, np.nextafter(w, 0))]
    for p in cases:
        for k in range(p.num_samples):
            b = p.bins_of(k)
            ref = np.concatenate(([0], np.flatnonzero(np.diff(b)) + 1, [p.seq_len]))
            np.testing.assert_array_equal(p.offsets[k], ref)


def test_all_samples_at_once_equal_one_sample_at_a_time(rng):
    """Where s n is small the boundaries of every sample come from one (s, n) bin array; they equal
    the O(n / delta) walk of each sample, and ``lengths`` is every block length in sample order."""
    from poslsh_cli.numerics.sampling import VECTOR_ELEMENTS, _block_starts

    for _ in range(150):
        n, s = int(rng.integers(1, 3000)), int(rng.integers(2, 120))
        p = sample_partitions(n, float(10 ** rng.uniform(-2, 3.5)), s, rng)
        assert s * n <= VECTOR_ELEMENTS
        walked = [_block_starts(n, float(w), float(u)) for w, u in zip(p.widths, p.shifts)]
        assert len(p.offsets) == s
        for got, ref in zip(p.offsets, walked):
            np.testing.assert_array_equal(got, ref)
        np.testing.assert_array_equal(p.lengths, np.concatenate([np.diff(o) for o in walked]))
        assert p.lengths.sum() == s * n and p.b_max == max(int(np.diff(o).max()) for o in walked)


def test_block_length_pmf_matches_realised_blocks():
    sigma, n, s = 2.0, 2048, 20000
    p = sample_partitions(n, sigma, s, np.random.default_rng(3))
    lengths = np.concatenate([np.diff(o)[1:-1] for o in p.offsets])  # interior blocks
    top = 20
    emp = np.bincount(lengths, minlength=top + 1)[1:top + 1] / lengths.size
    pmf = block_length_pmf(np.arange(1, top + 1), sigma)
    assert block_length_pmf(np.arange(1, 400), sigma).sum() == pytest.approx(1.0, abs=1e-6)
    assert 0.5 * np.abs(emp - pmf).sum() < 0.03


def test_alibi_slopes_standard():
    np.testing.assert_allclose(standard_alibi_slopes(8), 2.0 ** -np.arange(1, 9))
    s12 = standard_alibi_slopes(12)
    np.testing.assert_allclose(s12[:8], 2.0 ** -np.arange(1, 9))
    np.testing.assert_allclose(s12[8:], 2.0 ** -(np.arange(1, 8, 2) / 2))
    assert standard_alibi_slopes(1)[0] == pytest.approx(2.0 ** -8)


def test_derive_seed_is_stable_and_parameter_sensitive():
    a = derive_seed(0, "matrix-error", 1024, 4.0, 8, 0)
    assert a == derive_seed(0, "matrix-error", 1024, 4.0, 8, 0)
    assert 0 <= a < 2**31
    assert len({derive_seed(0, "x", t) for t in range(100)}) == 100
    assert derive_seed(1, "x", 0) != derive_seed(0, "x", 0)


@pytest.mark.parametrize("bad", [dict(seq_len=0, sigma=1.0, num_samples=1), dict(seq_len=4, sigma=0.0, num_samples=1),
                                 dict(seq_len=4, sigma=1.0, num_samples=0)])
def test_sampling_rejects_bad_arguments(bad, rng):
    with pytest.raises(ValueError):
        sample_partitions(generator=rng, **bad)
