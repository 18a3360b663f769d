"""Reading run directories, for the readers (``plot``, ``report``, ``collect``) and for the owner
before it writes: nothing in this module writes a file. A reader takes no lock; when results.csv
disagrees with ``cells/`` (the source of truth) it rebuilds the table in memory and says so, and
only the run's owner, the same command run again, rewrites it (:mod:`poslsh_cli.store.rundir`).
"""
from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

from poslsh_cli.core.errors import ConfigError
from poslsh_cli.store import ownership


def read_json(path: Path) -> tuple[Optional[Any], Optional[str]]:
    """(value, None), or (None, why) for a missing, empty, cut or malformed file."""
    try:
        text = Path(path).read_bytes().decode("utf-8")
    except OSError as exc:
        return None, exc.strerror or type(exc).__name__
    except UnicodeDecodeError:
        return None, "not UTF-8 text"
    if not text.strip():
        return None, "empty"
    try:
        return json.loads(text), None
    except ValueError:
        return None, "cut or malformed JSON"


def read_config_text(path: Path) -> str:
    """A run's config.yaml as text, or one error line naming it (unreadable, not UTF-8)."""
    try:
        return Path(path).read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"{path} is not UTF-8 text: not a poslsh configuration (move it away, or use "
                          "another out=)") from None
    except OSError as exc:
        raise ConfigError(f"{path} cannot be read ({exc.strerror or type(exc).__name__})") from None


def read_cells(cells_dir: Path) -> tuple[dict[str, dict], list[tuple[Path, str]]]:
    good: dict[str, dict] = {}
    bad: list[tuple[Path, str]] = []
    if not Path(cells_dir).is_dir():
        return good, bad
    for p in sorted(Path(cells_dir).glob("*.json")):
        data, why = read_json(p)
        if isinstance(data, dict) and isinstance(data.get("rows"), list) and "key" in data:
            good[p.stem] = data
        else:
            bad.append((p, why or "not a cell record"))
    return good, bad


def frames_of(cells: list[dict], columns: list[str]) -> tuple[str, dict[str, str]]:
    """results.csv text and aux tables' texts from cell records, in the given order."""
    import pandas as pd

    rows = [r for c in cells for r in c["rows"]]
    df = pd.DataFrame(rows)
    if df.empty:
        df = pd.DataFrame(columns=list(columns))
    extra = [c for c in df.columns if c not in columns]
    df = df[[c for c in columns if c in df.columns] + extra]
    aux = {}
    for name in sorted({n for c in cells for n in c.get("aux", {})}):
        aux[name] = pd.DataFrame([r for c in cells for r in c["aux"].get(name, [])]).to_csv(index=False)
    return df.to_csv(index=False), aux


def results(run: Path, columns: Iterable[str] = (), notice: Callable[[str], None] = print) -> Any:
    """The rows of a run as a DataFrame, from ``cells/`` (the source of truth).

    results.csv is checked against the cells: when it is missing, cut, or holds other rows, the
    table is rebuilt from them in memory, saying so; the file is never written here (only a run's
    owner writes it: the same command rewrites it). Without ``columns`` (the experiment's column order) the cells
    are only read. An unreadable cell file is named and left out. Runs without
    ``cells/`` are read from results.csv, with one error line naming it when it cannot be parsed.
    """
    import pandas as pd

    run = Path(run)
    table = run / "results.csv"
    if not (run / "cells").is_dir():
        try:
            return pd.read_csv(table)
        except FileNotFoundError:
            raise ConfigError(f"{run}: no results.csv yet") from None
        except (ValueError, pd.errors.ParserError) as exc:
            raise ConfigError(f"{table} cannot be read ({str(exc).splitlines()[0]})") from None
    good, bad = read_cells(run / "cells")
    for p, why in bad:
        notice(f"{p} is unreadable ({why}); left out (run the command again to compute that cell)")

    def order(item: tuple[str, dict]) -> tuple:
        idx = item[1].get("index")
        return (0, idx, "") if isinstance(idx, int) else (1, (run / "cells" / f"{item[0]}.json").stat().st_mtime, item[0])

    cells = [c for _, c in sorted(good.items(), key=order)]
    if not cells and not table.exists():
        return pd.DataFrame(columns=list(columns))
    text, aux = frames_of(cells, list(columns))
    if not columns:  # the column order is the experiment's: without it, read only
        return pd.read_csv(io.StringIO(text)) if text.strip() else pd.DataFrame()
    current = table.read_bytes().decode("utf-8", errors="replace") if table.exists() else None
    # only the owner writes a run (a reader that rewrote the table could lose its temporary file to an
    # owner starting at that moment): the table is rebuilt here in memory only; a run another process is
    # still writing has a table that lags its cells by design, which needs no word
    stale = current is None or sorted(current.splitlines()) != sorted(text.splitlines())
    if stale and (current is not None or cells) and (ownership.holder(run) is None or ownership.owns(run)):
        problem = ("is missing" if current is None else "is cut mid-line" if not current.endswith("\n")
                   else f"holds {_rows(len(current.splitlines()) - 1)} where the cells hold "
                        f"{_rows(len(text.splitlines()) - 1)}" if len(current.splitlines()) != len(text.splitlines())
                   else "disagrees with the cells")
        notice(f"{table} {problem}; read from its {len(cells)} cell{'s' if len(cells) != 1 else ''} in "
               f"{run / 'cells'} (the same command with out={run} rewrites the file)")
    if not text.strip():
        return pd.DataFrame(columns=list(columns))
    return pd.read_csv(io.StringIO(text))


def _rows(n: int) -> str:
    n = max(0, n)
    return f"{n} row{'s' if n != 1 else ''}"


def status(run: Path, meta: dict[str, Any]) -> str:
    """The run's status, with ``died`` for a ``running`` run whose owner is gone."""
    st = meta.get("status") or "unknown"
    if st == "running" and ownership.holder(run) is None:
        return "died"
    return st


def load_run(path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(config, meta) of a finished or partial run directory (meta {} when unreadable)."""
    import yaml

    path = Path(path)
    if not (path / "config.yaml").exists():
        raise ConfigError(f"{path} is not a poslsh run directory (no config.yaml)")
    try:
        cfg = yaml.safe_load(read_config_text(path / "config.yaml")) or {}
    except yaml.YAMLError:
        raise ConfigError(f"{path / 'config.yaml'} cannot be read (malformed YAML)") from None
    meta, _ = read_json(path / "meta.json")
    return cfg, meta if isinstance(meta, dict) else {}


def find_runs(paths: Iterable[Path]) -> list[Path]:
    """Run directories at or below each path (a multirun sweep holds one per job)."""
    out: list[Path] = []
    for p in paths:
        p = Path(p)
        if (p / "config.yaml").exists():
            out.append(p)
        elif p.is_dir():
            found = sorted(q.parent for q in p.rglob("config.yaml") if (q.parent / "cells").is_dir()
                           or (q.parent / "meta.json").exists())
            if not found:
                raise ConfigError(f"{p} holds no poslsh run (no config.yaml below it)")
            out.extend(found)
        elif p.exists():
            raise ConfigError(f"{p} is not a run: give a run directory (it holds config.yaml) or a folder of runs")
        else:
            raise ConfigError(f"{p} does not exist")
    return out


__all__ = ["read_json", "read_config_text", "read_cells", "frames_of", "results", "status", "load_run", "find_runs"]
