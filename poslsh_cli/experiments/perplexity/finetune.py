"""The fine-tuning claims of ``poslsh perplexity``: fine-tuned from one pretrained model, the gap of
Positional LSH to exact ALiBi falls as s grows, at the largest s it reaches exact ALiBi, and it is
better than fixed blocks there. The models are one fine-tuned group of
:mod:`~poslsh_cli.experiments.perplexity.claims` (its :class:`Data`, margins and rules).
"""
from __future__ import annotations

import math
from typing import Optional

import numpy as np

from poslsh_cli.experiments.perplexity.claims import (ALIBI, ANY_S, BPB, EQUIVALENCE_RULE, FIXED_BLOCK, POSLSH, Arm,
                                                      Data, judged_better, judged_equivalent, poslsh_s)
from poslsh_cli.verdicts.claims import Status, Verdict
from poslsh_cli.verdicts.declared import Claim
from poslsh_cli.verdicts.stats import DIFFERENCE_RULE, MIN_SEEDS, NEEDS_SEEDS, difference, on_seeds, slope, t_interval

FT_GAP_FALLS = Claim(
    "finetune/gap_falls_with_s", "perplexity", "fine-tuned, the gap of Positional LSH to exact ALiBi falls as s grows",
    f"gap = bits per byte of Positional LSH s minus exact ALiBi at the training length; per training seed the "
    f"least-squares slope of its gaps against ln s (at least three s), and the 95% t-interval of those slopes over "
    f"the seeds (at least {MIN_SEEDS}): below 0 SUPPORTED, above 0 NOT SUPPORTED, else INCONCLUSIVE. With fewer than "
    f"{MIN_SEEDS} seeds, the slope of the seeds' mean gaps with the interval of the fit's residuals (evaluation noise "
    "only, not the seed-to-seed spread) and the verdict INCONCLUSIVE", metric="bits_per_byte",
    sides=({"position": ALIBI, "finetuned": True}, {**ANY_S, "finetuned": True}))
FT_REACHES = Claim("finetune/reaches_alibi/largest_s", "perplexity",
                   "fine-tuned, Positional LSH at the largest s{which} reaches exact ALiBi", EQUIVALENCE_RULE,
                   metric="bits_per_byte", sides=({"position": ALIBI, "finetuned": True},
                                                  {"position": POSLSH, "s": "largest", "finetuned": True}))
FT_BEATS_FIXED = Claim("finetune/better_than_fixed_block/largest_s", "perplexity",
                       "fine-tuned, Positional LSH at the largest s is better than fixed blocks", DIFFERENCE_RULE,
                       metric="bits_per_byte", sides=({"position": FIXED_BLOCK, "finetuned": True},
                                                      {"position": POSLSH, "s": "largest", "finetuned": True}))


def claim_finetune_approaches_alibi(d: Optional[Data]) -> list[Verdict]:
    """Fine-tuned from one pretrained model, the gap to exact ALiBi falls with log s, and at the
    largest s Positional LSH reaches exact ALiBi."""
    if d is None:
        return [FT_GAP_FALLS.not_measured("no fine-tuned checkpoints (train with pretrain=rope)"),
                FT_REACHES.not_measured("no fine-tuned checkpoints", key=f"{FT_REACHES.id}/{BPB.column}", which="")]
    a = d.per_seed(Arm(ALIBI), d.L)
    by_seed: dict = {}  # seed -> {s: gap}; every gap of a seed shares that seed's ALiBi value
    for s in poslsh_s(d):
        p = d.per_seed(Arm(POSLSH, s), d.L)
        for seed in sorted(set(p) & set(a)):
            by_seed.setdefault(seed, {})[s] = p[seed] - a[seed]
    gaps = {s: float(np.mean([g[s] for g in by_seed.values() if s in g]))
            for s in poslsh_s(d) if any(s in g for g in by_seed.values())}
    fitted = {seed: g for seed, g in by_seed.items() if len(g) >= 3}
    if len(gaps) < 3 or not fitted:
        st = Status.NOT_MEASURED if not gaps else Status.INCONCLUSIVE
        out = [FT_GAP_FALLS.verdict(st, "fewer than three s with alibi and poslsh models" if gaps else
                                    "no alibi or poslsh fine-tuning runs")]
    else:
        shown = ", ".join(f"s={s}: {g:+.4f}" for s, g in gaps.items())
        if len(fitted) >= MIN_SEEDS:
            slopes = {seed: slope([math.log(s) for s in g], list(g.values())).estimate for seed, g in fitted.items()}

            iv = t_interval(slopes.values())
            ev = (f"L={d.L}: slope of the gap against ln s {iv.text()}, one slope per seed ("
                  + ", ".join(f"seed {k}: {v:+.4f}" for k, v in sorted(slopes.items())) + f"); mean gaps {shown}")
        else:
            iv = slope([math.log(s) for s in gaps], list(gaps.values()))
            n = len(by_seed)
            ev = (f"L={d.L}: slope of the mean gap against ln s {iv.text()} over {len(gaps)} s ({n} seed"
                  f"{'s' if n != 1 else ''}: the fit's residuals, evaluation noise only; {NEEDS_SEEDS}); gaps {shown}")
        out = [FT_GAP_FALLS.verdict(on_seeds(difference(iv, "negative"), iv), ev)]
    ss = poslsh_s(d)
    if ss:
        out.append(judged_equivalent(d, FT_REACHES, Arm(POSLSH, max(ss)), Arm(ALIBI), d.L, which=f" (s={max(ss)})"))
    return out


def claim_finetune_beats_fixed_blocks(d: Optional[Data]) -> list[Verdict]:
    if d is None or not poslsh_s(d):
        return [FT_BEATS_FIXED.not_measured("no fine-tuned poslsh checkpoints", key=f"{FT_BEATS_FIXED.id}/{BPB.column}")]
    return [judged_better(d, FT_BEATS_FIXED, Arm(FIXED_BLOCK), Arm(POSLSH, max(poslsh_s(d))), d.L)]
