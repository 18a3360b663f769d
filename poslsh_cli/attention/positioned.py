"""Attention at explicit token positions: every method for queries and keys whose positions are
given per sequence, which is what a padded batch and a decoding step through a key/value cache
need (the other paths assume query i and key i are both position i of one unpadded sequence).

Every method's weight is a function of the two positions alone (docs/THEORY.md, "Mask
expectation"), so it is computed from them here:

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

import torch

from poslsh_cli.attention.dense import bias_dtype
from poslsh_cli.attention.reference import NEG_INF, alibi_slopes, scale_of
from poslsh_cli.numerics.methods import Method

#: queries per SDPA call (bounds the (B, H, chunk, n) bias)
QUERY_CHUNK = 256


def position_bias(spec: "object", q_pos: torch.Tensor, k_pos: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The additive logit bias of ``spec``'s method between query positions ``q_pos`` (B, m) and
    key positions ``k_pos`` (B, n), int64: (B, H, m, n) in ``dtype`` (``-inf`` for a dropped pair).
    ``spec`` is an :class:`~poslsh_cli.attention.api.AttentionSpec`; its causal flag is not applied
    here (the caller's ``allowed`` is)."""
    H = spec.sigmas.shape[0]
    B, m, n = q_pos.shape[0], q_pos.shape[1], k_pos.shape[1]
    device = q_pos.device
    if spec.method in (Method.EXACT, Method.WINDOWED):
        dist = (q_pos[:, :, None] - k_pos[:, None, :]).abs()  # (B, m, n)
        slopes = alibi_slopes(spec.sigmas, dtype, device)
        bias = -slopes[None, :, None, None] * dist[:, None].to(dtype)
        if spec.window is not None:
            w = torch.as_tensor(spec.window, device=device)[None, :, None, None]
            bias = bias.masked_fill(dist[:, None] > w, NEG_INF)
        return bias
    if spec.partitions is not None:
        widths, shifts = (torch.as_tensor(a, dtype=torch.float64, device=device) for a in spec.bin_table)
        s = widths.shape[1]

        def bins(pos: torch.Tensor) -> torch.Tensor:  # (B, L) -> (B, H, s, L): the same float64 expression as
            # poslsh_cli.attention.blocks.device_bins, so a position's bin is the one the other paths give it
            return torch.floor((pos.to(torch.float64)[:, None, None, :] + shifts[None, :, :, None])
                               / widths[None, :, :, None]).to(torch.int64)

        bq, bk = bins(q_pos), bins(k_pos)
        count = torch.zeros(B, H, m, n, dtype=dtype, device=device)
        for k in range(s):
            count += (bq[:, :, k, :, None] == bk[:, :, k, None, :]).to(dtype)
        return torch.log(count / s)  # log 0 = -inf: no sample puts the pair in one block
    return torch.zeros(B, H, m, n, dtype=dtype, device=device)


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


def positions_from_mask(mask: torch.Tensor | None, batch: int, m: int, n: int,
                        device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Query positions (B, m), key positions (B, n) and the keys each query may see (B, m, n) from
    a transformers attention mask.

    ``mask``: None (no padding: the m queries are the last m of the n keys, causal) or the boolean
    (B, 1, m, n) mask transformers builds from ``attention_mask`` and the cache (True: attend;
    causal, padding and any window already in it). A key that no query may see is padding; the
    others are numbered 0, 1, ... in order (left and right padding alike), and a query has the
    position of the last key it may see, itself.
    """
    if mask is None:
        k_pos = torch.arange(n, device=device).expand(batch, n)
        q_pos = k_pos[:, n - m:]
        allowed = (k_pos[:, None, :] <= q_pos[:, :, None])
        return q_pos, k_pos, allowed
    if mask.dtype != torch.bool:  # an additive float mask: 0 keeps, -inf (or the dtype's min) drops
        mask = mask == 0
    allowed = mask[:, 0].expand(batch, m, n)
    real = allowed.any(1)  # (B, n): keys some query may see
    k_pos = (real.cumsum(-1) - 1).clamp(min=0)
    last = torch.where(allowed, torch.arange(n, device=mask.device), -1).amax(-1).clamp(min=0)  # (B, m)
    q_pos = k_pos.gather(1, last)
    return q_pos, k_pos, allowed
