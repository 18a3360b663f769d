"""The claims of the attention timing command, each computed from the rows it quotes: the
near-linear time of Theorem 2.2 (with the crossovers with exact ALiBi), the roofline of the
Positional-LSH block path, and the CUDA goals. A row's speed-up is against the exact-ALiBi time
paired with it (:func:`exact_time`), and a speed claim from a row measured on an overloaded
machine is INCONCLUSIVE (:func:`poslsh_cli.experiments.measure.judge_load`)."""
from __future__ import annotations

import math
from typing import Any, Callable

from poslsh_cli.experiments.measure import judge_load, overload_reason
from poslsh_cli.numerics.methods import Method
from poslsh_cli.numerics.metrics import fit_loglog_slope
from poslsh_cli.verdicts.claims import TIME_RULE, Groups, Status, Verdict, time_status, upper_half
from poslsh_cli.verdicts.declared import Claim
from poslsh_cli.verdicts.claims import crossover as crossover_of

EXACT, POSLSH, WINDOWED, FIXED_BLOCK = (m.value for m in (Method.EXACT, Method.POSLSH, Method.WINDOWED,
                                                          Method.FIXED_BLOCK))
#: exact-ALiBi rows of the paths other than the reference one (``exact_backends`` of more than one)
EXACT_ALT = "exact_alt"
#: the roofline goal: Positional LSH on the plan's path, from this n on and with at least ROOFLINE_S
#: masks, reaches this fraction of the bias-free flash kernel's useful throughput (its useful work: the
#: query-key pairs some mask keeps; the union route scores each query's band of keys, about twice the
#: pairs it keeps, and builds the log counts of each chunk besides)
ROOFLINE_N, ROOFLINE_S, ROOFLINE_FRACTION = 16384, 8, 0.25
#: CUDA goals of the path the plan takes: at GPU_GOAL_N, causal, s = GPU_GOAL_S, Positional LSH at
#: least this many times faster than exact ALiBi (forward; forward + backward); its peak memory at
#: most GPU_MEMORY_GOAL x exact ALiBi's plus the masks' own integers (4 bytes per head, mask and
#: position) at every n; drawing the masks and building their layout at most SAMPLE_SHARE_GOAL of
#: the end-to-end time at the largest n
GPU_GOAL_N, GPU_GOAL_S = 131072, 8
GPU_SPEEDUP_GOALS = {False: 8.0, True: 10.0}
GPU_MEMORY_GOAL, SAMPLE_SHARE_GOAL = 1.5, 0.10


ROOFLINE = Claim(
    "bench/roofline", "bench",
    f"Positional LSH on the plan's path reaches {ROOFLINE_FRACTION:.0%} of the flash kernel's throughput at "
    f"n >= {ROOFLINE_N}, s >= {ROOFLINE_S}",
    f"SUPPORTED when every Positional-LSH row on the plan's path with n >= {ROOFLINE_N} and s >= {ROOFLINE_S} has "
    f"useful GFLOP/s (4 d per pair some mask keeps, over the end-to-end time with the masks drawn) at least "
    f"{ROOFLINE_FRACTION:.0%} of the bias-free flash kernel's on a dense problem of the same heads, head dimension and "
    "direction (measured once in the run); NOT SUPPORTED when one is below; NOT MEASURED without such rows",
    metric="fraction", sides=({"kernel": "flash, no bias"}, {"method": POSLSH, "s": f"{ROOFLINE_S} or more"}))
NEAR_LINEAR = Claim("bench/near_linear", "bench", "Positional-LSH time grows near-linearly in n (Theorem 2.2)",
                    TIME_RULE, metric="seconds")
GPU_SPEEDUP = {backward: Claim(
    f"bench/gpu_speedup[{what}]", "bench",
    f"on CUDA, causal Positional LSH s={GPU_GOAL_S} is at least {goal:g}x faster than exact ALiBi at n={GPU_GOAL_N} "
    f"({what}, the plan's paths)",
    f"median end-to-end time of exact ALiBi (timed interleaved with Positional LSH: exact_seconds; else its own row) "
    f"over Positional LSH s={GPU_GOAL_S} (masks drawn in the call) in one run; SUPPORTED when at least {goal:g}, else "
    "NOT SUPPORTED; NOT MEASURED without both rows", metric="seconds",
    sides=({"method": EXACT}, {"method": POSLSH, "s": GPU_GOAL_S}))
    for backward, goal, what in ((b, g, "forward + backward" if b else "forward") for b, g in GPU_SPEEDUP_GOALS.items())}
GPU_MEMORY = Claim(
    "bench/gpu_memory", "bench",
    f"on CUDA, Positional LSH's peak memory is at most {GPU_MEMORY_GOAL:g}x exact ALiBi's plus the masks' integers, at "
    "every n and s",
    f"per (n, causal, backward, s): peak allocator memory of the call over {GPU_MEMORY_GOAL:g} x exact's + 4 H s n "
    "bytes; SUPPORTED when every one is at most 1, NOT SUPPORTED when one is above; NOT MEASURED without CUDA rows of "
    "both", metric="peak_mem_mb", sides=({"method": EXACT}, {"method": POSLSH, "s": "*"}))
GPU_MASK_SHARE = Claim(
    "bench/gpu_mask_share", "bench",
    f"on CUDA, drawing the masks and building their layout take at most {SAMPLE_SHARE_GOAL:.0%} of Positional LSH's "
    "end-to-end time at the largest n",
    f"sample_seconds / seconds of every Positional-LSH row at the largest n; SUPPORTED when every one is at most "
    f"{SAMPLE_SHARE_GOAL:.0%}, else NOT SUPPORTED; NOT MEASURED without CUDA rows", metric="sample_seconds / seconds")


def crossover(df: Any, method: str, select: Callable[[Any], Any] | None = None) -> float:
    """Smallest n from which ``method`` is faster than exact at every measured larger n: the
    median per n of each row's time over the exact time paired with it (:func:`exact_time`).

    ``df`` holds the rows of one causal setting (times of causal and bidirectional attention are
    not comparable); ``select`` narrows the method's rows (one s, one backend).
    """
    if "causal" in df.columns and df.causal.nunique() > 1:
        raise ValueError("crossover compares one causal setting at a time: group by causal first")
    m = df[df.method == method]
    if select is not None:
        m = select(m)
    ratio = (m.seconds / exact_time(df).loc[m.index]).groupby(m.n).median()
    best = crossover_of({int(n): float(r) for n, r in ratio.items() if r == r})
    return math.nan if best is None else best


def exact_time(df: Any) -> Any:
    """Each row's exact-ALiBi time (a Series on ``df``'s index): the row's ``exact_seconds``, exact
    ALiBi timed interleaved with it, where present; else (exact rows, and runs written before the
    column) the median time of the exact rows at its (n, causal)."""
    import pandas as pd

    keys = [c for c in ("n", "causal") if c in df.columns]
    med = df[df.method == EXACT].groupby(keys)["seconds"].median()
    fallback = pd.Series([med.get(k if len(keys) > 1 else k[0], math.nan) for k in
                          df[keys].itertuples(index=False, name=None)], index=df.index, dtype=float)
    if "exact_seconds" not in df.columns:
        return fallback
    paired = pd.to_numeric(df.exact_seconds, errors="coerce")
    return paired.where(paired.notna(), fallback)


def planned_rows(df: Any) -> Any:
    """The rows of the paths the plan takes by itself at their own n (every row in runs without the
    ``planned`` column)."""
    if "planned" not in df.columns:
        return df
    return df[df.planned.fillna(True).astype(bool)]


def claim_roofline(df: Any) -> Verdict:
    """Positional LSH on the plan's path from n = ROOFLINE_N on, with s >= ROOFLINE_S, reaches
    ROOFLINE_FRACTION of the machine's attainable attention throughput (both directions measured)."""
    p = planned_rows(df)
    rows = p[(p.method == POSLSH) & (p.n >= ROOFLINE_N) & (p.s >= ROOFLINE_S)]
    if rows.empty or rows.fraction.isna().all():
        return ROOFLINE.not_measured(f"no Positional-LSH rows of the plan's path with n >= {ROOFLINE_N} and s >= "
                                     f"{ROOFLINE_S}")
    worst = rows.loc[rows.fraction.idxmin()]
    ev = (f"lowest fraction {worst.fraction:.0%} (s={worst.s}, n={int(worst.n)}, "
          f"{'causal' if worst.causal else 'bidirectional'}, {worst.backend}); highest {rows.fraction.max():.0%}; "
          f"{len(rows)} rows")
    return judge_load(ROOFLINE.verdict(Status.SUPPORTED if rows.fraction.min() >= ROOFLINE_FRACTION else
                                       Status.NOT_SUPPORTED, ev), rows)


def claim_near_linear_time(df: Any) -> tuple[Verdict, list[str]]:
    """Theorem 2.2: Positional-LSH time on the plan's paths grows near-linearly in n; with the
    crossover with exact and the share of drawing the masks, per s and backend. A row measured
    overloaded makes the claim INCONCLUSIVE when it is among the rows the slopes were fitted on."""
    import pandas as pd

    dev = df.device.iloc[0]
    groups, paragraphs, fitted = Groups(), [], []  # fitted: the rows the slopes were fitted on
    for causal, g in df.groupby("causal"):
        mode = "causal" if causal else "bidirectional"
        for (s, backend), gs in planned_rows(g[g.method == POSLSH]).groupby(["s", "backend"]):
            x = crossover(g, POSLSH, lambda f, s=s, b=backend: f[(f.s == s) & (f.backend == b)])
            where = f"from n={int(x)} on" if math.isfinite(x) else "at no measured n"
            why = overload_reason(gs)
            spread = gs.spread.max() if "spread" in gs.columns else math.nan
            paragraphs.append(f"{mode}: Positional LSH s={s} ({backend}) is faster than exact {where} ({dev})"
                              + (f"; its calls at one n differ by up to {spread:.2f}x (slowest over fastest)"
                                 if spread == spread else "")
                              + (f"; {why}" if why else "") + ".")
            ns = upper_half(gs.n)
            fit = fit_loglog_slope(gs[gs.n.isin(ns)].n, gs[gs.n.isin(ns)].seconds) if ns else None
            fitted.append(gs[gs.n.isin(ns)])
            groups.add(time_status(fit),
                       f"{mode} s={s} {backend}: {fit.slope:.2f}" if fit else f"{mode} s={s} {backend}: fewer than 3 n")
            big = gs[gs.n == gs.n.max()]
            if "sample_seconds" in gs.columns and len(big):
                share = float((big.sample_seconds / big.seconds).median())  # every row there (samplers, passes)
                if math.isfinite(share):
                    rows = f" (median of {len(big)} rows)" if len(big) > 1 else ""
                    paragraphs.append(f"{mode}, s={s} ({backend}), n={int(big.n.iloc[0])}: drawing the masks and "
                                      f"building their layout take {share:.1%} of the end-to-end "
                                      f"{float(big.seconds.median()):.3g} s{rows}.")
        ex = g[g.method == EXACT]
        ns = upper_half(ex.n)
        if ns:
            fit = fit_loglog_slope(ex[ex.n.isin(ns)].n, ex[ex.n.isin(ns)].seconds)
            groups.add(None, f"{mode} exact: {fit.slope:.2f}")
    verdict = groups.verdict(NEAR_LINEAR, lead="log-log slopes over the larger n: ", none="no Positional-LSH rows")
    # the load rule reads the rows the slopes were fitted on (the larger half of each series' n)
    return judge_load(verdict, pd.concat(fitted) if fitted else df.iloc[0:0]), paragraphs



def _gpu_rows(df: Any) -> Any:
    """CUDA rows of the paths the plan takes by itself (``planned``; every row in runs without it),
    with the ``backward`` column (False in runs without it)."""
    rows = planned_rows(df[df.device.astype(str).str.startswith("cuda")])
    return rows.assign(backward=rows.backward.fillna(False).astype(bool) if "backward" in rows.columns else False)


def claims_gpu(df: Any) -> list[Verdict]:
    """The CUDA goals of Positional LSH on the plan's path against exact ALiBi: speed at
    GPU_GOAL_N (forward, and forward + backward), peak memory at every n, the share of drawing the
    masks at the largest n. NOT MEASURED without CUDA rows."""
    g = _gpu_rows(df)
    out = []
    for backward, goal in GPU_SPEEDUP_GOALS.items():
        what = "forward + backward" if backward else "forward"
        sel = g[(g.n == GPU_GOAL_N) & g.causal.astype(bool) & (g.backward == backward)]
        ex, p = sel[sel.method == EXACT], sel[(sel.method == POSLSH) & (sel.s == GPU_GOAL_S)]
        if ex.empty or p.empty:
            out.append(GPU_SPEEDUP[backward].not_measured(f"no CUDA rows at n={GPU_GOAL_N}, causal, {what}"))
            continue
        exact = float(exact_time(sel).loc[p.index].median())
        r = exact / float(p.seconds.median())
        out.append(judge_load(GPU_SPEEDUP[backward].verdict(Status.SUPPORTED if r >= goal else Status.NOT_SUPPORTED,
                                                            f"exact {exact:.4g} s ({ex.backend.iloc[0]}), Positional LSH "
                                                            f"{p.seconds.median():.4g} s ({p.backend.iloc[0]}): {r:.2f}x"),
                              sel[sel.index.isin(ex.index) | sel.index.isin(p.index)]))
    memory = Groups()
    for (n, causal, backward), gg in g.groupby(["n", "causal", "backward"]):
        ex = gg[gg.method == EXACT]
        if ex.empty:
            continue
        exm = float(ex.peak_mem_mb.median())
        for r in gg[gg.method == POSLSH].itertuples():
            allow = GPU_MEMORY_GOAL * exm + 4.0 * r.heads * r.s * n / 2**20
            memory.add(bool(r.peak_mem_mb <= allow),
                       f"n={n}{' causal' if causal else ''}{' fwd+bwd' if backward else ''} s={r.s}: "
                       f"{r.peak_mem_mb:.0f} / {exm:.0f} MiB = {r.peak_mem_mb / max(exm, 1e-9):.2f}x")
    out.append(memory.verdict(GPU_MEMORY, every=True, none="no CUDA rows of exact ALiBi and Positional LSH"))
    p = g[(g.method == POSLSH)]
    p = p[p.n == p.n.max()] if len(p) else p
    if p.empty:
        out.append(GPU_MASK_SHARE.not_measured("no CUDA Positional-LSH rows"))
    else:
        share = p.sample_seconds / p.seconds
        ev = "; ".join(f"{'causal' if r.causal else 'bidirectional'}{' fwd+bwd' if r.backward else ''} s={r.s}: "
                       f"{r.sample_seconds * 1e3:.2f} of {r.seconds * 1e3:.2f} ms = {r.sample_seconds / r.seconds:.0%}"
                       for r in p.itertuples())
        out.append(judge_load(GPU_MASK_SHARE.verdict(Status.SUPPORTED if bool((share <= SAMPLE_SHARE_GOAL).all()) else
                                                     Status.NOT_SUPPORTED, f"n={int(p.n.iloc[0])}: {ev}"), p))
    return out
