"""Positional LSH on the CPU as one attention over the union of each query's s blocks, weighted by
how many masks share the pair (docs/THEORY.md, "One attention over the union of the blocks"): the
union route where there is no FlexAttention, for inference and for training.

With ``C_ij = #{k : h_k(i) = h_k(j)}`` (``= s M~_ij``; the constant ``log s`` cancels in the softmax)

    T~ = softmax(q k^T * scale + log C) V            (log 0 = -inf)

Every block holding i is an interval around i, so for a key j <= i the block of sample k holds j
exactly when it starts at or before j, and for j >= i when it ends at or after j:

    C_{i, j} = #{k : start_k(i) <= j}  (j <= i),        C_{i, j} = #{k : end_k(i) >= j}  (j >= i).

Both are zero beyond the longest block, ``R`` positions, so query i sees at most the keys
``i - R + 1 .. i + R - 1``: a band of ``w`` keys (``w = R`` causal, ``2R - 1`` bidirectional).

Heads are grouped by their own ``R`` (:func:`head_groups`: with the standard slopes sigma spans two
orders of magnitude, and a head of sigma 2 does not pay for the band of sigma 256). A
:class:`BandLayout` keeps, per group, each position's s block starts and ends *sorted* ((H, n, s)
integers: O(H s n), never the band itself). The log counts of a query chunk are built from them in one
float buffer: along a row ``C`` is a step function, 0 before the first sorted start, ``k`` from the
k-th, ``s - j`` after the j-th sorted end, 0 after the last, so the row is ``2s + 1`` segments (causal
``s + 2``: the last is the padding after the diagonal) whose
lengths are the differences of the sorted ends and whose values (``log k``) are the same for every
row: one ``numpy.repeat`` fills the buffer, without a logarithm, a table lookup or a cumulative sum
per pair, and every value is exactly the rounded logarithm. Each buffer row carries ``c`` padding
columns of ``-inf`` (the last segment), so the chunk's
bias (row t of the band at columns t .. t + w - 1) is a strided *view* of the buffer, handed to the
CPU flash kernel as its float mask without a copy (:func:`union_banded`). Training rebuilds each
chunk's bias in the backward pass (:class:`BandedUnion`), so it keeps q, k, v, the output, its lse
and the sorted ends. The same chunks with padded matmuls serve low precision (:func:`band_chunks`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np
import torch

from poslsh_cli.attention.plan import BAND_ROWS, COST_UNION_CALL, COST_UNION_PAIR_INFER
from poslsh_cli.attention.reference import scale_of
from poslsh_cli.attention.transfer import to_device
from poslsh_cli.numerics.sampling import VECTOR_ELEMENTS, Partitions, bin_index, longest_block

#: Elements of the (heads, samples, positions) intermediates while the ends are built on a device:
#: samples are taken this many elements at a time.
BUILD_ELEMENTS = 2**23


def head_groups(reach: Sequence[int], n: int, causal: bool, rows: int = BAND_ROWS) -> list[list[int]]:
    """Heads grouped by their longest block ``reach`` (R per head) so that the groups' calls cost least
    under the plan's cost model (:data:`~poslsh_cli.attention.plan.COST_UNION_CALL` per flash-kernel call,
    :data:`~poslsh_cli.attention.plan.COST_UNION_PAIR_INFER` per scored pair): a group of heads runs one
    call per query chunk, every head charged the group's widest band. The best split of the heads
    sorted by R into consecutive groups, by dynamic programming over the H heads."""
    order = sorted(range(len(reach)), key=lambda h: (reach[h], h))
    calls = -(-n // rows)
    pairs = [band_pairs(reach[h], n, causal, rows) for h in order]  # a group is charged its widest head's

    def cost(i: int, j: int) -> float:  # heads order[i:j] in one group
        return calls * COST_UNION_CALL + COST_UNION_PAIR_INFER * (j - i) * pairs[j - 1]

    best, cut = [0.0] + [math.inf] * len(order), [0] * (len(order) + 1)
    for j in range(1, len(order) + 1):
        for i in range(j):
            c = best[i] + cost(i, j)
            if c < best[j]:
                best[j], cut[j] = c, i
    groups, j = [], len(order)
    while j:
        groups.append(sorted(order[cut[j]:j]))
        j = cut[j]
    return groups[::-1]


def band_pairs(reach: int, n: int, causal: bool, rows: int = BAND_ROWS) -> float:
    """Scored pairs of one head whose band reaches ``reach`` positions: every chunk's rows against its
    ``rows + w - 1`` keys, cut at the sequence's ends."""
    back = reach - 1
    a = np.arange(0, n, rows, dtype=np.int64)
    b = np.minimum(n, a + rows)
    return float(((b - a) * (np.minimum(n, b if causal else b + back) - np.maximum(0, a - back))).sum())


def _pattern(s: int, causal: bool, dtype: torch.dtype, mean: bool) -> np.ndarray:
    """The values of a band row's segments, left to right: ``log 0`` before the first start, ``log k``
    after the k-th sorted start, (bidirectional) ``log (s - j)`` after the j-th sorted end, ``log 0``
    after the last end and in the padding; ``log (k / s)`` with ``mean``."""
    k = np.arange(1, s + 1, dtype=np.float64)
    logs = np.log(k / s if mean else k)
    inner = logs if causal else np.concatenate([logs, logs[:-1][::-1]])
    np_type = np.float64 if dtype == torch.float64 else np.float32
    return np.concatenate([[-np.inf], inner, [-np.inf]]).astype(np_type)


@dataclass(frozen=True, eq=False)
class BandGroup:
    """Heads that share one band: their sorted block starts and ends as band columns.

    Attributes:
        heads: the heads (indices into the layout's H), increasing.
        back: R - 1, the farthest a block of these heads reaches from a query.
        rises: (Hg, n, s) int32, sorted: the column ``R - 1 - (i - start_k(i))`` where C starts counting
            sample k (column ``R - 1`` is the diagonal).
        falls: (Hg, n, s) int32, sorted (bidirectional): ``R + min(end_k(i) - i, R - 1)``, the column
            just past sample k's block (``2R - 1``, past the band, where the block reaches R - 1
            forward); None causal.
    """

    heads: tuple[int, ...]
    back: int
    rises: torch.Tensor
    falls: torch.Tensor | None

    @property
    def width(self) -> int:
        return self.back + 1 if self.falls is None else 2 * self.back + 1

    @property
    def index(self) -> slice | torch.Tensor:
        """The group's heads as an index of the head dimension (a slice where they are consecutive)."""
        h = self.heads
        if h == tuple(range(h[0], h[0] + len(h))):
            return slice(h[0], h[0] + len(h))
        return torch.as_tensor(h, dtype=torch.int64, device=self.rises.device)

    def keys(self, a: int, b: int, n: int) -> tuple[int, int]:
        """The key range ``[lo, hi)`` of queries ``a .. b-1``."""
        return max(0, a - self.back), min(n, (b if self.falls is None else b + self.back))

    def bias(self, a: int, b: int, n: int, dtype: torch.dtype, mean: bool = False) -> torch.Tensor:
        """``log C`` of queries ``a .. b-1`` against their key range :meth:`keys`, (Hg, b-a, hi-lo) in
        ``dtype`` (float32 or float64; ``-inf`` where no mask puts the pair in a block), or with ``mean``
        ``log M~ = log (C / s)`` (the same softmax): a strided view of one buffer (module docstring)."""
        s = self.rises.shape[-1]
        hg, c, w = len(self.heads), b - a, self.width
        wp = w + c  # a row: the band, then c columns of -inf
        rises = self.rises[:, a:b].cpu().numpy()
        cut = [rises] if self.falls is None else [rises, self.falls[:, a:b].cpu().numpy()]
        if self.falls is None:
            cut.append(np.full((hg, c, 1), w, dtype=np.int32))  # the diagonal is the band's last column
        bounds = np.concatenate([np.zeros((hg, c, 1), dtype=np.int32), *cut, np.full((hg, c, 1), wp, dtype=np.int32)],
                                -1)
        pattern = _pattern(s, self.falls is None, dtype, mean)
        buf = torch.from_numpy(np.repeat(np.tile(pattern, hg * c), np.diff(bounds, axis=-1).ravel())).view(hg, c, wp)
        buf = buf.to(self.rises.device)
        view = buf.as_strided((hg, c, c + w - 1), (c * wp, wp - 1, 1))  # row t: band at columns t .. t+w-1
        lo, hi = self.keys(a, b, n)
        start = lo - (a - self.back)
        return view[..., start:start + (hi - lo)]

    def chunks(self, n: int, rows: int = BAND_ROWS) -> Iterator[tuple[int, int, int, int]]:
        """(a, b, lo, hi) of every query chunk and its key range."""
        for a in range(0, n, rows):
            b = min(n, a + rows)
            yield (a, b, *self.keys(a, b, n))


@dataclass(frozen=True, eq=False)
class BandLayout:
    """The sorted block starts and ends of one set of partitions (one per head), grouped by band width.

    Attributes:
        heads, seq_len, num_samples, causal: H, n, s and the direction it was built for.
        groups: the :class:`BandGroup` of heads sharing a band, covering every head once.
    """

    heads: int
    seq_len: int
    num_samples: int
    causal: bool
    groups: tuple[BandGroup, ...]

    @property
    def nbytes(self) -> int:
        """Bytes the layout holds (its sorted starts and ends)."""
        return sum(t.numel() * t.element_size() for g in self.groups for t in (g.rises, g.falls) if t is not None)

    @classmethod
    def of(cls, partitions: Sequence[Partitions], causal: bool, device: torch.device | str = "cpu") -> "BandLayout":
        """The layout of one set of partitions (one per head). On the CPU, where every sample's bins are
        small enough to hold at once, from the block boundaries the partitions computed
        (:meth:`~poslsh_cli.numerics.sampling.Partitions.block_ends`: computed once for the plan's cost
        model and the layout), sorted on the host; otherwise on ``device`` from the drawn scalars
        (:meth:`build`)."""
        n, s = partitions[0].seq_len, partitions[0].num_samples
        if torch.device(device).type != "cpu" or s * n > VECTOR_ELEMENTS or s < 2:
            return cls.build(np.stack([p.widths for p in partitions]), np.stack([p.shifts for p in partitions]),
                             n, causal, device)
        def ascending(x: np.ndarray) -> torch.Tensor:  # (s, n) int32 -> (n, s), each row sorted
            out = torch.from_numpy(x).T.contiguous()  # torch's tiled transpose: about 3x numpy's here
            out.numpy().sort(axis=1)
            return out

        ends = []
        for p in partitions:
            start, end = p.block_ends(ends=not causal)
            ends.append((ascending(start), None if end is None else ascending(end)))
        return cls._grouped(n, s, causal, ends)

    @classmethod
    def build(cls, widths: np.ndarray, shifts: np.ndarray, seq_len: int, causal: bool,
              device: torch.device | str = "cpu") -> "BandLayout":
        """The layout of H partitions given by their drawn scalars ``widths``, ``shifts`` (H, s) float64,
        on ``device``: per sample the bins of every position (:func:`bin_index`), each position's block
        start (and end) by a running maximum (minimum) over the positions, sorted over the samples."""
        widths = np.asarray(widths, dtype=np.float64)
        shifts = np.asarray(shifts, dtype=np.float64)
        H, s = widths.shape
        n = int(seq_len)
        dev = torch.device(device)
        w_t, u_t = to_device(np.stack([widths, shifts]), dev)
        pos = torch.arange(n, device=dev)
        starts, ends = [], []
        step = max(1, BUILD_ELEMENTS // max(1, H * n))
        for a in range(0, s, step):  # samples a few at a time: O(H n step) memory beyond the ends
            bins = bin_index(pos, w_t[:, a:a + step, None], u_t[:, a:a + step, None])  # (H, c, n)
            first = torch.ones(bins.shape, dtype=torch.bool, device=dev)
            first[..., 1:] = bins[..., 1:] != bins[..., :-1]
            starts.append(torch.where(first, pos, 0).cummax(-1).values.to(torch.int32))
            if not causal:
                last = torch.ones_like(first)
                last[..., :-1] = first[..., 1:]
                ends.append(torch.flip(torch.flip(torch.where(last, pos, n), [-1]).cummin(-1).values, [-1])
                            .to(torch.int32))
            del bins, first
        start = torch.sort(torch.cat(starts, 1).transpose(1, 2), -1).values  # (H, n, s)
        end = torch.sort(torch.cat(ends, 1).transpose(1, 2), -1).values if ends else None
        return cls._grouped(n, s, causal, [(start[h], None if end is None else end[h]) for h in range(H)])

    @classmethod
    def _grouped(cls, n: int, s: int, causal: bool,
                 ends: list[tuple[torch.Tensor, torch.Tensor | None]]) -> "BandLayout":
        """The layout from every head's sorted block starts and ends ((n, s) int32 each, owned: they are
        turned into band columns in place), grouped by reach."""
        pos = torch.arange(n, device=ends[0][0].device, dtype=torch.int32)[:, None]
        reach = []
        for start, end in ends:
            r = int((pos[:, 0] - start[:, 0]).max()) + 1  # the farthest start (sorted: the first)
            if end is not None:
                r = max(r, int((end[:, -1] - pos[:, 0]).max()) + 1)
            reach.append(max(1, r))
        groups = []
        for heads in head_groups(reach, n, causal):
            R = max(reach[h] for h in heads)
            for h in heads:
                ends[h][0].sub_(pos).add_(R - 1)
                if not causal:
                    ends[h][1].sub_(pos).clamp_(max=R - 1).add_(R)
            # copies, so that no group keeps the whole (H, n, s) tensor of build() alive
            rises = torch.stack([ends[h][0] for h in heads])
            falls = None if causal else torch.stack([ends[h][1] for h in heads])
            groups.append(BandGroup(tuple(heads), R - 1, rises, falls))
        return cls(len(ends), n, s, bool(causal), tuple(groups))

    def dense_bias(self, dtype: torch.dtype, mean: bool = False) -> torch.Tensor:
        """The whole (H, n, n) ``log C`` (or ``log M~``), ``-inf`` outside every block."""
        n = self.seq_len
        out = torch.full((self.heads, n, n), -math.inf, dtype=dtype, device=self.groups[0].rises.device)
        for g in self.groups:
            out[g.index] = g.bias(0, n, n, dtype, mean)
        return out


class BandedUnion(torch.autograd.Function):
    """:func:`union_banded` with gradients: the CPU flash kernel per head group and query chunk, each
    chunk's ``log C`` bias rebuilt from the sorted ends in the backward pass (the flash kernel's own
    backward), so only q, k, v, the output and its lse are saved."""

    @staticmethod
    def forward(ctx, q, k, v, layout, sc, rows):  # noqa: ANN001, ANN205
        n = layout.seq_len
        out = torch.empty_like(q)
        # the flash kernel's lse is float32 for float32 inputs, float64 for float64 ones
        lse = torch.empty(q.shape[:3], dtype=torch.promote_types(q.dtype, torch.float32), device=q.device)
        for g in layout.groups:
            h = g.index
            qg, kg, vg = q[:, h], k[:, h], v[:, h]
            og = torch.empty_like(qg)
            lg = torch.empty(qg.shape[:3], dtype=lse.dtype, device=q.device)
            for a, b, lo, hi in g.chunks(n, rows):
                og[:, :, a:b], lg[:, :, a:b] = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                    qg[:, :, a:b], kg[:, :, lo:hi], vg[:, :, lo:hi], 0.0, False,
                    attn_mask=g.bias(a, b, n, q.dtype)[None], scale=sc)
            out[:, h], lse[:, h] = og, lg
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (layout, sc, rows)
        return out

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        q, k, v, out, lse = ctx.saved_tensors
        layout, sc, rows = ctx.args
        n = layout.seq_len
        grad = grad.contiguous()
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for g in layout.groups:
            h = g.index
            qg, kg, vg, gg, og, lg = q[:, h], k[:, h], v[:, h], grad[:, h], out[:, h], lse[:, h]
            dqg, dkg, dvg = torch.zeros_like(qg), torch.zeros_like(kg), torch.zeros_like(vg)
            for a, b, lo, hi in g.chunks(n, rows):
                gq, gk, gv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                    gg[:, :, a:b], qg[:, :, a:b], kg[:, :, lo:hi], vg[:, :, lo:hi], og[:, :, a:b], lg[:, :, a:b],
                    0.0, False, attn_mask=g.bias(a, b, n, q.dtype)[None], scale=sc)
                dqg[:, :, a:b] += gq
                dkg[:, :, lo:hi] += gk
                dvg[:, :, lo:hi] += gv
            dq[:, h], dk[:, h], dv[:, h] = dqg, dkg, dvg
        return dq, dk, dv, None, None, None


def union_banded(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: BandLayout, scale: float | None = None,
                 rows: int = BAND_ROWS) -> torch.Tensor:
    """Positional-LSH attention over each query's band of keys with the CPU flash kernel, per head group
    query chunks of ``rows`` against their keys with ``log C`` as the float mask (module docstring).

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
    n = layout.seq_len
    parts = []
    for g in layout.groups:
        h = g.index
        outs = []
        for a, b, lo, hi in g.chunks(n, rows):
            scores = (q[:, h, a:b] @ k[:, h, lo:hi].transpose(-1, -2)).to(acc) * sc + g.bias(a, b, n, acc)
            outs.append((torch.softmax(scores, dim=-1).to(v.dtype) @ v[:, h, lo:hi]).to(q.dtype))  # (B, Hg, c, d)
        parts.append((g.heads, torch.cat(outs, dim=2)))
    if len(parts) == 1:
        return parts[0][1]
    order = torch.as_tensor([h for heads, _ in parts for h in heads], device=q.device)
    return torch.cat([p for _, p in parts], dim=1)[:, torch.argsort(order)]


def _check(q: torch.Tensor, layout: BandLayout) -> None:
    B, H, n, d = q.shape
    if layout.heads != H or layout.seq_len != n:
        raise ValueError("the BandLayout was built for another head count or length")


def _reach_bounds(widths: np.ndarray, seq_len: int) -> list[int]:
    """R per head (a bound: the widest drawn width's positions, :func:`longest_block`)."""
    w = np.asarray(widths, dtype=np.float64).reshape(-1, np.asarray(widths).shape[-1])
    return [int(r) for r in longest_block(w.max(1), int(seq_len))]


def band_bytes(widths: np.ndarray, seq_len: int, causal: bool, num_samples: int) -> float:
    """Bytes :class:`BandLayout` holds for drawn ``widths`` (H, s): every position's s sorted starts (and
    ends, bidirectional), int32, and one chunk's log-count buffer of the widest group."""
    n = int(seq_len)
    reach = _reach_bounds(widths, n)
    ends = 4.0 * len(reach) * n * num_samples * (1 if causal else 2)
    widest = max(len(g) * (max(reach[h] for h in g) * (1 if causal else 2) + BAND_ROWS)
                 for g in head_groups(reach, n, causal))
    return ends + 4.0 * BAND_ROWS * widest


def band_work(widths: np.ndarray, seq_len: int, causal: bool, rows: int = BAND_ROWS) -> tuple[float, int]:
    """Scored pairs and flash-kernel calls of the banded route over all heads (the plan's cost model),
    each head charged its group's band (:func:`head_groups` on the drawn widths' bounds)."""
    n = int(seq_len)
    reach = _reach_bounds(widths, n)
    groups = head_groups(reach, n, causal, rows)
    pairs = sum(len(g) * band_pairs(max(reach[h] for h in g), n, causal, rows) for g in groups)
    return pairs, len(groups) * -(-n // rows)


__all__ = ["BandLayout", "BandGroup", "head_groups", "union_banded", "band_chunks", "band_bytes", "band_work"]
