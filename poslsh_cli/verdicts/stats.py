"""Intervals and the decision rules of comparisons between trained models (docs/THEORY.md,
"Verdict rules"), and the power of a goodness-of-fit test (:func:`ks_power`).

A comparison between two schemes is a statistic: the difference of their bits per byte, paired by
training seed (the same seed gives the same initial weights and data order to every scheme), with a
t-interval over the seeds. Each seed's value is already the mean over its mask draws, so the
interval covers training seeds and mask draws; every model is evaluated on the same windows.
With fewer than :data:`MIN_SEEDS` seeds the seed-to-seed spread cannot be estimated: the interval
shown is then over evaluation noise (the per-window differences of the same models on the same
evaluation windows, or a fit's residuals), which says how sure the measurement is of *these*
models, not of the schemes, and the verdict is INCONCLUSIVE whatever it says (:func:`on_seeds`).

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

#: Fewer training seeds than this: a comparison can only use evaluation noise, and decides nothing.
MIN_SEEDS = 3
#: What a verdict over fewer seeds says.
NEEDS_SEEDS = f"undecided: a verdict needs {MIN_SEEDS} training seeds"
#: The one non-inferiority margin of every language-model metric, as a fraction of the baseline's own
#: value on that metric (docs/THEORY.md, "One margin"): "A reaches B" when A is at most 1% worse than B,
#: on bits per byte (about 1% in perplexity) as on the top-1 error rate (1% more wrong predictions).
MARGIN_FRACTION = 0.01


def relative_margin(baseline: float, fraction: float = MARGIN_FRACTION) -> float:
    """The non-inferiority margin on a metric whose baseline (exact ALiBi's mean over seeds) is
    ``baseline``: ``fraction`` of it (NaN when the baseline is not measured)."""
    return fraction * abs(baseline) if baseline == baseline else math.nan


def spread(iv: "Interval") -> float:
    """The standard deviation of the values behind a t-interval, backed out of its half-width
    (NaN without an interval)."""
    from scipy import stats

    if not iv.finite or iv.n < 2:
        return math.nan
    half = (iv.high - iv.low) / 2
    return half / stats.t.ppf(0.5 + iv.level / 2, df=iv.n - 1) * math.sqrt(iv.n)


def half_width(sd: float, n: int, level: float) -> float:
    """The half-width of a t-interval at ``level`` of the mean of ``n`` values with spread ``sd``."""
    from scipy import stats

    return float(stats.t.ppf(0.5 + level / 2, df=n - 1) * sd / math.sqrt(n)) if n >= 2 else math.inf


def seeds_to_decide(iv: "Interval", boundary: float, limit: int = 1000) -> int | None:
    """The fewest seeds with which an interval at ``iv``'s level, at its estimate and spread, would
    lie wholly on one side of ``boundary`` (the margin of a non-inferiority rule, 0 of a difference
    rule): the smallest n with half-width < |estimate - boundary|. None when the estimate sits on the
    boundary or more than ``limit`` would be needed; the spread is the one measured, so the number is
    a planning figure, not a promise."""
    sd = spread(iv)
    gap = abs(iv.estimate - boundary)
    if not (sd == sd) or gap == 0:
        return None
    for n in range(2, limit + 1):
        if half_width(sd, n, iv.level) < gap:
            return n
    return None


def seeds_for_half_width(sd: float, target: float, level: float = 0.90, limit: int = 1000) -> int | None:
    """The fewest seeds whose t-interval at ``level`` has a half-width at most ``target`` at spread
    ``sd`` (the power rule: 90% half-width at most half the margin)."""
    if not (sd == sd) or target <= 0:
        return None
    for n in range(2, limit + 1):
        if half_width(sd, n, level) <= target:
            return n
    return None


def family_wise(iv: "Interval", members: int) -> "Interval":
    """``iv`` (same estimate, spread and count) at Bonferroni's level for a family of ``members``
    intervals: its two-sided error rate ``1 - level`` divided among them, so that all of them hold
    together at the single interval's rate."""
    sd = spread(iv)
    level = 1 - (1 - iv.level) / max(1, members)
    if not (sd == sd):
        return Interval(iv.estimate, math.nan, math.nan, iv.n, level, iv.source)
    h = half_width(sd, iv.n, level)
    return Interval(iv.estimate, iv.estimate - h, iv.estimate + h, iv.n, level, iv.source)


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

    def record(self) -> dict:
        """The interval as a verdict's ``numbers["diff"]`` (what a later reader re-reads: :meth:`of_record`)."""
        from dataclasses import asdict

        return asdict(self)

    @classmethod
    def of_record(cls, d: dict) -> "Interval":
        """The interval a :meth:`record` holds."""
        return cls(d["estimate"], d["low"], d["high"], int(d["n"]), d["level"], d["source"])

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


def equivalence(iv: Interval, margin: float) -> tuple[Status, str]:
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


def on_seeds(status: Status, iv: "Interval | None") -> Status:
    """A comparison of trained models is decided on the spread of at least :data:`MIN_SEEDS` training seeds:
    over an interval of evaluation windows or a fit's points (fewer seeds) it is INCONCLUSIVE."""
    return status if iv is not None and iv.source == "seeds" and iv.n >= MIN_SEEDS else Status.INCONCLUSIVE


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


DIFFERENCE_RULE = (f"paired by training seed, the 95% t-interval of the difference excludes 0 on the claimed side "
                   f"(SUPPORTED) or on the other side (NOT SUPPORTED), else INCONCLUSIVE. With fewer than {MIN_SEEDS} "
                   "seeds the interval is over the evaluation windows (evaluation noise only) and the verdict "
                   "INCONCLUSIVE")


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

