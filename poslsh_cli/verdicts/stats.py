"""Intervals and the decision rules of comparisons between trained models (docs/THEORY.md,
"Verdict rules"), and the power of a goodness-of-fit test (:func:`ks_power`).

A comparison between two schemes is a statistic: the difference of their bits per byte, paired by
training seed (the same seed gives the same initial weights and data order to every scheme), with a
t-interval over the seeds. Each seed's value is already the mean over its mask draws, so the
interval covers training seeds and mask draws; every model is evaluated on the same windows.
With fewer than :data:`MIN_SEEDS` seeds the seed-to-seed spread cannot be estimated, and a rule
may only use evaluation noise: the per-window differences of the same models on the same
evaluation windows, whose interval says how sure the measurement is of *these* models, not of
the schemes. Verdicts say which one they used.

    equivalence    the 90% interval ends below +margin                  -> SUPPORTED ("reaches": at
                   (non-inferiority: "A reaches B")                        most margin worse, or better)
                   it starts at or above +margin                        -> NOT SUPPORTED
                   otherwise (it contains +margin)                      -> INCONCLUSIVE
    difference     the 95% interval excludes 0 in the claimed direction -> SUPPORTED
                   it excludes 0 in the other direction                 -> NOT SUPPORTED
                   otherwise                                            -> INCONCLUSIVE
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Sequence

import numpy as np

from poslsh_cli.verdicts.claims import Status
from poslsh_cli.numerics.metrics import fit_line

#: Fewer training seeds than this: a comparison can only use evaluation noise.
MIN_SEEDS = 3
#: Bits per byte within which two schemes count as equivalent ("reaches").
MARGIN = 0.02


@dataclass(frozen=True)
class Interval:
    """An estimate with a two-sided interval at ``level``, from ``n`` values of ``source``
    (``seeds`` or ``windows``)."""

    estimate: float
    low: float
    high: float
    n: int
    level: float
    source: str

    @property
    def finite(self) -> bool:
        return math.isfinite(self.low) and math.isfinite(self.high)

    def text(self, digits: int = 4, sign: bool = True) -> str:
        f = f"{{:{'+' if sign else ''}.{digits}f}}"
        if not self.finite:
            return f.format(self.estimate) + f" (no interval: {count(self.n, self.source)})"
        return (f.format(self.estimate) + f" [{f.format(self.low)}, {f.format(self.high)}] "
                f"({int(round(self.level * 100))}%, {count(self.n, self.source)})")


def count(n: int, noun: str) -> str:
    """``n`` and a plural noun, singular for one: ``count(1, "seeds") == "1 seed"``."""
    return f"{n} {noun[:-1] if n == 1 and noun.endswith('s') else noun}"


def t_interval(values: Iterable[float], level: float = 0.95, source: str = "seeds") -> Interval:
    """Mean of ``values`` with a Student-t interval (none from a single value)."""
    from scipy import stats

    x = np.asarray([v for v in values if v == v], dtype=np.float64)
    if x.size == 0:
        return Interval(math.nan, math.nan, math.nan, 0, level, source)
    mean = float(x.mean())
    if x.size < 2:
        return Interval(mean, math.nan, math.nan, 1, level, source)
    half = float(stats.t.ppf(0.5 + level / 2, df=x.size - 1) * x.std(ddof=1) / math.sqrt(x.size))
    return Interval(mean, mean - half, mean + half, int(x.size), level, source)


def paired(a: Mapping, b: Mapping, level: float = 0.95) -> Interval:
    """Mean of ``a[k] - b[k]`` over the keys (seeds) both have, with its t-interval."""
    keys = sorted(set(a) & set(b))
    return t_interval([a[k] - b[k] for k in keys], level)


def ratio_interval(bits: np.ndarray, nbytes: np.ndarray, level: float = 0.95) -> Interval:
    """Bits per byte of the pooled windows (sum bits / sum bytes), with a delta-method interval over
    the windows (evaluation noise)."""
    from scipy import stats

    bits, nbytes = np.asarray(bits, float), np.asarray(nbytes, float)
    W = bits.size
    est = float(bits.sum() / nbytes.sum()) if W else math.nan
    if W < 2:
        return Interval(est, math.nan, math.nan, W, level, "windows")
    resid = (bits - est * nbytes) / nbytes.mean()
    half = float(stats.t.ppf(0.5 + level / 2, df=W - 1) * resid.std(ddof=1) / math.sqrt(W))
    return Interval(est, est - half, est + half, W, level, "windows")


def paired_windows(a_bits: np.ndarray, b_bits: np.ndarray, nbytes: np.ndarray, level: float = 0.95) -> Interval:
    """Difference of two models' bits per byte on the same windows (a - b), with its interval over
    the windows: evaluation noise only."""
    return ratio_interval(np.asarray(a_bits) - np.asarray(b_bits), nbytes, level)


def slope(x: Sequence[float], y: Sequence[float], level: float = 0.95) -> Interval:
    """Least-squares slope of y on x with its t-interval (the residuals' spread; none below three
    points): :func:`poslsh_cli.numerics.metrics.fit_line`."""
    f = fit_line(np.asarray(x, float), np.asarray(y, float), level)
    return Interval(f.slope, f.ci_low, f.ci_high, f.points, level, "points")


def equivalence(iv: Interval, margin: float = MARGIN) -> tuple[Status, str]:
    """The non-inferiority rule ("A reaches B") on a 90% interval of A - B (smaller is better): A
    is at most ``margin`` worse than B when the interval's upper end is below the margin, however
    far below 0 its lower end reaches (a scheme better than B reaches it too); A is worse by the
    margin or more when the lower end is at or above it."""
    if not iv.finite:
        return Status.INCONCLUSIVE, "no interval"
    if iv.high < margin:
        return Status.SUPPORTED, (f"better by more than {margin}" if iv.high <= -margin
                                  else f"at most {margin} worse")
    if iv.low >= margin:
        return Status.NOT_SUPPORTED, f"worse by {margin} or more"
    return Status.INCONCLUSIVE, f"the interval crosses +{margin}"


def difference(iv: Interval, claimed: str = "positive") -> Status:
    """The difference rule on a 95% interval: is it on the ``claimed`` side of 0?"""
    if not iv.finite:
        return Status.INCONCLUSIVE
    lo, hi = (iv.low, iv.high) if claimed == "positive" else (-iv.high, -iv.low)
    if lo > 0:
        return Status.SUPPORTED
    if hi < 0:
        return Status.NOT_SUPPORTED
    return Status.INCONCLUSIVE


#: Top-1 next-token accuracy, in percentage points, within which two schemes count as equivalent.
ACCURACY_MARGIN = 1.0


def equivalence_rule(margin: float = MARGIN, unit: str = "bits per byte") -> str:
    """The text of the non-inferiority rule for a margin in ``unit`` (smaller is better)."""
    return (f"non-inferiority, paired by training seed: the 90% t-interval of the difference ends below "
            f"+{margin:g} {unit} (SUPPORTED: at most {margin:g} worse, or better); it starts at or above "
            f"+{margin:g}: NOT SUPPORTED; otherwise INCONCLUSIVE. With fewer than {MIN_SEEDS} seeds the interval is "
            "over the evaluation windows (evaluation noise only)")


EQUIVALENCE_RULE = equivalence_rule()
DIFFERENCE_RULE = (f"paired by training seed, the 95% t-interval of the difference excludes 0 on the claimed side "
                   f"(SUPPORTED) or on the other side (NOT SUPPORTED), else INCONCLUSIVE. With fewer than {MIN_SEEDS} "
                   "seeds the interval is over the evaluation windows (evaluation noise only)")


# ---------------------------------------------------------------------------------------------
# the power of a goodness-of-fit test

#: Power a test must have against the alternative it is meant to see before its not rejecting
#: the null law counts as support.
POWER = 0.8


def ks_power(null_cdf: Callable[[np.ndarray], np.ndarray], draw: Callable[[int, np.random.Generator], np.ndarray],
             m: int, alpha: float, generator: np.random.Generator, draws: int = 400) -> float:
    """Power of the two-sided one-sample Kolmogorov-Smirnov test of ``null_cdf`` at level
    ``alpha`` with ``m`` values, against the law ``draw(size, generator)`` samples: the share of
    ``draws`` simulated samples it rejects. The test rejects when ``D_m = sup |F_m - F_0|`` reaches
    the exact critical value ``kstwo.isf(alpha, m)`` (what ``scipy.stats.kstest`` decides)."""
    from scipy import stats

    x = np.sort(np.stack([np.asarray(draw(m, generator), dtype=np.float64) for _ in range(draws)]), axis=1)
    F = null_cdf(x)  # (draws, m)
    i = np.arange(1, m + 1)
    D = np.maximum((i / m - F).max(axis=1), (F - (i - 1) / m).max(axis=1))
    return float(np.mean(D >= stats.kstwo.isf(alpha, m)))


def ks_values_needed(null_cdf: Callable[[np.ndarray], np.ndarray],
                     draw: Callable[[int, np.random.Generator], np.ndarray], alpha: float,
                     generator: np.random.Generator, power: float = POWER, start: int = 2, limit: int = 10_000) -> int:
    """The fewest values (found by doubling, then bisection, each power simulated by
    :func:`ks_power`) with which the test reaches ``power``; ``limit`` if none up to it does."""
    lo, hi = max(1, start - 1), max(2, start)
    while ks_power(null_cdf, draw, hi, alpha, generator) < power:
        lo, hi = hi, 2 * hi
        if hi > limit:
            return limit
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if ks_power(null_cdf, draw, mid, alpha, generator) >= power else (mid, hi)
    return hi

