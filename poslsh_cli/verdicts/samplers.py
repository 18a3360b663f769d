"""The mask samplers side by side (:class:`poslsh_cli.numerics.sampling.Sampler`): how an error
falls with s under each, and how many independent (iid) masks a sampler's s is worth.

The worth of a sampler's s is read off the iid curve of the same group: the mean iid error over
trials at each measured s, interpolated linearly in log s and log error; the sampler's mean error
at s then sits at some iid s' (its *iid equivalent*). Outside the measured iid range it is only
bounded (``> s_max`` when the sampler beats the most iid masks run). docs/THEORY.md, "Stratified
and quasi-random masks", says why every sampler stays unbiased.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from poslsh_cli.verdicts.claims import ASYMPTOTIC_S, asymptotic_fit, slope_text
from poslsh_cli.numerics.metrics import fit_loglog_slope

IID = "iid"


def with_sampler(df: Any) -> Any:
    """``df`` with a ``sampler`` column (rows from before the key: iid)."""
    if "sampler" not in df.columns:
        return df.assign(sampler=IID)
    return df.assign(sampler=df["sampler"].fillna(IID).astype(str))


def samplers_of(df: Any) -> list[str]:
    """The samplers present, iid first, then in the order they appear."""
    seen = list(dict.fromkeys(with_sampler(df)["sampler"]))
    return sorted(seen, key=lambda x: (x != IID, seen.index(x)))


def iid_equivalent(iid_s: Sequence[float], iid_err: Sequence[float], err: float) -> tuple[float, str]:
    """The iid s' whose (interpolated) mean error equals ``err``, and how it is bounded: ``=`` inside
    the measured range, ``>`` beyond its largest s, ``<`` below its smallest (NaN without iid data)."""
    s = np.asarray(iid_s, dtype=np.float64)
    e = np.asarray(iid_err, dtype=np.float64)
    ok = np.isfinite(e) & (e > 0) & (s > 0)
    s, e = s[ok], e[ok]
    if s.size == 0 or not (math.isfinite(err) and err > 0):
        return float("nan"), "="
    order = np.argsort(s)
    s, e = s[order], e[order]
    e = np.minimum.accumulate(e)  # the error of the best iid s up to here: monotone, so invertible
    if err < e[-1]:
        return float(s[-1]), ">"
    if err > e[0]:
        return float(s[0]), "<"
    ls, le = np.log(s), np.log(e)
    j = int(np.searchsorted(-le, -math.log(err), side="left"))
    if j == 0 or le[j] == le[j - 1]:
        return float(s[j]), "="
    t = (math.log(err) - le[j - 1]) / (le[j] - le[j - 1])
    return float(math.exp(ls[j - 1] + t * (ls[j] - ls[j - 1]))), "="


def equivalent_text(value: float, bound: str) -> str:
    if not math.isfinite(value):
        return "–"
    shown = f"{value:.3g}" if value < 100 else f"{value:.0f}"
    return {"=": shown, ">": f"> {shown}", "<": f"< {shown}"}[bound]


def comparison(df: Any, group: list[str], err: str, s_col: str = "s") -> Any:
    """One row per (group, sampler, s): trials, the mean ``err``, its ratio to iid's at the same s and
    the iid equivalent of s (empty where the group has no iid rows)."""
    import pandas as pd

    df = with_sampler(df)
    rows = []
    for gkey, g in df.groupby(group, sort=True):
        gkey = gkey if isinstance(gkey, tuple) else (gkey,)
        iid = g[g.sampler == IID].groupby(s_col)[err].mean()
        for sm in samplers_of(g):
            for s, c in g[g.sampler == sm].groupby(s_col):
                mean = float(c[err].mean())
                ref = float(iid.get(s, float("nan")))
                eq, bound = iid_equivalent(iid.index, iid.values, mean) if len(iid) else (float("nan"), "=")
                rows.append({**dict(zip(group, gkey)), "sampler": sm, "s": int(s), "trials": len(c), "mean": mean,
                             "ratio_to_iid": mean / ref if ref > 0 else float("nan"), "iid_equivalent": eq,
                             "bound": bound})
    return pd.DataFrame(rows)


def slope_table(df: Any, group: list[str], errs: dict[str, str], s_col: str = "s") -> Any:
    """Per (group, sampler): the fitted log-log decay slope of each error over s >= ASYMPTOTIC_S
    (with its 95% interval), or over all s when fewer than three such s were run."""
    import pandas as pd

    df = with_sampler(df)
    rows = []
    for gkey, g in df.groupby(group, sort=True):
        gkey = gkey if isinstance(gkey, tuple) else (gkey,)
        for sm in samplers_of(g):
            c = g[g.sampler == sm]
            row = {**dict(zip(group, gkey)), "sampler": sm}
            for label, col in errs.items():
                fit = asymptotic_fit(c[s_col], c[col])
                if fit is not None:
                    row[f"slope {label} (s≥{ASYMPTOTIC_S})"] = slope_text(fit)
                else:
                    whole = fit_loglog_slope(c[s_col], c[col]) if c[s_col].nunique() >= 2 else None
                    row[f"slope {label} (s≥{ASYMPTOTIC_S})"] = f"{whole.slope:.3f} (all s)" if whole else "–"
            rows.append(row)
    return pd.DataFrame(rows)


def worth_sentences(cmp: Any, what: str, group: list[str]) -> list[str]:
    """Sentences computed from :func:`comparison`: for each non-iid sampler, the median ratio of its
    error to iid's at equal s, and what its s is worth in iid masks at each s (median over groups,
    range), naming the best sampler (lowest median ratio)."""
    if cmp.empty or not (cmp.sampler == IID).any():
        return []
    others = [sm for sm in dict.fromkeys(cmp.sampler) if sm != IID]
    out, best = [], None
    for sm in others:
        c = cmp[(cmp.sampler == sm) & np.isfinite(cmp.ratio_to_iid)]
        if c.empty:
            continue
        med = float(np.median(c.ratio_to_iid))
        if best is None or med < best[1]:
            best = (sm, med)
        worth = []
        for s, g in cmp[cmp.sampler == sm].groupby("s"):
            vals = g[np.isfinite(g.iid_equivalent)]
            if vals.empty:
                continue
            # beyond the iid range counts as larger than any measured value; below it, as smaller
            keyed = np.where(vals.bound == ">", np.inf, np.where(vals.bound == "<", -np.inf, vals.iid_equivalent))
            ranked = np.sort(keyed)
            mid_i = (len(ranked) - 1) // 2  # the lower median, so it is a value some group has
            pick = vals.iloc[int(np.argsort(keyed, kind="stable")[mid_i])]
            lo, hi = vals.iloc[int(np.argmin(keyed))], vals.iloc[int(np.argmax(keyed))]
            ends = (equivalent_text(lo.iid_equivalent, lo.bound), equivalent_text(hi.iid_equivalent, hi.bound))
            span = f" (range {ends[0]} .. {ends[1]})" if len(vals) > 1 and ends[0] != ends[1] else ""
            worth.append(f"{sm} s={int(s)} matches iid s {'' if pick.bound != '=' else '≈ '}"
                         f"{equivalent_text(pick.iid_equivalent, pick.bound)}{span}")
        groups = cmp[group].drop_duplicates().shape[0]
        lo_t, hi_t = int(c.trials.min()), int(c.trials.max())
        trials = str(lo_t) if lo_t == hi_t else f"{lo_t}–{hi_t}"
        out.append(f"{what}, {sm} against iid at equal s: median ratio {med:.3f} over {len(c)} (group, s) cells "
                   f"({groups} groups, {trials} trials each). "
                   + ("; ".join(worth) + " (the median group; from the iid curve, interpolated in log-log)."
                      if worth else ""))
    if best is not None and len(others) > 1:
        out.append(f"Lowest {what} at equal s: {best[0]} (median ratio to iid {best[1]:.3f}).")
    return out
