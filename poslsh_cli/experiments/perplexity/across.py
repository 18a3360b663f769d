"""The registered comparison across context lengths (docs/PREREGISTRATION_L1024.md, "Across lengths"):
does the gap of Positional LSH to exact ALiBi grow from L = 256 to L = 1024?

Per primary s and per registered seed k of each experiment, the relative gap
``r_k = (bpb(poslsh s, k) - bpb(alibi, k)) / bpb(alibi, k)`` on each experiment's registered endpoint
(:func:`~poslsh_cli.experiments.perplexity.registered.endpoint_rows`); ``D`` is the mean of r at the
longer length minus the mean at the shorter, by Welch's t (the two experiments' models share seed
numbers, nothing else). Two families of one-sided tests, each through Holm over the values of s:
rejecting ``D <= 0`` (SUPPORTED: the gap grows with L) and rejecting ``D >= bound`` (the gap does not
grow by more than ``bound``: NOT SUPPORTED unless the first family rejected too, which reads "grows,
by less than" the bound); neither: INCONCLUSIVE. Both experiments need every registered seed
evaluated as registered, else NOT MEASURED.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from poslsh_cli.experiments.perplexity import gap_figures
from poslsh_cli.experiments.perplexity.registered import endpoint_rows, not_as_registered, per_seed
from poslsh_cli.experiments.perplexity.registered import section as registered_section
from poslsh_cli.verdicts.claims import Status, Verdict
from poslsh_cli.verdicts.declared import Claim, Role
from poslsh_cli.verdicts.stats import t_interval
from poslsh_cli.verdicts.registered import ACROSS_L, AcrossLengths, Difference, Primary, Registration, holm, welch


def section(runs: list[tuple[Path, Any]]) -> Any:
    """The registered experiments' section of a report (:func:`registered.section`) with the registered
    comparison across lengths and its table, when either experiment is among the perplexity runs (their
    directories and rows; else None); its figures are drawn into the first run's ``figures/``."""
    dfs = [df for _, df in runs]
    sec = registered_section(dfs)
    if sec is not None:
        verdicts, table = across_lengths(dfs)
        sec.verdicts += verdicts
        if table:
            sec.add_table(TABLE_HEAD, table)
        try:
            sec.figures = gap_figures.draw(sorted(Path(r) for r, _ in runs)[0], sec.verdicts)
        except Exception as exc:  # a figure that cannot be drawn must not lose the numbers
            sec.paragraphs.append(f"(figures unavailable: {exc or type(exc).__name__})")
    return sec


def relative_gaps(rows: Any, primary: Primary) -> dict:
    """Per training seed, the treatment's bits per byte minus the control's, over the control's."""
    a, b = per_seed(rows, primary.treatment, primary.s), per_seed(rows, primary.control)
    return {k: (a[k] - b[k]) / b[k] for k in sorted(set(a) & set(b))}


def _rows(df: Any, reg: Registration) -> tuple[Any, str]:
    rows = endpoint_rows(df, reg.train_run, reg.steps)
    return rows, not_as_registered(rows, reg)


def across_lengths(dfs: list[Any]) -> tuple[list[Verdict], list[list[str]]]:
    """The registered verdicts across lengths (one per s) and the table of gaps at both lengths, from
    the rows of every perplexity run of the report; ([], []) when neither experiment is among them."""
    import pandas as pd

    spec = ACROSS_L  # the one registered comparison across lengths (its claims are ACROSS)
    dfs = [d for d in dfs if "trained_run" in d.columns]
    if not dfs:
        return [], []
    df = pd.concat(dfs, ignore_index=True)
    runs = set(df.trained_run.astype(str).str.split("/").str[0])
    if not {spec.short.train_run, spec.long.train_run} & runs:
        return [], []
    (short, why_short), (long_, why_long) = _rows(df, spec.short), _rows(df, spec.long)
    claims = [ACROSS[i] for i in ACROSS_L.ids]
    why = "; ".join(f"{r.name}: {w}" for r, w in ((spec.short, why_short), (spec.long, why_long)) if w)
    if why:
        return [c.not_measured(why) for c in claims], []
    gaps = {}
    for ps, pl in zip(spec.short.primary, spec.long.primary):
        a = relative_gaps(short, ps)
        b = relative_gaps(long_, pl)
        gaps[pl.s] = ([a[k] for k in spec.short.seeds], [b[k] for k in spec.long.seeds])
    tests = {s: welch(a, b, spec.bound) for s, (a, b) in gaps.items()}
    above = holm({str(s): t.p_above for s, t in tests.items()}, spec.alpha)
    below = holm({str(s): t.p_below for s, t in tests.items()}, spec.alpha)
    out, table = [], []
    for (s, t), claim in zip(tests.items(), claims):
        grows, within = above[str(s)].rejected, below[str(s)].rejected
        status = Status.SUPPORTED if grows else Status.NOT_SUPPORTED if within else Status.INCONCLUSIVE
        reading = ("grows, by less than " if grows and within else "grows" if grows else
                   "does not grow by more than " if within else "not decided")
        reading += f"{spec.bound:.0%}" if within else ""
        ev = (f"{reading}: D {100 * t.d:+.2f} points of exact ALiBi's bits per byte, 90% [{100 * t.low90:+.2f}, "
              f"{100 * t.high90:+.2f}] (Welch, {t.df:.1f} degrees of freedom); relative gap "
              f"{100 * np.mean(gaps[s][0]):+.2f}% at L={spec.short.seq_len}, {100 * np.mean(gaps[s][1]):+.2f}% at "
              f"L={spec.long.seq_len}; Holm-adjusted p {above[str(s)].adjusted:.4f} (grows), "
              f"{below[str(s)].adjusted:.4f} (within {spec.bound:.0%})")
        out.append(claim.verdict(status, ev, _numbers(s, t, gaps[s], spec)))
        table.append([f"Positional LSH s = {s}", *(_cell(g) for g in gaps[s]), _interval(t), reading])
    return out, table


TABLE_HEAD = ["scheme", "relative gap at L = 256", "relative gap at L = 1024", "D (1024 - 256)", "reading"]


def _claim(p: Primary, key: str, spec: AcrossLengths) -> Claim:
    return Claim(
        f"across/{key}", "perplexity",
        f"registered ({spec.long.name}): the gap of Positional LSH s={p.s} to exact ALiBi, relative to exact ALiBi's "
        f"bits per byte, grows from L={spec.short.seq_len} to L={spec.long.seq_len}",
        f"registered in {spec.long.page} ({spec.long.name}, commit {spec.long.commit[:10]}): per s, D = mean relative "
        f"gap (gap / exact ALiBi's bits per byte, per seed) at L={spec.long.seq_len} minus at L={spec.short.seq_len}, "
        f"Welch's t; Holm over the {len(spec.ids)} values of s at {spec.alpha:.0%} in each direction: D <= 0 rejected, "
        f"SUPPORTED (grows); D >= {spec.bound:.0%} rejected and D <= 0 not, NOT SUPPORTED (does not grow by more than "
        "that); otherwise INCONCLUSIVE", metric="relative gap in bits_per_byte", role=Role.PRIMARY,
        sides=({"position": p.control, "seq_len": spec.short.seq_len}, {"position": p.treatment, "s": p.s,
                                                                         "seq_len": spec.long.seq_len}))


#: the registered claims across lengths, by their ids (one per s)
ACROSS = {key: _claim(p, key, ACROSS_L) for p, key in zip(ACROSS_L.long.primary, ACROSS_L.ids)}


def _cell(values: list) -> str:
    iv = t_interval(values, 0.90)
    return f"{100 * iv.estimate:+.2f}% [{100 * iv.low:+.2f}, {100 * iv.high:+.2f}] ({iv.n} seeds)"


def _interval(t: Difference) -> str:
    return f"{100 * t.d:+.2f} points [{100 * t.low90:+.2f}, {100 * t.high90:+.2f}]"


def _numbers(s: int, t: Difference, gaps: tuple, spec: AcrossLengths) -> dict:
    """The verdict's numbers: D with its interval, and each length's mean relative gap with its 90%
    t-interval over the seeds (what the gap-against-L figure draws)."""
    ends = {}
    for side, values, length in (("short", gaps[0], spec.short.seq_len), ("long", gaps[1], spec.long.seq_len)):
        iv = t_interval(values, 0.90)
        ends.update({side: float(iv.estimate), f"{side}_low": float(iv.low), f"{side}_high": float(iv.high),
                     f"{side}_length": length})
    return {"unit": "fraction of exact ALiBi's bits per byte", "s": s, "d": t.d, "low90": t.low90, "high90": t.high90,
            "df": t.df, **ends}
