"""Compare two reproduce roots column by column: the check that a refactoring moved no number.

    python scripts/compare_runs.py BEFORE_ROOT AFTER_ROOT [--rtol 1e-9]

For every run folder with a ``results.csv`` in both roots, rows are matched in order and every
column present in both is compared: text exactly, numbers within ``rtol`` (relative) or equal as
NaN. Columns that measure the machine rather than the method (times, memory, load, throughput)
differ between any two runs and are listed as skipped, not compared. Prints one line per run
(rows, columns compared, columns that differ with their largest difference) and exits 1 when any
compared column differs.
"""
from __future__ import annotations

import argparse
import math
import re
import sys
from pathlib import Path

import numpy as np
import pandas as pd

#: Column names that measure the machine (time, memory, load, throughput, hosts), never the method.
MACHINE = re.compile(r"(seconds|_s$|^wall|time|mem|_mb$|load|overloaded|threads|cores|gflops|fraction|share|"
                     r"tokens_per|per_second|throughput|host|started|finished|speedup|ratio|^device_name)")


def compare(before: pd.DataFrame, after: pd.DataFrame, rtol: float) -> tuple[list[str], dict[str, str], list[str]]:
    common = [c for c in before.columns if c in after.columns]
    skipped = [c for c in common if MACHINE.search(c)]
    compared = [c for c in common if c not in skipped]
    differ: dict[str, str] = {}
    if len(before) != len(after):
        differ["<rows>"] = f"{len(before)} -> {len(after)}"
        return compared, differ, skipped
    for c in compared:
        a, b = before[c], after[c]
        if pd.api.types.is_numeric_dtype(a) and pd.api.types.is_numeric_dtype(b):
            x, y = a.to_numpy(np.float64), b.to_numpy(np.float64)
            both_nan = np.isnan(x) & np.isnan(y)
            scale = np.maximum(np.abs(x), np.abs(y))
            bad = ~both_nan & ~(np.abs(x - y) <= rtol * np.where(scale > 0, scale, 1.0))
            if bad.any():
                rel = np.abs(x - y)[bad] / np.where(scale[bad] > 0, scale[bad], 1.0)
                differ[c] = f"{int(bad.sum())} rows, largest relative difference {float(np.nanmax(rel)):.3g}"
        else:
            bad = a.fillna("").astype(str).to_numpy() != b.fillna("").astype(str).to_numpy()
            if bad.any():
                i = int(np.flatnonzero(bad)[0])
                differ[c] = f"{int(bad.sum())} rows, first {a.iloc[i]!r} -> {b.iloc[i]!r}"
    return compared, differ, skipped


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("before", type=Path)
    ap.add_argument("after", type=Path)
    ap.add_argument("--rtol", type=float, default=1e-9, help="relative tolerance for numbers (default 1e-9)")
    a = ap.parse_args(argv)
    runs = sorted(p.parent.name for p in a.before.glob("*/results.csv"))
    if not runs:
        print(f"compare_runs: error: no */results.csv under {a.before}", file=sys.stderr)
        return 2
    failed = False
    for run in runs:
        other = a.after / run / "results.csv"
        if not other.is_file():
            print(f"{run}: missing in {a.after}")
            failed = True
            continue
        before, after = pd.read_csv(a.before / run / "results.csv"), pd.read_csv(other)
        compared, differ, skipped = compare(before, after, a.rtol)
        only = sorted(set(before.columns) ^ set(after.columns))
        state = "SAME" if not differ else "DIFFERS"
        print(f"{run}: {state}; {len(before)} rows, {len(compared)} columns compared, {len(skipped)} machine "
              f"columns skipped ({', '.join(skipped) or '-'})" + (f"; columns in one only: {', '.join(only)}" if only else ""))
        for c, text in differ.items():
            print(f"    {c}: {text}")
        failed |= bool(differ)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
