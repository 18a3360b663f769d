"""One module per experiment command; each exports ``EXPERIMENT`` (an
:class:`~poslsh_cli.experiments.base.Experiment`), which :mod:`poslsh_cli.app.registry` finds by itself.
Beside them: ``base`` (the Experiment type and the helpers experiments share), ``measure`` (timing
and peak memory), ``stage`` (one training stage of ``poslsh train``) and each command's
``<name>_report`` / ``<name>_claims`` companions."""
