"""Shared drawing helpers for the experiments' own ``plot`` functions (results -> matplotlib, PNG
+ PDF into ``figures/``); :func:`poslsh_cli.app.report.plot_run` dispatches a run to its experiment.

Plotting reads what the runs wrote and draws it; the only arithmetic is aggregation over
trials, least-squares slopes for legends, and theory curves.
"""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Callable, Iterator

from poslsh_cli.numerics.metrics import fit_loglog_slope

#: Sizes chosen for figures shown at about 1000 px wide (the HTML report): no text under 8 pt.
STYLE = {"font.size": 9, "legend.fontsize": 8, "axes.titlesize": 10, "axes.labelsize": 9, "xtick.labelsize": 8,
         "ytick.labelsize": 8, "figure.titlesize": 11}


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend with the house style (imported on first use)."""
    import matplotlib

    matplotlib.use("Agg")
    matplotlib.rcParams.update(STYLE)
    import matplotlib.pyplot as plt

    return plt


#: The formats :func:`save` writes (``poslsh plot``: PNG and PDF; a report, which shows PNGs only,
#: draws inside :func:`png_only`).
_FORMATS = ["png", "pdf"]


@contextlib.contextmanager
def png_only() -> Iterator[None]:
    """Within it, figures are written as PNG only (what the report embeds and publishes)."""
    saved = list(_FORMATS)
    _FORMATS[:] = ["png"]
    try:
        yield
    finally:
        _FORMATS[:] = saved


def save(fig: Any, run: Path, name: str) -> list[Path]:
    """Write ``figures/<name>.png`` (and .pdf) of a run. No date or version is written into the
    files, so the same data and library versions give the same bytes."""
    out = Path(run) / "figures"
    out.mkdir(exist_ok=True)
    paths = []
    for fmt in _FORMATS:
        path = out / f"{name}.{fmt}"
        meta = {"Software": None} if fmt == "png" else {"Creator": None, "Producer": None, "CreationDate": None}
        fig.savefig(path, dpi=110 if fmt == "png" else None, bbox_inches="tight", metadata=meta)
        paths.append(path)
    pyplot().close(fig)
    return paths


def log_axes(ax: Any, xlabel: str | None = None, ylabel: str | None = None, *, x: int | None = 2,
             y: int | None = 10, grid: bool = True) -> None:
    """The axes of the experiments' figures: x on a log scale of base ``x`` (2 for lengths and s, 10
    for times and tokens; None leaves it linear), y likewise of base ``y``, a light grid at the major
    and minor ticks (``grid=False``: none), and the labels given."""
    if x is not None:
        ax.set_xscale("log", base=x)
    if y is not None:
        ax.set_yscale("log", base=y)
    if xlabel is not None:
        ax.set_xlabel(xlabel)
    if ylabel is not None:
        ax.set_ylabel(ylabel)
    if grid:
        ax.grid(True, which="both", alpha=0.25)


def decay_panel(ax: Any, df: Any, x: str, y: str, group: list[str], label: Callable[[tuple], str]) -> None:
    """Mean over trials with min-max band, fitted log-log slope in the legend, c/sqrt(x) guide."""
    import numpy as np

    for i, (gkey, g) in enumerate(df.groupby(group, sort=True)):
        gkey = gkey if isinstance(gkey, tuple) else (gkey,)
        agg = g.groupby(x)[y].agg(["mean", "min", "max"]).reset_index()
        fit = fit_loglog_slope(g[x], g[y])
        color = f"C{i % 10}"
        ax.plot(agg[x], agg["mean"], "o-", color=color, ms=3.5, lw=1.4,
                label=f"{label(gkey)}  slope {fit.slope:.2f}")
        ax.fill_between(agg[x], agg["min"], agg["max"], color=color, alpha=0.18, lw=0)
        if len(agg) > 1:
            c = float(np.exp(np.mean(np.log(agg["mean"]) + 0.5 * np.log(agg[x]))))
            xs = np.asarray(agg[x], dtype=float)
            ax.plot(xs, c / np.sqrt(xs), "--", color=color, lw=0.8, alpha=0.7)
    log_axes(ax)
