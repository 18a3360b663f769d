"""Mask samplers (iid, stratified, scrambled Sobol): every sampler is unbiased (the mean mask
estimates L* = exp(-|i-j|/sigma)), replays by seed, keeps each width Gamma(2, sigma)-distributed,
and the two that spread their draws lower the mean-mask error at the same s."""
import numpy as np
import pytest

from poslsh_cli.numerics.sampling import Sampler, sample_partitions

SAMPLERS = [s.value for s in Sampler]


def _mean_mask(p):
    n = p.seq_len
    m = np.zeros((n, n))
    for k in range(p.num_samples):
        b = p.bins_of(k)
        m += b[:, None] == b[None]
    return m / p.num_samples


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_every_sampler_is_unbiased_and_replays(sampler):
    """Mean over 400 draws of s=8 masks of the entries at lags 0..40 against exp(-lag/sigma):
    within 5 standard errors of the per-draw means (a stratified draw's entries are averages of
    8 dependent indicators; draws are independent of each other)."""
    n, sigma, s, trials = 64, 6.0, 8, 400
    lags = np.arange(0, 41)
    per = np.empty((trials, lags.size))
    for t in range(trials):
        m = _mean_mask(sample_partitions(n, sigma, s, np.random.default_rng(t), sampler))
        per[t] = [np.mean(np.diagonal(m, lag)) for lag in lags]
    mean, se = per.mean(0), per.std(0, ddof=1) / np.sqrt(trials)
    want = np.exp(-lags / sigma)
    assert np.all(np.abs(mean - want) <= 5 * se + 1e-12), np.max(np.abs(mean - want) / (se + 1e-12))
    a = sample_partitions(n, sigma, s, np.random.default_rng(5), sampler)
    b = sample_partitions(n, sigma, s, np.random.default_rng(5), sampler)
    assert np.array_equal(a.widths, b.widths) and np.array_equal(a.shifts, b.shifts)
    assert np.all((a.shifts >= 0) & (a.shifts < a.widths))


@pytest.mark.parametrize("sampler", ["stratified", "sobol"])
def test_spread_samplers_keep_the_width_law_and_lower_the_error(sampler):
    """Widths pooled over draws follow Gamma(2, sigma) (Kolmogorov-Smirnov, p > 0.001), and the
    mean spectral error of the mean mask at n=512, sigma=16, s=16 over 12 draws is below iid's."""
    from scipy import stats

    w = np.concatenate([sample_partitions(10, 3.0, 16, np.random.default_rng(t), sampler).widths for t in range(200)])
    assert stats.kstest(w, stats.gamma(a=2.0, scale=3.0).cdf).pvalue > 1e-3
    n, sigma, s = 512, 16.0, 16
    i = np.arange(n)
    L = np.exp(-np.abs(i[:, None] - i[None]) / sigma)

    def err(smp):
        return np.mean([np.linalg.norm(_mean_mask(sample_partitions(n, sigma, s, np.random.default_rng(100 + t), smp))
                                       - L, 2) for t in range(12)])

    assert err(sampler) < err("iid")
