"""``poslsh block-stats``'s tables, figures and claims: the largest width against its exact law (with
the power to see a wrong one), the realised largest block against its law, b_max / (σ log log n)
when s grows like log n, and block-length histograms against the theory."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from poslsh_cli.numerics.metrics import fit_loglog_slope
from poslsh_cli.verdicts.claims import Groups, Section, Status, Verdict, slope_text
from poslsh_cli.verdicts.declared import Claim
from poslsh_cli.verdicts.stats import POWER, ks_power, ks_values_needed
from poslsh_cli.numerics.sampling import (
    block_length_pmf, block_max_quantile, derive_seed, width_max_cdf, width_max_draws, width_max_quantile)
from poslsh_cli.verdicts import plotting


def summary(df: Any) -> tuple[list[str], list[list[str]]]:
    head = ["n", "sigma", "s", "b_max median", "law median", "sigma loglog n", "mean_block", "blocks/sample"]
    rows = []
    for (n, sigma, s), g in df.groupby(["n", "sigma", "s"], sort=False):
        rows.append([str(n), f"{sigma:g}", str(s), f"{g['b_max'].median():g}",
                     f"{g['b_max_theory_median'].iloc[0]:.1f}", f"{g['b_max_loglog'].iloc[0]:.1f}",
                     f"{g['mean_block'].mean():.2f}", f"{g['num_blocks'].mean():.1f}"])
    return head, rows


def _with_rule(df: Any) -> Any:
    """Rows labelled by how s was chosen (fixed, or ceil(c ln n)), and b_max / (sigma ln ln n)."""
    import numpy as np

    if "s_per_log_n" not in df.columns:  # runs made before s could grow with n
        df = df.assign(s_per_log_n=np.nan)
    return df.assign(rule=[f"s = ⌈{c:g} ln n⌉" if c == c else f"s = {s}" for c, s in zip(df.s_per_log_n, df.s)],
                     ratio=df.b_max / df.b_max_loglog)


# ---------------------------------------------------------------------------------------------
# figures


def plot(run: Path, df: Any) -> list[Path]:
    import numpy as np
    import pandas as pd

    plt = plotting.pyplot()
    df = _with_rule(df)
    sigmas = sorted(df["sigma"].unique())
    paths = []
    fig, axes = plt.subplots(1, len(sigmas), figsize=(4.3 * len(sigmas), 3.9), squeeze=False)
    for ax, sigma in zip(axes[0], sigmas):
        for i, (rule, g) in enumerate(df[df.sigma == sigma].groupby("rule")):
            agg = g.groupby("n").agg(med=("b_max", "median"), lo=("b_max", lambda v: v.quantile(0.1)),
                                     hi=("b_max", lambda v: v.quantile(0.9)),
                                     law=("b_max_theory_median", "first")).reset_index()
            c = f"C{i % 10}"
            ax.plot(agg["n"], agg["med"], "o-", color=c, ms=4, label=rule)
            ax.fill_between(agg["n"], agg["lo"], agg["hi"], color=c, alpha=0.15, lw=0)
            ax.plot(agg["n"], agg["law"], "--", color=c, lw=1)
        ll = df[df.sigma == sigma].groupby("n")["b_max_loglog"].first()
        ax.plot(ll.index, ll.to_numpy(), ":", color="k", lw=1.2, label="σ ln ln n")
        plotting.log_axes(ax, "sequence length n", y=None)
        ax.set_title(f"σ = {sigma:g}")
        ax.legend(title="solid: median b_max (10–90%)\ndashed: exact law median", title_fontsize=8)
    axes[0][0].set_ylabel("largest block b_max (positions)")
    fig.suptitle("Largest block against n")
    paths += plotting.save(fig, run, "b_max_vs_n")

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for i, ((sigma, rule), g) in enumerate(df.groupby(["sigma", "rule"])):
        agg = g.groupby("n").agg(med=("ratio", "median"), s=("s", "first"), ll=("b_max_loglog", "first")).reset_index()
        c = f"C{i % 10}"
        ax.plot(agg["n"], agg["med"], "o-", color=c, ms=4, label=f"σ={sigma:g}, {rule}")
        lo = [block_max_quantile(0.05, sigma, int(s)) / ll for s, ll in zip(agg["s"], agg["ll"])]
        hi = [block_max_quantile(0.95, sigma, int(s)) / ll for s, ll in zip(agg["s"], agg["ll"])]
        ax.fill_between(agg["n"], lo, hi, color=c, alpha=0.12, lw=0)
    plotting.log_axes(ax, "sequence length n", "b_max / (σ ln ln n), median over trials", y=None)
    ax.set_title("Largest block relative to σ log log n; bands: exact law, 5–95%")
    ax.legend(ncol=2)
    paths += plotting.save(fig, run, "b_max_over_loglog")

    hist_file = run / "block_lengths.csv"
    if hist_file.exists():
        h = pd.read_csv(hist_file)
        sig = sorted(h["sigma"].unique())
        fig, axes = plt.subplots(1, len(sig), figsize=(4.2 * len(sig), 3.6), squeeze=False)
        for ax, sigma in zip(axes[0], sig):
            g = h[(h["sigma"] == sigma) & (h["n"] == h[h["sigma"] == sigma]["n"].max())]
            counts = g.groupby("length")["count"].sum()
            lengths = np.arange(1, int(counts.index.max()) + 1)
            emp = counts.reindex(lengths, fill_value=0).to_numpy() / counts.sum()
            ax.bar(lengths, emp, width=1.0, color="C0", alpha=0.6, label="realised")
            ax.plot(lengths, block_length_pmf(lengths, sigma), "k-", lw=1.2, label="theory")
            plotting.log_axes(ax, "block length", x=None, grid=False)
            ax.set_title(f"σ={sigma:g}, n={int(g['n'].max())}")
            ax.legend()
        axes[0][0].set_ylabel("fraction of blocks")
        paths += plotting.save(fig, run, "block_length_hist")
    return paths


# ---------------------------------------------------------------------------------------------
# report

#: b_max / (sigma log log n) "stays in a bounded band" when its per-n medians stay within this
#: factor of each other over n spanning at least 2^8.
BAND_FACTOR = 1.5
BAND_RULE = (f"per σ, the median of b_max / (σ ln ln n) at each n; SUPPORTED when the largest over the smallest is "
             f"at most {BAND_FACTOR} over at least four n spanning at least 2^8, else NOT SUPPORTED; INCONCLUSIVE "
             "with fewer n; NOT MEASURED without runs where s grows like log n (s_per_log_n)")


#: The exact-law test must be able to see a law this much wider (sigma times it) ...
WIDER = 1.3
#: ... at this level over the (σ, s) groups (Bonferroni).
LAW_ALPHA = 0.01
LAW_RULE = (f"Kolmogorov–Smirnov test of each (σ, s) group's largest widths against the exact law, at {LAW_ALPHA:.0%} "
            f"over the groups (Bonferroni): a group rejected: NOT SUPPORTED; none rejected: SUPPORTED only when, in "
            f"every group, the test rejects a law {WIDER - 1:.0%} wider (σ × {WIDER:g}) with probability at least "
            f"{POWER:g} at the group's number of values (simulated), else INCONCLUSIVE (too few trials to tell)")


WIDTH_LAW = Claim("block_stats/width_law", "block-stats", "the largest width follows (1 − e^{{−t/σ}}(1 + t/σ))^s exactly",
                  LAW_RULE, metric="max_width")
REALISED = Claim("block_stats/realised_largest_block", "block-stats",
                 "the realised largest block b_max follows the law of max ceil(δ_k)",
                 "at least 90% of cells expected inside; NOT SUPPORTED when fewer is significant at 1%", metric="b_max")
BOUNDED = Claim("block_stats/bounded_loglog", "block-stats",
                "b_max / (σ log log n) stays bounded as n grows when s {grows}", BAND_RULE, metric="ratio")


def exact_law_verdict(df: Any) -> Verdict:
    """The largest width against its exact law (:data:`LAW_RULE`): not rejecting the law supports
    it only when the test had the power to reject a law :data:`WIDER` times as wide."""
    import numpy as np
    from scipy import stats

    groups = [(float(sigma), int(s), g) for (sigma, s), g in df.groupby(["sigma", "s"])]
    alpha = LAW_ALPHA / len(groups)
    rng = np.random.default_rng(derive_seed(0, "block-stats", "power"))
    worst = None
    pvals = []
    for sigma, s, g in groups:
        pvals.append(stats.kstest(g.max_width.to_numpy(), lambda t, sg=sigma, ss=s: width_max_cdf(t, sg, ss)).pvalue)
        law = (lambda t, sg=sigma, ss=s: width_max_cdf(t, sg, ss),
               lambda size, gen, sg=sigma, ss=s: width_max_draws(size, WIDER * sg, ss, gen))
        power = ks_power(*law, len(g), alpha, rng)
        if worst is None or power < worst[0]:
            worst = (power, sigma, s, g, law)
    power, sigma, s, g, law = worst
    ev = (f"smallest Kolmogorov–Smirnov p-value {min(pvals):.3g} over {len(groups)} (σ, s) groups; power to reject "
          f"a law {WIDER - 1:.0%} wider {power:.2f} at {len(g)} values a group (the least, σ={sigma:g}, s={s})")
    if min(pvals) <= alpha:
        return WIDTH_LAW.verdict(Status.NOT_SUPPORTED, ev)
    if power >= POWER:
        return WIDTH_LAW.verdict(Status.SUPPORTED, ev)
    need = ks_values_needed(*law, alpha, rng, start=len(g))
    per_trial = max(1, len(g) // max(1, g.trial.nunique()))  # values a trial adds to the group (its n)
    ev += (f", below {POWER:g}: about {need} values a group reach it (trials={math.ceil(need / per_trial)})")
    return WIDTH_LAW.verdict(Status.INCONCLUSIVE, ev)


def report(run: Path, df: Any) -> Section:
    import numpy as np
    import pandas as pd
    from scipy import stats

    sec = Section("block-stats", run, "Block sizes: the largest block against the exact law and σ log log n")
    df = _with_rule(df)
    # 1. the exact law of the largest width (continuous: Kolmogorov-Smirnov), with the power to see a wrong one
    sec.verdicts.append(exact_law_verdict(df))
    # 2. the realised largest block (positions) against its law: inside the 5-95% range 90% of the time
    if {"b_max_law_q05", "b_max_law_q95"} <= set(df.columns):
        inside = (df.b_max >= df.b_max_law_q05) & (df.b_max <= df.b_max_law_q95)
        k, m = int(inside.sum()), len(inside)
        p = float(stats.binom.cdf(k, m, 0.9))
        sec.verdicts.append(REALISED.verdict(
            Status.SUPPORTED if p > 0.01 else Status.NOT_SUPPORTED,
            f"{k}/{m} cells ({k / m:.1%}) inside the law's 5–95% range; binomial lower-tail p = {p:.3g}"))
    logs, fixed = df[df.s_per_log_n.notna()], df[df.s_per_log_n.isna()]
    # 3. s ~ log n: b_max / (sigma log log n) bounded
    if logs.empty:
        sec.verdicts.append(BOUNDED.not_measured("this run keeps s fixed (run experiment=block_stats_loglog_paper)",
                                                 grows="grows like log n"))
    else:
        groups = Groups()
        for sigma, g in logs.groupby("sigma"):
            med = g.groupby("n").ratio.median()
            law = pd.Series({n: width_max_quantile(0.5, sigma, int(g[g.n == n].s.iloc[0])) / (sigma * math.log(math.log(n)))
                             for n in med.index})
            band = float(med.max() / med.min())
            short = len(med) < 4 or med.index.max() / med.index.min() < 2**8
            groups.add(Status.INCONCLUSIVE if short else band <= BAND_FACTOR,
                       f"σ={sigma:g}: median ratio {med.iloc[0]:.2f} at n=2^{math.log2(med.index[0]):.0f} → "
                      f"{med.iloc[-1]:.2f} at n=2^{math.log2(med.index[-1]):.0f}, band ×{band:.2f} "
                      f"(exact law ×{law.max() / law.min():.2f})")
        c = float(logs.s_per_log_n.iloc[0])
        sec.verdicts.append(groups.verdict(BOUNDED, grows=f"= ⌈{c:g} ln n⌉"))
    # fixed s: does b_max grow with n? (its law does not depend on n)
    for (sigma, s), g in fixed.groupby(["sigma", "s"]):
        if g.n.nunique() < 2:
            continue
        med = g.groupby("n").b_max.median()
        fit = fit_loglog_slope(np.log2(g.n.to_numpy(dtype=float)), g.b_max.to_numpy(dtype=float))
        sec.paragraphs.append(
            f"σ={sigma:g}, s={s} fixed: median b_max {med.iloc[0]:g} at n={med.index[0]} and {med.iloc[-1]:g} at "
            f"n={med.index[-1]} (log-log slope against log₂ n {slope_text(fit)}).")
    summary_rows = []
    for (sigma, rule), g in df.groupby(["sigma", "rule"]):
        agg = g.groupby("n").agg(b=("b_max", "median"), law=("b_max_theory_median", "first"), r=("ratio", "median"))
        summary_rows.append({"σ": sigma, "s": rule, "n": f"{agg.index.min()}–{agg.index.max()} ({len(agg)} values)",
                             "trials": g.trial.nunique(), "b_max median": f"{agg.b.min():g}–{agg.b.max():g}",
                             "law median of max δ": f"{agg.law.min():.1f}–{agg.law.max():.1f}",
                             "b_max / (σ ln ln n)": f"{agg.r.min():.2f}–{agg.r.max():.2f}"})
    sec.tables.append(pd.DataFrame(summary_rows))
    full = df.groupby(["sigma", "s", "n"]).agg(trials=("trial", "nunique"), b_max_median=("b_max", "median"),
                                               law_median=("b_max_theory_median", "first"),
                                               sigma_loglog_n=("b_max_loglog", "first"), ratio=("ratio", "median"),
                                               mean_block=("mean_block", "mean")).reset_index()
    sec.details.append(("every (σ, s, n): medians over trials (results.csv has every trial)", full.round(3)))
    return sec
