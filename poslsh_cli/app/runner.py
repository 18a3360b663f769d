"""Run one experiment into a run directory: the side-effect layer.

:func:`execute` takes an :class:`~poslsh_cli.experiments.base.Experiment` and its validated spec,
walks the cells that are not finished yet, writes each atomically as it finishes, and prints
progress (rich on a terminal, plain lines otherwise) and a summary table. Ctrl-C / SIGTERM stop
between cells' writes: every finished cell stays, and the same command with the same ``out=``
resumes. Errors are raised (ConfigError for bad input, RunFailed for anything else, after the
run directory says so); the command line turns them into one line.
"""
from __future__ import annotations

import contextlib
import re
import sys
import time
from pathlib import Path
from typing import Any

from poslsh_cli.core.errors import ConfigError
from poslsh_cli.experiments.base import Experiment, check_memory
from poslsh_cli.core import distributed as dist
from poslsh_cli.core.files import atomic_write_bytes
from poslsh_cli.store.cellwork import CellWork
from poslsh_cli.store.readers import results
from poslsh_cli.store.rundir import RunDir, cell_id, work_name

#: Exit codes of a stopped run (128 + the signal, the shell's convention): Ctrl-C, SIGTERM.
INTERRUPTED, TERMINATED = 130, 143


class Terminated(KeyboardInterrupt):
    """SIGTERM (a cancelled or preempted job), raised where Ctrl-C raises KeyboardInterrupt: the
    same stop, its own exit code."""


def stopped_code(exc: KeyboardInterrupt) -> int:
    """The exit code of a run stopped by ``exc``: 143 after SIGTERM, 130 after Ctrl-C."""
    return TERMINATED if isinstance(exc, Terminated) else INTERRUPTED


class RunFailed(RuntimeError):
    """An unexpected failure inside a cell; finished cells are kept."""


@contextlib.contextmanager
def waiting(text: str) -> Any:
    """A spinner on a terminal's stderr while a silent step runs (loading data or a model, tens of
    seconds on a busy machine). Off a terminal nothing: a line there could stand beside a refusal that
    the step raises, and a refusal is one line."""
    err = console()
    if not err.is_terminal:
        yield
        return
    with err.status(text, spinner="dots"):
        yield


def console(stderr: bool = True) -> Any:
    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    # log lines stay whole; tables get room when the output is a file or a pipe
    return Console(stderr=stderr, highlight=False, soft_wrap=stderr,
                   width=None if stream.isatty() else 160)


def _plain(x: Any) -> Any:
    """A spec value as YAML writes it: enums by value, tuples as lists, dataclasses as dicts."""
    import dataclasses
    import enum

    if dataclasses.is_dataclass(x):
        return {f.name: _plain(getattr(x, f.name)) for f in dataclasses.fields(x)}
    if isinstance(x, enum.Enum):
        return x.value
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    return x


def config_yaml(spec: Any) -> str:
    """The resolved configuration as YAML (enums by value, tuples as lists)."""
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml(OmegaConf.create(_plain(spec)))


def spec_defaults(spec_cls: Any) -> dict[str, Any]:
    """Every key's default as config.yaml writes it (keys without one left out): what a run made
    before a key existed is taken to have used (:func:`poslsh_cli.store.rundir.config_changes`)."""
    import dataclasses

    out = {}
    for f in dataclasses.fields(spec_cls):
        if f.default is not dataclasses.MISSING:
            out[f.name] = _plain(f.default)
        elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
            out[f.name] = _plain(f.default_factory())  # type: ignore[misc]
    return out


def execute(exp: Experiment, spec: Any, run_dir: Path, argv: str, config_text: str | None = None,
            meta: dict | None = None) -> int:
    """Run every unfinished cell of ``exp`` into ``run_dir``; 0 when complete, 130 when interrupted
    by Ctrl-C, 143 by SIGTERM.

    Order: the run directory is checked without writing (same configuration to resume; no live
    owner), the memory estimate is checked, ``prepare`` checks the data and checkpoints; only then
    is the directory created and owned (its lock held until the end). ``config_text`` is the
    resolved configuration written to config.yaml (the composed Hydra config, as the user's keys
    read); without it, the spec itself. ``meta`` goes into meta.json (the preset the run was made with,
    a multirun job's number and overrides).

    Several processes (torchrun, a multi-task SLURM job; :mod:`poslsh_cli.core.distributed`): rank 0
    does all of the above; the other ranks wait for its checks, prepare the same context, learn
    the cells still to run from it and run them with it, writing nothing (:func:`_follow`).
    """
    if dist.active():
        if not exp.distributed:
            raise ConfigError(f"poslsh {exp.name} runs in one process (this is rank {dist.rank()} of "
                              f"{dist.world().size}); only train runs under torchrun or a multi-task job")
        dist.init()
        if not dist.is_main():
            return _follow(exp, spec, run_dir)
        dist.watch_followers()

    found: dict[str, Any] = {}

    def checked() -> None:  # the other ranks wait for this, then prepare (reading what rank 0 cached)
        found["run"] = RunDir.open(run_dir, exp.name, config_text if config_text is not None else config_yaml(spec),
                                   spec_defaults(exp.spec))
        check_memory(exp, spec)
        with waiting(f"poslsh {exp.name}: preparing (data, models) ..."):
            found["ctx"] = exp.prepare(spec) if exp.prepare is not None else None

    dist.decide(checked)
    run, ctx = found["run"], found["ctx"]
    err = console()

    def notice(text: str) -> None:
        err.print(text, markup=False, highlight=False)

    for line in getattr(ctx, "notes", None) or ():  # what prepare found that the user should see first
        notice(line)

    keys = exp.cells(spec, ctx)
    owned = contextlib.ExitStack()

    def started() -> list[dict]:
        owned.enter_context(run.own(argv))
        _begin(run, ctx, argv, spec.seed, len(keys), meta, notice)
        done = run.done_ids()
        return [k for k in keys if cell_id(k) not in done]

    with owned:
        try:
            todo = dist.decide(started)
        except KeyboardInterrupt as exc:  # Ctrl-C / SIGTERM while the directory was being set up
            return _interrupted(run, len(keys), err, stopped_code(exc))
        if hasattr(ctx, "todo"):  # a context that says what the session will cost (train)
            ctx.todo = len(todo)
        return _loop(exp, spec, ctx, run, keys, todo, err, notice)

def _begin(run: Any, ctx: Any, argv: str, seed: int, cells: int, meta: dict | None, notice: Any) -> None:
    """Start (or resume) the owned run directory: its meta.json (with what only the experiment knows:
    ``ctx.meta``, a corpus hash), cells that cannot be read dropped, and the files the experiment
    writes once (``ctx.files``); a directory that cannot be written is one error line, and left as it
    was found when it was empty."""
    try:
        run.start(argv, seed, cells, notice)
        run.drop_unreadable_cells(notice)
        if meta:
            run.write_meta(**meta)
        if getattr(ctx, "meta", None):
            run.write_meta(**ctx.meta)
        if dist.active():
            run.write_meta(world_size=dist.world().size)
        for rel, produce in (getattr(ctx, "files", None) or {}).items():
            target = run.path / rel
            if not target.exists():
                target.parent.mkdir(parents=True, exist_ok=True)
                atomic_write_bytes(target, produce())
    except OSError as exc:
        run.discard_if_empty()
        raise ConfigError(f"cannot write {run.path}: {exc.strerror}") from None



def _interrupted(run: Any, total: int, err: Any, code: int) -> int:
    """Record an interrupted session and say what was kept: a directory with any work in it (a
    finished cell, a checkpoint or metrics log of an unfinished one) stays for the same command to
    resume; one that holds nothing yet is removed."""
    with contextlib.suppress(OSError):
        run.write_meta(status="interrupted", cells_done=len(run.finished()))
    n_done = len(run.finished())
    if run.discard_if_empty():
        err.print(f"interrupted before anything was computed; {run.path} removed", markup=False)
    else:
        partial = n_done < total and (run.path / "work").is_dir() and any((run.path / "work").iterdir())
        err.print(f"interrupted: {n_done}/{total} cells finished"
                  + (", and the work of unfinished ones (checkpoints, logs)" if partial else "")
                  + f" kept in {run.path}; run the same command with out={run.path} to continue", markup=False)
    return code


def _follow(exp: Experiment, spec: Any, run_dir: Path) -> int:
    """A rank other than 0: the same cells as rank 0, computing its share, writing nothing."""
    try:
        dist.decide(lambda: None)  # rank 0 has checked the run directory and prepared the data
        ctx = exp.prepare(spec) if exp.prepare is not None else None
        todo = dist.decide(lambda: [])
        for key in todo:
            exp.run_cell(spec, key, ctx, CellWork(Path(run_dir) / "work" / work_name(key), writer=False))
    except (dist.FollowerError, KeyboardInterrupt):
        raise  # rank 0 reported it, or the whole job is being stopped
    except BaseException as exc:
        dist.report_failure(f"{type(exc).__name__}: {exc}")  # rank 0 fails at once, naming it
        raise
    return 0


def _loop(exp: Experiment, spec: Any, ctx: Any, run: Any, keys: list[dict], todo: list[dict], err: Any,
          notice: Any) -> int:
    """The cells not yet done (``todo``), each written as it finishes (the run directory is owned)."""
    index = {cell_id(k): i for i, k in enumerate(keys)}
    for cid, cell in list(run.finished().items()):  # seeds appended to a run move the cells after them in the grid
        if cid in index and cell.get("index") != index[cid]:
            run.write_cell(cell["key"], cell["rows"], cell.get("aux"), index[cid])
    if len(todo) < len(keys):
        err.print(f"resuming {run.path}: {len(keys) - len(todo)}/{len(keys)} cells already done", markup=False)
    status, code = "complete", 0
    tables = _Tables(run, keys, list(exp.columns))
    try:
        with _Progress(err, len(keys), len(keys) - len(todo), exp.name) as bar:
            for key in todo:
                t0 = time.perf_counter()
                rows, aux = exp.run_cell(spec, key, ctx, run.work(key, bar.sub, notice))
                run.write_cell(key, rows, aux, index[cell_id(key)])
                tables.after_cell()
                run.write_meta(cells_done=len(run.finished()))
                bar.advance(key, time.perf_counter() - t0)
        tables.write()
    except KeyboardInterrupt as exc:
        status, code = "interrupted", stopped_code(exc)
        # the signal may have landed between a cell's file and the table: make them agree
        tables.write()
    except ConfigError as exc:
        run.write_meta(status="failed", error=str(exc))
        run.discard_if_empty()
        raise
    except Exception as exc:  # keep finished cells, say what happened

        why = dist.follower_failure()  # a follower's error is the cause of this rank's broken collective
        text = f"{why} (rank 0 then: {type(exc).__name__})" if why else f"{type(exc).__name__}: {exc}"
        run.write_meta(status="failed", error=text)
        run.discard_if_empty()
        raise RunFailed(text) from exc
    if status == "interrupted":
        return _interrupted(run, len(keys), err, code)
    run.write_meta(status=status, cells_done=len(run.finished()))
    _print_summary(exp, run)
    return 0


class _Tables:
    """results.csv (and the aux tables) rewritten after a cell when the last rewrite is at least
    :data:`TABLES_EVERY_S` seconds old, or 20 times its own cost: rewriting them after every cell
    costs O(N^2) over a run of N small cells (block-stats' 1080). The cell files are the record
    (:func:`poslsh_cli.store.readers.results` reads them, and rebuilds a stale table); the tables are
    always rewritten at the end, on an interrupt, and after a cell that took longer than that."""

    def __init__(self, run: Any, keys: list[dict], columns: list[str]):
        self.run, self.keys, self.columns = run, keys, columns
        self.last, self.cost = -float("inf"), 0.0

    def after_cell(self) -> None:
        if time.perf_counter() - self.last >= max(TABLES_EVERY_S, 20.0 * self.cost):
            self.write()

    def write(self) -> None:
        now = time.perf_counter()
        self.run.write_tables(self.keys, self.columns)
        self.last = time.perf_counter()
        self.cost = self.last - now


#: Seconds between rewrites of a run's tables while its cells finish (see :class:`_Tables`).
TABLES_EVERY_S = 5.0


def _print_summary(exp: Experiment, run: Any) -> None:
    from rich.table import Table

    df = results(run.path, exp.columns)
    if df.empty or exp.summary is None:
        return
    head, rows = exp.summary(df)
    table = Table(title=f"poslsh {exp.name}: {run.path}", title_justify="left")
    for h in head:
        table.add_column(h, justify="right")
    for r in rows:
        table.add_row(*r)
    out = console(stderr=False)
    out.print(table)
    out.print(f"results: {run.path / 'results.csv'}   plots: poslsh plot {run.path}")



def key_text(key: dict) -> str:
    """A cell's key as progress lines print it: ``k=v`` pairs, without ``s=0`` (the cells of schemes
    that draw no masks, and attention that is not Positional LSH, carry s = 0)."""
    return " ".join(f"{k}={v}" for k, v in key.items() if not (k == "s" and v == 0))


#: Off a terminal, the longest a cell's progress stays silent: a line at least this often (seconds)
#: besides one every tenth of the cell (a tenth of a long training cell is minutes on a busy machine).
QUIET_S = 10.0
#: The numbers of a progress message, masked to tell its kinds apart (:meth:`_Progress.sub`).
_NUMBERS = re.compile(r"[0-9.]+")


class _Progress:
    """Rich progress bar on a terminal; one plain line per cell otherwise (logs, SLURM). A long
    cell reports its own steps through :meth:`sub` (a second bar, or a line every 10%, and one line for each
    kind of message at the end: a training cell's final evaluations report at its last step)."""

    def __init__(self, console: Any, total: int, done: int, label: str):
        self.console, self.total, self.done, self.label = console, total, done, label
        self.rich = console.is_terminal
        self._sub_task = None
        self._last_tenth, self._last_kind = -1, ""
        self._last_line = time.monotonic()

    def __enter__(self) -> "_Progress":
        if self.rich:
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                                       TimeElapsedColumn, TimeRemainingColumn)

            self.progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                     TimeElapsedColumn(), TimeRemainingColumn(), console=self.console,
                                     transient=False)
            self.progress.start()
            self.task = self.progress.add_task(self.label, total=self.total, completed=self.done)
        return self

    def sub(self, done: int, total: int, text: str) -> None:
        if self.rich:
            if self._sub_task is None:
                self._sub_task = self.progress.add_task("", total=total)
            self.progress.update(self._sub_task, completed=done, total=total, description=f"  {text}")
            return
        tenth = int(10 * done / max(1, total))
        kind = _NUMBERS.sub("#", text) if done == total else ""  # at the end: the message, numbers aside
        quiet = time.monotonic() - self._last_line >= QUIET_S  # a tenth of a long cell may take minutes
        if tenth != self._last_tenth or (done == total and kind != self._last_kind) or quiet:
            self._last_tenth, self._last_kind, self._last_line = tenth, kind, time.monotonic()
            self.console.print(f"    {done}/{total} {text}", markup=False)

    def advance(self, key: dict, seconds: float) -> None:
        """One more cell. The time shown is the cell's wall time (a training cell's includes its
        evaluations and saving; its rows' ``seconds`` column counts training steps only)."""
        self.done += 1
        text = key_text(key)
        if self.rich:
            if self._sub_task is not None:
                self.progress.remove_task(self._sub_task)
                self._sub_task = None
            self.progress.update(self.task, advance=1, description=f"{self.label} {text}")
        else:
            self._last_tenth = -1
            self.console.print(f"[{self.done}/{self.total}] {text} ({seconds:.2f} s wall)", markup=False)

    def __exit__(self, *exc: Any) -> None:
        if self.rich:
            self.progress.stop()
