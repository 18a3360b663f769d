"""One module per experiment command; each exports ``EXPERIMENT`` (an
:class:`~poslsh_cli.experiment.Experiment`), which :mod:`poslsh_cli.registry` finds by itself."""
