"""The registered confirmatory analysis (docs/PREREGISTRATION.md): Holm's correction over the primary
non-inferiority comparisons, and the stability check of a gap against the training length.

A registered experiment fixes its design before its first model trains; :data:`CONFIRM_L256` is that
design as the code reads it (``tests/test_preregistration.py`` holds it equal to the registered block).
Its primary comparisons are decided here and nowhere else; every other comparison of the same run is
secondary: an estimate with its interval and direction (:data:`~poslsh_cli.verdicts.claims.Status`
``ESTIMATE``), never a verdict.

    primary      per comparison i, the seed-paired gaps d_k (treatment minus control) over m seeds,
                 mean g, standard error se = sd / sqrt(m), margin delta;
                 p_reach_i = P(t_{m-1} <= (g - delta) / se)     (H0: gap >= delta)
                 p_worse_i = P(t_{m-1} >= (g - delta) / se)     (H0': gap <= delta)
                 each family of p-values through Holm at alpha (so at most alpha of wrong verdicts in
                 each direction): SUPPORTED where H0 is rejected,
                 NOT SUPPORTED where H0' is, INCONCLUSIVE where neither
    stability    the gap at several training lengths T (mean, standard error each); the weighted
                 least-squares slope b of the gap against log2 T (per doubling, weights 1/se^2), its
                 interval b +- t_{level, df} se_b; settled inside (-band, +band), still moving wholly
                 outside it, otherwise undetermined
"""
from __future__ import annotations

import dataclasses
import enum
import math
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from poslsh_cli.verdicts.claims import Status


@dataclass(frozen=True)
class Primary:
    """One primary comparison: Positional LSH with ``s`` masks (``treatment``) against ``control``."""

    id: str
    treatment: str
    s: int
    control: str


@dataclass(frozen=True)
class Registration:
    """A registered confirmatory experiment as the analysis reads it (the registered block of
    docs/PREREGISTRATION.md, field for field where the analysis needs it)."""

    name: str
    commit: str  # the commit that registered it, before its first model trained
    train_run: str  # the run name of its training (its preset without the scale)
    seq_len: int
    sigma: float
    steps: int
    seeds: tuple[int, ...]
    primary: tuple[Primary, ...]
    mask_draws: int
    alpha: float
    margin_fraction: float
    stability_level: float
    stability_df: int
    #: the earlier points of the stability check: (run name, steps) of the runs that trained them
    earlier: tuple[tuple[str, int], ...]
    #: training runs made for this registration besides ``train_run`` (its models at T/2): their other
    #: comparisons are secondary too (an earlier point from an exploratory run is not one of them)
    companions: tuple[str, ...] = ()
    #: the page that registered it
    page: str = "docs/PREREGISTRATION.md"


CONFIRM_L256 = Registration(
    name="confirm-L256-v1",
    commit="c6e76b48bfdb4e839da5d724ba31058caa444ebd",
    train_run="train_confirm",
    seq_len=256,
    sigma=8.0,
    steps=2400,
    seeds=tuple(range(100, 111)),
    primary=tuple(Primary(f"reaches_alibi_s{s}", "poslsh", s, "alibi") for s in (10, 20, 100)),
    mask_draws=3,
    alpha=0.05,
    margin_fraction=0.01,
    stability_level=0.90,
    stability_df=4,
    earlier=(("train_official", 600), ("train_official", 1200)),
)

#: the same design at four times the context (its page says "as confirm-L256-v1" for the rest)
CONFIRM_L1024 = dataclasses.replace(
    CONFIRM_L256,
    name="confirm-L1024-v1",
    commit="9670fe6ecaa49ee44fc9a455ed1c85656481c25e",
    train_run="train_confirm_l1024",
    seq_len=1024,
    sigma=32.0,
    primary=tuple(Primary(f"reaches_alibi_s{s}_L1024", "poslsh", s, "alibi") for s in (10, 20, 100)),
    earlier=(("train_stability_l1024", 1200),),
    companions=("train_stability_l1024",),
    page="docs/PREREGISTRATION_L1024.md",
)

#: the paper's training length (its Qwen3 models, sigma = 256: sigma / L = 1/32, the ratio both
#: registrations keep), against which the answer states its own
PAPER_SEQ_LEN = 8192

#: every registered experiment, by the run name of its training
REGISTERED = {r.train_run: r for r in (CONFIRM_L256, CONFIRM_L1024)}


@dataclass(frozen=True)
class HolmStep:
    """One hypothesis through Holm's step-down procedure: its rank among the family's p-values (1 for
    the smallest), the level it is tested at (alpha / (m - rank + 1)), its adjusted p-value and
    whether it is rejected."""

    p: float
    rank: int
    level: float
    adjusted: float
    rejected: bool
    tested: bool = True  # False: the procedure stopped at a smaller p-value before reaching this one


def holm(pvalues: Mapping[str, float], alpha: float) -> dict[str, HolmStep]:
    """Holm's step-down correction over one family: the smallest p-value against alpha / m, the next
    against alpha / (m - 1), ..., stopping at the first that fails; the adjusted p-value of the j-th
    smallest is max over i <= j of min(1, (m - i + 1) p_(i)), rejected where it is at most alpha.
    A NaN p-value is never rejected and is ranked last."""
    m = len(pvalues)
    order = sorted(pvalues, key=lambda k: (not (pvalues[k] == pvalues[k]), pvalues[k] if pvalues[k] == pvalues[k] else 0))
    out: dict[str, HolmStep] = {}
    running, stopped = 0.0, False
    for rank, key in enumerate(order, start=1):
        p = pvalues[key]
        level = alpha / (m - rank + 1)
        adjusted = min(1.0, (m - rank + 1) * p) if p == p else math.nan
        running = max(running, adjusted) if adjusted == adjusted else math.nan
        tested = not stopped
        rejected = tested and p == p and p <= level
        stopped = stopped or not rejected
        out[key] = HolmStep(p, rank, level, running, rejected, tested)
    return out


@dataclass(frozen=True)
class NonInferiority:
    """A seed-paired gap against a margin: its mean, standard error, seeds, 90% interval and the two
    one-sided p-values (``p_reach``: of ``gap >= margin``; ``p_worse``: of ``gap <= margin``)."""

    gap: float
    se: float
    n: int
    margin: float
    low90: float
    high90: float
    p_reach: float
    p_worse: float

    def bound(self, level: float, upper: bool) -> float:
        """The one-sided confidence bound at error rate ``level`` (upper, or lower)."""
        from scipy import stats

        q = stats.t.ppf(1 - level, df=self.n - 1) * self.se
        return self.gap + q if upper else self.gap - q


def noninferiority(gaps: Sequence[float], margin: float) -> NonInferiority:
    """The paired one-sided t-tests of ``mean gap >= margin`` and ``mean gap <= margin`` over the
    per-seed ``gaps`` (at least two), with the 90% t-interval of the mean gap."""
    from scipy import stats

    d = np.asarray(list(gaps), float)
    n = d.size
    if n < 2:
        raise ValueError("a paired test needs at least two seeds")
    g, se = float(d.mean()), float(d.std(ddof=1) / math.sqrt(n))
    half = float(stats.t.ppf(0.95, df=n - 1) * se)
    if se == 0:
        p_reach = 0.0 if g < margin else 1.0
        p_worse = 0.0 if g > margin else 1.0
    else:
        t = (g - margin) / se
        p_reach, p_worse = float(stats.t.cdf(t, df=n - 1)), float(stats.t.sf(t, df=n - 1))
    return NonInferiority(g, se, n, margin, g - half, g + half, p_reach, p_worse)


@dataclass(frozen=True)
class PrimaryResult:
    """A primary comparison decided under Holm: the test, the two families' steps, the status, and the
    one-sided bound at the Holm level that decided it (or at the level it was tested at)."""

    primary: Primary
    test: NonInferiority
    reach: HolmStep
    worse: HolmStep
    status: Status

    @property
    def bound(self) -> float:
        """The bound the verdict rests on: the upper bound at the reaching family's level (SUPPORTED
        when below the margin), or the lower bound at the other family's (NOT SUPPORTED when above)."""
        if self.status is Status.NOT_SUPPORTED:
            return self.test.bound(self.worse.level, upper=False)
        return self.test.bound(self.reach.level, upper=True)

    @property
    def adjusted_p(self) -> float:
        return self.worse.adjusted if self.status is Status.NOT_SUPPORTED else self.reach.adjusted


def decide_primary(gaps: Mapping[Primary, Sequence[float]], margin: float, alpha: float) -> dict[Primary, PrimaryResult]:
    """Every primary comparison decided: per comparison the paired tests against ``margin``; the
    "reaches" p-values through Holm at ``alpha`` (rejected: SUPPORTED), the "worse" p-values through
    Holm at ``alpha`` (rejected: NOT SUPPORTED); neither: INCONCLUSIVE."""
    tests = {p: noninferiority(g, margin) for p, g in gaps.items()}
    reach = holm({p.id: t.p_reach for p, t in tests.items()}, alpha)
    worse = holm({p.id: t.p_worse for p, t in tests.items()}, alpha)
    out = {}
    for p, t in tests.items():
        r, w = reach[p.id], worse[p.id]
        status = Status.SUPPORTED if r.rejected else Status.NOT_SUPPORTED if w.rejected else Status.INCONCLUSIVE
        out[p] = PrimaryResult(p, t, r, w, status)
    return out


class Reading(str, enum.Enum):
    """What the stability check reads from the slope's interval."""

    SETTLED = "settled"
    MOVING = "still moving"
    UNDETERMINED = "undetermined"


@dataclass(frozen=True)
class GapPoint:
    """The seed-paired gap at one training length: ``steps``, its mean, standard error and seeds."""

    steps: int
    gap: float
    se: float
    n: int


@dataclass(frozen=True)
class Stability:
    """The slope of the gap per doubling of training, its interval, the band and the reading."""

    slope: float
    low: float
    high: float
    band: float
    reading: Reading
    points: tuple[GapPoint, ...]

    def text(self) -> str:
        where = ", ".join(f"{p.gap:+.4f} at {p.steps}" for p in self.points)
        head = (f"slope {self.slope:+.4f} per doubling of training [{self.low:+.4f}, {self.high:+.4f}] against the band "
                f"+-{self.band:.4f} (the gap {where})")
        if self.reading is Reading.MOVING:
            way = "shrinking" if self.slope * np.sign(self.points[-1].gap or 1.0) < 0 else "growing"
            return f"the gap is still moving ({way} by {abs(self.slope):.4f} per doubling): {head}"
        return f"the gap is {self.reading.value}: {head}"


def stability(points: Sequence[GapPoint], band: float, level: float, df: int) -> Stability:
    """The weighted least-squares slope of the gap against log2 of the training steps (weights
    1 / se^2) with its ``level`` interval on ``df`` degrees of freedom, read against ``+-band``
    (:class:`Reading`). At least two training lengths, every standard error positive."""
    from scipy import stats

    pts = tuple(sorted(points, key=lambda p: p.steps))
    if len({p.steps for p in pts}) < 2:
        raise ValueError("the stability check needs the gap at two training lengths at least")
    x = np.log2([p.steps for p in pts])
    y = np.array([p.gap for p in pts])
    w = 1.0 / np.array([p.se for p in pts]) ** 2
    xm = float((w * x).sum() / w.sum())
    sxx = float((w * (x - xm) ** 2).sum())
    b = float((w * (x - xm) * (y - (w * y).sum() / w.sum())).sum() / sxx)
    half = float(stats.t.ppf(0.5 + level / 2, df=df) * math.sqrt(1.0 / sxx))
    low, high = b - half, b + half
    reading = (Reading.SETTLED if -band < low and high < band else
               Reading.MOVING if low >= band or high <= -band else Reading.UNDETERMINED)
    return Stability(b, low, high, band, reading, pts)


@dataclass(frozen=True)
class AcrossLengths:
    """The registered comparison of a gap across two context lengths (docs/PREREGISTRATION_L1024.md,
    ``across_lengths``): per primary ``s``, the mean relative gap of ``long`` minus that of ``short``."""

    short: Registration
    long: Registration
    ids: tuple[str, ...]  # one per s, in the order of long.primary
    bound: float  # "grows by less than this": the second family's null D >= bound
    alpha: float


ACROSS_L = AcrossLengths(CONFIRM_L256, CONFIRM_L1024, tuple(f"gap_grows_with_L_s{s}" for s in (10, 20, 100)),
                         bound=0.01, alpha=0.05)


@dataclass(frozen=True)
class Difference:
    """A difference of two independent means (Welch): ``d`` = mean(b) - mean(a), its standard error,
    the Welch-Satterthwaite degrees of freedom, its 90% interval and the two one-sided p-values
    (``p_above``: of ``d <= 0``; ``p_below``: of ``d >= bound``)."""

    d: float
    se: float
    df: float
    low90: float
    high90: float
    p_above: float
    p_below: float


def welch(a: Sequence[float], b: Sequence[float], bound: float) -> Difference:
    """Welch's t (scipy's ``ttest_ind`` with unequal variances) for mean(b) - mean(a), each sample at
    least two values, tested one-sided against 0 (rejecting ``d <= 0``) and against ``bound``
    (rejecting ``d >= bound``)."""
    from scipy import stats

    x, y = np.asarray(list(a), float), np.asarray(list(b), float)
    if x.size < 2 or y.size < 2:
        raise ValueError("Welch's t needs two values in each sample")
    above = stats.ttest_ind(y, x, equal_var=False, alternative="greater")
    below = stats.ttest_ind(y - bound, x, equal_var=False, alternative="less")
    ci = stats.ttest_ind(y, x, equal_var=False).confidence_interval(0.90)
    se = math.sqrt(x.var(ddof=1) / x.size + y.var(ddof=1) / y.size)
    return Difference(float(y.mean() - x.mean()), se, float(above.df), float(ci.low), float(ci.high),
                      float(above.pvalue), float(below.pvalue))
