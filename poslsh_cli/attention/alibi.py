"""Exact and windowed ALiBi without n x n tensors, and attention without bias.

    exact ALiBi      T* = softmax(q k^T * scale - |i-j| / sigma_h) V
    windowed ALiBi   the same on |i-j| <= w_h only (keys further away dropped)

Paths: query chunks against their key range (memory O(B H chunk n); banded, O(n (chunk + w) d),
when windowed), causal exact ALiBi as one extra q/k coordinate on the bias-free causal SDPA kernel
(training), and a dense (H, n, n) bias (:mod:`poslsh_cli.attention.dense`). FlexAttention lives
in :mod:`poslsh_cli.attention.flex`.
"""
from __future__ import annotations

from typing import Sequence

import torch

from poslsh_cli import masks
from poslsh_cli.attention.plan import Kernel
from poslsh_cli.attention.reference import NEG_INF, scale_of

#: Elements of one chunk's (heads, chunk, keys) bias in the chunked exact path: bounds its memory.
CHUNK_ELEMENTS = 2**26


def alibi_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sigmas: torch.Tensor, causal: bool,
                  window: int | Sequence[int] | None = None, chunk: int | None = None, scale: float | None = None,
                  kernel: Kernel = Kernel.FUSED) -> torch.Tensor:
    """Exact ALiBi attention by query chunks: memory O(B H chunk n), never (n, n) at once.

    Args:
        q, k, v: (B, H, n, d), any float dtype; queries, keys, values.
        sigmas: (H,) kernel bandwidths, ``sigma_h = 1 / slope_h``.
        causal: drop keys j > i.
        window: None, one half-width for every head or one per head: keys with ``|i - j| > w_h``
            are dropped (windowed exact ALiBi); each chunk then touches only
            ``chunk + 2 max(w)`` keys, so the cost is O(n (chunk + w) d).
        chunk: queries per chunk (default: as many as keep a chunk's bias within
            ``CHUNK_ELEMENTS`` elements, at most 1024).
        kernel: ``fused`` (SDPA with the bias as a float mask; float32/float64 inputs) or
            ``matmul`` (scores, softmax statistics in float32 at least: narrower inputs).

    Returns (B, H, n, d) in q's dtype; differentiable in q, k, v.
    """
    B, H, n, d = q.shape
    sc = scale_of(d, scale)
    if chunk is None:
        chunk = max(16, min(1024, CHUNK_ELEMENTS // max(1, B * H * n)))
    slopes = (1.0 / sigmas).to(device=q.device, dtype=torch.float32)[:, None, None]  # (H, 1, 1)
    acc = torch.promote_types(q.dtype, torch.float32)
    if kernel is Kernel.FUSED and q.dtype != acc:
        kernel = Kernel.MATMUL  # SDPA's float mask would be rounded to the input dtype
    outs = []
    pos = torch.arange(n, device=q.device)
    keep = masks.combine(causal, None if window is None else masks.Window.of(window, H, q.device))
    for a in range(0, n, chunk):
        b = min(n, a + chunk)
        lo, hi = 0, n
        if keep is not None:  # intervals are monotone: the chunk's keys span lo(a) .. hi(b-1)
            lo = max(0, int(keep.interval(pos[a:a + 1])[0].min()))
            hi = min(n, int(keep.interval(pos[b - 1:b])[1].max()) + 1)
        qi, kj = pos[a:b], pos[lo:hi]
        dist = (qi[:, None] - kj[None, :]).abs().to(acc)  # (c, m)
        bias = -slopes.to(acc) * dist  # (H, c, m)
        if keep is not None:
            bias = bias.masked_fill(~keep.grid(qi, kj, H), NEG_INF)
        if kernel is Kernel.FUSED:
            # fused kernel (flash on CPU, memory-efficient on CUDA) with the bias as a float mask
            outs.append(torch.nn.functional.scaled_dot_product_attention(
                q[:, :, a:b], k[:, :, lo:hi], v[:, :, lo:hi], attn_mask=bias[None].to(q.dtype), scale=sc))
            continue
        scores = (q[:, :, a:b] @ k[:, :, lo:hi].transpose(-1, -2)).to(acc) * sc + bias  # (B, H, c, m)
        lse = torch.logsumexp(scores, dim=-1, keepdim=True)
        p = torch.exp(scores - lse)
        outs.append((p.to(v.dtype) @ v[:, :, lo:hi]).to(q.dtype))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)


def alibi_rank1(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sigmas: torch.Tensor,
                scale: float | None = None) -> torch.Tensor:
    """Causal exact ALiBi with the bias-free causal SDPA kernel.

    Under the causal mask ``-m_h (i - j) = m_h j - m_h i`` and ``-m_h i`` is constant along a
    row, where softmax ignores it; ``m_h j`` is a rank-one term that fits in one more q/k
    coordinate: q gets 1, k gets ``m_h (j - c) / scale`` (c = (n-1)/2 keeps the values small),
    zero-padded to a multiple of 8. The logits then carry the offset ``m_h (j - c)``, up to
    ``m_h (n-1)/2`` in size, so their rounding error is about ``eps * m_h (n-1)/2`` (float32 at
    n=1024, m=1/2: 3e-5, far below what training notices); float32 or wider only (bf16 cannot
    hold it).

    Args:
        q, k, v: (B, H, n, d) float32/float64; queries, keys, values.
        sigmas: (H,) kernel bandwidths, ``m_h = 1 / sigma_h``.

    Returns (B, H, n, d) in q's dtype.
    """
    B, H, n, d = q.shape
    sc = scale_of(d, scale)
    extra = -(-(d + 1) // 8) * 8 - d  # at least one coordinate, total a multiple of 8
    slopes = (1.0 / sigmas).to(device=q.device, dtype=q.dtype)  # (H,)
    pos = torch.arange(n, device=q.device, dtype=q.dtype) - (n - 1) / 2
    qe = q.new_zeros(B, H, n, extra)
    qe[..., 0] = 1.0
    ke = k.new_zeros(B, H, n, extra)
    ke[..., 0] = (slopes[:, None] * pos[None, :] / sc)[None]
    ve = v.new_zeros(B, H, n, extra)
    out = torch.nn.functional.scaled_dot_product_attention(
        torch.cat([q, qe], -1), torch.cat([k, ke], -1), torch.cat([v, ve], -1), is_causal=True, scale=sc)
    return out[..., :d]


def no_bias_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                      scale: float | None = None) -> torch.Tensor:
    """``softmax(q k^T / sqrt(d)) V`` (PyTorch SDPA: flash/memory-efficient kernels where available).

    q, k, v: (B, H, n, d), any float dtype. Returns (B, H, n, d) in q's dtype.
    """
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                            scale=scale_of(q.shape[-1], scale))
