"""Exact and windowed ALiBi without n x n tensors, and attention without bias.

    exact ALiBi      T* = softmax(q k^T * scale - |i-j| / sigma_h) V
    windowed ALiBi   the same on |i-j| <= w_h only (keys further away dropped)

Paths: query chunks against their key range (memory O(B H chunk n); banded, O(n (chunk + w) d),
when windowed), causal exact ALiBi as one extra q/k coordinate on the bias-free causal SDPA kernel
(training), and a dense (H, n, n) bias (:mod:`poslsh_cli.attention.dense`). FlexAttention lives
in :mod:`poslsh_cli.attention.flex`.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from poslsh_cli.numerics import masks
from poslsh_cli.attention.plan import Kernel
from poslsh_cli.attention.reference import NEG_INF, alibi_distance_bias, slopes_from_sigmas, scale_of
from poslsh_cli.attention.merge import merge_by_lse

#: Elements of one chunk's (heads, chunk, keys) bias in the chunked exact path: bounds its memory.
CHUNK_ELEMENTS = 2**26
#: Queries per call of the banded training path (:func:`alibi_banded`).
BAND_CHUNK = 512


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
    acc = torch.promote_types(q.dtype, torch.float32)
    slopes = slopes_from_sigmas(sigmas, acc, q.device)  # (H,) in the precision of the scores
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
        bias = alibi_distance_bias(pos[a:b], pos[lo:hi], slopes)  # (H, c, m)
        qi, kj = pos[a:b], pos[lo:hi]
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


def alibi_banded(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sigmas: torch.Tensor, causal: bool,
                 window: int | Sequence[int] | None = None, scale: float | None = None,
                 chunk: int = BAND_CHUNK) -> torch.Tensor:
    """Exact or windowed ALiBi for training on the CPU: query chunks of one head at a time against
    that head's own key range (``[i - w_h, i + w_h]``, cut by causality), with the fused CPU flash
    kernel and a backward that recomputes (:class:`BandedAlibi`). Memory O(B H n d) plus one
    chunk's (chunk x range) bias, never the (H, n, n) bias nor stored scores; time
    O(n (chunk + 2 w_h) d) per head, near-linear when windowed.

    q, k, v: (B, H, n, d) float32/float64. Returns (B, H, n, d) in q's dtype.
    """
    H, n = q.shape[1], q.shape[2]
    wins = (None,) * H if window is None else tuple(int(w) for w in torch.as_tensor(window).reshape(-1).expand(H))
    slopes = slopes_from_sigmas(sigmas, torch.promote_types(q.dtype, torch.float32), q.device)  # (H,)
    return BandedAlibi.apply(q, k, v, slopes, causal, wins, scale_of(q.shape[-1], scale), max(1, min(chunk, n)))


def _bands(n: int, causal: bool, wins: tuple, chunk: int) -> Any:
    """(head, query slice, key slice) of every call of the banded path."""
    for h, w in enumerate(wins):
        for a in range(0, n, chunk):
            b = min(n, a + chunk)
            lo = 0 if w is None else max(0, a - w)
            hi = (b if causal else n) if w is None else min(b if causal else n, b - 1 + w + 1)
            yield h, a, b, lo, hi


def _band_bias(a: int, b: int, lo: int, hi: int, slope: torch.Tensor, causal: bool, w: int | None,
               dtype: torch.dtype) -> torch.Tensor:
    """The (1, 1, b-a, hi-lo) ALiBi bias of one call in ``dtype`` (``slope``: (1,), one head's),
    -inf outside the causal / window mask."""
    i = torch.arange(a, b, device=slope.device)[:, None]
    j = torch.arange(lo, hi, device=slope.device)[None, :]
    bias = alibi_distance_bias(i[:, 0], j[0], slope)[0].to(dtype)  # (b-a, hi-lo)
    keep = masks.combine(causal, None if w is None else masks.Window.of(w, 1, slope.device))
    return (bias if keep is None else bias.masked_fill(~keep.grid(i[:, 0], j[0], 1)[0], NEG_INF))[None, None]


class BandedAlibi(torch.autograd.Function):
    """The banded ALiBi attention of :func:`alibi_banded`; saves q, k, v, the output and its lse, and
    recomputes each call's probabilities in the backward with the flash kernel's own backward."""

    @staticmethod
    def forward(ctx, q, k, v, slopes, causal, wins, sc, chunk):  # noqa: ANN001, ANN205
        B, H, n, d = q.shape
        out = torch.empty_like(q)
        # the flash kernel's lse is float32 for float32 inputs, float64 for float64 ones
        lse = torch.empty(B, H, n, dtype=torch.promote_types(q.dtype, torch.float32), device=q.device)
        for h, a, b, lo, hi in _bands(n, causal, wins, chunk):
            bias = _band_bias(a, b, lo, hi, slopes[h:h + 1], causal, wins[h], q.dtype)
            o, l = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q[:, h:h + 1, a:b], k[:, h:h + 1, lo:hi], v[:, h:h + 1, lo:hi], 0.0, False, attn_mask=bias, scale=sc)
            out[:, h:h + 1, a:b] = o
            lse[:, h:h + 1, a:b] = l
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (slopes, causal, wins, sc, chunk)
        return out

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        q, k, v, out, lse = ctx.saved_tensors
        slopes, causal, wins, sc, chunk = ctx.args
        n = q.shape[2]
        grad = grad.contiguous()
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for h, a, b, lo, hi in _bands(n, causal, wins, chunk):
            bias = _band_bias(a, b, lo, hi, slopes[h:h + 1], causal, wins[h], q.dtype)
            gq, gk, gv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                grad[:, h:h + 1, a:b], q[:, h:h + 1, a:b], k[:, h:h + 1, lo:hi], v[:, h:h + 1, lo:hi],
                out[:, h:h + 1, a:b], lse[:, h:h + 1, a:b], 0.0, False, attn_mask=bias, scale=sc)
            dq[:, h:h + 1, a:b] += gq
            dk[:, h:h + 1, lo:hi] += gk
            dv[:, h:h + 1, lo:hi] += gv
        return dq, dk, dv, None, None, None, None, None


def alibi_rank1(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sigmas: torch.Tensor,
                scale: float | None = None, dropout: float = 0.0) -> torch.Tensor:
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
    slopes = slopes_from_sigmas(sigmas, q.dtype, q.device)  # (H,)
    pos = torch.arange(n, device=q.device, dtype=q.dtype) - (n - 1) / 2
    qe = q.new_zeros(B, H, n, extra)
    qe[..., 0] = 1.0
    ke = k.new_zeros(B, H, n, extra)
    ke[..., 0] = (slopes[:, None] * pos[None, :] / sc)[None]
    ve = v.new_zeros(B, H, n, extra)
    out = torch.nn.functional.scaled_dot_product_attention(
        torch.cat([q, qe], -1), torch.cat([k, ke], -1), torch.cat([v, ve], -1), is_causal=True, scale=sc,
        dropout_p=dropout)
    return out[..., :d]


#: Queries per tile of the tiled rank-one path (:func:`alibi_rank1_tiled`): the extra coordinate
#: is centred on each tile, so the offsets the kernel adds to the logits of a tile's own keys stay
#: within m T / 2 (float32 keeps them to about 1e-5 at m = 1/2) whatever n is.
RANK1_TILE = 512


def _flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, sc: float,
           bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The CPU flash kernel: attention output and its natural-log normaliser (lse)."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=bias,
                                                                           scale=sc)
    return out, lse


def alibi_rank1_tiled(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sigmas: torch.Tensor, causal: bool,
                      scale: float | None = None, tile: int = RANK1_TILE, rows: tuple[int, int] | None = None
                      ) -> torch.Tensor:
    """Exact ALiBi, causal or bidirectional, on the bias-free flash kernel (inference).

    Queries go in tiles [a, b) of ``tile`` rows. The keys before the tile see the bias
    ``-m (i - j) = m (j - a) - m (i - a)``: ``m (j - a)`` is one more q/k coordinate (q 1, k
    ``m (j - a) / scale``) and ``-m (i - a)``, constant along a row, moves only the row's
    normaliser. The keys after it (bidirectional) see ``-m (j - i) = -m (j - e) - m (e - i)``
    with e = b - 1: the same coordinate with q -1. The tile's own keys (a T x T block) take the
    exact bias as a float mask. The two or three parts merge by their normalisers
    (:func:`merge_by_lse`), so the result is attention over all keys, with O(B H n d) memory and
    the flash kernel's speed.

    Re-centring at every tile's edges keeps float32 accurate at long n: the offsets the kernel
    adds are at most 0 and small on the keys next to the tile, and the far keys, with offsets up to
    m n, carry weights exp(-m |i - j|) too small for their rounding to matter (one coordinate
    centred once for all n, as the training path :func:`alibi_rank1` does, loses about
    eps m n / 2 on every logit).

    Args:
        q, k, v: (B, H, n, d) float32/float64 on the CPU.
        sigmas: (H,) bandwidths, ``m_h = 1 / sigma_h``.
        rows: ``(start, stop)``: only the output rows of those queries (against all n keys),
            e.g. the last rows of a long context; None: every row.

    Returns (B, H, n or stop - start, d) in q's dtype (no gradient: the training path is
    :func:`alibi_rank1`).
    """
    B, H, n, d = q.shape
    sc = scale_of(d, scale)
    extra = -(-(d + 1) // 8) * 8 - d
    slopes = slopes_from_sigmas(sigmas, torch.float64, q.device)  # (H,)
    k_ext = torch.cat([k, k.new_zeros(B, H, n, extra)], -1)
    v_ext = torch.cat([v, v.new_zeros(B, H, n, extra)], -1)
    pos = torch.arange(n, device=q.device, dtype=torch.float64)
    start, stop = (0, n) if rows is None else (max(0, int(rows[0])), min(n, int(rows[1])))
    out = q.new_empty(B, H, max(0, stop - start), d)
    tile = max(1, min(int(tile), n))
    for a in range(start, stop, tile):
        b = min(stop, a + tile)
        qt = q[:, :, a:b]
        own = alibi_distance_bias(pos[a:b].long(), pos[a:b].long(), slopes.to(q.dtype))  # (H, T, T)
        if causal:
            own = own.masked_fill(torch.ones(b - a, b - a, dtype=torch.bool, device=q.device).triu(1), NEG_INF)
        o, l = _flash(qt, k[:, :, a:b], v[:, :, a:b], False, sc, own[None].expand(B, H, b - a, b - a).to(q.dtype))
        outs, lses = [o], [l]
        # keys before the tile: offsets m (j - a) <= 0, the row constant -m (i - a); keys after it:
        # offsets -m (j - (b-1)) <= 0, the row constant -m ((b-1) - i)
        sides = [(0, a, a, 1.0)] + ([] if causal else [(b, n, b - 1, -1.0)])
        for lo, hi, c, sign in sides:
            if hi <= lo:
                continue
            k_ext[:, :, lo:hi, d] = (slopes[:, None] * (pos[lo:hi] - c)[None] / sc).to(q.dtype)[None]
            q_ext = torch.cat([qt, qt.new_zeros(B, H, b - a, extra)], -1)
            q_ext[..., d] = sign
            o, l = _flash(q_ext, k_ext[:, :, lo:hi], v_ext[:, :, lo:hi], False, sc)
            outs.append(o[..., :d])
            lses.append((l.double() - slopes[None, :, None] * (sign * (pos[a:b] - c))[None, None]).to(l.dtype))
        if len(outs) == 1:
            out[:, :, a - start:b - start] = outs[0]
        else:
            merged, _ = merge_by_lse(torch.stack(outs, 2), torch.stack(lses, 2), dim=2)
            out[:, :, a - start:b - start] = merged
    return out


def no_bias_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                      scale: float | None = None, dropout: float = 0.0) -> torch.Tensor:
    """``softmax(q k^T / sqrt(d)) V`` (PyTorch SDPA: flash/memory-efficient kernels where available).

    q, k, v: (B, H, n, d), any float dtype. Returns (B, H, n, d) in q's dtype.
    """
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                            scale=scale_of(q.shape[-1], scale), dropout_p=dropout)
