"""Positional LSH as one attention over each query's band of keys on the CPU, with the counts of the
s masks as a log bias (docs/THEORY.md, "One attention over the union of the blocks"): the union route
where there is no FlexAttention, for inference and for training.

With ``C_ij = #{k : h_k(i) = h_k(j)}`` (``= s M~_ij``; the constant ``log s`` cancels in the softmax)

    T~ = softmax(q k^T * scale + log C) V            (log 0 = -inf)

Every block holding i is an interval around i, so for a key j <= i the block of sample k holds j
exactly when it starts at or before j, and for j >= i when it ends at or after j:

    C_{i, i-r} = #{k : i - start_k(i) >= r},        C_{i, i+r} = #{k : end_k(i) - i >= r},

the tail counts of how far each of i's s blocks reaches back (and forward). Both are zero beyond
the longest block, ``R`` positions (a block of width delta holds at most ceil(delta) positions), so
query i sees at most the keys ``i - R + 1 .. i + R - 1``: a band. :class:`BandLayout` keeps the
counts of that band, ``(H, n, w)`` small integers (uint8 for s <= 255: n w bytes a head, not n^2),
built from the 2 s drawn scalars of each head by one histogram of the reaches and one cumulative
sum, without a loop over heads or samples.

Attention runs by query chunks of ``c`` rows against their ``c + w - 1`` keys: the chunk's bias is
the band shifted one column per row (row t of the band lands at columns t .. t + w - 1: one strided
copy), ``log`` of it (0 counts give -inf), then the CPU flash kernel with that float mask
(:func:`union_banded`). Training recomputes each chunk's bias in the backward pass
(:class:`BandedUnion`), so it keeps only q, k, v, the output and its lse besides the band: memory
O(H n w) bytes. The same chunks with padded matmuls serve low precision (:func:`band_chunks`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import numpy as np
import torch

from poslsh_cli.attention.reference import scale_of
from poslsh_cli.attention.transfer import to_device
from poslsh_cli.numerics.sampling import VECTOR_ELEMENTS, Partitions, bin_index, longest_block

#: Queries per chunk of the banded route: the bias of a chunk is ``c (c + w - 1)`` per head, so a
#: narrower chunk wastes less of it on the triangle outside the band, a wider one makes fewer calls.
BAND_ROWS = 128
#: Elements of the (heads, samples, positions) intermediates while the band is built: samples are
#: taken this many elements at a time, so memory stays O(H n w) beyond the masks' own scalars.
BUILD_ELEMENTS = 2**23


def count_dtype(num_samples: int) -> torch.dtype:
    """The narrowest integer type that holds counts 0..s."""
    return torch.uint8 if num_samples <= 255 else torch.int16 if num_samples <= 32767 else torch.int32


@dataclass(frozen=True, eq=False)
class BandLayout:
    """The counts ``C_ij`` of one set of partitions (one per head) over each query's band of keys.

    Attributes:
        heads, seq_len, num_samples, causal: H, n, s and the direction it was built for.
        counts: (H, n, w) integers; ``counts[h, i, u]`` is ``C_{i, i - back + u}`` (0 where that
            key lies outside the sequence); causal: ``w = back + 1`` (the diagonal last),
            bidirectional ``w = 2 back + 1`` (the diagonal in the middle).
        back: R - 1, the farthest a block of any head reaches from a query.
    """

    heads: int
    seq_len: int
    num_samples: int
    causal: bool
    counts: torch.Tensor
    back: int
    _log_table: dict = field(default_factory=dict, repr=False)

    @property
    def width(self) -> int:
        return int(self.counts.shape[-1])

    @classmethod
    def of(cls, partitions: Sequence[Partitions], causal: bool, device: torch.device | str = "cpu") -> "BandLayout":
        """The band of one set of partitions (one per head). On the CPU, where every sample's bins are
        small enough to hold at once, from the reaches the partitions computed with their boundaries
        (:meth:`~poslsh_cli.numerics.sampling.Partitions.reaches`: the bins are computed once for the
        plan's cost model and the band); otherwise on ``device`` from the drawn scalars (:meth:`build`)."""
        n, s = partitions[0].seq_len, partitions[0].num_samples
        widths = np.stack([p.widths for p in partitions])
        if torch.device(device).type != "cpu" or s * n > VECTOR_ELEMENTS or s < 2:
            return cls.build(widths, np.stack([p.shifts for p in partitions]), n, causal, device)
        H = len(partitions)
        R = int(longest_block(widths.max(), n))
        # the scatter indices, R - 1 - reach back, written on the host where the reaches are computed
        back = np.empty((H, s, n), dtype=np.int64)
        fwds = [p.reaches(forward=not causal, back_out=back[h], offset=R - 1)[1] for h, p in enumerate(partitions)]
        fwd = None if causal else torch.from_numpy(np.minimum(np.stack(fwds), R - 1))
        return cls._counted(H, n, s, causal, R, torch.from_numpy(back), fwd)

    @classmethod
    def _counted(cls, H: int, n: int, s: int, causal: bool, R: int, left_at: torch.Tensor,
                 fwd: torch.Tensor | None) -> "BandLayout":
        """The band from every (head, sample, position)'s place in the left band, ``R - 1 - reach back``,
        and (bidirectional) its reach forward cut at ``R - 1``, (H, s, n) int64 each."""
        acc = count_dtype(s)
        ones = torch.ones(H, n, left_at.shape[1], dtype=acc, device=left_at.device)
        # left side, in band order: a +1 at u = R-1 - reach, so a cumulative sum along u counts the blocks
        # reaching back at least R-1-u (and, a reach never passing position 0, nothing before it)
        left = torch.zeros(H, n, R, dtype=acc, device=left_at.device)
        left.scatter_add_(-1, left_at.transpose(1, 2), ones)
        band = left.cumsum_(-1)  # C_{i, i-R+1+u}: the diagonal (all s) last
        if fwd is not None:  # C_{i, i+r} = s - #{k : reach_k < r}, r = 1 .. R-1
            right = torch.zeros(H, n, R, dtype=acc, device=left_at.device)
            right.scatter_add_(-1, fwd.transpose(1, 2), ones)
            band = torch.cat([band, s - right.cumsum_(-1)[..., :-1]], -1)
        return cls(H, n, s, bool(causal), band.to(count_dtype(s)), R - 1)

    @classmethod
    def build(cls, widths: np.ndarray, shifts: np.ndarray, seq_len: int, causal: bool,
              device: torch.device | str = "cpu") -> "BandLayout":
        """The band of H partitions given by their drawn scalars ``widths``, ``shifts`` (H, s) float64:
        per sample the bins of every position (:func:`bin_index`), each position's block start (and
        end) by a running maximum (minimum) over the positions, the reaches as one histogram per
        position (``scatter_add``), and the tail counts as one reversed cumulative sum."""
        widths = np.asarray(widths, dtype=np.float64)
        shifts = np.asarray(shifts, dtype=np.float64)
        H, s = widths.shape
        n = int(seq_len)
        dev = torch.device(device)
        R = int(longest_block(widths.max(), n))  # a block holds at most this many positions
        w_t, u_t = to_device(np.stack([widths, shifts]), dev)
        pos = torch.arange(n, device=dev)
        backs, fwds = [], []
        step = max(1, BUILD_ELEMENTS // max(1, H * n))
        for a in range(0, s, step):  # samples a few at a time: O(H n step) memory beyond the band
            bins = bin_index(pos, w_t[:, a:a + step, None], u_t[:, a:a + step, None])  # (H, c, n)
            first = torch.ones(bins.shape, dtype=torch.bool, device=dev)
            first[..., 1:] = bins[..., 1:] != bins[..., :-1]
            backs.append((R - 1) - (pos - torch.where(first, pos, 0).cummax(-1).values))
            if not causal:
                last = torch.ones_like(first)
                last[..., :-1] = first[..., 1:]
                end = torch.flip(torch.flip(torch.where(last, pos, n), [-1]).cummin(-1).values, [-1])
                fwds.append((end - pos).clamp_(max=R - 1))
            del bins, first
        return cls._counted(H, n, s, causal, R, torch.cat(backs, 1), torch.cat(fwds, 1) if fwds else None)

    def keys(self, a: int, b: int) -> tuple[int, int]:
        """The key range ``[lo, hi)`` of queries ``a .. b-1``."""
        return max(0, a - self.back), min(self.seq_len, (b if self.causal else b + self.back))

    def chunk_counts(self, a: int, b: int) -> torch.Tensor:
        """``C`` of queries ``a .. b-1`` against their key range :meth:`keys`, (H, b-a, hi-lo), by one
        strided copy of the band (row t shifted t columns) into zeros."""
        c, w = b - a, self.width
        cols = c + w - 1  # keys a - back .. a + c - 1 + (w - 1 - back)
        out = torch.zeros(self.heads, c, cols, dtype=self.counts.dtype, device=self.counts.device)
        out.as_strided((self.heads, c, w), (c * cols, cols + 1, 1)).copy_(self.counts[:, a:b])
        lo, hi = self.keys(a, b)
        first = lo - (a - self.back)
        return out[..., first:first + (hi - lo)]

    def chunk_bias(self, a: int, b: int, dtype: torch.dtype, mean: bool = False) -> torch.Tensor:
        """``log C`` of :meth:`chunk_counts` in ``dtype`` (-inf where no mask puts the pair in a block),
        or with ``mean`` ``log M~ = log (C / s)`` (the same softmax), looked up in a table of the s + 1
        values (a logarithm per pair costs 3-4x more, most of it in the zeros)."""
        table = self._log_table.get((dtype, mean))
        if table is None:
            values = torch.arange(self.num_samples + 1, dtype=torch.float64, device=self.counts.device)
            table = self._log_table[(dtype, mean)] = torch.log(values / self.num_samples if mean else values).to(dtype)
        return torch.take(table, self.chunk_counts(a, b).to(torch.int64))

    def chunks(self, rows: int = BAND_ROWS) -> Iterator[tuple[int, int, int, int]]:
        """(a, b, lo, hi) of every query chunk and its key range."""
        for a in range(0, self.seq_len, rows):
            b = min(self.seq_len, a + rows)
            yield (a, b, *self.keys(a, b))


class BandedUnion(torch.autograd.Function):
    """:func:`union_banded` with gradients: the CPU flash kernel per query chunk, each chunk's
    ``log C`` bias rebuilt from the band in the backward pass (the flash kernel's own backward), so
    only q, k, v, the output and its lse are saved."""

    @staticmethod
    def forward(ctx, q, k, v, layout, sc, rows):  # noqa: ANN001, ANN205
        out = torch.empty_like(q)
        # the flash kernel's lse is float32 for float32 inputs, float64 for float64 ones
        lse = torch.empty(q.shape[:3], dtype=torch.promote_types(q.dtype, torch.float32), device=q.device)
        for a, b, lo, hi in layout.chunks(rows):
            bias = layout.chunk_bias(a, b, q.dtype)[None]  # (1, H, c, keys)
            o, l = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q[:, :, a:b], k[:, :, lo:hi], v[:, :, lo:hi], 0.0, False, attn_mask=bias, scale=sc)
            out[:, :, a:b] = o
            lse[:, :, a:b] = l
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (layout, sc, rows)
        return out

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        q, k, v, out, lse = ctx.saved_tensors
        layout, sc, rows = ctx.args
        grad = grad.contiguous()
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for a, b, lo, hi in layout.chunks(rows):
            bias = layout.chunk_bias(a, b, q.dtype)[None]
            gq, gk, gv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                grad[:, :, a:b], q[:, :, a:b], k[:, :, lo:hi], v[:, :, lo:hi], out[:, :, a:b], lse[:, :, a:b], 0.0,
                False, attn_mask=bias, scale=sc)
            dq[:, :, a:b] += gq
            dk[:, :, lo:hi] += gk
            dv[:, :, lo:hi] += gv
        return dq, dk, dv, None, None, None


def union_banded(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: BandLayout, scale: float | None = None,
                 rows: int = BAND_ROWS) -> torch.Tensor:
    """Positional-LSH attention over each query's band of keys with the CPU flash kernel, query chunks
    of ``rows`` against their keys with ``log C`` as the float mask (module docstring).

    Args:
        q, k, v: (B, H, n, d) float32/float64 on the CPU; queries, keys, values.
        layout: :class:`BandLayout` for the same H, n and direction.

    Returns (B, H, n, d) in q's dtype; differentiable in q, k, v (:class:`BandedUnion`).
    """
    _check(q, layout)
    return BandedUnion.apply(q, k, v, layout, scale_of(q.shape[-1], scale), rows)


def band_chunks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: BandLayout, scale: float | None = None,
                rows: int = BAND_ROWS) -> torch.Tensor:
    """The same attention with padded matmuls, scores and softmax in float32 at least (any dtype,
    differentiable through autograd; every chunk's scores kept for the backward)."""
    _check(q, layout)
    sc = scale_of(q.shape[-1], scale)
    acc = torch.promote_types(q.dtype, torch.float32)
    outs = []
    for a, b, lo, hi in layout.chunks(rows):
        scores = (q[:, :, a:b] @ k[:, :, lo:hi].transpose(-1, -2)).to(acc) * sc + layout.chunk_bias(a, b, acc)
        outs.append((torch.softmax(scores, dim=-1).to(v.dtype) @ v[:, :, lo:hi]).to(q.dtype))  # (B, H, c, d)
    return torch.cat(outs, dim=2)


def _check(q: torch.Tensor, layout: BandLayout) -> None:
    B, H, n, d = q.shape
    if layout.heads != H or layout.seq_len != n:
        raise ValueError("the BandLayout was built for another head count or length")


def band_bytes(widths: np.ndarray, seq_len: int, causal: bool, num_samples: int) -> float:
    """Bytes of the band of counts :class:`BandLayout` holds for drawn ``widths`` (H, s): ``(H, n, w)``
    integers of :func:`count_dtype`, ``w = R`` causal, ``2 R - 1`` bidirectional."""
    n = int(seq_len)
    R = int(longest_block(np.asarray(widths, dtype=np.float64).max(), n))
    heads = math.prod(np.asarray(widths).shape[:-1])
    return float(heads) * n * (R if causal else 2 * R - 1) * torch.empty((), dtype=count_dtype(num_samples)).element_size()


def band_work(widths: np.ndarray, seq_len: int, causal: bool, rows: int = BAND_ROWS) -> float:
    """Scored pairs of the banded route over all heads (the plan's cost model), each head charged the
    widest head's band (a chunk spans every head's band at once): every chunk's rows against its
    ``rows + w - 1`` keys, cut at the sequence's ends."""
    n = int(seq_len)
    back = int(longest_block(np.asarray(widths, dtype=np.float64).max(), n)) - 1
    total = 0.0
    for a in range(0, n, rows):
        b = min(n, a + rows)
        lo, hi = max(0, a - back), min(n, b if causal else b + back)
        total += (b - a) * (hi - lo)
    return total * math.prod(np.asarray(widths).shape[:-1])


__all__ = ["BandLayout", "union_banded", "band_chunks", "band_bytes", "band_work", "count_dtype"]
