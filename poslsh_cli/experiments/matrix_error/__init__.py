"""The ``matrix-error`` command (``command``: its ``EXPERIMENT``) and what only it uses."""
