"""How a report reads: ``report.md`` and the self-contained ``report.html`` from the sections
:mod:`poslsh_cli.app.report` builds. A summary of the claims a rule decided, one line each, grouped by
the paper's parts and linked to their anchored sections; the notes; a table of contents; every section
under a title that names its run; the provenance table.
"""
from __future__ import annotations

import base64
import collections
import datetime as _dt
import html
import math
import re
from pathlib import Path
from typing import Any, Callable

import pandas as pd

from poslsh_cli.app import registry
from poslsh_cli.verdicts.claims import Section, Status


def verdict_text(sec: Section, v: Any) -> str:
    """A verdict's status as the summary prints it: with ``(smoke test)`` for a smoke-scale run."""
    return v.status.value + (" (smoke test)" if sec.smoke else "")


#: The paper's parts, by the experiments' report order (``Experiment.order``): up to the first
#: bound, then up to the next (the report's summary and the README group their claims by them).
PARTS = (("Theory: masks, matrix error, block sizes", 30),
         ("Attention: output error and speed", 50),
         ("Language models: training, extrapolation, retrieval", float("inf")))
#: what the summary lists one line each: the verdicts a rule decided
DECIDED = (Status.SUPPORTED, Status.NOT_SUPPORTED)


def anchor(sec: Section) -> str:
    """A section's anchor in report.md and report.html: its command and run (the run's parent too, so
    two runs of one name in different folders, or a multirun's numbered jobs, stay apart), dashed."""
    where = f"{sec.run.parent.name} {sec.run.name}" if sec.run.parent.name else sec.run.name
    return re.sub(r"[^a-z0-9]+", "-", f"{sec.command} {where}".lower()).strip("-")


def heading(sec: Section) -> str:
    """A section's title with the run it reports (several sections of one command are told apart)."""
    return sec.title if sec.run.name in ("", "registered") else f"{sec.title} ({sec.run.name})"


def _part(sec: Section) -> int:
    """The paper's part a section belongs to (the last for a section of no registered command)."""
    order = registry.get(sec.command).order if sec.command in registry.experiments() else math.inf
    return next((i for i, (_, bound) in enumerate(PARTS) if order < bound), len(PARTS) - 1)


def summary_lines(sections: list[Section]) -> list[tuple[int, Section, Any]]:
    """(part, section, verdict) of every decided verdict, grouped by the paper's parts in report order."""
    rows = [(_part(s), s, v) for s in sections for v in s.verdicts if v.status in DECIDED]
    return sorted(rows, key=lambda r: r[0])


SUMMARY_TEXT = ("The claims a rule decided, by the paper's part; each links to its section, where its evidence, its "
                "rule and the claims left undecided are.")


def summary_parts(sections: list[Section]) -> list[tuple[str, list, str]]:
    """Per part of the paper with anything to say: (its title, its decided (section, verdict) pairs,
    the count of the undecided ones as text)."""
    rows = summary_lines(sections)
    out = []
    for i, (title, _) in enumerate(PARTS):
        here = [(s, v) for part, s, v in rows if part == i]
        rest = _undecided(sections, i)
        if here or rest:
            out.append((title, here, rest))
    return out


def _undecided(sections: list[Section], part: int) -> str:
    counts = collections.Counter(v.status.value for s in sections if _part(s) == part for v in s.verdicts
                                 if v.status not in DECIDED)
    return ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))


class Lead(str):
    """A note every verdict of the report depends on (that its runs are at smoke scale): before the
    summary, where the other notes come after it."""


def _lead(sections: list[Section], notes: list[str]) -> tuple[list[str], list[str]]:
    """(the notes that lead, the other notes)."""
    return [n for n in notes if isinstance(n, Lead)], [n for n in notes if not isinstance(n, Lead)]


def markdown(sections: list[Section], provenance: list[dict], out_dir: Path, notes: list[str]) -> str:
    """report.md: the summary, the notes, the contents, every section, the provenance."""
    lines = ["# Positional LSH: claims and measurements", "",
             f"Generated {_dt.datetime.now().isoformat(timespec='seconds')} by `poslsh report`.", ""]
    lead, notes = _lead(sections, notes)
    lines += [f"- {n}" for n in lead] + ([""] if lead else [])
    lines += ["## Summary", "", SUMMARY_TEXT, ""]
    for title, here, rest in summary_parts(sections):
        lines += [f"**{title}**", ""]
        lines += [f"- **{verdict_text(s, v)}** {v.claim} ([{s.run.name or s.command}](#{anchor(s)}))" for s, v in here]
        if rest:
            lines.append(f"- not decided: {rest} (in the sections)")
        lines.append("")
    lines += [f"- {n}" for n in notes] + ([""] if notes else [])
    lines += ["## Contents", ""] + [f"- [{heading(s)}](#{anchor(s)})" for s in sections] + ["- [Provenance](#provenance)"]
    for sec in sections:
        lines += section_markdown(sec, f"Run: `{sec.run}`",
                                  details_in=lambda sec: f"report.html and `{_rel(sec.run / 'results.csv', out_dir)}`",
                                  figure_link=lambda f: _rel(f, out_dir), anchored=True)
    lines += ["", "<a id=\"provenance\"></a>", "", "## Provenance", ""]
    lines.append(pd.DataFrame(provenance).to_markdown(index=False))
    return "\n".join(lines) + "\n"


def section_markdown(sec: Section, run_line: str, details_in: Callable[[Section], str],
                     figure_link: Callable[[Path], str], level: str = "##", anchored: bool = False) -> list[str]:
    """One section as markdown lines: title, where it came from, verdicts with their rules, the
    computed sentences, tables, where the full tables are, figures (``anchored``: the title under an
    anchor the report's summary and contents link to, and naming its run)."""
    lines = (["", f"<a id=\"{anchor(sec)}\"></a>", "", f"{level} {heading(sec)}"] if anchored else
             ["", f"{level} {sec.title}"]) + ["", run_line, ""]
    for v in sec.verdicts:
        lines.append(f"- **{verdict_text(sec, v)}**: {v.claim}. {v.evidence}. *Rule: {v.rule}.*")
    lines += [""] + sec.paragraphs
    for t in sec.tables:
        lines += ["", t.to_markdown(index=False)]
    for caption, _ in sec.details:
        lines += ["", f"({caption}: in {details_in(sec)}.)"]
    for f in sec.figures:
        lines += ["", f"![{f.stem}]({figure_link(f)})"]
    return lines


def _rel(path: Path, base: Path) -> str:
    import os

    return os.path.relpath(path, base)


def embedded_png(path: Path) -> str:
    """A figure for the self-contained HTML, base64: the PNG with a palette of 256 colours (the line
    figures lose nothing visible, and the file a quarter of its size); the file as it is when it
    cannot be read as an image."""
    import io

    raw = Path(path).read_bytes()
    try:
        from PIL import Image

        with Image.open(io.BytesIO(raw)) as im:
            out = io.BytesIO()
            im.convert("RGB").convert("P", palette=Image.Palette.ADAPTIVE, colors=256).save(out, "PNG", optimize=True)
        smaller = out.getvalue()
        raw = smaller if len(smaller) < len(raw) else raw
    except Exception:  # noqa: BLE001  (not an image Pillow reads: embed the bytes as they are)
        pass
    return base64.b64encode(raw).decode()


def _inline(text: str) -> str:
    """Plain text with markdown's inline code (`...`) as HTML <code> (a note's backticks showed as such)."""
    return re.sub(r"`([^`]+)`", lambda m: f"<code>{m.group(1)}</code>", html.escape(text))


_CLASS = {Status.SUPPORTED: "ok", Status.NOT_SUPPORTED: "no", Status.INCONCLUSIVE: "unsure", Status.NOT_MEASURED: "na", Status.ESTIMATE: "na"}


def html_page(sections: list[Section], provenance: list[dict], notes: list[str]) -> str:
    """report.html: what report.md holds, with every figure embedded (one self-contained file)."""
    e = html.escape
    css = ("body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;color:#222;line-height:1.45}"
           ".scroll{overflow-x:auto;max-width:100%}"
           "table{border-collapse:collapse;margin:.8em 0;font-size:.85em}td,th{border:1px solid #ccc;padding:3px 7px;"
           "text-align:right;vertical-align:top}th{background:#f3f3f3}td.text{text-align:left}"
           "td.argv{text-align:left;font-family:monospace;font-size:.9em;word-break:break-all;min-width:16em}"
           ".ok{color:#0a0;font-weight:bold}.no{color:#c00;font-weight:bold}.unsure{color:#b60;font-weight:bold}"
           ".na{color:#888;font-weight:bold}.rule{color:#555;font-size:.9em}"
           "img{max-width:100%;border:1px solid #eee;margin:.5em 0}code{background:#f5f5f5;padding:1px 3px;word-break:break-all}"
           "details{margin:.6em 0}summary{cursor:pointer;color:#036}")
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>poslsh report</title><style>{css}</style></head><body>",
             "<h1>Positional LSH: claims and measurements</h1>",
             f"<p>Generated {e(_dt.datetime.now().isoformat(timespec='seconds'))} by <code>poslsh report</code>.</p>"]
    lead, notes = _lead(sections, notes)
    if lead:
        parts.append("<ul>" + "".join(f"<li>{_inline(n)}</li>" for n in lead) + "</ul>")
    parts.append(f"<h2 id='summary'>Summary</h2><p>{e(SUMMARY_TEXT)}</p>")
    for title, here, rest in summary_parts(sections):
        parts.append(f"<h3>{e(title)}</h3><ul>")
        parts += [f"<li><span class='{_CLASS[v.status]}'>{e(verdict_text(s, v))}</span> {e(v.claim)} "
                  f"(<a href='#{anchor(s)}'>{e(s.run.name or s.command)}</a>)</li>" for s, v in here]
        if rest:
            parts.append(f"<li class='rule'>not decided: {e(rest)} (in the sections)</li>")
        parts.append("</ul>")
    if notes:
        parts.append("<ul>" + "".join(f"<li>{_inline(n)}</li>" for n in notes) + "</ul>")
    parts.append("<h2 id='contents'>Contents</h2><ul>" + "".join(
        f"<li><a href='#{anchor(s)}'>{e(heading(s))}</a></li>" for s in sections)
        + "<li><a href='#provenance'>Provenance</a></li></ul>")
    for sec in sections:
        parts.append(f"<h2 id='{anchor(sec)}'>{e(heading(sec))}</h2><p>Run: <code>{e(str(sec.run))}</code> "
                     "<a href='#contents'>(contents)</a></p><ul>")
        for v in sec.verdicts:
            parts.append(f"<li><span class='{_CLASS[v.status]}'>{e(verdict_text(sec, v))}</span>: {e(v.claim)}. "
                         f"{e(v.evidence)}."
                         f"<br><span class='rule'>Rule: {e(v.rule)}.</span></li>")
        parts.append("</ul>")
        parts += [f"<p>{e(p)}</p>" for p in sec.paragraphs]
        parts += [f"<div class='scroll'>{t.to_html(index=False, border=0, escape=True)}</div>" for t in sec.tables]
        for caption, t in sec.details:
            parts.append(f"<details><summary>{e(caption)}</summary><div class='scroll'>"
                         f"{t.to_html(index=False, border=0, escape=True)}</div></details>")
        for f in sec.figures:
            parts.append(f"<img alt='{e(f.stem)}' src='data:image/png;base64,{embedded_png(f)}'>")
    parts.append("<h2 id='provenance'>Provenance</h2><div class='scroll'><table><tr>"
                 + "".join(f"<th>{e(c)}</th>" for c in (provenance[0] if provenance else {})) + "</tr>")
    for row in provenance:
        parts.append("<tr>" + "".join(f"<td class='{'argv' if k == 'argv' else 'text'}'>{e(str(v))}</td>"
                                      for k, v in row.items()) + "</tr>")
    parts.append("</table></div></body></html>")
    return "\n".join(parts)


