"""Verdicts: a claim of the paper, the rule that judges it, and what the measurements say.

Every verdict is computed from the numbers it quotes; a claim without measurements is
NOT MEASURED, and a measurement that cannot decide (too noisy, too few points, dominated by
fixed costs) is INCONCLUSIVE, never SUPPORTED. The rules are written next to the verdict in the
report, and the console summaries use the same fits.
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import numpy as np

from poslsh_cli.numerics.metrics import SlopeFit, fit_loglog_slope


class Status(enum.Enum):
    SUPPORTED = "SUPPORTED"
    NOT_SUPPORTED = "NOT SUPPORTED"
    INCONCLUSIVE = "INCONCLUSIVE"
    NOT_MEASURED = "NOT MEASURED"
    #: a secondary comparison of a registered experiment: an estimate with its interval and
    #: direction, never a verdict (docs/PREREGISTRATION.md)
    ESTIMATE = "ESTIMATE"


@dataclass(frozen=True)
class Verdict:
    claim: str
    status: Status
    evidence: str  # the numbers the status was computed from
    rule: str  # how the status follows from them
    #: the same numbers, structured, where a later comparison reads them (a two-scheme comparison:
    #: each scheme's label, mean and interval over seeds, and the difference's interval)
    numbers: dict | None = field(default=None, compare=False)
    #: the claim's id (``bench/roofline``, ``scratch/reaches_alibi/s=10``), stable whatever its sentence
    #: says: readers join verdicts of several runs on it and group them by it and the fields below, never
    #: by the sentence
    key: str = field(default="", compare=False)
    #: a claim made of each of several schemes: the family's id (empty: a claim of its own), its
    #: sentence with "…" where the members differ, and the member this verdict is about (a scheme's label)
    family: str = field(default="", compare=False)
    family_text: str = field(default="", compare=False)
    member: str = field(default="", compare=False)
    #: what the claim is restricted to, shown after it ("[600 steps]"); verdicts of one family and tag fold
    tag: str = field(default="", compare=False)
    #: the id of the claim's declaration (:class:`poslsh_cli.verdicts.declared.Claim`: its metric, sides
    #: and role); a verdict's ``key`` adds the member or setting where one claim is judged several times
    claim_id: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if not self.key:
            raise ValueError(f"a verdict needs its claim's id (key=): {self.claim!r}")
        if self.family and not (self.family_text and self.member):
            raise ValueError(f"a claim of family {self.family!r} needs its family_text and member: {self.claim!r}")

    @property
    def name(self) -> str:
        """The claim's id (:attr:`key`)."""
        return self.key


@dataclass
class Section:
    """One experiment run's part of the report: verdicts, computed sentences, tables, figures."""

    command: str
    run: Path
    title: str
    verdicts: list[Verdict] = field(default_factory=list)
    paragraphs: list[str] = field(default_factory=list)
    tables: list[Any] = field(default_factory=list)  # DataFrames
    details: list[tuple[str, Any]] = field(default_factory=list)  # (caption, full DataFrame), collapsed
    figures: list[Path] = field(default_factory=list)
    #: the run was made at smoke scale (a ``_quick`` preset): its verdicts test the pipeline, not a claim
    smoke: bool = False
    #: what a section says of its run for readers that set several runs side by side (the run's
    #: protocol: ``protocol``, its name; ``described``, one sentence of what it trained and evaluated)
    facts: dict = field(default_factory=dict)
    #: the lines a summary of the section shows (the README's block), apart from its paragraphs
    highlights: list[str] = field(default_factory=list)
    #: several runs' verdicts joined on the claim's id (the side-by-side section), for readers that
    #: show them as a table
    joined: "Joined | None" = None
    #: Markdown lines that answer the question of the section's part of the README (the registered
    #: experiments' answer, table and caveats): the part then opens with them and its figure, and
    #: its verdict rows stay in docs/RESULTS.md
    lead: list[str] = field(default_factory=list)

    def add_table(self, head: list[str], rows: list[list[Any]]) -> None:
        """A table from a command's ``summary(df)`` (its header and rows)."""
        import pandas as pd

        self.tables.append(pd.DataFrame(rows, columns=head))


@dataclass
class Joined:
    """Verdicts of several runs joined on their claims' ids: the runs' column names, and per claim its
    sentence (the first run's) and each run's verdict (a run that did not judge it is absent)."""

    runs: list[str]
    rows: list[tuple[str, dict[str, Verdict]]]


#: How a claim made over several groups ((n, sigma), layers, lengths) is judged from its groups'
#: verdicts; every such verdict's rule ends with it (:func:`over_groups`).
GROUPS_RULE = ("over the groups: SUPPORTED when more than half of the measured groups are SUPPORTED and none is "
               "NOT SUPPORTED; NOT SUPPORTED when any group is (the claim is made for every group); otherwise "
               "INCONCLUSIVE; groups not measured do not count")


def combine(statuses: Iterable[Status]) -> Status:
    """One status for a claim over several groups (:data:`GROUPS_RULE`): a group where the claim
    fails fails it; it is supported only when most measured groups support it; one supported
    group among undecided ones is INCONCLUSIVE; NOT MEASURED when no group was measured."""
    measured = [s for s in statuses if s is not Status.NOT_MEASURED]
    if not measured:
        return Status.NOT_MEASURED
    if Status.NOT_SUPPORTED in measured:
        return Status.NOT_SUPPORTED
    if 2 * sum(s is Status.SUPPORTED for s in measured) > len(measured):
        return Status.SUPPORTED
    return Status.INCONCLUSIVE


def over_groups(rule: str) -> str:
    """A group's rule followed by how the groups combine (:data:`GROUPS_RULE`)."""
    return f"{rule}; {GROUPS_RULE}"


def tally(statuses: Iterable[Status]) -> str:
    st = list(statuses)
    parts = [f"{sum(s is k for s in st)} {k.value.lower()}" for k in Status if any(s is k for s in st)]
    return ", ".join(parts) if parts else "no groups"


@dataclass
class Groups:
    """The one way a claim over several groups becomes a verdict: each group adds its status (a
    :class:`Status`, or a bool for holds / fails) and the numbers behind it; :meth:`verdict` judges
    them together, by :data:`GROUPS_RULE` (:func:`combine`, the rule followed by
    :func:`over_groups`) or, with ``every=True``, SUPPORTED only when every group holds (NOT
    MEASURED without groups; the rule as given)."""

    statuses: list[Status] = field(default_factory=list)
    evidence: list[str] = field(default_factory=list)

    def add(self, status: Status | bool | None, evidence: str | None = None) -> None:
        """One group's status and evidence; either may be None (evidence that judges nothing, a
        group that quotes nothing)."""
        if status is not None:
            self.statuses.append(status if isinstance(status, Status) else
                                 Status.SUPPORTED if status else Status.NOT_SUPPORTED)
        if evidence is not None:
            self.evidence.append(evidence)

    def tally(self) -> str:
        return tally(self.statuses)

    def status(self, every: bool = False) -> Status:
        if not every:
            return combine(self.statuses)
        if not self.statuses:
            return Status.NOT_MEASURED
        return Status.SUPPORTED if all(s is Status.SUPPORTED for s in self.statuses) else Status.NOT_SUPPORTED

    def verdict(self, claim: Any, rule: str | None = None, *, none: str = "", lead: str = "",
                evidence: str | None = None, every: bool = False, **fields: Any) -> Verdict:
        """The verdict of ``claim`` (:class:`poslsh_cli.verdicts.declared.Claim`; ``rule``, else its
        declared rule, and ``fields``, as its :meth:`~poslsh_cli.verdicts.declared.Claim.verdict` takes
        them); its evidence is ``evidence`` when given, else ``lead`` and the groups' evidence joined by
        "; ", or ``none`` when there is none."""
        if evidence is None:
            evidence = lead + "; ".join(self.evidence) if self.evidence else none
        rule = claim.rule_for(**fields) if rule is None else rule
        return claim.verdict(self.status(every), evidence, rule=rule if every else over_groups(rule), **fields)


# ---------------------------------------------------------------------------------------------
# decay like s^(-1/2) (Theorem 2.1)

#: Fits of the decay exponent use s >= this (when three or more such s were run): at small s
#: the entries of M~ are coarse multiples of 1/s and the max norm saturates near 1, so the
#: log-log slope there says nothing about the O(1/sqrt(s)) regime of Theorem 2.1.
ASYMPTOTIC_S = 8
#: "Decays like s^(-1/2)" is an equivalence claim: the slope's 95% interval must lie inside
#: -1/2 ± this (a wide interval, or a tight one that excludes -1/2, cannot support it).
DECAY_MARGIN = 0.1

DECAY_RULE = (f"log-log slope of the error against s, fitted over s >= {ASYMPTOTIC_S} (all trials; at least three "
              f"such s), with its 95% t-interval: SUPPORTED when the interval lies inside "
              f"[{-0.5 - DECAY_MARGIN:.1f}, {-0.5 + DECAY_MARGIN:.1f}], NOT SUPPORTED when it lies wholly outside, "
              "else INCONCLUSIVE")


def asymptotic_fit(s: np.ndarray, err: np.ndarray) -> SlopeFit | None:
    """Slope fit over s >= ASYMPTOTIC_S, or None with fewer than three such s."""
    s, err = np.asarray(s, dtype=np.float64), np.asarray(err, dtype=np.float64)
    big = s >= ASYMPTOTIC_S
    if np.unique(s[big]).size < 3:
        return None
    return fit_loglog_slope(s[big], err[big])


def decay_status(fit: SlopeFit | None) -> Status:
    """The equivalence rule of :data:`DECAY_RULE` on a slope fit."""
    if fit is None or not math.isfinite(fit.slope):
        return Status.NOT_MEASURED
    if not (math.isfinite(fit.ci_low) and math.isfinite(fit.ci_high)):
        return Status.INCONCLUSIVE
    lo, hi = -0.5 - DECAY_MARGIN, -0.5 + DECAY_MARGIN
    if lo <= fit.ci_low and fit.ci_high <= hi:
        return Status.SUPPORTED
    if fit.ci_high < lo or fit.ci_low > hi:
        return Status.NOT_SUPPORTED
    return Status.INCONCLUSIVE


def slope_text(fit: SlopeFit | None) -> str:
    if fit is None or not math.isfinite(fit.slope):
        return "–"
    if not math.isfinite(fit.ci_low):
        return f"{fit.slope:.3f}"
    return f"{fit.slope:.3f} [{fit.ci_low:.3f}, {fit.ci_high:.3f}]"


# ---------------------------------------------------------------------------------------------
# time against n (Theorem 2.2)

#: Below this slope the time is still dominated by fixed costs over the fitted range.
OVERHEAD_SLOPE = 0.8
#: Above this slope the growth is clearly super-linear (exact attention: 2).
LINEAR_SLOPE_MAX = 1.3

TIME_RULE = (f"log-log slope of end-to-end time against n over the larger half of the n grid (at least three n, "
             f"where fixed costs weigh least); SUPPORTED when {OVERHEAD_SLOPE} <= slope <= {LINEAR_SLOPE_MAX}, "
             f"NOT SUPPORTED above {LINEAR_SLOPE_MAX}, INCONCLUSIVE below {OVERHEAD_SLOPE} (time still dominated "
             "by fixed costs, so the fit says nothing about growth) or with fewer than three n")


def crossover(ratio: dict[int, float]) -> int | None:
    """The smallest length from which a time ratio (new over reference) stays below 1 at every
    larger measured length; None when it is not below 1 at the largest."""
    best = None
    for n in sorted(ratio, reverse=True):
        if ratio[n] >= 1:
            break
        best = n
    return best


def upper_half(ns: Iterable[int]) -> list[int]:
    """The larger half of the distinct n (at least three when three exist)."""
    u = sorted(set(int(x) for x in ns))
    if len(u) < 3:
        return []
    return u[min(len(u) // 2, len(u) - 3):]


def time_status(fit: SlopeFit | None) -> Status:
    if fit is None or not math.isfinite(fit.slope):
        return Status.INCONCLUSIVE
    if fit.slope > LINEAR_SLOPE_MAX:
        return Status.NOT_SUPPORTED
    if fit.slope < OVERHEAD_SLOPE:
        return Status.INCONCLUSIVE
    return Status.SUPPORTED


def fmt(x: object, digits: int = 3) -> str:
    if isinstance(x, (float, np.floating)):
        if not math.isfinite(float(x)):
            return "–"
        return f"{float(x):.{digits}g}"
    return str(x)


def few(items: list[str], k: int = 6) -> str:
    """At most k items, then how many more."""
    return "; ".join(items[:k]) + (f"; … ({len(items) - k} more in the table)" if len(items) > k else "")
