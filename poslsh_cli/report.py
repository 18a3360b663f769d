"""``poslsh report``: one markdown and one self-contained HTML report beside the runs.

Each section puts a claim of the paper beside what the runs measured and says whether the
measurement supports it, with the number and the rule used. The report reads results and draws
figures through :mod:`poslsh_cli.plotting`; it computes only fits and summary statistics.
"""
from __future__ import annotations

import base64
import datetime as _dt
import html
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from poslsh_cli.metrics import fit_loglog_slope
from poslsh_cli.rundir import atomic_write_text, find_runs, load_run

ORDER = ["matrix-error", "block-stats", "output-error", "bench", "sample"]
TITLES = {
    "matrix-error": "Matrix approximation: ‖L* − M̃‖ decays like 1/√s (Theorem 2.1)",
    "block-stats": "Block sizes: the largest block against the exact law and σ log log n",
    "output-error": "Attention outputs on real activations: error against s, with baselines",
    "bench": "Speed: Positional-LSH attention against exact and windowed ALiBi",
    "sample": "Sampled masks",
}


@dataclass
class Section:
    command: str
    run: Path
    paragraphs: list[str] = field(default_factory=list)
    tables: list[pd.DataFrame] = field(default_factory=list)
    figures: list[Path] = field(default_factory=list)
    verdicts: list[tuple[str, bool | None, str]] = field(default_factory=list)  # claim, supported, evidence


def _fmt(x: Any, digits: int = 3) -> str:
    if isinstance(x, (float, np.floating)):
        if not math.isfinite(x):
            return "–"
        return f"{x:.{digits}g}"
    return str(x)


def _slope_cell(fit: Any) -> str:
    return f"{fit.slope:.3f} [{fit.ci_low:.3f}, {fit.ci_high:.3f}]" if math.isfinite(fit.slope) else "–"


def _half_rule(fit: Any) -> bool:
    """Consistent with a -1/2 exponent: the 95% interval contains -0.5, or the slope is within 0.1."""
    return bool(math.isfinite(fit.slope) and ((fit.ci_low <= -0.5 <= fit.ci_high) or abs(fit.slope + 0.5) <= 0.1))


#: Fits of the decay exponent use s >= this (when three or more such s were run): at small s the
#: entries of M~ are coarse multiples of 1/s and the max norm saturates near 1, so the log-log
#: slope there says nothing about the O(1/sqrt(s)) regime of Theorem 2.1.
ASYMPTOTIC_S = 8


def _asymptotic(g: pd.DataFrame) -> pd.DataFrame | None:
    big = g[g.s >= ASYMPTOTIC_S]
    return big if big.s.nunique() >= 3 else None


def section_matrix_error(run: Path, df: pd.DataFrame) -> Section:
    sec = Section("matrix-error", run)
    rows, ok_spec, ok_max = [], [], []
    fast = df[df.method == ("fast" if (df.method == "fast").any() else "dense")]
    for (n, sigma), g in fast.groupby(["n", "sigma"]):
        a = _asymptotic(g)
        if a is not None:
            fs, fm = fit_loglog_slope(a.s, a.spectral_err), fit_loglog_slope(a.s, a.max_err)
            ok_spec.append(_half_rule(fs))
            ok_max.append(_half_rule(fm))
        else:  # too few large s (e.g. a dense-check run): report the slopes, judge nothing
            fs = fm = fit_loglog_slope(g.s[:0], g.s[:0])
        top = g[g.s == g.s.max()]
        rows.append({"n": n, "sigma": sigma, "fit s range": f"{a.s.min()}–{a.s.max()}" if a is not None else "–",
                     "trials": g.trial.nunique(),
                     "slope spectral [95% CI]": _slope_cell(fs), "slope max [95% CI]": _slope_cell(fm),
                     "slopes over all s (spec / max)": f"{fit_loglog_slope(g.s, g.spectral_err).slope:.3f} / "
                                                       f"{fit_loglog_slope(g.s, g.max_err).slope:.3f}",
                     "spectral_rel at s_max": _fmt(top.spectral_rel.mean()), "max_err at s_max": _fmt(top.max_err.mean())})
    sec.tables.append(pd.DataFrame(rows))
    rule = (f"fits over s >= {ASYMPTOTIC_S} where three such s exist; rule: -0.5 in the 95% interval "
            "or the slope within 0.1 of it")
    if ok_spec:
        sec.verdicts.append(("spectral error decays like s^-1/2", all(ok_spec),
                             f"{sum(ok_spec)}/{len(ok_spec)} (n, σ) pass ({rule})"))
        sec.verdicts.append(("max-norm error decays like s^-1/2", all(ok_max),
                             f"{sum(ok_max)}/{len(ok_max)} (n, σ) pass (same rule)"))
    sec.paragraphs.append("Over all s the max-norm slope is shallower: with few samples M~ takes only the values "
                          "k/s and the largest entrywise gap saturates near 1 (both columns are shown).")
    both = df[df.method.isin(["fast", "dense"])]
    if set(both.method) == {"fast", "dense"}:
        piv = both.pivot_table(index=["n", "sigma", "s", "trial"], columns="method", values=["spectral_err", "max_err", "seconds"])
        rel = (piv["spectral_err"]["fast"] - piv["spectral_err"]["dense"]).abs() / piv["spectral_err"]["dense"]
        exact = bool((piv["max_err"]["fast"] == piv["max_err"]["dense"]).all())
        nmax = both.n.max()
        speed = (piv["seconds"]["dense"] / piv["seconds"]["fast"]).xs(nmax, level="n")
        sec.verdicts.append(("the O(n) fast path equals the dense float64 reference", bool(rel.max() < 1e-6 and exact),
                             f"largest relative spectral difference {rel.max():.2g}; max norm bit-identical: {exact}; "
                             f"at n={nmax} fast is {speed.median():.0f}x faster than dense (median over cells)"))
    return sec


def section_block_stats(run: Path, df: pd.DataFrame) -> Section:
    from scipy import stats

    from poslsh_cli.sampling import width_max_cdf

    sec = Section("block-stats", run)
    rows, pvals = [], []
    for (sigma, s), g in df.groupby(["sigma", "s"]):
        ks = stats.kstest(g.max_width.to_numpy(), lambda t: width_max_cdf(t, sigma, s))
        pvals.append(ks.pvalue)
        for n, gn in g.groupby("n"):
            rows.append({"sigma": sigma, "s": s, "n": n, "trials": len(gn), "b_max median": _fmt(gn.b_max.median()),
                         "law median of max δ": _fmt(gn.b_max_theory_median.iloc[0]),
                         "σ log log n": _fmt(gn.b_max_loglog.iloc[0]), "mean block": _fmt(gn.mean_block.mean()),
                         "KS p (max δ vs law, all n)": _fmt(ks.pvalue, 2)})
    sec.tables.append(pd.DataFrame(rows))
    # Bonferroni over the (sigma, s) groups at 1%
    ok = bool(min(pvals) * len(pvals) > 0.01) if pvals else None
    sec.verdicts.append(("the largest width follows (1 - e^{-t/σ}(1 + t/σ))^s exactly", ok,
                         f"smallest Kolmogorov-Smirnov p-value {min(pvals):.3g} over {len(pvals)} (σ, s) groups "
                         f"(Bonferroni at 1%)"))
    ratio = (df.b_max / df.b_max_loglog).replace([np.inf, -np.inf], np.nan).dropna()
    sec.paragraphs.append(
        f"b_max / (σ log log n) over all cells: median {ratio.median():.2f}, 10–90% {ratio.quantile(0.1):.2f}–"
        f"{ratio.quantile(0.9):.2f}. With s fixed, b_max does not grow with n (its law does not depend on n); "
        "σ log log n is the paper's scale for s of order log n.")
    return sec


def section_output_error(run: Path, df: pd.DataFrame) -> Section:
    sec = Section("output-error", run)
    rows, ok_slope, ok_base = [], [], []
    model = str(df.model.iloc[0])
    for layer, g in df.groupby("layer"):
        p = g[g.method == "poslsh"]
        if p.empty:
            continue
        med = p.groupby(["s", "trial"])["rel_fro"].median().reset_index()
        fit = fit_loglog_slope(med.s, med.rel_fro)
        smax = p.s.max()
        top = p[p.s == smax].rel_fro.median()
        base = {m: g[g.method == m].rel_fro.median() for m in ("no_bias", "fixed_block", "windowed")}
        ok_slope.append(-0.7 <= fit.slope <= -0.3)
        beaten = [base[m] for m in ("no_bias", "fixed_block") if np.isfinite(base[m])]
        ok_base.append(all(top < b for b in beaten))
        rows.append({"layer": layer, "slope [95% CI]": _slope_cell(fit), f"poslsh s={smax}": _fmt(top),
                     "no bias": _fmt(base["no_bias"]), "fixed block": _fmt(base["fixed_block"]),
                     "windowed": _fmt(base["windowed"])})
    sec.paragraphs.append(f"Model {model}, n={int(df.n.iloc[0])}, {df['head'].nunique()} heads, "
                          f"{'causal' if df.causal.iloc[0] else 'bidirectional'}; medians over heads of "
                          "‖T* − T̃‖_F / ‖T*‖_F against exact ALiBi (float64).")
    sec.tables.append(pd.DataFrame(rows))
    all_med = df[df.method == "poslsh"].groupby(["s", "trial"])["rel_fro"].median().reset_index()
    fit = fit_loglog_slope(all_med.s, all_med.rel_fro)
    sec.verdicts.append(("output error falls with s (slope in [-0.7, -0.3])", bool(all(ok_slope)) if ok_slope else None,
                         f"all layers pooled: slope {_slope_cell(fit)}; {sum(ok_slope)}/{len(ok_slope)} layers in range"))
    sec.verdicts.append(("at the largest s Positional LSH beats the no-bias and fixed-block baselines",
                         bool(all(ok_base)) if ok_base else None, f"{sum(ok_base)}/{len(ok_base)} layers (medians over heads)"))
    win = df[df.method == "windowed"]
    if len(win):
        top = df[(df.method == "poslsh") & (df.s == df.s.max())].rel_fro.median()
        sec.paragraphs.append(f"Windowed exact ALiBi (median {win.rel_fro.median():.3g}) is far more accurate than "
                              f"Positional LSH at s={df.s.max()} ({top:.3g}) here: it keeps the exact bias where it "
                              "matters and drops only a negligible tail.")
    return sec


def section_bench(run: Path, df: pd.DataFrame) -> Section:
    from poslsh_cli.experiments.bench import crossover, summary

    sec = Section("bench", run)
    head, rows = summary(df)
    sec.tables.append(pd.DataFrame(rows, columns=head))
    dev = df.device.iloc[0]
    for s in sorted(df[df.method == "poslsh"].s.unique()):
        x = crossover(df, "poslsh", lambda f, s=s: f[f.s == s])
        sec.paragraphs.append(f"Positional LSH s={s} is faster than exact from n={_fmt(x)} on ({dev}).")
    p = df[df.method == "poslsh"]
    if len(p) and p.n.nunique() > 1:
        fits = {s: fit_loglog_slope(g.n, g.seconds) for s, g in p.groupby("s")}
        ex = df[df.method == "exact"]
        fe = fit_loglog_slope(ex.n, ex.seconds) if ex.n.nunique() > 1 else None
        txt = ", ".join(f"s={s}: {f.slope:.2f}" for s, f in fits.items())
        sec.verdicts.append(("Positional-LSH time grows near-linearly in n (Theorem 2.2)",
                             bool(all(f.slope < 1.3 for f in fits.values())),
                             f"log-log slope of time against n: {txt}" + (f"; exact: {fe.slope:.2f}" if fe else "")))
    # who wins the Pareto front
    from poslsh_cli.plotting import _pareto

    winners = {}
    for n, g in df[df.method != "exact"].dropna(subset=["rel_fro"]).groupby("n"):
        front = _pareto(g[["seconds", "rel_fro", "method"]].to_numpy())
        winners[n] = sorted(set(front[:, 2]))
    if winners:
        sec.paragraphs.append("Error–time Pareto front per n: " + "; ".join(f"n={n}: {', '.join(w)}" for n, w in winners.items())
                              + ". At matched error (table), the cheapest windowed exact ALiBi is the method to beat.")
    return sec


def section_sample(run: Path, df: pd.DataFrame) -> Section:
    sec = Section("sample", run)
    sec.paragraphs.append(f"{len(df)} sampled partitions; mean block {df.mean_block.mean():.2f}, largest {df.max_block.max()}.")
    return sec


BUILDERS = {"matrix-error": section_matrix_error, "block-stats": section_block_stats,
            "output-error": section_output_error, "bench": section_bench, "sample": section_sample}


def build(run_dirs: list[Path], out_dir: Path, notes: list[str] | None = None) -> tuple[Path, Path]:
    """Write report.md and report.html into ``out_dir``; returns their paths."""
    from poslsh_cli import plotting

    runs = find_runs(run_dirs)
    sections, provenance = [], []
    for run in runs:
        cfg, meta = load_run(run)
        command = meta.get("command")
        if command not in BUILDERS or not (run / "results.csv").exists():
            continue
        df = pd.read_csv(run / "results.csv")
        if df.empty:
            continue
        sec = BUILDERS[command](run, df)
        try:
            sec.figures = [p for p in plotting.plot_run(run) if p.suffix == ".png"]
        except Exception as exc:  # a figure that cannot be drawn must not lose the numbers
            sec.paragraphs.append(f"(figures unavailable: {exc})")
        sections.append(sec)
        provenance.append({"run": str(run), "command": command, "status": meta.get("status"),
                           "commit": (meta.get("git") or {}).get("commit"), "dirty": (meta.get("git") or {}).get("dirty"),
                           "seed": meta.get("seed"), "wall s": meta.get("wall_seconds"),
                           "device": (meta.get("device") or {}).get("cuda") or (meta.get("device") or {}).get("machine"),
                           "torch": (meta.get("versions") or {}).get("torch"),
                           "numpy": (meta.get("versions") or {}).get("numpy"), "argv": meta.get("argv")})
    sections.sort(key=lambda s: ORDER.index(s.command))
    out_dir.mkdir(parents=True, exist_ok=True)
    md, body = _markdown(sections, provenance, out_dir, notes or []), _html(sections, provenance, notes or [])
    md_path, html_path = out_dir / "report.md", out_dir / "report.html"
    atomic_write_text(md_path, md)
    atomic_write_text(html_path, body)
    return md_path, html_path


def _verdict_word(ok: bool | None) -> str:
    return {True: "SUPPORTED", False: "NOT SUPPORTED", None: "NO DATA"}[ok]


def _markdown(sections: list[Section], provenance: list[dict], out_dir: Path, notes: list[str]) -> str:
    lines = ["# Positional LSH: claims and measurements", "",
             f"Generated {_dt.datetime.now().isoformat(timespec='seconds')} by `poslsh report`.", ""]
    lines += [f"- {n}" for n in notes] + ([""] if notes else [])
    lines += ["## Summary", "", "| section | claim | verdict | evidence |", "|---|---|---|---|"]
    for sec in sections:
        for claim, ok, ev in sec.verdicts:
            lines.append(f"| {sec.command} ({sec.run.name}) | {claim} | **{_verdict_word(ok)}** | {ev} |")
    for sec in sections:
        lines += ["", f"## {TITLES[sec.command]}", "", f"Run: `{sec.run}`", ""]
        for claim, ok, ev in sec.verdicts:
            lines.append(f"- **{_verdict_word(ok)}**: {claim}. {ev}.")
        lines += [""] + sec.paragraphs
        for t in sec.tables:
            lines += ["", t.to_markdown(index=False)]
        for f in sec.figures:
            lines += ["", f"![{f.stem}]({_rel(f, out_dir)})"]
    lines += ["", "## Provenance", ""]
    prov = pd.DataFrame(provenance)
    lines.append(prov.to_markdown(index=False))
    return "\n".join(lines) + "\n"


def _rel(path: Path, base: Path) -> str:
    import os

    return os.path.relpath(path, base)


def _html(sections: list[Section], provenance: list[dict], notes: list[str]) -> str:
    e = html.escape
    css = ("body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;color:#222}"
           "table{border-collapse:collapse;margin:.8em 0;font-size:.85em}td,th{border:1px solid #ccc;padding:3px 7px;"
           "text-align:right}th{background:#f3f3f3}.ok{color:#0a0;font-weight:bold}.no{color:#c00;font-weight:bold}"
           ".na{color:#888}img{max-width:100%;border:1px solid #eee;margin:.5em 0}code{background:#f5f5f5;padding:1px 3px}")
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>poslsh report</title><style>{css}</style></head><body>",
             "<h1>Positional LSH: claims and measurements</h1>",
             f"<p>Generated {e(_dt.datetime.now().isoformat(timespec='seconds'))} by <code>poslsh report</code>.</p>"]
    parts += [f"<p>{e(n)}</p>" for n in notes]
    parts.append("<h2>Summary</h2><table><tr><th>section</th><th>claim</th><th>verdict</th><th>evidence</th></tr>")
    for sec in sections:
        for claim, ok, ev in sec.verdicts:
            cls = {True: "ok", False: "no", None: "na"}[ok]
            parts.append(f"<tr><td>{e(sec.command)} ({e(sec.run.name)})</td><td style='text-align:left'>{e(claim)}</td>"
                         f"<td class='{cls}'>{_verdict_word(ok)}</td><td style='text-align:left'>{e(ev)}</td></tr>")
    parts.append("</table>")
    for sec in sections:
        parts.append(f"<h2>{e(TITLES[sec.command])}</h2><p>Run: <code>{e(str(sec.run))}</code></p><ul>")
        for claim, ok, ev in sec.verdicts:
            cls = {True: "ok", False: "no", None: "na"}[ok]
            parts.append(f"<li><span class='{cls}'>{_verdict_word(ok)}</span>: {e(claim)}. {e(ev)}.</li>")
        parts.append("</ul>")
        parts += [f"<p>{e(p)}</p>" for p in sec.paragraphs]
        parts += [t.to_html(index=False, border=0, escape=True) for t in sec.tables]
        for f in sec.figures:
            data = base64.b64encode(f.read_bytes()).decode()
            parts.append(f"<img alt='{e(f.stem)}' src='data:image/png;base64,{data}'>")
    parts.append("<h2>Provenance</h2>" + pd.DataFrame(provenance).to_html(index=False, border=0))
    parts.append("</body></html>")
    return "\n".join(parts)
