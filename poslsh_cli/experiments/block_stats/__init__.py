"""The ``block-stats`` command (``command``: its ``EXPERIMENT``) and what only it uses."""
