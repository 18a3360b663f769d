"""One dense attention with an additive (H, n, n) bias: the training path at short lengths.

    exact / windowed ALiBi   bias -|i-j| / sigma_h (-inf outside the window)
    Positional LSH           bias log M~ (log 0 = -inf), so softmax(q k^T * scale + log M~) V
                             = D~^-1 (A o M~) V exactly (docs/THEORY.md, "Training identity")
    any declared method      its score, -inf where its key mask drops a pair (:func:`score_bias`)

Causal masks are folded into the bias (-inf above the diagonal). At training lengths this costs
one attention whatever the number of samples s is; the memory is O(H n^2).
"""
from __future__ import annotations

import functools
from typing import Sequence

import torch

from poslsh_cli.numerics import masks
from poslsh_cli.attention.dropout import FlashDropout, keep_mask
from poslsh_cli.attention.plan import needs_grad
from poslsh_cli.attention.reference import NEG_INF, alibi_distance_bias, method_bias, slopes_from_sigmas, scale_of
from poslsh_cli.numerics.sampling import Partitions
from poslsh_cli.attention.band import BandLayout


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
            need gradients it runs :class:`~poslsh_cli.attention.dropout.FlashDropout` (the probability rounded to a multiple of
            2^-16, 0.1 -> 0.1000061), elsewhere SDPA's own ``dropout_p`` (its fused CUDA kernels).

    Returns (B, H, n, d) in q's dtype.
    """
    sc = scale_of(q.shape[-1], scale)
    mask = bias[None].to(q.dtype)
    if dropout > 0 and q.device.type == "cpu" and q.dtype in (torch.float32, torch.float64) and needs_grad(q, k, v):
        keep, p = keep_mask(q.shape[:2] + bias.shape[-2:], dropout, q.device)
        return FlashDropout.apply(q, k, v, mask, keep, p, sc)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=sc, dropout_p=dropout)


def alibi_bias(n: int, sigmas: torch.Tensor, causal: bool, window: int | Sequence[int] | None = None,
               device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The ALiBi bias ``-m_h |i-j|`` (``m_h = 1 / sigma_h``), (H, n, n) in ``dtype``, ``-inf`` where the causal or
    window mask drops a key. It depends only on its arguments, so the last few are cached
    (training rebuilds it in every layer at every step otherwise); treat it as read-only."""
    sigmas = tuple(float(x) for x in sigmas.reshape(-1))
    win = None if window is None else tuple(int(w) for w in torch.as_tensor(window).reshape(-1).expand(len(sigmas)))
    return _alibi_bias(n, sigmas, causal, win, str(device), dtype)


@functools.lru_cache(maxsize=8)
def _alibi_bias(n: int, sigmas: tuple[float, ...], causal: bool, window: tuple[int, ...] | None, device: str,
                dtype: torch.dtype) -> torch.Tensor:
    H = len(sigmas)
    i = torch.arange(n, device=device)
    bias = alibi_distance_bias(i, i, slopes_from_sigmas(sigmas, dtype, device))  # (H, n, n)
    keep = masks.combine(causal, None if window is None else masks.Window.of(window, H, device))
    return bias if keep is None else bias.masked_fill(~keep.grid(i, i, H), NEG_INF)


def poslsh_bias(partitions: Sequence[Partitions], causal: bool, device: torch.device | str = "cpu",
                dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``log M~`` (H, n, n) in ``dtype`` with ``log 0 = -inf``, and ``-inf`` above the diagonal when
    causal: with it, ``softmax(q k^T / sqrt(d) + log M~) V`` is Positional-LSH attention exactly.

    ``log (C / s)`` from each position's sorted block starts and ends
    (:meth:`~poslsh_cli.attention.band.BandLayout.dense_bias`: ``C_ij = #{k : start_k(i) <= j}`` before i,
    ``#{k : end_k(i) >= j}`` after), each row filled segment by segment: O(H s n) work to count besides
    filling the output.
    """
    return BandLayout.of(partitions, causal, device).dense_bias(dtype, mean=True)


def score_bias(spec: "object", n: int, device: torch.device | str = "cpu",
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The (H, n, n) bias of any declared method (``spec``: an
    :class:`~poslsh_cli.attention.api.AttentionSpec`) from its score and key mask
    (:func:`~poslsh_cli.attention.reference.method_bias`), ``-inf`` above the diagonal when causal."""
    i = torch.arange(n, device=device)
    bias = method_bias(spec, i[None], i[None], dtype)[0]
    return bias.masked_fill(~masks.Causal().grid(i, i, 1)[0], NEG_INF) if spec.causal else bias
