"""One dense attention with an additive (H, n, n) bias: the training path at short lengths.

    exact / windowed ALiBi   bias -|i-j| / sigma_h (-inf outside the window)
    Positional LSH           bias log M~ (log 0 = -inf), so softmax(q k^T * scale + log M~) V
                             = D~^-1 (A o M~) V exactly (docs/THEORY.md, "Training identity")

Causal masks are folded into the bias (-inf above the diagonal). At training lengths this costs
one attention whatever the number of samples s is; the memory is O(H n^2).
"""
from __future__ import annotations

import functools
import math
from typing import Sequence

import torch

from poslsh_cli import masks
from poslsh_cli.attention.blocks import device_bins
from poslsh_cli.attention.plan import needs_grad
from poslsh_cli.attention.reference import NEG_INF, alibi_distance_bias, alibi_slopes, scale_of
from poslsh_cli.sampling import Partitions


def bias_dtype(dtype: torch.dtype) -> torch.dtype:
    """Biases are built in float64 for float64 inputs, float32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def dense_bias_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor,
                         scale: float | None = None, dropout: float = 0.0) -> torch.Tensor:
    """``softmax(q k^T * scale + bias) V`` in one SDPA call (differentiable in q, k, v).

    Args:
        q, k, v: (B, H, n, d); queries, keys, values.
        bias: (H, n, n) additive logit bias, ``-inf`` where a key is dropped (causal and
            empty-mask entries); every row keeps at least its diagonal.

        dropout: attention dropout probability (training). On the CPU with float32/64 inputs that
            need gradients it runs :class:`FlashDropout` (the probability rounded to a multiple of
            2^-16, 0.1 -> 0.1000061), elsewhere SDPA's own ``dropout_p`` (its fused CUDA kernels).

    Returns (B, H, n, d) in q's dtype.
    """
    sc = scale_of(q.shape[-1], scale)
    mask = bias[None].to(q.dtype)
    if dropout > 0 and q.device.type == "cpu" and q.dtype in (torch.float32, torch.float64) and needs_grad(q, k, v):
        keep, p = keep_mask(q.shape[:2] + bias.shape[-2:], dropout, q.device)
        return FlashDropout.apply(q, k, v, mask, keep, p, sc)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=sc, dropout_p=dropout)


def keep_mask(shape: Sequence[int], p: float, device: torch.device | str = "cpu") -> tuple[torch.Tensor, float]:
    """An i.i.d. dropout keep mask of ``shape`` (bool) from torch's global generator, and the drop
    probability it has: ``p`` rounded to a multiple of 2^-16. Each 64-bit draw gives four 16-bit
    lanes, each dropped when below ``round(p 2^16)`` (a fifth of the cost of ``torch.rand``)."""
    m = int(round(p * 65536))
    count = math.prod(shape)
    words = torch.empty(-(-count // 4), dtype=torch.int64, device=device).random_(-2 ** 63, 2 ** 63 - 1)
    keep = words.view(torch.int16)[:count] >= (m - 32768)
    return keep.view(tuple(shape)), m / 65536


class FlashDropout(torch.autograd.Function):
    """``(softmax(q k^T * scale + bias) o D / (1 - p)) V``, attention dropout with the keep mask D,
    from the CPU flash kernel (which has no dropout of its own; SDPA with ``dropout_p`` falls back
    to its unfused math path, 2.8x a plain training step at L=256).

    The flash kernel with the dropped entries masked (bias -inf where D = 0) gives the renormalised
    ``O'_i = sum_j D_ij P_ij v_j / r_i`` with ``r_i = sum_j D_ij P_ij = exp(lse'_i - lse_i)``, lse and
    lse' the log-normalisers without and with the mask, so ``O = O' r / (1 - p)`` (0 where a row
    keeps no key). With ``g_i = dO_i . O_i``, the softmax backward is
    ``dS_ij = P'_ij dP'_ij - g_i P_ij`` where ``dP'_ij = (r_i/(1-p)) dO_i . v_j``: the first term is the
    masked kernel's backward with the output gradient ``r dO / (1-p)`` and a zero output (so its
    row term vanishes), the second the unmasked kernel's with zero values, an output gradient e_1
    and an output ``g e_1`` (so only its row term ``-g_i P_ij`` is left). Two forward and two backward
    kernel calls, the (B, H, n, n) masked bias kept for the backward.
    """

    @staticmethod
    def forward(ctx, q, k, v, bias, keep, p, sc):  # noqa: ANN001, ANN205
        flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        masked = bias.masked_fill(~keep, NEG_INF)  # (B, H, n, n)
        some = (masked > NEG_INF).any(-1)  # (B, H, n): the row keeps a key
        o1, l1 = flash(q, k, v, 0.0, False, attn_mask=masked, scale=sc)
        _, l0 = flash(q, k, v, 0.0, False, attn_mask=bias, scale=sc)
        r = torch.exp(l1 - l0).mul_(some).mul_(1.0 / (1.0 - p)).to(q.dtype)
        o1 = o1.masked_fill(~some[..., None], 0.0)
        l1 = l1.masked_fill(~some, 0.0)  # finite: the backward's exp(-inf - l1) is then 0, not NaN
        ctx.save_for_backward(q, k, v, bias, masked, o1, l1, l0, r)
        ctx.sc = sc
        return o1 * r[..., None]

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        flash_bwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
        q, k, v, bias, masked, o1, l1, l0, r = ctx.saved_tensors
        g1 = grad.contiguous() * r[..., None]
        dq, dk, dv = flash_bwd(g1, q, k, v, torch.zeros_like(o1), l1, 0.0, False, attn_mask=masked, scale=ctx.sc)
        e1 = torch.zeros_like(q)
        e1[..., 0] = 1.0
        go = torch.zeros_like(q)
        go[..., 0] = (g1 * o1).sum(-1)
        dq2, dk2, _ = flash_bwd(e1, q, k, torch.zeros_like(v), go, l0, 0.0, False, attn_mask=bias, scale=ctx.sc)
        return dq.add_(dq2), dk.add_(dk2), dv, None, None, None, None


def alibi_bias(n: int, sigmas: torch.Tensor, causal: bool, window: int | Sequence[int] | None = None,
               device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The ALiBi bias ``-m_h |i-j|`` (``m_h = 1 / sigma_h``), (H, n, n) in ``dtype``, ``-inf`` where the causal or
    window mask drops a key. It depends only on its arguments, so the last few are cached
    (training rebuilds it in every layer at every step otherwise); treat it as read-only."""
    sig = tuple(float(x) for x in sigmas.reshape(-1))
    win = None if window is None else tuple(int(w) for w in torch.as_tensor(window).reshape(-1).expand(len(sig)))
    return _alibi_bias(n, sig, causal, win, str(device), dtype)


@functools.lru_cache(maxsize=8)
def _alibi_bias(n: int, sigmas: tuple[float, ...], causal: bool, window: tuple[int, ...] | None, device: str,
                dtype: torch.dtype) -> torch.Tensor:
    H = len(sigmas)
    i = torch.arange(n, device=device)
    bias = alibi_distance_bias(i, i, alibi_slopes(sigmas, dtype, device))  # (H, n, n)
    keep = masks.combine(causal, None if window is None else masks.Window.of(window, H, device))
    return bias if keep is None else bias.masked_fill(~keep.grid(i, i, H), NEG_INF)


def poslsh_bias(partitions: Sequence[Partitions], causal: bool, device: torch.device | str = "cpu",
                dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``log M~`` (H, n, n) in ``dtype`` with ``log 0 = -inf``, and ``-inf`` above the diagonal when
    causal: with it, ``softmax(q k^T / sqrt(d) + log M~) V`` is Positional-LSH attention exactly.

    Built row by row from the band: ``M~_{i,i-r} = #{k : i - start_k(i) >= r} / s`` (keys
    before i) and ``M~_{i,i+r} = #{k : end_k(i) - i >= r} / s`` (keys after, bidirectional only),
    the logarithm taken on the band only, scattered into a ``-inf`` matrix: O(H n b_max) work
    besides filling the (H, n, n) output.
    """
    H, s, n = len(partitions), partitions[0].num_samples, partitions[0].seq_len
    bins = device_bins(partitions, device).reshape(H * s, n)
    blocks = masks.SameBlock.of(bins)
    pos = torch.arange(n, device=device)
    out = torch.full((H, n, n), NEG_INF, dtype=dtype, device=device)
    sides = [(pos - blocks.start, -1)] + ([] if causal else [(blocks.end - pos, 1)])
    for reach_all, sign in sides:
        reach_all = reach_all.reshape(H, s, n).transpose(1, 2)  # (H, n, s): how far i's block extends
        for h in range(H):  # each head's own band width: narrow heads cost little
            reach = reach_all[h]
            R = int(reach.max()) + 1
            hist = torch.zeros(n, R, dtype=dtype, device=device)
            hist.scatter_add_(-1, reach, torch.ones_like(reach, dtype=dtype))
            band = torch.log(hist.flip(-1).cumsum(-1).flip(-1) / s)  # (n, R): log M~_{i, i + sign r}
            j = pos[:, None] + sign * torch.arange(R, device=device)[None, :]  # (n, R)
            outside = (j < 0) | (j >= n)
            # entries past the sequence are sent to the diagonal with its own value, log 1 = 0
            out[h].scatter_(-1, torch.where(outside, pos[:, None], j), band.masked_fill(outside, 0.0))
    return out
