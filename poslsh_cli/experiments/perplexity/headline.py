"""The answer of the registered experiments as the README gives it, computed from their rows and
verdicts: one paragraph from the primary endpoints, one table per registered experiment in the
paper's form, and the caveats with their numbers (the training length against the paper's, exact
ALiBi's bits per byte under each training protocol reported, how much validation still fell at the
end of training).
"""
from __future__ import annotations

import math
from typing import Any, Optional

import numpy as np

from poslsh_cli.experiments.perplexity.claims import ALIBI, FIXED_BLOCK, NONE, POSLSH, ROPE
from poslsh_cli.experiments.perplexity.groups import main_text
from poslsh_cli.verdicts.claims import Status, Verdict
from poslsh_cli.verdicts.registered import PAPER_SEQ_LEN, Registration
from poslsh_cli.verdicts.stats import paired, t_interval

#: the paper's rows, in its order (Positional LSH: each s the rows hold)
ORDER = ((NONE, "no position"), (ROPE, "RoPE"), (FIXED_BLOCK, "fixed blocks"), (ALIBI, "exact ALiBi"))
TABLE_HEAD = ["scheme", "bits per byte [90%]", "gap to exact ALiBi [90%]", "gap %", "top-1 %", "verdict"]


def answer(reg: Registration, verdicts: list[Verdict]) -> str:
    """One paragraph from a registration's primary verdicts: which s reaches exact ALiBi, by how much in
    bits per byte and in percent, at what training length, under which correction; what is missing
    while a verdict is NOT MEASURED."""
    ids = {f"primary/{p.id}" for p in reg.primary}
    every = [v for v in verdicts if v.claim_id in ids]
    mine = [v for v in every if v.numbers and "gap" in v.numbers]
    head = (f"{reg.name} (L = {reg.seq_len}, sigma = {reg.sigma:g}, T = {reg.steps} steps, {len(reg.seeds)} seeds, "
            f"margin {reg.margin_fraction:.0%} of exact ALiBi's bits per byte, Holm over {len(reg.primary)} at "
            f"{reg.alpha:.0%}): does Positional LSH reach exact ALiBi? ")
    if not mine:
        return head + "Not measured yet" + (f": {every[0].evidence}" if every else "") + "."
    parts = []
    for v in sorted(mine, key=lambda v: v.numbers["s"]):
        nb = v.numbers
        base = nb["margin"] / reg.margin_fraction
        word = {Status.SUPPORTED: "reaches it", Status.NOT_SUPPORTED: "does not reach it",
                Status.INCONCLUSIVE: "is not decided"}[v.status]
        parts.append(f"s = {nb['s']} {word} ({v.status.value}; gap {nb['gap']:+.4f} bits per byte, "
                     f"{100 * nb['gap'] / base:+.2f}%, 90% [{nb['low90']:+.4f}, {nb['high90']:+.4f}] unadjusted, "
                     f"Holm-adjusted p {nb['adjusted_p']:.4f})")
    return head + "; ".join(parts) + "."


def measured(reg: Registration, verdicts: list[Verdict]) -> bool:
    """Whether a primary verdict of ``reg`` was measured (the README then opens with the answer)."""
    return any((v.numbers or {}).get("registration") == reg.name for v in verdicts)


def markdown(head: list[str], rows: list[list[str]]) -> list[str]:
    """A Markdown table."""
    return ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"] + ["| " + " | ".join(r) + " |" for r in rows]


def _label(position: str, s: int = 0) -> str:
    return f"Positional LSH s = {s}" if position == POSLSH else dict(ORDER)[position]


def paper_table(rows: Any, reg: Registration, verdicts: list[Verdict]) -> list[list[str]]:
    """The endpoint's rows (:func:`~poslsh_cli.experiments.perplexity.registered.endpoint_rows`) as the
    paper's table: each scheme's bits per byte (per seed the mean over its draws, a 90% t-interval over
    the seeds), its seed-paired gap to exact ALiBi, the gap in percent of exact ALiBi's, top-1 accuracy,
    and the verdict of the primary rows only."""
    status = {v.numbers["s"]: v.status.value for v in verdicts if (v.numbers or {}).get("registration") == reg.name}
    schemes = [(p, 0) for p, _ in ORDER] + [(POSLSH, int(s)) for s in sorted(rows[rows.position == POSLSH].trained_s.unique())]
    control = _per_seed(rows, ALIBI, 0, "bits_per_byte")
    registered = [control[k] for k in reg.seeds if k in control]  # the margin's base, as the verdicts'
    base = float(np.mean(registered)) if registered else math.nan
    out = []
    for position, s in schemes:
        bpb = _per_seed(rows, position, s, "bits_per_byte")
        if not bpb:
            continue
        iv = t_interval(bpb.values(), 0.90)
        gap = paired(bpb, control, 0.90) if position != ALIBI else None
        top1 = _per_seed(rows, position, s, "top1")
        primary = position == POSLSH and s in {p.s for p in reg.primary}
        out.append([_label(position, s), _interval(iv.estimate, iv.low, iv.high, iv.n),
                    "–" if gap is None else _interval(gap.estimate, gap.low, gap.high, gap.n, sign=True),
                    "–" if gap is None else f"{100 * gap.estimate / base:+.2f}%",
                    f"{100 * float(np.mean(list(top1.values()))):.2f}" if top1 else "–",
                    f"**{status[s]}**" if primary and s in status else "(primary, not measured)" if primary else ""])
    return out


def _per_seed(rows: Any, position: str, s: int, column: str) -> dict:
    r = rows[rows.position == position]
    if position == POSLSH:
        r = r[r.trained_s == s]
    if column not in r.columns:
        return {}
    return r.groupby("run_seed")[column].mean().dropna().to_dict()


def _interval(mid: float, low: float, high: float, n: int, sign: bool = False) -> str:
    f = "+.4f" if sign else ".4f"
    if not math.isfinite(low):
        return f"{mid:{f}} ({n} seed{'s' if n != 1 else ''})"
    return f"{mid:{f}} [{low:{f}}, {high:{f}}] ({n} seeds)"


def caveats(df: Any, reg: Registration, rows: Any, margin: Optional[float]) -> list[str]:
    """The caveats of a registration's answer, each with its numbers: its training length against the
    paper's; exact ALiBi's bits per byte at that length in each train run the report holds (each
    protocol's baseline, at its longest training); how far validation still fell over the last 20% of
    the registered models' steps, against the margin."""
    out = [f"L = {reg.seq_len} is {PAPER_SEQ_LEN // reg.seq_len}x shorter than the paper's L = {PAPER_SEQ_LEN} "
           f"(sigma / L = {reg.sigma / reg.seq_len:g} in both)."]
    own = main_text(df[(df.attention == "own") & (df.length == df.trained_len) & (df.trained_len == reg.seq_len)
             & (df.position == ALIBI) & (df.finetuned != "yes") & (df.attn_dropout.fillna(0.0) == 0.0)])
    if "protocol" in own.columns:
        own = own[own.protocol == "nonoverlapping"]
    bases = []
    for run, g in own.groupby(own.trained_run.astype(str).str.split("/").str[0]):
        last = g[g.trained_steps == g.trained_steps.max()]
        bases.append(f"{float(last.groupby('run_seed').bits_per_byte.mean().mean()):.4f} ({run or 'unnamed run'}, "
                     f"{int(last.trained_steps.iloc[0])} steps, {last.run_seed.nunique()} seeds)")
    if len(bases) > 1:
        out.append(f"exact ALiBi's bits per byte at L = {reg.seq_len} under each training protocol reported: "
                   + "; ".join(bases) + ".")
    if "trained_fall" in rows.columns and rows.trained_fall.notna().any():
        fall = rows.drop_duplicates("checkpoint").trained_fall.dropna()
        where = f", against a margin of {margin:.4f}" if margin is not None and math.isfinite(margin) else ""
        out.append(f"validation still fell {fall.mean():.4f} bits per byte over the last 20% of the steps (mean over "
                   f"the {len(fall)} registered models; largest {fall.max():.4f}){where}.")
    else:
        out.append("how far validation still fell at the end of training: not measured in these rows.")
    return out
