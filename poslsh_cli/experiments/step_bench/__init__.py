"""The ``step-bench`` command (``command``: its ``EXPERIMENT``) and what only it uses."""
