"""The length-extrapolation claims of ``poslsh perplexity``: Positional LSH stays robust at kL (its bits
per byte at kL minus at L within the relative margin), and RoPE and the model without positions degrade
more there (difference of degradations, paired by seed); with fewer than three seeds over the evaluation
windows (evaluation noise only). The models and text are one group of :mod:`~poslsh_cli.experiments.perplexity.claims`.
"""
from __future__ import annotations

import math
from typing import Optional

import numpy as np

from poslsh_cli.experiments.perplexity.claims import NONE, POSLSH, ROPE, Data, Arm, reference_s
from poslsh_cli.verdicts.claims import Status, Verdict
from poslsh_cli.verdicts.declared import Claim
from poslsh_cli.verdicts.stats import (DIFFERENCE_RULE, MARGIN_FRACTION, MIN_SEEDS, NEEDS_SEEDS, Interval, count,
                                      difference, on_seeds, paired, paired_windows, ratio_interval, relative_margin)
from poslsh_cli.verdicts.stats import t_interval


def _degradation(d: Data, sc: Arm) -> dict:
    """Per seed: bits per byte at kL (``d.far``) minus at L."""
    at_L, at_kL = d.per_seed(sc, d.L), d.per_seed(sc, d.far * d.L)
    return {k: at_kL[k] - at_L[k] for k in set(at_L) & set(at_kL)}


ROBUST = Claim(
    "extrapolation/robust", "perplexity", "Positional LSH stays robust at {k}x the training length",
    f"per seed, bits per byte at {{k}}L minus at L (own attention, from scratch, on one evaluation text); margin = "
    f"{MARGIN_FRACTION:.0%} of the model's own bits per byte at L; SUPPORTED when the 95% t-interval over the seeds "
    f"(at least {MIN_SEEDS}; with fewer, over the evaluation windows: evaluation noise only, and INCONCLUSIVE) ends "
    "below the margin, NOT SUPPORTED when it starts above it, else INCONCLUSIVE; whether RoPE or no-position models "
    "degrade more is a claim of its own", metric="bits_per_byte at kL - at L")
#: RoPE and no-position models degrade more at kL than Positional LSH (reference s)
DEGRADES_MORE = {pos: Claim(f"extrapolation/{pos}_degrades_more", "perplexity",
                            "{label} degrades more at {k}L than Positional LSH s={s}", DIFFERENCE_RULE,
                            metric="bits_per_byte at kL - at L",
                            sides=({"position": POSLSH, "s": "reference"}, {"position": pos}))
                 for pos in (ROPE, NONE)}


def claim_extrapolation(d: Data) -> list[Verdict]:
    """Positional LSH stays robust at 4L, where RoPE and no-position models degrade (more)."""
    s = reference_s(d)
    k = d.far
    if s is None or not _degradation(d, Arm(POSLSH, s)):
        return [ROBUST.not_measured(f"no poslsh model evaluated at L and {k}L", k=k)]
    others = [sc for sc in (Arm(ROPE), Arm(NONE)) if _degradation(d, sc)]
    p = _degradation(d, Arm(POSLSH, s))
    at_L = d.per_seed(Arm(POSLSH, s), d.L)
    margin = relative_margin(float(np.mean(list(at_L.values()))))

    if len(p) >= MIN_SEEDS:
        iv = t_interval(p.values())
        ev = f"L={d.L}: poslsh s={s} at {k}L minus at L {iv.text()}; {count(len(p), 'training seeds')}"
    else:  # the seed-to-seed spread cannot be estimated from fewer seeds
        iv = _windows_change(d, Arm(POSLSH, s), sorted(p))
        ev = (f"L={d.L}: poslsh s={s} at {k}L minus at L "
              + (f"{iv.text()}; {count(len(p), 'training seeds')}: evaluation noise only ({NEEDS_SEEDS})" if iv is not None else
                 f"{np.mean(list(p.values())):+.4f}; {count(len(p), 'training seeds')} and no evaluation windows"))
    ev += f"; margin {margin:.4f}"
    if not others:
        ev += f" (no rope or none model evaluated at L and {k}L to set beside it)"
    if iv is not None and iv.finite:
        st = on_seeds(Status.SUPPORTED if iv.high < margin else (
            Status.NOT_SUPPORTED if iv.low > margin else Status.INCONCLUSIVE), iv)
    else:
        st = Status.INCONCLUSIVE
    out = [ROBUST.verdict(st, ev, _numbers(iv, margin, margin), k=k)]
    for sc in others:
        o = _degradation(d, sc)
        common = sorted(set(o) & set(p))
        if len(common) >= MIN_SEEDS:
            div = paired(o, p)
            basis = f"{len(common)} training seeds paired"
        else:
            div = _windows_degradation(d, sc, Arm(POSLSH, s), common)
            basis = (f"{count(len(common), 'training seeds')}: evaluation noise only ({NEEDS_SEEDS})" if div
                     else "no evaluation windows")
        said = dict(label=sc.label, k=k, s=s)
        if div is None:
            out.append(DEGRADES_MORE[sc.position].verdict(Status.INCONCLUSIVE, f"L={d.L}: {basis}", **said))
            continue
        out.append(DEGRADES_MORE[sc.position].verdict(
            on_seeds(difference(div, "positive"), div), f"L={d.L}: ({sc.label} at {k}L - at L) - (poslsh s={s} at "
            f"{k}L - at L) = {div.text()}; {basis}", _numbers(div), **said))
    return out


def _numbers(iv: Optional[Interval], margin: float = math.nan, boundary: float = 0.0) -> Optional[dict]:
    """The interval a verdict was decided on, its margin and the boundary the rule compares it with
    (what the power table and the error-rate paragraph re-read); None without an interval."""
    if iv is None:
        return None
    return {"unit": "bits per byte", "diff": iv.record(), "margin": margin, "boundary": boundary}


def _combine(hi: Interval, lo: Interval) -> Interval:
    """hi - lo for two interval estimates on different windows: each standard error backed out of its
    95% half-width, the variances added."""
    from scipy import stats

    est = hi.estimate - lo.estimate
    se = [(iv.high - iv.low) / 2 / stats.t.ppf(0.975, df=iv.n - 1) for iv in (hi, lo)]
    n = min(hi.n, lo.n)
    half = float(stats.t.ppf(0.975, df=n - 1) * math.hypot(*se))
    return Interval(est, est - half, est + half, n, 0.95, "windows")


def _windows_change(d: Data, sc: Arm, seeds: list) -> Optional[Interval]:
    """Evaluation noise of one scheme's bits per byte at kL minus at L: the pooled windows' ratio
    estimate at each length (different windows), its variances added."""
    if not seeds:
        return None
    parts = []
    for length in (d.far * d.L, d.L):
        w = d.window_bits(sc, length, seeds)
        if w is None or len(w[0]) < 2:
            return None
        parts.append(ratio_interval(w[0], w[1], 0.95))
    return _combine(*parts)


def _windows_degradation(d: Data, other: Arm, pos: Arm, seeds: list) -> Optional[Interval]:
    """Evaluation noise of the difference of degradations: per-window paired differences of the two
    models at kL and at L (different windows at the two lengths), their variances added."""
    if not seeds:
        return None
    parts = []
    for length in (d.far * d.L, d.L):
        w_o, w_p = d.window_bits(other, length, seeds), d.window_bits(pos, length, seeds)
        if w_o is None or w_p is None or len(w_o[0]) != len(w_p[0]) or len(w_o[0]) < 2:
            return None
        parts.append(paired_windows(w_o[0], w_p[0], w_o[1], 0.95))
    return _combine(*parts)


