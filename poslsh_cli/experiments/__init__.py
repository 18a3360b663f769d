"""One package per experiment command (``experiments/<name>/``): its ``command`` module exports
``EXPERIMENT`` (an :class:`~poslsh_cli.experiments.base.Experiment`), which
:mod:`poslsh_cli.app.registry` finds by itself, and beside it what only that command uses (``report``
for its tables, figures and claims, ``claims`` where those are long, ``train``'s ``spec`` and
``stage``, ``perplexity``'s ``groups``, ``extrapolation`` and ``plots``). The modules here serve
several commands: ``base`` (the Experiment type, memory estimates, grids, seeds, choice enums),
``devices`` (device, dtype and precision keys), ``machine`` (memory and cores) and ``measure``
(timing and peak memory)."""
