"""FlexAttention paths: exact or windowed ALiBi with a ``score_mod``, Positional LSH with the sampled
bins as document ids. Block masks come from the key intervals of :mod:`poslsh_cli.numerics.masks`, never
from an n x n grid. Compiled on CUDA; uncompiled they run anywhere (densely), which is how the
tests check them on the CPU at sizes with many 128-token tiles.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from poslsh_cli.numerics import masks
from poslsh_cli.attention.blocks import device_bins
from poslsh_cli.attention.merge import merge_by_lse
from poslsh_cli.attention.reference import alibi_slopes, scale_of
from poslsh_cli.numerics.sampling import Partitions

_FLEX = None


def flex_function(compiled: bool) -> Any:
    """``flex_attention``, compiled once per process when asked (CUDA), plain otherwise."""
    global _FLEX
    from torch.nn.attention.flex_attention import flex_attention

    if not compiled:
        return flex_attention
    if _FLEX is None:
        _FLEX = torch.compile(flex_attention, dynamic=False)
    return _FLEX


def alibi_flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sigmas: torch.Tensor, causal: bool,
               window: int | Sequence[int] | None = None, scale: float | None = None,
               compiled: bool = True) -> torch.Tensor:
    """Exact (or windowed) ALiBi with FlexAttention: a ``score_mod`` adds ``-m_h |i-j|`` (the formula
    of :func:`~poslsh_cli.attention.reference.alibi_distance_bias`, per element).

    Args:
        q, k, v: (B, H, n, d), float16/bfloat16/float32; queries, keys, values.
        sigmas: (H,) kernel bandwidths.
        causal: drop keys j > i.
        window: None, one half-width for every head or one per head (keys with ``|i-j| > w_h``
            are dropped).
        compiled: run ``torch.compile``d (CUDA); uncompiled it runs anywhere (tests).

    Returns (B, H, n, d) in q's dtype.
    """
    B, H, n, d = q.shape
    slopes = alibi_slopes(sigmas, torch.float32, q.device)  # the scores are float32 inside the kernel

    def score_mod(score, b, h, qi, kj):  # noqa: ANN001
        return score - slopes[h] * (qi - kj).abs().to(score.dtype)

    win = None if window is None else masks.Window.of(window, H, q.device)
    keep = masks.combine(causal, win)
    bm = None if keep is None else masks.block_mask(keep, H, n, q.device)
    return flex_function(compiled)(q, k, v, score_mod=score_mod, block_mask=bm, scale=scale_of(d, scale))


@dataclass(frozen=True)
class FlexLayout:
    """Sampled partitions as FlexAttention sees them: query head ``h*s + k`` is (head h, sample
    k), and its ``BlockMask`` keeps keys in the same bin (and causal, when asked).

    ``block_mask`` covers (1, H*s, n, n); built from the bins' block intervals on ``device``
    (:func:`masks.block_mask`), never from an n x n grid.
    """

    heads: int
    num_samples: int
    seq_len: int
    causal: bool
    block_mask: Any

    @classmethod
    def build(cls, partitions: Sequence[Partitions], causal: bool,
              device: torch.device | str = "cpu") -> "FlexLayout":
        H, s, n = len(partitions), partitions[0].num_samples, partitions[0].seq_len
        doc = device_bins(partitions, device).reshape(H * s, n)  # (H*s, n)
        keep = masks.combine(causal, block=masks.SameBlock.of(doc))
        return cls(H, s, n, causal, masks.block_mask(keep, H * s, n, device))


def poslsh_flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, partitions: Sequence[Partitions] | None,
                causal: bool, scale: float | None = None, compiled: bool | None = None,
                layout: FlexLayout | None = None) -> torch.Tensor:
    """Positional-LSH attention with FlexAttention: each (head, sample) is one query head whose
    mask keeps keys in the same block (the sampled bins are document ids), ``lse`` returned by
    the kernel, then the merge. Key/value heads are shared across samples through grouped-query
    attention (query head ``h*s + k`` reads kv head ``h``), so only q is repeated s times.

    Args:
        q, k, v: (B, H, n, d), float16/bfloat16/float32; queries, keys, values.
        partitions: H partitions with the same s (ignored when ``layout`` is given).
        layout: a prepared :class:`FlexLayout` for the same H, n and causal flag.
        compiled: default: compiled on CUDA; uncompiled (dense, slow) elsewhere, which is how the
            tests check it.

    Returns (B, H, n, d) in q's dtype.
    """
    from torch.nn.attention.flex_attention import AuxRequest

    B, H, n, d = q.shape
    if layout is None:
        layout = FlexLayout.build(partitions, causal, q.device)
    if layout.causal != causal or layout.heads != H or layout.seq_len != n:
        raise ValueError("the FlexLayout was built for another causal flag, head count or length")
    s = layout.num_samples
    qs = q.unsqueeze(2).expand(B, H, s, n, d).reshape(B, H * s, n, d)  # (B, H*s, n, d)
    fn = flex_function(q.is_cuda if compiled is None else compiled)
    out, aux = fn(qs, k, v, block_mask=layout.block_mask, scale=scale_of(d, scale), enable_gqa=True,
                  return_aux=AuxRequest(lse=True))
    return merge_by_lse(out.reshape(B, H, s, n, d), aux.lse.reshape(B, H, s, n).float(), dim=2,
                        inplace=True)[0]
