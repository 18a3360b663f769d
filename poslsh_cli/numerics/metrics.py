"""Errors of the mean mask against the ALiBi kernel, and the decay-slope fit.

    spectral_err = ||L* - M~||_2,   spectral_rel = spectral_err / ||L*||_2
    max_err      = max_ij |L*_ij - M~_ij|

Theorem 2.1 of the paper bounds both by O(1/sqrt(s)) w.h.p.; :func:`fit_loglog_slope` measures
the exponent. The spectral norm comes with a certified interval (:func:`spectral_error_fast`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # scipy and the operators load on first use: the CLI starts without them
    from poslsh_cli.numerics.operators import LaplacianKernel, MeanMask

#: Default relative width of the certified interval for ``||L* - M~||_2``: the reported value (a
#: lower bound) and the certified upper bound are at most this far apart, relatively.
LANCZOS_TOL = 1e-3
#: Default failure probability of the upper bound (over the random start vector).
LANCZOS_DELTA = 1e-3
#: Bytes the Lanczos basis may take for full reorthogonalisation (smaller problems keep it).
REORTH_BYTES = 256 * 2**20
#: Rows of the max-norm computation held at once.
_MAX_CHUNK = 1 << 17


@dataclass(frozen=True)
class SpectralResult:
    value: float  # the norm: sqrt of the largest Ritz value of E^2, a lower bound of ||E||_2
    bound: float  # certified upper bound of ||E||_2, with probability >= 1 - delta
    tol: float  # relative width asked for: (bound - value) / value <= tol
    delta: float  # failure probability of the bound
    converged: bool  # the interval is within tol
    matvecs: int  # products with E = L* - M~


def lanczos_steps(n: int, tol: float, delta: float) -> int:
    """Lanczos steps on the positive semidefinite ``E^2`` that certify ``||E||_2`` to relative ``tol``
    with failure probability ``delta``, for any spectrum (Kuczyński & Woźniakowski 1992): after k
    steps from a start vector uniform on the sphere, ``P(theta_k < (1 - eps) lambda_1) <=
    1.648 sqrt(n) exp(-sqrt(eps) (2k - 1))``. The interval ``[sqrt(theta), sqrt(theta / (1 - eps))]``
    has relative width ``tol`` when ``eps = 1 - 1/(1 + tol)^2``. The count grows like
    ``log(sqrt(n)/delta) / sqrt(tol)``: 142 steps at n = 2^15 and 177 at n = 2^24 for tol = delta =
    1e-3 (284 and 354 products with E: two per step on E^2), whatever s and
    however clustered the top of the spectrum is."""
    eps = 1.0 - 1.0 / (1.0 + tol) ** 2
    return int(math.ceil((math.log(1.648 * math.sqrt(n) / delta) / math.sqrt(eps) + 1) / 2))


def certified_bound(theta: float, steps: int, n: int, delta: float) -> float:
    """Upper bound of ``sqrt(lambda_max)`` from the largest Ritz value ``theta`` of ``steps`` Lanczos
    steps on a positive semidefinite n x n matrix, valid with probability >= 1 - delta."""
    eps = (math.log(1.648 * math.sqrt(n) / delta) / (2 * steps - 1)) ** 2
    return math.sqrt(theta / (1.0 - eps)) if eps < 1 else math.inf


def spectral_error_fast(
    kernel: LaplacianKernel,
    mask: MeanMask,
    generator: np.random.Generator,
    tol: float = LANCZOS_TOL,
    delta: float = LANCZOS_DELTA,
) -> SpectralResult:
    """``||L* - M~||_2`` with a certified interval, from matvecs only (O(n) memory beyond the
    operators; docs/THEORY.md, "Certified spectral norm").

    ``E = L* - M~`` is symmetric and indefinite; ``||E||_2^2`` is the largest eigenvalue of the
    positive semidefinite ``E^2``. Lanczos on ``E^2`` (two O(n + blocks) matvecs per step) from a
    random start: the largest Ritz value ``theta`` is a Rayleigh quotient, so ``sqrt(theta) <=
    ||E||_2`` always, and after :func:`lanczos_steps` steps ``||E||_2 <= sqrt(theta / (1 - eps))``
    with probability at least 1 - delta, however clustered the top of the spectrum is (the number
    of steps depends on n, tol and delta only). Small problems keep the basis and
    reorthogonalise fully (closer to exact arithmetic; when the Krylov space is exhausted the value
    is exact); large ones use the three-term recurrence, whose largest Ritz value still converges
    (Paige). Tiny problems are solved densely.
    """
    from scipy.linalg import eigh_tridiagonal
    from scipy.linalg.blas import daxpy as axpy

    n = kernel.seq_len
    count = [0]

    def apply(x: np.ndarray) -> np.ndarray:
        count[0] += 2
        y = kernel.matvec(x)
        y -= mask.matvec(x)
        z = kernel.matvec(y)
        z -= mask.matvec(y)
        return z

    if n <= 64:  # exact and cheap
        e = np.linalg.eigvalsh(kernel.dense() - mask.dense())
        v = float(np.max(np.abs(e)))
        return SpectralResult(v, v, tol, delta, True, 0)
    steps = min(lanczos_steps(n, tol, delta), n)
    keep = n * steps * 8 <= REORTH_BYTES
    basis = np.empty((steps, n)) if keep else None
    v = generator.standard_normal(n)
    v /= np.linalg.norm(v)
    prev = np.zeros(n)
    alphas, betas = [], []
    beta = 0.0
    exhausted = False
    for j in range(steps):  # the three-term recurrence, in place (no full-length temporaries)
        if basis is not None:
            basis[j] = v
        w = apply(v)
        axpy(prev, w, a=-beta)
        alpha = float(v @ w)
        axpy(v, w, a=-alpha)
        if basis is not None:  # full reorthogonalisation, twice (Kahan: twice is enough)
            for _ in range(2):
                w -= basis[: j + 1].T @ (basis[: j + 1] @ w)
        alphas.append(alpha)
        beta = float(np.linalg.norm(w))
        if j + 1 == steps:
            break
        if beta <= 1e-13 * max(abs(a) for a in alphas):  # an invariant subspace: its top is exact
            exhausted = True
            break
        betas.append(beta)
        w *= 1.0 / beta
        prev, v = v, w
    k = len(alphas)
    theta = float(eigh_tridiagonal(np.asarray(alphas), np.asarray(betas), eigvals_only=True,
                                   select="i", select_range=(k - 1, k - 1))[0]) if k > 1 else alphas[0]
    theta = max(theta, 0.0)
    value = math.sqrt(theta)
    bound = value if exhausted or (basis is not None and k == n) else certified_bound(theta, k, n, delta)
    return SpectralResult(value, bound, tol, delta, bound <= value * (1 + tol) * (1 + 1e-12), count[0])


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


def fit_line(x: np.ndarray, y: np.ndarray, level: float = 0.95) -> SlopeFit:
    """Least-squares fit of ``y = slope * x + intercept`` with a t-interval on the slope (NaN
    interval with fewer than three points; NaN slope with fewer than two distinct x)."""
    from scipy import stats

    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    if x.size < 2 or np.ptp(x) == 0:
        return SlopeFit(math.nan, math.nan, math.nan, math.nan, math.nan, int(x.size))
    res = stats.linregress(x, y)
    half = stats.t.ppf(0.5 + level / 2, df=x.size - 2) * res.stderr if x.size > 2 else math.nan
    return SlopeFit(float(res.slope), float(res.intercept), float(res.stderr),
                    float(res.slope - half), float(res.slope + half), int(x.size))


def fit_loglog_slope(x: np.ndarray, y: np.ndarray, level: float = 0.95) -> SlopeFit:
    """Least-squares fit of ``log y = slope * log x + intercept`` with a t-interval on the slope.

    Fit on every (x, y) pair (all trials), so the interval reflects trial-to-trial spread.
    """
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    ok = (x > 0) & (y > 0) & np.isfinite(y)
    return fit_line(np.log(x[ok]), np.log(y[ok]), level)


def output_errors(exact, approx) -> tuple[np.ndarray, np.ndarray]:
    """Per head: ``||T* - T~||_F / ||T*||_F`` and ``max_i ||T*_i - T~_i|| / ||T*_i||``.

    ``exact`` and ``approx`` are (heads, n, head_dim) tensors; computed in float64.
    """
    e, a = exact.double(), approx.double()
    diff = e - a
    rel_fro = diff.flatten(1).norm(dim=1) / e.flatten(1).norm(dim=1)
    row = diff.norm(dim=-1) / e.norm(dim=-1).clamp_min(np.finfo(np.float64).tiny)
    return rel_fro.cpu().numpy(), row.max(dim=-1).values.cpu().numpy()


def paper_output_metrics(exact, approx) -> dict[str, np.ndarray]:
    """Per head, the output metrics of the paper's validation script, in float64: ``rel_sym``
    ``||o1 - o2||_F / (0.5 (||o1||_F + ||o2||_F))`` (a symmetric denominator), the row-wise
    relative differences with the same symmetric denominator at their median, 90th and 99th
    percentiles (``row_rel_median``, ``row_rel_p90``, ``row_rel_p99``; linear interpolation, as
    torch.quantile) and the cosine similarity of the flattened outputs (``cosine``).
    ``exact``/``approx``: (heads, n, head_dim)."""
    import torch

    e, a = exact.double(), approx.double()
    diff = (e - a).flatten(1).norm(dim=1)
    rel_sym = diff / (0.5 * (e.flatten(1).norm(dim=1) + a.flatten(1).norm(dim=1)) + 1e-12)
    row = (e - a).norm(dim=-1) / (0.5 * (e.norm(dim=-1) + a.norm(dim=-1)) + 1e-12)  # (H, n)
    qs = torch.quantile(row, torch.tensor([0.5, 0.9, 0.99], dtype=torch.float64, device=row.device), dim=-1)
    cos = torch.nn.functional.cosine_similarity(e.flatten(1), a.flatten(1), dim=1)
    out = {"rel_sym": rel_sym, "row_rel_median": qs[0], "row_rel_p90": qs[1], "row_rel_p99": qs[2], "cosine": cos}
    return {k: v.cpu().numpy() for k, v in out.items()}
