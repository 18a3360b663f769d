"""The ``decode-bench`` command (``command``: its ``EXPERIMENT``) and what only it uses."""
