"""poslsh: experiment runner for Positional LSH (Wolfson & Wagner, 2026).

One folder per layer (docs/ARCHITECTURE.md): ``core`` (configuration, files, processes),
``numerics`` and ``attention`` (partitions, operators, errors; attention on tensors), ``store``
(run directories), ``lm`` (models, position schemes, corpora, evaluation), ``verdicts`` (claims,
intervals, drawing), ``experiments`` (one package per command), ``app`` (the registry, the runner,
reports and the command line).

What a Python user imports: ``poslsh_cli.attention`` (``attend``, ``AttentionSpec``,
``poslsh_attention``, ``exact_alibi``, ...), and the loader, ``poslsh_cli.load_model`` (a checkpoint
with its position scheme installed; :func:`poslsh_cli.lm.loading.load_model`).
"""
from typing import Any

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:  # the loader, imported on first use (the CLI starts without torch)
    if name == "load_model":
        from poslsh_cli.lm.loading import load_model

        return load_model
    raise AttributeError(f"module 'poslsh_cli' has no attribute {name!r}")


__all__ = ["__version__", "load_model"]
