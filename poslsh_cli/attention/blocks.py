"""Positional-LSH attention as s short, bias-free, block-local attentions merged by log-sum-exp.

Each sampled partition makes ``M(h_k)`` block diagonal, so ``(A o M(h_k)) V`` is ordinary
attention inside each block. Run it per sample, keep each position's output ``O_k,i`` and
natural-log normaliser ``lse_k,i``, then merge:

    T~_i = sum_k exp(lse_k,i) O_k,i / sum_k exp(lse_k,i)      (a softmax over k of lse)

Causal: causal attention inside each block. Every position shares a block with itself, so no
denominator is zero. All blocks of all samples and heads are batched: they are grouped by length
into a few dozen buckets (exact lengths for short blocks, padding under 19% for long ones), so the
work is a few dozen batched calls, with no Python loop over blocks (docs/THEORY.md, "Attention identity and the lse merge").
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from poslsh_cli.numerics import masks
from poslsh_cli.attention.merge import merge_by_lse
from poslsh_cli.attention.plan import Kernel
from poslsh_cli.attention.reference import NEG_INF, scale_of
from poslsh_cli.attention.transfer import drawn_scalars
from poslsh_cli.numerics.sampling import Partitions, bin_index

#: Upper bound on the bytes of one batch of gathered blocks (q, k, v copies and scores): large
#: buckets are processed in several batches, so memory stays O(s n d), not O(padded slots x d x 3).
BLOCK_BATCH_BYTES = 64 * 2**20


@dataclass(frozen=True)
class BlockLayout:
    """Where every block of every (head, sample) lives, grouped into length buckets.

    For bucket b, all (num_blocks_b, L_b) int64:
    - ``valid[b]``: bool, real positions (padding sits at the end of each block);
    - ``src[b]``: rows ``h*n + i`` of the (H*n)-row view of q, k, v; padding points to row H*n (a
      zero row appended by the kernels, or a row that receives nothing useful);
    - ``dest[b]``: rows ``(h*s + k)*n + i`` of the per-sample outputs (the flat slot of position i
      in the copy of head h, sample k); padding points to row H*s*n (a trash row).

    Every (head, sample, position) is a real slot of exactly one block.
    """

    heads: int
    num_samples: int
    seq_len: int
    valid: tuple[torch.Tensor, ...]
    src: tuple[torch.Tensor, ...]
    dest: tuple[torch.Tensor, ...]
    padded_slots: int  # total slots computed, padding included

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
        bucket_np = length_bucket(lengths_np)
        starts = torch.as_tensor(starts_np, device=device)
        lengths = torch.as_tensor(lengths_np, device=device)
        owner = torch.repeat_interleave(torch.arange(len(offs), device=device),
                                        torch.as_tensor(counts, device=device))  # (blocks,) = h*s + k
        bucket = torch.as_tensor(bucket_np, device=device)
        valid, src, dest = [], [], []
        offset = 0
        for b, _, L in buckets(lengths_np, bucket_np):
            sel = torch.nonzero(bucket == int(b)).reshape(-1)
            ar = torch.arange(L, device=device)
            ln = lengths[sel, None]
            ok = ar[None, :] < ln  # (nb, L)
            pos = starts[sel, None] + torch.minimum(ar[None, :], ln - 1)
            slot = owner[sel, None] * n + pos  # (nb, L)
            valid.append(ok)
            src.append(torch.where(ok, (owner[sel, None] // s) * n + pos, heads * n))
            dest.append(torch.where(ok, slot, heads * s * n))
            offset += sel.numel() * L
        return cls(heads, s, n, tuple(valid), tuple(src), tuple(dest), offset)


#: Blocks up to this length are bucketed by their exact length (no padding at all); longer ones by
#: a geometric grid of ratio BUCKET_RATIO, so padding adds less than 19% to a block's length.
EXACT_BUCKET_MAX = 16
BUCKET_RATIO = 2 ** 0.25


def length_bucket(lengths: np.ndarray) -> np.ndarray:
    """Bucket id of every block length: the length itself up to EXACT_BUCKET_MAX, then one bucket
    per factor BUCKET_RATIO. Fewer padded pairs cost more kernel calls; at these settings a layout
    of the standard sigmas (2..256) with s=10 has a few dozen buckets."""
    lengths = np.asarray(lengths, dtype=np.int64)
    big = np.ceil(np.log(np.maximum(lengths, 1) / EXACT_BUCKET_MAX) / np.log(BUCKET_RATIO) - 1e-9)
    return np.where(lengths <= EXACT_BUCKET_MAX, lengths, EXACT_BUCKET_MAX + big.astype(np.int64))


def buckets(lengths: np.ndarray, bucket: np.ndarray | None = None) -> list[tuple[int, int, int]]:
    """(bucket id, blocks, padded length L) of every length bucket of these block lengths, in bucket
    order: the grouping both :meth:`BlockLayout.build` and :func:`padded_work` use."""
    lengths = np.asarray(lengths, dtype=np.int64)
    bucket = length_bucket(lengths) if bucket is None else bucket
    counts = np.bincount(bucket)  # small non-negative ids: no sort of the (H s n / sigma) lengths
    ids = np.flatnonzero(counts)
    longest = np.where(ids <= EXACT_BUCKET_MAX, ids, 0)  # a bucket up to there holds one length, its id
    big = bucket > EXACT_BUCKET_MAX
    if big.any():
        top = np.zeros(len(counts), dtype=np.int64)
        np.maximum.at(top, bucket[big], lengths[big])
        longest = np.maximum(longest, top[ids])
    return [(int(b), int(counts[b]), int(L)) for b, L in zip(ids, longest)]


def padded_work(partitions: Sequence[Partitions]) -> tuple[float, float]:
    """(padded pairs, slots) the blocks backend would compute for ``partitions``, from their block
    lengths alone (the plan's cost model): pairs = sum over blocks of the bucket's length squared,
    slots = H s n gathered rows."""
    lengths = np.concatenate([p.lengths for p in partitions])
    pairs = sum(float(count) * float(L) ** 2 for _, count, L in buckets(lengths))
    return pairs, float(len(partitions) * partitions[0].num_samples * partitions[0].seq_len)


def device_bins(partitions: Sequence[Partitions], device: torch.device | str) -> torch.Tensor:
    """Bins of every (head, sample) computed on ``device``, (H, s, n) int64.

    :func:`~poslsh_cli.numerics.sampling.bin_index` (``floor((i + u) / delta)`` in float64) from the 2 s
    drawn scalars per head, copied in one non-blocking transfer: IEEE float64 addition, division and
    floor are exact-rounded everywhere, so this equals :meth:`Partitions.bins` bit for bit, without
    moving an (H, s, n) array to the device.
    """
    widths, shifts = drawn_scalars(partitions, device)
    i = torch.arange(partitions[0].seq_len, dtype=torch.float64, device=widths.device)
    raw = bin_index(i, widths[..., None], shifts[..., None]).to(torch.int64)  # (H, s, n)
    return raw - raw[..., :1]


def _rows(t: torch.Tensor, extra: bool = True) -> torch.Tensor:
    """(B, H, n, d) -> (H*n [+1], B, d): row ``h*n + i`` holds position i of head h for every batch
    element (a view when B = 1); ``extra`` appends a zero row, where padding points."""
    B, H, n, d = t.shape
    r = t.permute(1, 2, 0, 3).reshape(H * n, B, d)
    return torch.cat([r, r.new_zeros(1, B, d)]) if extra else r


def _gather(rows: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Rows ``idx`` (m, L) of (R, B, d) as the kernels' (B, m, L, d)."""
    m, L = idx.shape
    return rows.index_select(0, idx.reshape(-1)).view(m, L, rows.shape[1], rows.shape[2]).permute(2, 0, 1, 3)


def _batches(layout: BlockLayout, per_row_bytes: int) -> Any:
    """(src, dest, valid) batches of blocks, each within BLOCK_BATCH_BYTES."""
    for src, dest, ok in zip(layout.src, layout.dest, layout.valid):
        nb, L = src.shape
        step = max(1, BLOCK_BATCH_BYTES // (L * per_row_bytes(L)))
        for a in range(0, nb, step):
            yield src[a:a + step], dest[a:a + step], ok[a:a + step]


def per_sample_block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: BlockLayout, causal: bool,
                    scale: float | None = None, kernel: Kernel = Kernel.MATMUL) -> tuple[torch.Tensor, torch.Tensor]:
    """Bias-free attention inside every block of every sample; outputs per sample, not merged.

    Args:
        q, k, v: (B, H, n, d), any float dtype; queries, keys, values.
        layout: where the blocks of every (head, sample) are (:class:`BlockLayout`, H heads, n).
        causal: attend only to keys j <= i inside each block.
        kernel: ``fused`` (the CPU flash kernel) or ``matmul`` (padded matmuls).

    Returns ``out (B, H, s, n, d)`` in q's dtype and ``lse (B, H, s, n)`` (float32 or wider,
    natural log): ``lse = log sum_{j in block(i)} exp(q_i . k_j * scale)``. Both are strided views
    of (H*s*n, B, .) buffers filled block by block.
    """
    B, H, n, d = q.shape
    s = layout.num_samples
    sc = scale_of(d, scale)
    acc = torch.promote_types(q.dtype, torch.float32)
    out = q.new_empty(H * s * n + 1, B, d)  # every (head, sample, position) is written exactly once; + trash row
    lse = torch.empty(H * s * n + 1, B, dtype=acc, device=q.device)
    qr, kr, vr = _rows(q), _rows(k), _rows(v)
    for src, dest, ok in _batches(layout, lambda L: B * (3 * d * q.element_size() + 2 * L * 4)):
        m, L = src.shape
        o, l = _block_kernel(_gather(qr, src), _gather(kr, src), _gather(vr, src), ok, causal, sc, kernel)
        out.index_copy_(0, dest.reshape(-1), o.permute(1, 2, 0, 3).reshape(m * L, B, d))
        lse.index_copy_(0, dest.reshape(-1), l.permute(1, 2, 0).reshape(m * L, B))
    return (out[:-1].view(H, s, n, B, d).permute(3, 0, 1, 2, 4), lse[:-1].view(H, s, n, B).permute(3, 0, 1, 2))


def _padded_key_bias(ok: torch.Tensor, causal: bool, B: int, dtype: torch.dtype) -> torch.Tensor | None:
    """The fused kernel's additive mask for padded keys, (B, nb, L, L), or None: with causal
    attention padding (at the end of each block) is never seen by a real query, and blocks without
    padding need none."""
    if causal or bool(ok.all()):
        return None
    nb, L = ok.shape
    mask = torch.zeros(nb, 1, L, dtype=dtype, device=ok.device).masked_fill(~ok[:, None, :], NEG_INF)
    return mask[None].expand(B, nb, L, L)


def _keep(ok: torch.Tensor, causal: bool) -> torch.Tensor:
    """Which (query, key) pairs of padded blocks count, (nb, L, L) or broadcastable: real keys, and
    with causal attention keys at or before the query."""
    keep = ok[:, None, :]
    if causal:
        local = torch.arange(ok.shape[-1], device=ok.device)
        keep = keep & masks.Causal().grid(local, local, 1)
    return keep


def _block_kernel(qb: torch.Tensor, kb: torch.Tensor, vb: torch.Tensor, ok: torch.Tensor, causal: bool,
                  sc: float, kernel: Kernel) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention inside padded blocks: ``qb, kb, vb`` (B, nb, L, d), ``ok`` (nb, L) real keys.

    Returns ``(out (B, nb, L, d) in q's dtype, lse (B, nb, L) float32 or wider)``. Padding sits at
    the end of each block, so with causal attention no real query ever sees a padded key.
    """
    B, nb, L, d = qb.shape
    acc = torch.promote_types(qb.dtype, torch.float32)
    if kernel is Kernel.FUSED:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            qb, kb, vb, 0.0, causal, attn_mask=_padded_key_bias(ok, causal, B, qb.dtype), scale=sc)
        return out, lse.to(acc)
    scores = (qb @ kb.transpose(-1, -2)).to(acc) * sc  # (B, nb, L, L)
    scores = scores.masked_fill(~_keep(ok, causal), NEG_INF)
    lse = torch.logsumexp(scores, dim=-1)  # (B, nb, L)
    p = torch.exp(scores - lse[..., None])
    return (p.to(vb.dtype) @ vb).to(qb.dtype), lse


def merged_block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: BlockLayout, causal: bool,
                     scale: float | None = None, kernel: Kernel = Kernel.MATMUL) -> torch.Tensor:
    """Positional-LSH (or fixed-block) attention on the blocks backend: the block attentions of
    every sample (:func:`per_sample_block_attention`), merged by lse. q, k, v (B, H, n, d) -> (B, H, n, d).

    Differentiable in q, k, v through :class:`MergedBlockAttention`, which keeps only q, k, v, the
    merged output and its lse and recomputes the block probabilities in the backward pass."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        return MergedBlockAttention.apply(q, k, v, layout, causal, scale_of(q.shape[-1], scale), kernel)
    out, lse = per_sample_block_attention(q, k, v, layout, causal, scale, kernel)
    return merge_by_lse(out, lse, dim=2, inplace=True)[0]


class MergedBlockAttention(torch.autograd.Function):
    """Merged block attention with its own backward (docs/THEORY.md, "Gradient of the lse merge").

    Forward: the block attentions of every sample without autograd (fused kernel or padded
    matmuls), merged by lse into ``T (B, H, n, d)`` with ``LSE (B, H, n)``; saved: q, k, v, T, LSE.

    Backward: the merged output is attention over the multiset union of every sample's block, so
    with ``p_ij = exp(q_i.k_j * scale - LSE_i)`` (the globally normalised probability of a pair
    inside one sample's block) and ``D_i = dT_i . T_i``, ``ds_ij = p_ij (dT_i . v_j - D_i)``,
    ``dq_i = scale sum_j ds_ij k_j``, ``dk_j = scale sum_i ds_ij q_i``, ``dv_j = sum_i p_ij dT_i``,
    summed over the samples. Per bucket of blocks this is exactly a flash-attention backward with
    the merged ``T`` and ``LSE`` in place of the block's own output and lse: the CPU flash kernel's
    backward (``fused``) or padded matmuls in chunks (``matmul``). Memory O(s n d) for the
    per-sample outputs of the forward plus one chunk of blocks, never every block's L x L scores.
    """

    @staticmethod
    def forward(ctx, q, k, v, layout, causal, sc, kernel):  # noqa: ANN001, ANN205
        with torch.no_grad():
            out, lse = per_sample_block_attention(q, k, v, layout, causal, sc, kernel)
            merged, total = merge_by_lse(out, lse, dim=2, inplace=True)
            del out, lse
        ctx.save_for_backward(q, k, v, merged, total)
        ctx.layout, ctx.causal, ctx.sc, ctx.kernel = layout, causal, sc, kernel
        return merged

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        q, k, v, merged, total = ctx.saved_tensors
        dq, dk, dv = block_attention_backward(grad, q, k, v, merged, total, ctx.layout, ctx.causal, ctx.sc,
                                              ctx.kernel)
        return dq, dk, dv, None, None, None, None


def block_attention_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             merged: torch.Tensor, total: torch.Tensor, layout: BlockLayout, causal: bool, sc: float,
                             kernel: Kernel) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of the merged block attention (see :class:`MergedBlockAttention`).

    Args:
        grad: dT (B, H, n, d); q, k, v: (B, H, n, d); merged: T (B, H, n, d); total: LSE (B, H, n).

    Returns (dq, dk, dv), each (B, H, n, d) in the dtype of q, k, v. Padded slots read the zero
    row (no gradient flows from them) and add into a trash row.
    """
    B, H, n, d = q.shape
    acc = torch.promote_types(q.dtype, torch.float32)
    qr, kr, vr, gr, orow = (_rows(t) for t in (q, k, v, grad.to(q.dtype), merged))
    # the merged lse in the accumulation precision: float64 gradients for float64 inputs (the CPU flash
    # kernel's backward takes its lse in float32 for float32 inputs, float64 for float64 ones)
    lr = torch.cat([total.permute(1, 2, 0).reshape(H * n, B), total.new_zeros(1, B)]).to(acc)
    dq, dk, dv = (torch.zeros(H * n + 1, B, d, dtype=acc, device=q.device) for _ in range(3))
    for src, dest, ok in _batches(layout, lambda L: B * (6 * d * q.element_size() + 4 * L * 4)):
        m, L = src.shape
        qb, kb, vb, gb, ob = (_gather(t, src) for t in (qr, kr, vr, gr, orow))  # (B, m, L, d)
        lb = lr.index_select(0, src.reshape(-1)).view(m, L, B).permute(2, 0, 1)  # (B, m, L)
        if kernel is Kernel.FUSED:
            gq, gk, gv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                gb, qb, kb, vb, ob, lb, 0.0, causal, attn_mask=_padded_key_bias(ok, causal, B, q.dtype), scale=sc)
        else:
            gq, gk, gv = _block_backward_matmul(gb, qb, kb, vb, ob, lb, ok, causal, sc, acc)
        flat = src.reshape(-1)
        for acc_t, g in ((dq, gq), (dk, gk), (dv, gv)):
            acc_t.index_add_(0, flat, g.permute(1, 2, 0, 3).reshape(m * L, B, d).to(acc))
    return tuple(t[:-1].view(H, n, B, d).permute(2, 0, 1, 3).to(q.dtype).contiguous() for t in (dq, dk, dv))


def _block_backward_matmul(gb: torch.Tensor, qb: torch.Tensor, kb: torch.Tensor, vb: torch.Tensor, ob: torch.Tensor,
                           lb: torch.Tensor, ok: torch.Tensor, causal: bool, sc: float,
                           acc: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The flash-attention backward on padded blocks with padded matmuls (any device):
    ``p = exp(s - lse)``, ``ds = p (dO v^T - rowsum(dO o O))``; (B, m, L, .) in, in ``acc``."""
    gq, gk, gv, go = (t.to(acc) for t in (qb, kb, vb, ob))
    g = gb.to(acc)
    scores = (gq @ gk.transpose(-1, -2)) * sc  # (B, m, L, L)
    p = torch.exp(scores.masked_fill(~_keep(ok, causal), NEG_INF) - lb.to(acc)[..., None])
    dpv = g @ gv.transpose(-1, -2)  # (B, m, L, L)
    ds = p * (dpv - (g * go).sum(-1, keepdim=True))
    return (ds @ gk) * sc, (ds.transpose(-1, -2) @ gq) * sc, p.transpose(-1, -2) @ g
