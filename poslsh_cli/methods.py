"""The attention methods every command compares (DESIGN.md section 1), in a module without torch so
that command specs can name them before the numerical stack is imported. The implementations and
the backend chooser are in :mod:`poslsh_cli.attention` (which re-exports :class:`Method`)."""
from __future__ import annotations

import enum


class Method(str, enum.Enum):
    """The attention methods every command compares."""

    EXACT = "exact"  # exact ALiBi: softmax(q k^T / sqrt(d) - |i-j| / sigma) V
    WINDOWED = "windowed"  # exact ALiBi on |i-j| <= w_h only
    POSLSH = "poslsh"  # Positional LSH: D~^-1 (A o M~) V with s sampled partitions per head
    FIXED_BLOCK = "fixed_block"  # one deterministic partition per head, width round(2 sigma)
    NO_BIAS = "no_bias"  # softmax(q k^T / sqrt(d)) V
