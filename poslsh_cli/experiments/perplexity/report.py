"""``poslsh perplexity``'s tables, figures and claims: one function per figure and per claim of the
paper, each computed from the rows it quotes. Schemes appear in one order everywhere (the order
of :class:`~poslsh_cli.attention.scheme.Position`: no bias, the baselines, exact ALiBi, Positional LSH,
RoPE).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from poslsh_cli.experiments.perplexity.claims import OWN
from poslsh_cli.lm.evaluate import METRICS
from poslsh_cli.attention.scheme import Position, model_label
from poslsh_cli.verdicts.claims import Section
from poslsh_cli.experiments.perplexity import (
    claims as pc, extrapolation as pe, finetune as ft, groups as pg, registered as pr)
from poslsh_cli.verdicts.stats import t_interval

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
    """Bits per byte per trained model (scheme, s, dropout, bandwidths, steps), attention and s at each
    evaluation length L in tokens (the columns ``bpb L=n``), mean over trials and the training seeds counted in ``seeds``, in scheme
    order."""
    df = main_protocol(df)
    lengths = sorted(df.length.unique())
    head = ["trained", "finetuned", "steps", "seeds", "attention", "s"] + [f"bpb L={n}" for n in lengths]
    keys = MODEL_KEYS + ["finetuned", "trained_steps", "attention", "s"]
    groups = sorted(df.groupby(keys, sort=False), key=lambda kg: (scheme_rank(kg[0][0], kg[0][1]), kg[0][2], kg[0][3],
                                                                  kg[0][4], kg[0][5], kg[0][6] != OWN,
                                                                  scheme_rank(kg[0][6], kg[0][7])))
    rows = []
    for k, g in groups:
        by = g.groupby("length").bits_per_byte.mean()
        rows.append([model_label(*k[:4]), k[4], str(int(k[5])) if k[5] else "-", str(g.run_seed.nunique()), k[6],
                     str(k[7]) if k[7] else "-"] + [f"{by[n]:.4f}" if n in by else "-" for n in lengths])
    return head, rows


# ---------------------------------------------------------------------------------------------
# the report


#: the columns a trained model is told apart by, in the tables of this report: its train run, whether
#: fine-tuned, its training length and steps (a run's T/2 and T models are different models), then
#: :data:`MODEL_KEYS`
MODEL_GROUP_KEYS = ["trained_run", "finetuned", "trained_len", "trained_steps"] + MODEL_KEYS


def _by_scheme(df: Any) -> list:
    """(key, rows) per trained model (``MODEL_GROUP_KEYS``), in report order."""
    return sorted(df.groupby(MODEL_GROUP_KEYS),
                  key=lambda kg: (kg[0][:4], scheme_rank(kg[0][4], kg[0][5]), kg[0][6], kg[0][7]))


def _scheme_label(k: tuple) -> str:
    return model_label(*k[4:8])


def _trained(k: tuple) -> dict:
    """The columns that say which training a table row's models had (the run's name: by ``_one_run``)."""
    return {"run": k[0], "fine-tuned": k[1], "L": int(k[2]), "steps": int(k[3])}


def _one_run(table: Any) -> Any:
    """``table`` without its ``run`` column when every row comes from one train run (or none was recorded)."""
    if len(table) and "run" in table.columns and table["run"].nunique() <= 1:
        return table.drop(columns="run")
    return table


def _interval_text(iv: Any) -> str:
    return f"[{iv.low:.4f}, {iv.high:.4f}]" if iv.finite else "-"


def interval_table(own: Any) -> Any:
    """Per trained scheme and evaluation length: mean bits per byte with its 95% t-interval over
    training seeds (each seed the mean over its mask draws), and the counts it rests on."""
    import pandas as pd

    rows = []
    for k, g in _by_scheme(own):
        for length, h in g.groupby("length"):
            per_seed = h.groupby("run_seed").bits_per_byte.mean()
            iv = t_interval(per_seed.values)
            rows.append({**_trained(k), "scheme": _scheme_label(k),
                         "length": length, "bits/byte": round(iv.estimate, 4), "95% interval": _interval_text(iv),
                         "seeds": iv.n, "draws/seed": int(h.groupby("run_seed").size().max())})
    return _one_run(pd.DataFrame(rows))


def swapped_table(df: Any) -> Any:
    """At the training length, each trained scheme with another attention swapped in: mean bits per
    byte with its 95% t-interval over training seeds (each seed the mean over its mask draws), the
    same models under their own attention, the seed-paired difference (swapped minus own) with its
    95% interval, and the mean KL divergence (nats per token) from the model's own predictions."""
    import pandas as pd

    rows = []
    for k, g in _by_scheme(df[df.length == df.trained_len]):
        own = g[g.attention == OWN].groupby("run_seed").bits_per_byte.mean()
        for (att, s), h in g[g.attention != OWN].groupby(["attention", "s"]):
            per_seed = h.groupby("run_seed").bits_per_byte.mean()
            iv = t_interval(per_seed.values)
            common = per_seed.index.intersection(own.index)
            diff = t_interval((per_seed[common] - own[common]).values)
            rows.append({**_trained(k), "trained": _scheme_label(k),
                         "attention": model_label(att, s if att == "poslsh" else 0),
                         "bits/byte": round(iv.estimate, 4), "95% interval": _interval_text(iv),
                         "own": round(float(own[common].mean()), 4) if len(common) else float("nan"),
                         "swapped - own": round(diff.estimate, 4) if len(common) else float("nan"),
                         "difference 95%": _interval_text(diff) if len(common) else "-",
                         "KL": round(float(h.kl.mean()), 4), "seeds": iv.n,
                         "draws/seed": int(h.groupby("run_seed").size().max())})
    return _one_run(pd.DataFrame(rows))


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
    """A windows table's ``protocol`` column (windows written before it: nonoverlapping; the rows get it
    from :func:`~poslsh_cli.experiments.perplexity.groups.migrate`)."""
    if "protocol" not in df.columns:
        return df.assign(protocol=NONOVERLAPPING)
    return df.assign(protocol=df.protocol.fillna(NONOVERLAPPING))


def main_protocol(df: Any) -> Any:
    """The rows of the run's main protocol (nonoverlapping when it was run): what the tables and
    figures of one protocol show; the protocol table puts both side by side."""
    name = NONOVERLAPPING if (df.protocol == NONOVERLAPPING).any() or df.empty else df.protocol.iloc[0]
    return df[df.protocol == name]


def by_protocol(own: Any, windows: Any) -> list[tuple[str, Any, Any]]:
    """(tag, rows, windows) per scoring protocol. The sliding frame takes the nonoverlapping rows
    (and windows) at lengths up to the training length, where both protocols score the same
    windows and only nonoverlapping was run. One untagged frame when the run used one protocol."""
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

    long = own[own.length > own.trained_len]
    rows = []
    for k, g in _by_scheme(long):
        for length, h in g.groupby("length"):
            row = {**_trained(k), "model": _scheme_label(k), "length": int(length)}
            for name, hh in h.groupby("protocol"):
                row[f"{name} bpb"] = f"{hh.bits_per_byte.mean():.4f}"
                row[f"{name} tokens"] = int(hh.tokens.iloc[0])
            rows.append(row)
    return _one_run(pd.DataFrame(rows))


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
            rows.append({**_trained(k), "model": _scheme_label(k), "length": length, "seeds": h.run_seed.nunique(),
                         **{m.label: f"{m.scale * h[m.name].mean():.{m.digits}f}" for m in metrics},
                         "bpb": f"{h.bits_per_byte.mean():.4f}"})
    return _one_run(pd.DataFrame(rows))


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

    return [dataclasses.replace(v, claim=f"{v.claim} [{tag}]" if tag else v.claim, tag=f"[{tag}]" if tag else "",
                                key=f"{v.name}[{key_tag}]" if key_tag else v.name,
                                family=f"{v.family}[{key_tag}]" if v.family and key_tag else v.family)
            for v in verdicts]


def report(run: Path, df: Any) -> Section:
    sec = Section("perplexity", run, "Language modelling: from scratch, fine-tuning, length extrapolation")
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
    judged = _judged(protocols)
    judged += pg.claim_weights_reach_alibi(main_protocol(df))
    sec.verdicts += judged
    if "top1" in own.columns and own.top1.notna().any():
        sec.tables.append(accuracy_table(pg.main_text(own)))
        sec.paragraphs.append(ACCURACY_TEXT)
    _swapped(sec, df)
    power = pg.power_table(judged)
    if len(power):
        sec.tables.append(power)
        sec.paragraphs.append("Power of each comparison judged over seeds: the measured seed-paired spread, the 90% "
                              "interval's half-width against half the margin, and the seeds that would make that "
                              "half-width at most half the margin at this spread.")
    sec.paragraphs.append(pg.family_paragraph(judged))
    return sec


def _judged(protocols: list) -> list:
    """The verdicts at the training length (judged once, with the first protocol) and beyond it (under
    each protocol): a registered run's comparisons other than its primary ones as estimates."""
    judged: list = []
    for i, (ptag, pown, windows) in enumerate(protocols):
        # claims at the training length read the same windows under every protocol: judged once,
        # with the first (main) protocol; extrapolation is judged under each (on the side text)
        if i == 0:
            at_L = pg.main_text(pown[pown.length == pown.trained_len])
            accuracy = "top1" in at_L.columns and at_L.top1.notna().all() and len(at_L)
            for gtag, d in pg.groups(at_L, windows, finetuned=False):
                # a registered run's primary comparisons are decided once, in the registered section
                # (app/report.py); everything else it measured is secondary: estimates, no verdicts
                reg = pr.registration_of(d.rows.trained_run.iloc[0])
                claims = ((pc.claim_beats_no_bias, pc.claim_beats_original_and_fixed_blocks, pc.claim_beats_alibi)
                          if reg else (pc.claim_reaches_alibi, pc.claim_beats_no_bias,
                                       pc.claim_beats_original_and_fixed_blocks, pc.claim_beats_alibi))
                role = pr.secondary if reg else list
                for tag, h in _by_bandwidths(d.rows):
                    dd = dataclasses.replace(_restrict(d, h), estimate=bool(reg))
                    for claim in claims:
                        judged += _tagged(role(claim(dd)), _join(tag, gtag), tag)
                    if accuracy:
                        judged += _tagged(role(pc.claim_reaches_alibi_accuracy(dd.with_metric(pc.TOP1_MISS))),
                                          _join(tag, gtag), tag)
            tuned = list(pg.groups(at_L, windows, finetuned=True))
            for gtag, d in tuned or [("", None)]:
                for tag, h in _by_bandwidths(d.rows) if d is not None else [("", None)]:
                    dd = _restrict(d, h) if d is not None else None
                    judged += _tagged(ft.claim_finetune_approaches_alibi(dd) + ft.claim_finetune_beats_fixed_blocks(dd),
                                      _join(tag, gtag), tag)
        side = pg.side_text(pown)
        for gtag, d in pg.groups(side, windows, finetuned=False):
            for tag, h in _by_bandwidths(d.rows):
                # the protocol is part of the claim's name even where a run scored one (it lines up with a
                # run that scored several)
                proto = ptag or (str(pown.protocol.iloc[0]) if len(pown) else "")
                role = pr.secondary if pr.registration_of(d.rows.trained_run.iloc[0]) else list
                judged += _tagged(role(pe.claim_extrapolation(_restrict(d, h, keep_half=False))), _join(tag, gtag, ptag),
                                  _join(tag, proto))
    return judged


def _swapped(sec: Section, df: Any) -> None:
    """The rows run with another attention than the model's own, and the 2 x 2 decomposition of the gap."""
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
            sec.paragraphs.append("The training kernel crossed with the inference kernel, for every Positional-LSH-trained "
                                  "scheme at its training length (bits per byte, mean over seeds): AA, the "
                                  "exact-ALiBi-trained weights run with exact ALiBi; AP, the same weights with that "
                                  "scheme's masks; PA, the Positional-LSH-trained weights with exact ALiBi; PP, those "
                                  "weights with their own masks. The effects are seed-paired with 95% t-intervals: the "
                                  "total gap PP-AA, the inference kernel's effect on each set of weights, the training "
                                  "kernel's under each inference, and their interaction (PP-PA)-(AP-AA). Where the "
                                  "interaction is as large as the effects, the gap has no share that belongs to inference "
                                  "or to the weights alone, and no verdict is drawn from it. The last columns run the "
                                  "Positional-LSH weights with other s at inference, minus AA (\"-\" at its own s: PP).")


def protocol_label(own: Any) -> str:
    """How a run's models set their bandwidths, from its rows: ALiBi's per-head slopes (this project's
    protocol) or one sigma for every head (the paper's): the name of its column beside other runs."""
    labels = sorted(set(own.sigmas) - {""})
    return "; ".join("per-head σ (ALiBi's slopes)" if x == "standard" else x.replace("sigma=", "σ = ")
                     for x in labels) or "no bandwidth"


def described(run: Path, own: Any) -> str:
    """One sentence of what a run trained and evaluated (bandwidths, s, schemes, seeds, lengths, protocols)."""
    d = own
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
