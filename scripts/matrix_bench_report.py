"""Print the matrix-error speed/memory targets from `make bench` runs (ratios within one run)."""
import sys
from pathlib import Path

import pandas as pd

root = Path(sys.argv[1] if len(sys.argv) > 1 else "runs/bench/matrix")
rows = []
for csv in sorted(root.glob("*/results.csv")):
    df = pd.read_csv(csv)
    for (n, sigma, s), g in df.groupby(["n", "sigma", "s"]):
        fast = g[g.method == "fast"]
        dense = g[g.method == "dense"]
        row = {"n": n, "sigma": sigma, "s": s, "trials": len(fast),
               "fast_s_median": fast.seconds.median(), "fast_s_max": fast.seconds.max(), "fast_peak_mb": fast.peak_mem_mb.max()}
        if len(dense):
            row.update(dense_s_median=dense.seconds.median(), dense_peak_mb=dense.peak_mem_mb.max(),
                       speedup_median=(dense.seconds.to_numpy() / fast.seconds.to_numpy()).round(1).tolist(),
                       spectral_rel_diff=float(((fast.spectral_err.to_numpy() - dense.spectral_err.to_numpy())
                                                / dense.spectral_err.to_numpy()).__abs__().max()),
                       max_err_equal=bool((fast.max_err.to_numpy() == dense.max_err.to_numpy()).all()))
        rows.append(row)
out = pd.DataFrame(rows)
with pd.option_context("display.width", 200, "display.max_columns", 20):
    print(out.to_string(index=False))
checks = []
for r in rows:
    if "speedup_median" in r:
        checks.append(f"n={r['n']}: fast/dense speed-up per trial {r['speedup_median']} (target >= 100x)")
    if r["n"] == 65536:
        checks.append(f"n=65536 s={r['s']}: {r['fast_s_median']:.2f} s median, {r['fast_s_max']:.2f} s worst "
                      f"of {r['trials']} trials, both norms (target < 15 s), peak {r['fast_peak_mb']:.0f} MiB")
    if r["n"] == 1048576:
        checks.append(f"n=1048576 s={r['s']}: {r['fast_s_median']:.2f} s, both norms (target < 120 s), "
                      f"peak {r['fast_peak_mb']:.0f} MiB")
print("\n".join(checks))
