"""``poslsh matrix-error``'s tables, figures and claims: the decay of ‖L* − M̃‖ against s (slopes
over s ≥ ASYMPTOTIC_S), Theorem 2.1's expectation bound in every cell, the samplers side by side,
and the fast O(n) path against the dense float64 reference."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from poslsh_cli.numerics.metrics import fit_loglog_slope
from poslsh_cli.verdicts.declared import Claim
from poslsh_cli.verdicts.claims import (ASYMPTOTIC_S, DECAY_RULE, Groups, Section, Status, asymptotic_fit,
                                        decay_status, few, fmt, slope_text)
from poslsh_cli.numerics import theorem
from poslsh_cli.numerics.theorem import expectation_bound
from poslsh_cli.verdicts.samplers import comparison, samplers_of, slope_table, with_sampler, worth_sentences
from poslsh_cli.verdicts import plotting


def no_fit_text(s: Any) -> str:
    """What a slope cell says when there is no fit: how many s >= ASYMPTOTIC_S were run of the
    three a fit needs."""
    import numpy as np

    k = int(np.unique(np.asarray(s)[np.asarray(s) >= ASYMPTOTIC_S]).size)
    return f"– (fit needs 3 s≥{ASYMPTOTIC_S}, has {k})"


def summary(df: Any) -> tuple[list[str], list[list[str]]]:
    """Per (n, sigma, method): the decay slopes by the report's rule (fits over s >= 8) and the
    error at the largest s."""
    df = with_sampler(df)
    head = ["n", "sigma", "sampler", "method", f"slope spec (s≥{ASYMPTOTIC_S})", f"slope max (s≥{ASYMPTOTIC_S})", "s_max",
            "spec_rel", "max_err", "secs"]
    rows = []
    for (n, sigma, sampler, method), g in df.groupby(["n", "sigma", "sampler", "method"], sort=False):
        fs, fm = asymptotic_fit(g["s"], g["spectral_err"]), asymptotic_fit(g["s"], g["max_err"])
        top = g[g["s"] == g["s"].max()]
        none = no_fit_text(g["s"])
        rows.append([str(n), f"{sigma:g}", sampler, method, f"{fs.slope:.3f}" if fs else none, f"{fm.slope:.3f}" if fm else none,
                     str(int(top['s'].iloc[0])), f"{top['spectral_rel'].mean():.4g}", f"{top['max_err'].mean():.4g}",
                     f"{g['seconds'].sum():.2f}"])
    return head, rows


# ---------------------------------------------------------------------------------------------
# figures


def plot(run: Path, df: Any) -> list[Path]:
    plt = plotting.pyplot()
    df = with_sampler(df)
    every = df[df["method"] == ("fast" if (df["method"] == "fast").any() else "dense")]
    main = every[every.sampler == samplers_of(every)[0]]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    lab = lambda k: f"n={k[0]}, σ={k[1]:g}"  # noqa: E731
    plotting.decay_panel(axes[0], main, "s", "spectral_rel", ["n", "sigma"], lab)
    _draw_bound(axes[0], main)
    axes[0].set_title("spectral error  ‖L* − M̃‖₂ / ‖L*‖₂  (dotted: Theorem 2.1's bound)")
    plotting.decay_panel(axes[1], main, "s", "max_err", ["n", "sigma"], lab)
    axes[1].set_title("max-norm error  max |L* − M̃|")
    for ax in axes:
        ax.set_xlabel("number of samples s")
        ax.legend(title="mean, min–max band; dashed: c/√s", title_fontsize=8)
    fig.suptitle("Positional LSH: error of the mean mask against s (Theorem 2.1: O(1/√s))")
    paths = plotting.save(fig, run, "matrix_error_vs_s")
    if len(samplers_of(every)) > 1:
        paths += _plot_samplers(run, every)
    if set(df["method"]) >= {"fast", "dense"}:
        paths += _plot_fast_vs_dense(run, df)
    return paths


def _plot_samplers(run: Path, df: Any) -> list[Path]:
    """Spectral and max-norm error against s, one line per sampler, one row of panels per (n, σ)
    (at most four)."""
    plt = plotting.pyplot()
    groups = list(df.groupby(["n", "sigma"], sort=True))[:4]
    fig, axes = plt.subplots(len(groups), 2, figsize=(11, 3.6 * len(groups)), squeeze=False)
    order = {sm: i for i, sm in enumerate(samplers_of(df))}
    for row, ((n, sigma), g) in zip(axes, groups):
        g = g.assign(_order=g.sampler.map(order)).sort_values("_order")
        for ax, col, name in ((row[0], "spectral_rel", "‖L* − M̃‖₂ / ‖L*‖₂"), (row[1], "max_err", "max |L* − M̃|")):
            plotting.decay_panel(ax, g, "s", col, ["_order"], lambda k: samplers_of(df)[int(k[0])])
            ax.set_title(f"n={n}, σ={sigma:g}: {name}")
            ax.set_xlabel("number of samples s")
            ax.legend(title="sampler (mean, min–max band)", title_fontsize=8)
    fig.suptitle("Mask samplers side by side: every one unbiased, the error at equal s differs")
    return plotting.save(fig, run, "matrix_error_samplers")


def _draw_bound(ax: Any, df: Any) -> None:
    """Theorem 2.1's expectation bound over ‖L*‖₂, dotted, in each (n, σ) group's colour (the
    order decay_panel draws them in)."""
    import numpy as np

    for i, ((n, sigma), g) in enumerate(df.groupby(["n", "sigma"], sort=True)):
        xs = np.unique(np.asarray(g["s"], dtype=int))
        norm = float(g["kernel_norm"].iloc[0])
        ax.plot(xs, [expectation_bound(float(sigma), int(n), int(k)) / norm for k in xs], ":", color=f"C{i % 10}",
                lw=1.2)


def _plot_fast_vs_dense(run: Path, df: Any) -> list[Path]:
    """The fast O(n) path against the dense float64 reference: same errors, far less time."""
    plt = plotting.pyplot()
    piv = df.pivot_table(index=["n", "sigma", "s", "trial"], columns="method",
                         values=["spectral_err", "seconds"]).dropna().reset_index()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    ax = axes[0]
    f, d = piv[("spectral_err", "fast")], piv[("spectral_err", "dense")]
    floor = 1e-17  # equal values (difference 0) are drawn here
    rel = ((f - d).abs() / d).clip(lower=floor)
    ax.scatter(d, rel, s=14, color="C0", label="cells (0 drawn at 1e-17)")
    tol = float(df[df.method == "fast"]["lanczos_tol"].max()) if "lanczos_tol" in df else float("nan")
    if tol > 0:
        ax.axhline(tol, color="C3", ls="--", lw=1, label=f"certified interval width {tol:g}")
    plotting.log_axes(ax, "‖L* − M̃‖₂ (dense float64 eigendecomposition)", "|fast − dense| / dense", x=10)
    ax.set_title("spectral error: fast (Lanczos) against dense")
    ax.legend()
    ax = axes[1]
    t = piv.groupby(("n", ""))[[("seconds", "fast"), ("seconds", "dense")]].median()
    ax.plot(t.index, t[("seconds", "dense")], "o-", color="C3", label="dense (n×n float64)")
    ax.plot(t.index, t[("seconds", "fast")], "o-", color="C0", label="fast (O(n) matvecs)")
    plotting.log_axes(ax, "n", "seconds per cell (median)")
    ax.set_title("time against n")
    ax.legend()
    return plotting.save(fig, run, "fast_vs_dense")


# ---------------------------------------------------------------------------------------------
# report


def _converged(df: Any) -> tuple[Any, int]:
    """Rows whose Lanczos met its tolerance, and how many did not (left out of fits)."""
    if "converged" not in df.columns:
        return df, 0
    ok = df.converged.astype(str).str.lower().isin(["true", "1"])
    return df[ok], int((~ok).sum())


def report(run: Path, df: Any) -> Section:
    import numpy as np
    import pandas as pd

    df = with_sampler(df)
    dense_check = set(df.method) == {"fast", "dense"}
    sec = Section("matrix-error", run, "Matrix approximation: ‖L* − M̃‖ decays like 1/√s (Theorem 2.1)")
    every, unconverged = _converged(df[df.method == ("fast" if (df.method == "fast").any() else "dense")])
    samplers = samplers_of(every) if len(every) else ["iid"]
    main = every[every.sampler == samplers[0]]
    if samplers[0] != "iid":
        sec.paragraphs.append(f"No iid rows: the decay and Theorem 2.1 checks below use sampler={samplers[0]} "
                              "(the theorem is stated for independent masks).")
    elif len(samplers) > 1:
        sec.paragraphs.append("The decay and Theorem 2.1 checks below use the iid rows (the theorem is stated for "
                              "independent masks); the samplers are compared after them.")
    if unconverged:
        sec.paragraphs.append(f"{unconverged} rows did not certify their interval within lanczos_tol "
                              "(converged=false); they are left out of every fit.")
    rows, all_max, asym_max, spec_groups, max_groups = [], [], [], Groups(), Groups()
    for (n, sigma), g in main.groupby(["n", "sigma"]):
        fs, fm = asymptotic_fit(g.s, g.spectral_err), asymptotic_fit(g.s, g.max_err)
        if fs is not None:
            spec_groups.add(decay_status(fs), f"n={n} σ={sigma:g}: {slope_text(fs)}")
            max_groups.add(decay_status(fm), f"n={n} σ={sigma:g}: {slope_text(fm)}")
            asym_max.append(fm.slope)
        whole = fit_loglog_slope(g.s, g.max_err)
        all_max.append(whole.slope)
        top = g[g.s == g.s.max()]
        rows.append({"n": n, "σ": sigma,
                     f"s ≥ {ASYMPTOTIC_S}": ",".join(str(x) for x in sorted(g.s[g.s >= ASYMPTOTIC_S].unique())) or "–",
                     "trials": g.trial.nunique(),
                     "slope spectral [95% CI]": slope_text(fs) + f" {decay_status(fs).value}" if fs else no_fit_text(g.s),
                     "slope max [95% CI]": slope_text(fm) + f" {decay_status(fm).value}" if fm else no_fit_text(g.s),
                     "slopes over all s (spec / max)": f"{fit_loglog_slope(g.s, g.spectral_err).slope:.3f} / {whole.slope:.3f}",
                     "spectral_rel at s_max": fmt(top.spectral_rel.mean()), "max_err at s_max": fmt(top.max_err.mean())})
    sec.tables.append(pd.DataFrame(rows))
    if spec_groups.statuses:
        for claim, groups in ((SPECTRAL_DECAY, spec_groups), (MAX_DECAY, max_groups)):
            sec.verdicts.append(groups.verdict(claim, evidence=f"(n, σ) groups: {groups.tally()}; "
                                                               f"slopes {few(groups.evidence)}"))
        a, b = float(np.nanmedian(all_max)), float(np.nanmedian(asym_max))
        if math.isfinite(a) and math.isfinite(b):
            word = "shallower" if a > b else "steeper" if a < b else "the same"
            text = (f"Over all s the max-norm slope is {word} than over s ≥ {ASYMPTOTIC_S} (median over (n, σ) "
                    f"{a:.3f} against {b:.3f}).")
            if a > b:
                text += " With few samples M̃ takes only the values k/s, so the largest entrywise gap stays near 1."
            sec.paragraphs.append(text)
    elif not dense_check:
        sec.verdicts.append(SPECTRAL_DECAY.not_measured(f"fewer than three s ≥ {ASYMPTOTIC_S} in every (n, σ)"))
    _report_theorem(sec, main)
    if len(samplers) > 1:
        _report_samplers(sec, every)
    if dense_check:
        if not spec_groups.statuses:  # a run made to check the fast path, not to measure the decay
            sec.title = "Fast O(n) path against the dense float64 reference"
        _report_dense_check(sec, df)
    return sec


def _report_samplers(sec: Section, df: Any) -> None:
    """The samplers side by side: decay slopes, error ratios to iid at equal s and the iid s each
    sampler's s is worth (:mod:`poslsh_cli.verdicts.samplers`)."""
    sec.tables.append(slope_table(df, ["n", "sigma"], {"spectral": "spectral_err", "max": "max_err"}))
    spec = comparison(df, ["n", "sigma"], "spectral_err")
    mx = comparison(df, ["n", "sigma"], "max_err")
    sec.paragraphs.extend(worth_sentences(spec, "spectral error", ["n", "sigma"]))
    sec.paragraphs.extend(worth_sentences(mx, "max-norm error", ["n", "sigma"]))
    table = spec.rename(columns={"mean": "spectral_err (mean)", "ratio_to_iid": "spectral ratio to iid",
                                 "iid_equivalent": "iid s matched (spectral)"})
    table["max_err (mean)"] = mx["mean"].values
    table["max ratio to iid"] = mx["ratio_to_iid"].values
    sec.details.append(("Samplers per (n, σ, s): mean errors over trials, ratio to iid at equal s, the iid s of the "
                        "same mean spectral error (bound: > beyond the largest iid s run)", table))


THEOREM_RULE = ("holds: in every (n, σ, s) cell the mean over trials of the certified upper end of ‖L* − M̃‖₂ "
                "(spectral_err_bound; dense: the exact value) is at most Ψσ (√(ln n / s) + ln n / s); "
                "tightness = that mean / the bound")


SPECTRAL_DECAY = Claim("matrix_error/spectral_decay", "matrix-error", "spectral error decays like s^-1/2", DECAY_RULE,
                       metric="spectral_err")
MAX_DECAY = Claim("matrix_error/max_decay", "matrix-error", "max-norm error decays like s^-1/2", DECAY_RULE,
                  metric="max_err")
EXPECTATION_BOUND = Claim("matrix_error/expectation_bound", "matrix-error",
                          "Theorem 2.1's expectation bound holds in every cell", THEOREM_RULE, metric="spectral_err_bound")
FAST_EQUALS_DENSE = Claim("matrix_error/fast_equals_dense", "matrix-error",
                          "the O(n) fast path equals the dense float64 reference",
                          "relative spectral difference at most the certified interval's width ({tol}), the dense "
                          "value inside the interval, and max norms equal bit for bit", metric="spectral_err",
                          sides=({"method": "dense"}, {"method": "fast"}))


def theorem_cells(df: Any) -> Any:
    """Per (n, sigma, s): trials, the mean certified error, Theorem 2.1's expectation bound (recomputed
    from n, sigma, s, so runs without the column are checked too), their ratio, the tail bound at the
    mean error and the s the theorem asks for it."""
    import numpy as np
    import pandas as pd

    upper = df["spectral_err_bound"] if "spectral_err_bound" in df.columns else df["spectral_err"]
    g = df.assign(upper=upper.fillna(df["spectral_err"])).groupby(["n", "sigma", "s"], sort=True)
    out = g.agg(trials=("trial", "nunique"), mean_err=("upper", "mean")).reset_index()
    out["bound"] = [theorem.expectation_bound(sg, int(n), int(k)) for n, sg, k in zip(out.n, out.sigma, out.s)]
    out["tightness"] = out.mean_err / out.bound
    out["tail_bound"] = [theorem.tail_bound(sg, int(n), int(k), e) for n, sg, k, e in zip(out.n, out.sigma, out.s, out.mean_err)]
    out["s_needed"] = [theorem.s_needed(sg, int(n), e) if e > 0 else np.nan
                       for n, sg, e in zip(out.n, out.sigma, out.mean_err)]
    return pd.DataFrame(out)


def _report_theorem(sec: Section, df: Any) -> None:
    """Theorem 2.1's expectation bound against the measured mean in every cell, and how tight it is."""
    import pandas as pd

    if df.empty:
        return
    cells = theorem_cells(df)
    holds = cells.mean_err <= cells.bound
    rows = []
    for sigma, g in cells.groupby("sigma"):
        rows.append({"σ": sigma, "Ψσ": fmt(theorem.psi_sigma(float(sigma))),
                     "cells": len(g), "bound holds": f"{int((g.mean_err <= g.bound).sum())}/{len(g)}",
                     "tightness min / median / max": f"{g.tightness.min():.3g} / {g.tightness.median():.3g} / "
                                                     f"{g.tightness.max():.3g}",
                     "tail bound < 1 (cells)": f"{int((g['tail_bound'] < 1).sum())}/{len(g)}",
                     "s needed at the measured error (median)": f"{g.s_needed.median():.3g}"})
    sec.tables.append(pd.DataFrame(rows))
    bad = cells[~holds]
    trials = sorted(set(int(t) for t in cells.trials))
    evidence = (f"{int(holds.sum())} of {len(cells)} (n, σ, s) cells, mean over {'/'.join(map(str, trials))} "
                f"trials; measured / bound {cells.tightness.min():.3g} .. {cells.tightness.max():.3g}")
    if len(bad):
        worst = bad.loc[bad.tightness.idxmax()]
        evidence += (f"; exceeded at e.g. n={int(worst.n)} σ={worst.sigma:g} s={int(worst.s)}: "
                     f"{worst.mean_err:.4g} > {worst.bound:.4g}")
    sec.verdicts.append(EXPECTATION_BOUND.verdict(Status.SUPPORTED if holds.all() else Status.NOT_SUPPORTED, evidence))
    sec.details.append(("Theorem 2.1 per cell: mean certified error, expectation bound, tail bound at the mean error, "
                        "s needed", cells))


def _report_dense_check(sec: Section, df: Any) -> None:
    piv = df.pivot_table(index=["n", "sigma", "s", "trial"], columns="method",
                         values=["spectral_err", "max_err", "seconds"]).dropna()
    if piv.empty:
        return
    rel = (piv["spectral_err"]["fast"] - piv["spectral_err"]["dense"]).abs() / piv["spectral_err"]["dense"]
    exact = bool((piv["max_err"]["fast"] == piv["max_err"]["dense"]).all())
    tol = float(df[df.method == "fast"].lanczos_tol.max()) if "lanczos_tol" in df else 1e-6
    speed = (piv["seconds"]["dense"] / piv["seconds"]["fast"]).groupby(level="n").median()
    ok = bool(rel.max() <= max(tol, 1e-12) and exact)
    inside = True
    if "spectral_err_bound" in df.columns:
        b = df[df.method == "fast"].set_index(["n", "sigma", "s", "trial"])["spectral_err_bound"]
        d = piv["spectral_err"]["dense"]
        inside = bool((d.reindex(b.index).dropna() <= b.reindex(d.index).dropna() * (1 + 1e-12)).all())
    ok = ok and inside
    sec.verdicts.append(FAST_EQUALS_DENSE.verdict(
        Status.SUPPORTED if ok else Status.NOT_SUPPORTED,
        f"largest relative spectral difference {rel.max():.2g} over {len(rel)} cells; dense inside every certified "
        f"interval: {inside}; max norm bit-identical: {exact}", tol=f"{tol:g}"))
    sec.paragraphs.append("Dense time over fast time (median over cells): "
                          + ", ".join(f"n={n}: {x:.1f}x" for n, x in speed.items()) + ".")
