"""The attention methods every command compares (docs/THEORY.md, "Attention"), in a module without
torch so that command specs can name them before the numerical stack is imported.

Each method has one row in :data:`INFO`: what it is called as a training position scheme, what
parameters it draws or derives (sampled partitions, a fixed partition, a window, nothing), and
whether commands treat it as a baseline. The commands read this table: ``poslsh bench`` times
every method, ``poslsh output-error`` reports every baseline beside Positional LSH,
``poslsh train position=`` and ``poslsh perplexity attention=`` accept every scheme. Adding a
method is a row here and its implementation in :mod:`poslsh_cli.attention` (its reference weight
and the backends it runs on); nothing else names methods one by one.

Enum order is the display order of every table and figure: no positional bias first, then the
baselines from the coarsest, then exact ALiBi and Positional LSH.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Literal


class Method(str, enum.Enum):
    """The attention methods every command compares."""

    NO_BIAS = "no_bias"  # softmax(q k^T / sqrt(d)) V
    FIXED_BLOCK = "fixed_block"  # one deterministic partition per head, width round(2 sigma)
    WINDOWED = "windowed"  # exact ALiBi on |i-j| <= w_h only
    EXACT = "exact"  # exact ALiBi: softmax(q k^T / sqrt(d) - |i-j| / sigma) V
    POSLSH = "poslsh"  # Positional LSH: D~^-1 (A o M~) V with s sampled partitions per head


#: What a method needs besides q, k, v and one sigma per head.
Params = Literal["none", "sampled_partitions", "fixed_partitions", "window"]


@dataclass(frozen=True)
class MethodInfo:
    """One method's row: ``scheme`` is its name as a position scheme (``position=`` of ``train``,
    ``attention=`` of ``perplexity``); ``params`` what :meth:`AttentionSpec.build
    <poslsh_cli.attention.AttentionSpec.build>` makes for it; ``baseline``: output-error reports
    it beside Positional LSH (exact ALiBi is the reference there, Positional LSH the subject)."""

    scheme: str
    params: Params
    baseline: bool
    summary: str

    @property
    def randomized(self) -> bool:
        """Its masks are drawn at random (seeds, trials, s)."""
        return self.params == "sampled_partitions"


INFO: dict[Method, MethodInfo] = {
    Method.NO_BIAS: MethodInfo("none", "none", True, "no positional bias (NoPE)"),
    Method.FIXED_BLOCK: MethodInfo("fixed_block", "fixed_partitions", True,
                                   "one fixed block-diagonal mask per head, blocks of round(2 sigma)"),
    Method.WINDOWED: MethodInfo("windowed", "window", True, "exact ALiBi within |i-j| <= ceil(c sigma)"),
    Method.EXACT: MethodInfo("alibi", "none", False, "exact ALiBi, bias -|i-j|/sigma"),
    Method.POSLSH: MethodInfo("poslsh", "sampled_partitions", False, "Positional LSH: the mean of s sampled masks"),
}


def baselines() -> list[Method]:
    """The methods output-error compares with Positional LSH, in display order."""
    return [m for m in Method if INFO[m].baseline]


def of_scheme(scheme: str) -> Method:
    """The method behind a position scheme name (``alibi`` -> ``exact``)."""
    for m, info in INFO.items():
        if info.scheme == scheme:
            return m
    raise ValueError(f"no attention method for scheme {scheme!r}")
