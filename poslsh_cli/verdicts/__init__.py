"""Claims and their rules: verdicts and sections (``claims``), intervals and the decision rules
between trained models (``stats``), shared drawing helpers (``plotting``). No experiment knowledge.
"""
