"""Block statistics of positional-LSH partitions: b_max against the exact law and sigma log log n.

The largest width of s samples has the exact law
``P(max_k delta_k <= t) = (1 - e^{-t/sigma}(1 + t/sigma))^s``, and the realised largest block
(positions) is ``max_k ceil(delta_k)`` for n >> sigma, so ``P(b_max <= L)`` is the same
expression at integer L (:func:`poslsh_cli.sampling.block_max_cdf`). The paper's
``b_max ~ sigma log log n`` takes s of order log n: ``s_per_log_n=c`` runs s = ceil(c ln n).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from poslsh_cli.experiments import grid_cells
from poslsh_cli.sampling import block_max_quantile, derive_seed, sample_partitions, width_max_quantile

COLUMNS = ["n", "sigma", "s", "trial", "seed", "b_max", "b_max_theory_median", "mean_block",
           "num_blocks", "max_width", "b_max_loglog", "b_max_law_q05", "b_max_law_q95", "s_per_log_n"]


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


def cells(cfg: Any, ctx: Any = None) -> list[dict[str, Any]]:
    if getattr(cfg, "s_per_log_n", None) is None:
        return grid_cells(cfg)
    c = float(cfg.s_per_log_n)
    return [{"n": n, "sigma": sigma, "s": samples_for(n, c), "trial": t}
            for n in cfg.n for sigma in cfg.sigma for t in range(cfg.trials)]


def cell_seed(root_seed: int, key: dict[str, Any]) -> int:
    return derive_seed(root_seed, "block-stats", key["n"], float(key["sigma"]), key["s"], key["trial"])


def run_cell(cfg: Any, key: dict[str, Any], ctx: Any = None) -> tuple[list[dict], dict]:
    n, sigma, s, trial = key["n"], key["sigma"], key["s"], key["trial"]
    seed = cell_seed(cfg.seed, key)
    parts = sample_partitions(n, sigma, s, np.random.default_rng(seed))
    lengths = np.concatenate(parts.block_lengths())
    c = getattr(cfg, "s_per_log_n", None)
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


def summary(df: Any) -> tuple[list[str], list[list[str]]]:
    head = ["n", "sigma", "s", "b_max median", "law median", "sigma loglog n", "mean_block", "blocks/sample"]
    rows = []
    for (n, sigma, s), g in df.groupby(["n", "sigma", "s"], sort=False):
        rows.append([str(n), f"{sigma:g}", str(s), f"{g['b_max'].median():g}",
                     f"{g['b_max_theory_median'].iloc[0]:.1f}", f"{g['b_max_loglog'].iloc[0]:.1f}",
                     f"{g['mean_block'].mean():.2f}", f"{g['num_blocks'].mean():.1f}"])
    return head, rows
