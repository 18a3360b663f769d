"""One module per experiment: pure functions from a validated config to result records.

Each module exposes ``COLUMNS`` (results.csv column order), ``cells(cfg, ctx)`` (the grid, one
dict per cell, in a fixed order), ``run_cell(cfg, key, ctx)`` returning ``(rows, aux)`` and
``summary(df)`` for the end-of-run table; optionally ``prepare(cfg)`` building a context that
every cell shares (loaded model, captured activations), which may refuse bad input with a
ConfigError before anything is written. No printing.
"""
from __future__ import annotations

from types import ModuleType


def get(command: str) -> ModuleType:
    from poslsh_cli.experiments import bench, block_stats, matrix_error, output_error

    return {"matrix-error": matrix_error, "block-stats": block_stats, "output-error": output_error,
            "bench": bench}[command]
