"""poslsh: experiment runner for Positional LSH (Wolfson & Wagner, 2026).

Modules (docs/ARCHITECTURE.md): ``sampling`` (random partitions), ``operators`` (L*, M~),
``metrics`` (errors, slope fits), ``experiments`` (one per command), ``rundir`` (run
directories), ``plotting``, ``config`` and ``cli``.
"""
__version__ = "0.1.0"
