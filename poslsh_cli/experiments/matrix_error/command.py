"""``poslsh matrix-error``: error of the mean of s positional-LSH masks (Theorem 2.1).

For each (n, sigma, s, trial): sample s partitions with the cell's seed, then measure
``||L* - M~||_2`` (absolute and relative to ``||L*||_2``) and ``max_ij |L* - M~|``, by the fast
O(n) path (matvecs, Lanczos, the band argument), the dense float64 reference, or both. Every
row also carries the theorem's explicit constants for its cell (:mod:`poslsh_cli.numerics.theorem`):
``Psi_sigma``, the expectation bound, the tail bound at the measured error and the ``s`` the
theorem asks for that error.
"""
from __future__ import annotations

import enum
import time
import tracemalloc
from dataclasses import asdict, dataclass
from typing import Any

from poslsh_cli.core.config import Spec, check, key
from poslsh_cli.core.errors import ConfigError
from poslsh_cli.experiments.base import Experiment, MemoryNeed, cell_seed, grid_cells
from poslsh_cli.experiments.matrix_error.report import plot, report, summary
from poslsh_cli.attention.scheme import scheme_key
from poslsh_cli.numerics.sampling import Sampler, mean_blocks, sample_partitions
from poslsh_cli.numerics import theorem
from poslsh_cli.numerics.metrics import (
    REORTH_BYTES, max_error_dense, max_error_fast, spectral_error_dense, spectral_error_fast)

NAME = "matrix-error"
COLUMNS = ("n", "sigma", "s", "trial", "seed", "sampler", "method", "spectral_err", "spectral_rel", "max_err",
           "b_max", "seconds", "peak_mem_mb", "kernel_norm", "lanczos_tol", "converged", "matvecs",
           "spectral_err_bound", "lanczos_delta", "psi_sigma", "expectation_bound", "tail_bound", "s_needed")


class Computation(str, enum.Enum):
    """How ||L* - M~|| is computed: the O(n) operators, the dense float64 reference, or both."""

    FAST = "fast"
    DENSE = "dense"
    BOTH = "both"


@dataclass(frozen=True)
class MatrixErrorSpec(Spec):
    n: tuple[int, ...] = key("sequence lengths (int or list)", [256, 1024, 4096], ge=2)
    sigma: tuple[float, ...] = scheme_key("sigma", [4.0, 16.0], "float or list")
    s: tuple[int, ...] = scheme_key("s", [1, 2, 4, 8, 16, 32, 64, 128], "int or list")
    trials: int = key("independent repetitions per (n, sigma, s)", 3, ge=1)
    sampler: tuple[Sampler, ...] = scheme_key("sampler", [Sampler.IID], "a list: side by side; the theorem's "
                                              "verdicts use iid")
    method: Computation = key("fast (O(n) operators + Lanczos), dense (n x n float64 reference) or both", Computation.FAST)
    tol: float = key("relative width of the certified interval for ||L*-M~||_2: spectral_err (a lower bound) and "
                     "spectral_err_bound within tol of each other", 1e-3, gt=0)
    delta: float = key("failure probability of the certified upper bound (over the random Lanczos start)", 1e-3,
                       gt=0)
    dense_max_n: int = key("largest n for which method=dense/both builds n x n matrices", 8192, ge=2)
    memory: bool = key("also measure the fast path's peak memory (a second, untimed pass)", False)

    def check(self) -> None:
        check(self.tol < 1, f"tol must be in (0, 1), got {self.tol}")
        check(self.delta < 1, f"delta must be in (0, 1), got {self.delta}")
        if self.method is not Computation.FAST:
            big = [x for x in self.n if x > self.dense_max_n]
            if big:
                raise ConfigError(f"method={self.method.value} builds n x n matrices; n={big[0]} exceeds "
                                  f"dense_max_n={self.dense_max_n} (raise it if you have the memory)")


@dataclass(frozen=True)
class MatrixErrorRow:
    n: int
    sigma: float
    s: int
    trial: int
    seed: int
    sampler: str
    method: str
    spectral_err: float
    spectral_rel: float
    max_err: float
    b_max: int
    seconds: float
    peak_mem_mb: float  # peak traced allocation of this method (tracemalloc; NumPy registers with it)
    kernel_norm: float
    lanczos_tol: float  # relative width of the certified interval asked for
    converged: bool  # the interval is within lanczos_tol
    matvecs: int
    spectral_err_bound: float  # certified upper bound of ||L* - M~||_2 (probability >= 1 - lanczos_delta)
    lanczos_delta: float
    psi_sigma: float  # Theorem 2.1's Psi_sigma
    expectation_bound: float  # its bound on E ||L* - M~||_2 for this (n, sigma, s)
    tail_bound: float  # its bound on P(||L* - M~||_2 >= spectral_err) (above 1: no information)
    s_needed: int  # ceil(sigma^2 ln n / spectral_err^2): the s the theorem asks for this error


def memory(spec: MatrixErrorSpec) -> MemoryNeed:
    """Peak bytes of the largest cell: the fast path keeps O(n) vectors (the Lanczos recurrence, the
    operators' temporaries; a full basis only below REORTH_BYTES) and O(blocks) integers; the dense
    path a few n x n float64 matrices."""
    need, what = 0.0, ""
    for n in spec.n:
        blocks = max(spec.s) * max(mean_blocks(n, sg) for sg in spec.sigma)
        b = 8.0 * (18 * n + 7 * blocks) + 40.0 * max(spec.s) * min(n, 1 << 17) + min(REORTH_BYTES, 8.0 * n * n)
        if spec.method is not Computation.FAST:
            b = max(b, 6 * 8.0 * float(n) ** 2)
        if b > need:
            need, what = b, f"n={n}" + (" with n x n float64 matrices" if spec.method is not Computation.FAST else "")
    return MemoryNeed(need, what)


def cells(spec: MatrixErrorSpec, ctx: Any = None) -> list[dict[str, Any]]:
    return grid_cells(spec)


def run_cell(spec: MatrixErrorSpec, key: dict[str, Any], ctx: Any = None, work: Any = None) -> tuple[list[dict], dict]:
    import numpy as np

    from poslsh_cli.numerics.operators import LaplacianKernel, MeanMask

    n, sigma, s, trial = key["n"], key["sigma"], key["s"], key["trial"]
    seed = cell_seed(spec.seed, NAME, key)
    sampler = key.get("sampler", "iid")
    parts = sample_partitions(n, sigma, s, np.random.default_rng(seed), sampler)
    kernel, mask = LaplacianKernel(n, sigma), MeanMask(parts)
    common = dict(n=n, sigma=sigma, s=s, trial=trial, seed=seed, sampler=sampler, b_max=parts.b_max, psi_sigma=theorem.psi_sigma(sigma),
                  expectation_bound=theorem.expectation_bound(sigma, n, s))

    def at(err: float) -> dict:
        return dict(tail_bound=theorem.tail_bound(sigma, n, s, err),
                    s_needed=theorem.s_needed(sigma, n, err) if err > 0 else 0)
    rows = []
    if spec.method in (Computation.FAST, Computation.BOTH):
        def fast() -> tuple:
            res = spectral_error_fast(kernel, mask, np.random.default_rng([seed, 1]), tol=spec.tol, delta=spec.delta)
            return res, kernel.norm(), max_error_fast(kernel, mask)

        t0 = time.perf_counter()
        res, norm, mx = fast()
        seconds = time.perf_counter() - t0
        peak = float("nan")
        if spec.memory:
            # tracemalloc slows many small allocations, so memory is measured in a second,
            # untimed pass (its result is identical)
            tracemalloc.start()
            fast()
            peak = tracemalloc.get_traced_memory()[1] / 2**20
            tracemalloc.stop()
        rows.append(MatrixErrorRow(**common, method="fast", spectral_err=res.value, spectral_rel=res.value / norm,
                                   max_err=mx, seconds=seconds, peak_mem_mb=peak, kernel_norm=norm,
                                   lanczos_tol=res.tol, converged=res.converged, matvecs=res.matvecs,
                                   spectral_err_bound=res.bound, lanczos_delta=res.delta, **at(res.value)))
    if spec.method in (Computation.DENSE, Computation.BOTH):
        tracemalloc.start()  # few, large allocations: negligible overhead here
        t0 = time.perf_counter()
        err, norm = spectral_error_dense(kernel, mask)
        mx = max_error_dense(kernel, mask)
        seconds, peak = time.perf_counter() - t0, tracemalloc.get_traced_memory()[1] / 2**20
        tracemalloc.stop()
        rows.append(MatrixErrorRow(**common, method="dense", spectral_err=err, spectral_rel=err / norm,
                                   max_err=mx, seconds=seconds, peak_mem_mb=peak, kernel_norm=norm,
                                   lanczos_tol=0.0, converged=True, matvecs=0, spectral_err_bound=err,
                                   lanczos_delta=0.0, **at(err)))
    return [asdict(r) for r in rows], {}


EXPERIMENT = Experiment(
    name=NAME,
    spec=MatrixErrorSpec,
    help="""Spectral and max-norm error of the mean of s masks against L* = exp(-|i-j|/sigma).

    One row per (n, sigma, s, trial) and method. method=fast never builds an n x n matrix:
    O(n) matvecs, Lanczos for ||L*-M~||_2, the band argument for the max norm.""",
    columns=COLUMNS,
    cells=cells,
    run_cell=run_cell,
    summary=summary,
    plot=plot,
    report=report,
    presets=("matrix_error", "matrix_dense_check", "matrix_error_samplers"),
    order=10,
    memory=memory,
)
