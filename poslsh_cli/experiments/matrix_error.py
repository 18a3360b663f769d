"""Matrix approximation error of the mean of s positional-LSH masks (Theorem 2.1).

For each (n, sigma, s, trial): sample s partitions with the cell's seed, then measure
``||L* - M~||_2`` (absolute and relative to ``||L*||_2``) and ``max_ij |L* - M~|``.
"""
from __future__ import annotations

import time
import tracemalloc
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from poslsh_cli.metrics import (max_error_dense, max_error_fast, spectral_error_dense,
                                spectral_error_fast)
from poslsh_cli.operators import LaplacianKernel, MeanMask
from poslsh_cli.experiments import grid_cells
from poslsh_cli.sampling import derive_seed, sample_partitions

COLUMNS = ["n", "sigma", "s", "trial", "seed", "method", "spectral_err", "spectral_rel", "max_err",
           "b_max", "seconds", "peak_mem_mb", "kernel_norm", "lanczos_tol", "converged", "matvecs"]


@dataclass(frozen=True)
class MatrixErrorRow:
    n: int
    sigma: float
    s: int
    trial: int
    seed: int
    method: str
    spectral_err: float
    spectral_rel: float
    max_err: float
    b_max: int
    seconds: float
    peak_mem_mb: float  # peak traced allocation of this method (tracemalloc; NumPy registers with it)
    kernel_norm: float
    lanczos_tol: float
    converged: bool
    matvecs: int


def cells(cfg: Any, ctx: Any = None) -> list[dict[str, Any]]:
    return grid_cells(cfg)


def cell_seed(root_seed: int, key: dict[str, Any]) -> int:
    return derive_seed(root_seed, "matrix-error", key["n"], float(key["sigma"]), key["s"], key["trial"])


def run_cell(cfg: Any, key: dict[str, Any], ctx: Any = None) -> tuple[list[dict], dict]:
    n, sigma, s, trial = key["n"], key["sigma"], key["s"], key["trial"]
    seed = cell_seed(cfg.seed, key)
    parts = sample_partitions(n, sigma, s, np.random.default_rng(seed))
    kernel, mask = LaplacianKernel(n, sigma), MeanMask(parts)
    common = dict(n=n, sigma=sigma, s=s, trial=trial, seed=seed, b_max=parts.b_max)
    rows = []
    if cfg.method in ("fast", "both"):
        def fast() -> tuple:
            spec = spectral_error_fast(kernel, mask, np.random.default_rng([seed, 1]), tol=cfg.tol)
            return spec, kernel.norm(), max_error_fast(kernel, mask)

        t0 = time.perf_counter()
        spec, norm, mx = fast()
        seconds = time.perf_counter() - t0
        peak = float("nan")
        if cfg.memory:
            # tracemalloc slows many small allocations, so memory is measured in a second,
            # untimed pass (its result is identical)
            tracemalloc.start()
            fast()
            peak = tracemalloc.get_traced_memory()[1] / 2**20
            tracemalloc.stop()
        rows.append(MatrixErrorRow(**common, method="fast", spectral_err=spec.value,
                                   spectral_rel=spec.value / norm, max_err=mx,
                                   seconds=seconds, peak_mem_mb=peak, kernel_norm=norm,
                                   lanczos_tol=spec.tol, converged=spec.converged,
                                   matvecs=spec.matvecs))
    if cfg.method in ("dense", "both"):
        tracemalloc.start()  # few, large allocations: negligible overhead here
        t0 = time.perf_counter()
        err, norm = spectral_error_dense(kernel, mask)
        mx = max_error_dense(kernel, mask)
        seconds, peak = time.perf_counter() - t0, tracemalloc.get_traced_memory()[1] / 2**20
        tracemalloc.stop()
        rows.append(MatrixErrorRow(**common, method="dense", spectral_err=err, spectral_rel=err / norm,
                                   max_err=mx, seconds=seconds, peak_mem_mb=peak, kernel_norm=norm,
                                   lanczos_tol=0.0, converged=True, matvecs=0))
    return [asdict(r) for r in rows], {}


def summary(df: Any) -> tuple[list[str], list[list[str]]]:
    """Per (n, sigma, method): fitted slope of spectral error vs s and the error at the largest s."""
    from poslsh_cli.metrics import fit_loglog_slope

    head = ["n", "sigma", "method", "slope spec", "slope max", "s_max", "spec_rel", "max_err", "secs"]
    rows = []
    for (n, sigma, method), g in df.groupby(["n", "sigma", "method"], sort=False):
        fs = fit_loglog_slope(g["s"], g["spectral_err"])
        fm = fit_loglog_slope(g["s"], g["max_err"])
        top = g[g["s"] == g["s"].max()]
        rows.append([str(n), f"{sigma:g}", method, f"{fs.slope:.3f}", f"{fm.slope:.3f}", str(int(top['s'].iloc[0])),
                     f"{top['spectral_rel'].mean():.4g}", f"{top['max_err'].mean():.4g}",
                     f"{g['seconds'].sum():.2f}"])
    return head, rows
