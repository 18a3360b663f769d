"""Run directories: resolved config, provenance, one owner, per-cell atomic results, resume.

Layout of ``runs/<command>/<timestamp>/`` (or ``out=DIR``)::

    .lock           held by the owning process for the life of the run (:mod:`poslsh_cli.store.ownership`)
    config.yaml     resolved configuration (the same command + config resumes)
    meta.json       argv, root seed, git commit, package versions, device, wall time, status, and
                    the history of earlier sessions (one that died is recorded as such)
    cells/          one JSON file per finished cell (its key, rows, grid index), written atomically:
                    the source of truth for every table
    results.csv     every finished cell's rows, in grid order; rewritten atomically by the owner as
                    cells finish and at the end; a reader that finds it disagreeing with cells/
                    reads the cells instead and writes nothing (:func:`results`)
    <aux>.csv       extra tables some experiments keep (e.g. block_lengths.csv), also from cells/
    work/<cell>/    a long cell's own directory (:mod:`poslsh_cli.store.cellwork`)
    figures/        written by ``poslsh plot``

A cell is one parameter combination and trial. A run killed at any point leaves only whole
cells behind (and, inside a long cell, whole checkpoints); started again with the same ``out=``
it computes only the missing cells and continues a started one from its checkpoint.
"""
from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import platform
import re
import shutil
import tempfile
from contextlib import contextmanager
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

from poslsh_cli.store import ownership
from poslsh_cli.store.cellwork import CellWork
from poslsh_cli.store.provenance import device_info, git_commit, package_versions
from poslsh_cli.store.readers import frames_of, read_cells, read_config_text, read_json
from poslsh_cli.core.config import override_text
from poslsh_cli.core.errors import ConfigError
from poslsh_cli.core.files import TMP_PREFIX, atomic_write_text, fault_point, remove_stale_temporaries

#: Keys that do not change any result: a run resumes when only these differ.
RESUME_IGNORED = ("out", "memory_check")
#: List keys a run grows by: values appended add cells and leave the finished ones as they are (training seeds).
GROWABLE = ("seed",)
#: Keys that choose which schemes train the seeds past the first ``first_seeds``: set with seeds appended, they
#: may change while every seed the run held stays within the seeds every scheme trains (its cells unchanged).
SEED_SELECTORS = ("all_seeds", "first_seeds")


def timestamp() -> str:
    return _dt.datetime.now().strftime("%Y-%m-%d_%H-%M-%S")


def reserve_default(root: Path, stamp: Optional[str] = None) -> tuple[Path, Path]:
    """A new, empty run directory ``root/<timestamp>`` (``-2``, ``-3``, ... after it when another
    launch took that second): ``mkdir`` is atomic, so launches in the same second never share one.
    Returns (the directory, the highest directory this call created, for
    :func:`remove_created`)."""
    root = Path(root).resolve()
    top = missing_top(root)
    root.mkdir(parents=True, exist_ok=True)
    stamp = stamp or timestamp()
    k = 1
    while True:
        path = root / (stamp if k == 1 else f"{stamp}-{k}")
        try:
            path.mkdir()
        except FileExistsError:
            k += 1
            continue
        return path, top or path


def check_writable(out: Path) -> None:
    """Refuse an ``out=`` that cannot be created or written, before anything is written."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"out={out} exists and is not a directory")
    probe = out
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        raise ConfigError(f"out={out}: {probe} is not a directory")
    try:
        tmp = tempfile.mkdtemp(prefix=".poslsh-probe-", dir=probe)
        os.rmdir(tmp)
    except OSError as exc:
        raise ConfigError(f"out={out} is not writable ({exc.strerror})") from None


def missing_top(path: Path) -> Optional[Path]:
    """The highest ancestor of ``path`` (or ``path`` itself) that does not exist yet: what creating
    ``path`` creates, and what to remove again when nothing was made there."""
    path = Path(path).resolve()
    top = None
    while not path.exists():
        top, path = path, path.parent
    return top


def remove_created(path: Path, top: Optional[Path]) -> None:
    """Remove the now empty directories from ``path`` up to ``top`` (see :func:`missing_top`)."""
    if top is None:
        return
    p = Path(path).resolve()
    top = Path(top).resolve()
    while True:
        try:
            p.rmdir()
        except OSError:
            return
        if p == top or top not in p.parents:
            return
        p = p.parent


def _jsonable(x: Any) -> Any:
    if is_dataclass(x):
        return asdict(x)
    if hasattr(x, "item"):
        return x.item()
    if isinstance(x, tuple):
        return list(x)
    raise TypeError(f"not JSON serialisable: {type(x)}")


def cell_id(key: dict[str, Any]) -> str:
    text = json.dumps(key, sort_keys=True, default=_jsonable)
    return hashlib.sha1(text.encode()).hexdigest()[:16]


def _config_body(yaml_text: str) -> str:
    return "\n".join(line for line in yaml_text.splitlines() if not line.split(":", 1)[0] in RESUME_IGNORED)


def _flat_config(text: str) -> dict[str, Any]:
    """A configuration's keys, nested ones dotted, the keys resuming ignores left out."""
    import yaml

    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError:
        return {}
    out: dict[str, Any] = {}

    def walk(prefix: str, x: Any) -> None:
        if isinstance(x, dict) and x:
            for k, v in x.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        else:
            out[prefix] = x
    walk("", data if isinstance(data, dict) else {})
    return {k: v for k, v in out.items() if k.split(".")[0] not in RESUME_IGNORED}


def migrate_config(held: dict[str, Any], defaults: dict[str, Any], wanted: dict[str, Any]) -> dict[str, Any]:
    """A held configuration (flat) in today's layout, the one place older run directories are read as
    current: an enum member stored by its name (``ALIBI``) reads as its value where that value is
    asked for (``alibi``; a file named ``README`` asked for as ``README`` stays as it is); a key the command
    gained after the run was made (one asked for, with a default, that the run lacks) takes its
    default, so those runs resume and evaluate as before."""
    def value(x: Any) -> Any:
        if isinstance(x, list):
            return [value(v) for v in x]
        return x.lower() if isinstance(x, str) and re.fullmatch(r"[A-Z][A-Z0-9_]*", x) else x

    out = {k: value(v) if k in wanted and _same_value(value(v), wanted[k]) else v for k, v in held.items()}
    return {**out, **{k: defaults[k] for k in wanted if k not in out and k in defaults}}


def _same_value(a: Any, b: Any) -> bool:
    """One value written two ways counts once: ``v`` and ``[v]`` (a key that became a list sweep)."""
    return a == b or [a] == b or a == [b]


def config_changes(held: str, wanted: str, defaults: Optional[dict[str, Any]] = None) -> list[str]:
    """What differs between the configuration a run directory holds (read through
    :func:`migrate_config`) and the one asked for, key by key (nested keys dotted, the keys resuming
    ignores left out): ``["steps: 4000 -> 150"]``; a value and the one-element list of it are the same."""
    raw, b = _flat_config(held), _flat_config(wanted)
    a = migrate_config(raw, defaults or {}, b)

    def show(x: Any) -> str:
        if x is _ABSENT:
            return "(not set)"
        if isinstance(x, list):
            return "[" + ", ".join(show(v) for v in x) + "]"
        return "null" if x is None else str(x).lower() if isinstance(x, bool) else str(x)

    keys = list(a) + [k for k in b if k not in a]
    return [f"{k}: {show(raw.get(k, _ABSENT))} -> {show(b.get(k, _ABSENT))}" for k in keys
            if not _same_value(a.get(k, _ABSENT), b.get(k, _ABSENT))]


_ABSENT = object()


def grown(held: str, wanted: str) -> dict[str, list]:
    """The :data:`GROWABLE` keys whose held list the wanted one extends, and by what: ``{"seed": [3, 4]}``;
    with the arguments swapped, the keys a run grew by past the list asked for."""
    a, b = _flat_config(held), _flat_config(wanted)
    out: dict[str, list] = {}
    for k in GROWABLE:
        x, y = ([v] if v is not None and not isinstance(v, list) else v for v in (a.get(k), b.get(k)))
        if isinstance(x, list) and isinstance(y, list) and len(y) > len(x) and y[:len(x)] == x:
            out[k] = y[len(x):]
    return out


def selects_only_added(held: str, wanted: str, defaults: Optional[dict[str, Any]] = None) -> bool:
    """Whether the :data:`SEED_SELECTORS` asked for leave the held seeds' cells as they are: the held
    run trained every scheme with each of its seeds, and so does the run asked for."""
    a, b = _flat_config(held), _flat_config(wanted)
    defaults = defaults or {}
    seeds = a.get("seed")
    n = len(seeds) if isinstance(seeds, list) else 1

    def full(c: dict) -> bool:
        return c.get("all_seeds", defaults.get("all_seeds")) is None or n <= int(c.get("first_seeds", defaults.get(
            "first_seeds", 1)))
    return full(a) and full(b)


def _grown_hint(held: str, wanted: str, changes: list[str]) -> str:
    """Where the run holds a longer list than asked for (a command added seeds to it, perhaps
    interrupted before their cells) and nothing else differs: how to resume it."""
    longer = grown(wanted, held)
    free = [*longer, *(SEED_SELECTORS if "seed" in longer else ())]
    if not longer or any(c.split(":", 1)[0] not in free for c in changes):
        return ""
    flat = _flat_config(held)
    full = {k: v if isinstance(v, list) else [v] for k, v in flat.items() if k in longer}
    keys = [f"{k}=[{','.join(map(str, full[k]))}]" for k in longer]
    keys += [f"{k}={override_text(flat.get(k))}" for k in SEED_SELECTORS
             if k in flat and any(c.split(":", 1)[0] == k for c in changes)]
    return "".join(f"; it holds {k}={full[k]}, {longer[k]} beyond the list asked for" for k in longer) + \
        f": resume with '{' '.join(keys)}'"



class RunDir:
    """One run directory. :meth:`open` checks it without writing; :meth:`own` makes this process
    its owner (creating it) for the run; only the owner writes."""

    def __init__(self, path: Path, command: str, config_yaml: str, defaults: Optional[dict[str, Any]] = None):
        self.path = Path(path)
        self.command = command
        self.config_yaml = config_yaml
        self.defaults = defaults or {}
        self.fresh = True
        self.grown: dict[str, list] = {}  # resuming with more seeds: the values added (:func:`grown`)
        self.cells_dir = self.path / "cells"
        self.meta: dict[str, Any] = {}
        self._created: Optional[Path] = None
        self._done: Optional[dict[str, dict]] = None  # the owner's finished cells, read from disk once

    @classmethod
    def open(cls, path: Path, command: str, config_yaml: str, defaults: Optional[dict[str, Any]] = None) -> "RunDir":
        """Check that ``path`` can hold this run (new, or the same configuration to resume, seeds added
        allowed: :func:`config_changes`, :func:`grown`) and that no live process owns it; writes nothing."""
        run = cls(path, command, config_yaml, defaults)
        run._check()
        ownership.check_free(run.path)
        return run

    def _check(self) -> None:
        cfg_file = self.path / "config.yaml"
        if cfg_file.exists():
            held = read_config_text(cfg_file)
            other = self._other_command()
            if other:
                raise ConfigError(f"out={self.path} holds a poslsh {other} run, not a {self.command} run; use another "
                                  "out=")
            if _config_body(held) != _config_body(self.config_yaml):
                if not _flat_config(held):  # cut, emptied or not YAML: say so, not "a different configuration"
                    raise ConfigError(f"{cfg_file} cannot be read as a poslsh configuration (empty, cut or malformed "
                                      "YAML): restore it, move the directory away or use another out=")
                self.grown = grown(held, self.config_yaml)
                free = [*self.grown, *(SEED_SELECTORS if "seed" in self.grown
                                       and selects_only_added(held, self.config_yaml, self.defaults) else ())]
                changes = [c for c in config_changes(held, self.config_yaml, self.defaults)
                           if c.split(":", 1)[0] not in free]
                if changes or not _flat_config(held):
                    raise ConfigError(f"out={self.path} holds a run with a different configuration"
                                      + (f" ({'; '.join(changes)})" if changes else "")
                                      + (_grown_hint(held, self.config_yaml, changes)
                                         or "; use another out= (or the same keys to resume)"))
            self.fresh = False
            return
        # a reproduce marker (skipped.json) and the lock do not count: the run replaces them
        if self.path.exists() and any(p for p in self.path.iterdir() if not p.name.startswith(".")
                                      and p.name != "skipped.json"):
            raise ConfigError(f"out={self.path} exists, is not empty and holds no poslsh run")
        self.fresh = True

    def _other_command(self) -> str:
        """The command that made the run held here, when it is not this one (from its meta.json)."""
        meta, _ = read_json(self.path / "meta.json")
        held = meta.get("command") if isinstance(meta, dict) else None
        return held if isinstance(held, str) and held and held != self.command else ""

    @contextmanager
    def own(self, argv: str) -> Iterator["RunDir"]:
        """Own the directory for the block: create it, take its lock (:class:`ownership.RunBusy`
        if another process got there first), check it again under the lock, and remove what a
        killed session left half-written."""
        top = missing_top(self.path)
        ownership.acquire(self.path, argv)
        try:
            self._created = top
            self._check()
            remove_stale_temporaries(self.path)
            yield self
        finally:
            ownership.release(self.path)

    def start(self, argv: str, seed: int, cells_total: int, notice: Callable[[str], None] = print) -> None:
        """Write config.yaml (new or grown runs) and this session's meta.json; a previous session still
        ``running`` there died (its lock is free now), and is recorded as such."""
        self.cells_dir.mkdir(parents=True, exist_ok=True)
        if self.fresh or self.grown:
            atomic_write_text(self.path / "config.yaml", self.config_yaml)
        for k, added in self.grown.items():
            notice(f"{self.path}: {k} {', '.join(map(str, added))} added; the finished cells stay")
        old, why = read_json(self.path / "meta.json")
        if not isinstance(old, dict):
            if not self.fresh:
                notice(f"{self.path / 'meta.json'} was unreadable ({why}); started a new one")
            old = {}
        history = list(old.get("history", []))
        if old:
            prev = {k: old.get(k) for k in ("sessions", "status", "cells_done", "error", "pid", "host")}
            if old.get("status") == "running":
                prev["status"] = "died"
                prev["error"] = "the process ended without finishing (killed, or out of memory)"
                notice(f"the previous session of {self.path} (pid {old.get('pid')}) died without finishing; "
                       "resuming")
            history.append(prev)
        self.meta = {
            "command": self.command,
            "argv": argv,
            "seed": seed,
            "git": git_commit(),
            "versions": package_versions(),
            "device": device_info(),
            "pid": os.getpid(),
            "host": platform.node(),
            "started": old.get("started", _dt.datetime.now().isoformat(timespec="seconds")),
            "wall_seconds": float(old.get("wall_seconds", 0.0)),
            "sessions": int(old.get("sessions", 0)) + 1,
            "status": "running",
            "cells_total": cells_total,
            "cells_done": len(self.done_ids()),
            "history": history,
            "grown": [*old.get("grown", []), *([self.grown] if self.grown else [])],  # what sessions appended
        }
        self._t0 = _dt.datetime.now()
        self._wall0 = self.meta["wall_seconds"]
        self.write_meta()

    def write_meta(self, **updates: Any) -> None:
        self.meta.update(updates)
        if hasattr(self, "_t0"):
            self.meta["wall_seconds"] = round(self._wall0 + (_dt.datetime.now() - self._t0).total_seconds(), 3)
        atomic_write_text(self.path / "meta.json", json.dumps(self.meta, indent=2, default=_jsonable) + "\n")

    def work(self, key: dict[str, Any], progress: Callable[[int, int, str], None] | None = None,
             notice: Callable[[str], None] | None = None) -> CellWork:
        """The working directory of one cell (see :class:`~poslsh_cli.store.cellwork.CellWork`)."""
        extra = {k: v for k, v in (("progress", progress), ("notice", notice)) if v is not None}
        return CellWork(self.path / "work" / work_name(key), **extra)

    def cells(self) -> tuple[dict[str, dict], list[tuple[Path, str]]]:
        """Finished cells by id, and the cell files that cannot be read (path, why)."""
        return read_cells(self.cells_dir)

    def finished(self) -> dict[str, dict]:
        """Finished cells by id. The owner reads cells/ once and then adds each cell it writes
        (only the owner writes cells), so a run of N cells reads N files, not N^2/2."""
        if self._done is None:
            self._done = self.cells()[0]
        return self._done

    def done_ids(self) -> set[str]:
        return set(self.finished())

    def drop_unreadable_cells(self, notice: Callable[[str], None]) -> None:
        """(Owner only) a cell file that cannot be read is not finished: remove it, say so."""
        self._done = None
        for path, why in self.cells()[1]:
            notice(f"{path} is unreadable ({why}); the cell will be computed again")
            path.unlink(missing_ok=True)

    def write_cell(self, key: dict[str, Any], rows: list[dict[str, Any]], aux: dict[str, list[dict]] | None = None,
                   index: int | None = None) -> None:
        payload = {"key": key, "rows": rows, "aux": aux or {}, "index": index}
        text = json.dumps(payload, default=_jsonable)
        atomic_write_text(self.cells_dir / f"{cell_id(key)}.json", text + "\n")
        self.finished()[cell_id(key)] = json.loads(text)  # as a reader of the file would see it
        fault_point("cell")

    def write_tables(self, keys: list[dict[str, Any]], columns: list[str]) -> int:
        """Rewrite results.csv (and aux tables) from the finished cells, in grid order."""
        done = self.finished()
        cells = [done[cell_id(k)] for k in keys if cell_id(k) in done]
        _write_tables(self.path, cells, columns)
        return len(cells)

    def holds_work(self) -> bool:
        """Whether the directory holds anything a later session needs: a finished cell, or any file
        below ``work/`` (a checkpoint, a metrics log, a shared stage), temporaries aside."""
        if self.done_ids():
            return True
        work = self.path / "work"
        return work.is_dir() and any(p.is_file() and not any(part.startswith(TMP_PREFIX) for part in p.parts)
                                     for p in work.rglob("*"))

    def discard_if_empty(self) -> bool:
        """(Owner only) after a failure or an interrupt: remove a run this session created when it holds no
        work yet (:meth:`holds_work`), and the directories created above it; never one with work. True when removed."""
        if not self.fresh or not ownership.owns(self.path) or self.holds_work():
            return False
        shutil.rmtree(self.path, ignore_errors=True)
        remove_created(self.path.parent, self._created)
        return True


def _write_tables(path: Path, cells: list[dict], columns: list[str]) -> None:
    text, aux = frames_of(cells, columns)
    atomic_write_text(path / "results.csv", text)
    for name, t in aux.items():
        atomic_write_text(path / f"{name}.csv", t)


def work_name(key: dict[str, Any]) -> str:
    """A readable directory name for a cell: ``position-poslsh_s-10_seed-0-<id>`` (no ``=``, so the
    path can be passed as an override value)."""
    text = "_".join(f"{k}-{v}" for k, v in key.items())
    return re.sub(r"[^A-Za-z0-9.,+-]+", "_", text)[:120] + "-" + cell_id(key)[:6]


__all__ = ["RunDir", "atomic_write_text", "check_writable", "reserve_default", "timestamp", "cell_id", "work_name",
           "missing_top", "remove_created"]
