"""``poslsh bench``'s tables, figures and report: the time against n with the crossovers, the
error-time Pareto front per n, and the claims (:mod:`poslsh_cli.experiments.bench.claims`), each
computed from the rows it quotes."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from poslsh_cli.experiments.bench.claims import (  # noqa: F401 (the claims' constants, read by tests)
    EXACT, EXACT_ALT, POSLSH, WINDOWED, claim_near_linear_time, claim_roofline, claims_gpu,
    crossover, exact_time)
from poslsh_cli.experiments.measure import load_paragraphs
from poslsh_cli.verdicts.claims import Section
from poslsh_cli.numerics.methods import Method
from poslsh_cli.verdicts.samplers import comparison, samplers_of, with_sampler, worth_sentences
from poslsh_cli.verdicts import plotting


def first_sampler(df: Any) -> tuple[Any, Any]:
    """(the rows the speed tables use: every method, Positional LSH under its first sampler;
    every Positional-LSH row, with a sampler column). Samplers differ in error, not in time."""
    if "sampler" not in df.columns:
        return df, df[df.method == POSLSH].assign(sampler="iid")
    p = with_sampler(df[df.method == POSLSH])
    if p.empty:
        return df, p
    keep = (df.method != POSLSH) | (df.sampler.fillna("iid").astype(str) == samplers_of(p)[0])
    return df[keep], p


def split_exact(df: Any) -> Any:
    """Rows of exact ALiBi on several paths: the reference path's (the first of ``exact_backends``,
    whose ``rel_fro`` is empty) stay ``exact``, the others become :data:`EXACT_ALT`, so times,
    crossovers and speed-ups compare against one exact path."""
    if "backend" not in df.columns:
        return df.assign(backend="")
    ex = df.method == EXACT
    if not ex.any() or df[ex].backend.nunique() < 2:
        return df
    ref = set(df[ex & df.rel_fro.isna()].backend)
    df = df.copy()
    df.loc[ex & ~df.backend.isin(ref), "method"] = EXACT_ALT
    return df




def pareto_front(points: np.ndarray) -> np.ndarray:
    """Points (seconds, error, label, ...) not beaten on both time and error, by increasing time."""
    order = np.argsort(points[:, 0].astype(float), kind="stable")
    front, best = [], np.inf
    for i in order:
        if float(points[i, 1]) < best:
            front.append(points[i])
            best = float(points[i, 1])
    return np.asarray(front, dtype=object)


def summary(df: Any) -> tuple[list[str], list[list[str]]]:
    """Per (n, causal): Positional LSH at each s (end to end, and its sampling part) with the exact
    time paired with it (:func:`exact_time`) and the speed-up over it; the cheapest window at least
    as accurate, with its own speed-up."""
    df, _ = first_sampler(df)
    head = ["n", "causal", "exact secs", "poslsh", "e2e secs", "of which sampling", "speed-up", "rel_fro", "window@≤err",
            "window secs", "win speed-up"]
    df = split_exact(df)
    exact = exact_time(df)
    rows = []
    for (n, causal), g in df.groupby(["n", "causal"], sort=True):
        win = g[g.method == WINDOWED]
        multi = g[g.method == POSLSH].backend.nunique() > 1
        for _, p in g[g.method == POSLSH].iterrows():
            ok = win[win.rel_fro <= p.rel_fro] if np.isfinite(p.rel_fro) else win.iloc[0:0]
            best = ok.loc[ok.seconds.idxmin()] if len(ok) else None
            share = p.get("sample_seconds", math.nan) / p.seconds
            ex_t = float(exact[p.name])
            loaded = str(p.get("overloaded", False)) == "True"
            rows.append([str(n), str(causal), f"{ex_t:.3g}", f"s={p.s}" + (f" {p.backend}" if multi else ""),
                         f"{p.seconds:.3g}", f"{share:.0%}" if np.isfinite(share) else "-",
                         (f"{ex_t / p.seconds:.2f}x" + (" overloaded: INCONCLUSIVE" if loaded else ""))
                         if np.isfinite(ex_t) else "-", f"{p.rel_fro:.3g}",
                         f"{best.window_sigmas:g}σ" if best is not None else "-",
                         f"{best.seconds:.3g}" if best is not None else "-",
                         f"{float(exact[best.name]) / best.seconds:.2f}x" if best is not None and
                         np.isfinite(exact[best.name]) else "-"])
    return head, rows


# ---------------------------------------------------------------------------------------------
# figures


def plot(run: Path, df: Any) -> list[Path]:
    """Time against n (end to end: Positional LSH includes drawing its masks) with crossovers,
    and the error-time Pareto front per n, one pair of figures per causal setting."""
    if "backend" not in df.columns:
        df = df.assign(backend="")
    df, _ = first_sampler(df)
    paths = []
    for causal, g in df.groupby("causal"):
        mode = "causal" if causal else "bidir"
        paths += plot_time(run, g, mode)
        paths += plot_pareto(run, g, mode)
    return paths


def _lines(g: Any, multi: bool, cmap: Any) -> list[tuple[str, dict, Any, str, str]]:
    """(method, row filter, colour, line style, label) per curve: exact, Positional LSH per s (and
    backend), windowed per window, then every other method once, in the method order."""
    ref = g[g.method == EXACT].backend
    lines = [(EXACT, {}, "k", "-", "exact ALiBi" + (f" ({ref.iloc[0]})" if len(ref) and ref.iloc[0] else ""))]
    lines += [(EXACT_ALT, {"backend": b}, "0.45", ":", f"exact ALiBi ({b})")
              for b in sorted(g[g.method == EXACT_ALT].backend.unique())]
    pos = g[g.method == POSLSH][["s", "backend"]].drop_duplicates().sort_values(["s", "backend"])
    lines += [(POSLSH, {"s": s, "backend": b}, f"C{i % 10}", "-" if not str(b).startswith("flex") else "-.",
               f"Positional LSH s={s}" + (f" ({b})" if multi else "")) for i, (s, b) in enumerate(pos.itertuples(index=False))]
    cs = sorted(g[g.method == WINDOWED].window_sigmas.unique())
    lines += [(WINDOWED, {"window_sigmas": c}, cmap(0.35 + 0.6 * i / max(1, len(cs))), "--", f"windowed w={c:g}σ")
              for i, c in enumerate(cs)]
    others = [m.value for m in Method if m.value not in (EXACT, POSLSH, WINDOWED)]  # exact_alt: drawn above
    lines += [(m, {}, f"C{7 + i}", ":", m.replace("_", " ")) for i, m in enumerate(others)]
    return lines


def plot_time(run: Path, g: Any, mode: str) -> list[Path]:
    """Seconds against n per method and parameter, with the crossover with exact starred."""
    import pandas as pd

    plt = plotting.pyplot()
    fig, ax = plt.subplots(figsize=(8, 5))
    multi = g[g.method == POSLSH].backend.nunique() > 1
    for method, params, color, ls, label in _lines(g, multi, plt.cm.Purples):
        def sel(frame: pd.DataFrame, params: dict = params) -> pd.DataFrame:
            for k, v in params.items():
                frame = frame[frame[k] == v]
            return frame

        m = sel(g[g.method == method]).sort_values("n")
        if m.empty:
            continue
        x = crossover(g, method, sel) if method not in (EXACT, EXACT_ALT) else float("nan")
        ax.plot(m.n, m.seconds, ls, color=color, marker="o", ms=3, lw=1.2,
                label=label + (f"  (faster from n={int(x)})" if np.isfinite(x) else ""))
        if np.isfinite(x):
            ax.plot([x], [m.set_index("n").seconds[x]], "*", color=color, ms=11, mec="k", mew=0.5)
    plotting.log_axes(ax, "sequence length n", "seconds, end to end (median)")
    ax.legend(ncol=2)
    ax.set_title(f"Attention time, {int(g.heads.iloc[0])} heads, d={int(g.head_dim.iloc[0])}, {g.dtype.iloc[0]}, "
                 f"{'causal' if mode == 'causal' else 'bidirectional'}, {g.device.iloc[0]}; ★ crossover")
    return plotting.save(fig, run, f"bench_time_vs_n_{mode}")


def plot_pareto(run: Path, g: Any, mode: str) -> list[Path]:
    """Relative error against seconds per n for every approximation, with the Pareto front."""
    import matplotlib.ticker

    plt = plotting.pyplot()
    pts = g[~g.method.isin([EXACT, EXACT_ALT]) & g.rel_fro.notna()]
    ns = sorted(pts.n.unique())
    if not ns:
        return []
    multi = g[g.method == POSLSH].backend.nunique() > 1
    markers = dict(zip([m.value for m in Method if m.value != EXACT], "o^sDvP"))
    cols = min(3, len(ns))
    rows = int(np.ceil(len(ns) / cols))
    fig, axes = plt.subplots(rows, cols, figsize=(4.4 * cols, 3.8 * rows), squeeze=False, layout="constrained")
    for ax, n in zip(axes.flat, ns):
        p = pts[pts.n == n]
        ex = g[(g.method == EXACT) & (g.n == n)].seconds
        for i, method in enumerate(m for m in markers if (p.method == m).any()):
            q = p[p.method == method]
            ax.scatter(q.seconds, q.rel_fro, marker=markers[method], color=f"C{i}", s=22, label=method, zorder=3)
            for _, r in q.iterrows():
                tag = f"s={r.s}" if method == POSLSH else (f"{r.window_sigmas:g}σ" if method == WINDOWED else "")
                if method == POSLSH and multi:
                    tag += f" {r.backend}"
                ax.annotate(tag, (r.seconds, r.rel_fro), fontsize=8, xytext=(3, 2), textcoords="offset points")
        front = pareto_front(p[["seconds", "rel_fro", "method"]].to_numpy())
        ax.step(front[:, 0].astype(float), front[:, 1].astype(float), where="post", color="k", lw=0.8, alpha=0.6)
        if len(ex):
            ax.axvline(float(ex.iloc[0]), color="k", ls="--", lw=0.8, label="exact time")
        plotting.log_axes(ax, "seconds, end to end", x=10)
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_title(f"n={n}: front = {', '.join(sorted(set(front[:, 2])))}", fontsize=9)
    for ax in axes.flat[len(ns):]:
        ax.axis("off")
    axes[0][0].set_ylabel("relative error vs exact")
    axes[0][0].legend()
    return plotting.save(fig, run, f"bench_pareto_{mode}")


# ---------------------------------------------------------------------------------------------
# report


def report(run: Path, df: Any) -> Section:
    sec = Section("bench", run, "Speed: Positional-LSH attention against exact and windowed ALiBi")
    df, every = first_sampler(df)
    sec.add_table(*summary(df))
    raw = df if "backend" in df.columns else df.assign(backend="")
    df = split_exact(df)
    verdict, paragraphs = claim_near_linear_time(df)
    sec.verdicts.append(verdict)
    sec.paragraphs += paragraphs + pareto_findings(df)
    ex = raw[raw.method == EXACT]
    if len(ex):
        sec.tables.append(exact_paths_table(ex))
        paths = ", ".join(sorted(set(df[df.method == EXACT].backend)))
        paired = "exact_seconds" in df.columns and df.exact_seconds.notna().any()
        sec.paragraphs.append(f"Speed-ups and crossovers are against exact ALiBi on {paths}"
                              + (" (the reference of rel_fro; the other exact paths are in the table of exact "
                                 "paths)" if (df.method == EXACT_ALT).any() else "")
                              + (", timed interleaved with each row (exact_seconds)" if paired else "") + ".")
    sec.paragraphs += load_paragraphs(raw)
    if "fraction" in raw.columns and raw.fraction.notna().any():
        sec.tables.append(roofline_table(raw))
        sec.verdicts.append(claim_roofline(raw))
    sec.verdicts += claims_gpu(raw)
    if every.sampler.nunique() > 1 and every.rel_fro.notna().any():

        sec.paragraphs.append(f"Mask samplers (the tables above: {samplers_of(every)[0]}): the error against exact "
                              "ALiBi at equal s, times being the same.")
        cmp = comparison(every[every.rel_fro.notna()], ["n", "causal"], "rel_fro")
        sec.paragraphs.extend(worth_sentences(cmp, "output error (rel_fro, median over heads)", ["n", "causal"]))
        sec.details.append(("Samplers per (n, causal, s): rel_fro against exact ALiBi, ratio to iid, the iid s of "
                            "the same error", cmp))
    return sec


def exact_paths_table(ex: Any) -> Any:
    """Exact ALiBi per (n, causal, path): time, useful GFLOP/s, its fraction of the machine's
    attainable attention throughput, and its largest difference from float64."""
    import pandas as pd

    def fmt(r: Any, col: str, spec: str) -> str:
        x = float(getattr(r, col, math.nan))
        return format(x, spec) if math.isfinite(x) else "-"

    rows = []
    for r in ex.sort_values(["causal", "n", "seconds"]).itertuples():
        rows.append([str(bool(r.causal)), str(int(r.n)), r.backend, f"{r.seconds:.3g}", fmt(r, "gflops", ".1f"),
                     fmt(r, "fraction", ".0%"), fmt(r, "max_err_f64", ".2g")])
    return pd.DataFrame(rows, columns=["causal", "n", "exact path", "seconds", "GFLOP/s", "of attainable",
                                       "max |err| vs float64"])


def roofline_table(df: Any) -> Any:
    """Each method's useful GFLOP/s at its largest n as a fraction of what the bias-free flash
    kernel attains here on a dense problem (measured once in the run)."""
    import pandas as pd

    rows = []
    for causal, g in df.groupby("causal"):
        machine = float(g.machine_gflops.dropna().iloc[0]) if g.machine_gflops.notna().any() else math.nan
        top = g[g.n == g.n.max()]
        for r in top.sort_values(["method", "s", "window_sigmas"]).itertuples():
            what = r.method + (f" s={r.s}" if r.method == POSLSH else "") + \
                (f" w={r.window_sigmas:g}σ" if r.method == WINDOWED else "")
            rows.append([str(bool(causal)), str(int(r.n)), what, r.backend, f"{r.gflops:.1f}", f"{machine:.1f}",
                         f"{r.fraction:.0%}"])
    return pd.DataFrame(rows, columns=["causal", "n", "method", "path", "useful GFLOP/s", "flash kernel GFLOP/s",
                                       "fraction"])


def pareto_findings(df: Any) -> list[str]:
    """The error-time Pareto front per n, and Positional LSH against windowed ALiBi at matched error."""
    out = []
    for causal, g in df.groupby("causal"):
        mode = "causal" if causal else "bidirectional"
        pts = g[~g.method.isin([EXACT, EXACT_ALT])].dropna(subset=["rel_fro"])
        fronts, beaten, total = [], 0, 0
        for n, gn in pts.groupby("n"):
            front = pareto_front(gn[["seconds", "rel_fro", "method"]].to_numpy())
            fronts.append(f"n={n}: {', '.join(sorted(set(front[:, 2])))}")
            win = gn[gn.method == WINDOWED]
            for _, r in gn[gn.method == POSLSH].iterrows():
                total += 1
                beaten += bool(((win.seconds <= r.seconds) & (win.rel_fro <= r.rel_fro)).any())
        if fronts:
            out.append(f"{mode}: error–time Pareto front (end-to-end time) per n: " + "; ".join(fronts) + ".")
        if total and (pts.method == WINDOWED).any():
            out.append(f"{mode}: {beaten} of {total} Positional-LSH points are matched by a windowed exact "
                       "ALiBi point that is at least as fast and at least as accurate.")
    return out
