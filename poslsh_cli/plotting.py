"""Figures from run directories: tidy results -> matplotlib (PNG + PDF into figures/).

Plotting reads what the runs wrote and draws it; the only arithmetic here is aggregation over
trials, least-squares slopes for legends, and theory curves from :mod:`poslsh_cli.sampling`.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import matplotlib

matplotlib.use("Agg")
import matplotlib.ticker  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from poslsh_cli.config import ConfigError  # noqa: E402
from poslsh_cli.metrics import fit_loglog_slope  # noqa: E402
from poslsh_cli.rundir import load_run  # noqa: E402

PLOTTERS: dict[str, Callable[[Path, dict], list[Path]]] = {}

#: Sizes chosen for figures shown at about 1000 px wide (the HTML report): no text under 8 pt.
STYLE = {"font.size": 9, "legend.fontsize": 8, "axes.titlesize": 10, "axes.labelsize": 9, "xtick.labelsize": 8,
         "ytick.labelsize": 8, "figure.titlesize": 11}
matplotlib.rcParams.update(STYLE)


def _plotter(command: str) -> Callable:
    def deco(fn: Callable) -> Callable:
        PLOTTERS[command] = fn
        return fn
    return deco


def save(fig: plt.Figure, run: Path, name: str) -> list[Path]:
    out = run / "figures"
    out.mkdir(exist_ok=True)
    paths = [out / f"{name}.png", out / f"{name}.pdf"]
    fig.savefig(paths[0], dpi=110, bbox_inches="tight")
    fig.savefig(paths[1], bbox_inches="tight")
    plt.close(fig)
    return paths


def plot_run(run: Path) -> list[Path]:
    """Every figure for one run directory; returns the files written."""
    run = Path(run)
    cfg, meta = load_run(run)
    command = meta.get("command")
    if command not in PLOTTERS:
        raise ConfigError(f"{run}: no plots for command {command!r}")
    if command != "sample" and not (run / "results.csv").exists():
        raise ConfigError(f"{run}: no results.csv yet")
    return PLOTTERS[command](run, cfg)


def _results(run: Path) -> pd.DataFrame:
    """The run's results table; a run with no finished cell has nothing to draw."""
    df = pd.read_csv(run / "results.csv")
    if df.empty:
        raise ConfigError(f"{run}: results.csv has no rows yet")
    return df


def decay_panel(ax: plt.Axes, df: pd.DataFrame, x: str, y: str, group: list[str], label: Callable[[tuple], str]) -> None:
    """Mean over trials with min-max band, fitted log-log slope in the legend, c/sqrt(x) guide."""
    for i, (gkey, g) in enumerate(df.groupby(group, sort=True)):
        gkey = gkey if isinstance(gkey, tuple) else (gkey,)
        agg = g.groupby(x)[y].agg(["mean", "min", "max"]).reset_index()
        fit = fit_loglog_slope(g[x], g[y])
        color = f"C{i % 10}"
        ax.plot(agg[x], agg["mean"], "o-", color=color, ms=3.5, lw=1.4,
                label=f"{label(gkey)}  slope {fit.slope:.2f}")
        ax.fill_between(agg[x], agg["min"], agg["max"], color=color, alpha=0.18, lw=0)
        if len(agg) > 1:
            c = float(np.exp(np.mean(np.log(agg["mean"]) + 0.5 * np.log(agg[x]))))
            xs = np.asarray(agg[x], dtype=float)
            ax.plot(xs, c / np.sqrt(xs), "--", color=color, lw=0.8, alpha=0.7)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.grid(True, which="both", alpha=0.25)


@_plotter("matrix-error")
def plot_matrix_error(run: Path, cfg: dict) -> list[Path]:
    df = _results(run)
    df = df[df["method"] == ("fast" if (df["method"] == "fast").any() else "dense")]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    lab = lambda k: f"n={k[0]}, σ={k[1]:g}"  # noqa: E731
    decay_panel(axes[0], df, "s", "spectral_rel", ["n", "sigma"], lab)
    axes[0].set_title("spectral error  ‖L* − M̃‖₂ / ‖L*‖₂")
    decay_panel(axes[1], df, "s", "max_err", ["n", "sigma"], lab)
    axes[1].set_title("max-norm error  max |L* − M̃|")
    for ax in axes:
        ax.set_xlabel("number of samples s")
        ax.legend(title="mean, min–max band; dashed: c/√s", title_fontsize=8)
    fig.suptitle("Positional LSH: error of the mean mask against s (Theorem 2.1: O(1/√s))")
    paths = save(fig, run, "matrix_error_vs_s")
    full = _results(run)
    if set(full["method"]) >= {"fast", "dense"}:
        paths += _fast_vs_dense(run, full)
    return paths


def _fast_vs_dense(run: Path, df: pd.DataFrame) -> list[Path]:
    """The fast O(n) path against the dense float64 reference: same errors, far less time."""
    piv = df.pivot_table(index=["n", "sigma", "s", "trial"], columns="method",
                         values=["spectral_err", "seconds"]).dropna().reset_index()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    ax = axes[0]
    f, d = piv[("spectral_err", "fast")], piv[("spectral_err", "dense")]
    ax.scatter(d, (f - d).abs() / d, s=14, color="C0")
    ax.set_xscale("log")
    ax.set_yscale("symlog", linthresh=1e-16)
    ax.set_xlabel("‖L* − M̃‖₂ (dense float64 eigendecomposition)")
    ax.set_ylabel("|fast − dense| / dense")
    ax.set_title("spectral error: fast (Lanczos) against dense")
    ax.grid(True, which="both", alpha=0.25)
    ax = axes[1]
    t = piv.groupby(("n", ""))[[("seconds", "fast"), ("seconds", "dense")]].median()
    ax.plot(t.index, t[("seconds", "dense")], "o-", color="C3", label="dense (n×n float64)")
    ax.plot(t.index, t[("seconds", "fast")], "o-", color="C0", label="fast (O(n) matvecs)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("n")
    ax.set_ylabel("seconds per cell (median)")
    ax.set_title("time against n")
    ax.legend()
    ax.grid(True, which="both", alpha=0.25)
    return save(fig, run, "fast_vs_dense")


@_plotter("block-stats")
def plot_block_stats(run: Path, cfg: dict) -> list[Path]:
    from poslsh_cli.sampling import block_length_pmf, block_max_quantile

    df = _results(run)
    if "s_per_log_n" not in df.columns:
        df = df.assign(s_per_log_n=np.nan)
    df = df.assign(rule=[f"s = ⌈{c:g} ln n⌉" if c == c else f"s = {s}" for c, s in zip(df.s_per_log_n, df.s)],
                   ratio=df.b_max / df.b_max_loglog)
    sigmas = sorted(df["sigma"].unique())
    paths = []
    fig, axes = plt.subplots(1, len(sigmas), figsize=(4.3 * len(sigmas), 3.9), squeeze=False, sharey=False)
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
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length n")
        ax.set_title(f"σ = {sigma:g}")
        ax.grid(True, which="both", alpha=0.25)
        ax.legend(title="solid: median b_max (10–90%)\ndashed: exact law median", title_fontsize=8)
    axes[0][0].set_ylabel("largest block b_max (positions)")
    fig.suptitle("Largest block against n")
    paths += save(fig, run, "b_max_vs_n")

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for i, ((sigma, rule), g) in enumerate(df.groupby(["sigma", "rule"])):
        agg = g.groupby("n").agg(med=("ratio", "median"), s=("s", "first"), ll=("b_max_loglog", "first")).reset_index()
        c = f"C{i % 10}"
        ax.plot(agg["n"], agg["med"], "o-", color=c, ms=4, label=f"σ={sigma:g}, {rule}")
        lo = [block_max_quantile(0.05, sigma, int(s)) / ll for s, ll in zip(agg["s"], agg["ll"])]
        hi = [block_max_quantile(0.95, sigma, int(s)) / ll for s, ll in zip(agg["s"], agg["ll"])]
        ax.fill_between(agg["n"], lo, hi, color=c, alpha=0.12, lw=0)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sequence length n")
    ax.set_ylabel("b_max / (σ ln ln n), median over trials")
    ax.set_title("Largest block relative to σ log log n; bands: exact law, 5–95%")
    ax.grid(True, which="both", alpha=0.25)
    ax.legend(ncol=2)
    paths += save(fig, run, "b_max_over_loglog")

    hist_file = run / "block_lengths.csv"
    if hist_file.exists():
        h = pd.read_csv(hist_file)
        sigmas = sorted(h["sigma"].unique())
        fig, axes = plt.subplots(1, len(sigmas), figsize=(4.2 * len(sigmas), 3.6), squeeze=False)
        for ax, sigma in zip(axes[0], sigmas):
            g = h[(h["sigma"] == sigma) & (h["n"] == h[h["sigma"] == sigma]["n"].max())]
            counts = g.groupby("length")["count"].sum()
            lengths = np.arange(1, int(counts.index.max()) + 1)
            emp = counts.reindex(lengths, fill_value=0).to_numpy() / counts.sum()
            ax.bar(lengths, emp, width=1.0, color="C0", alpha=0.6, label="realised")
            ax.plot(lengths, block_length_pmf(lengths, sigma), "k-", lw=1.2, label="theory")
            ax.set_yscale("log")
            ax.set_xlabel("block length")
            ax.set_title(f"σ={sigma:g}, n={int(g['n'].max())}")
            ax.legend()
        axes[0][0].set_ylabel("fraction of blocks")
        paths += save(fig, run, "block_length_hist")
    return paths


@_plotter("sample")
def plot_sample(run: Path, cfg: dict) -> list[Path]:
    data = np.load(run / "masks.npz")
    bins = data["bins"]
    sigmas = np.atleast_1d(data["sigma"])
    if bins.ndim == 2:
        bins = bins[None]
    n = bins.shape[-1]
    if n > 1024:
        raise ConfigError(f"{run}: n={n} is too large for a heat map (at most 1024)")
    rows = min(4, bins.shape[0])
    fig, axes = plt.subplots(rows, 3, figsize=(11, 3.5 * rows), squeeze=False)
    idx = np.arange(n)
    for h in range(rows):
        b = bins[h]
        mean = np.mean(b[:, :, None] == b[:, None, :], axis=0)
        L = np.exp(-np.abs(idx[:, None] - idx[None, :]) / sigmas[h])
        for ax, mat, title in zip(axes[h], (b[0][:, None] == b[0][None, :], mean, L),
                                  ("one mask M(h₁)", f"mean of s={b.shape[0]} masks  M̃", f"L* = exp(−|i−j|/σ), σ={sigmas[h]:.3g}")):
            im = ax.imshow(mat.astype(float), vmin=0, vmax=1, cmap="viridis", interpolation="nearest")
            ax.set_title(title)
            ax.set_xticks([])
            ax.set_yticks([])
        fig.colorbar(im, ax=axes[h].tolist(), shrink=0.8)
    return save(fig, run, "mean_mask_heatmap")


@_plotter("output-error")
def plot_output_error(run: Path, cfg: dict) -> list[Path]:
    df = _results(run)
    paths = []
    layers = sorted(df["layer"].unique())
    cols = min(3, len(layers))
    rows = int(np.ceil(len(layers) / cols))
    fig, axes = plt.subplots(rows, cols, figsize=(4.3 * cols, 3.5 * rows), squeeze=False, sharey=True,
                             layout="constrained")
    styles = {"no_bias": ("C3", "no bias"), "fixed_block": ("C2", "fixed block"), "windowed": ("C4", "windowed ALiBi")}
    model = str(df["model"].iloc[0])
    for ax, layer in zip(axes.flat, layers):
        g = df[df.layer == layer]
        p = g[g.method == "poslsh"]
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
            b = g[g.method == method]
            if len(b):
                if method == "windowed":
                    label += " w=" + "/".join(f"{c:g}σ" for c in sorted(set((b["window"] / b["sigma"]).round(0))))
                ax.axhline(b["rel_fro"].median(), color=color, lw=1.1, ls=":", label=f"{label} (median)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"layer {layer}" + (f": slope {fit.slope:.2f}" if len(p) else ""))
        ax.grid(True, which="both", alpha=0.25)
        ax.set_xlabel("number of samples s")
    for ax in axes.flat[len(layers):]:
        ax.axis("off")
    axes[0][0].set_ylabel("‖T* − T̃‖_F / ‖T*‖_F (median over heads, IQR)")
    axes[0][0].legend()
    fig.suptitle(f"Output error against exact ALiBi: {model}, n={int(df['n'].iloc[0])}")
    paths += save(fig, run, "output_error_vs_s")

    p = df[df.method == "poslsh"]
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
        paths += save(fig, run, "output_error_heatmap")
    return paths


@_plotter("bench")
def plot_bench(run: Path, cfg: dict) -> list[Path]:
    """Time against n (end to end: Positional LSH includes drawing its masks) with crossovers,
    and the error-time Pareto front per n, one pair of figures per causal setting."""
    from poslsh_cli.experiments.bench import crossover, pareto_front

    df = _results(run)
    if "backend" not in df.columns:
        df = df.assign(backend="")
    paths = []
    for causal, g in df.groupby("causal"):
        fig, ax = plt.subplots(figsize=(8, 5))
        multi = g[g.method == "poslsh"].backend.nunique() > 1
        lines = [("exact", {}, "k", "-", "exact ALiBi")]
        pos = g[g.method == "poslsh"][["s", "backend"]].drop_duplicates().sort_values(["s", "backend"])
        lines += [("poslsh", {"s": s, "backend": b}, f"C{i % 10}", "-" if b != "flex" else "-.",
                   f"Positional LSH s={s}" + (f" ({b})" if multi else ""))
                  for i, (s, b) in enumerate(pos.itertuples(index=False))]
        cs = sorted(g[g.method == "windowed"].window_sigmas.unique())
        lines += [("windowed", {"window_sigmas": c}, plt.cm.Purples(0.35 + 0.6 * i / max(1, len(cs))), "--",
                   f"windowed w={c:g}σ") for i, c in enumerate(cs)]
        lines += [("fixed_block", {}, "C7", ":", "fixed block")]
        for method, params, color, ls, label in lines:
            def sel(frame: pd.DataFrame, params: dict = params) -> pd.DataFrame:
                for k, v in params.items():
                    frame = frame[frame[k] == v]
                return frame

            m = sel(g[g.method == method]).sort_values("n")
            if m.empty:
                continue
            x = crossover(g, method, sel) if method != "exact" else float("nan")
            ax.plot(m.n, m.seconds, ls, color=color, marker="o", ms=3, lw=1.2,
                    label=label + (f"  (faster from n={int(x)})" if np.isfinite(x) else ""))
            if np.isfinite(x):
                ax.plot([x], [m.set_index("n").seconds[x]], "*", color=color, ms=11, mec="k", mew=0.5)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length n")
        ax.set_ylabel("seconds, end to end (median)")
        ax.grid(True, which="both", alpha=0.25)
        ax.legend(ncol=2)
        dev = str(g.device.iloc[0])
        ax.set_title(f"Attention time, {int(g.heads.iloc[0])} heads, d={int(g.head_dim.iloc[0])}, "
                     f"{g.dtype.iloc[0]}, {'causal' if causal else 'bidirectional'}, {dev}; ★ crossover")
        paths += save(fig, run, f"bench_time_vs_n_{'causal' if causal else 'bidir'}")

        pts = g[g.method.isin(["poslsh", "windowed", "fixed_block"]) & g.rel_fro.notna()]
        ns = sorted(pts.n.unique())
        if ns:
            cols = min(3, len(ns))
            rows = int(np.ceil(len(ns) / cols))
            fig, axes = plt.subplots(rows, cols, figsize=(4.4 * cols, 3.8 * rows), squeeze=False, layout="constrained")
            for ax, n in zip(axes.flat, ns):
                p = pts[pts.n == n]
                ex = g[(g.method == "exact") & (g.n == n)].seconds
                for method, marker, color in (("poslsh", "o", "C0"), ("windowed", "s", "C4"), ("fixed_block", "^", "C7")):
                    q = p[p.method == method]
                    ax.scatter(q.seconds, q.rel_fro, marker=marker, color=color, s=22, label=method, zorder=3)
                    for _, r in q.iterrows():
                        tag = f"s={r.s}" if method == "poslsh" else (f"{r.window_sigmas:g}σ" if method == "windowed" else "")
                        if method == "poslsh" and multi:
                            tag += f" {r.backend}"
                        ax.annotate(tag, (r.seconds, r.rel_fro), fontsize=8, xytext=(3, 2), textcoords="offset points")
                front = pareto_front(p[["seconds", "rel_fro", "method"]].to_numpy())
                ax.step(front[:, 0].astype(float), front[:, 1].astype(float), where="post", color="k", lw=0.8, alpha=0.6)
                if len(ex):
                    ax.axvline(float(ex.iloc[0]), color="k", ls="--", lw=0.8, label="exact time")
                ax.set_xscale("log")
                ax.set_yscale("log")
                ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
                winners = ", ".join(sorted(set(front[:, 2])))
                ax.set_title(f"n={n}: front = {winners}", fontsize=9)
                ax.set_xlabel("seconds, end to end")
                ax.grid(True, which="both", alpha=0.25)
            for ax in axes.flat[len(ns):]:
                ax.axis("off")
            axes[0][0].set_ylabel("relative error vs exact")
            axes[0][0].legend()
            paths += save(fig, run, f"bench_pareto_{'causal' if causal else 'bidir'}")
    return paths
