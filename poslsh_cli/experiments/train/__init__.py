"""The ``train`` command (``command``: its ``EXPERIMENT``) and what only it uses."""
