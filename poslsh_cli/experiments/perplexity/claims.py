"""The paper's downstream claims, each judged from ``poslsh perplexity`` rows by a rule with an
interval (:mod:`poslsh_cli.verdicts.stats`): one function per claim.

A trained scheme is (position, s, attention dropout); the models compared are those of one train run,
one training length and one number of steps (the group the report builds). Its value at a length is,
per training seed, the mean metric over the mask draws of that seed's model (own attention);
comparisons are paired by seed. With fewer than three common seeds a comparison uses the per-window
differences of the same models on the same evaluation windows (evaluation noise only), and says so.

Every non-inferiority margin is :data:`~poslsh_cli.verdicts.stats.MARGIN_FRACTION` of the baseline's
own value on the metric (docs/THEORY.md, "One margin"). Where the group's run also trained the same
schemes for fewer steps (``half``: T/2 beside T), a verdict stands only if the seed-paired gap moved by
less than half the margin between the two: otherwise it is INCONCLUSIVE ("the gap still moves with
training").
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from poslsh_cli.verdicts.claims import Status, Verdict
from poslsh_cli.verdicts.declared import Claim
from poslsh_cli.attention.scheme import Position, model_label
from poslsh_cli.verdicts.stats import (DIFFERENCE_RULE, MARGIN_FRACTION, MIN_SEEDS, NEEDS_SEEDS, Interval, count,
                                      difference, equivalence, on_seeds, paired, paired_windows, relative_margin,
                                      seeds_to_decide)
from poslsh_cli.verdicts.stats import t_interval

#: the ``attention`` value of a model run as trained (the one definition: perplexity's rows, report and claims)
OWN = "own"
ALIBI, POSLSH, NONE = Position.ALIBI.value, Position.POSLSH.value, Position.NONE.value
FIXED_BLOCK, ROPE = Position.FIXED_BLOCK.value, Position.ROPE.value
#: Positional LSH's reference s for claims about one s (the paper's s=10), when it was run.
REFERENCE_S = 10


@dataclass(frozen=True)
class Arm:  # one side of a comparison: the rows of a position, s and attention dropout
    position: str
    s: int = 0
    dropout: float = 0.0

    @property
    def label(self) -> str:
        return model_label(self.position, self.s, self.dropout)


#: The metric a claim is judged on (smaller is better): the rows' column, the windows' columns
#: (value, weight) whose pooled ratio is the metric over windows, and a scale for that ratio. Its
#: margin is relative (:data:`MARGIN_FRACTION` of the baseline's value).
@dataclass(frozen=True)
class Metric:
    column: str
    unit: str
    window_value: str
    window_weight: str
    scale: float = 1.0


BPB = Metric("bits_per_byte", "bits per byte", "bits", "bytes")
#: top-1 next-token error in percentage points (100 x (1 - top-1 accuracy)): smaller is better
TOP1_MISS = Metric("top1_miss", "% top-1 error", "misses", "tokens", 100.0)


def equivalence_rule(unit: str) -> str:
    """The non-inferiority rule with the relative margin and the stability check, for a metric in ``unit``."""
    return (f"non-inferiority, paired by training seed: margin = {MARGIN_FRACTION:.0%} of exact ALiBi's mean {unit} "
            f"(the baseline of the comparison); the 90% t-interval of the difference ends below +margin: SUPPORTED "
            f"(at most that much worse, or better); it starts at or above +margin: NOT SUPPORTED; otherwise "
            f"INCONCLUSIVE. Where the run also trained the schemes for half the steps, the verdict stands only if "
            f"the seed-paired gap moved by less than half the margin between the two lengths of training "
            f"(else INCONCLUSIVE). With fewer than {MIN_SEEDS} seeds the interval is over the evaluation windows "
            f"(evaluation noise only) and the verdict INCONCLUSIVE")


EQUIVALENCE_RULE = equivalence_rule("bits per byte")
BETTER_RULE = (DIFFERENCE_RULE + f"; where the run also trained the schemes for half the steps, the verdict stands only "
               f"if the seed-paired gap moved by less than half the margin ({MARGIN_FRACTION:.0%} of exact ALiBi's "
               "value) between the two lengths of training (else INCONCLUSIVE)")

#: the compared side of a claim made of each s (sides as scheme fields, verdicts/declared.py)
ANY_S = {"position": POSLSH, "s": "*"}
_REF_S = {"position": POSLSH, "s": "reference"}
#: from scratch, Positional LSH (each s) reaches exact ALiBi on a metric: one family per metric
REACHES = {m.column: Claim(f"scratch/reaches_alibi/s/{m.column}", "perplexity",
                           "from scratch, Positional LSH {member} reaches the " + what + " of exact ALiBi",
                           equivalence_rule(m.unit), metric=m.column, sides=({"position": ALIBI}, ANY_S), family=True)
           for m, what in ((BPB, "bits per byte"), (TOP1_MISS, "top-1 accuracy"))}
BEATS_NONE = Claim("scratch/better_than_none/reference_s", "perplexity",
                   "from scratch, Positional LSH s={s} beats the model without positional information", BETTER_RULE,
                   metric="bits_per_byte or top1_miss", sides=({"position": NONE}, _REF_S))
#: the paper's baselines, where they were trained
BEATS_BASELINE = {pos: Claim(f"scratch/better_than_{pos}/reference_s", "perplexity",
                             "from scratch, Positional LSH s={s} is better than " + name, BETTER_RULE,
                             metric="bits_per_byte or top1_miss", sides=({"position": pos}, _REF_S))
                  for pos, name in ((ROPE, "the original RoPE model"), (FIXED_BLOCK, "fixed blocks"))}
BEATS_ALIBI = Claim("scratch/better_than_alibi/reference_s", "perplexity",
                    "from scratch, Positional LSH s={s} is better than exact ALiBi", BETTER_RULE,
                    metric="bits_per_byte or top1_miss", sides=({"position": ALIBI}, _REF_S))
BEATS_ALIBI_DROPOUT = Claim("scratch/better_than_alibi_dropout/reference_s", "perplexity",
                            "from scratch, Positional LSH s={s} is better than exact ALiBi trained with attention "
                            "dropout{dropout}", BETTER_RULE, metric="bits_per_byte or top1_miss",
                            sides=({"position": ALIBI, "dropout": "> 0"}, _REF_S))


def with_top1_miss(rows: Any) -> Any:
    """``rows`` with the ``top1_miss`` column (percentage points of wrong top-1 predictions)."""
    return rows.assign(top1_miss=100.0 * (1.0 - rows.top1))


def with_metric_rows(metric: Metric, rows: Any) -> Any:
    """``rows`` carrying ``metric``'s column."""
    return with_top1_miss(rows) if metric is TOP1_MISS else rows


@dataclass
class Data:
    """The own-attention rows of one group of models (one train run, from scratch or fine-tuned, one
    training length and number of steps) on one evaluation text and the evaluation windows of the run
    (``windows.csv``; may be empty), judged on ``metric`` (bits per byte unless said). ``half``: the
    same group trained for fewer steps (the stability check), ``steps``: this group's."""

    rows: Any
    windows: Any
    L: int
    metric: Metric = BPB
    half: Optional["Data"] = None
    steps: int = 0
    #: a registered run's secondary comparison: an estimate, so no count of seeds that would decide it
    estimate: bool = False

    @property
    def margin(self) -> float:
        """:data:`MARGIN_FRACTION` of exact ALiBi's mean over seeds at L on this metric (NaN without it)."""
        a = self.per_seed(Arm(ALIBI), self.L)
        return relative_margin(float(np.mean(list(a.values()))) if a else math.nan)

    def with_metric(self, metric: Metric) -> "Data":
        """The same group (and its ``half``) judged on another metric."""
        half = None if self.half is None else self.half.with_metric(metric)
        return Data(with_metric_rows(metric, self.rows), self.windows, self.L, metric, half, self.steps, self.estimate)

    def fall(self, sc: Arm) -> float:
        """How far the scheme's validation bits per byte still fell over the last 20% of its training
        (mean over its models; NaN where not recorded)."""
        r = self.select(sc, self.L)
        if "trained_fall" not in r.columns or r.trained_fall.isna().all():
            return math.nan
        return float(r.drop_duplicates("run_seed").trained_fall.mean())

    def select(self, sc: Arm, length: int) -> Any:
        r = self.rows[(self.rows.position == sc.position) & (self.rows.length == length)]
        if sc.position == POSLSH:
            r = r[r.trained_s == sc.s]
        if "attn_dropout" in r.columns:
            r = r[r.attn_dropout.fillna(0.0).round(6) == round(sc.dropout, 6)]
        return r

    def per_seed(self, sc: Arm, length: int) -> dict:
        """The metric (bits per byte) per training seed: the mean over that seed's mask draws."""
        return self.select(sc, length).groupby("run_seed")[self.metric.column].mean().to_dict()

    @property
    def far(self) -> int:
        """The extrapolation length as a multiple of L: 4 when models were evaluated at 4L (this
        project's protocol), else 2 when at 2L (the paper's longest multiple at CPU scale), else 4."""
        lengths = set(int(x) for x in self.rows.length.unique())
        return 4 if 4 * self.L in lengths else 2 if 2 * self.L in lengths else 4

    def present(self, sc: Arm, length: int) -> bool:
        return len(self.select(sc, length)) > 0

    def window_bits(self, sc: Arm, length: int, seeds: list) -> Optional[tuple[np.ndarray, np.ndarray]]:
        """(bits per window, bytes per window) of the scheme's models of ``seeds``, each window's bits
        the mean over the mask draws, windows of the seeds concatenated in seed order."""
        if self.windows is None or not len(self.windows):
            return None
        sel = self.select(sc, length)
        bits, nbytes = [], []
        for seed in seeds:
            cks = sel[sel.run_seed == seed].checkpoint.unique()
            if not len(cks):
                return None
            w = self.windows[(self.windows.checkpoint == cks[0]) & (self.windows.attention == OWN)
                             & (self.windows.length == length)]
            if w.empty:
                return None
            if self.metric.window_value == "misses":
                if "top1" not in w.columns or w.top1.isna().any():
                    return None
                w = w.assign(misses=self.metric.scale * (w.tokens - w.top1))
            g = w.groupby("window").agg(bits=(self.metric.window_value, "mean"),
                                        nbytes=(self.metric.window_weight, "first")).sort_index()
            bits.append(g.bits.to_numpy())
            nbytes.append(g.nbytes.to_numpy())
        return np.concatenate(bits), np.concatenate(nbytes)

    def compare(self, a: Arm, b: Arm, length: int, level: float) -> tuple[Optional[Interval], str]:
        """Interval of bits per byte of ``a`` minus ``b`` at ``length``, and what it rests on."""
        sa, sb = self.per_seed(a, length), self.per_seed(b, length)
        common = sorted(set(sa) & set(sb))
        if len(common) >= MIN_SEEDS:
            return paired(sa, sb, level), f"{len(common)} training seeds paired"
        seeds = common or []
        wa = self.window_bits(a, length, seeds) if seeds else None
        wb = self.window_bits(b, length, seeds) if seeds else None
        if wa is None or wb is None or len(wa[0]) != len(wb[0]):
            return None, f"{count(len(common), 'common seeds')} and no evaluation windows"
        iv = paired_windows(wa[0], wb[0], wa[1], level)
        return iv, f"{count(len(common), 'training seeds')}: evaluation noise only, over {iv.n} windows ({NEEDS_SEEDS})"


def _draws(d: Data, sc: Arm, length: int) -> int:
    sel = d.select(sc, length)
    return int(sel.groupby("run_seed").size().max()) if len(sel) else 0


def _evidence(d: Data, a: Arm, b: Arm, length: int, iv: Interval, basis: str) -> str:
    sa, sb = d.per_seed(a, length), d.per_seed(b, length)
    means = (f"{a.label} {np.mean(list(sa.values())):.4f} ({count(len(sa), 'seeds')} x "
             f"{count(_draws(d, a, length), 'draws')}), "
             f"{b.label} {np.mean(list(sb.values())):.4f} ({count(len(sb), 'seeds')} x "
             f"{count(_draws(d, b, length), 'draws')})")
    unit = "" if d.metric is BPB else f" ({d.metric.unit}, 100 minus the top-1 accuracy in %)"
    falls = [(sc.label, d.fall(sc)) for sc in (a, b)]
    trained = "; ".join(f"{lab} {f:.4f}" for lab, f in falls if f == f)
    return (f"L={length}{unit}: {means}; difference {a.label} - {b.label} {iv.text()}; {basis}"
            + (f"; validation fell over the last 20% of training: {trained}" if trained else ""))


def _numbers(d: Data, a: Arm, b: Arm, length: int, iv: Interval, margin: float = math.nan,
             boundary: float = 0.0) -> dict:
    """What a comparison of ``a`` with ``b`` rests on, for a reader that compares two runs' verdicts
    (:func:`poslsh_cli.app.report.side_by_side`) or re-reads them (power, multiplicity): each
    scheme's mean over seeds with its 95% t-interval, the difference ``a - b`` (``iv``) with its
    interval and what it is over, the margin and the boundary the rule compares the interval with."""
    def scheme(sc: Arm) -> dict:
        ti = t_interval(d.per_seed(sc, length).values())
        return {"label": sc.label, "position": sc.position, "mean": ti.estimate, "low": ti.low, "high": ti.high, "seeds": ti.n,
                "draws": _draws(d, sc, length)}

    return {"unit": d.metric.unit, "length": length, "a": scheme(a), "b": scheme(b),
            "diff": iv.record(), "margin": margin, "boundary": boundary}


def _gap(d: Data, a: Arm, b: Arm, length: int) -> Optional[float]:
    """Mean over the common seeds of ``a - b`` (None without a common seed)."""
    sa, sb = d.per_seed(a, length), d.per_seed(b, length)
    common = sorted(set(sa) & set(sb))
    return float(np.mean([sa[k] - sb[k] for k in common])) if common else None


def stability(d: Data, a: Arm, b: Arm, length: int, margin: float) -> tuple[Optional[bool], str]:
    """Whether the seed-paired gap ``a - b`` settled with training: (True, why) when it moved by less
    than half the margin from the group trained for fewer steps (``d.half``) to this one, (False, why)
    when it moved by more, (None, why) when it was not measured."""
    if d.half is None:
        return None, (f"trained for {d.steps} steps only: whether the gap still moves with training is not measured"
                      if d.steps else "one training length: whether the gap still moves with training is not measured")
    g_half, g = _gap(d.half, a, b, length), _gap(d, a, b, length)
    if g_half is None or g is None:
        return None, f"no {a.label} and {b.label} pair at {d.half.steps} steps: the gap's movement is not measured"
    moved = abs(g - g_half)
    where = f"{g_half:+.4f} at {d.half.steps} steps, {g:+.4f} at {d.steps}"
    if not (margin == margin):
        return None, f"the gap was {where} (no margin to compare its movement with)"
    if moved < margin / 2:
        return True, f"the gap settled: {where} (moved {moved:.4f}, less than half the margin, {margin / 2:.4f})"
    return False, f"the gap still moves with training: {where} (moved {moved:.4f}, half the margin is {margin / 2:.4f})"


def _decide(iv: Interval, boundary: float, status: Status, margin: float) -> str:
    """For an INCONCLUSIVE interval: how many seeds would decide it at the measured spread."""
    if status is not Status.INCONCLUSIVE or not iv.finite or iv.source != "seeds":
        return ""
    n = seeds_to_decide(iv, boundary)
    return (f"; at this spread {n} seeds would decide it" if n is not None else
            "; the estimate sits on the boundary: no number of seeds at this spread decides it")


def _key(name: str, d: Data) -> str:
    """A claim's name with the metric it is judged on."""
    return f"{name}/{d.metric.column}"


def _absent(d: Data, length: int, *schemes: Arm) -> str:
    """Which of the schemes a claim compares were not evaluated at ``length`` (only those)."""
    return f"no {' or '.join(sc.label for sc in schemes if not d.present(sc, length))} models evaluated at L={length}"


def judged_equivalent(d: Data, claim: Claim, a: Arm, b: Arm, length: int, key: str = "", **fields: Any) -> Verdict:
    """``a`` reaches ``b`` on ``d``'s metric (the relative non-inferiority margin), as ``claim`` (its
    ``fields`` and member) under ``key`` (default the claim's id) with the metric's column added."""
    rule = EQUIVALENCE_RULE if d.metric is BPB else equivalence_rule(d.metric.unit)
    said = dict(rule=rule, key=_key(key or claim.id, d), **fields)
    if not (d.present(a, length) and d.present(b, length)):
        return claim.not_measured(_absent(d, length, a, b), **said)
    margin = d.margin
    if not (margin == margin):
        return claim.not_measured(f"no exact-ALiBi model at L={length} to scale the margin", **said)
    iv, basis = d.compare(a, b, length, 0.90)
    if iv is None:
        return claim.verdict(Status.INCONCLUSIVE, f"L={length}: {basis}", **said)
    status, why = equivalence(iv, margin)
    status = on_seeds(status, iv)
    why = why.replace(str(margin), f"{margin:.4f}")
    decide = "" if d.estimate else _decide(iv, margin, status, margin)
    settled, moved = stability(d, a, b, length, margin)
    if settled is False:
        status, decide = Status.INCONCLUSIVE, ""
    ev = (_evidence(d, a, b, length, iv, basis) + f"; margin {margin:.4f} ({MARGIN_FRACTION:.0%} of {b.label}'s) "
          f"({why}); {moved}" + decide)
    return claim.verdict(status, ev, _numbers(d, a, b, length, iv, margin, margin), **said)


def judged_better(d: Data, claim: Claim, worse: Arm, better: Arm, length: int, key: str = "", **fields: Any) -> Verdict:
    """``better`` has lower bits per byte than ``worse``: the interval of better - worse below 0 (every
    difference a report shows is the claim's scheme minus the other, as "reaches" shows it); ``claim``,
    ``key`` and ``fields`` as :func:`judged_equivalent` takes them."""
    said = dict(rule=BETTER_RULE, key=_key(key or claim.id, d), **fields)
    if not (d.present(worse, length) and d.present(better, length)):
        return claim.not_measured(_absent(d, length, better, worse), **said)
    iv, basis = d.compare(better, worse, length, 0.95)
    if iv is None:
        return claim.verdict(Status.INCONCLUSIVE, f"L={length}: {basis}", **said)
    status = on_seeds(difference(iv, "negative"), iv)
    margin = d.margin
    decide = "" if d.estimate else _decide(iv, 0.0, status, margin)
    settled, moved = stability(d, better, worse, length, margin)
    if settled is False:
        status, decide = Status.INCONCLUSIVE, ""
    ev = _evidence(d, better, worse, length, iv, basis) + f"; {moved}" + decide
    return claim.verdict(status, ev, _numbers(d, better, worse, length, iv, margin, 0.0), **said)


def poslsh_s(d: Data) -> list[int]:
    return sorted(int(s) for s in d.rows[d.rows.position == POSLSH].trained_s.unique())


def reference_s(d: Data) -> Optional[int]:
    ss = poslsh_s(d)
    return None if not ss else (REFERENCE_S if REFERENCE_S in ss else max(ss))


# ---------------------------------------------------------------------------------------------
# from scratch


def _reaches_each_s(d: Data) -> list[Verdict]:
    """From scratch, Positional LSH (each s) reaches exact ALiBi on ``d``'s metric: one family, its members the s."""
    return [judged_equivalent(d, REACHES[d.metric.column], Arm(POSLSH, s), Arm(ALIBI), d.L,
                              key=f"scratch/reaches_alibi/s={s}", member=f"s={s}") for s in poslsh_s(d)]


def claim_reaches_alibi(d: Data) -> list[Verdict]:
    """From scratch, Positional LSH (each s) reaches the bits per byte of exact ALiBi."""
    return _reaches_each_s(d)


def claim_reaches_alibi_accuracy(d: Data) -> list[Verdict]:
    """The same on the top-1 next-token accuracy (``d`` judged on :data:`TOP1_MISS`)."""
    return _reaches_each_s(d)


def claim_beats_no_bias(d: Data) -> list[Verdict]:
    s = reference_s(d)
    if s is None:
        return []
    return [judged_better(d, BEATS_NONE, Arm(NONE), Arm(POSLSH, s), d.L, s=s)]


def claim_beats_original_and_fixed_blocks(d: Data) -> list[Verdict]:
    """The paper's baselines: Positional LSH (reference s) better than the architecture's own RoPE
    ("original") and than fixed blocks, from scratch at the training length; only where they were trained."""
    s = reference_s(d)
    if s is None:
        return []
    return [judged_better(d, claim, Arm(pos), Arm(POSLSH, s), d.L, s=s) for pos, claim in BEATS_BASELINE.items()
            if d.present(Arm(pos), d.L)]


def claim_beats_alibi(d: Data) -> list[Verdict]:
    """Positional LSH better than exact ALiBi, and still once ALiBi is trained with attention dropout
    (the regulariser control)."""
    s = reference_s(d)
    if s is None:
        return []
    out = [judged_better(d, BEATS_ALIBI, Arm(ALIBI), Arm(POSLSH, s), d.L, s=s)]
    drops = sorted(float(x) for x in d.rows[(d.rows.position == ALIBI)].get("attn_dropout", []) if x and x == x)
    if not drops:
        out.append(BEATS_ALIBI_DROPOUT.not_measured("no alibi model trained with attn_dropout > 0", rule=DIFFERENCE_RULE,
                                                    key=_key(BEATS_ALIBI_DROPOUT.id, d), s=s, dropout=""))
    for p in sorted(set(drops)):
        out.append(judged_better(d, BEATS_ALIBI_DROPOUT, Arm(ALIBI, 0, p), Arm(POSLSH, s), d.L, s=s,
                                 dropout=f" {p:g} (the regulariser control)"))
    return out


__all__ = ["Data", "Arm", "claim_reaches_alibi", "claim_beats_no_bias", "claim_beats_alibi"]
