"""``poslsh perplexity``'s figures: bits per byte against evaluation length under each model's own
attention (one figure per scoring protocol), the same models with another attention swapped in,
bits per byte against inference-time s, and the fine-tuned gap to exact ALiBi against s. Plotting
draws what the report's helpers select; it computes no claim.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from poslsh_cli.experiments.perplexity.report import (ALIBI, MARKERS, MODEL_KEYS, OWN, POSLSH, by_protocol,
                                                      main_protocol, scheme_rank)
from poslsh_cli.attention.scheme import model_label
from poslsh_cli.experiments.perplexity.groups import longest_training
from poslsh_cli.verdicts.stats import t_interval
from poslsh_cli.verdicts import plotting


def _scheme(r: Any) -> str:
    """A trained model's label (:func:`~poslsh_cli.attention.scheme.model_label`: scheme, s, dropout,
    bandwidths), and its training length when it is not the only one (the ``multi_length`` column
    set by :func:`plot`)."""
    return (model_label(r["position"], r["trained_s"], r["attn_dropout"], r["sigmas"])
            + (f" L={r['trained_len']}" if r.get("multi_length", False) else ""))


def _schemes(df: Any) -> list[str]:
    """Trained models (all but the seed) in the one order, so colours are stable across figures."""
    keys = {(_scheme(r), r["position"], int(r["trained_s"] or 0), float(r["attn_dropout"]), str(r["sigmas"]),
             int(r["trained_len"])) for _, r in df.drop_duplicates(MODEL_KEYS + ["trained_len"]).iterrows()}
    return [k[0] for k in sorted(keys, key=lambda t: (scheme_rank(t[1], t[2]), t[3], t[4], t[5]))]


def _groups(df: Any) -> list[tuple[str, Any]]:
    groups = [("from scratch", df[df.finetuned != "yes"]), ("fine-tuned", df[df.finetuned == "yes"])]
    return [(t, g) for t, g in groups if len(g)]


def plot(run: Path, df: Any) -> list[Path]:
    """bits per byte against evaluation length under each model's own attention, the same models
    with another attention swapped in, and bits per byte against inference-time s: each train run's
    longest-trained models (its T/2 models are in the tables)."""
    df = longest_training(df)
    every = df
    df = main_protocol(df)
    df = df.assign(multi_length=df.trained_len.nunique() > 1)
    schemes = _schemes(df)
    color = {k: f"C{i % 10}" for i, k in enumerate(schemes)}
    paths = plot_length(run, df, schemes, color)
    protocols = by_protocol(every[every.attention == OWN], None)
    for name, rows, _ in protocols[1:] if len(protocols) > 1 else []:  # each further protocol its own figure
        rows = rows.assign(multi_length=rows.trained_len.nunique() > 1)
        paths += plot_length(run, rows, schemes, color, protocol=name)
    if (df.attention != OWN).any():
        paths += plot_swapped(run, df, schemes, color)
    if df[df.attention == POSLSH].s.nunique() > 1:
        paths += plot_inference_s(run, df)
    paths += plot_finetune_gap(run, df)
    return paths


def plot_finetune_gap(run: Path, df: Any) -> list[Path]:
    """Fine-tuned models at their training length: the seed-paired gap of Positional LSH to exact
    ALiBi against the s it was fine-tuned with (mean over seeds, band: 95% t-interval over seeds;
    each seed the mean over its mask draws), the other fine-tuned schemes as horizontal lines."""
    import numpy as np

    own = df[(df.attention == OWN) & (df.finetuned == "yes") & (df.length == df.trained_len)]
    ref = own[(own.position == ALIBI) & (own.attn_dropout == 0)].groupby("run_seed").bits_per_byte.mean()
    pos = own[own.position == POSLSH]
    if ref.empty or pos.trained_s.nunique() < 2:
        return []
    plt = plotting.pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    ss, mean, lo, hi, seeds = [], [], [], [], 0
    for s_, g in pos.groupby("trained_s"):
        gap = g.groupby("run_seed").bits_per_byte.mean() - ref
        iv = t_interval(gap.dropna().values)
        ss.append(int(s_))
        mean.append(iv.estimate)
        lo.append(iv.low)
        hi.append(iv.high)
        seeds = max(seeds, iv.n)
    ax.plot(ss, mean, "o-", color="C0", label=f"Positional LSH ({seeds} seed{'s' if seeds != 1 else ''})")
    if np.isfinite(lo).any():
        ax.fill_between(ss, lo, hi, color="C0", alpha=0.2, lw=0, label="95% interval over seeds")
    for i, (position, g) in enumerate(own[~own.position.isin([ALIBI, POSLSH])].groupby("position")):
        gap = (g.groupby("run_seed").bits_per_byte.mean() - ref).dropna()
        if len(gap):
            ax.axhline(float(gap.mean()), color=f"C{i + 1}", ls="--", lw=1, label=f"{position} (mean over seeds)")
    ax.axhline(0, color="k", lw=0.8)
    plotting.log_axes(ax, "s (masks per head, fine-tuned with)", "bits per byte minus exact ALiBi's", x=2, y=None)
    ax.set_title(f"Fine-tuned: gap to exact ALiBi at L={int(own.trained_len.max())} against s")
    ax.legend(fontsize=8)
    return plotting.save(fig, run, "finetune_gap_vs_s")


def plot_length(run: Path, df: Any, schemes: list[str], color: dict[str, str], protocol: str = "") -> list[Path]:
    """One colour per trained scheme (shaded: range over seeds and draws), and a zoom on the curves
    near the best; ``protocol``: the rows are that scoring protocol's (its name in the title and
    the file name), else the run's main protocol."""
    plt = plotting.pyplot()
    groups = _groups(df)
    width = 5.6 * len(groups) + 1.8
    fig, axes = plt.subplots(2, len(groups), figsize=(width, 8.0), squeeze=False,
                             gridspec_kw={"height_ratios": (1.2, 1)})
    for col, (title, g) in enumerate(groups):
        own = g[g.attention == OWN]
        curves = {lab: h.groupby("length").bits_per_byte.agg(["mean", "min", "max"]).reset_index()
                  for lab, h in own.assign(label=own.apply(_scheme, axis=1)).groupby("label", sort=False)}
        best = min(float(c["mean"].min()) for c in curves.values()) if curves else 0.0
        for row, ax in enumerate(axes[:, col]):
            for lab, agg in curves.items():
                ax.plot(agg.length, agg["mean"], "-", marker="o", ms=3.5, color=color[lab], label=lab)
                ax.fill_between(agg.length, agg["min"], agg["max"], color=color[lab], alpha=0.15, lw=0)
            ax.axvline(int(g.trained_len.max()), color="k", lw=0.8, ls=":")
            plotting.log_axes(ax, ylabel="bits per byte (own attention)", y=None)
            if row == 0:
                ax.set_title(f"{title}: length extrapolation" + (f" ({protocol} protocol)" if protocol else ""))
            else:
                ax.set_ylim(*zoom_limits([v for c in curves.values() for v in c["min"]],
                                         [v for c in curves.values() for v in c["max"]], best))
                ax.set_title(f"zoom: the curves within 0.3 of the best ({best:.3f})")
                ax.set_xlabel("evaluation length; dotted: training length")
    handles = {h.get_label(): h for ax in axes[0] for h in ax.get_legend_handles_labels()[0]}
    fig.legend([handles[k] for k in schemes if k in handles], [k for k in schemes if k in handles],
               loc="center right", title="trained with", frameon=False)
    fig.tight_layout(rect=(0, 0, 1 - 1.8 / width, 1))
    return plotting.save(fig, run, f"bpb_vs_length_{protocol}" if protocol else "bpb_vs_length")


def plot_swapped(run: Path, df: Any, schemes: list[str], color: dict[str, str]) -> list[Path]:
    """The models at their training length with another attention swapped in, as a dot plot."""
    from matplotlib.lines import Line2D

    plt = plotting.pyplot()
    groups = _groups(df)
    width = 5.6 * len(groups) + 1.8
    fig, axes = plt.subplots(1, len(groups), figsize=(width, 0.9 + 0.38 * len(schemes)), squeeze=False)
    for ax, (title, g) in zip(axes[0], groups):
        g = g[g.length == g.trained_len]
        rows = [k for k in schemes if k in set(g.apply(_scheme, axis=1))]
        g = g.assign(scheme=g.apply(_scheme, axis=1))
        for att, h in g.groupby("attention"):
            for (sch, s), hh in h.groupby(["scheme", "s"]):
                lab = model_label(att, s if att == POSLSH else 0)
                ax.plot(hh.bits_per_byte.mean(), rows.index(sch), MARKERS.get(att, "o"), ms=6,
                        mfc="none" if att != OWN else None, color=color[sch] if att == OWN else "0.25", label=lab)
        ax.set_yticks(range(len(rows)), rows)
        ax.invert_yaxis()
        ax.set_xlabel("bits per byte at the training length")
        ax.set_title(f"{title}: attention swapped at inference")
        ax.grid(True, axis="x", alpha=0.25)
    labels = sorted({lab for ax in axes[0] for lab in ax.get_legend_handles_labels()[1]},  # a set: a total order
                    key=lambda t: (t != OWN, scheme_rank(t.split()[0], int(t.split("s=")[1]) if "s=" in t else 0), t))
    marks = [Line2D([], [], ls="", marker=MARKERS.get(lab.split()[0], "o"), ms=6, color="0.25",
                    mfc="0.25" if lab == OWN else "none") for lab in labels]
    fig.legend(marks, [f"{lab} (filled: the scheme's colour)" if lab == OWN else lab for lab in labels],
               loc="center right", title="run with", frameon=False)
    fig.tight_layout(rect=(0, 0, 1 - 1.8 / width, 1))
    return plotting.save(fig, run, "bpb_swapped")


def plot_inference_s(run: Path, df: Any) -> list[Path]:
    """Bits per byte against the s used at inference, with each model's own attention dashed."""
    plt = plotting.pyplot()
    p = df[df.attention == POSLSH]
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for i, (k, g) in enumerate(p.groupby(MODEL_KEYS + ["length"])):
        agg = g.groupby("s").bits_per_byte.mean()
        ax.plot(agg.index, agg.values, "o-", ms=3.5, color=f"C{i % 10}",
                label=f"trained {model_label(*k[:4])}, L={k[4]}")
        own = df[(df.attention == OWN) & (df.length == k[4]) & (df.checkpoint.isin(g.checkpoint))]
        if len(own):
            ax.axhline(own.bits_per_byte.mean(), color=f"C{i % 10}", lw=0.9, ls="--")
    plotting.log_axes(ax, "Positional-LSH masks per head at inference (s)", "bits per byte", y=None)
    ax.legend()
    ax.set_title("Inference-time s (dashed: the model's own attention)")
    return plotting.save(fig, run, "bpb_vs_s")


def zoom_limits(lows: list[float], highs: list[float], best: float, within: float = 0.3) -> tuple[float, float]:
    """y-limits that show every value within ``within`` of ``best`` and no more: the span of those
    values padded by 8%, so close curves are drawn apart instead of flattened."""
    vals = [v for v in list(lows) + list(highs) if v == v and v <= best + within]
    lo, hi = min(vals + [best]), max(vals + [best])
    pad = max(0.08 * (hi - lo), 1e-3)
    return lo - pad, hi + pad


