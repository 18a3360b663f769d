"""``poslsh sample``: draw positional-LSH partitions; ``masks.npz`` (bins, widths, shifts) and a
table of every sample's blocks (results.csv).

``poslsh sample n=N sigma=SIGMA s=S seed=SEED`` regenerates exactly the masks behind any results
row with that seed; ``heads=H`` draws one set per head with the standard ALiBi sigmas.
"""
from __future__ import annotations

import io
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from poslsh_cli.verdicts.claims import Section
from poslsh_cli.core.config import Spec, check, key
from poslsh_cli.experiments.base import Experiment, MemoryNeed
from poslsh_cli.attention.scheme import scheme_key
from poslsh_cli.numerics.sampling import Sampler, bandwidths, derive_seed, sample_partitions
from poslsh_cli.core.errors import ConfigError
from poslsh_cli.verdicts import plotting

COLUMNS = ("head", "sigma", "sample", "seed", "width", "shift", "num_blocks", "max_block", "mean_block")


@dataclass(frozen=True)
class SampleSpec(Spec):
    n: int = key("sequence length (number of positions), >= 2", 64, ge=2)
    sigma: Optional[float] = scheme_key("sigma", 8.0, "or give heads=")
    heads: Optional[int] = key("ALiBi head count: one sigma per head from the standard slopes (overrides sigma)",
                               None, ge=1)
    s: int = scheme_key("s", 16)
    sampler: Sampler = scheme_key("sampler", Sampler.IID)

    def check(self) -> None:
        check(self.heads is not None or self.sigma is not None, "give sigma= or heads=")


@dataclass
class SampleContext:
    sigmas: Any  # (H,)
    seeds: list[int]
    partitions: list[Any]
    files: dict[str, Callable[[], bytes]] = field(default_factory=dict)


def prepare(spec: SampleSpec) -> SampleContext:
    import numpy as np

    if spec.heads is not None:  # the standard slopes of the head count
        sigmas = bandwidths(spec.heads)
        seeds = [derive_seed(spec.seed, "head", h) for h in range(spec.heads)]
    else:
        sigmas, seeds = bandwidths(1, spec.sigma), [spec.seed]
    parts = [sample_partitions(spec.n, float(sigma), spec.s, np.random.default_rng(sd), spec.sampler)
             for sigma, sd in zip(sigmas, seeds)]
    ctx = SampleContext(sigmas, seeds, parts)
    ctx.files["masks.npz"] = lambda: _npz(spec, ctx)
    return ctx


def _npz(spec: SampleSpec, ctx: SampleContext) -> bytes:
    import numpy as np

    parts, seeds = ctx.partitions, ctx.seeds
    if spec.heads is None:
        arrays = {"bins": parts[0].bins(), "widths": parts[0].widths, "shifts": parts[0].shifts,
                  "sigma": np.float64(parts[0].sigma), "seed": np.int64(seeds[0])}
    else:
        arrays = {"bins": np.stack([p.bins() for p in parts]), "widths": np.stack([p.widths for p in parts]),
                  "shifts": np.stack([p.shifts for p in parts]), "sigma": ctx.sigmas,
                  "seed": np.asarray(seeds, dtype=np.int64)}
    buf = io.BytesIO()
    np.savez_compressed(buf, **arrays)
    return buf.getvalue()


def memory(spec: SampleSpec) -> MemoryNeed:
    """Peak bytes: the (heads, s, n) int64 bins of masks.npz, stacked once more while it is written."""
    heads = spec.heads or 1
    return MemoryNeed(8.0 * (2 * heads * spec.s * spec.n + 3 * spec.n), f"bins of {heads} x {spec.s} x {spec.n}")


def cells(spec: SampleSpec, ctx: SampleContext | None = None) -> list[dict[str, Any]]:
    return [{"head": h} for h in range(spec.heads if spec.heads is not None else 1)]


def run_cell(spec: SampleSpec, key: dict[str, Any], ctx: SampleContext, work: Any = None) -> tuple[list[dict], dict]:
    h = key["head"]
    p, sd = ctx.partitions[h], ctx.seeds[h]
    rows = [{"head": h, "sigma": p.sigma, "sample": k, "seed": sd, "width": float(p.widths[k]),
             "shift": float(p.shifts[k]), "num_blocks": int(lengths.size), "max_block": int(lengths.max()),
             "mean_block": float(lengths.mean())}
            for k, lengths in enumerate(p.block_lengths())]
    return rows, {}


def summary(df: Any) -> tuple[list[str], list[list[str]]]:
    head = ["head", "sigma", "seed", "s", "mean width", "blocks", "mean block", "b_max"]
    rows = []
    for h, g in df.groupby("head"):
        rows.append([str(h), f"{g['sigma'].iloc[0]:g}", str(g['seed'].iloc[0]), str(len(g)),
                     f"{g['width'].mean():.2f}", f"{g['num_blocks'].mean():.1f}", f"{g['mean_block'].mean():.2f}",
                     str(g['max_block'].max())])
    return head, rows


def plot(run: Path, df: Any) -> list[Path]:
    """One mask, the mean of the s masks and L* side by side, for up to four heads."""
    import numpy as np

    plt = plotting.pyplot()
    data = np.load(run / "masks.npz")
    bins = data["bins"]
    sigmas = np.atleast_1d(data["sigma"])
    if bins.ndim == 2:
        bins = bins[None]
    n = bins.shape[-1]
    if n > 1024:
        raise ConfigError(f"{run}: n={n} is too large for a heat map (at most 1024)")
    rows = min(4, bins.shape[0])
    fig, axes = plt.subplots(rows, 3, figsize=(11, 3.5 * rows), squeeze=False)
    idx = np.arange(n)
    for h in range(rows):
        b = bins[h]
        mean = np.mean(b[:, :, None] == b[:, None, :], axis=0)
        L = np.exp(-np.abs(idx[:, None] - idx[None, :]) / sigmas[h])
        for ax, mat, title in zip(axes[h], (b[0][:, None] == b[0][None, :], mean, L),
                                  ("one mask M(h₁)", f"mean of s={b.shape[0]} masks  M̃",
                                   f"L* = exp(−|i−j|/σ), σ={sigmas[h]:.3g}")):
            im = ax.imshow(mat.astype(float), vmin=0, vmax=1, cmap="viridis", interpolation="nearest")
            ax.set_title(title)
            ax.set_xticks([])
            ax.set_yticks([])
        fig.colorbar(im, ax=axes[h].tolist(), shrink=0.8)
    return plotting.save(fig, run, "mean_mask_heatmap")


def report(run: Path, df: Any) -> Section:
    sec = Section("sample", run, "Sampled masks")
    sec.paragraphs.append(f"{len(df)} sampled partitions; mean block {df.mean_block.mean():.2f}, "
                          f"largest {df.max_block.max()}.")
    return sec


EXPERIMENT = Experiment(
    name="sample",
    spec=SampleSpec,
    help="""Draw positional-LSH partitions; write masks.npz (bins, widths, shifts) and a block table.

    `poslsh sample n=N sigma=SIGMA s=S seed=SEED` regenerates exactly the masks behind any results
    row with that seed.""",
    columns=COLUMNS,
    cells=cells,
    run_cell=run_cell,
    summary=summary,
    prepare=prepare,
    plot=plot,
    report=report,
    order=90,
    memory=memory,
)
