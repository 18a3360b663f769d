"""Positional LSH as one attention over the union of each query's s blocks, weighted by how many
masks put the pair in one block (docs/THEORY.md, "One attention over the union of the blocks").

With ``C_ij = #{k : h_k(i) = h_k(j)} = s M~_ij`` (the constant ``log s`` cancels in the softmax):

    T~ = D~^-1 (A o M~) V = softmax(q k^T * scale + log C) V        (log 0 = -inf)

Every block holding position i is an interval, so the keys with ``C_ij > 0`` are one interval
``[lo(i), hi(i)]``: the union of i's s blocks (about ``sigma ln s`` each side for the Gamma(2, sigma)
widths), and ``C_ij`` is a step function of j on it. One attention over that span costs work that
grows with the union, not with s (the per-mask route visits ``sum_k |block_k(i)|`` keys, about
``1.5 s sigma`` for a causal query), and needs neither the s per-sample outputs nor their merge.

Counts are stored once per *cell*: the positions between consecutive block boundaries of any of
the s samples lie in the same s blocks, so they share ``lo``, ``hi`` and the whole row of counts
``c(j) = #{k : start_k <= j <= end_k}`` (causal: ``#{k : start_k <= j}``, since ``j <= i <= end_k``).
The table is ragged: head h has ``C_h`` rows of ``W_h + 1`` counts, with ``C_h <= min(n, 1 + number
of boundaries)`` and ``W_h`` bounded by the longest block ``B_h`` (causal ``B_h``, bidirectional
``2 B_h - 1``), both computed on the host from the ``2 s`` drawn scalars per head; everything of size
n is built on the device without reading it back. A row is filled by a +1 at each block's start and
a -1 after its end (causal: in the row's last, never-read column) and one cumulative sum over the
whole table: each row's changes sum to zero, so every row starts again from 0.

``offset[h, i] + j`` is the table index of the pair (i, j): FlexAttention's ``score_mod`` adds
``log table[offset[h, i] + j]`` and its ``mask_mod`` keeps ``lo(i) <= j <= hi(i)`` (CUDA); on the CPU
query chunks attend to their key span with the same counts as a float bias (:func:`union_chunked`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import numpy as np
import torch

from poslsh_cli.attention.plan import Kernel, needs_grad
from poslsh_cli.attention.reference import scale_of
from poslsh_cli.attention.transfer import to_device
from poslsh_cli.numerics import masks
from poslsh_cli.numerics.sampling import bin_index, longest_block
from poslsh_cli.attention.flex import flex_call

#: Elements of one (cells or positions) x (samples) intermediate while the table is built: samples
#: are taken this many elements at a time, so memory stays O(n) beyond the masks' own integers.
BUILD_ELEMENTS = 2**22
#: Queries per call of the CPU union path (:func:`union_chunked`).
UNION_CHUNK = 256


def padded_size(total: int) -> int:
    """``total`` rounded up to a quarter of its power of two: the table's length, so that a kernel
    compiled for one draw's table serves the next (draws differ by a few percent; padding <= 25%)."""
    q = 1 << max(0, total.bit_length() - 3)
    return -(-total // q) * q


def _cumulative_counts(marks: Callable[[], Iterator[tuple[torch.Tensor, torch.Tensor]]], total: int,
                       dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The count table: +1 at every ``plus`` index, -1 at every ``minus`` index, cumulated.

    Each row's marks sum to zero, so one cumulative sum over the whole table restarts every row from
    0, and every count lies in [0, s]: the marks are added in ``dtype`` itself (uint8 for s <= 255,
    whose wrap-around arithmetic gives the same sums), with an int32 pass where the device cannot
    add in it."""
    try:
        table = torch.zeros(total, dtype=dtype, device=device)
        for plus, minus in marks():
            table.scatter_add_(0, plus, torch.ones(plus.numel(), dtype=dtype, device=device))
            table.scatter_add_(0, minus, torch.full((minus.numel(),), -1, dtype=torch.int32,
                                                    device=device).to(dtype))
        return table.cumsum_(0)
    except RuntimeError:  # no atomic add or scan in this narrow type here
        diff = torch.zeros(total, dtype=torch.int32, device=device)
        for plus, minus in marks():
            diff.scatter_add_(0, plus, torch.ones(plus.numel(), dtype=torch.int32, device=device))
            diff.scatter_add_(0, minus, torch.full((minus.numel(),), -1, dtype=torch.int32, device=device))
        return diff.cumsum_(0).to(dtype)


def _geometry(widths: np.ndarray, shifts: np.ndarray, n: int, causal: bool) -> tuple[np.ndarray, ...]:
    """Host-side sizes of a union layout, (H,) each: a row's width (the longest block, ``ceil(delta)``
    positions and one more for rounding, on one side or both), the row's length (one more column
    collects the -1s the table never reads), the cells (at least as many as there are), and the
    first cell and table entry of every head."""
    longest = longest_block(widths.max(1), n)
    width = longest if causal else 2 * longest - 1
    row = width + 1
    bounds = bin_index(n - 1, widths, shifts) - bin_index(0, widths, shifts)  # boundaries per sample
    cells = np.minimum(n, 1 + bounds.sum(1)).astype(np.int64)
    cbase = np.concatenate([[0], np.cumsum(cells)[:-1]])
    tbase = np.concatenate([[0], np.cumsum(cells * row)[:-1]])
    return width, row, cells, cbase, tbase


def _cell_starts(pos: torch.Tensor, w: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """(H, n) bool: whether a cell (a run of positions no sample splits) starts at each position,
    from the bins of every sample, :data:`BUILD_ELEMENTS` elements at a time."""
    H, s = w.shape
    n = pos.numel()
    step = max(1, BUILD_ELEMENTS // max(1, H * n))
    new = torch.zeros(H, n, dtype=torch.bool, device=pos.device)
    new[:, 0] = True
    for a in range(0, s, step):
        b = bin_index(pos, w[:, a:a + step, None], u[:, a:a + step, None])  # (H, c, n)
        new[:, 1:] |= (b[..., 1:] != b[..., :-1]).any(1)
        del b
    return new


def count_dtype(num_samples: int) -> torch.dtype:
    """The narrowest integer type that holds counts 0..s."""
    return torch.uint8 if num_samples <= 255 else torch.int16 if num_samples <= 32767 else torch.int32


@dataclass(frozen=True, eq=False)
class UnionLayout:
    """The counts ``C_ij`` of one set of partitions (one per head) over each query's key span.

    Attributes:
        heads, seq_len, num_samples, causal: H, n, s and the direction it was built for.
        table: (T,) counts (uint8 for s <= 255), one row per cell of every head.
        offset: (H, n) int32: the count of pair (i, j) of head h is ``table[offset[h, i] + j]``.
        lo, hi: (H, n) int32: the key span of query i (causal: ``hi = i``).
        span: host-known bound on ``hi - lo + 1`` (sizes the ``BlockMask`` without a device read).
    """
    heads: int
    seq_len: int
    num_samples: int
    causal: bool
    table: torch.Tensor
    offset: torch.Tensor
    lo: torch.Tensor
    hi: torch.Tensor
    span: int
    _block_mask: dict = field(default_factory=dict, repr=False)

    @property
    def mask(self) -> masks.Span:
        """The key spans as a :class:`~poslsh_cli.numerics.masks.KeyMask`."""
        return masks.Span(self.lo, self.hi, self.span)

    def block_mask(self, q_blocks: bool = True) -> Any:
        """FlexAttention ``BlockMask`` of the spans (one group per head), built once per layout;
        ``q_blocks`` (the transposed indices, which the backward pass reads) when asked."""
        bm = self._block_mask.get("mask")
        if bm is None or (q_blocks and getattr(bm, "q_indices", None) is None):
            bm = self._block_mask["mask"] = masks.block_mask(self.mask, self.heads, self.seq_len, self.table.device,
                                                             q_blocks=q_blocks)
        return bm

    @classmethod
    def build(cls, widths: np.ndarray, shifts: np.ndarray, seq_len: int, causal: bool,
              device: torch.device | str = "cpu") -> "UnionLayout":
        """The layout of H partitions given by their drawn scalars.

        Args:
            widths, shifts: (H, s) float64 on the host, ``delta`` and ``u`` of every head and sample
                (:attr:`AttentionSpec.bin_table <poslsh_cli.attention.api.AttentionSpec.bin_table>`).
            seq_len: n; causal: the direction.

        On ``device``, with nothing read back (the few host numbers travel in one non-blocking copy):
        cell starts from the bins of every sample (O(H s n) elementwise); at each cell's first
        position p, whether p starts a block of sample k; the last such start at or before p
        (``start_k``, a running maximum over the cells) and the first after p (``end_k + 1``, a
        running minimum from the end); the table from +1/-1 marks and one cumulative sum. No Python
        loop over heads or samples (samples are taken :data:`BUILD_ELEMENTS` elements at a time).
        """
        widths = np.asarray(widths, dtype=np.float64)
        shifts = np.asarray(shifts, dtype=np.float64)
        H, s = widths.shape
        n = int(seq_len)
        dev = torch.device(device)
        width, row, cells, cbase, tbase = _geometry(widths, shifts, n, causal)
        total_cells, total = int(cells.sum()), int((cells * row).sum())
        if padded_size(total) >= 2**31:
            raise ValueError(f"the union layout needs {total} counts (n={n}, s={s}): more than int32 indexes; "
                             "use the per-mask route (backend=flex or blocks)")
        w, u = to_device(np.stack([widths, shifts]), dev)  # (H, s) each
        cells_t, cbase_t, tbase_t, row_t, width_t = to_device(np.stack([cells, cbase, tbase, row, width]), dev)

        pos = torch.arange(n, device=dev)
        new = _cell_starts(pos, w, u)  # (H, n): a cell starts at i
        count = new.sum(1)  # (H,) cells of each head
        gcell = torch.cumsum(new, 1) - 1 + cbase_t[:, None]  # (H, n) global cell of each position
        first = torch.full((total_cells,), n - 1, dtype=torch.int64, device=dev)
        first.scatter_reduce_(0, gcell.reshape(-1), pos.expand(H, n).reshape(-1), reduce="amin")
        head = torch.repeat_interleave(torch.arange(H, device=dev), cells_t, output_size=total_cells)  # (cells,)
        local = torch.arange(total_cells, device=dev) - cbase_t[head]
        real = (local < count[head])[:, None]  # cells past a head's count are padding rows
        rowbase = tbase_t[head] + local * row_t[head]
        key = (head * n + first)[:, None]  # positions made increasing across the heads
        never = torch.full((), H * n + n, dtype=torch.int64, device=dev)
        cstep = max(1, BUILD_ELEMENTS // max(1, total_cells))

        def ends(a: int) -> tuple[torch.Tensor, torch.Tensor]:  # (cells, c) each: samples a .. a+c
            wc, uc = w[:, a:a + cstep][head], u[:, a:a + cstep][head]
            p = first[:, None].to(torch.float64)
            starts = (bin_index(p, wc, uc) != bin_index(p - 1, wc, uc)) | (local == 0)[:, None]
            starts &= real
            last = torch.cummax(torch.where(starts, key, -1), 0).values  # the block start at or before p
            nxt = torch.flip(torch.cummin(torch.flip(torch.where(starts, key, never), [0]), 0).values, [0])
            nxt = torch.cat([nxt[1:], never.expand(1, nxt.shape[1])])  # the first start after p
            base = (head * n)[:, None]
            return last - base, torch.clamp(nxt - base - 1, max=n - 1)

        lo = torch.full((total_cells,), n, dtype=torch.int64, device=dev)
        hi = torch.zeros(total_cells, dtype=torch.int64, device=dev)
        kept = []
        for a in range(0, s, cstep):
            st, en = ends(a)
            lo = torch.minimum(lo, st.amin(1))
            hi = torch.maximum(hi, en.amax(1))
            if s <= cstep:
                kept.append((st, en))
        sink = (rowbase + width_t[head])[:, None]

        def marks() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:  # table indices of the +1s and -1s
            for a in range(0, s, cstep):
                st, en = kept[0] if kept else ends(a)
                plus = rowbase[:, None] + (st - lo[:, None])
                minus = sink.expand_as(st) if causal else rowbase[:, None] + (en + 1 - lo[:, None])
                yield plus.reshape(-1), minus.reshape(-1)

        table = _cumulative_counts(marks, padded_size(total), count_dtype(s), dev)
        offset = (rowbase - lo)[gcell].to(torch.int32)  # (H, n)
        qlo = lo[gcell].to(torch.int32)
        qhi = pos.to(torch.int32).expand(H, n).contiguous() if causal else hi[gcell].to(torch.int32)
        return cls(H, n, s, bool(causal), table, offset, qlo, qhi, int(width.max()))

    def counts(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """``C_ij`` for query positions ``q`` (m,) and key positions ``k`` (r,): (H, m, r) int64, 0
        outside each query's span (and, causal, for keys after the query)."""
        lo, hi = self.lo[:, q, None], self.hi[:, q, None]  # (H, m, 1)
        inside = (k[None, None, :] >= lo) & (k[None, None, :] <= hi)
        idx = (self.offset[:, q, None].to(torch.int64) + k[None, None, :]).clamp(0, self.table.numel() - 1)
        return torch.where(inside, self.table[idx].to(torch.int64), torch.zeros((), dtype=torch.int64,
                                                                                device=q.device))


def union_flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: UnionLayout, scale: float | None = None,
               compiled: bool | None = None) -> torch.Tensor:
    """Positional-LSH attention in one FlexAttention call over the union of the blocks.

    ``score_mod`` adds ``log C_ij`` (a lookup in the layout's count table), ``mask_mod`` keeps
    ``lo(i) <= j <= hi(i)``; the ``BlockMask`` visits only the key tiles of the spans.

    Args:
        q, k, v: (B, H, n, d), float16/bfloat16/float32 (float64 uncompiled); queries, keys, values.
        layout: :class:`UnionLayout` for the same H, n and direction.
        compiled: default: compiled on CUDA; uncompiled (dense, slow) elsewhere, which is how the
            tests check it.

    Returns (B, H, n, d) in q's dtype; differentiable in q, k, v on CUDA (FlexAttention's own backward).
    """
    B, H, n, d = q.shape
    if layout.heads != H or layout.seq_len != n:
        raise ValueError("the UnionLayout was built for another head count or length")
    table, offset = layout.table, layout.offset
    top = torch.full((), table.numel() - 1, dtype=offset.dtype, device=offset.device)

    def score_mod(score, b, h, q_idx, kv_idx):  # noqa: ANN001 - FlexAttention's signature
        idx = torch.minimum(torch.clamp(offset[h, q_idx] + kv_idx, min=0), top)
        return score + torch.log(table[idx].to(score.dtype))

    bm = layout.block_mask(q_blocks=needs_grad(q, k, v))
    return flex_call(q, k, v, score_mod=score_mod, block_mask=bm, scale=scale_of(d, scale),
                     compiled=q.is_cuda if compiled is None else compiled, sizes=(table.numel(), str(table.dtype)))


def union_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: UnionLayout, scale: float | None = None,
                  kernel: Kernel = Kernel.FUSED, chunk: int = UNION_CHUNK) -> torch.Tensor:
    """The union route on any device without FlexAttention: query chunks against their key span
    (the union over the chunk's queries and the heads), with ``log C`` as a float bias (``-inf``
    outside each query's span). Memory O(B H chunk span); differentiable in q, k, v.

    q, k, v: (B, H, n, d). ``kernel``: ``fused`` (SDPA with the float mask; float32/64) or
    ``matmul`` (scores and softmax in float32 at least). Returns (B, H, n, d) in q's dtype.
    """
    B, H, n, d = q.shape
    if layout.heads != H or layout.seq_len != n:
        raise ValueError("the UnionLayout was built for another head count or length")
    sc = scale_of(d, scale)
    acc = torch.promote_types(q.dtype, torch.float32)
    if kernel is Kernel.FUSED and q.dtype != acc:
        kernel = Kernel.MATMUL  # SDPA's float mask would be rounded to the input dtype
    lo_all, hi_all = layout.lo.amin(0).tolist(), layout.hi.amax(0).tolist()  # (n,) each, over heads
    pos = torch.arange(n, device=q.device)
    outs = []
    for a in range(0, n, chunk):
        b = min(n, a + chunk)
        lo, hi = int(lo_all[a]), int(max(hi_all[a:b])) + 1  # spans are monotone in i
        cnt = layout.counts(pos[a:b], pos[lo:hi])  # (H, c, m)
        bias = torch.log(cnt.to(acc))  # log 0 = -inf outside the span
        if kernel is Kernel.FUSED:
            outs.append(torch.nn.functional.scaled_dot_product_attention(
                q[:, :, a:b], k[:, :, lo:hi], v[:, :, lo:hi], attn_mask=bias[None].to(q.dtype), scale=sc))
            continue
        scores = (q[:, :, a:b] @ k[:, :, lo:hi].transpose(-1, -2)).to(acc) * sc + bias  # (B, H, c, m)
        p = torch.softmax(scores, dim=-1)
        outs.append((p.to(v.dtype) @ v[:, :, lo:hi]).to(q.dtype))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)


__all__ = ["UnionLayout", "union_flex", "union_chunked"]
