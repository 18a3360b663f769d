"""``poslsh perplexity``'s tables, figures and claims: one function per figure and per claim of the
paper, each computed from the rows it quotes. Schemes appear in one order everywhere (the order
of :class:`~poslsh_cli.positions.Position`: no bias, the baselines, exact ALiBi, Positional LSH,
RoPE).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from poslsh_cli.claims import Section, Status, Verdict, combine
from poslsh_cli.positions import Position

OWN = "own"  # the attention column's value for a model run as trained
ALIBI, POSLSH, NONE = Position.ALIBI.value, Position.POSLSH.value, Position.NONE.value
FIXED_BLOCK, ROPE = Position.FIXED_BLOCK.value, Position.ROPE.value
SCHEMES = [p.value for p in Position]
MARKERS = {OWN: "o", ALIBI: "s", POSLSH: "^", Position.WINDOWED.value: "D", FIXED_BLOCK: "x", NONE: "v"}
#: Positional LSH's reference s for claims about one s (the paper's s=10), when it was run.
REFERENCE_S = 10
#: Extrapolation: bits per byte at 4L may exceed the value at L by at most this much.
EXTRAPOLATION_MARGIN = 0.05


def scheme_rank(position: str, s: int = 0) -> tuple:
    """Sort key of a trained scheme: the one scheme order, Positional LSH by s."""
    return (SCHEMES.index(position) if position in SCHEMES else len(SCHEMES), int(s or 0), position)


def summary(df: Any) -> tuple[list[str], list[list[str]]]:
    """Bits per byte per (checkpoint scheme, attention, s) and evaluation length, mean over
    trials and training seeds, in scheme order."""
    lengths = sorted(df.length.unique())
    head = ["trained", "finetuned", "attention", "s"] + [f"L={n}" for n in lengths]
    keys = ["position", "trained_s", "finetuned", "attention", "s"]
    groups = sorted(df.groupby(keys, sort=False), key=lambda kg: (scheme_rank(kg[0][0], kg[0][1]), kg[0][2],
                                                                  kg[0][3] != OWN, scheme_rank(kg[0][3], kg[0][4])))
    rows = []
    for k, g in groups:
        by = g.groupby("length").bits_per_byte.mean()
        rows.append([k[0] + (f" s={k[1]}" if k[1] else ""), k[2], k[3], str(k[4]) if k[4] else "-"]
                    + [f"{by[n]:.4f}" if n in by else "-" for n in lengths])
    return head, rows


# ---------------------------------------------------------------------------------------------
# figures


def _scheme(r: Any) -> str:
    """A trained model's label: its scheme, s, and its training length when it is not the only one
    (the ``multi_length`` column set by :func:`plot`)."""
    return (r["position"] + (f" s={r['trained_s']}" if r["trained_s"] else "")
            + (f" L={r['trained_len']}" if r.get("multi_length", False) else ""))


def _schemes(df: Any) -> list[str]:
    """Trained schemes in the one order, so colours are stable across figures."""
    keys = {(_scheme(r), r["position"], int(r["trained_s"] or 0), int(r["trained_len"]))
            for _, r in df.drop_duplicates(["position", "trained_s", "trained_len"]).iterrows()}
    return [k for k, pos, s, L in sorted(keys, key=lambda t: (scheme_rank(t[1], t[2]), t[3]))]


def _groups(df: Any) -> list[tuple[str, Any]]:
    groups = [("from scratch", df[df.finetuned != "yes"]), ("fine-tuned", df[df.finetuned == "yes"])]
    return [(t, g) for t, g in groups if len(g)]


def plot(run: Path, df: Any) -> list[Path]:
    """bits per byte against evaluation length under each model's own attention, the same models
    with another attention swapped in, and bits per byte against inference-time s."""
    df = df.assign(multi_length=df.trained_len.nunique() > 1)
    schemes = _schemes(df)
    color = {k: f"C{i % 10}" for i, k in enumerate(schemes)}
    paths = plot_length(run, df, schemes, color)
    if (df.attention != OWN).any():
        paths += plot_swapped(run, df, schemes, color)
    if df[df.attention == POSLSH].s.nunique() > 1:
        paths += plot_inference_s(run, df)
    return paths


def plot_length(run: Path, df: Any, schemes: list[str], color: dict[str, str]) -> list[Path]:
    """One colour per trained scheme (shaded: range over seeds and draws), and a zoom on the curves
    near the best."""
    from poslsh_cli.plotting import pyplot, save

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
            ax.set_xscale("log", base=2)
            ax.grid(True, which="both", alpha=0.25)
            ax.set_ylabel("bits per byte (own attention)")
            if row == 0:
                ax.set_title(f"{title}: length extrapolation")
            else:
                ax.set_ylim(*zoom_limits([v for c in curves.values() for v in c["min"]],
                                         [v for c in curves.values() for v in c["max"]], best))
                ax.set_title(f"zoom: the curves within 0.3 of the best ({best:.3f})")
                ax.set_xlabel("evaluation length; dotted: training length")
    handles = {h.get_label(): h for ax in axes[0] for h in ax.get_legend_handles_labels()[0]}
    fig.legend([handles[k] for k in schemes if k in handles], [k for k in schemes if k in handles],
               loc="center right", title="trained with", frameon=False)
    fig.tight_layout(rect=(0, 0, 1 - 1.8 / width, 1))
    return save(fig, run, "bpb_vs_length")


def plot_swapped(run: Path, df: Any, schemes: list[str], color: dict[str, str]) -> list[Path]:
    """The models at their training length with another attention swapped in, as a dot plot."""
    from matplotlib.lines import Line2D

    from poslsh_cli.plotting import pyplot, save

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
    from poslsh_cli.plotting import pyplot, save

    plt = pyplot()
    p = df[df.attention == POSLSH]
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for i, ((pos, ts, length), g) in enumerate(p.groupby(["position", "trained_s", "length"])):
        agg = g.groupby("s").bits_per_byte.mean()
        ax.plot(agg.index, agg.values, "o-", ms=3.5, color=f"C{i % 10}",
                label=f"trained {pos}{f' s={ts}' if ts else ''}, L={length}")
        own = df[(df.attention == OWN) & (df.position == pos) & (df.trained_s == ts) & (df.length == length)
                 & (df.checkpoint.isin(g.checkpoint))]
        if len(own):
            ax.axhline(own.bits_per_byte.mean(), color=f"C{i % 10}", lw=0.9, ls="--")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("Positional-LSH masks per head at inference (s)")
    ax.set_ylabel("bits per byte")
    ax.grid(True, which="both", alpha=0.25)
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
# claims


def scheme_bpb(g: Any, position: str, s: int, length: int) -> Any:
    """Per training seed: bits per byte of one scheme at one length (mean over mask draws)."""
    sel = g[(g.position == position) & (g.length == length)]
    if position == POSLSH:
        sel = sel[sel.trained_s == s]
    return sel.groupby("run_seed").bits_per_byte.mean()


def _seeds(k: int) -> str:
    return f"{k} seed" + ("" if k == 1 else "s")


def _spread(*groups: Any) -> float:
    import numpy as np

    return max([float(np.ptp(g)) for g in groups if len(g) > 1] or [0.0])


def report(run: Path, df: Any) -> Section:
    import pandas as pd

    sec = Section("perplexity", run, "Language modelling: from scratch, fine-tuning, length extrapolation")
    head, rows = summary(df)
    sec.tables.append(pd.DataFrame(rows, columns=head))
    own = df[df.attention == OWN]
    scratch, tuned = own[own.finetuned != "yes"], own[own.finetuned == "yes"]
    L = int(df.trained_len.max()) if len(df) else 0
    sec.verdicts += claim_reaches_alibi(scratch, L)
    sec.verdicts += claim_beats_no_bias(scratch, L)
    sec.verdicts += claim_finetune_approaches_alibi(tuned)
    sec.verdicts += claim_finetune_beats_fixed_blocks(tuned)
    sec.verdicts += claim_extrapolation(scratch, L)
    swapped = df[df.attention != OWN]
    if len(swapped):
        sec.paragraphs.append(f"{len(swapped)} rows evaluate a model with another attention than its own "
                              "(the figure 'attention swapped at inference', the 'attention' column of results.csv).")
    return sec


def claim_reaches_alibi(scratch: Any, L: int) -> list[Verdict]:
    """From scratch, Positional LSH (each s) reaches the bits per byte of exact ALiBi."""
    rule = ("at the training length L, mean bits per byte over seeds; 'reaches' when Positional LSH - ALiBi <= "
            "the larger range (max - min) over the two schemes' seeds, i.e. not worse beyond the seed-to-seed "
            "spread (better counts); needs two seeds of at least one, else INCONCLUSIVE")
    alibi = scheme_bpb(scratch, ALIBI, 0, L)
    out = []
    for s in sorted(scratch[scratch.position == POSLSH].trained_s.unique()):
        p = scheme_bpb(scratch, POSLSH, s, L)
        claim = f"from scratch, Positional LSH s={s} reaches the bits per byte of exact ALiBi"
        if alibi.empty or p.empty:
            out.append(Verdict(claim, Status.NOT_MEASURED, "missing alibi or poslsh runs", rule))
            continue
        spread, gap = _spread(alibi, p), float(p.mean() - alibi.mean())
        status = (Status.INCONCLUSIVE if len(alibi) < 2 and len(p) < 2
                  else Status.SUPPORTED if gap <= spread else Status.NOT_SUPPORTED)
        out.append(Verdict(claim, status, f"L={L}: poslsh {p.mean():.4f} ({_seeds(len(p))}), alibi {alibi.mean():.4f} "
                           f"({_seeds(len(alibi))}), difference {gap:+.4f}, seed spread {spread:.4f}", rule))
    return out


def claim_beats_no_bias(scratch: Any, L: int) -> list[Verdict]:
    """From scratch, Positional LSH (the reference s) beats the model without positional bias."""
    ps = scratch[scratch.position == POSLSH].trained_s
    if not len(ps):
        return []
    s_ref = REFERENCE_S if (ps == REFERENCE_S).any() else int(ps.max())
    p, none = scheme_bpb(scratch, POSLSH, s_ref, L), scheme_bpb(scratch, NONE, 0, L)
    claim = f"from scratch, Positional LSH s={s_ref} beats the model without positional bias"
    if none.empty:
        return [Verdict(claim, Status.NOT_MEASURED, "no position=none run", "lower mean bits per byte")]
    spread, gap = _spread(none, p), float(none.mean() - p.mean())
    return [Verdict(claim, Status.SUPPORTED if gap > spread else Status.NOT_SUPPORTED,
                    f"L={L}: none {none.mean():.4f}, poslsh {p.mean():.4f} (none - poslsh = {gap:+.4f}; seed "
                    f"spread {spread:.4f})", "none - poslsh larger than the seed-to-seed spread")]


def _finetune_gaps(tuned: Any) -> tuple[int, Any, dict[int, float]]:
    Lt = int(tuned.trained_len.max())
    a = scheme_bpb(tuned, ALIBI, 0, Lt)
    svals = sorted(tuned[tuned.position == POSLSH].trained_s.unique())
    gaps = {s: float(scheme_bpb(tuned, POSLSH, s, Lt).mean() - a.mean()) for s in svals} if len(a) else {}
    return Lt, a, gaps


def claim_finetune_approaches_alibi(tuned: Any) -> list[Verdict]:
    """Fine-tuned from one pretrained model, Positional LSH approaches exact ALiBi as s grows."""
    from scipy import stats

    claim = "fine-tuned, Positional LSH approaches exact ALiBi as s grows"
    if tuned.empty:
        return [Verdict(claim, Status.NOT_MEASURED, "no fine-tuned checkpoints (train with pretrain=rope)",
                        "needs checkpoints fine-tuned from one pretrained model")]
    _, _, gaps = _finetune_gaps(tuned)
    rule = ("gap = bits per byte of Positional LSH s minus exact ALiBi, both fine-tuned from the same model; "
            "SUPPORTED when its Spearman rank correlation with s is <= -0.8 over at least four s, NOT SUPPORTED "
            "when >= 0, else INCONCLUSIVE")
    if len(gaps) < 4:
        st = Status.NOT_MEASURED if not gaps else Status.INCONCLUSIVE
        ev = "fewer than four s" if gaps else "no alibi or poslsh fine-tuning runs"
    else:
        rho = float(stats.spearmanr(list(gaps), list(gaps.values())).statistic)
        st = Status.SUPPORTED if rho <= -0.8 else Status.NOT_SUPPORTED if rho >= 0 else Status.INCONCLUSIVE
        ev = f"Spearman {rho:.2f}"
    ev += "; gaps " + ", ".join(f"s={s}: {g:+.4f}" for s, g in gaps.items()) if gaps else ""
    return [Verdict(claim, st, ev, rule)]


def claim_finetune_beats_fixed_blocks(tuned: Any) -> list[Verdict]:
    """Fine-tuned, Positional LSH is clearly better than fixed blocks."""
    claim = "fine-tuned, Positional LSH is clearly better than fixed blocks"
    rule = ("Positional LSH at the largest s closes at least half of the gap between fixed blocks and exact "
            "ALiBi: fixed_block - poslsh >= 0.5 (fixed_block - alibi), and that gap is positive")
    if tuned.empty:
        return [Verdict(claim, Status.NOT_MEASURED, "no fine-tuned checkpoints (train with pretrain=rope)", rule)]
    Lt, a, gaps = _finetune_gaps(tuned)
    fb = scheme_bpb(tuned, FIXED_BLOCK, 0, Lt)
    if fb.empty or not gaps:
        return [Verdict(claim, Status.NOT_MEASURED, "missing fixed_block, alibi or poslsh runs", rule)]
    smax = max(gaps)
    pv = float(scheme_bpb(tuned, POSLSH, smax, Lt).mean())
    need = 0.5 * float(fb.mean() - a.mean())
    ok = need > 0 and float(fb.mean()) - pv >= need
    return [Verdict(claim, Status.SUPPORTED if ok else Status.NOT_SUPPORTED,
                    f"L={Lt}: fixed_block {float(fb.mean()):.4f}, poslsh s={smax} {pv:.4f}, alibi {float(a.mean()):.4f}",
                    rule)]


def claim_extrapolation(scratch: Any, L: int) -> list[Verdict]:
    """Positional LSH (and ALiBi) stay robust at 4L; RoPE and no position degrade more."""
    rule = (f"bits per byte at 4L minus at L (own attention, from scratch): at most {EXTRAPOLATION_MARGIN} for "
            "SUPPORTED; the comparison needs the same lengths measured for rope or none")
    deltas = {}
    for (pos, ts), g in sorted(scratch.groupby(["position", "trained_s"]), key=lambda kg: scheme_rank(*kg[0])):
        at = g.groupby("length").bits_per_byte.mean()
        if L in at.index and 4 * L in at.index:
            deltas[pos + (f" s={ts}" if ts else "")] = float(at[4 * L] - at[L])
    posl = {k: v for k, v in deltas.items() if k.startswith(POSLSH)}
    if not posl:
        return [Verdict("Positional LSH stays robust at 4x the training length", Status.NOT_MEASURED,
                        "no poslsh checkpoint evaluated at L and 4L", rule)]
    st = combine(Status.SUPPORTED if d <= EXTRAPOLATION_MARGIN else Status.NOT_SUPPORTED for d in posl.values())
    out = [Verdict("Positional LSH stays robust at 4x the training length", st,
                   "; ".join(f"{k}: {v:+.4f}" for k, v in deltas.items()), rule)]
    others = {k: v for k, v in deltas.items() if k in (ROPE, NONE)}
    if others:
        worse = all(v > max(posl.values()) for v in others.values())
        out.append(Verdict("RoPE and no-position models degrade more at 4L than Positional LSH",
                           Status.SUPPORTED if worse else Status.NOT_SUPPORTED,
                           "; ".join(f"{k}: {v:+.4f}" for k, v in others.items())
                           + f"; poslsh worst {max(posl.values()):+.4f}",
                           "each of rope / none degrades by more than every Positional-LSH model"))
    return out
