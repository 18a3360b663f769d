"""The error every layer raises for bad user input: the command line reports it as one line on
stderr and exits non-zero (docs/ARCHITECTURE.md, "Errors"). It lives apart from the configuration
hub so that a module that only refuses input imports nothing else."""
from __future__ import annotations


class ConfigError(ValueError):
    """Bad user input: reported as one line on stderr with a non-zero exit."""


__all__ = ["ConfigError"]
