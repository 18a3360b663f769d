"""The explicit constants of the paper's Theorem 2.1 (docs/THEORY.md, "The theorem's constants").

For the mean ``M~`` of ``s`` independent masks of bandwidth ``sigma`` on ``n`` positions:

    Psi_sigma           = 1 + sigma + (e^(1/sigma) + 1) / (e^(1/sigma) - 1)
    E ||L* - M~||_2    <= Psi_sigma (sqrt(ln n / s) + ln n / s)                (expectation bound)
    P(||L* - M~||_2 >= eps) <= n exp(-s eps^2 / (4 Psi_sigma (4 Psi_sigma + eps)))   (tail bound)
    s needed for eps    = ceil(sigma^2 ln n / eps^2)

These are the formulas of the authors' validation script, evaluated in float64; the tail bound
is a probability bound and is reported as it is (it exceeds 1 where it says nothing).
"""
from __future__ import annotations

import math


def psi_sigma(sigma: float) -> float:
    """``Psi_sigma = 1 + sigma + coth(1 / (2 sigma))``, the theorem's variance proxy."""
    if not sigma > 0:
        raise ValueError(f"sigma must be > 0, got {sigma}")
    # (e^x + 1) / (e^x - 1) = coth(x / 2); expm1 keeps it exact for large sigma (small x)
    x = 1.0 / sigma
    return 1.0 + sigma + (math.expm1(x) + 2.0) / math.expm1(x)


def expectation_bound(sigma: float, n: int, s: int) -> float:
    """Upper bound of ``E ||L* - M~||_2`` for ``s`` masks on ``n`` positions."""
    r = math.log(n) / s
    return psi_sigma(sigma) * (math.sqrt(r) + r)


def tail_bound(sigma: float, n: int, s: int, eps: float) -> float:
    """Upper bound of ``P(||L* - M~||_2 >= eps)``; above 1 it bounds nothing."""
    psi = psi_sigma(sigma)
    return n * math.exp(-s * eps * eps / (4.0 * psi * (4.0 * psi + eps)))


def s_needed(sigma: float, n: int, eps: float) -> int:
    """The number of masks the theorem asks for a spectral error ``eps``: ``ceil(sigma^2 ln n / eps^2)``."""
    if not eps > 0:
        raise ValueError(f"eps must be > 0, got {eps}")
    return int(math.ceil(sigma * sigma * math.log(n) / (eps * eps)))
