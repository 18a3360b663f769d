"""Run one experiment command into a run directory: the side-effect layer.

``execute`` turns a composed config into a typed one, walks the experiment's cells that are not
finished yet, writes each atomically as it finishes, and prints progress (rich on a terminal,
plain lines otherwise) and a summary table. Ctrl-C / SIGTERM stop between cells' writes: every
finished cell stays, and the same command with the same ``out=`` resumes.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from poslsh_cli.config import ConfigError, validate


def _console(stderr: bool = True) -> Any:
    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    # log lines stay whole; tables get room when the output is a file or a pipe
    return Console(stderr=stderr, highlight=False, soft_wrap=stderr,
                   width=None if stream.isatty() else 160)


def _fail(command: str, message: str, code: int = 2) -> None:
    from poslsh_cli.cli import fail

    fail(command, message, code)


def _config_yaml(cfg: Any) -> str:
    from omegaconf import OmegaConf

    data = OmegaConf.to_container(cfg, resolve=True) if OmegaConf.is_config(cfg) else dict(cfg)
    data.pop("hydra", None)
    return OmegaConf.to_yaml(OmegaConf.create(data))


def execute(command: str, cfg: Any, run_dir: Path, argv: str) -> None:
    from poslsh_cli.rundir import RunDir

    try:
        typed = validate(command, cfg)
        run = RunDir.open(run_dir, command, _config_yaml(cfg))
    except ConfigError as exc:
        _fail(command, str(exc))
        return
    if command == "sample":
        _execute_sample(typed, run, argv)
    else:
        _execute_cells(command, typed, run, argv)


def _execute_cells(command: str, cfg: Any, run: Any, argv: str) -> None:
    from poslsh_cli import experiments
    from poslsh_cli.rundir import atomic_write_bytes

    exp = experiments.get(command)
    err = _console()
    ctx = None
    if hasattr(exp, "prepare"):
        try:
            ctx = exp.prepare(cfg)
        except ConfigError as exc:
            _fail(command, str(exc))
    keys = exp.cells(cfg, ctx)
    columns = exp.COLUMNS
    try:
        run.start(argv, cfg.seed, len(keys))
        for rel, produce in (getattr(ctx, "files", None) or {}).items():
            target = run.path / rel
            if not target.exists():
                target.parent.mkdir(parents=True, exist_ok=True)
                atomic_write_bytes(target, produce())
    except OSError as exc:
        _fail(command, f"cannot write {run.path}: {exc.strerror}")
    done = run.done_ids()
    from poslsh_cli.rundir import cell_id

    todo = [k for k in keys if cell_id(k) not in done]
    if done:
        err.print(f"resuming {run.path}: {len(keys) - len(todo)}/{len(keys)} cells already done")
    status = "complete"
    try:
        with _Progress(err, len(keys), len(keys) - len(todo), command) as bar:
            for key in todo:
                t0 = time.perf_counter()
                rows, aux = exp.run_cell(cfg, key, ctx)
                run.write_cell(key, rows, aux)
                run.write_tables(keys, columns)
                run.write_meta(cells_done=len(run.done_ids()))
                bar.advance(key, time.perf_counter() - t0)
        run.write_tables(keys, columns)
    except KeyboardInterrupt:
        status = "interrupted"
        # the signal may have landed between a cell's file and the table: make them agree
        run.write_tables(keys, columns)
    except ConfigError as exc:
        run.write_meta(status="failed", error=str(exc))
        run.discard_if_empty()
        _fail(command, str(exc))
    except Exception as exc:  # an unexpected failure: keep finished cells, say what happened
        run.write_meta(status="failed", error=f"{type(exc).__name__}: {exc}")
        run.discard_if_empty()
        if _debug():
            raise
        _fail(command, f"{type(exc).__name__}: {exc} (set POSLSH_DEBUG=1 for a traceback)", code=1)
    n_done = len(run.done_ids())
    run.write_meta(status=status, cells_done=n_done)
    if status == "interrupted":
        run.discard_if_empty()
        err.print(f"interrupted: {n_done}/{len(keys)} cells kept in {run.path}; "
                  f"run the same command with out={run.path} to finish")
        raise SystemExit(130)
    _print_summary(exp, run)


def _debug() -> bool:
    import os

    return bool(os.environ.get("POSLSH_DEBUG"))


def _print_summary(exp: Any, run: Any) -> None:
    import pandas as pd
    from rich.table import Table

    df = pd.read_csv(run.path / "results.csv")
    if df.empty:
        return
    head, rows = exp.summary(df)
    table = Table(title=f"poslsh {run.command}: {run.path}", title_justify="left")
    for h in head:
        table.add_column(h, justify="right")
    for r in rows:
        table.add_row(*r)
    out = _console(stderr=False)
    out.print(table)
    out.print(f"results: {run.path / 'results.csv'}   plots: poslsh plot {run.path}")


class _Progress:
    """Rich progress bar on a terminal; one plain line per cell otherwise (logs, SLURM)."""

    def __init__(self, console: Any, total: int, done: int, label: str):
        self.console, self.total, self.done, self.label = console, total, done, label
        self.rich = console.is_terminal

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

    def advance(self, key: dict, seconds: float) -> None:
        self.done += 1
        text = " ".join(f"{k}={v}" for k, v in key.items())
        if self.rich:
            self.progress.update(self.task, advance=1, description=f"{self.label} {text}")
        else:
            self.console.print(f"[{self.done}/{self.total}] {text} ({seconds:.2f} s)")

    def __exit__(self, *exc: Any) -> None:
        if self.rich:
            self.progress.stop()


def _execute_sample(cfg: Any, run: Any, argv: str) -> None:
    """``poslsh sample``: masks.npz + a per-sample block table (results.csv)."""
    import io

    import numpy as np
    import pandas as pd
    from rich.table import Table

    from poslsh_cli.rundir import atomic_write_bytes, atomic_write_text
    from poslsh_cli.sampling import alibi_sigmas, derive_seed, sample_partitions

    if cfg.heads is not None:
        sigmas = alibi_sigmas(cfg.heads)
        seeds = [derive_seed(cfg.seed, "head", h) for h in range(cfg.heads)]
    else:
        sigmas, seeds = np.asarray([float(cfg.sigma)]), [cfg.seed]
    parts = [sample_partitions(cfg.n, float(sg), cfg.s, np.random.default_rng(sd))
             for sg, sd in zip(sigmas, seeds)]
    rows = []
    for h, (p, sd) in enumerate(zip(parts, seeds)):
        for k, lengths in enumerate(p.block_lengths()):
            rows.append({"head": h, "sigma": p.sigma, "sample": k, "seed": sd,
                         "width": float(p.widths[k]), "shift": float(p.shifts[k]),
                         "num_blocks": int(lengths.size), "max_block": int(lengths.max()),
                         "mean_block": float(lengths.mean())})
    if cfg.heads is None:
        arrays = {"bins": parts[0].bins(), "widths": parts[0].widths, "shifts": parts[0].shifts,
                  "sigma": np.float64(parts[0].sigma), "seed": np.int64(seeds[0])}
    else:
        arrays = {"bins": np.stack([p.bins() for p in parts]), "widths": np.stack([p.widths for p in parts]),
                  "shifts": np.stack([p.shifts for p in parts]), "sigma": sigmas,
                  "seed": np.asarray(seeds, dtype=np.int64)}
    run.start(argv, cfg.seed, 1)
    buf = io.BytesIO()
    np.savez_compressed(buf, **arrays)
    atomic_write_bytes(run.path / "masks.npz", buf.getvalue())
    atomic_write_text(run.path / "results.csv", pd.DataFrame(rows).to_csv(index=False))
    run.write_meta(status="complete", cells_done=1)

    table = Table(title=f"poslsh sample: {run.path}", title_justify="left")
    for h in ["head", "sigma", "seed", "s", "mean width", "blocks", "mean block", "b_max"]:
        table.add_column(h, justify="right")
    df = pd.DataFrame(rows)
    for h, g in df.groupby("head"):
        table.add_row(str(h), f"{g['sigma'].iloc[0]:g}", str(g['seed'].iloc[0]), str(len(g)),
                      f"{g['width'].mean():.2f}", f"{g['num_blocks'].mean():.1f}",
                      f"{g['mean_block'].mean():.2f}", str(g['max_block'].max()))
    out = _console(stderr=False)
    out.print(table)
    out.print(f"masks: {run.path / 'masks.npz'}   plots: poslsh plot {run.path}")
