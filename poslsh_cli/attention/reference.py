"""The float64 dense reference: the oracle every fast path is tested against.

With ``A_ij = exp(q_i . k_j * scale)`` and a nonnegative weight W, the reference computes
``D^-1 (A o W) V`` with ``D = diag((A o W) 1)``: W = L* (``exp(-|i-j|/sigma)``) is exact ALiBi,
W = M~ (the mean of s sampled masks) Positional LSH, zeros drop a pair (``log 0 = -inf``).
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import torch

from poslsh_cli.numerics import masks
from poslsh_cli.numerics.sampling import Partitions

NEG_INF = float("-inf")


def scale_of(head_dim: int, scale: float | None) -> float:
    """The logit scale: ``scale`` or ``1 / sqrt(d)``."""
    return 1.0 / math.sqrt(head_dim) if scale is None else float(scale)


def alibi_slopes(sigmas: Sequence[float] | torch.Tensor | np.ndarray, dtype: torch.dtype,
                 device: torch.device | str = "cpu") -> torch.Tensor:
    """ALiBi slopes ``m_h = 1 / sigma_h`` (H,): computed in float64 and rounded once to ``dtype``,
    the precision of the inputs they bias (every exact-ALiBi path takes its slopes from here)."""
    if isinstance(sigmas, torch.Tensor):
        sig = sigmas.detach().to(device="cpu", dtype=torch.float64).reshape(-1)
    else:
        sig = torch.as_tensor(np.asarray(sigmas, dtype=np.float64)).reshape(-1)
    return (1.0 / sig).to(device=device, dtype=dtype)


def alibi_distance_bias(qi: torch.Tensor, kj: torch.Tensor, slopes: torch.Tensor) -> torch.Tensor:
    """The ALiBi logit bias ``-m_h |i - j|`` of query positions ``qi`` (c,) against key positions
    ``kj`` (m,): (H, c, m) in the slopes' dtype (:func:`alibi_slopes`). The one builder of the bias
    for the dense, chunked and banded paths (FlexAttention's ``score_mod`` applies the same formula
    per element)."""
    dist = (qi[:, None] - kj[None, :]).abs().to(slopes.dtype)  # (c, m)
    return -slopes[:, None, None] * dist[None]


def as_sigmas(sigmas: Sequence[float] | torch.Tensor | np.ndarray, heads: int) -> torch.Tensor:
    """One float64 sigma per head, (H,), from one value or H values; all > 0."""
    s = torch.as_tensor(np.asarray(sigmas, dtype=np.float64)).reshape(-1)
    if s.numel() == 1:
        s = s.expand(heads)
    if s.numel() != heads:
        raise ValueError(f"need one sigma per head ({heads}), got {s.numel()}")
    if not torch.all(s > 0):
        raise ValueError("sigmas must be > 0")
    return s


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, weight: torch.Tensor | None,
                        causal: bool, scale: float | None = None,
                        dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    """``D^-1 (A o W) V`` computed densely in ``dtype`` (float64: the test oracle).

    Args:
        q, k, v: (B, H, n, d) any float dtype; queries, keys, values.
        weight: nonnegative multiplicative weight W, (H, n, n) or (n, n); ``None`` for no bias.
        causal: also drop keys j > i.
        dtype: float64 for the reference; float32 gives the *naive* float32 implementation whose
            error against float64 sets the tolerance of every fast path in the tests.

    Returns ``(out (B, H, n, d), lse (B, H, n))`` in ``dtype``, ``lse = log sum_j A_ij W_ij``.
    """
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    n = q.shape[-2]
    scores = (q @ k.transpose(-1, -2)) * scale_of(q.shape[-1], scale)  # (B, H, n, n)
    if weight is not None:
        scores = scores + torch.log(weight.to(dtype))  # log 0 = -inf drops the pair
    if causal:
        i = torch.arange(n, device=q.device)
        scores = scores.masked_fill(~masks.Causal().grid(i, i, 1)[0], NEG_INF)
    lse = torch.logsumexp(scores, dim=-1)
    return torch.softmax(scores, dim=-1) @ v, lse


def alibi_rows_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sigmas: Sequence[float] | torch.Tensor,
                         causal: bool, rows: Sequence[int], scale: float | None = None,
                         chunk: int = 32) -> torch.Tensor:
    """Float64 exact ALiBi output of the query rows ``rows`` only, against all n keys:
    (B, H, len(rows), d). Memory O(B H chunk n): a check of a fast path at lengths where the full
    (n, n) reference does not fit."""
    sc = scale_of(q.shape[-1], scale)
    m = alibi_slopes(sigmas, torch.float64, q.device)
    j = torch.arange(k.shape[-2], device=q.device, dtype=torch.float64)
    kd, vd = k.double(), v.double()
    outs = []
    for a in range(0, len(rows), chunk):
        idx = torch.as_tensor(list(rows[a:a + chunk]), device=q.device)
        i = idx.to(torch.float64)
        s = (q[:, :, idx].double() @ kd.transpose(-1, -2)) * sc - m[:, None, None] * (i[:, None] - j).abs()
        if causal:
            s = s.masked_fill(j[None, :] > i[:, None], NEG_INF)
        outs.append(torch.softmax(s, -1) @ vd)
    return torch.cat(outs, 2)


def laplacian_weight(n: int, sigmas: torch.Tensor, device: torch.device | str = "cpu") -> torch.Tensor:
    """Dense ``L*_ij = exp(-|i-j| / sigma_h)`` per head: sigmas (H,) -> (H, n, n) float64
    (tests and small references only)."""
    i = torch.arange(n, device=device, dtype=torch.float64)
    dist = (i[:, None] - i[None, :]).abs()
    return torch.exp(-dist[None] / sigmas.to(device=device, dtype=torch.float64)[:, None, None])


def mean_mask_weight(partitions: Sequence[Partitions], device: torch.device | str = "cpu") -> torch.Tensor:
    """Dense ``M~`` per head, (H, n, n) float64, from :meth:`poslsh_cli.numerics.operators.MeanMask.dense`
    (the one dense builder; tests and small references only)."""
    from poslsh_cli.numerics.operators import MeanMask

    return torch.stack([torch.as_tensor(MeanMask(p).dense(), device=device) for p in partitions])
