"""``poslsh perplexity``'s tables, figures and claims: one function per figure and per claim of the
paper, each computed from the rows it quotes. Schemes appear in one order everywhere (the order
of :class:`~poslsh_cli.lm.positions.Position`: no bias, the baselines, exact ALiBi, Positional LSH,
RoPE).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from poslsh_cli.verdicts.claims import Section
from poslsh_cli.lm.evaluate import METRICS
from poslsh_cli.lm.positions import Position, model_label, with_model_columns

OWN = "own"  # the attention column's value for a model run as trained
ALIBI, POSLSH, NONE = Position.ALIBI.value, Position.POSLSH.value, Position.NONE.value
FIXED_BLOCK, ROPE = Position.FIXED_BLOCK.value, Position.ROPE.value
SCHEMES = [p.value for p in Position]
MARKERS = {OWN: "o", ALIBI: "s", POSLSH: "^", Position.WINDOWED.value: "D", FIXED_BLOCK: "x", NONE: "v"}


def scheme_rank(position: str, s: int = 0) -> tuple:
    """Sort key of a trained scheme: the one scheme order, Positional LSH by s."""
    return (SCHEMES.index(position) if position in SCHEMES else len(SCHEMES), int(s or 0), position)


#: what defines a trained model besides its training seed (which tables count and figures shade)
MODEL_KEYS = ["position", "trained_s", "attn_dropout", "sigmas"]


def summary(df: Any) -> tuple[list[str], list[list[str]]]:
    """Bits per byte per trained model (scheme, s, dropout, bandwidths), attention and s at each
    evaluation length, mean over trials and the training seeds counted in ``seeds``, in scheme
    order."""
    df = with_model_columns(main_protocol(df))
    lengths = sorted(df.length.unique())
    head = ["trained", "finetuned", "seeds", "attention", "s"] + [f"L={n}" for n in lengths]
    keys = MODEL_KEYS + ["finetuned", "attention", "s"]
    groups = sorted(df.groupby(keys, sort=False), key=lambda kg: (scheme_rank(kg[0][0], kg[0][1]), kg[0][2], kg[0][3],
                                                                  kg[0][4], kg[0][5] != OWN,
                                                                  scheme_rank(kg[0][5], kg[0][6])))
    rows = []
    for k, g in groups:
        by = g.groupby("length").bits_per_byte.mean()
        rows.append([model_label(*k[:4]), k[4], str(g.run_seed.nunique()), k[5], str(k[6]) if k[6] else "-"]
                    + [f"{by[n]:.4f}" if n in by else "-" for n in lengths])
    return head, rows


# ---------------------------------------------------------------------------------------------
# figures


def _scheme(r: Any) -> str:
    """A trained model's label (:func:`~poslsh_cli.lm.positions.model_label`: scheme, s, dropout,
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
    with another attention swapped in, and bits per byte against inference-time s."""
    every = with_model_columns(protocol_of(df))
    df = with_model_columns(main_protocol(df))
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

    from poslsh_cli.verdicts.plotting import log_axes, pyplot, save
    from poslsh_cli.verdicts.stats import t_interval

    own = df[(df.attention == OWN) & (df.finetuned == "yes") & (df.length == df.trained_len)]
    ref = own[(own.position == ALIBI) & (own.attn_dropout == 0)].groupby("run_seed").bits_per_byte.mean()
    pos = own[own.position == POSLSH]
    if ref.empty or pos.trained_s.nunique() < 2:
        return []
    plt = pyplot()
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
    log_axes(ax, "s (masks per head, fine-tuned with)", "bits per byte minus exact ALiBi's", x=2, y=None)
    ax.set_title(f"Fine-tuned: gap to exact ALiBi at L={int(own.trained_len.max())} against s")
    ax.legend(fontsize=8)
    return save(fig, run, "finetune_gap_vs_s")


def plot_length(run: Path, df: Any, schemes: list[str], color: dict[str, str], protocol: str = "") -> list[Path]:
    """One colour per trained scheme (shaded: range over seeds and draws), and a zoom on the curves
    near the best; ``protocol``: the rows are that scoring protocol's (its name in the title and
    the file name), else the run's main protocol."""
    from poslsh_cli.verdicts.plotting import log_axes, pyplot, save

    plt = pyplot()
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
            log_axes(ax, ylabel="bits per byte (own attention)", y=None)
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
    return save(fig, run, f"bpb_vs_length_{protocol}" if protocol else "bpb_vs_length")


def plot_swapped(run: Path, df: Any, schemes: list[str], color: dict[str, str]) -> list[Path]:
    """The models at their training length with another attention swapped in, as a dot plot."""
    from matplotlib.lines import Line2D

    from poslsh_cli.verdicts.plotting import pyplot, save

    plt = pyplot()
    groups = _groups(df)
    width = 5.6 * len(groups) + 1.8
    fig, axes = plt.subplots(1, len(groups), figsize=(width, 0.9 + 0.38 * len(schemes)), squeeze=False)
    for ax, (title, g) in zip(axes[0], groups):
        g = g[g.length == g.trained_len]
        rows = [k for k in schemes if k in set(g.apply(_scheme, axis=1))]
        g = g.assign(scheme=g.apply(_scheme, axis=1))
        for att, h in g.groupby("attention"):
            for (sch, s), hh in h.groupby(["scheme", "s"]):
                lab = att if att != POSLSH else f"{POSLSH} s={s}"
                ax.plot(hh.bits_per_byte.mean(), rows.index(sch), MARKERS.get(att, "o"), ms=6,
                        mfc="none" if att != OWN else None, color=color[sch] if att == OWN else "0.25", label=lab)
        ax.set_yticks(range(len(rows)), rows)
        ax.invert_yaxis()
        ax.set_xlabel("bits per byte at the training length")
        ax.set_title(f"{title}: attention swapped at inference")
        ax.grid(True, axis="x", alpha=0.25)
    labels = sorted({lab for ax in axes[0] for lab in ax.get_legend_handles_labels()[1]},
                    key=lambda t: (t != OWN, scheme_rank(t.split()[0])))
    marks = [Line2D([], [], ls="", marker=MARKERS.get(lab.split()[0], "o"), ms=6, color="0.25",
                    mfc="0.25" if lab == OWN else "none") for lab in labels]
    fig.legend(marks, [f"{lab} (filled: the scheme's colour)" if lab == OWN else lab for lab in labels],
               loc="center right", title="run with", frameon=False)
    fig.tight_layout(rect=(0, 0, 1 - 1.8 / width, 1))
    return save(fig, run, "bpb_swapped")


def plot_inference_s(run: Path, df: Any) -> list[Path]:
    """Bits per byte against the s used at inference, with each model's own attention dashed."""
    from poslsh_cli.verdicts.plotting import log_axes, pyplot, save

    plt = pyplot()
    p = df[df.attention == POSLSH]
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for i, (k, g) in enumerate(p.groupby(MODEL_KEYS + ["length"])):
        agg = g.groupby("s").bits_per_byte.mean()
        ax.plot(agg.index, agg.values, "o-", ms=3.5, color=f"C{i % 10}",
                label=f"trained {model_label(*k[:4])}, L={k[4]}")
        own = df[(df.attention == OWN) & (df.length == k[4]) & (df.checkpoint.isin(g.checkpoint))]
        if len(own):
            ax.axhline(own.bits_per_byte.mean(), color=f"C{i % 10}", lw=0.9, ls="--")
    log_axes(ax, "Positional-LSH masks per head at inference (s)", "bits per byte", y=None)
    ax.legend()
    ax.set_title("Inference-time s (dashed: the model's own attention)")
    return save(fig, run, "bpb_vs_s")


def zoom_limits(lows: list[float], highs: list[float], best: float, within: float = 0.3) -> tuple[float, float]:
    """y-limits that show every value within ``within`` of ``best`` and no more: the span of those
    values padded by 8%, so close curves are drawn apart instead of flattened."""
    vals = [v for v in list(lows) + list(highs) if v == v and v <= best + within]
    lo, hi = min(vals + [best]), max(vals + [best])
    pad = max(0.08 * (hi - lo), 1e-3)
    return lo - pad, hi + pad


# ---------------------------------------------------------------------------------------------
# the report


#: the columns a trained scheme is told apart by, in the tables of this report
SCHEME_KEYS = ["finetuned", "trained_len"] + MODEL_KEYS


def _by_scheme(df: Any) -> list:
    """(key, rows) per trained scheme (``SCHEME_KEYS``), in report order."""
    return sorted(with_model_columns(df).groupby(SCHEME_KEYS),
                  key=lambda kg: (kg[0][0], kg[0][1], scheme_rank(kg[0][2], kg[0][3]), kg[0][4], kg[0][5]))


def _scheme_label(k: tuple) -> str:
    return model_label(*k[2:6])


def _interval_text(iv: Any) -> str:
    return f"[{iv.low:.4f}, {iv.high:.4f}]" if iv.finite else "-"


def interval_table(own: Any) -> Any:
    """Per trained scheme and evaluation length: mean bits per byte with its 95% t-interval over
    training seeds (each seed the mean over its mask draws), and the counts it rests on."""
    import pandas as pd

    from poslsh_cli.verdicts.stats import t_interval

    rows = []
    for k, g in _by_scheme(own):
        for length, h in g.groupby("length"):
            per_seed = h.groupby("run_seed").bits_per_byte.mean()
            iv = t_interval(per_seed.values)
            rows.append({"fine-tuned": k[0], "L": k[1],
                         "scheme": _scheme_label(k),
                         "length": length, "bits/byte": round(iv.estimate, 4), "95% interval": _interval_text(iv),
                         "seeds": iv.n, "draws/seed": int(h.groupby("run_seed").size().max())})
    return pd.DataFrame(rows)


def swapped_table(df: Any) -> Any:
    """At the training length, each trained scheme with another attention swapped in: mean bits per
    byte with its 95% t-interval over training seeds (each seed the mean over its mask draws), the
    same models under their own attention, the seed-paired difference (swapped minus own) with its
    95% interval, and the mean KL divergence (nats per token) from the model's own predictions."""
    import pandas as pd

    from poslsh_cli.verdicts.stats import t_interval

    rows = []
    for k, g in _by_scheme(df[df.length == df.trained_len]):
        own = g[g.attention == OWN].groupby("run_seed").bits_per_byte.mean()
        for (att, s), h in g[g.attention != OWN].groupby(["attention", "s"]):
            per_seed = h.groupby("run_seed").bits_per_byte.mean()
            iv = t_interval(per_seed.values)
            common = per_seed.index.intersection(own.index)
            diff = t_interval((per_seed[common] - own[common]).values)
            rows.append({"fine-tuned": k[0], "L": k[1], "trained": _scheme_label(k),
                         "attention": att + (f" s={s}" if att == "poslsh" else ""),
                         "bits/byte": round(iv.estimate, 4), "95% interval": _interval_text(iv),
                         "own": round(float(own[common].mean()), 4) if len(common) else float("nan"),
                         "swapped - own": round(diff.estimate, 4) if len(common) else float("nan"),
                         "difference 95%": _interval_text(diff) if len(common) else "-",
                         "KL": round(float(h.kl.mean()), 4), "seeds": iv.n,
                         "draws/seed": int(h.groupby("run_seed").size().max())})
    return pd.DataFrame(rows)


NONOVERLAPPING, SLIDING = "nonoverlapping", "sliding"
PROTOCOL_TEXT = ("Two scoring protocols on the same models: nonoverlapping scores every token of side-by-side windows "
                 "of the evaluation length; sliding (the ALiBi paper's and the Positional-LSH paper's code) steps "
                 "windows of the evaluation length by the training length L and scores only their last L tokens, so "
                 "every scored token has at least (length − L) tokens of context. Up to L they are the same windows "
                 "(one row serves both), so the claims at L are judged once; the extrapolation verdicts name their "
                 "protocol in brackets.")
ACCURACY_TEXT = ("The paper's accuracy metrics of the same predictions (own attention, at each model's training length "
                 "and the longest length evaluated, mean over training seeds and mask draws): top-1 / top-10 / top-100 "
                 "next-token accuracy (%; top-100 not shown for byte-level models, whose 256 outcomes make it near "
                 "100% for any model), the mean reciprocal rank of the true token and the mean predictive entropy "
                 "(nats). The rank counts the tokens with a strictly higher probability.")


def protocol_of(df: Any) -> Any:
    """The ``protocol`` column (runs written before it: nonoverlapping)."""
    if "protocol" not in df.columns:
        return df.assign(protocol=NONOVERLAPPING)
    return df.assign(protocol=df.protocol.fillna(NONOVERLAPPING))


def main_protocol(df: Any) -> Any:
    """The rows of the run's main protocol (nonoverlapping when it was run): what the tables and
    figures of one protocol show; the protocol table puts both side by side."""
    df = protocol_of(df)
    name = NONOVERLAPPING if (df.protocol == NONOVERLAPPING).any() or df.empty else df.protocol.iloc[0]
    return df[df.protocol == name]


def by_protocol(own: Any, windows: Any) -> list[tuple[str, Any, Any]]:
    """(tag, rows, windows) per scoring protocol. The sliding frame takes the nonoverlapping rows
    (and windows) at lengths up to the training length, where both protocols score the same
    windows and only nonoverlapping was run. One untagged frame when the run used one protocol."""
    own = protocol_of(own)
    windows = protocol_of(windows) if windows is not None else None
    names = sorted(set(own.protocol), key=lambda p: p != NONOVERLAPPING)
    if names == [NONOVERLAPPING]:
        return [("", own, windows)]
    out = []
    for name in names:
        short = own.length <= own.trained_len
        rows = own[(own.protocol == name) | ((own.protocol == NONOVERLAPPING) & short)] if name == SLIDING \
            else own[own.protocol == name]
        w = None
        if windows is not None:
            trained = dict(zip(own.checkpoint, own.trained_len))
            short_w = windows.length <= windows.checkpoint.map(trained).fillna(0)
            w = windows[(windows.protocol == name) | ((windows.protocol == NONOVERLAPPING) & short_w)] \
                if name == SLIDING else windows[windows.protocol == name]
        out.append((name, rows, w))
    return out


def protocol_table(own: Any) -> Any:
    """Bits per byte of each trained model beyond its training length under each protocol (mean over
    seeds and draws), side by side."""
    import pandas as pd

    own = protocol_of(own)
    long = own[own.length > own.trained_len]
    rows = []
    for k, g in _by_scheme(long):
        for length, h in g.groupby("length"):
            row = {"model": _scheme_label(k), "length": int(length)}
            for name, hh in h.groupby("protocol"):
                row[f"{name} bpb"] = f"{hh.bits_per_byte.mean():.4f}"
                row[f"{name} tokens"] = int(hh.tokens.iloc[0])
            rows.append(row)
    return pd.DataFrame(rows)


def accuracy_table(own: Any) -> Any:
    """The paper's accuracy metrics per trained model at its training length and at the longest
    length evaluated (the default protocol's rows)."""
    import pandas as pd

    own = main_protocol(own)
    metrics = shown_metrics(own)
    rows = []
    for k, g in _by_scheme(own):
        for length in sorted({int(g.trained_len.iloc[0]), int(g.length.max())}):
            h = g[g.length == length]
            if h.empty or h.top1.isna().all():
                continue
            rows.append({"model": _scheme_label(k), "length": length, "seeds": h.run_seed.nunique(),
                         **{m.label: f"{m.scale * h[m.name].mean():.{m.digits}f}" for m in metrics},
                         "bpb": f"{h.bits_per_byte.mean():.4f}"})
    return pd.DataFrame(rows)


def shown_metrics(rows: Any) -> list:
    """The accuracy metrics worth a column: all of them, but top-100 for byte-level models (each
    predicted token a byte: with about 256 outcomes, the top 100 hold the true one almost always)."""
    byte_level = len(rows) and "bytes" in rows.columns and bool((rows.bytes == rows.tokens).all())
    return [m for m in METRICS if not (byte_level and m.name == "top100")]


def _windows(run: Path) -> Any:
    import pandas as pd

    path = Path(run) / "windows.csv"
    return pd.read_csv(path) if path.exists() and path.stat().st_size else None


def _by_bandwidths(own: Any) -> list[tuple[str, Any]]:
    """The models of one comparison group split by their bandwidths (``sigmas``) when they were
    trained with several: each set of claims compares models of one sigma scheme (schemes without
    bandwidths, rope and none, join every set). One set, untagged, otherwise."""
    labels = sorted(set(own.sigmas) - {""})
    if len(labels) <= 1:
        return [("", own)]
    return [(lab, own[own.sigmas.isin([lab, ""])]) for lab in labels]


def _tagged(verdicts: list, tag: str, key_tag: str = "") -> list:
    """The verdicts with ``tag`` shown after their claim, and ``key_tag`` (what tells the same claim of
    two groups apart for a reader that joins runs: bandwidths, protocol) added to their names."""
    import dataclasses

    return [dataclasses.replace(v, claim=f"{v.claim} [{tag}]" if tag else v.claim,
                                key=f"{v.name}[{key_tag}]" if key_tag else v.name) for v in verdicts]


def report(run: Path, df: Any) -> Section:
    from poslsh_cli.experiments import perplexity_claims as pc
    from poslsh_cli.experiments import perplexity_groups as pg

    sec = Section("perplexity", run, "Language modelling: from scratch, fine-tuning, length extrapolation")
    df = pg.with_group_columns(with_model_columns(df))
    own = df[df.attention == OWN]
    sec.facts.update(protocol=protocol_label(own), described=described(run, own))
    sec.tables.append(interval_table(pg.main_text(main_protocol(own))))
    main = main_protocol(own)
    scoring = ("non-overlapping windows, every token scored" if main.empty or main.protocol.iloc[0] == NONOVERLAPPING
               else "the sliding protocol (windows stepped by L, their last L tokens scored)")
    sec.paragraphs.append(
        f"Bits per byte of each model under its own attention ({scoring}; at the training length on its largest "
        "evaluation text), mean over training seeds with a 95% t-interval; "
        "each seed's value is the mean over its Positional-LSH mask draws, so the interval covers training seeds "
        "and mask draws. Every model is evaluated on the same windows of the same validation documents, so "
        "comparisons are paired (by seed) and stay inside one train run, training length and number of steps; with "
        "fewer than three seeds a comparison uses the per-window differences on those windows (evaluation noise "
        "only) and says so.")
    texts = sorted(int(x) for x in own.text_tokens.unique() if x)
    if texts:
        sec.paragraphs.append("Evaluation text: " + " and ".join(f"{t:,} tokens" for t in sorted(set(texts), reverse=True))
                              + " from the start of each model's validation split" + (
                                  " (the larger for the claims at the training length, the smaller for the lengths "
                                  "beyond it and the attention swapped at inference, with every model scored on it "
                                  "at L as well)" if len(set(texts)) > 1 else "") + ".")
    margins = pg.margin_paragraph(main)
    if margins:
        sec.paragraphs.append(margins)
    all_windows = _windows(run)
    protocols = by_protocol(own, all_windows)
    if len(protocols) > 1:
        sec.tables.append(protocol_table(own))
        sec.paragraphs.append(PROTOCOL_TEXT)
    judged: list = []
    for i, (ptag, pown, windows) in enumerate(protocols):
        # claims at the training length read the same windows under every protocol: judged once,
        # with the first (main) protocol; extrapolation is judged under each (on the side text)
        if i == 0:
            at_L = pg.main_text(pown[pown.length == pown.trained_len])
            accuracy = "top1" in at_L.columns and at_L.top1.notna().all() and len(at_L)
            for gtag, d in pg.groups(at_L, windows, finetuned=False):
                for tag, h in _by_bandwidths(d.rows):
                    dd = _restrict(d, h)
                    for claim in (pc.claim_reaches_alibi, pc.claim_beats_no_bias,
                                  pc.claim_beats_original_and_fixed_blocks, pc.claim_beats_alibi):
                        judged += _tagged(claim(dd), _join(tag, gtag), tag)
                    if accuracy:
                        judged += _tagged(pc.claim_reaches_alibi_accuracy(dd.with_metric(pc.TOP1_MISS)), _join(tag, gtag),
                                          tag)
            tuned = list(pg.groups(at_L, windows, finetuned=True))
            for gtag, d in tuned or [("", None)]:
                for tag, h in _by_bandwidths(d.rows) if d is not None else [("", None)]:
                    dd = _restrict(d, h) if d is not None else None
                    judged += _tagged(pc.claim_finetune_approaches_alibi(dd) + pc.claim_finetune_beats_fixed_blocks(dd),
                                      _join(tag, gtag), tag)
        side = pg.side_text(pown)
        for gtag, d in pg.groups(side, windows, finetuned=False):
            for tag, h in _by_bandwidths(d.rows):
                # the protocol is part of the claim's name even where a run scored one (it lines up with a
                # run that scored several)
                proto = ptag or (str(protocol_of(pown).protocol.iloc[0]) if len(pown) else "")
                judged += _tagged(pc.claim_extrapolation(_restrict(d, h, keep_half=False)), _join(tag, gtag, ptag),
                                  _join(tag, proto))
    judged += pg.claim_weights_reach_alibi(main_protocol(df))
    sec.verdicts += judged
    if "top1" in own.columns and own.top1.notna().any():
        sec.tables.append(accuracy_table(pg.main_text(own)))
        sec.paragraphs.append(ACCURACY_TEXT)
    swapped = df[df.attention != OWN]
    if len(swapped):
        sec.tables.append(swapped_table(pg.side_text(main_protocol(df))))
        sec.paragraphs.append(f"{len(swapped)} rows evaluate a model with another attention than its own (the table "
                              "above, at the training length; the figure 'attention swapped at inference'; the "
                              "'attention' column of results.csv): bits per byte over training seeds with a 95% "
                              "t-interval, the same models under their own attention, the seed-paired difference "
                              "(swapped minus own) with its 95% t-interval, and the KL divergence of the next-token "
                              "distributions from the model's own (nats per token).")
        parts = pg.decomposition(main_protocol(df))
        if len(parts):
            sec.tables.append(parts)
            sec.paragraphs.append("Where the gap to exact ALiBi comes from, for every Positional-LSH-trained scheme at its "
                                  "training length (seed-paired, mean over seeds with 95% t-intervals): total = its own "
                                  "attention minus the exact-ALiBi-trained model; inference = its own attention minus "
                                  "the same weights run with exact ALiBi (the approximation at inference); weights = "
                                  "those weights with exact ALiBi minus the exact-ALiBi-trained model (what training "
                                  "under the masks did to the weights); total = inference + weights. The last columns "
                                  "run the same weights with other s at inference.")
    power = pg.power_table(judged)
    if len(power):
        sec.tables.append(power)
        sec.paragraphs.append("Power of each comparison judged over seeds: the measured seed-paired spread, the 90% "
                              "interval's half-width against half the margin, and the seeds that would make that "
                              "half-width at most half the margin at this spread.")
    sec.paragraphs.append(pg.family_paragraph(judged))
    return sec


def protocol_label(own: Any) -> str:
    """How a run's models set their bandwidths, from its rows: ALiBi's per-head slopes (this project's
    protocol) or one sigma for every head (the paper's): the name of its column beside other runs."""
    labels = sorted(set(own.sigmas) - {""})
    return "; ".join("per-head σ (ALiBi's slopes)" if x == "standard" else x.replace("sigma=", "σ = ")
                     for x in labels) or "no bandwidth"


def described(run: Path, own: Any) -> str:
    """One sentence of what a run trained and evaluated (bandwidths, s, schemes, seeds, lengths, protocols)."""
    d = protocol_of(own)
    seeds = d.groupby(["position", "trained_s"]).run_seed.nunique()
    return (f"{Path(run).name}: bandwidths {', '.join(sorted(set(d.sigmas) - {''})) or 'none'}; trained s "
            f"{', '.join(str(int(x)) for x in sorted(set(d[d.position == POSLSH].trained_s))) or 'none'}; schemes "
            f"{', '.join(sorted(set(d.position)))}; {int(seeds.min()) if len(seeds) else 0}-"
            f"{int(seeds.max()) if len(seeds) else 0} training seeds per scheme; lengths "
            f"{', '.join(str(int(x)) for x in sorted(set(d.length)))}; protocols {', '.join(sorted(set(d.protocol)))}.")


def _join(*tags: str) -> str:
    return ", ".join(t for t in tags if t)


def _restrict(d: Any, rows: Any, keep_half: bool = True) -> Any:
    """``d`` on a subset of its rows (one set of bandwidths), its ``half`` restricted alike."""
    import dataclasses

    half = None
    if keep_half and d.half is not None:
        labels = set(rows.sigmas) - {""}
        hr = d.half.rows[d.half.rows.sigmas.isin(labels | {""})] if labels else d.half.rows
        half = dataclasses.replace(d.half, rows=hr)
    return dataclasses.replace(d, rows=rows, half=half)
