"""``poslsh block-stats``: block sizes of positional-LSH partitions; b_max against the exact law
and sigma log log n.

The largest width of s samples has the exact law
``P(max_k delta_k <= t) = (1 - e^{-t/sigma}(1 + t/sigma))^s``, and the realised largest block
(positions) is ``max_k ceil(delta_k)`` for n >> sigma, so ``P(b_max <= L)`` is the same
expression at integer L (:func:`poslsh_cli.numerics.sampling.block_max_cdf`). The paper's
``b_max ~ sigma log log n`` takes s of order log n: ``s_per_log_n=c`` runs s = ceil(c ln n).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Optional

from poslsh_cli.attention.scheme import scheme_key
from poslsh_cli.core.config import Spec, key
from poslsh_cli.experiments.base import Experiment, MemoryNeed, cell_seed, grid_cells
from poslsh_cli.experiments.block_stats.report import plot, report, summary
from poslsh_cli.numerics.sampling import block_max_quantile, mean_blocks, sample_partitions, width_max_quantile

NAME = "block-stats"
COLUMNS = ("n", "sigma", "s", "trial", "seed", "b_max", "b_max_theory_median", "mean_block",
           "num_blocks", "max_width", "b_max_loglog", "b_max_law_q05", "b_max_law_q95", "s_per_log_n")


@dataclass(frozen=True)
class BlockStatsSpec(Spec):
    n: tuple[int, ...] = key("sequence lengths (int or list)", [1024, 4096, 16384, 65536, 262144, 1048576], ge=2)
    sigma: tuple[float, ...] = scheme_key("sigma", [4.0, 16.0, 64.0], "float or list")
    s: tuple[int, ...] = scheme_key("s", [16], "int or list")
    s_per_log_n: Optional[float] = key("c > 0: s = ceil(c ln n) for each n instead of s (the paper's regime for "
                                       "b_max ~ sigma log log n); null: the fixed s list", None, gt=0)
    trials: int = key("independent repetitions per (n, sigma, s)", 20, ge=1)


@dataclass(frozen=True)
class BlockStatsRow:
    n: int
    sigma: float
    s: int
    trial: int
    seed: int
    b_max: int  # largest realised block (positions) over the s samples
    b_max_theory_median: float  # median of max_k delta_k under the exact law
    mean_block: float  # mean length over all blocks of all samples
    num_blocks: float  # blocks per sample, mean over the s samples
    max_width: float  # realised max_k delta_k (continuous; the law is exact for it)
    b_max_loglog: float  # sigma * log(log(n))
    b_max_law_q05: int  # 5% and 95% quantiles of the realised b_max under the exact law
    b_max_law_q95: int
    s_per_log_n: float  # c when s = ceil(c ln n); NaN for a fixed s


def samples_for(n: int, c: float) -> int:
    """s = ceil(c ln n): the paper's regime for b_max ~ sigma log log n."""
    return max(1, int(math.ceil(c * math.log(n) - 1e-9)))


def cells(spec: BlockStatsSpec, ctx: Any = None) -> list[dict[str, Any]]:
    if spec.s_per_log_n is None:
        return grid_cells(spec)
    return [{"n": n, "sigma": sigma, "s": samples_for(n, spec.s_per_log_n), "trial": t}
            for n in spec.n for sigma in spec.sigma for t in range(spec.trials)]


def memory(spec: BlockStatsSpec) -> MemoryNeed:
    """Peak bytes of the largest cell: the block boundaries and lengths of its s samples, and an
    (n,) array for samples narrower than two positions."""
    def cell(n: int) -> float:
        s = samples_for(n, spec.s_per_log_n) if spec.s_per_log_n is not None else max(spec.s)
        return 8.0 * (4 * n + 4 * s * max(mean_blocks(n, sigma) for sigma in spec.sigma))

    n = max(spec.n, key=cell)
    return MemoryNeed(cell(n), f"n={n}")


def run_cell(spec: BlockStatsSpec, key: dict[str, Any], ctx: Any = None, work: Any = None) -> tuple[list[dict], dict]:
    import numpy as np

    n, sigma, s, trial = key["n"], key["sigma"], key["s"], key["trial"]
    seed = cell_seed(spec.seed, NAME, key)
    parts = sample_partitions(n, sigma, s, np.random.default_rng(seed))
    lengths = np.concatenate(parts.block_lengths())
    c = spec.s_per_log_n
    row = BlockStatsRow(n=n, sigma=sigma, s=s, trial=trial, seed=seed, b_max=int(lengths.max()),
                        b_max_theory_median=width_max_quantile(0.5, sigma, s),
                        mean_block=float(lengths.mean()), num_blocks=lengths.size / s,
                        max_width=float(parts.widths.max()),
                        b_max_loglog=sigma * math.log(math.log(n)) if n > math.e else math.nan,
                        b_max_law_q05=min(n, block_max_quantile(0.05, sigma, s)),
                        b_max_law_q95=min(n, block_max_quantile(0.95, sigma, s)),
                        s_per_log_n=float(c) if c is not None else math.nan)
    counts = np.bincount(lengths)
    hist = [{"n": n, "sigma": sigma, "s": s, "trial": trial, "length": int(v), "count": int(counts[v])}
            for v in np.flatnonzero(counts)]
    return [asdict(row)], {"block_lengths": hist}


EXPERIMENT = Experiment(
    name=NAME,
    spec=BlockStatsSpec,
    help="""Realised block sizes: b_max against the exact law and sigma*loglog(n); block histograms.

    s_per_log_n=c takes s = ceil(c ln n) samples at each n, the regime of the paper's
    b_max ~ sigma log log n.""",
    columns=COLUMNS,
    cells=cells,
    run_cell=run_cell,
    summary=summary,
    plot=plot,
    report=report,
    presets=("block_stats", "block_stats_loglog"),
    order=20,
    memory=memory,
)
