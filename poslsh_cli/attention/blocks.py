"""Positional-LSH attention as s short, bias-free, block-local attentions merged by log-sum-exp.

Each sampled partition makes ``M(h_k)`` block diagonal, so ``(A o M(h_k)) V`` is ordinary
attention inside each block. Run it per sample, keep each position's output ``O_k,i`` and
natural-log normaliser ``lse_k,i``, then merge:

    T~_i = sum_k exp(lse_k,i) O_k,i / sum_k exp(lse_k,i)      (a softmax over k of lse)

Causal: causal attention inside each block. Every position shares a block with itself, so no
denominator is zero. All blocks of all samples and heads are batched: they are grouped by length
into a few buckets (padding at most doubles a block), so the work is a few batched calls, with no
Python loop over blocks (docs/THEORY.md, "Attention identity and the lse merge").
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from poslsh_cli import masks
from poslsh_cli.attention.plan import Kernel
from poslsh_cli.attention.reference import NEG_INF, scale_of
from poslsh_cli.sampling import Partitions

#: Upper bound on the bytes of one batch of gathered blocks (q, k, v copies and scores): large
#: buckets are processed in several batches, so memory stays O(s n d), not O(padded slots x d x 3).
BLOCK_BATCH_BYTES = 64 * 2**20


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
        """Layout of one :class:`Partitions` per head (same n and s), built on ``device``."""
        heads = len(partitions)
        s, n = partitions[0].num_samples, partitions[0].seq_len
        if any(p.num_samples != s or p.seq_len != n for p in partitions):
            raise ValueError("every head needs the same seq_len and number of samples")
        offs = [off for p in partitions for off in p.offsets]  # (head, sample) order
        counts = np.asarray([off.size - 1 for off in offs])
        starts_np = np.concatenate([off[:-1] for off in offs])
        lengths_np = np.concatenate([np.diff(off) for off in offs])
        useful = int((lengths_np.astype(np.int64) ** 2).sum())
        # bucket by the power of two at or above the length: padding < 2x inside a bucket
        bucket_np = np.ceil(np.log2(lengths_np)).astype(np.int64)
        starts = torch.as_tensor(starts_np, device=device)
        lengths = torch.as_tensor(lengths_np, device=device)
        owner = torch.repeat_interleave(torch.arange(len(offs), device=device),
                                        torch.as_tensor(counts, device=device))  # (blocks,)
        bucket = torch.as_tensor(bucket_np, device=device)
        index, valid = [], []
        offset = 0
        for b in np.unique(bucket_np):
            sel = torch.nonzero(bucket == int(b)).reshape(-1)
            L = int(lengths_np[bucket_np == b].max())
            ar = torch.arange(L, device=device)
            ln = lengths[sel, None]
            ok = ar[None, :] < ln  # (nb, L)
            pos = starts[sel, None] + torch.minimum(ar[None, :], ln - 1)
            index.append(owner[sel, None] * n + pos)  # (nb, L)
            valid.append(ok)
            offset += sel.numel() * L
        return cls(heads, s, n, tuple(index), tuple(valid), offset, useful)


def device_bins(partitions: Sequence[Partitions], device: torch.device | str) -> torch.Tensor:
    """Bins of every (head, sample) computed on ``device``, (H, s, n) int64.

    ``floor((i + u) / delta)`` in float64 from the 2 s drawn scalars per head: IEEE float64
    addition, division and floor are exact-rounded everywhere, so this equals
    :meth:`Partitions.bins` bit for bit, without moving an (H, s, n) array to the device.
    """
    widths = torch.as_tensor(np.stack([p.widths for p in partitions]), dtype=torch.float64, device=device)
    shifts = torch.as_tensor(np.stack([p.shifts for p in partitions]), dtype=torch.float64, device=device)
    i = torch.arange(partitions[0].seq_len, dtype=torch.float64, device=device)
    raw = torch.floor((i + shifts[..., None]) / widths[..., None]).to(torch.int64)  # (H, s, n)
    return raw - raw[..., :1]


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: BlockLayout, causal: bool,
                    scale: float | None = None, kernel: Kernel = Kernel.MATMUL) -> tuple[torch.Tensor, torch.Tensor]:
    """Bias-free attention inside every block of every sample; outputs per sample, not merged.

    Args:
        q, k, v: (B, H, n, d), any float dtype; queries, keys, values.
        layout: where the blocks of every (head, sample) are (:class:`BlockLayout`, H heads, n).
        causal: attend only to keys j <= i inside each block.
        kernel: ``fused`` (the CPU flash kernel; no gradients) or ``matmul`` (padded matmuls).

    Returns ``out (B, H, s, n, d)`` in q's dtype and ``lse (B, H, s, n)`` (float32 or wider,
    natural log): ``lse = log sum_{j in block(i)} exp(q_i . k_j * scale)``.
    """
    B, H, n, d = q.shape
    s = layout.num_samples
    sc = scale_of(d, scale)
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
            o, l = _block_kernel(qf[:, src], kf[:, src], vf[:, src], bok, causal, sc, kernel)  # (B, m, L, d), (B, m, L)
            target = bi[bok]  # real slots -> their (head, sample, position)
            out[:, target] = o[:, bok]
            lse[:, target] = l[:, bok]
    return out.reshape(B, H, s, n, d), lse.reshape(B, H, s, n)


def _block_kernel(qb: torch.Tensor, kb: torch.Tensor, vb: torch.Tensor, ok: torch.Tensor, causal: bool,
                  sc: float, kernel: Kernel) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention inside padded blocks: ``qb, kb, vb`` (B, nb, L, d), ``ok`` (nb, L) real keys.

    Returns ``(out (B, nb, L, d) in q's dtype, lse (B, nb, L) float32 or wider)``. Padding sits at
    the end of each block, so with causal attention no real query ever sees a padded key.
    """
    B, nb, L, d = qb.shape
    acc = torch.promote_types(qb.dtype, torch.float32)
    if kernel is Kernel.FUSED:
        mask = None
        if not causal and not bool(ok.all()):
            mask = torch.zeros(nb, 1, L, dtype=qb.dtype, device=qb.device).masked_fill(~ok[:, None, :], NEG_INF)
            mask = mask[None].expand(B, nb, L, L)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            qb, kb, vb, 0.0, causal, attn_mask=mask, scale=sc)
        return out, lse.to(acc)
    scores = (qb @ kb.transpose(-1, -2)).to(acc) * sc  # (B, nb, L, L)
    keep = ok[:, None, :]  # keys that are real positions
    if causal:
        local = torch.arange(L, device=qb.device)
        keep = keep & masks.Causal().grid(local, local, 1)
    scores = scores.masked_fill(~keep, NEG_INF)
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


def blocks_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: BlockLayout, causal: bool,
                     scale: float | None = None, kernel: Kernel = Kernel.MATMUL) -> torch.Tensor:
    """Positional-LSH (or fixed-block) attention on the blocks backend: the block attentions of
    every sample (:func:`block_attention`), merged by lse. q, k, v (B, H, n, d) -> (B, H, n, d)."""
    out, lse = block_attention(q, k, v, layout, causal, scale, kernel)
    return merge_by_lse(out, lse, dim=2)[0]
