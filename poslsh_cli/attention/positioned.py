"""Attention at explicit token positions: every method for queries and keys whose positions are
given per sequence, which is what a decoding step through a key/value cache needs (the other
paths assume query i and key i are both position i of one unpadded sequence); and a padded batch
without a cache run on those other paths, each sequence's real tokens alone from position 0
(:func:`attend_each_sequence`), so that padding costs what the sequences cost unpadded.

Positions come from the padding alone (:func:`positions_from_padding`: which tokens are real),
never from which keys a query may see: a key outside a sliding window is still a token.

Every method's weight is a function of the two positions alone (docs/THEORY.md, "Mask
expectation"), so it is computed from them here, as the method declares it (its score and key
mask, :mod:`poslsh_cli.numerics.methods`; :func:`~poslsh_cli.attention.reference.method_bias`):

    exact / windowed ALiBi   -|p_i - p_j| / sigma_h  (-inf beyond the window)
    Positional LSH           log #{k : h_k(p_i) = h_k(p_j)} / s  with h_k(p) = floor((p + u_k) / delta_k)
    fixed blocks             0 in the same block, -inf otherwise (one partition, u = 0)
    no bias                  0

A Positional-LSH hash is defined for every integer position (one width and one shift per
sample), so the masks a prefix sees do not depend on how long the sequence becomes: a token
decoded through the cache meets the weights the full forward gives it. ``allowed`` (causal and
padding, from the caller) drops keys; the softmax runs as SDPA with the float bias, one chunk of
queries at a time, so memory is O(B H chunk n_keys).
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from poslsh_cli.attention.dense import bias_dtype
from poslsh_cli.attention.reference import NEG_INF, method_bias, scale_of
from poslsh_cli.attention.api import attend

#: queries per SDPA call (bounds the (B, H, chunk, n) bias)
QUERY_CHUNK = 256


def position_bias(spec: "object", q_pos: torch.Tensor, k_pos: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The additive logit bias of ``spec``'s method between query positions ``q_pos`` (B, m) and
    key positions ``k_pos`` (B, n), int64: (B, H, m, n) in ``dtype`` (``-inf`` for a dropped pair);
    :func:`~poslsh_cli.attention.reference.method_bias`, which raises for an unknown method. ``spec``
    is an :class:`~poslsh_cli.attention.api.AttentionSpec`; its causal flag is not applied here (the
    caller's ``allowed`` is)."""
    return method_bias(spec, q_pos, k_pos, dtype)


def positioned_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: "object", q_pos: torch.Tensor,
                         k_pos: torch.Tensor, allowed: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """``spec``'s method for queries at positions ``q_pos`` against keys at ``k_pos``.

    Args:
        q: (B, H, m, d) queries; k, v: (B, H, n, d) keys and values (the same number of heads).
        spec: an :class:`~poslsh_cli.attention.api.AttentionSpec` (method, sigmas, partitions or
            window); partitions are used through their widths and shifts only, at any position.
        q_pos, k_pos: (B, m), (B, n) int64 positions (each sequence counted from its first token).
        allowed: (B, m, n) bool, the keys each query may see (causal and padding). A query that
            may see none (a padding position) attends to every key; its output means nothing.
        scale: logit scale (None: 1/sqrt(d)).

    Returns (B, H, m, d) in q's dtype (differentiable in q, k, v).
    """
    sc = scale_of(q.shape[-1], scale)
    dtype = bias_dtype(q.dtype)
    outs = []
    for c in range(0, q.shape[-2], QUERY_CHUNK):
        sl = slice(c, c + QUERY_CHUNK)
        bias = position_bias(spec, q_pos[:, sl], k_pos, dtype).masked_fill(~allowed[:, None, sl], NEG_INF)
        empty = ~torch.isfinite(bias).any(-1, keepdim=True)  # padding queries: no key to see
        bias = torch.where(empty, torch.zeros((), dtype=dtype, device=bias.device), bias)
        outs.append(torch.nn.functional.scaled_dot_product_attention(q[:, :, sl], k, v, attn_mask=bias.to(q.dtype),
                                                                     scale=sc))
    return torch.cat(outs, dim=2)


def positions_from_padding(padding: torch.Tensor | None, batch: int, m: int, n: int, device: torch.device | str,
                           tokens: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Query positions (B, m) and key positions (B, n): the m queries are the last m tokens and the
    n keys the last n (a cache may have dropped earlier ones, a sliding window's) of the L tokens so
    far; real tokens are numbered 0, 1, ... in order (left and right padding alike).

    ``padding``: None (no padding: positions 0 .. L-1, L = ``tokens``, or n when None) or (B, L)
    bool/int, the model's 2-D ``attention_mask`` (1: a real token) over every token so far,
    L >= n. A padding token gets the position of the real token before it, 0 before the first
    (what it attends to counts for nothing).
    """
    if padding is None:
        L = n if tokens is None else tokens
        if L < max(m, n):
            raise ValueError(f"{L} tokens so far cannot hold {n} keys")
        pos = torch.arange(L, device=device).expand(batch, L)
        return pos[:, L - m:], pos[:, L - n:]
    L = padding.shape[-1]
    if padding.shape[0] != batch or L < max(m, n):
        raise ValueError(f"a padding mask of shape {tuple(padding.shape)} does not describe {batch} sequences "
                         f"with {n} keys")
    pos = (padding.to(device=device, dtype=torch.bool).long().cumsum(-1) - 1).clamp(min=0)  # (B, L)
    return pos[:, L - m:], pos[:, L - n:]


def allowed_from_mask(mask: torch.Tensor | None, batch: int, m: int, n: int,
                      device: torch.device | str) -> torch.Tensor:
    """The keys each query may see, (B, m, n) bool, from a transformers attention mask: None (the
    m queries are the last m of the n keys, causal) or the (B, 1, m, n) mask transformers builds
    (bool, True: attend; or additive float, 0: attend), with causality, padding and any window in it."""
    if mask is None:
        j = torch.arange(n, device=device)
        return (j[None, :] <= j[n - m:, None]).expand(batch, m, n)
    if mask.dtype != torch.bool:  # an additive float mask: 0 keeps, -inf (or the dtype's min) drops
        mask = mask == 0
    return mask[:, 0].expand(batch, m, n)


def is_causal_padding(allowed: torch.Tensor, padding: torch.Tensor | None) -> bool:
    """Whether ``allowed`` (B, n, n) lets every real query of ``padding`` (B, n) (None: all real)
    see every real key up to itself: for a mask inside causal attention over the real tokens (what
    transformers builds: causality and padding, and-ed with any window), that it is exactly that
    and nothing else restricts it, so each sequence may run alone (:func:`attend_each_sequence`).
    Compares each real query's number of visible keys with its number of real keys so far."""
    B, n = allowed.shape[0], allowed.shape[-1]
    real = torch.ones(B, n, dtype=torch.bool, device=allowed.device) if padding is None \
        else padding.to(device=allowed.device, dtype=torch.bool)
    seen = allowed.sum(-1)  # (B, n): keys each query may see
    return bool(((seen == real.long().cumsum(-1)) | ~real).all())


def attend_each_sequence(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, padding: torch.Tensor,
                         spec_at: Callable[[int], Any], **attend_kwargs: Any) -> torch.Tensor:
    """Causal attention of a padded batch as each sequence's real tokens alone, from position 0,
    in one call of :func:`~poslsh_cli.attention.api.attend` (its fast path).

    Row b's r_b real tokens (``padding[b]``, any pattern) are moved to the front, in order, and the
    batch runs at the longest real length R = max_b r_b with ``spec_at(R)``: a real query i < r_b
    sees keys j <= i only, all real, and every method's weight between positions i and j does not
    depend on the length (docs/THEORY.md, "Mask expectation"), so row b gets what its sequence
    gets alone. The outputs are put back in the real tokens' columns. Costs what the sequences
    cost unpadded, where the positioned path costs O(s n^2).

    Args:
        q, k, v: (B, H, n, d), one token per column of ``padding``.
        padding: (B, n) bool/int, 1: a real token.
        spec_at: the causal :class:`~poslsh_cli.attention.api.AttentionSpec` at a length.
        attend_kwargs: passed to ``attend`` (backend, on_plan, dropout).

    Returns (B, H, n, d) in q's dtype; 0 at padding queries.
    """
    real = padding.to(device=q.device, dtype=torch.bool)
    counts = real.sum(-1)  # (B,)
    R = int(counts.max()) if counts.numel() else 0
    out = q.new_zeros(*q.shape[:-1], v.shape[-1])
    if R == 0:
        return out
    cols = torch.sort((~real).to(torch.int8), dim=-1, stable=True).indices[:, :R]  # (B, R): real columns first
    take = (torch.arange(q.shape[0], device=q.device)[:, None], slice(None), cols)  # (B, H, n, d) as (B, R, H, d)
    o = attend(*(t[take].transpose(1, 2) for t in (q, k, v)), spec_at(R), **attend_kwargs)  # (B, H, R, d)
    is_real = torch.arange(R, device=q.device)[None, :] < counts[:, None]  # (B, R): else a padding column
    out[take] = torch.where(is_real[:, :, None, None], o.transpose(1, 2), 0.0)
    return out
