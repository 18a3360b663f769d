"""The ``perplexity`` command (``command``: its ``EXPERIMENT``) and what only it uses."""
