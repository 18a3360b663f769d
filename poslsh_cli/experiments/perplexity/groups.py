"""Which models ``poslsh perplexity``'s claims compare, and what the report says about the verdicts
as a whole: the groups (one train run, one training length, one number of steps, one evaluation
text), where the gap to exact ALiBi comes from (the approximation at inference or the trained
weights), the power of each comparison and the error rate the verdicts share.

A group is judged at the longest training of its run; the same run's models trained for fewer steps
(T/2 beside T) are its ``half``, which the stability rule reads (:mod:`~poslsh_cli.experiments.perplexity.claims`). Claims at
the training length read the largest evaluation text of each model (``text_tokens``); claims across
lengths and with swapped attention read the side text, on which every model was also scored at L.
"""
from __future__ import annotations

import math
from typing import Any, Iterator, Optional

from poslsh_cli.experiments.perplexity import claims as pc
from poslsh_cli.lm.positions import with_model_columns
from poslsh_cli.verdicts.claims import Status, Verdict
from poslsh_cli.verdicts.declared import Claim
from poslsh_cli.verdicts.stats import (MARGIN_FRACTION, MIN_SEEDS, Interval, count, family_wise, half_width,
                                      seeds_for_half_width, spread, t_interval)
from poslsh_cli.verdicts.stats import relative_margin

OWN = pc.OWN
#: what a row written before the column existed meant by its absence: no train run, steps, text and
#: fall not recorded, the non-overlapping protocol (the only one then)
DEFAULTS = {"trained_run": "", "trained_steps": 0, "text_tokens": 0, "trained_fall": math.nan,
            "protocol": "nonoverlapping"}


def migrate(df: Any) -> Any:
    """The one migration of ``poslsh perplexity``'s rows (:attr:`~poslsh_cli.experiments.base.Experiment.migrate`):
    the model columns (:func:`~poslsh_cli.lm.positions.with_model_columns`) and :data:`DEFAULTS`."""
    return with_group_columns(with_model_columns(df))


def with_group_columns(df: Any) -> Any:
    """``df`` with every column of :data:`DEFAULTS` (a missing or empty value: the default)."""
    for col, value in DEFAULTS.items():
        if col not in df.columns:
            df = df.assign(**{col: value})
        else:
            column = df[col].astype(object) if isinstance(value, str) else df[col]  # an all-empty column reads as float
            df = df.assign(**{col: column.fillna(value)})
    return df


def longest_training(rows: Any) -> Any:
    """The rows of each train run's longest-trained models (per run, fine-tuned or not, and training
    length): the models the figures draw. A run's shorter trainings (T/2 beside T) are other models,
    read by the stability rule and shown in the tables with their steps."""
    if rows.empty:
        return rows
    top = rows.groupby(["trained_run", "finetuned", "trained_len"]).trained_steps.transform("max")
    return rows[rows.trained_steps == top]


def main_text(rows: Any) -> Any:
    """Each model's rows on its largest evaluation text (per checkpoint and length)."""
    if rows.empty:
        return rows
    top = rows.groupby(["checkpoint", "length"]).text_tokens.transform("max")
    return rows[rows.text_tokens == top]


def side_text(rows: Any) -> Any:
    """Each model's rows on its smallest evaluation text (per checkpoint): the text every length and
    every swapped attention was scored on (all rows when one text was used)."""
    if rows.empty:
        return rows
    low = rows.groupby("checkpoint").text_tokens.transform("min")
    return rows[rows.text_tokens == low]


def _texts(windows: Any, rows: Any) -> Any:
    """The windows of the checkpoints' texts in ``rows`` (windows written before ``text_tokens``: all)."""
    if windows is None or "text_tokens" not in windows.columns or rows.empty:
        return windows
    keep = rows[["checkpoint", "length", "text_tokens"]].drop_duplicates()
    return windows.merge(keep, on=["checkpoint", "length", "text_tokens"])


def groups(rows: Any, windows: Any, finetuned: bool) -> Iterator[tuple[str, pc.Data]]:
    """(tag, Data) per train run and training length, at the run's longest training, with ``half`` the
    same run trained for fewer steps (the most steps below, when there are several). ``rows`` are own
    attention rows on one text; the tag names the run and its steps when the report holds several runs."""
    rows = rows[(rows.finetuned == "yes") == finetuned]
    many_runs = rows.trained_run.nunique() > 1
    for (run, L), g in rows.groupby(["trained_run", "trained_len"], sort=True):
        steps = sorted(int(x) for x in g.trained_steps.unique())
        datas: dict[int, pc.Data] = {}
        for st in steps:
            h = g[g.trained_steps == st]
            datas[st] = pc.Data(h, _texts(windows, h), int(L), steps=st,
                                half=datas[max(datas)] if datas else None)
        top = datas[steps[-1]]
        tag = ", ".join(t for t in ((run if many_runs else ""), (f"{steps[-1]} steps" if len(steps) > 1 else "")) if t)
        yield tag, top


# ---------------------------------------------------------------------------------------------
# where the gap comes from


def decomposition(df: Any) -> Any:
    """The training kernel crossed with the inference kernel, for every Positional-LSH-trained scheme
    of each group at its training length (the side text): bits per byte of the exact-ALiBi-trained
    weights run with exact ALiBi (``AA``) and with that scheme's masks (``AP``), and of the
    Positional-LSH-trained weights run with exact ALiBi (``PA``) and with their own masks (``PP``);
    the effects seed-paired with 95% t-intervals: the total gap ``PP - AA``, the inference kernel's
    effect on each set of weights (``AP - AA``, ``PP - PA``), the training kernel's under each inference
    (``PA - AA``, ``PP - AP``) and their interaction ``(PP - PA) - (AP - AA)``. Where the interaction is
    as large as the effects, no share of the gap belongs to inference or to the weights alone. The last
    columns run the Positional-LSH weights with other s at inference, minus ``AA``."""
    import pandas as pd

    rows, swapped_s = [], set()
    d = side_text(df[df.length == df.trained_len])
    for (run, ft, L, steps), g in d.groupby(["trained_run", "finetuned", "trained_len", "trained_steps"]):
        alibi = g[(g.position == pc.ALIBI) & (g.attn_dropout.fillna(0) == 0)]
        aa = alibi[alibi.attention == OWN].groupby("run_seed").bits_per_byte.mean()
        for s_trained, h in g[g.position == pc.POSLSH].groupby("trained_s"):
            pp = h[h.attention == OWN].groupby("run_seed").bits_per_byte.mean()
            pa = h[h.attention == pc.ALIBI].groupby("run_seed").bits_per_byte.mean()
            ap = alibi[(alibi.attention == pc.POSLSH) & (alibi.s == s_trained)].groupby("run_seed").bits_per_byte.mean()
            if pp.empty or pa.empty or aa.empty:
                continue
            seeds = sorted(set(pp.index) & set(pa.index) & set(aa.index) & (set(ap.index) if len(ap) else set(aa.index)))
            row = {"run": run, "fine-tuned": ft, "L": int(L), "steps": int(steps), "trained": f"poslsh s={int(s_trained)}",
                   "seeds": len(seeds)}
            cells = {"AA": aa, "AP": ap, "PA": pa, "PP": pp}
            for name, v in cells.items():
                row[name] = round(float(v[seeds].mean()), 4) if len(v) else float("nan")
            effects = {"total PP-AA": pp[seeds] - aa[seeds], "training under ALiBi PA-AA": pa[seeds] - aa[seeds],
                       "inference on own weights PP-PA": pp[seeds] - pa[seeds]}
            if len(ap):
                effects.update({"inference on ALiBi weights AP-AA": ap[seeds] - aa[seeds],
                                "training under masks PP-AP": pp[seeds] - ap[seeds],
                                "interaction": (pp[seeds] - pa[seeds]) - (ap[seeds] - aa[seeds])})
            for name, v in effects.items():
                iv = t_interval(v.values)
                row[name] = f"{iv.estimate:+.4f} [{iv.low:+.4f}, {iv.high:+.4f}]" if iv.finite else f"{iv.estimate:+.4f}"
            for s_inf, hh in h[h.attention == pc.POSLSH].groupby("s"):
                v = hh.groupby("run_seed").bits_per_byte.mean()
                common = sorted(set(v.index) & set(aa.index))
                swapped_s.add(int(s_inf))
                row[_swapped_column(s_inf)] = round(float((v[common] - aa[common]).mean()), 4) \
                    if common else float("nan")
            rows.append(row)
    out = pd.DataFrame(rows)
    swapped = [_swapped_column(s) for s in sorted(swapped_s)]
    out = out[[c for c in out.columns if c not in swapped] + swapped]
    return out.astype({c: object for c in swapped}).fillna({c: "-" for c in swapped})  # "-": its own s (PP)


def _swapped_column(s: int) -> str:
    """The decomposition's column of the Positional-LSH weights run with s masks at inference."""
    return f"s={int(s)} at inference - AA"


WEIGHTS_RULE = ("an estimate, no verdict: the Positional-LSH-trained weights run with exact ALiBi at inference minus "
                "the exact-ALiBi-trained model of the same seed (PA - AA), with its 90% t-interval beside the margin "
                f"({MARGIN_FRACTION:.0%} of the latter's mean bits per byte). The training kernel's effect depends on the "
                "inference kernel (the 2 x 2 table's interaction), so this difference does not say which share of the "
                "gap is the weights' and decides nothing")


WEIGHTS = Claim("weights_reach_alibi", "perplexity",
                "{where}Positional LSH s={s}'s trained weights run with exact ALiBi, against the exact-ALiBi-trained "
                "model (PA - AA: an estimate)", WEIGHTS_RULE, metric="bits_per_byte",
                sides=({"position": pc.ALIBI, "attention": "own"}, {"position": pc.POSLSH, "s": "*", "attention": pc.ALIBI}))


def claim_weights_reach_alibi(df: Any) -> list[Verdict]:
    """For each Positional-LSH-trained scheme: its weights, run with exact ALiBi, reach the
    exact-ALiBi-trained model (so the gap is the approximation at inference, not the weights)."""
    out = []
    d = side_text(df[df.length == df.trained_len])
    for (run, ft, L, steps), g in d.groupby(["trained_run", "finetuned", "trained_len", "trained_steps"]):
        ref = g[(g.position == pc.ALIBI) & (g.attention == OWN) & (g.attn_dropout.fillna(0) == 0)]
        ref = ref.groupby("run_seed").bits_per_byte.mean()
        if ref.empty:
            continue
        margin = relative_margin(float(ref.mean()))
        where = "fine-tuned, " if ft == "yes" else ""
        for s_trained, h in g[g.position == pc.POSLSH].groupby("trained_s"):
            exact = h[h.attention == pc.ALIBI].groupby("run_seed").bits_per_byte.mean()
            if exact.empty:
                continue
            seeds = sorted(set(exact.index) & set(ref.index))
            iv = t_interval((exact[seeds] - ref[seeds]).values, 0.90)
            said = dict(key=f"{'finetune' if ft == 'yes' else 'scratch'}/weights_reach_alibi/s={int(s_trained)}",
                        where=where, s=int(s_trained))
            if iv.n < MIN_SEEDS:
                out.append(WEIGHTS.verdict(Status.INCONCLUSIVE, f"L={int(L)}: {count(iv.n, 'seeds')} (at least "
                                           f"{MIN_SEEDS} needed)", **said))
                continue
            # not identified alone (the interaction of the 2 x 2 table): an estimate, never a verdict
            status = Status.ESTIMATE
            where_iv = "above" if iv.low > margin else "below" if iv.high < margin else "across"
            why = f"the interval lies {where_iv} the margin"
            ev = (f"L={int(L)}, {int(steps)} steps{', ' + run if run else ''}: weights with exact ALiBi minus the "
                  f"ALiBi-trained model {iv.text()}; margin {margin:.4f} ({why})")
            out.append(WEIGHTS.verdict(status, ev, {"unit": "bits per byte", "length": int(L), "margin": margin,
                                                    "boundary": margin, "diff": iv.record()}, **said))
    return out


# ---------------------------------------------------------------------------------------------
# power and the error rate the verdicts share


def power_table(verdicts: list[Verdict]) -> Any:
    """Per comparison judged over seeds: the measured seed-paired spread, the interval's half-width
    against half the margin, and the seeds that make the 90% half-width at most half the margin at that
    spread (the power rule)."""
    import pandas as pd

    rows = []
    for v in verdicts:
        n = v.numbers or {}
        diff, margin = n.get("diff"), n.get("margin", math.nan)
        if not diff or diff.get("source") != "seeds" or not (margin == margin) or v.status is Status.ESTIMATE:
            continue
        iv = Interval.of_record(diff)
        sd = spread(iv)
        if not (sd == sd):
            continue
        need = seeds_for_half_width(sd, margin / 2, 0.90)
        rows.append({"claim": v.claim, "seeds": iv.n, "paired SD": round(sd, 4),
                     "90% half-width": round(half_width(sd, iv.n, 0.90), 4), "half the margin": round(margin / 2, 4),
                     "seeds for half-width <= margin/2": need if need is not None else "> 1000",
                     "verdict": v.status.value})
    return pd.DataFrame(rows)


def family_paragraph(verdicts: list[Verdict]) -> str:
    """How many verdicts share the error rate, that none is corrected, and which decided ones still
    hold when Bonferroni's correction spreads the rate over all of them."""
    decided = [v for v in verdicts if v.status in (Status.SUPPORTED, Status.NOT_SUPPORTED)]
    judged = [v for v in verdicts if v.status not in (Status.NOT_MEASURED, Status.ESTIMATE)]  # estimates decide nothing
    holding = []
    for v in decided:
        n = v.numbers or {}
        diff = n.get("diff")
        if not diff or diff.get("source") != "seeds":
            continue
        iv = family_wise(Interval.of_record(diff), len(judged))
        b = n.get("boundary", 0.0)
        if iv.finite and (iv.high < b or iv.low >= b):
            holding.append(v.claim)
    return (f"These {len(judged)} language-model verdicts each hold at their own error rate (a non-inferiority verdict "
            "5% one-sided, a difference 2.5% each side); no multiplicity correction is applied, so among them about "
            f"{0.05 * len(judged):.1f} could be wrong by chance. With Bonferroni's correction over all {len(judged)} "
            f"(each interval widened to its level divided among them), {len(holding)} of the {len(decided)} decided "
            "verdicts still hold" + (": " + "; ".join(holding) if holding else "") + ".")


def margin_paragraph(own: Any) -> Optional[str]:
    """The margins in use, each computed from the baseline it scales: exact ALiBi's mean over seeds at its
    training length on each metric, per group."""
    parts = []
    for tag, d in groups(main_text(own[own.length == own.trained_len]), None, False):
        m = d.margin
        if m == m:
            top1 = d.with_metric(pc.TOP1_MISS).margin if "top1" in d.rows.columns and d.rows.top1.notna().all() \
                else math.nan
            parts.append(f"{tag or 'this run'}: {m:.4f} bits per byte" + (f", {top1:.2f} top-1 error points"
                                                                        if top1 == top1 else ""))
    if not parts:
        return None
    return (f"The non-inferiority margin is {MARGIN_FRACTION:.0%} of exact ALiBi's own value on each metric "
            "(docs/THEORY.md, \"One margin\"): " + "; ".join(parts) + ".")
