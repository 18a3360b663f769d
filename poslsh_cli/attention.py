"""Attention with ALiBi, Positional-LSH attention, and the baselines (DESIGN.md sections 1-2).

All operators take SDPA-layout tensors ``q, k, v`` of shape (batch, heads, seq_len, head_dim)
and one kernel bandwidth per head, ``sigmas`` (heads,), ``sigma_h = 1 / slope_h``. With
``A_ij = exp(q_i . k_j / sqrt(d))``:

    exact ALiBi        T* = D^-1 (A o L*) V   = softmax(q k^T / sqrt(d) - |i-j| / sigma) V
    Positional LSH     T~ = D~^-1 (A o M~) V,  M~ = (1/s) sum_k M(h_k)

``T~`` is computed as s block-local, bias-free attentions: inside every block of every sample,
ordinary (causal, if asked) attention with its natural-log ``lse``; then per position
``T~_i = sum_k exp(lse_k,i) O_k,i / sum_k exp(lse_k,i)``. Every position shares a block with
itself, so no denominator is zero. All blocks of all samples and heads are batched: they are
grouped by length into a few buckets (padding at most doubles a block), so the work is a few
batched matmuls, with no Python loop over blocks.

Paths are chosen in one place, :func:`exact_alibi`; ``backend="reference"`` (float64, dense) is
the test oracle. On CUDA the exact path uses FlexAttention with an ALiBi ``score_mod`` (never an
n x n tensor); on CPU a chunked path keeps memory at O(chunk x n).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from poslsh_cli.sampling import Partitions

_NEG_INF = float("-inf")


def _scale(head_dim: int, scale: float | None) -> float:
    return 1.0 / math.sqrt(head_dim) if scale is None else float(scale)


def _as_sigmas(sigmas: Sequence[float] | torch.Tensor | np.ndarray, heads: int) -> torch.Tensor:
    s = torch.as_tensor(np.asarray(sigmas, dtype=np.float64)).reshape(-1)
    if s.numel() == 1:
        s = s.expand(heads)
    if s.numel() != heads:
        raise ValueError(f"need one sigma per head ({heads}), got {s.numel()}")
    if not torch.all(s > 0):
        raise ValueError("sigmas must be > 0")
    return s


# ---------------------------------------------------------------------------------------------
# reference (float64, dense): the oracle for tests


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, weight: torch.Tensor | None,
                        causal: bool, scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``D^-1 (A o W) V`` in float64 with a dense nonnegative weight W, shape (H, n, n) or (n, n).

    W = L* gives exact ALiBi; W = M~ gives Positional LSH; W = None gives no bias. Returns
    ``(out (B, H, n, d), lse (B, H, n))`` with ``lse = log sum_j A_ij W_ij``.
    """
    q, k, v = q.double(), k.double(), v.double()
    n = q.shape[-2]
    scores = (q @ k.transpose(-1, -2)) * _scale(q.shape[-1], scale)  # (B, H, n, n)
    if weight is not None:
        scores = scores + torch.log(weight.double())  # log 0 = -inf drops the pair
    if causal:
        future = torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(future, _NEG_INF)
    lse = torch.logsumexp(scores, dim=-1)
    return torch.softmax(scores, dim=-1) @ v, lse


def laplacian_weight(n: int, sigmas: torch.Tensor, device: torch.device | str = "cpu") -> torch.Tensor:
    """Dense ``L*`` per head, (H, n, n) float64 (tests and small references only)."""
    i = torch.arange(n, device=device, dtype=torch.float64)
    dist = (i[:, None] - i[None, :]).abs()
    return torch.exp(-dist[None] / sigmas.to(device=device, dtype=torch.float64)[:, None, None])


# ---------------------------------------------------------------------------------------------
# exact ALiBi and the windowed baseline, without n x n tensors


def alibi_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sigmas: torch.Tensor, causal: bool,
                  window: int | Sequence[int] | None = None, chunk: int = 512, scale: float | None = None,
                  return_lse: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Exact ALiBi attention by query chunks: memory O(B H chunk n), never (n, n) at once.

    With ``window=w`` (one int, or one per head) only keys with ``|i - j| <= w`` are kept
    (windowed exact ALiBi) and each chunk touches only ``chunk + 2 max(w)`` keys, so the cost is
    O(n (chunk + w) d).
    Softmax statistics are kept in float32 at least.
    """
    B, H, n, d = q.shape
    sc = _scale(d, scale)
    slopes = (1.0 / sigmas).to(device=q.device, dtype=torch.float32)[:, None, None]  # (H, 1, 1)
    acc = torch.promote_types(q.dtype, torch.float32)
    out = torch.empty_like(q)
    lse_all = torch.empty(B, H, n, device=q.device, dtype=acc) if return_lse else None
    pos = torch.arange(n, device=q.device)
    w_max = None
    if window is not None:
        w_head = torch.as_tensor(window, device=q.device).reshape(-1).expand(H)[:, None, None]  # (H, 1, 1)
        w_max = int(w_head.max())
    for a in range(0, n, chunk):
        b = min(n, a + chunk)
        lo = 0 if window is None else max(0, a - w_max)
        hi = b if causal else (n if window is None else min(n, b + w_max))
        qi, kj = pos[a:b], pos[lo:hi]
        dist = (qi[:, None] - kj[None, :]).abs().to(acc)  # (c, m)
        drop = torch.zeros_like(dist, dtype=torch.bool)
        if causal:
            drop = drop | (kj[None, :] > qi[:, None])
        if window is not None:
            drop = drop | (dist > w_head)  # (H, c, m)
        bias = (-slopes.to(acc) * dist).masked_fill(drop, _NEG_INF)  # (H, c, m)
        if not return_lse and q.dtype == acc:
            # fused kernel (flash on CPU, memory-efficient on CUDA) with the bias as a float mask
            out[:, :, a:b] = torch.nn.functional.scaled_dot_product_attention(
                q[:, :, a:b], k[:, :, lo:hi], v[:, :, lo:hi], attn_mask=bias[None].to(q.dtype), scale=sc)
            continue
        scores = (q[:, :, a:b] @ k[:, :, lo:hi].transpose(-1, -2)).to(acc) * sc + bias  # (B, H, c, m)
        lse = torch.logsumexp(scores, dim=-1, keepdim=True)
        p = torch.exp(scores - lse)
        out[:, :, a:b] = (p.to(v.dtype) @ v[:, :, lo:hi]).to(q.dtype)
        if return_lse:
            lse_all[:, :, a:b] = lse[..., 0]
    return (out, lse_all) if return_lse else out


def alibi_flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sigmas: torch.Tensor, causal: bool,
               window: int | None = None, scale: float | None = None, compile: bool = True) -> torch.Tensor:
    """Exact (or windowed) ALiBi with FlexAttention: a ``score_mod`` adds ``-|i-j|/sigma_h``.

    Compiled on CUDA (fused kernel, no n x n tensor); uncompiled it runs anywhere (tests).
    """
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    B, H, n, d = q.shape
    slopes = (1.0 / sigmas).to(device=q.device, dtype=torch.float32)

    def score_mod(score, b, h, qi, kj):  # noqa: ANN001
        return score - slopes[h] * (qi - kj).abs().to(score.dtype)

    block_mask = None
    if causal or window is not None:
        def mask_mod(b, h, qi, kj):  # noqa: ANN001
            keep = qi >= 0
            if causal:
                keep = keep & (kj <= qi)
            if window is not None:
                keep = keep & ((qi - kj).abs() <= window)
            return keep

        block_mask = create_block_mask(mask_mod, None, None, n, n, device=q.device)
    fn = _compiled_flex() if compile else flex_attention
    return fn(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=_scale(d, scale))


_FLEX = None


def _compiled_flex():  # noqa: ANN202
    global _FLEX
    if _FLEX is None:
        from torch.nn.attention.flex_attention import flex_attention

        _FLEX = torch.compile(flex_attention, dynamic=False)
    return _FLEX


def exact_alibi(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sigmas: Sequence[float] | torch.Tensor,
                causal: bool, window: int | None = None, backend: str = "auto",
                scale: float | None = None) -> torch.Tensor:
    """Exact (``window=None``) or windowed ALiBi attention; the one place a path is chosen.

    backend: ``auto`` (FlexAttention on CUDA, chunked elsewhere), ``flex``, ``chunked``, or
    ``reference`` (float64 dense; tests only).
    """
    sig = _as_sigmas(sigmas, q.shape[1])
    if backend == "auto":
        backend = "flex" if q.is_cuda else "chunked"
    if backend == "reference":
        w = laplacian_weight(q.shape[-2], sig, q.device)
        if window is not None:
            i = torch.arange(q.shape[-2], device=q.device)
            w = w * ((i[:, None] - i[None, :]).abs() <= window)
        return reference_attention(q, k, v, w, causal, scale)[0].to(q.dtype)
    if backend == "flex":
        return alibi_flex(q, k, v, sig, causal, window, scale, compile=q.is_cuda)
    if backend == "chunked":
        return alibi_chunked(q, k, v, sig, causal, window, scale=scale)
    raise ValueError(f"unknown backend {backend!r}")


def no_bias_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                      scale: float | None = None) -> torch.Tensor:
    """``softmax(q k^T / sqrt(d)) V`` (PyTorch SDPA: flash/memory-efficient kernels where available)."""
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                            scale=_scale(q.shape[-1], scale))


# ---------------------------------------------------------------------------------------------
# Positional-LSH attention


@dataclass(frozen=True)
class BlockLayout:
    """Where every block of every (head, sample) lives, grouped into length buckets.

    For bucket b: ``index[b]`` (num_blocks_b, L_b) int64 flat positions ``(h*s + k)*n + i``
    into the per-(head, sample) copies of the sequence (padding repeats the block's last
    position) and ``valid[b]`` (num_blocks_b, L_b) bool.
    Every (head, sample, position) is a real slot of exactly one block.
    """

    heads: int
    num_samples: int
    seq_len: int
    index: tuple[torch.Tensor, ...]
    valid: tuple[torch.Tensor, ...]
    padded_slots: int  # total slots computed, padding included
    useful_pairs: int  # sum over blocks of L^2 (bidirectional work)

    @classmethod
    def build(cls, partitions: Sequence[Partitions], device: torch.device | str = "cpu") -> "BlockLayout":
        heads = len(partitions)
        s, n = partitions[0].num_samples, partitions[0].seq_len
        if any(p.num_samples != s or p.seq_len != n for p in partitions):
            raise ValueError("every head needs the same seq_len and number of samples")
        starts, lengths, owner = [], [], []
        for h, p in enumerate(partitions):
            for k, off in enumerate(p.offsets):
                starts.append(off[:-1])
                lengths.append(np.diff(off))
                owner.append(np.full(off.size - 1, h * s + k, dtype=np.int64))
        starts_a = np.concatenate(starts)
        lengths_a = np.concatenate(lengths)
        owner_a = np.concatenate(owner)
        # bucket by the power of two at or above the length: padding < 2x inside a bucket
        bucket = np.ceil(np.log2(lengths_a)).astype(np.int64)
        index, valid = [], []
        offset = 0
        for b in np.unique(bucket):
            sel = np.flatnonzero(bucket == b)
            L = int(lengths_a[sel].max())
            ar = np.arange(L)
            ok = ar[None, :] < lengths_a[sel, None]  # (nb, L)
            pos = starts_a[sel, None] + np.minimum(ar[None, :], lengths_a[sel, None] - 1)
            flat = owner_a[sel, None] * n + pos  # (nb, L)
            offset += sel.size * L
            index.append(torch.as_tensor(flat, device=device))
            valid.append(torch.as_tensor(ok, device=device))
        return cls(heads, s, n, tuple(index), tuple(valid), offset,
                   int((lengths_a.astype(np.int64) ** 2).sum()))


#: Upper bound on the bytes of one batch of gathered blocks (q, k, v copies and scores): large
#: buckets are processed in several batches, so memory stays O(s n d), not O(padded slots x d x 3).
BLOCK_BATCH_BYTES = 64 * 2**20


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: BlockLayout, causal: bool,
                    scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Bias-free attention inside every block of every sample; outputs per sample, not merged.

    Returns ``out (B, H, s, n, d)`` in q's dtype and ``lse (B, H, s, n)`` (float32 or wider,
    natural log).
    """
    B, H, n, d = q.shape
    s = layout.num_samples
    sc = _scale(d, scale)
    acc = torch.promote_types(q.dtype, torch.float32)
    out = q.new_empty(B, H * s * n, d)  # every (head, sample, position) is written exactly once
    lse = torch.empty(B, H * s * n, dtype=acc, device=q.device)
    # every (head, sample) block gathers its rows from the (B, H*n, d) flattening of q, k, v:
    # flat layout index (h*s + k)*n + i -> h*n + i
    qf, kf, vf = (t.reshape(B, H * n, d) for t in (q, k, v))
    for idx, ok in zip(layout.index, layout.valid):
        nb, L = idx.shape
        per_block = B * L * (3 * d * q.element_size() + 2 * L * 4)
        step = max(1, BLOCK_BATCH_BYTES // per_block)
        for a in range(0, nb, step):
            bi, bok = idx[a:a + step], ok[a:a + step]  # (m, L)
            src = (bi // (s * n)) * n + bi % n  # (m, L) rows of the (H*n) flattening
            o, l = _block_kernel(qf[:, src], kf[:, src], vf[:, src], bok, causal, sc)  # (B, m, L, d), (B, m, L)
            target = bi[bok]  # real slots -> their (head, sample, position)
            out[:, target] = o[:, bok]
            lse[:, target] = l[:, bok]
    return out.reshape(B, H, s, n, d), lse.reshape(B, H, s, n)


#: Which kernel runs the attention inside blocks: "auto" (the fused CPU flash kernel, which also
#: returns lse, when no gradient is needed; the padded-matmul path otherwise), "fused" or "manual".
BLOCK_KERNEL = "auto"


def _block_kernel(qb: torch.Tensor, kb: torch.Tensor, vb: torch.Tensor, ok: torch.Tensor, causal: bool,
                  sc: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention inside padded blocks: ``qb, kb, vb`` (B, nb, L, d), ``ok`` (nb, L) real keys.

    Returns ``(out (B, nb, L, d) in q's dtype, lse (B, nb, L) float32 or wider)``. Padding sits at
    the end of each block, so with causal attention no real query ever sees a padded key.
    """
    B, nb, L, d = qb.shape
    acc = torch.promote_types(qb.dtype, torch.float32)
    grad = torch.is_grad_enabled() and (qb.requires_grad or kb.requires_grad or vb.requires_grad)
    fused = BLOCK_KERNEL == "fused" or (BLOCK_KERNEL == "auto" and not grad and qb.device.type == "cpu")
    if fused:
        mask = None
        if not causal and not bool(ok.all()):
            mask = torch.zeros(nb, 1, L, dtype=qb.dtype, device=qb.device).masked_fill(~ok[:, None, :], _NEG_INF)
            mask = mask[None].expand(B, nb, L, L)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            qb, kb, vb, 0.0, causal, attn_mask=mask, scale=sc)
        return out, lse.to(acc)
    scores = (qb @ kb.transpose(-1, -2)).to(acc) * sc  # (B, nb, L, L)
    keep = ok[:, None, :]  # keys that are real positions
    if causal:
        keep = keep & torch.ones(L, L, dtype=torch.bool, device=qb.device).tril()
    scores = scores.masked_fill(~keep, _NEG_INF)
    lse = torch.logsumexp(scores, dim=-1)  # (B, nb, L)
    p = torch.exp(scores - lse[..., None])
    return (p.to(vb.dtype) @ vb).to(qb.dtype), lse


def merge_by_lse(out: torch.Tensor, lse: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge attention results over ``dim`` by their natural-log normalisers.

    ``out`` (..., K, n, d) and ``lse`` (..., K, n) with K at ``dim`` (counted on ``lse``):
    ``sum_k exp(lse_k - LSE) out_k`` with ``LSE = logsumexp_k lse_k``; returns ``(merged, LSE)``.
    Merging attention over disjoint key sets this way equals attention over their union.
    Without autograd (inference) ``out`` is weighted in place to avoid a second (K, n, d) buffer.
    """
    total = torch.logsumexp(lse, dim=dim, keepdim=True)
    w = torch.exp(lse - total).unsqueeze(-1)  # (..., K, n, 1)
    odim = dim if dim >= 0 else dim - 1
    if torch.is_grad_enabled() and (out.requires_grad or lse.requires_grad) or out.dtype != w.dtype:
        merged = (w * out.to(w.dtype)).sum(dim=odim)
    else:  # inference: weight in place, no (..., K, n, d) temporary
        merged = out.mul_(w).sum(dim=odim)
    return merged.to(out.dtype), total.squeeze(dim)


def poslsh_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, partitions: Sequence[Partitions],
                     causal: bool, scale: float | None = None, layout: BlockLayout | None = None,
                     sample_chunk: int | None = None, backend: str = "auto") -> torch.Tensor:
    """Positional-LSH attention ``D~^-1 (A o M~) V`` with one :class:`Partitions` per head.

    backend: ``blocks`` (length-bucketed padded blocks, any device, differentiable), ``flex``
    (FlexAttention with the bins as document ids, :func:`poslsh_flex`), or ``auto`` (flex on
    CUDA for inference, blocks otherwise). ``sample_chunk`` bounds memory: samples are processed
    that many at a time and merged online (default: all at once).
    """
    if backend == "auto":
        grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
        backend = "flex" if q.is_cuda and not grad and layout is None else "blocks"
    if backend == "flex":
        return poslsh_flex(q, k, v, partitions, causal, scale)
    if backend != "blocks":
        raise ValueError(f"unknown backend {backend!r}")
    if layout is None:
        if sample_chunk is None or sample_chunk >= partitions[0].num_samples:
            layout = BlockLayout.build(partitions, q.device)
        else:
            s = partitions[0].num_samples
            acc_out, acc_lse = None, None
            for a in range(0, s, sample_chunk):
                part = [Partitions(p.seq_len, p.sigma, p.widths[a:a + sample_chunk], p.shifts[a:a + sample_chunk])
                        for p in partitions]
                o, l = block_attention(q, k, v, BlockLayout.build(part, q.device), causal, scale)
                o, l = merge_by_lse(o, l, dim=2)
                if acc_out is None:
                    acc_out, acc_lse = o, l
                else:
                    acc_out, acc_lse = merge_by_lse(torch.stack([acc_out, o], 2), torch.stack([acc_lse, l], 2), 2)
            return acc_out
    out, lse = block_attention(q, k, v, layout, causal, scale)
    return merge_by_lse(out, lse, dim=2)[0]


def _doc_block_mask(doc: torch.Tensor, causal: bool, tile: int = 128):  # noqa: ANN202
    """FlexAttention ``BlockMask`` for "same block" attention, built from the block structure.

    ``doc`` (G, n) int64 block ids per (head, sample) group, non-decreasing along n. A query tile
    ``[a, a+tile)`` meets exactly the key tiles spanned by its first block's start and its last
    block's end, so the kv-tile lists come straight from the boundaries, in O(G n / tile) memory
    (``create_block_mask`` would evaluate the mask on every (query, key) tile pair).
    """
    from torch.nn.attention.flex_attention import BlockMask

    G, n = doc.shape
    tiles = (n + tile - 1) // tile
    pos = torch.arange(n, device=doc.device)
    # first position of each position's block, and one past its last
    new_block = torch.ones_like(doc, dtype=torch.bool)
    new_block[:, 1:] = doc[:, 1:] != doc[:, :-1]
    start = torch.where(new_block, pos, torch.zeros_like(pos)).cummax(dim=1).values  # (G, n)
    last = torch.ones_like(doc, dtype=torch.bool)
    last[:, :-1] = doc[:, :-1] != doc[:, 1:]
    end = torch.where(last, pos + 1, torch.full_like(pos, n + 1))
    end = torch.flip(torch.flip(end, [1]).cummin(dim=1).values, [1])  # (G, n) block end (exclusive)
    q_first = torch.arange(tiles, device=doc.device) * tile
    q_last = torch.clamp(q_first + tile - 1, max=n - 1)
    kv_lo = start[:, q_first] // tile  # (G, tiles)
    kv_hi = (end[:, q_last] - 1) // tile
    if causal:
        kv_hi = torch.minimum(kv_hi, torch.arange(tiles, device=doc.device))
    count = (kv_hi - kv_lo + 1).to(torch.int32)
    width = int(count.max())
    idx = kv_lo[..., None] + torch.arange(width, device=doc.device)
    idx = torch.minimum(idx, kv_hi[..., None]).to(torch.int32)  # (G, tiles, width)

    def mask_mod(b, h, qi, kj):  # noqa: ANN001
        keep = doc[h, qi] == doc[h, kj]
        return keep & (kj <= qi) if causal else keep

    return BlockMask.from_kv_blocks(count[None], idx[None], BLOCK_SIZE=tile, mask_mod=mask_mod,
                                    seq_lengths=(n, n))


def poslsh_flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, partitions: Sequence[Partitions], causal: bool,
                scale: float | None = None, compile: bool | None = None) -> torch.Tensor:
    """Positional-LSH attention with FlexAttention: each (head, sample) is one query head whose
    mask keeps keys in the same block (the sampled bins are document ids), ``lse`` returned by
    the kernel, then the merge. Key/value heads are shared across samples through grouped-query
    attention (query head ``h*s + k`` reads kv head ``h``), so only q is repeated s times.
    Compiled on CUDA; uncompiled (dense, slow) elsewhere, which is how the tests check it.
    """
    from torch.nn.attention.flex_attention import AuxRequest, flex_attention

    B, H, n, d = q.shape
    s = partitions[0].num_samples
    doc = torch.as_tensor(np.stack([p.bins() for p in partitions]).reshape(H * s, n), device=q.device)
    block_mask = _doc_block_mask(doc, causal)
    qs = q.unsqueeze(2).expand(B, H, s, n, d).reshape(B, H * s, n, d)  # (B, H*s, n, d)
    fn = _compiled_flex() if (q.is_cuda if compile is None else compile) else flex_attention
    out, aux = fn(qs, k, v, block_mask=block_mask, scale=_scale(d, scale), enable_gqa=True,
                  return_aux=AuxRequest(lse=True))
    return merge_by_lse(out.reshape(B, H, s, n, d), aux.lse.reshape(B, H, s, n).float(), dim=2)[0]


def fixed_block_partitions(seq_len: int, sigmas: Sequence[float]) -> list[Partitions]:
    """The paper's fixed-block baseline: one deterministic partition per head, width round(2 sigma), aligned at 0."""
    return [Partitions(seq_len, float(sg), np.asarray([float(max(1, round(2 * sg)))]), np.zeros(1))
            for sg in np.asarray(sigmas, dtype=np.float64).reshape(-1)]


def mean_mask_weight(partitions: Sequence[Partitions], device: torch.device | str = "cpu") -> torch.Tensor:
    """Dense ``M~`` per head, (H, n, n) float64 (tests and small references only)."""
    from poslsh_cli.operators import MeanMask

    return torch.stack([torch.as_tensor(MeanMask(p).dense(), device=device) for p in partitions])
