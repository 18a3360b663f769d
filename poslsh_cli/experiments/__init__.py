"""One module per experiment: pure functions from a validated config to result records.

Each module exposes ``COLUMNS`` (results.csv column order), ``cells(cfg, ctx)`` (the grid, one
dict per cell, in a fixed order), ``run_cell(cfg, key, ctx)`` returning ``(rows, aux)`` and
``summary(df)`` for the end-of-run table; optionally ``prepare(cfg)`` building a context that
every cell shares (loaded model, captured activations), which may refuse bad input with a
ConfigError before anything is written. No printing.
"""
from __future__ import annotations

from itertools import product
from types import ModuleType
from typing import Any


def get(command: str) -> ModuleType:
    from poslsh_cli.experiments import bench, block_stats, matrix_error, output_error

    return {"matrix-error": matrix_error, "block-stats": block_stats, "output-error": output_error,
            "bench": bench}[command]


def grid_cells(cfg: Any) -> list[dict[str, Any]]:
    """The (n, sigma, s, trial) grid of the matrix experiments, in a fixed order."""
    return [{"n": n, "sigma": sigma, "s": s, "trial": t}
            for n, sigma, s, t in product(cfg.n, cfg.sigma, cfg.s, range(cfg.trials))]


def resolve_device(name: str) -> Any:
    """``auto`` -> CUDA when present, else CPU; refuses CUDA where there is none."""
    import torch

    from poslsh_cli.config import ConfigError

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if str(name).startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"device={name} but CUDA is not available")
    return torch.device(name)


def torch_dtype(name: str) -> Any:
    import torch

    return {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16,
            "float16": torch.float16}[name]


def synchronize(device: Any) -> None:
    """Wait for queued CUDA work, so wall-clock timings are honest."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)
