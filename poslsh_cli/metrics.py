"""Errors of the mean mask against the ALiBi kernel, and the decay-slope fit.

    spectral_err = ||L* - M~||_2,   spectral_rel = spectral_err / ||L*||_2
    max_err      = max_ij |L*_ij - M~_ij|

Theorem 2.1 of the paper bounds both by O(1/sqrt(s)) w.h.p.; :func:`fit_loglog_slope` measures
the exponent.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # scipy and the operators load on first use: the CLI starts without them
    from poslsh_cli.operators import LaplacianKernel, MeanMask

#: Default ARPACK tolerance for ``||L* - M~||_2``: the Ritz residual is below ``tol * |theta|``,
#: so theta is within a relative ``tol`` of an eigenvalue of ``L* - M~`` (in practice the value
#: is far more accurate: the eigenvalue error is quadratic in the residual).
LANCZOS_TOL = 1e-6
#: Krylov subspace size. The top of the spectrum of ``L* - M~`` can hold tight clusters of
#: localised modes at large n; a larger subspace pays more per restart but restarts far less.
LANCZOS_NCV = 48
_MAX_CHUNK = 1 << 17


@dataclass(frozen=True)
class SpectralResult:
    value: float  # the norm
    tol: float  # ARPACK relative tolerance met (the one asked for when converged)
    converged: bool
    matvecs: int


def spectral_error_fast(
    kernel: LaplacianKernel,
    mask: MeanMask,
    generator: np.random.Generator,
    tol: float = LANCZOS_TOL,
) -> SpectralResult:
    """``||L* - M~||_2`` by implicitly restarted Lanczos (ARPACK ``eigsh``) on matvecs only.

    ``E = L* - M~`` is symmetric and indefinite, so its norm is ``max(lambda_max, -lambda_min)``.
    The two ends are computed separately (``which='LA'`` and ``'SA'``): asking for the largest
    magnitude (``'LM'``) stalls when ``lambda_max ~ -lambda_min``. Each matvec is O(n + blocks).
    The start vector comes from ``generator``, so results are reproducible. If ARPACK does not
    meet ``tol`` within its restart budget, ``tol`` is relaxed to 1e-3 (then LOBPCG, a lower
    bound); ``tol`` in the result is the tolerance actually met and ``converged`` says whether
    it is the one asked for.
    """
    from scipy.sparse.linalg import LinearOperator

    n = kernel.seq_len
    count = [0]

    def mv(x: np.ndarray) -> np.ndarray:
        x = np.asarray(x, dtype=np.float64)
        count[0] += 1 if x.ndim == 1 else x.shape[1]
        return kernel.matvec(x) - mask.matvec(x)

    if n <= 16:  # ARPACK needs ncv < n; tiny problems are cheaper dense
        e = np.linalg.eigvalsh(kernel.dense() - mask.dense())
        return SpectralResult(float(np.max(np.abs(e))), 0.0, True, 0)
    op = LinearOperator((n, n), matvec=mv, matmat=mv, dtype=np.float64)
    v0 = generator.standard_normal(n)
    ends, met = [], []
    for which in ("LA", "SA"):
        value, achieved = _extreme(op, which, v0, tol)
        ends.append(value)
        met.append(achieved)
    achieved = max(met)
    return SpectralResult(max(abs(ends[0]), abs(ends[1])), achieved, achieved <= tol, count[0])


def lanczos_restarts(n: int) -> int:
    """ARPACK restarts allowed per attempt: about constant work, 2^23 / n, within [100, 2000].

    Spectra with huge degenerate clusters (s = 1 or 2 at large n: n / delta nearly identical
    blocks) stall the residual test long after the Ritz value has settled; past this budget the
    tolerance is relaxed 1000-fold and the one met is reported. A count, not a time, so results
    do not depend on the machine.
    """
    return int(min(2000, max(100, 2**23 // n)))


def _extreme(op: Any, which: str, v0: np.ndarray, tol: float) -> tuple[float, float]:
    """One end of the spectrum and the ARPACK tolerance it met (inf: LOBPCG lower bound)."""
    from scipy.sparse.linalg import ArpackNoConvergence, eigsh

    n = op.shape[0]
    for attempt_tol in (tol, max(tol, 1e-3)):
        try:
            vals = eigsh(op, k=1, which=which, tol=attempt_tol, v0=v0, ncv=min(n - 1, LANCZOS_NCV),
                         maxiter=lanczos_restarts(n), return_eigenvectors=False)
            return float(vals[0]), attempt_tol
        except ArpackNoConvergence:
            continue
    return _lobpcg_end(op, v0, which == "LA", tol), float("inf")


def _lobpcg_end(op: Any, v0: np.ndarray, largest: bool, tol: float) -> float:
    import warnings

    from scipy.sparse.linalg import lobpcg

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        x = np.column_stack([v0, np.roll(v0, 1), np.roll(v0, 2), np.roll(v0, 3)])
        w, _ = lobpcg(op, x, largest=largest, tol=tol, maxiter=500)
    return float(np.max(w) if largest else np.min(w))


def spectral_error_dense(kernel: LaplacianKernel, mask: MeanMask) -> tuple[float, float]:
    """Reference: ``(||L* - M~||_2, ||L*||_2)`` from full float64 eigendecompositions."""
    L = kernel.dense()
    err = float(np.max(np.abs(np.linalg.eigvalsh(L - mask.dense()))))
    return err, float(np.linalg.eigvalsh(L)[-1])


def max_error_fast(kernel: LaplacianKernel, mask: MeanMask) -> float:
    """``max_ij |L*_ij - M~_ij|`` exactly, in O(s n log s) time and O(s * chunk) memory.

    By symmetry only ``j = i + r``, r >= 0, is needed. With ``rem[k, i]`` the number of later
    positions in i's block of sample k, ``M~_{i,i+r} = #{k : rem[k,i] >= r} / s``: a step function
    of r that is constant between consecutive sorted ``rem`` values, while ``exp(-r/sigma)``
    decreases. The largest gap on each constant stretch is at one of its two ends, so the
    candidates are ``r = rho_(j-1) + 1`` and ``r = rho_(j)`` for the sorted values ``rho``, plus
    ``r = rho_(s) + 1`` (where M~ = 0: the band argument, nothing further out can be larger).
    Entries use the same float64 expressions as the dense reference, so the result is equal to it
    bit for bit.
    """
    n, s, sigma = kernel.seq_len, mask.num_samples, kernel.sigma
    best = 0.0
    for lo in range(0, n, _MAX_CHUNK):
        rows = slice(lo, min(n, lo + _MAX_CHUNK))
        rho = np.sort(mask.remaining(rows), axis=0)  # (s, m) ascending
        limit = (n - 1) - np.arange(n)[rows]  # largest valid r per row, (m,)
        prev = np.vstack([np.full((1, rho.shape[1]), -1, dtype=np.int64), rho])  # (s+1, m)
        for j in range(s + 1):
            # on r in (prev[j], rho[j]] the count of k with rem >= r is s - j
            r_lo = prev[j] + 1
            r_hi = rho[j] if j < s else r_lo  # j == s: the stretch beyond every block
            valid = (r_lo <= r_hi) & (r_lo <= limit)
            if not np.any(valid):
                continue
            c = (s - j) / s
            for r in (r_lo, r_hi):
                v = valid & (r <= limit)
                if np.any(v):
                    e = np.abs(np.exp(-(r[v].astype(np.float64)) / sigma) - c)
                    best = max(best, float(np.max(e)))
    return best


def max_error_dense(kernel: LaplacianKernel, mask: MeanMask) -> float:
    """Reference ``max_ij |L*_ij - M~_ij|`` from the dense matrices."""
    return float(np.max(np.abs(kernel.dense() - mask.dense())))


@dataclass(frozen=True)
class SlopeFit:
    slope: float
    intercept: float
    stderr: float
    ci_low: float
    ci_high: float
    points: int


def fit_loglog_slope(x: np.ndarray, y: np.ndarray, level: float = 0.95) -> SlopeFit:
    """Least-squares fit of ``log y = slope * log x + intercept`` with a t-interval on the slope.

    Fit on every (x, y) pair (all trials), so the interval reflects trial-to-trial spread.
    """
    from scipy import stats

    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    ok = (x > 0) & (y > 0) & np.isfinite(y)
    x, y = np.log(x[ok]), np.log(y[ok])
    if x.size < 2 or np.ptp(x) == 0:
        return SlopeFit(math.nan, math.nan, math.nan, math.nan, math.nan, int(x.size))
    res = stats.linregress(x, y)
    if x.size > 2:
        t = stats.t.ppf(0.5 + level / 2, df=x.size - 2)
        half = t * res.stderr
    else:
        half = math.nan
    return SlopeFit(float(res.slope), float(res.intercept), float(res.stderr),
                    float(res.slope - half), float(res.slope + half), int(x.size))


def output_errors(exact, approx) -> tuple[np.ndarray, np.ndarray]:
    """Per head: ``||T* - T~||_F / ||T*||_F`` and ``max_i ||T*_i - T~_i|| / ||T*_i||``.

    ``exact`` and ``approx`` are (heads, n, head_dim) tensors; computed in float64.
    """
    e, a = exact.double(), approx.double()
    diff = e - a
    rel_fro = diff.flatten(1).norm(dim=1) / e.flatten(1).norm(dim=1)
    row = diff.norm(dim=-1) / e.norm(dim=-1).clamp_min(np.finfo(np.float64).tiny)
    return rel_fro.cpu().numpy(), row.max(dim=-1).values.cpu().numpy()
