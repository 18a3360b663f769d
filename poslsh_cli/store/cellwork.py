"""A long cell's own working directory (training): an append-only metrics log, verified step
checkpoints, the final model, and the places a sweep's cells share.

Layout of ``<run>/work/<cell>/``::

    metrics.csv                 one line per step, appended and flushed; a line cut by a kill is
                                dropped when the log is opened again
    checkpoints/step-NNNNNNNN/  written whole (files, then manifest.json, then a rename)
    final/                      the finished model, written the same way

A shared stage of a sweep (the pretrained model every fine-tuning cell starts from) lives in
``<run>/work/<name>/`` beside the cells (:meth:`CellWork.shared`).
"""
from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from poslsh_cli.core.errors import ConfigError
from poslsh_cli.core.files import atomic_write_bytes, atomic_write_text, verify_dir, write_dir


def _say_nothing(text: str) -> None:
    return None


class MetricsLog:
    """An append-only CSV log (one row per training step or event) that survives being killed.

    ``append`` writes one whole line and flushes it to disk; a line cut short by a kill is dropped
    when the log is opened again (and ignored by :meth:`frame` while another process writes it).
    The header is fixed by the first row written (later rows may leave columns empty).
    ``truncate_after(column, value)`` keeps only rows with ``row[column] <= value``: a stage that
    (re)starts from step t calls it with t (0 when starting from scratch), so the log never holds
    a step twice, whatever the kill point.
    """

    def __init__(self, path: Path, columns: list[str]):
        self.path = Path(path)
        self.columns = list(columns)
        self._drop_partial_line()
        self._widen_header()

    def _widen_header(self) -> None:
        """A log written with fewer columns (an older version) gets the new ones, empty in its rows,
        so appended rows stay aligned with the header."""
        if not self.path.exists() or not self.path.stat().st_size:
            return
        with open(self.path, encoding="utf-8") as fh:
            header = fh.readline().rstrip("\n").split(",")
        if header == self.columns or not set(header) <= set(self.columns):
            return
        df = self.frame()
        atomic_write_text(self.path, df.reindex(columns=self.columns).to_csv(index=False))

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
        return read_log(self.path, self.columns)

    def truncate_after(self, column: str, value: float) -> None:
        df = self.frame()
        if len(df) and (df[column] > value).any():
            atomic_write_text(self.path, df[df[column] <= value].to_csv(index=False))


class NullLog:
    """The metrics log of a rank that does not write (a distributed run's ranks other than 0)."""

    def __init__(self, columns: list[str]):
        self.columns = list(columns)

    def append(self, row: dict[str, Any]) -> None:
        return None

    def frame(self) -> Any:
        import pandas as pd

        return pd.DataFrame(columns=self.columns)

    def truncate_after(self, column: str, value: float) -> None:
        return None


def read_log(path: Path, columns: Optional[list[str]] = None) -> Any:
    """A metrics log as a DataFrame, without a last line that is still being written."""
    import io

    import pandas as pd

    path = Path(path)
    data = path.read_bytes() if path.exists() else b""
    data = data[: data.rfind(b"\n") + 1]
    if not data.strip():
        return pd.DataFrame(columns=columns or [])
    return pd.read_csv(io.BytesIO(data))


class Checkpoints:
    """Step checkpoints ``<root>/step-NNNNNNNN/``, each written whole with a manifest
    (:func:`poslsh_cli.core.files.write_dir`) and verified before it is trusted."""

    def __init__(self, root: Path, notice: Callable[[str], None] = _say_nothing):
        self.root = Path(root)
        self.notice = notice

    @staticmethod
    def name(step: int) -> str:
        return f"step-{int(step):08d}"

    def save(self, step: int, write: Callable[[Path], None], keep: int | None = None) -> Path:
        """``write(tmp_dir)`` fills the checkpoint; then it becomes ``step-NNNNNNNN``. With ``keep``,
        older checkpoints beyond the newest ``keep`` are removed."""
        final = write_dir(self.root / self.name(step), write)
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
        """The newest complete checkpoint. Incomplete or corrupt ones (checked against their
        manifest) are named in one notice each and skipped; when checkpoints exist but none is
        usable, one error names the newest and why."""
        found = self.all()
        bad = []
        for step, path in reversed(found):
            why = verify_dir(path)
            if why is None:
                for b, reason in bad:
                    self.notice(f"checkpoint {b} is unusable ({reason}); resuming from {path.name}")
                return step, path
            bad.append((path, why))
        if bad:
            raise ConfigError(f"no usable checkpoint in {self.root}: {bad[0][1]}; remove {self.root.parent} to "
                              "train this cell again from the start")
        return None


@dataclass(frozen=True)
class CellWork:
    """A cell's own working directory ``<run>/work/<cell>/`` (created on first use), a progress
    callback ``progress(done, total, text)`` the runner shows under its bar, and ``notice(text)``
    for one-line messages (a checkpoint skipped, a file rebuilt)."""

    path: Path
    progress: Callable[[int, int, str], None] = lambda done, total, text: None
    notice: Callable[[str], None] = field(default=_say_nothing)
    #: False for the ranks of a distributed run other than 0: they read, never write
    writer: bool = True

    def metrics(self, columns: list[str], name: str = "metrics.csv") -> "MetricsLog | NullLog":
        return MetricsLog(self.path / name, columns) if self.writer else NullLog(columns)

    def checkpoints(self) -> Checkpoints:
        return Checkpoints(self.path / "checkpoints", self.notice)

    @property
    def final(self) -> Path:
        """Where the cell's finished model goes (written whole, see :meth:`finished`)."""
        return self.path / "final"

    def finished(self) -> Optional[Path]:
        """``final/`` when it is complete and verified; a corrupt one is removed (it is derived from
        the checkpoints and is written again) with a notice."""
        if not self.final.exists():
            return None
        why = verify_dir(self.final)
        if why is None:
            return self.final
        if not self.writer:
            return None
        self.notice(f"{self.final} is unusable ({why}); it will be written again")
        shutil.rmtree(self.final, ignore_errors=True)
        return None

    def shared(self, name: str) -> "CellWork":
        """A stage several cells of the run share (e.g. ``pretrain-rope-seed0``), beside the cells."""
        return CellWork(self.path.parent / name, self.progress, self.notice, self.writer)

    def relative(self, path: Path) -> str:
        """``path`` relative to the run directory (what results.csv records)."""
        return str(Path(path).relative_to(self.path.parent.parent))
