"""Structured operators against float64 dense references; fast errors against dense errors."""
import numpy as np
import pytest

from poslsh_cli.numerics.metrics import (fit_loglog_slope, max_error_dense, max_error_fast, spectral_error_dense,
                                spectral_error_fast)
from poslsh_cli.numerics.operators import LaplacianKernel, MeanMask, laplacian_norm
from poslsh_cli.numerics.sampling import sample_partitions

CASES = [(2, 1.0, 1), (3, 0.2, 5), (9, 2.0, 3), (64, 0.7, 16), (300, 4.0, 8), (1000, 16.0, 32),
         (2048, 8.0, 64), (2048, 16.0, 4), (512, 1e4, 3)]


@pytest.mark.parametrize("n,sigma,s", CASES)
def test_structured_matvecs_equal_dense(n, sigma, s):
    g = np.random.default_rng(n + s)
    K, M = LaplacianKernel(n, sigma), MeanMask(sample_partitions(n, sigma, s, g))
    x = g.standard_normal(n)
    np.testing.assert_allclose(K.matvec(x), K.dense() @ x, rtol=0, atol=1e-12 * max(1.0, np.abs(x).sum()) / np.sqrt(n))
    np.testing.assert_allclose(M.matvec(x), M.dense() @ x, rtol=0, atol=1e-12)
    X = g.standard_normal((n, 3))
    np.testing.assert_allclose(M.matvec(X), M.dense() @ X, rtol=0, atol=1e-12)
    np.testing.assert_allclose(K.matvec(X), K.dense() @ X, rtol=0, atol=1e-11)


@pytest.mark.parametrize("n,sigma,s", [(1, 2.0, 3), (40, 3.0, 5), (80, 0.3, 1), (300, 16.0, 20), (257, 1e4, 4),
                                       (64, 0.01, 7)])
def test_mean_mask_dense_is_the_mean_of_indicator_matrices(n, sigma, s):
    """MeanMask.dense (built from the band of block remainders) against M~ built independently, pair
    by pair from the bins: (1/s) sum_k 1[bin_k(i) == bin_k(j)], exactly."""
    p = sample_partitions(n, sigma, s, np.random.default_rng(n))
    ref = np.zeros((n, n))
    for b in p.bins():
        for i in range(n):
            ref[i] += b == b[i]
    np.testing.assert_array_equal(MeanMask(p).dense(), ref / s)


@pytest.mark.parametrize("n,sigma", [(1, 3.0), (2, 1.0), (10, 2.0), (257, 0.5), (2048, 16.0), (1500, 300.0),
                                     (64, 0.01), (64, 0.03), (500, 0.035), (3, 1e-4)])
def test_kernel_norm_closed_form_equals_eigvalsh(n, sigma):
    ref = np.linalg.eigvalsh(LaplacianKernel(n, sigma).dense())[-1]
    assert laplacian_norm(n, sigma) == pytest.approx(ref, rel=1e-12)


@pytest.mark.parametrize("n,sigma,s", [c if c[0] < 2048 else pytest.param(*c, marks=pytest.mark.slow) for c in CASES])
def test_fast_errors_equal_dense(n, sigma, s):
    """Spectral: the dense float64 norm lies in the certified interval [value, bound], whose relative
    width is at most the default tolerance (1e-3). Max norm: bit-exact."""
    g = np.random.default_rng(100 + n)
    K, M = LaplacianKernel(n, sigma), MeanMask(sample_partitions(n, sigma, s, g))
    fast = spectral_error_fast(K, M, np.random.default_rng(1))
    dense, norm = spectral_error_dense(K, M)
    assert fast.converged and fast.bound <= fast.value * (1 + fast.tol) * (1 + 1e-12)
    assert fast.value <= dense * (1 + 1e-12) and dense <= fast.bound * (1 + 1e-12)
    assert K.norm() == pytest.approx(norm, rel=1e-10)
    assert max_error_fast(K, M) == max_error_dense(K, M)


@pytest.mark.slow
def test_certified_interval_holds_the_dense_norm_at_8192_with_one_sample():
    """Issue 21: s = 1 (the top of the spectrum of L* - M is a band of near-equal eigenvalues, one
    per block) at n = 8192 against LAPACK's float64 eigenvalues of the dense matrix, read as a band:
    the entries farther than 192 from the diagonal (L*'s, below exp(-48); M's, none) move no
    eigenvalue by more than their largest row sum (Weyl), asserted negligible."""
    from scipy.linalg import eig_banded

    n, sigma, b = 8192, 4.0, 192
    K, M = LaplacianKernel(n, sigma), MeanMask(sample_partitions(n, sigma, 1, np.random.default_rng(7)))
    fast = spectral_error_fast(K, M, np.random.default_rng(1))
    D = K.dense() - M.dense()
    dropped = float((np.abs(np.tril(D, -b - 1)).sum(1) + np.abs(np.triu(D, b + 1)).sum(1)).max())
    band = np.zeros((b + 1, n))
    for k in range(b + 1):
        band[k, :n - k] = np.diagonal(D, -k)  # LAPACK's lower band layout: band[k, j] = D[j + k, j]
    dense = float(np.max(np.abs(eig_banded(band, lower=True, eigvals_only=True))))
    assert dropped <= 1e-15 * dense
    assert fast.converged and fast.matvecs <= 500
    assert fast.value <= dense * (1 + 1e-12) <= fast.bound * (1 + 1e-12)


@pytest.mark.slow
@pytest.mark.parametrize("s,seed", [(1, 0), (2, 1)])
def test_certified_interval_holds_a_tighter_run_at_32768(s, seed):
    """Issue 21: n = 32768, sigma = 4, s = 1 and 2 (where restarted Lanczos crawled): the default run
    certifies its interval in at most 500 matvecs, and a run 100 times tighter from the same start
    vector (whose Krylov space contains the default one's, so its value can only be larger) lands
    inside it."""
    n, sigma = 32768, 4.0
    K, M = LaplacianKernel(n, sigma), MeanMask(sample_partitions(n, sigma, s, np.random.default_rng([s, seed])))
    fast = spectral_error_fast(K, M, np.random.default_rng([seed, 1]))
    tight = spectral_error_fast(K, M, np.random.default_rng([seed, 1]), tol=1e-5)
    assert fast.converged and fast.matvecs <= 500 and tight.converged
    assert fast.value <= tight.value * (1 + 1e-12) and tight.value <= fast.bound
    assert tight.bound <= fast.bound * (1 + 1e-12)


def test_the_certified_step_count_depends_on_n_only_through_a_logarithm():
    from poslsh_cli.numerics.metrics import lanczos_steps

    steps = [lanczos_steps(2**k, 1e-3, 1e-3) for k in (14, 16, 20, 24)]
    assert steps == sorted(steps) and steps[-1] <= 250 and steps[-1] / steps[0] < 1.35


def test_max_error_fast_is_chunk_independent(monkeypatch):
    import poslsh_cli.numerics.metrics as metrics

    p = sample_partitions(3000, 5.0, 7, np.random.default_rng(4))
    K, M = LaplacianKernel(3000, 5.0), MeanMask(p)
    full = metrics.max_error_fast(K, M)
    monkeypatch.setattr(metrics, "_MAX_CHUNK", 97)
    assert metrics.max_error_fast(K, M) == full == max_error_dense(K, M)


@pytest.mark.parametrize("root", [0, 1])
def test_spectral_error_decays_like_inverse_sqrt_s(root):
    """Theorem 2.1: ||L* - M~||_2 = O(1/sqrt(s)); the fitted log-log slope lies in [-0.6, -0.4]."""
    n, sigma = 2048, 8.0
    ss, errs = [], []
    for s in (4, 8, 16, 32, 64, 128, 256):
        for trial in range(3):
            g = np.random.default_rng([root, s, trial])
            K, M = LaplacianKernel(n, sigma), MeanMask(sample_partitions(n, sigma, s, g))
            ss.append(s)
            errs.append(spectral_error_fast(K, M, g).value)
    fit = fit_loglog_slope(np.array(ss), np.array(errs))
    assert -0.6 <= fit.slope <= -0.4, fit


def test_slope_fit_recovers_power_law():
    x = np.array([1, 2, 4, 8, 16.0])
    fit = fit_loglog_slope(x, 3.0 * x**-0.5)
    assert fit.slope == pytest.approx(-0.5, abs=1e-12)
    assert fit.intercept == pytest.approx(np.log(3.0), abs=1e-12)
    assert fit.ci_low <= fit.slope <= fit.ci_high


def test_threaded_mean_mask_product_equals_dense_and_works_in_a_forked_child():
    """At lengths where the gathers are split over threads the product still equals the mean of the
    indicator products, and a child forked after the pool started gets a pool of its own."""
    import os

    n, s = 1 << 17, 3
    parts = sample_partitions(n, 6.0, s, np.random.default_rng(5))
    M = MeanMask(parts)
    x = np.random.default_rng(6).standard_normal(n)
    ref = np.zeros(n)
    for o in parts.offsets:  # each sample's block sums broadcast back, independently of MeanMask
        ref += np.repeat(np.add.reduceat(x, o[:-1]), np.diff(o))
    got = M.matvec(x)
    np.testing.assert_allclose(got, ref / s, rtol=0, atol=1e-9)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        ok = np.array_equal(M.matvec(x), got)
        os.write(w, b"1" if ok else b"0")
        os._exit(0)
    os.close(w)
    _, status = os.waitpid(pid, 0)
    assert os.read(r, 1) == b"1" and status == 0


# ---------------------------------------------------------------------------------------------
# Theorem 2.1's explicit constants


def test_theorem_constants_match_their_formulas_and_limits():
    import math

    from poslsh_cli.numerics import theorem

    for sigma in (0.5, 2.0, 16.0, 256.0, 1e6):
        e = math.exp(1 / sigma)
        direct = 1 + sigma + (e + 1) / (e - 1)  # the formula as written: cancels for large sigma
        assert theorem.psi_sigma(sigma) == pytest.approx(direct, rel=1e-9 if sigma < 1e5 else 1e-6)
        # coth(y) = 1/y + y/3 - y^3/45 + ... at y = 1/(2 sigma): Psi = 1 + 3 sigma + 1/(6 sigma) - 1/(360 sigma^3) ...
        assert theorem.psi_sigma(sigma) == pytest.approx(1 + 3 * sigma + 1 / (6 * sigma), abs=1 / (300 * sigma ** 3) + 1e-9 * sigma)
    n, s, sigma = 4096, 64, 16.0
    r = math.log(n) / s
    assert theorem.expectation_bound(sigma, n, s) == pytest.approx(theorem.psi_sigma(sigma) * (math.sqrt(r) + r),
                                                                   rel=1e-15)
    # the bound falls with s and grows with n and sigma
    assert theorem.expectation_bound(sigma, n, 2 * s) < theorem.expectation_bound(sigma, n, s)
    assert theorem.expectation_bound(sigma, 2 * n, s) > theorem.expectation_bound(sigma, n, s)
    assert theorem.expectation_bound(2 * sigma, n, s) > theorem.expectation_bound(sigma, n, s)
    psi = theorem.psi_sigma(sigma)
    eps = 30.0
    assert theorem.tail_bound(sigma, n, s, eps) == pytest.approx(n * math.exp(-s * eps ** 2 / (4 * psi * (4 * psi + eps))))
    assert theorem.tail_bound(sigma, n, 10 ** 6, eps) < 1 < theorem.tail_bound(sigma, n, 1, eps)
    # s needed for eps, and it is the smallest s with sigma^2 ln n / s <= eps^2
    k = theorem.s_needed(sigma, n, 0.5)
    assert sigma ** 2 * math.log(n) / k <= 0.25 < sigma ** 2 * math.log(n) / (k - 1)
    with pytest.raises(ValueError):
        theorem.psi_sigma(0.0)
    with pytest.raises(ValueError):
        theorem.s_needed(sigma, n, 0.0)


@pytest.mark.parametrize("n,sigma", [(256, 2.0), pytest.param(512, 8.0, marks=pytest.mark.slow),
                                     pytest.param(300, 0.5, marks=pytest.mark.slow)])
def test_expectation_bound_holds_for_the_dense_error_over_many_draws(n, sigma):
    """The theorem, checked where it can be: the mean of the dense float64 error over 40 independent
    draws is below Psi_sigma (sqrt(ln n / s) + ln n / s) at every s. The bound is an upper bound on the
    expectation, so only a sampling fluctuation could break it; the measured mean stays well under
    (about 0.05 .. 0.3 of the bound at these sizes), far beyond 40-draw noise."""
    from poslsh_cli.numerics import theorem

    K = LaplacianKernel(n, sigma)
    for s in (1, 4, 16, 64):
        g = np.random.default_rng([n, s])
        errs = [spectral_error_dense(K, MeanMask(sample_partitions(n, sigma, s, g)))[0] for _ in range(40)]
        assert np.mean(errs) <= 0.5 * theorem.expectation_bound(sigma, n, s)


def test_evaluation_accuracy_metrics_equal_an_independent_count():
    """top-k accuracy, reciprocal rank and entropy of evaluate() against a plain NumPy recount from
    the same logits (a fixed random 'model'), per window and in total."""
    import types

    import torch

    from poslsh_cli.lm.evaluate import TOP_K, WINDOW_SUMS, evaluate

    V, L = 300, 40
    g = torch.Generator().manual_seed(0)
    table = torch.randn(V, V, generator=g, dtype=torch.float64) * 3

    class Fixed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))
            self.config = types.SimpleNamespace(vocab_size=V)

        def forward(self, input_ids, use_cache=False):
            return types.SimpleNamespace(logits=table[input_ids].float() + 0 * self.w)

    rng = np.random.default_rng(1)  # a chain that follows the table's favourite often enough for top-1 hits
    best = table.argmax(1).numpy()
    tokens = [int(rng.integers(V))]
    for _ in range(5 * L - 1):
        tokens.append(int(best[tokens[-1]]) if rng.random() < 0.3 else int(rng.integers(V)))
    tokens = np.asarray(tokens)
    state = types.SimpleNamespace(eval_key=None)
    ev = evaluate(Fixed(), state, tokens, L, batch=2)
    hits, rr, ent, nll, k = np.zeros(len(TOP_K)), 0.0, 0.0, 0.0, 0
    per_window = []
    for w in range(5):
        x = tokens[w * L:(w + 1) * L]
        logits = table[torch.as_tensor(x[:-1])].float().double().numpy()
        logp = logits - np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1, keepdims=True)) \
            - logits.max(1, keepdims=True)
        true = logp[np.arange(L - 1), x[1:]]
        rank = np.array([(row > t).sum() + 1 for row, t in zip(logp, true)])
        h = [(rank <= t).sum() for t in TOP_K]
        per_window.append([-true.sum(), L - 1, L - 1, *h, (1 / rank).sum(), -(np.exp(logp) * logp).sum()])
        hits += h
        rr += (1 / rank).sum()
        ent += -(np.exp(logp) * logp).sum()
        nll += -true.sum()
        k += L - 1
    assert ev.predicted == k and ev.hits == tuple(int(x) for x in hits)
    acc = ev.accuracy()
    assert acc["top1"] == hits[0] / k and acc["top100"] == hits[2] / k
    np.testing.assert_allclose([acc["mrr"], acc["entropy"], ev.nll], [rr / k, ent / k, nll], rtol=1e-12)
    assert ev.windows.shape == (5, len(WINDOW_SUMS))
    np.testing.assert_allclose(ev.windows, np.asarray(per_window), rtol=1e-12)
    assert 0 < acc["top1"] < acc["top10"] < acc["top100"] < 1


def test_an_accuracy_metric_is_declared_once_and_reaches_every_reader():
    """lm.evaluate.METRICS is the one list: train's results and metrics log (val_<name>),
    perplexity's results and the window sums all take their columns from it."""
    from poslsh_cli.experiments.perplexity import command as perplexity
    from poslsh_cli.experiments.train import stage
    from poslsh_cli.experiments.train import command as train
    from poslsh_cli.lm.evaluate import METRICS, WINDOW_SUMS

    names = [m.name for m in METRICS]
    assert names == ["top1", "top10", "top100", "mrr", "entropy"]
    assert [c for c in train.COLUMNS if c.startswith("val_") and c[4:] in names] == [f"val_{n}" for n in names]
    assert stage.METRICS[-len(names):] == [f"val_{n}" for n in names]
    assert perplexity.COLUMNS[-len(names):] == tuple(names)
    assert WINDOW_SUMS[3:] == tuple(m.total for m in METRICS)
