"""The registered confirmatory experiment's analysis from ``poslsh perplexity`` rows
(docs/PREREGISTRATION.md; the statistics in :mod:`poslsh_cli.verdicts.registered`).

The primary comparisons are decided here, once, under Holm's correction, on the registered endpoint:
each model under its own attention at the training length, non-overlapping windows, its largest
evaluation text, a Positional-LSH value the mean over its mask draws, paired by training seed. A
verdict needs every registered seed: with fewer evaluated it is NOT MEASURED and shows no gap (an
interim look was not registered). The stability check reads the same gap at the earlier training
lengths the registration names (from another run's rows, when the report holds it).

Every other comparison of a registered run is secondary: the run's own section shows it as an
estimate (:data:`~poslsh_cli.verdicts.claims.Status` ``ESTIMATE``), never as a verdict
(:func:`secondary`).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Iterable, Optional

import numpy as np

from poslsh_cli.experiments.perplexity import headline
from poslsh_cli.experiments.perplexity.claims import ALIBI, OWN, POSLSH
from poslsh_cli.experiments.perplexity.groups import main_text
from poslsh_cli.verdicts.claims import Section, Status, Verdict
from poslsh_cli.verdicts.declared import Claim, Role
from poslsh_cli.verdicts.registered import (REGISTERED, GapPoint, Primary, Registration, Stability, decide_primary,
                                            stability)

NONOVERLAPPING = "nonoverlapping"
SECONDARY_RULE = ("secondary comparison of a registered experiment (docs/PREREGISTRATION.md at L = 256, "
                  "docs/PREREGISTRATION_L1024.md at L = 1024): an estimate with its "
                  "interval and direction, no verdict")


def registration_of(run: str) -> Optional[Registration]:
    """The registration of a train run (by its run name: the registered run, or one trained for it),
    or None for an exploratory run."""
    name = str(run).split("/")[0]
    return REGISTERED.get(name) or next((r for r in REGISTERED.values() if name in r.companions), None)


def secondary(verdicts: Iterable[Verdict]) -> list[Verdict]:
    """The verdicts of a registered run's secondary comparisons, as estimates: the numbers and the
    interval stay, the status becomes ESTIMATE (a NOT MEASURED stays NOT MEASURED), the rule says why."""
    return [v if v.status is Status.NOT_MEASURED else
            dataclasses.replace(v, status=Status.ESTIMATE, rule=f"{SECONDARY_RULE}; computed as: {v.rule}")
            for v in verdicts]


def endpoint_rows(df: Any, run: str, steps: int) -> Any:
    """The registered endpoint's rows of one train run at one training length: own attention at the
    training length, non-overlapping windows, each model's largest evaluation text, not fine-tuned,
    no attention dropout."""
    rows = df[(df.attention == OWN) & (df.trained_run.astype(str).str.split("/").str[0] == run)
              & (df.trained_steps == steps) & (df.length == df.trained_len) & (df.finetuned != "yes")
              & (df.attn_dropout.fillna(0.0) == 0.0)]
    if "protocol" in rows.columns:
        rows = rows[rows.protocol == NONOVERLAPPING]
    return main_text(rows)


def per_seed(rows: Any, position: str, s: int = 0) -> dict:
    """Per training seed, a scheme's bits per byte on the endpoint's rows (the mean over its mask draws)."""
    r = rows[rows.position == position]
    if position == POSLSH:
        r = r[r.trained_s == s]
    return r.groupby("run_seed").bits_per_byte.mean().to_dict()


def seed_gaps(rows: Any, primary: Primary) -> dict:
    """Per training seed, the treatment's bits per byte (mean over its draws) minus the control's."""
    a, b = per_seed(rows, primary.treatment, primary.s), per_seed(rows, primary.control)
    return {k: a[k] - b[k] for k in sorted(set(a) & set(b))}


def gap_point(rows: Any, primary: Primary, steps: int) -> Optional[GapPoint]:
    """The seed-paired gap at one training length with its standard error (None under two seeds)."""
    g = np.array(list(seed_gaps(rows, primary).values()), float)
    if g.size < 2:
        return None
    return GapPoint(steps, float(g.mean()), float(g.std(ddof=1) / math.sqrt(g.size)), int(g.size))


def primary_verdicts(dfs: list[Any], reg: Registration) -> list[Verdict]:
    """The registered primary verdicts from the rows of every perplexity run of the report (the
    registered run's and, for the stability check, the earlier runs')."""
    import pandas as pd

    df = pd.concat(dfs, ignore_index=True)
    rows = endpoint_rows(df, reg.train_run, reg.steps)
    why = not_as_registered(rows, reg)
    if why:
        return [PRIMARY[p.id].not_measured(why) for p in reg.primary]
    control = per_seed(rows, ALIBI)
    gaps = {p: seed_gaps(rows, p) for p in reg.primary}
    margin = reg.margin_fraction * float(np.mean([control[k] for k in reg.seeds]))
    decided = decide_primary({p: [gaps[p][k] for k in reg.seeds] for p in reg.primary}, margin, reg.alpha)
    out = []
    for p in reg.primary:
        r = decided[p]
        t = r.test
        stab = _stability(df, reg, p, margin, GapPoint(reg.steps, t.gap, t.se, t.n))
        side = "upper" if r.status is not Status.NOT_SUPPORTED else "lower"
        step = r.worse if r.status is Status.NOT_SUPPORTED else r.reach
        tested = (f"Holm rank {step.rank}, one-sided level {step.level:.4f}: {side} bound {r.bound:+.4f}"
                  if step.tested else f"Holm rank {step.rank}: not tested (the procedure stopped before it)")
        ev = (f"L={reg.seq_len}, {reg.steps} steps, {t.n} seeds x {reg.mask_draws} draws: gap {t.gap:+.4f} bits per byte "
              f"({100 * t.gap / (margin / reg.margin_fraction):+.2f}% of exact ALiBi's), 90% [{t.low90:+.4f}, "
              f"{t.high90:+.4f}]; margin {margin:.4f}; {tested}, adjusted p {r.adjusted_p:.4f}; "
              + (stab.text() if isinstance(stab, Stability) else stab))
        numbers = {"unit": "bits per byte", "length": reg.seq_len, "steps": reg.steps, "margin": margin,
                   "boundary": margin, "gap": t.gap, "low90": t.low90, "high90": t.high90, "bound": r.bound,
                   "adjusted_p": r.adjusted_p, "seeds": t.n, "primary": p.id, "s": p.s, "registration": reg.name,
                   "stability": (dataclasses.asdict(stab) if isinstance(stab, Stability) else None)}
        out.append(PRIMARY[p.id].verdict(r.status, ev, numbers))
    return out


def not_as_registered(rows: Any, reg: Registration) -> str:
    """Why the endpoint's rows cannot be judged as registered ("" when they can): every registered
    seed of every primary scheme and of the control at the registered length, each Positional-LSH
    model with the registered number of mask draws, no missing value, one evaluation text for all."""
    registered = set(reg.seeds)
    rows = rows[rows.trained_len == reg.seq_len]
    schemes = [(ALIBI, 0)] + [(p.treatment, p.s) for p in reg.primary]
    seen = [set(rows[(rows.position == pos) & ((rows.trained_s == s) if pos == POSLSH else True)].run_seed)
            for pos, s in schemes]
    done = min(len(s & registered) for s in seen)
    if done < len(registered):
        return (f"{done} of the {len(reg.seeds)} registered seeds evaluated at L={reg.seq_len} after {reg.steps} steps: "
                "the registered analysis runs on all of them (no interim look was registered)")
    rows = rows[rows.run_seed.isin(registered)]
    if rows.bits_per_byte.isna().any():
        return "a registered model's bits per byte is missing (NaN): not measured as registered"
    draws = rows[rows.position == POSLSH].groupby(["trained_s", "run_seed"]).size()
    if len(draws) and (draws != reg.mask_draws).any():
        return (f"Positional-LSH models evaluated with {sorted(set(int(x) for x in draws))} mask draws, "
                f"{reg.mask_draws} registered")
    if rows.text_tokens.nunique() > 1:
        return "the registered models were scored on different evaluation texts"
    return ""


def _primary(p: Primary, reg: Registration) -> Claim:
    """The registered primary claim ``p`` of ``reg``, as its page registered it."""
    return Claim(
        f"primary/{p.id}", "perplexity",
        f"primary ({reg.name}): Positional LSH s={p.s} reaches exact ALiBi's bits per byte within "
        f"{reg.margin_fraction:.0%} at T = {reg.steps}",
        f"registered {reg.name} (commit {reg.commit[:10]}): one-sided paired t over the {len(reg.seeds)} registered "
        f"seeds against the margin ({reg.margin_fraction:.0%} of exact ALiBi's mean), Holm over the {len(reg.primary)} "
        f"primary comparisons at {reg.alpha:.0%} in each direction (reaching rejected: SUPPORTED; worse by more than "
        "the margin rejected: NOT SUPPORTED; otherwise INCONCLUSIVE); a verdict needs every registered seed, evaluated "
        "as registered", metric="bits_per_byte", role=Role.PRIMARY,
        sides=({"position": p.control}, {"position": p.treatment, "s": p.s}))


#: every registered primary claim, by its comparison's id
PRIMARY = {p.id: _primary(p, reg) for reg in REGISTERED.values() for p in reg.primary}


def _stability(df: Any, reg: Registration, p: Primary, margin: float, last: GapPoint) -> Stability | str:
    points = [gap_point(endpoint_rows(df, run, steps), p, steps) for run, steps in reg.earlier]
    missing = [f"{run} at {steps} steps" for (run, steps), pt in zip(reg.earlier, points) if pt is None]
    if missing:
        return f"stability not measured: no {', '.join(missing)} among the runs reported"
    return stability([*points, last], margin / 2, reg.stability_level, reg.stability_df)


def section(dfs: list[Any]) -> Optional[Section]:
    """The registered experiments' section of a report, from the rows of every perplexity run in it
    (None when no registered run is among them)."""
    runs = {str(x).split("/")[0] for d in dfs if "trained_run" in d.columns for x in d.trained_run.dropna().unique()}
    regs = [REGISTERED[r] for r in sorted(runs) if r in REGISTERED]
    if not regs:
        return None

    from pathlib import Path

    sec = Section("perplexity", Path("registered"), "Registered confirmatory experiment: does Positional LSH reach exact "
                  "ALiBi?")
    for reg in regs:
        sec.verdicts += primary_verdicts(dfs, reg)
        sec.paragraphs.append(
            f"{reg.name}, registered in {reg.page} at commit {reg.commit[:10]} before its first model "
            f"trained: {len(reg.seeds)} seeds ({reg.seeds[0]}-{reg.seeds[-1]}), T = {reg.steps} steps, L = {reg.seq_len}, "
            f"sigma = {reg.sigma:g} every head; each primary verdict is decided under Holm's correction over the "
            f"{len(reg.primary)} comparisons and carries the registered stability check (the gap's slope per "
            f"doubling of training over " + ", ".join(f"{st}" for _, st in reg.earlier) + f" and {reg.steps} steps, "
            f"{reg.stability_level:.0%} interval against half the margin). Every other comparison of the run is "
            "secondary: an estimate, in the run's own section.")
    _answer(sec, dfs, regs)
    return sec


def _answer(sec: Section, dfs: list[Any], regs: list[Registration]) -> None:
    """The section's answer (:mod:`~poslsh_cli.experiments.perplexity.headline`): per registration its
    paragraph and its table in the paper's form (also among the section's tables), then the caveats; the
    README's language-model part opens with it (:attr:`Section.lead`) once a primary verdict is measured."""
    import pandas as pd

    df = pd.concat(dfs, ignore_index=True)
    lead, notes = [], []
    for i, reg in enumerate(regs):
        rows = endpoint_rows(df, reg.train_run, reg.steps)
        table = headline.paper_table(rows, reg, sec.verdicts)
        lead.append(headline.answer(reg, sec.verdicts))
        sec.paragraphs.insert(i, lead[-1])
        if table:
            sec.add_table(headline.TABLE_HEAD, table)
            lead += ["", *headline.markdown(headline.TABLE_HEAD, table)]
        lead.append("")
        margin = next((v.numbers["margin"] for v in sec.verdicts if (v.numbers or {}).get("registration") == reg.name),
                      None)
        notes += [f"- {reg.name}: {c}" for c in headline.caveats(df, reg, rows, margin)]
    sec.paragraphs.append("Caveats: " + " ".join(n[2:] for n in notes))
    if any(headline.measured(reg, sec.verdicts) for reg in regs):
        sec.lead = lead + ["Caveats:", "", *notes]
