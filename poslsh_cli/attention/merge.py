"""Merging attention results by their log-normalisers: attention over disjoint key sets (the
blocks of one sample, the samples of Positional LSH, FlexAttention's per-sample passes) merged this
way equals attention over their union, weighted by each part's share of the total mass.
"""
from __future__ import annotations

import torch


def merge_by_lse(out: torch.Tensor, lse: torch.Tensor, dim: int,
                 inplace: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge attention results over ``dim`` by their natural-log normalisers.

    ``out`` (..., K, n, d) and ``lse`` (..., K, n) with K at ``dim`` (counted on ``lse``):
    ``sum_k exp(lse_k - LSE) out_k`` with ``LSE = logsumexp_k lse_k``; returns ``(merged, LSE)``.
    ``inplace=True`` (a caller that owns ``out`` and reads it no more): without autograd, ``out``
    is overwritten by its weighted values instead of filling a second (K, n, d) buffer.
    """
    total = torch.logsumexp(lse, dim=dim, keepdim=True)
    w = torch.exp(lse - total).unsqueeze(-1)  # (..., K, n, 1)
    odim = dim if dim >= 0 else dim - 1
    if torch.is_grad_enabled() and (out.requires_grad or lse.requires_grad) or out.dtype != w.dtype:
        merged = (w * out.to(w.dtype)).sum(dim=odim)
    elif not inplace:
        merged = (w * out).sum(dim=odim)
    else:  # inference on a buffer the caller gives up: weight in place, no (..., K, n, d) temporary
        merged = out.mul_(w).sum(dim=odim)
    return merged.to(out.dtype), total.squeeze(dim)
