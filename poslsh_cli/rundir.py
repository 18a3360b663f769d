"""Run directories: resolved config, provenance, per-cell atomic results, resume.

Layout of ``runs/<command>/<timestamp>/`` (or ``out=DIR``)::

    config.yaml     resolved configuration (the same command + config resumes)
    meta.json       argv, root seed, git commit, package versions, device, wall time, status
    cells/          one JSON file per finished cell, written atomically (tmp + rename)
    results.csv     every finished cell's rows, in grid order; rewritten atomically per cell
    <aux>.csv       extra tables some experiments keep (e.g. block_lengths.csv)
    work/<cell>/    a long cell's own directory (training): an append-only metrics.csv and
                    checkpoints/step-NNNNNNNN/, so the cell itself resumes from its last step
    figures/        written by ``poslsh plot``

A cell is one parameter combination and trial. A run killed at any point leaves only whole
cells behind (and, inside a long cell, whole checkpoints); started again with the same
``out=`` it computes only the missing cells and continues a started one from its checkpoint.
"""
from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import asdict, dataclass, is_dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

from poslsh_cli.config import ConfigError


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file and a rename: readers see the old file
    or the new one, never a part. The file gets the usual mode (0666 less the umask), not the
    0600 of a temporary file."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def timestamp() -> str:
    return _dt.datetime.now().strftime("%Y-%m-%d_%H-%M-%S")


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


def git_commit() -> dict[str, Any]:
    """Commit of the poslsh source tree, when it is a git checkout."""
    here = Path(__file__).resolve().parent
    try:
        commit = subprocess.run(["git", "-C", str(here), "rev-parse", "HEAD"], capture_output=True,
                                text=True, timeout=5, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(here), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=5, check=True).stdout.strip()
        return {"commit": commit, "dirty": bool(dirty)}
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}


def package_versions() -> dict[str, str | None]:
    from importlib import metadata

    out: dict[str, str | None] = {"python": platform.python_version()}
    for name in ("poslsh", "numpy", "scipy", "torch", "pandas", "hydra-core", "omegaconf",
                 "transformers", "matplotlib", "typer"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def device_info() -> dict[str, Any]:
    info: dict[str, Any] = {"platform": platform.platform(), "machine": platform.machine(),
                            "cpu_count": os.cpu_count()}
    try:
        import torch

        info["torch_threads"] = torch.get_num_threads()
        if torch.cuda.is_available():
            info["cuda"] = torch.cuda.get_device_name(0)
    except Exception:  # torch is optional for the matrix experiments
        pass
    return info


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


class RunDir:
    """One run directory. Create with :meth:`open`; it refuses to mix configurations."""

    def __init__(self, path: Path, command: str, config_yaml: str, fresh: bool):
        self.path = Path(path)
        self.command = command
        self.config_yaml = config_yaml
        self.fresh = fresh
        self.cells_dir = self.path / "cells"
        self.meta: dict[str, Any] = {}

    @classmethod
    def open(cls, path: Path, command: str, config_yaml: str) -> "RunDir":
        path = Path(path)
        cfg_file = path / "config.yaml"
        if cfg_file.exists():
            old = cfg_file.read_text()
            if _strip_out(old) != _strip_out(config_yaml):
                raise ConfigError(f"out={path} holds a run with a different configuration; "
                                  "use another out= (or the same keys to resume)")
            fresh = False
        else:
            # a reproduce marker (skipped.json) does not count: the run replaces it
            if path.exists() and any(p for p in path.iterdir() if not p.name.startswith(".") and p.name != "skipped.json"):
                raise ConfigError(f"out={path} exists, is not empty and holds no poslsh run")
            fresh = True
        return cls(path, command, config_yaml, fresh)

    def start(self, argv: list[str], seed: int, cells_total: int) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        self.cells_dir.mkdir(exist_ok=True)
        if self.fresh:
            atomic_write_text(self.path / "config.yaml", self.config_yaml)
        old = self._read_meta()
        self.meta = {
            "command": self.command,
            "argv": argv,
            "seed": seed,
            "git": git_commit(),
            "versions": package_versions(),
            "device": device_info(),
            "started": old.get("started", _dt.datetime.now().isoformat(timespec="seconds")),
            "wall_seconds": float(old.get("wall_seconds", 0.0)),
            "sessions": int(old.get("sessions", 0)) + 1,
            "status": "running",
            "cells_total": cells_total,
            "cells_done": len(self.done_ids()),
        }
        self._t0 = _dt.datetime.now()
        self._wall0 = self.meta["wall_seconds"]
        self.write_meta()

    def _read_meta(self) -> dict[str, Any]:
        try:
            return json.loads((self.path / "meta.json").read_text())
        except (OSError, ValueError):
            return {}

    def write_meta(self, **updates: Any) -> None:
        self.meta.update(updates)
        if hasattr(self, "_t0"):
            self.meta["wall_seconds"] = round(self._wall0 + (_dt.datetime.now() - self._t0).total_seconds(), 3)
        atomic_write_text(self.path / "meta.json", json.dumps(self.meta, indent=2, default=_jsonable) + "\n")

    def work(self, key: dict[str, Any], progress: Callable[[int, int, str], None] | None = None) -> CellWork:
        """The working directory of one cell (see :class:`CellWork`)."""
        path = self.path / "work" / work_name(key)
        return CellWork(path, progress) if progress is not None else CellWork(path)

    def done_ids(self) -> set[str]:
        if not self.cells_dir.exists():
            return set()
        return {p.stem for p in self.cells_dir.glob("*.json")}

    def write_cell(self, key: dict[str, Any], rows: list[dict[str, Any]], aux: dict[str, list[dict]] | None = None) -> None:
        payload = {"key": key, "rows": rows, "aux": aux or {}}
        atomic_write_text(self.cells_dir / f"{cell_id(key)}.json",
                          json.dumps(payload, default=_jsonable) + "\n")

    def read_cells(self, keys: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
        """Finished cells among ``keys``, in that order."""
        out = []
        for key in keys:
            p = self.cells_dir / f"{cell_id(key)}.json"
            if p.exists():
                out.append(json.loads(p.read_text()))
        return out

    def write_tables(self, keys: list[dict[str, Any]], columns: list[str]) -> int:
        """Rewrite results.csv (and aux tables) from the finished cells, in grid order."""
        import pandas as pd

        cells = self.read_cells(keys)
        rows = [r for c in cells for r in c["rows"]]
        df = pd.DataFrame(rows)
        if df.empty:
            df = pd.DataFrame(columns=columns)
        extra = [c for c in df.columns if c not in columns]
        df = df[[c for c in columns if c in df.columns] + extra]
        atomic_write_text(self.path / "results.csv", df.to_csv(index=False))
        aux_names = sorted({n for c in cells for n in c["aux"]})
        for name in aux_names:
            aux_rows = [r for c in cells for r in c["aux"].get(name, [])]
            atomic_write_text(self.path / f"{name}.csv", pd.DataFrame(aux_rows).to_csv(index=False))
        return len(cells)

    def discard_if_empty(self) -> None:
        """After a failure before any cell finished: leave nothing half-written behind."""
        if self.fresh and not self.done_ids():
            shutil.rmtree(self.path, ignore_errors=True)


class MetricsLog:
    """An append-only CSV log (one row per training step or event) that survives being killed.

    ``append`` writes one whole line and flushes it to disk; a line cut short by a kill is
    dropped when the log is opened again. The header is fixed by the first row written (later
    rows may leave columns empty). ``truncate_after(column, value)`` keeps only rows with
    ``row[column] <= value``: on resume from a checkpoint the steps after it are recomputed,
    so the log never holds a step twice.
    """

    def __init__(self, path: Path, columns: list[str]):
        self.path = Path(path)
        self.columns = list(columns)
        self._drop_partial_line()

    def _drop_partial_line(self) -> None:
        if not self.path.exists():
            return
        data = self.path.read_bytes()
        if data and not data.endswith(b"\n"):
            atomic_write_bytes(self.path, data[: data.rfind(b"\n") + 1])

    def append(self, row: dict[str, Any]) -> None:
        import csv
        import io

        new = not self.path.exists() or self.path.stat().st_size == 0
        buf = io.StringIO()
        w = csv.DictWriter(buf, fieldnames=self.columns, extrasaction="raise", lineterminator="\n")
        if new:
            w.writeheader()
        w.writerow({k: ("" if v is None else v) for k, v in row.items()})
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a", encoding="utf-8") as fh:
            fh.write(buf.getvalue())
            fh.flush()
            os.fsync(fh.fileno())

    def frame(self) -> Any:
        import pandas as pd

        if not self.path.exists() or self.path.stat().st_size == 0:
            return pd.DataFrame(columns=self.columns)
        return pd.read_csv(self.path)

    def truncate_after(self, column: str, value: float) -> None:
        df = self.frame()
        if len(df) and (df[column] > value).any():
            atomic_write_text(self.path, df[df[column] <= value].to_csv(index=False))


class Checkpoints:
    """Step checkpoints ``<root>/step-NNNNNNNN/``: each is written into a temporary directory and
    renamed into place, so a kill during a save leaves the previous checkpoint as the latest."""

    def __init__(self, root: Path):
        self.root = Path(root)

    @staticmethod
    def name(step: int) -> str:
        return f"step-{int(step):08d}"

    def save(self, step: int, write: Callable[[Path], None], keep: int | None = None) -> Path:
        """``write(tmp_dir)`` fills the checkpoint; then it becomes ``step-NNNNNNNN``. With ``keep``,
        older checkpoints beyond the newest ``keep`` are removed."""
        self.root.mkdir(parents=True, exist_ok=True)
        final = self.root / self.name(step)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=self.root))
        try:
            write(tmp)
            os.chmod(tmp, 0o777 & ~_umask())
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        if keep is not None:
            for _, old in self.all()[:-keep]:
                shutil.rmtree(old, ignore_errors=True)
        return final

    def all(self) -> list[tuple[int, Path]]:
        if not self.root.exists():
            return []
        out = []
        for p in self.root.iterdir():
            if p.is_dir() and p.name.startswith("step-") and p.name[5:].isdigit():
                out.append((int(p.name[5:]), p))
        return sorted(out)

    def latest(self) -> tuple[int, Path] | None:
        found = self.all()
        return found[-1] if found else None


def work_name(key: dict[str, Any]) -> str:
    """A readable directory name for a cell: ``position-poslsh_s-10_seed-0-<id>`` (no ``=``, so the
    path can be passed as an override value)."""
    import re

    text = "_".join(f"{k}-{v}" for k, v in key.items())
    return re.sub(r"[^A-Za-z0-9.,+-]+", "_", text)[:120] + "-" + cell_id(key)[:6]


@dataclass(frozen=True)
class CellWork:
    """A cell's own working directory ``<run>/work/<cell>/`` (created on first use) and a
    progress callback ``progress(done, total, text)`` the runner shows under its bar."""

    path: Path
    progress: Callable[[int, int, str], None] = lambda done, total, text: None

    def metrics(self, columns: list[str], name: str = "metrics.csv") -> MetricsLog:
        return MetricsLog(self.path / name, columns)

    def checkpoints(self) -> Checkpoints:
        return Checkpoints(self.path / "checkpoints")


def _strip_out(yaml_text: str) -> str:
    return "\n".join(line for line in yaml_text.splitlines() if not line.startswith("out:"))


def load_run(path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(config, meta) of a finished or partial run directory."""
    import yaml

    path = Path(path)
    if not (path / "config.yaml").exists():
        raise ConfigError(f"{path} is not a poslsh run directory (no config.yaml)")
    cfg = yaml.safe_load((path / "config.yaml").read_text()) or {}
    try:
        meta = json.loads((path / "meta.json").read_text())
    except (OSError, ValueError):
        meta = {}
    return cfg, meta


def find_runs(paths: Iterable[Path]) -> list[Path]:
    """Run directories at or below each path (a multirun sweep holds one per job)."""
    out: list[Path] = []
    for p in paths:
        p = Path(p)
        if (p / "config.yaml").exists():
            out.append(p)
        elif p.is_dir():
            found = sorted(q.parent for q in p.rglob("config.yaml") if (q.parent / "meta.json").exists())
            if not found:
                raise ConfigError(f"{p} holds no poslsh run (no config.yaml below it)")
            out.extend(found)
        else:
            raise ConfigError(f"{p} does not exist")
    return out


__all__ = ["RunDir", "MetricsLog", "Checkpoints", "CellWork", "atomic_write_text", "atomic_write_bytes",
           "check_writable", "timestamp", "load_run", "find_runs", "cell_id", "work_name"]
