"""The front ends: the registry of commands (``registry``), from argv to a run (``launch``), the
cell loop (``runner``), one table from a multirun (``sweep``), ``report`` and ``plot``
(``report``), ``reproduce``, and the Typer app (``cli``).
"""
