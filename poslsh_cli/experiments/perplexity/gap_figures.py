"""The registered experiments' two figures, drawn from the numbers their verdicts carry (nothing is
recomputed here): the gap to exact ALiBi against s at each training length of the stability check,
with the margin's band (docs/PREREGISTRATION.md), and the relative gap against the context length per
s (docs/PREREGISTRATION_L1024.md, "Across lengths"). Each interval is a 90% t-interval over the
training seeds.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable

from poslsh_cli.verdicts.claims import Verdict
from poslsh_cli.verdicts.registered import REGISTERED
from poslsh_cli.verdicts import plotting


def _half90(se: float, n: int) -> float:
    from scipy import stats

    return float(stats.t.ppf(0.95, df=n - 1) * se)


def gap_points(v: Verdict) -> list[tuple[int, float, float]]:
    """A primary verdict's (training steps, gap, 90% half-width) at each training length it carries:
    the stability check's points, or the endpoint alone where the check was not measured."""
    nb = v.numbers or {}
    stab = nb.get("stability")
    if stab:
        return [(int(p["steps"]), float(p["gap"]), _half90(p["se"], p["n"])) for p in stab["points"]]
    return [(int(nb["steps"]), float(nb["gap"]), (float(nb["high90"]) - float(nb["low90"])) / 2)]


def plot_gap_against_s(out: Path, name: str, verdicts: Iterable[Verdict]) -> list[Path]:
    """Bits-per-byte gap of Positional LSH to exact ALiBi against s (log axis), one series per
    training length, with the margin drawn as a band above zero; [] without measured verdicts."""
    measured = [v for v in verdicts if v.numbers and "gap" in v.numbers]
    if not measured:
        return []
    plt = plotting.pyplot()
    fig, ax = plt.subplots(figsize=(5.6, 3.6))
    margin = float(measured[0].numbers["margin"])
    ax.axhspan(0.0, margin, color="0.9", label=f"within the margin ({margin:.4f})")
    ax.axhline(0.0, color="0.4", lw=0.8)
    series: dict[int, list[tuple[int, float, float]]] = {}
    for v in measured:
        for steps, gap, half in gap_points(v):
            series.setdefault(steps, []).append((int(v.numbers["s"]), gap, half))
    for i, (steps, pts) in enumerate(sorted(series.items())):
        pts.sort()
        shift = 1.0 + 0.04 * (i - (len(series) - 1) / 2)  # side by side at each s
        ax.errorbar([p[0] * shift for p in pts], [p[1] for p in pts], yerr=[p[2] for p in pts], marker="o",
                    capsize=3, label=f"T = {steps} steps")
    ss = sorted({int(v.numbers["s"]) for v in measured})
    return _finish(fig, ax, ss, "masks s", "gap to exact ALiBi (bits per byte)", f"{name}: gap against s",
                   out, f"registered_gap_vs_s_{name}")


def plot_gap_against_length(out: Path, name: str, verdicts: Iterable[Verdict]) -> list[Path]:
    """The relative gap (% of exact ALiBi's bits per byte) at the two registered context lengths, one
    line per s; [] without measured verdicts."""
    measured = [v for v in verdicts if v.numbers and "short" in v.numbers]
    if not measured:
        return []
    plt = plotting.pyplot()
    fig, ax = plt.subplots(figsize=(5.6, 3.6))
    ax.axhline(0.0, color="0.4", lw=0.8)
    for v in sorted(measured, key=lambda v: v.numbers["s"]):
        nb = v.numbers
        lengths = [nb["short_length"], nb["long_length"]]
        mid = [100 * nb["short"], 100 * nb["long"]]
        err = [[100 * (nb["short"] - nb["short_low"]), 100 * (nb["long"] - nb["long_low"])],
               [100 * (nb["short_high"] - nb["short"]), 100 * (nb["long_high"] - nb["long"])]]
        ax.errorbar(lengths, mid, yerr=err, marker="o", capsize=3, label=f"Positional LSH s = {nb['s']}")
    ls = sorted({int(x) for v in measured for x in (v.numbers["short_length"], v.numbers["long_length"])})
    return _finish(fig, ax, ls, "context length L (tokens)", "gap to exact ALiBi (% of its bits per byte)",
                   f"{name.replace('_', ' ')}: gap against L", out, f"registered_gap_vs_L_{name}")


def _finish(fig: Any, ax: Any, ticks: list[int], xlabel: str, ylabel: str, title: str, out: Path, name: str) -> list[Path]:
    """The house axes (x on a log2 scale with a tick at each value drawn, y linear), the title with the
    intervals' level, the legend, and the files."""
    plotting.log_axes(ax, xlabel, ylabel, x=2, y=None)
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.set_title(f"{title} (90% intervals over seeds)")
    ax.legend()
    return plotting.save(fig, out, name)


def draw(out: Path, verdicts: list[Verdict]) -> list[Path]:
    """The PNG figures of the registered section's verdicts into ``out/figures``: the gap against s of
    each registration (the primary verdicts, by their numbers' ``registration``), the gap against L (the
    verdicts whose numbers carry both lengths)."""
    primary = [v for v in verdicts if (v.numbers or {}).get("registration")]
    paths: list[Path] = []
    with plotting.png_only():
        length = {r.name: r.seq_len for r in REGISTERED.values()}  # the shorter context first, as the answer
        for name in sorted({v.numbers["registration"] for v in primary}, key=lambda n: (length.get(n, 0), n)):
            paths += plot_gap_against_s(out, name, [v for v in primary if v.numbers["registration"] == name])
        paths += plot_gap_against_length(out, "across_lengths", verdicts)
    return [p for p in paths if p.suffix == ".png"]
