"""Attention dropout from a kernel that has none (docs/THEORY.md): the keep mask drawn cheaply from
torch's generator, and the CPU flash kernel made to drop (:class:`FlashDropout`), which the dense
bias path uses for training with ``attn_dropout`` on the CPU.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch

from poslsh_cli.attention.reference import NEG_INF


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
