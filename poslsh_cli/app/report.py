"""``poslsh report``: one markdown and one self-contained HTML report beside the runs.

Each run contributes its experiment's section (``Experiment.report``: a claim of the paper
beside what the run measured, with the verdict, the numbers it was computed from and the rule;
see :mod:`poslsh_cli.verdicts.claims`). Every comparative sentence is generated from the data it talks
about; a claim without data is NOT MEASURED. Skipped experiments and reproduce sessions are
read from the run directories, so any report over them says what is missing and why.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Callable

import pandas as pd

from poslsh_cli.app import registry, render
from poslsh_cli.attention.scheme import Position
from poslsh_cli.verdicts.claims import Joined, Section, Status
from poslsh_cli.core.errors import ConfigError
from poslsh_cli.core.files import atomic_write_text
from poslsh_cli.store.provenance import machine_text, preset_of
from poslsh_cli.store.readers import find_runs, read_json, results, status
from poslsh_cli.verdicts import plotting


def _print(text: str) -> None:
    import sys

    sys.stderr.write(text + "\n")


def run_table(run: Path, notice=_print) -> tuple:
    """(experiment, config, meta, rows) of one run directory; rows come from its cells
    (:func:`poslsh_cli.store.readers.results` repairs a results.csv that disagrees, saying so)."""
    exp, cfg, meta = registry.experiment_of(run)
    return exp, cfg, meta, results(run, exp.columns, notice)


def plot_run(run: Path, notice=_print) -> list[Path]:
    """Every figure of one run directory (its experiment's ``plot``); returns the files written."""
    exp, _, _, df = run_table(Path(run), notice)
    if exp.plot is None:
        raise ConfigError(f"{run}: no plots for command {exp.name!r}")
    if df.empty:
        raise ConfigError(f"{run}: no finished cell yet")
    return exp.plot(Path(run), df)


# ---------------------------------------------------------------------------------------------
# notes kept in the run directories (skipped experiments, reproduce sessions)


def notes_of(paths: list[Path]) -> list[str]:
    """Skipped experiments (``skipped.json`` in their run directory) and ``reproduce.json`` sessions
    found at or below ``paths``, so any report over them says what is missing and why."""
    notes: list[str] = []
    seen: set[Path] = set()
    skipped: dict[str, list[str]] = {}  # reason -> the presets skipped for it (one line a reason)
    for root in paths:
        root = Path(root)
        for f in sorted(root.rglob("skipped.json")) + ([root / "skipped.json"] if (root / "skipped.json").exists() else []):
            f = f.resolve()
            if f in seen or (f.parent / "config.yaml").exists():
                continue  # a run has since been made there
            seen.add(f)
            try:
                rec = json.loads(f.read_text())
                skipped.setdefault(str(rec["reason"]), []).append(str(rec["name"]))
            except (OSError, ValueError, KeyError, TypeError):
                continue
    notes += [f"skipped {', '.join(names)}: {reason}" for reason, names in skipped.items()]
    for root in paths:
        root = Path(root)
        rep = root / "reproduce.json"
        if rep.exists() and rep.resolve() not in seen:
            seen.add(rep.resolve())
            try:
                rec = json.loads(rep.read_text())
                for sess in rec.get("sessions", []):
                    notes.append(f"reproduce --scale {rec.get('scale')}: session started {sess['started']}, "
                                 f"{sess['ran']} experiments run in {sess['seconds']:.0f} s"
                                 + (f", failed: {', '.join(sess['failed'])}" if sess.get("failed") else ""))
            except (OSError, ValueError, KeyError, TypeError):
                pass
            timing = _wall_times(root)
            if timing:
                total = sum(timing.values())
                notes.append("wall time per experiment (meta.json, all sessions): "
                             + ", ".join(f"{name} {sec:.0f} s" for name, sec in timing.items())
                             + f"; total {total:.0f} s ({total / 3600:.2f} h)")
    return notes


def _wall_times(root: Path) -> dict[str, float]:
    """Seconds each experiment under a reproduce root ran, summed over its sessions (and over the
    jobs of a multirun): what ``make reproduce-*`` cost, even when it ran in several sessions."""
    out: dict[str, float] = {}
    for exp in sorted(p for p in root.iterdir() if p.is_dir()):
        metas = [exp / "meta.json"] if (exp / "meta.json").exists() else sorted(exp.glob("*/meta.json"))
        sec = 0.0
        for m in metas:
            meta, _ = read_json(m)
            try:
                sec += float(meta.get("wall_seconds", 0.0)) if isinstance(meta, dict) else 0.0
            except (TypeError, ValueError):
                continue
        if sec > 0:
            out[exp.name] = sec
    return out


def build(run_dirs: list[Path], out_dir: Path, notes: list[str] | None = None, notice=_print,
          progress: Callable[[str], None] | None = None) -> tuple[Path, Path]:
    """Write report.md and report.html into ``out_dir``; returns their paths. Repairs of a run's
    tables are said through ``notice`` and listed in the report; ``progress`` hears each run as it is
    read and the figures before they are drawn."""
    sections, provenance, notes = sections_of(run_dirs, notes, notice, progress)
    out_dir.mkdir(parents=True, exist_ok=True)
    md, body = render.markdown(sections, provenance, out_dir, notes), render.html_page(sections, provenance, notes)
    md_path, html_path = out_dir / "report.md", out_dir / "report.html"
    atomic_write_text(md_path, md)
    atomic_write_text(html_path, body)
    return md_path, html_path


def sections_of(run_dirs: list[Path], notes: list[str] | None = None, notice=_print,
                progress: Callable[[str], None] | None = None) -> tuple[list, list, list]:
    """(sections in report order with their figures drawn, provenance rows, notes) of the runs at
    or below ``run_dirs``; ``progress`` hears each run as it is read and the figures before they are drawn."""
    runs = find_runs(run_dirs)
    notes = list(notes or []) + [n for n in notes_of([Path(p) for p in run_dirs]) if n not in (notes or [])]
    experiments = registry.experiments()
    order = {name: i for i, name in enumerate(experiments)}
    sections, provenance = [], []
    tables = {}
    for i, run in enumerate(runs, start=1):
        if progress is not None:
            progress(f"{run.name} ({i}/{len(runs)})")
        said: list[str] = []

        def tell(text: str) -> None:
            said.append(text)
            notice(text)

        try:
            exp, cfg, meta, df = run_table(run, tell)
        except ConfigError as exc:
            notes.append(f"left out {run}: {exc}")
            continue
        notes.extend(said)
        if exp.report is None or df.empty:
            continue
        sec = exp.report(run, df)
        sec.smoke = is_smoke(meta)
        tables[run] = (sec, exp, df)
        sections.append(sec)
        git = meta.get("git") or {}
        provenance.append({"run": run.name, "command": exp.name, "status": status(run, meta),
                           "commit": ((git.get("commit") or "")[:10] + ("+dirty" if git.get("dirty") else "")) or None,
                           "seed": meta.get("seed"), "wall s": meta.get("wall_seconds"),
                           "device": machine_text(meta.get("device")),
                           "torch": (meta.get("versions") or {}).get("torch"), "argv": meta.get("argv")})
    if progress is not None:
        progress(f"drawing the figures of {len(tables)} runs")
    drawn = draw_figures([(run, exp, df) for run, (_, exp, df) in tables.items()], progress)
    for run, (sec, _, _) in tables.items():
        if isinstance(drawn[run], str):  # a figure that cannot be drawn must not lose the numbers
            sec.paragraphs.append(f"(figures unavailable: {drawn[run]})")
        else:
            sec.figures = drawn[run]
    sections.sort(key=lambda s: order[s.command])
    for exp in {exp.name: exp for _, exp, _ in tables.values() if exp.across_runs is not None}.values():
        joint = exp.across_runs([(run, df) for run, (_, e, df) in tables.items() if e is exp])
        if joint is not None:  # e.g. the registered primary verdicts, before the runs' own sections
            first = min((i for i, s in enumerate(sections) if s.command == exp.name), default=len(sections))
            sections.insert(first, joint)
    smoke = [s for s in sections if s.smoke]
    if smoke:
        notes.insert(0, render.Lead(SMOKE_NOTE.format(n=len(smoke), total=len(sections))))
    lm_runs = [sec for sec in sections if sec.facts.get("protocol")]
    if len(lm_runs) > 1:
        last = max(i for i, sec in enumerate(sections) if sec in lm_runs)
        sections.insert(last + 1, side_by_side(lm_runs))
    return sections, provenance, notes


def _figures_of(item: tuple) -> list[Path] | str:
    """The PNG figures of one run (its experiment's ``plot``), or why they cannot be drawn."""
    run, exp, df = item
    if exp.plot is None:
        return []
    try:
        with plotting.png_only():
            return [p for p in exp.plot(run, df) if p.suffix == ".png"]
    except Exception as exc:
        return str(exc) or type(exc).__name__


def draw_figures(items: list[tuple], progress: Callable[[str], None] | None = None) -> dict[Path, list[Path] | str]:
    """Every run's figures, PNG only, drawn in parallel over the runs (one process per core, forked
    so nothing is re-imported); each run's result is its files or the reason it has none.
    ``progress`` hears each run as its figures are done."""
    import concurrent.futures
    import multiprocessing
    import os

    def done(i: int, run: Path) -> None:
        if progress is not None:
            progress(f"figures of {run.name} drawn ({i}/{len(items)})")

    workers = min(len(items), os.cpu_count() or 1)
    if workers <= 1 or "fork" not in multiprocessing.get_all_start_methods():
        out = {}
        for i, item in enumerate(items, start=1):
            out[item[0]] = _figures_of(item)
            done(i, item[0])
        return out
    global _DRAWING
    _DRAWING = items  # the forked workers find the runs here (an experiment's functions need not pickle)
    try:
        with concurrent.futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
            futures = {pool.submit(_figures_at, i): item[0] for i, item in enumerate(items)}
            out = {}
            for i, future in enumerate(concurrent.futures.as_completed(futures), start=1):
                out[futures[future]] = future.result()
                done(i, futures[future])
            return {item[0]: out[item[0]] for item in items}
    finally:
        _DRAWING = []


_DRAWING: list[tuple] = []


def _figures_at(i: int) -> list[Path] | str:
    return _figures_of(_DRAWING[i])


#: the title of the section :func:`side_by_side` makes (the README block shows its table)
SIDE_BY_SIDE = "Language-model claims under each protocol, side by side"


def _moved(x: dict, y: dict, unit: str) -> str:
    return (f"{x['label']} {x['mean']:.4f} -> {y['mean']:.4f} {unit} ({y['mean'] - x['mean']:+.4f}; "
            f"{x['seeds']} -> {y['seeds']} seeds x {x['draws']} -> {y['draws']} draws)")


def disagreement(claim: str, a: tuple[str, Any], b: tuple[str, Any]) -> str:
    """One sentence on why two runs' verdicts on ``claim`` differ, computed from their numbers:
    which scheme's value moved (the baseline's or Positional LSH's) and which interval of the
    difference is wider."""
    (na, va), (nb, vb) = a, b
    head = f"*{claim}*: {va.status.value} under {na}, {vb.status.value} under {nb}"
    if not (va.numbers and vb.numbers):
        return head + " (no two-scheme comparison to take apart: the evidence is in each run's section)."
    x, y = va.numbers, vb.numbers
    unit = x["unit"]
    dx, dy = x["diff"], y["diff"]
    wx, wy = dx["high"] - dx["low"], dy["high"] - dy["low"]
    if not all(k in x and k in y for k in ("a", "b")):  # one interval (a change, or weights against a model)
        moves = "each run recorded the difference only"
    elif any(x[k]["label"] != y[k]["label"] for k in ("a", "b")):
        moves = f"the schemes compared differ ({x['a']['label']} vs {x['b']['label']}; {y['a']['label']} vs {y['b']['label']})"
    else:
        base = "b" if x["a"].get("position") == Position.POSLSH.value else "a"
        other = "a" if base == "b" else "b"
        shift = {k: y[k]["mean"] - x[k]["mean"] for k in ("a", "b")}
        bigger = base if abs(shift[base]) >= abs(shift[other]) else other
        moves = (f"the baseline moved {_moved(x[base], y[base], unit)}, Positional LSH "
                 f"{_moved(x[other], y[other], unit)}: the larger move is "
                 f"{'the baseline' if bigger == base else 'Positional LSH'}'s")
    if not (math.isfinite(wx) and math.isfinite(wy)):
        width = "one of the two has no interval"
    else:
        wider = na if wx > wy else nb
        width = (f"the interval of the difference is {wx:.4f} wide under {na} ({dx['n']} {dx['source']}) and {wy:.4f} "
                 f"under {nb} ({dy['n']} {dy['source']}): wider under {wider}")
    return (f"{head}. The difference went from {dx['estimate']:+.4f} [{dx['low']:+.4f}, {dx['high']:+.4f}] to "
            f"{dy['estimate']:+.4f} [{dy['low']:+.4f}, {dy['high']:+.4f}] {unit}; {moves}; {width}.")


def side_by_side(runs: list[Section]) -> Section:
    """One table of every claim of the runs that name their protocol (``facts["protocol"]``: the
    language-model runs), each run's verdict beside it, joined on the claim's name (never on its
    sentence), what each run trained and evaluated (``facts["described"]``), and for every claim two
    runs judge differently, why (:func:`disagreement`, in ``highlights``)."""
    sec = Section(runs[0].command, runs[0].run.parent, SIDE_BY_SIDE)
    names = [f"{s.run.name}: {s.facts['protocol']}" for s in runs]
    keys: list[str] = []
    label: dict[str, str] = {}
    judged: dict[tuple[str, str], Any] = {}
    for s, name in zip(runs, names):
        for v in s.verdicts:
            if v.name not in label:
                keys.append(v.name)
                label[v.name] = v.claim
            judged[(v.name, name)] = v
    sec.joined = Joined(names, [(label[k], {n: judged[(k, n)] for n in names if (k, n) in judged}) for k in keys])
    sec.tables.append(pd.DataFrame([{"claim": claim, **{n: (f"{cells[n].status.value}: {cells[n].evidence}"
                                                            if n in cells else "not judged in this run") for n in names}}
                                    for claim, cells in sec.joined.rows]))
    sec.paragraphs += [s.facts["described"] for s in runs if s.facts.get("described")]
    sec.paragraphs.append("Each cell is the verdict of that run's rule on its own rows (the rule is in its section); "
                          "rows join the runs' verdicts of one claim by its name, and a row's wording is the first "
                          "run's (an extrapolation claim's multiple, 4L or 2L, is each cell's own, in its evidence).")
    measured = [Status.SUPPORTED, Status.NOT_SUPPORTED, Status.INCONCLUSIVE]
    differ, both = [], 0
    for k in keys:
        cells = [(n, judged[(k, n)]) for n in names if (k, n) in judged and judged[(k, n)].status in measured]
        if len(cells) < 2:
            continue
        both += 1
        first = cells[0]
        differ += [disagreement(label[k], first, other) for other in cells[1:] if other[1].status is not first[1].status]
    if not both:
        said = ["No claim was judged under two protocols."]
    elif not differ:
        said = [f"The protocols agree on every one of the {both} claims judged under more than one."]
    else:
        said = [f"Where the protocols disagree ({len(differ)} of the {both} claims judged under more than one; scheme "
                "values are means over training seeds, the difference is the claim's own interval):"]
        said += [f"- {line}" for line in differ]
    sec.paragraphs += said
    sec.highlights = said
    return sec


#: What the top of a report says when some of its runs are at smoke scale
SMOKE_NOTE = ("{n} of these {total} runs are at smoke scale (`*_quick` presets: a few steps, one seed, small sizes); "
              "their verdicts, marked (smoke test), test that the pipeline runs end to end and decide none of the "
              "paper's claims: `make reproduce-all` makes the paper-scale runs")


def is_smoke(meta: dict) -> bool:
    """Whether a run was made from a smoke-scale preset (``experiment=<name>_quick``)."""
    return (preset_of(meta) or "").endswith("_quick")
