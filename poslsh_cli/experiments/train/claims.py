"""``poslsh train``'s step times against L and its claims on them: whether a run compared schemes at all,
and whether Positional LSH trains faster than exact ALiBi at the longest length trained with both."""
from __future__ import annotations

import math
from typing import Any

from poslsh_cli.attention.scheme import Position
from poslsh_cli.verdicts.claims import Verdict, crossover
from poslsh_cli.verdicts.declared import Claim
from poslsh_cli.verdicts.stats import difference, t_interval

ALIBI, POSLSH = Position.ALIBI.value, Position.POSLSH.value


def step_times(df: Any) -> Any:
    """Median training-step seconds per (scheme, s, L), mean over seeds, of the runs without
    attention dropout (a dropout run is a regulariser control with its own cost, not the scheme's
    attention path)."""
    col = "step_seconds" if "step_seconds" in df.columns else None
    if col is None:
        return None
    return df[df.attn_dropout == 0].groupby(["position", "s", "seq_len"])[col].mean()


def crossover_length(df: Any, s: int | None = None) -> float:
    """Smallest trained L from which Positional LSH (at ``s``, default the largest) steps faster
    than exact ALiBi at every larger trained L; NaN when it never does."""
    times = step_times(df)
    if times is None:
        return math.nan
    try:
        alibi = times.loc[(ALIBI, 0)]
        ps = sorted(times.loc[POSLSH].index.get_level_values(0).unique())
        p = times.loc[(POSLSH, s if s is not None else max(ps))]
    except KeyError:
        return math.nan
    best = crossover({L: p[L] / alibi[L] for L in set(alibi.index) & set(p.index)})
    return math.nan if best is None else best


SCHEMES_COMPARED = Claim("train/schemes_compared", "train", "schemes compared at the training length",
                         "needs two or more schemes")


def claim_schemes_compared(df: Any) -> list[Verdict]:
    if df.position.nunique() < 2:
        return [SCHEMES_COMPARED.not_measured("one scheme in this run")]
    return []


SPEED_RULE = ("seed-paired: per training seed, ln(median step time of Positional LSH at its largest s / exact "
              "ALiBi's) at the longest L trained with both, and the 95% t-interval of these over the seeds: it ends "
              "below 0 SUPPORTED (faster), it starts above 0 NOT SUPPORTED, otherwise INCONCLUSIVE (one seed: no "
              "interval); the crossover, the smallest L from which the mean step time of Positional LSH stays below "
              "exact ALiBi's, is descriptive")


TRAINS_FASTER = Claim("train/trains_faster", "train",
                      "Positional LSH trains faster than exact ALiBi at the longest trained length", SPEED_RULE,
                      metric="step_seconds", sides=({"position": "alibi"}, {"position": "poslsh", "s": "largest"}))


def claim_crossover(df: Any) -> list[Verdict]:
    """Positional LSH trains faster than exact ALiBi at long L (near-linear against quadratic),
    judged on the seed-paired log ratio of step times at the longest L (:data:`SPEED_RULE`): the
    same timing law with noise is SUPPORTED at most at the interval's error rate."""
    import numpy as np
    import pandas as pd

    times = step_times(df)
    if times is None or ALIBI not in times.index.get_level_values(0) or POSLSH not in times.index.get_level_values(0):
        return [TRAINS_FASTER.not_measured("needs alibi and poslsh cells at several L")]
    t = times.unstack("seq_len")
    x = crossover_length(df)
    smax = max(s for (p, s) in t.index if p == POSLSH)
    both = [L for L in t.columns if pd.notna(t.loc[(ALIBI, 0), L]) and pd.notna(t.loc[(POSLSH, smax), L])]
    if not both:
        return [TRAINS_FASTER.not_measured(f"no L trained with both alibi and poslsh s={smax}")]
    Lmax = max(both)
    d = df
    d = d[(d.attn_dropout == 0) & (d.seq_len == Lmax)]

    def per_seed(position: str, s: int) -> Any:
        return np.log(d[(d.position == position) & (d.s == s)].groupby("seed").step_seconds.mean())

    a, p = per_seed(ALIBI, 0), per_seed(POSLSH, smax)
    iv = t_interval((p - a).dropna().to_numpy())
    ev = "; ".join(f"L={L}: poslsh s={smax} {t.loc[(POSLSH, smax), L]:.3g} s, alibi {t.loc[(ALIBI, 0), L]:.3g} s"
                   for L in both)
    ev += (f"; at L={Lmax} ln(poslsh / alibi) over seeds {iv.text(3)}, ratio {math.exp(iv.estimate):.2f}x"
           + (f" [{math.exp(iv.low):.2f}x, {math.exp(iv.high):.2f}x]" if iv.finite else ""))
    ev += f"; crossover L={int(x)}" if math.isfinite(x) else "; no crossover at the trained lengths"
    return [TRAINS_FASTER.verdict(difference(iv, claimed="negative"), ev)]
