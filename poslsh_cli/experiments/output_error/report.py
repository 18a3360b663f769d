"""``poslsh output-error``'s tables, figures and claims: the decay of the output error with s per
layer and how Positional LSH compares with every baseline method, each computed from the rows it
quotes."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from poslsh_cli.verdicts.claims import (ASYMPTOTIC_S, DECAY_RULE, Groups, Section, Status, asymptotic_fit,
                                        decay_status, few, fmt, slope_text)
from poslsh_cli.numerics.methods import INFO, Method, baselines
from poslsh_cli.verdicts.declared import Claim
from poslsh_cli.numerics.metrics import fit_loglog_slope
from poslsh_cli.verdicts.samplers import comparison, samplers_of, slope_table, with_sampler, worth_sentences
from poslsh_cli.verdicts import plotting

DECAY = Claim("output_error/decay", "output-error", "output error falls like s^-1/2",
              DECAY_RULE + "; per layer, on the median over heads", metric="rel_fro")
#: per baseline method with no window: Positional LSH at its largest s beats it
BEATS = {m: Claim(f"output_error/beats_{m.value}", "output-error",
                  f"at the largest s Positional LSH is more accurate than the {m.value} baseline",
                  "median over heads at s={smax} below the baseline's median, in every layer", metric="rel_fro",
                  sides=({"method": m.value}, {"method": Method.POSLSH.value, "s": "largest"}))
         for m in baselines() if INFO[m].params != "window"}

POSLSH = Method.POSLSH.value
#: The method name of the rows that measure an ALiBi model's own attention against exact ALiBi.
MODEL_OWN = "model_own"


def _present(df: Any) -> list[Method]:
    """The baselines this run measured, in method order."""
    return [m for m in baselines() if (df.method == m.value).any()]


def first_sampler(df: Any) -> tuple[Any, Any]:
    """(the rows every table but the samplers' uses: baselines and Positional LSH under its first
    sampler, iid where present; every Positional-LSH row with its sampler)."""
    df = with_sampler(df)
    p = df[df.method == POSLSH]
    if p.empty:
        return df, p
    first = samplers_of(p)[0]
    return df[(df.method != POSLSH) | (df.sampler == first)], p


def _label(m: Method) -> str:
    return INFO[m].summary.split(",")[0].split(":")[0]


def summary(df: Any) -> tuple[list[str], list[list[str]]]:
    """Per layer: the decay slope by the report's rule (fit over s >= 8 on the median over heads),
    the error at the largest s, and each baseline's median error."""
    df, _ = first_sampler(df)
    present = _present(df)
    head = ["layer", f"slope (s≥{ASYMPTOTIC_S})", "poslsh@s_max", "s_max"] + [m.value for m in present] + ["secs"]
    rows = []
    for layer, g in df.groupby("layer", sort=True):
        p = g[g.method == POSLSH]
        med = p.groupby(["s", "trial"])["rel_fro"].median().reset_index()
        fit = asymptotic_fit(med["s"], med["rel_fro"]) if len(med) else None
        smax = int(p["s"].max()) if len(p) else 0

        def base(m: Method) -> str:
            b = g[g.method == m.value]
            return f"{b['rel_fro'].median():.4f}" if len(b) else "-"

        top = p[p.s == smax]["rel_fro"].median() if len(p) else float("nan")
        rows.append([str(layer), f"{fit.slope:.3f}" if fit else "–", f"{top:.4f}", str(smax)]
                    + [base(m) for m in present]
                    + [f"{g.drop_duplicates(['method', 's', 'trial', 'window'])['seconds'].sum():.1f}"])
    return head, rows


# ---------------------------------------------------------------------------------------------
# figures


def plot(run: Path, df: Any) -> list[Path]:
    import numpy as np

    plt = plotting.pyplot()
    paths = []
    df, every = first_sampler(df)
    if every.sampler.nunique() > 1:
        paths += _plot_samplers(run, every)
    layers = sorted(df["layer"].unique())
    cols = min(2 if len(layers) <= 6 else 4, len(layers))  # readable at report width
    rows = int(np.ceil(len(layers) / cols))
    fig, axes = plt.subplots(rows, cols, figsize=(4.6 * cols, 3.5 * rows), squeeze=False, sharey=True,
                             layout="constrained")
    styles = {m: (f"C{2 + i}", _label(m)) for i, m in enumerate(_present(df))}
    model = str(df["model"].iloc[0])
    for ax, layer in zip(axes.flat, layers):
        g = df[df.layer == layer]
        p = g[g.method == POSLSH]
        if len(p):
            per_head = p.groupby(["s", "head"])["rel_fro"].mean().reset_index()  # mean over trials
            agg = per_head.groupby("s")["rel_fro"].agg(med="median", lo=lambda v: v.quantile(0.25),
                                                       hi=lambda v: v.quantile(0.75)).reset_index()
            med_trials = p.groupby(["s", "trial"])["rel_fro"].median().reset_index()
            fit = fit_loglog_slope(med_trials["s"], med_trials["rel_fro"])
            ax.plot(agg["s"], agg["med"], "o-", color="C0", ms=3.5, label=f"Positional LSH, slope {fit.slope:.2f}")
            ax.fill_between(agg["s"], agg["lo"], agg["hi"], color="C0", alpha=0.18, lw=0)
            xs = agg["s"].to_numpy(dtype=float)
            c = float(np.exp(np.mean(np.log(agg["med"]) + 0.5 * np.log(xs))))
            ax.plot(xs, c / np.sqrt(xs), "--", color="C0", lw=0.8, alpha=0.7, label="c/√s")
        for method, (color, label) in styles.items():
            b = g[g.method == method.value]
            if len(b):
                if INFO[method].params == "window":
                    label += " w=" + "/".join(f"{c:g}σ" for c in sorted(set((b["window"] / b["sigma"]).round(0))))
                ax.axhline(b["rel_fro"].median(), color=color, lw=1.1, ls=":", label=f"{label} (median)")
        plotting.log_axes(ax, "number of samples s")
        ax.set_title(f"layer {layer}" + (f": slope {fit.slope:.2f}" if len(p) else ""))
    for ax in axes.flat[len(layers):]:
        ax.axis("off")
    axes[0][0].set_ylabel("‖T* − T̃‖_F / ‖T*‖_F (median over heads, IQR)")
    axes[0][0].legend()
    fig.suptitle(f"Output error against exact ALiBi: {model}, n={int(df['n'].iloc[0])}")
    paths += plotting.save(fig, run, "output_error_vs_s")

    p = df[df.method == POSLSH]
    if len(p):
        smax = p["s"].max()
        mat = p[p.s == smax].groupby(["layer", "head"])["rel_fro"].mean().unstack("head")
        fig, ax = plt.subplots(figsize=(0.6 * mat.shape[1] + 2.5, 0.45 * mat.shape[0] + 2.0))
        im = ax.imshow(mat.to_numpy(), cmap="magma_r", aspect="auto")
        sig = p.drop_duplicates("head").set_index("head")["sigma"]
        ax.set_xticks(range(mat.shape[1]), [f"{h}\n{sig[h]:.3g}" for h in mat.columns])
        ax.set_yticks(range(mat.shape[0]), [str(layer) for layer in mat.index])
        ax.set_xlabel("head (top) and its σ (bottom)")
        ax.set_ylabel("layer")
        ax.set_title(f"relative output error at s={smax} (mean over trials)")
        fig.colorbar(im, ax=ax, shrink=0.85)
        paths += plotting.save(fig, run, "output_error_heatmap")
    return paths


# ---------------------------------------------------------------------------------------------
# report


def report(run: Path, df: Any) -> Section:
    import pandas as pd

    sec = Section("output-error", run, "Attention outputs on real activations: error against s, with baselines")
    df, every = first_sampler(df)
    present = _present(df)
    rows, decay = [], Groups()
    beats = {m: Groups() for m in present if INFO[m].params != "window"}
    p_all = df[df.method == POSLSH]
    for layer, g in df.groupby("layer"):
        p = g[g.method == POSLSH]
        if p.empty:
            continue
        med = p.groupby(["s", "trial"])["rel_fro"].median().reset_index()
        fit = asymptotic_fit(med.s, med.rel_fro)
        decay.add(decay_status(fit), f"layer {layer}: {slope_text(fit)}" if fit is not None else None)
        smax = p.s.max()
        top = p[p.s == smax].rel_fro.median()
        base = {m: g[g.method == m.value].rel_fro.median() if (g.method == m.value).any() else math.nan for m in present}
        for m in beats:
            if math.isfinite(base[m]):
                beats[m].add(bool(top < base[m]))
        rows.append({"layer": layer,
                     f"slope s ≥ {ASYMPTOTIC_S} [95% CI]": slope_text(fit) + (f" {decay_status(fit).value}" if fit else ""),
                     f"poslsh s={smax}": fmt(top), **{_label(m): fmt(base[m]) for m in present}})
    sec.paragraphs.append(f"Model {df.model.iloc[0]}, n={int(df.n.iloc[0])}, {df['head'].nunique()} heads, "
                          f"{'causal' if df.causal.iloc[0] else 'bidirectional'}; medians over heads of "
                          "‖T* − T̃‖_F / ‖T*‖_F against exact ALiBi (float64).")
    sec.tables.append(pd.DataFrame(rows))
    if p_all.empty:
        sec.verdicts.append(DECAY.not_measured("no Positional-LSH rows", rule=DECAY_RULE))
        return sec
    slopes = f"; slopes {few(decay.evidence)}" if decay.evidence else f"; fewer than three s ≥ {ASYMPTOTIC_S}"
    sec.verdicts.append(decay.verdict(DECAY, evidence=f"layers: {decay.tally()}{slopes}"))
    smax = int(p_all.s.max())
    for m in (m for m in baselines() if INFO[m].params != "window"):
        layers = beats.get(m, Groups())
        won = f"{layers.statuses.count(Status.SUPPORTED)}/{len(layers.statuses)} layers" if layers.statuses else None
        sec.verdicts.append(layers.verdict(BEATS[m], every=True, evidence=won, smax=smax,
                                           none=f"no {m.value} rows in this run (baselines=)"))
    for m in (m for m in present if INFO[m].params == "window"):
        win = df[df.method == m.value]
        top = p_all[p_all.s == smax].rel_fro.median()
        w = win.rel_fro.median()
        cs = "/".join(f"{c:g}σ" for c in sorted(set((win.window / win.sigma).round(0))))
        word = "more" if w < top else "less" if w > top else "as"
        sec.paragraphs.append(f"{_label(m)} (w = {cs}; median error {w:.3g}) is {word} accurate than Positional "
                              f"LSH at s={smax} (median {top:.3g}) on this model: a ratio of {top / w:.3g}.")
    paper = paper_metrics_table(df)
    if paper is not None:
        official = "convention" in df.columns and (df.convention == "official").all()
        sec.paragraphs.append(
            "In the paper's validation metrics (" + ("its convention: scores K Q^T / √d, keys as rows, bidirectional"
                                                     if official else "on the model's own attention")
            + "): the relative difference with a symmetric denominator ‖o1 − o2‖ / (½(‖o1‖ + ‖o2‖)), the row-wise "
            "relative differences (median, 90th, 99th percentile over rows) and the cosine similarity of the "
            "flattened outputs, each the median over layers, heads and trials."
            + (f" exp(S) of the raw scores overflows float32 on {int(df.exp_overflow.astype(bool).sum())} rows; "
               "the paper's script takes it without subtracting a maximum (poslsh always does)."
               if official and df.exp_overflow.astype(bool).any() else ""))
        sec.tables.append(paper)
    if every.sampler.nunique() > 1:
        _report_samplers(sec, every)
    return sec


def _report_samplers(sec: Section, p: Any) -> None:
    """Positional LSH under each mask sampler: per layer the decay slope and the error at equal s
    against iid's, and the iid s each sampler's s is worth (:mod:`poslsh_cli.verdicts.samplers`)."""
    med = p.groupby(["layer", "sampler", "s", "trial"], sort=False)["rel_fro"].median().reset_index()
    if p.sampler.iloc[0] == "iid" or (p.sampler == "iid").any():
        sec.paragraphs.append("The tables above use Positional LSH's iid rows; below, every sampler on the same "
                              "layers (per trial the median over heads of ‖T* − T̃‖_F / ‖T*‖_F, then the mean over "
                              "trials).")
    sec.tables.append(slope_table(med, ["layer"], {"output": "rel_fro"}))
    cmp = comparison(med, ["layer"], "rel_fro")
    sec.paragraphs.extend(worth_sentences(cmp, "output error", ["layer"]))
    sec.details.append(("Samplers per (layer, s): mean output error, ratio to iid at equal s, the iid s of the same "
                        "error", cmp))


def _plot_samplers(run: Path, p: Any) -> list[Path]:
    """Output error against s, one line per sampler, one panel per layer (at most six)."""
    plt = plotting.pyplot()
    order = samplers_of(p)
    layers = sorted(p.layer.unique())[:6]
    fig, axes = plt.subplots(1, len(layers), figsize=(4.2 * len(layers), 3.6), squeeze=False, sharey=True)
    med = p.groupby(["layer", "sampler", "s", "trial"])["rel_fro"].median().reset_index()
    med = med.assign(_order=med.sampler.map({sm: i for i, sm in enumerate(order)}))
    for ax, layer in zip(axes[0], layers):
        plotting.decay_panel(ax, med[med.layer == layer], "s", "rel_fro", ["_order"], lambda k: order[int(k[0])])
        ax.set_title(f"layer {layer}")
        ax.set_xlabel("number of samples s")
        ax.legend(title="sampler", title_fontsize=8)
    axes[0][0].set_ylabel("‖T* − T̃‖_F / ‖T*‖_F (median over heads)")
    fig.suptitle(f"{p.model.iloc[0]}: Positional-LSH output error under each mask sampler")
    return plotting.save(fig, run, "output_error_samplers")


def paper_metrics_table(df: Any) -> Any:
    """Per method and s: medians of the paper's metrics (None for runs without them)."""
    import pandas as pd

    cols = ["rel_sym", "row_rel_median", "row_rel_p90", "row_rel_p99", "cosine"]
    if not set(cols) <= set(df.columns) or df[cols].isna().all(axis=None):
        return None
    rows = []
    for (method, s), g in df.groupby(["method", "s"], sort=True):
        rows.append({"method": method, "s": int(s) if s else "–", "rows": len(g),
                     "rel. diff (sym.)": fmt(g.rel_sym.median()), "row median": fmt(g.row_rel_median.median()),
                     "row p90": fmt(g.row_rel_p90.median()), "row p99": fmt(g.row_rel_p99.median()),
                     "cosine": f"{g.cosine.median():.6f}"})
    return pd.DataFrame(rows)
