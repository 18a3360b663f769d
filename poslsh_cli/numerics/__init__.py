"""Pure numerics on arrays: random partitions of positions (``sampling``), the ``L*`` and ``M~``
operators (``operators``), errors and fits (``metrics``), key masks (``masks``), the table of
attention methods (``methods``). Attention on tensors is the sibling package ``attention``.
"""
