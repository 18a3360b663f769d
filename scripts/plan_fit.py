"""Fit and check the CPU inference plan's choice between the blocks and the union of Positional LSH.

    python scripts/plan_fit.py measure --grid fit --out fit.csv       # time both paths on the fit grid
    python scripts/plan_fit.py fit fit.csv                              # the cost constants (NNLS)
    python scripts/plan_fit.py measure --grid check --out check.csv   # time both on the check grid
    python scripts/plan_fit.py check check.csv                          # the plan's path against the fastest

Every timed call is a whole forward pass as the commands run it: the masks drawn anew, their layout
built, then the attention (``attend`` with the path forced); a setting's time is the median of
``--repeats`` calls after one untimed call, and its spread the slowest over the fastest. The fit grid
and the check grid share no n and no head dimension. ``fit`` prints the constants of
:mod:`poslsh_cli.attention.plan` fitted to relative error: the blocks per padded pair and per gathered
row, each a constant and a part per head dimension; the union per scored pair (likewise) and per
(head, sample, position), its cost per flash-kernel call held at the plan's value; and, for low
precision, the smallest s from which the union was faster in every setting. ``check`` prints, for every
setting, the plan's path (the cost model's choice under the current constants, priced on the units of
a draw of the masks as ``attend`` prices them), its time, the fastest path's, their ratio, its spread,
and the share of its time spent drawing the masks and building their layout. Time alone: a loaded
core changes the ratios.
"""
from __future__ import annotations

import argparse
import csv
import itertools
import statistics
import sys
import time

#: (n, causal, s, sigma, head_dim, dtype) settings. sigma "slopes": the standard ALiBi slopes of 8 heads
#: (sigma 2 .. 256); a number: that sigma for every head.
GRIDS = {
    "fit": [*itertools.product([2048, 16384], [False, True], [2, 8, 32], ["slopes", "16"], [32, 128], ["float32"]),
            *itertools.product([2048, 16384], [False, True], [2, 4, 8], ["slopes", "16"], [32], ["bfloat16"])],
    "check": [*itertools.product([4096, 65536], [False, True], [4, 16], ["slopes", "64"], [64], ["float32"]),
              *itertools.product([1024, 24576], [False, True], [1, 50], ["slopes", "4"], [16], ["float32"]),
              *itertools.product([8192], [False, True], [8, 64], ["slopes"], [48, 96], ["float32", "bfloat16"])],
    "tiny": list(itertools.product([600], [False, True], [1, 3], ["slopes", "5"], [8], ["float32"])),
}
HEADS = 8
PATHS = ("blocks", "union")
COLUMNS = ["n", "causal", "s", "sigma", "head_dim", "dtype", "path", "seconds", "spread", "sample_seconds", "planned",
           "block_pairs", "union_pairs", "union_calls", "slots"]


def _sigmas(sigma: str) -> list[float]:
    from poslsh_cli.numerics.sampling import bandwidths

    return [float(x) for x in bandwidths(HEADS, None if sigma == "slopes" else float(sigma))]


def measure(grid: str, out: str, repeats: int) -> None:
    import numpy as np
    import torch

    from poslsh_cli.attention.api import AttentionSpec, attend, layout_for, work_of
    from poslsh_cli.attention.plan import choose, weighs
    from poslsh_cli.experiments.devices import torch_dtype

    rows = []
    for n, causal, s, sigma, d, dtype in GRIDS[grid]:
        torch.manual_seed(0)
        dt = torch_dtype(dtype)
        q, k, v = (torch.randn(1, HEADS, n, d, dtype=dt) for _ in range(3))
        method = "poslsh" if s > 1 else "fixed_block"
        rng = np.random.default_rng(n + s)
        first = AttentionSpec.build(method, _sigmas(sigma), n, causal, s=s, rng=rng)
        work = work_of(first, n, d)
        auto = choose(method, device="cpu", dtype=dt, n=n, causal=causal, grad=False, s=s,
                      work=work if weighs(True, "cpu", dt, n, False) else None)
        for path in PATHS:
            plan = choose(method, device="cpu", dtype=dt, n=n, causal=causal, grad=False, backend=path, s=s)
            times, prep = [], []
            for rep in range(repeats + 1):
                t0 = time.perf_counter()
                spec = AttentionSpec.build(method, _sigmas(sigma), n, causal, s=s, rng=rng)
                layout = layout_for(spec, plan, "cpu")
                t1 = time.perf_counter()
                attend(q, k, v, spec, layout=layout, plan=plan)
                if rep:
                    times.append(time.perf_counter() - t0)
                    prep.append(t1 - t0)
            row = dict(n=n, causal=causal, s=s, sigma=sigma, head_dim=d, dtype=dtype, path=path,
                       seconds=statistics.median(times), spread=max(times) / min(times),
                       sample_seconds=statistics.median(prep), planned=auto.backend.value == path,
                       block_pairs=work.block_pairs, union_pairs=work.union_pairs, union_calls=work.union_calls,
                       slots=work.slots)
            rows.append(row)
            print(f"n={n} causal={causal} s={s} sigma={sigma} d={d} {dtype} {path}: {row['seconds']:.4f} s"
                  f" (spread {row['spread']:.2f}x){' planned' if row['planned'] else ''}", file=sys.stderr)
    with open(out, "w", newline="") as f:
        w = csv.DictWriter(f, COLUMNS)
        w.writeheader()
        w.writerows(rows)


def _read(path: str) -> list[dict]:
    with open(path) as f:
        rows = list(csv.DictReader(f))
    for r in rows:
        for c in ("n", "s", "head_dim"):
            r[c] = int(r[c])
        for c in ("seconds", "spread", "sample_seconds", "block_pairs", "union_pairs", "union_calls", "slots"):
            r[c] = float(r[c])
        r["causal"], r["planned"] = r["causal"] == "True", r["planned"] == "True"
    return rows


def features(r: dict) -> list[float]:
    """The cost model's units of one timed row (float32 rows: the model prices float32)."""
    d = r["head_dim"]
    if r["path"] == "blocks":
        return [r["block_pairs"], d * r["block_pairs"], r["slots"], d * r["slots"]]
    return [r["union_pairs"], d * r["union_pairs"], r["slots"]]


NAMES = {"blocks": ["COST_BLOCK_PAIR_INFER", "COST_BLOCK_PAIR_D_INFER", "COST_BLOCK_SLOT_INFER", "COST_BLOCK_SLOT_D_INFER"],
         "union": ["COST_UNION_PAIR_INFER", "COST_UNION_PAIR_D_INFER", "COST_UNION_SLOT_INFER"]}


def fit(path: str) -> dict[str, float]:
    """Non-negative least squares of each path's times on its units, each row weighted by 1/time (so
    the fit is in relative error); prints the constants and each path's largest relative error. The
    union's cost per flash-kernel call (COST_UNION_CALL) is held at the plan's value and taken off its
    times first: the grid's call counts move with its pairs, so a free fit cannot tell them apart."""
    import numpy as np
    from scipy.optimize import nnls

    from poslsh_cli.attention.plan import COST_UNION_CALL

    rows = [r for r in _read(path) if r["dtype"] == "float32"]
    out = {"UNION_MIN_S_CPU": _min_s(_read(path))}
    print(f"UNION_MIN_S_CPU = {out['UNION_MIN_S_CPU']}")
    for p in PATHS:
        sel = [r for r in rows if r["path"] == p]
        fixed = np.array([COST_UNION_CALL * r["union_calls"] if p == "union" else 0.0 for r in sel])
        A = np.array([features(r) for r in sel]) / np.array([r["seconds"] for r in sel])[:, None]
        target = 1.0 - fixed / np.array([r["seconds"] for r in sel])
        scale = A.max(0)
        scale[scale == 0] = 1.0
        x, _ = nnls(A / scale, target)
        x = x / scale
        worst = float(np.abs(A @ x - target).max())
        for name, value in zip(NAMES[p], x):
            out[name] = float(value)
            print(f"{name} = {value:.3g}")
        print(f"# {p}: {len(sel)} settings, largest relative error {worst:.2f}")
    return out


def _planned(group: list[dict]) -> dict | None:
    """The row of the path the plan takes under the current constants: priced from the row's recorded
    units (float32 and wider, where the plan weighs the masks); as recorded otherwise."""
    from poslsh_cli.attention.plan import Backend, Work

    r = group[0]
    if r["dtype"] not in ("float32", "float64") or r["n"] < 512:
        return next((x for x in group if x["planned"]), None)
    work = Work(HEADS, r["n"], block_pairs=r["block_pairs"], slots=r["slots"], union_pairs=r["union_pairs"],
                union_calls=r["union_calls"], head_dim=r["head_dim"])
    best = min(PATHS, key=lambda p: work.cost(None, Backend(p), inference=True))
    return next(x for x in group if x["path"] == best)


def _min_s(rows: list[dict]) -> int:
    """Low precision, where the plan does not weigh the masks: the threshold (the union from that many
    masks on, else the blocks), among the grid's s and one past the largest, whose largest ratio of the
    path taken to the faster one over the low-precision settings is least (the larger threshold on a tie)."""
    times: dict[tuple, dict[str, float]] = {}
    for r in rows:
        if r["dtype"] not in ("float32", "float64"):
            times.setdefault((r["n"], r["causal"], r["s"], r["sigma"], r["head_dim"]), {})[r["path"]] = r["seconds"]
    if not times:
        return 0
    options = sorted({k[2] for k in times}) + [max(k[2] for k in times) + 1]

    def worst(threshold: int) -> float:
        return max(t["union" if k[2] >= threshold else "blocks"] / min(t.values()) for k, t in times.items())

    return min(reversed(options), key=worst)


def check(path: str) -> float:
    """The check table (markdown) and the largest ratio of the plan's time to the fastest path's."""
    rows = _read(path)
    key = lambda r: (r["n"], r["causal"], r["s"], r["sigma"], r["head_dim"], r["dtype"])  # noqa: E731
    print("| n | causal | s | sigma | d | dtype | plan's path | its time (s) | fastest (s) | ratio | spread |"
          " masks + layout share |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    worst = 0.0
    for k, group in itertools.groupby(sorted(rows, key=key), key=key):
        group = list(group)
        planned = _planned(group)
        fastest = min(group, key=lambda r: r["seconds"])
        if planned is None:
            continue
        ratio = planned["seconds"] / fastest["seconds"]
        worst = max(worst, ratio)
        print(f"| {k[0]} | {k[1]} | {k[2]} | {k[3]} | {k[4]} | {k[5]} | {planned['path']} | {planned['seconds']:.3f} |"
              f" {fastest['seconds']:.3f} ({fastest['path']}) | {ratio:.2f} | {planned['spread']:.2f} |"
              f" {planned['sample_seconds'] / planned['seconds']:.0%} |")
    print(f"\nlargest ratio of the plan's path to the fastest: {worst:.2f}")
    return worst


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("measure")
    m.add_argument("--grid", choices=sorted(GRIDS), required=True)
    m.add_argument("--out", required=True)
    m.add_argument("--repeats", type=int, default=3)
    for name in ("fit", "check"):
        sub.add_parser(name).add_argument("csv")
    a = ap.parse_args(argv)
    if a.cmd == "measure":
        measure(a.grid, a.out, a.repeats)
    elif a.cmd == "fit":
        fit(a.csv)
    else:
        check(a.csv)


if __name__ == "__main__":
    main()
