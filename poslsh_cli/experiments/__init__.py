"""One module per experiment: pure functions from a validated config to result records.

Each module exposes ``COLUMNS`` (results.csv column order), ``cells(cfg)`` (the grid, one dict
per cell, in a fixed order), ``run_cell(cfg, key)`` returning ``(rows, aux)`` and
``summary(df)`` for the end-of-run table. No I/O, no printing.
"""
from __future__ import annotations

from types import ModuleType


def get(command: str) -> ModuleType:
    from poslsh_cli.experiments import block_stats, matrix_error

    return {"matrix-error": matrix_error, "block-stats": block_stats}[command]
