"""The ``output-error`` command (``command``: its ``EXPERIMENT``) and what only it uses."""
