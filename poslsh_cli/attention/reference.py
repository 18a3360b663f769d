"""The float64 dense reference: the oracle every fast path is tested against, and a method's
bias at explicit positions, which it shares with the generic kernels and cached decoding.

With ``A_ij = exp(q_i . k_j * scale)`` and a nonnegative weight W, the reference computes
``D^-1 (A o W) V`` with ``D = diag((A o W) 1)``: W = L* (``exp(-|i-j|/sigma)``) is exact ALiBi,
W = M~ (the mean of s sampled masks) Positional LSH, zeros drop a pair (``log 0 = -inf``). A
method's W is ``exp`` of its declared score where its key mask keeps the pair
(:func:`method_bias`; docs/ARCHITECTURE.md, "Adding an attention method").
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import torch

from poslsh_cli.numerics import masks
from poslsh_cli.numerics.methods import HeadParams, distance_bias, method_def
from poslsh_cli.numerics.sampling import Partitions

NEG_INF = float("-inf")


def scale_of(head_dim: int, scale: float | None) -> float:
    """The logit scale: ``scale`` or ``1 / sqrt(d)``."""
    return 1.0 / math.sqrt(head_dim) if scale is None else float(scale)


def slopes_from_sigmas(sigmas: Sequence[float] | torch.Tensor | np.ndarray, dtype: torch.dtype,
                       device: torch.device | str = "cpu") -> torch.Tensor:
    """ALiBi slopes ``m_h = 1 / sigma_h`` (H,): computed in float64 and rounded once to ``dtype``,
    the precision of the inputs they bias (every exact-ALiBi path takes its slopes from here)."""
    if isinstance(sigmas, torch.Tensor):
        sigmas = sigmas.detach().to(device="cpu", dtype=torch.float64).reshape(-1)
    else:
        sigmas = torch.as_tensor(np.asarray(sigmas, dtype=np.float64)).reshape(-1)
    return (1.0 / sigmas).to(device=device, dtype=dtype)


def alibi_distance_bias(qi: torch.Tensor, kj: torch.Tensor, slopes: torch.Tensor) -> torch.Tensor:
    """The ALiBi logit bias ``-m_h |i - j|`` of query positions ``qi`` (c,) against key positions
    ``kj`` (m,): (H, c, m) in the slopes' dtype (:func:`slopes_from_sigmas`): the grid of
    :func:`~poslsh_cli.numerics.methods.distance_bias` for the dense, chunked and banded paths
    (FlexAttention's ``score_mod`` calls it per element)."""
    h = torch.arange(slopes.shape[0], device=slopes.device)[:, None, None]
    return distance_bias(slopes, h, qi[None, :, None], kj[None, None, :])


def as_sigmas(sigmas: Sequence[float] | torch.Tensor | np.ndarray, heads: int) -> torch.Tensor:
    """One float64 sigma per head, (H,), from one value or H values; all > 0."""
    sigmas = torch.as_tensor(np.asarray(sigmas, dtype=np.float64)).reshape(-1)
    if sigmas.numel() == 1:
        sigmas = sigmas.expand(heads)
    if sigmas.numel() != heads:
        raise ValueError(f"need one sigma per head ({heads}), got {sigmas.numel()}")
    if not torch.all(sigmas > 0):
        raise ValueError("sigmas must be > 0")
    return sigmas


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, weight: torch.Tensor | None,
                        causal: bool, scale: float | None = None,
                        dtype: torch.dtype = torch.float64,
                        bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``D^-1 (A o W) V`` computed densely in ``dtype`` (float64: the test oracle).

    Args:
        q, k, v: (B, H, n, d) any float dtype; queries, keys, values.
        weight: nonnegative multiplicative weight W, (H, n, n) or (n, n); ``None`` for no bias.
        bias: or the additive ``log W`` itself (``-inf`` drops a pair; a method's
            :func:`method_bias`).
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
    if bias is not None:
        scores = scores + bias.to(dtype)
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
    m = slopes_from_sigmas(sigmas, torch.float64, q.device)
    kj = torch.arange(k.shape[-2], device=q.device)
    j = kj.to(torch.float64)
    kd, vd = k.double(), v.double()
    outs = []
    for a in range(0, len(rows), chunk):
        idx = torch.as_tensor(list(rows[a:a + chunk]), device=q.device)
        i = idx.to(torch.float64)
        s = (q[:, :, idx].double() @ kd.transpose(-1, -2)) * sc + alibi_distance_bias(idx, kj, m)
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


def head_params(spec: "object", dtype: torch.dtype, device: torch.device | str) -> HeadParams:
    """The per-head parameters a method's score and key mask read (:class:`HeadParams`), from an
    :class:`~poslsh_cli.attention.api.AttentionSpec`: slopes in ``dtype``, the window, the bins'
    widths and shifts (float64), on ``device``."""
    window = None if spec.window is None else torch.as_tensor(spec.window, device=device)
    widths = shifts = None
    if spec.partitions is not None:
        widths, shifts = (torch.as_tensor(a, dtype=torch.float64, device=device) for a in spec.bin_table)
    return HeadParams(slopes_from_sigmas(spec.sigmas, dtype, device), dtype, window, widths, shifts)


def method_bias(spec: "object", q_pos: torch.Tensor, k_pos: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The additive logit bias of ``spec``'s method between query positions ``q_pos`` (B, m) and key
    positions ``k_pos`` (B, n), int64: (B, H, m, n) in ``dtype``, its declared score where its key
    mask keeps the pair and ``-inf`` elsewhere (:mod:`poslsh_cli.numerics.methods`; causality is
    the caller's). ValueError for an unknown method: never a silent zero bias."""
    defn = method_def(spec.method)
    H = spec.sigmas.shape[0]
    (B, m), n = q_pos.shape, k_pos.shape[1]
    p = head_params(spec, dtype, q_pos.device)
    h = torch.arange(H, device=q_pos.device)[None, :, None, None]
    qi, kj = q_pos[:, None, :, None], k_pos[:, None, None, :]
    if defn.score is None:
        bias = torch.zeros(B, H, m, n, dtype=dtype, device=q_pos.device)
    else:
        bias = defn.score(p, h, qi, kj).to(dtype).expand(B, H, m, n)
    if defn.keep is not None:
        bias = bias.masked_fill(~defn.keep(p, h, qi, kj), NEG_INF)
    return bias


def method_weight(spec: "object", n: int, device: torch.device | str = "cpu") -> torch.Tensor | None:
    """The nonnegative weight W of ``spec``'s method at positions 0..n-1, (H, n, n) float64:
    ``exp`` of :func:`method_bias` (0 where its key mask drops a pair); None for no bias."""
    defn = method_def(spec.method)
    if defn.score is None and defn.keep is None:
        return None
    i = torch.arange(n, device=device)[None]
    return torch.exp(method_bias(spec, i, i, torch.float64)[0])
