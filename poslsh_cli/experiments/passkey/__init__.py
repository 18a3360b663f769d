"""The ``passkey`` command (``command``: its ``EXPERIMENT``) and what only it uses."""
