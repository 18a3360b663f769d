"""Which keys a query may attend to: causal, windowed and same-block masks, written once.

Every mask used by the attention methods keeps, for query i of group g (a head, or a
(head, sample) pair), one contiguous interval of keys ``[lo_g(i), hi_g(i)]`` whose ends never
decrease with i:

    causal        j <= i                       [0, i]
    window w_g    |i - j| <= w_g               [i - w_g, i + w_g]
    same block    bin_g(i) == bin_g(j)         [start_g(i), end_g(i)]   (contiguous bins)

and the intersection of such masks is again one (monotone) interval. That one fact serves
every backend:

- as a FlexAttention ``mask_mod`` (``mask(b, h, q_idx, kv_idx) -> bool``), the same predicate
  evaluated elementwise;
- as a FlexAttention ``BlockMask`` built from the intervals at tile boundaries alone
  (:func:`block_mask`), in O(G n / tile) work, never evaluating an n x n grid: a query tile
  meets the key tiles between ``lo(first query)`` and ``hi(last query)``, and such a tile pair
  is *full* (no mask needed inside) when ``lo(last query) <= first key`` and
  ``hi(first query) >= last key``;
- in the chunked and reference paths, as the key range of a query chunk and a boolean grid.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Sequence

import torch

Tensor = torch.Tensor


class KeyMask(ABC):
    """Base: keys ``[lo, hi]`` (inclusive) per group and query; the predicate is the same set.

    ``interval(q)`` takes query positions ``q`` (m,) int64 and returns ``(lo, hi)`` of shape
    (G, m) or (1, m) (one row shared by every group); ``__call__(b, h, q_idx, kv_idx)`` returns
    whether key ``kv_idx`` is kept for query ``q_idx`` of group ``h`` (broadcasting tensors; the
    FlexAttention ``mask_mod`` signature). ``span`` is an upper bound on ``hi - lo + 1`` known on
    the host (None: unbounded), so a ``BlockMask`` is sized without reading the device.
    """

    groups: int = 1  # 1: the same for every group
    span: int | None = None

    @abstractmethod
    def interval(self, q: Tensor) -> tuple[Tensor, Tensor]:
        """(lo, hi) inclusive key range for query positions q."""

    @abstractmethod
    def __call__(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        """Keep key kv_idx for query q_idx of group h?"""

    def __and__(self, other: "KeyMask") -> "KeyMask":
        return Intersection((self, other))

    def grid(self, q: Tensor, k: Tensor, groups: int) -> Tensor:
        """Dense keep-grid (groups, len(q), len(k)) bool for query positions q and key positions k."""
        h = torch.arange(groups, device=q.device)[:, None, None]
        return self(h.new_zeros(()), h, q[None, :, None], k[None, None, :]).expand(groups, q.numel(), k.numel())


@dataclass(frozen=True, eq=False)
class Causal(KeyMask):
    """``j <= i``: key interval ``[0, i]``."""

    def interval(self, q: Tensor) -> tuple[Tensor, Tensor]:
        return torch.zeros_like(q)[None], q[None]

    def __call__(self, b, h, q_idx, kv_idx):  # noqa: ANN001
        return kv_idx <= q_idx


@dataclass(frozen=True, eq=False)
class Window(KeyMask):
    """``|i - j| <= w_g``: one half-width per group (``width`` (G,) int64, or one shared)."""

    width: Tensor
    span: int | None = None  # 2 max(w) + 1

    @classmethod
    def of(cls, window: int | Sequence[int] | Tensor, groups: int, device: torch.device | str) -> "Window":
        """Accept one int or one value per group (head)."""
        host = torch.as_tensor(window, device="cpu").reshape(-1).to(torch.int64)  # checked here: no device read
        if host.numel() not in (1, groups):
            raise ValueError(f"window needs one value or one per head ({groups}), got {host.numel()}")
        if bool((host < 0).any()):
            raise ValueError("window must be >= 0")
        return cls(host.expand(groups).contiguous().to(device), 2 * int(host.max()) + 1)

    @property
    def groups(self) -> int:  # type: ignore[override]
        return int(self.width.numel())

    def interval(self, q: Tensor) -> tuple[Tensor, Tensor]:
        w = self.width[:, None]
        return q[None] - w, q[None] + w

    def __call__(self, b, h, q_idx, kv_idx):  # noqa: ANN001
        return (q_idx - kv_idx).abs() <= self.width[h]


@dataclass(frozen=True, eq=False)
class SameBlock(KeyMask):
    """``bin_g(i) == bin_g(j)`` for contiguous bins ``doc`` (G, n) int64, non-decreasing along n.

    The sampled positional-LSH bins of each (head, sample) group are the "documents".
    """

    doc: Tensor
    start: Tensor  # (G, n) first position of i's block
    end: Tensor  # (G, n) last position of i's block
    span: int | None = None  # the longest block, when the caller knows it

    @classmethod
    def of(cls, doc: Tensor, span: int | None = None) -> "SameBlock":
        G, n = doc.shape
        pos = torch.arange(n, device=doc.device).expand(G, n)
        first = torch.ones_like(doc, dtype=torch.bool)
        first[:, 1:] = doc[:, 1:] != doc[:, :-1]
        start = torch.where(first, pos, torch.zeros_like(pos)).cummax(dim=1).values
        last = torch.ones_like(doc, dtype=torch.bool)
        last[:, :-1] = doc[:, :-1] != doc[:, 1:]
        end = torch.where(last, pos, torch.full_like(pos, n))
        end = torch.flip(torch.flip(end, [1]).cummin(dim=1).values, [1])
        return cls(doc, start, end, span)

    @property
    def groups(self) -> int:  # type: ignore[override]
        return int(self.doc.shape[0])

    def interval(self, q: Tensor) -> tuple[Tensor, Tensor]:
        return self.start[:, q], self.end[:, q]

    def __call__(self, b, h, q_idx, kv_idx):  # noqa: ANN001
        return self.doc[h, q_idx] == self.doc[h, kv_idx]


@dataclass(frozen=True, eq=False)
class Span(KeyMask):
    """Explicit key intervals ``[lo_g(i), hi_g(i)]``: ``lo``, ``hi`` (G, n) int64, non-decreasing
    along n (the union of the blocks holding each query, :mod:`poslsh_cli.attention.union`)."""

    lo: Tensor
    hi: Tensor
    span: int | None = None

    @property
    def groups(self) -> int:  # type: ignore[override]
        return int(self.lo.shape[0])

    def interval(self, q: Tensor) -> tuple[Tensor, Tensor]:
        return self.lo[:, q], self.hi[:, q]

    def __call__(self, b, h, q_idx, kv_idx):  # noqa: ANN001
        return (kv_idx >= self.lo[h, q_idx]) & (kv_idx <= self.hi[h, q_idx])


@dataclass(frozen=True, eq=False)
class Intersection(KeyMask):
    """Keys kept by every part; the interval is ``[max lo, min hi]``."""

    parts: tuple[KeyMask, ...]

    def __and__(self, other: KeyMask) -> KeyMask:
        return Intersection(self.parts + (other,))

    @property
    def span(self) -> int | None:  # type: ignore[override]
        known = [p.span for p in self.parts if p.span is not None]
        return min(known) if known else None

    @property
    def groups(self) -> int:  # type: ignore[override]
        return max(p.groups for p in self.parts)

    def interval(self, q: Tensor) -> tuple[Tensor, Tensor]:
        los, his = zip(*(p.interval(q) for p in self.parts))
        lo, hi = los[0], his[0]
        for a, b in zip(los[1:], his[1:]):
            lo, hi = torch.maximum(lo, a), torch.minimum(hi, b)
        return lo, hi

    def __call__(self, b, h, q_idx, kv_idx):  # noqa: ANN001
        keep = self.parts[0](b, h, q_idx, kv_idx)
        for p in self.parts[1:]:
            keep = keep & p(b, h, q_idx, kv_idx)
        return keep


def combine(causal: bool, window: KeyMask | None = None, block: KeyMask | None = None) -> KeyMask | None:
    """The intersection of the masks asked for; None when every key is kept."""
    parts = [m for m in (Causal() if causal else None, window, block) if m is not None]
    if not parts:
        return None
    return parts[0] if len(parts) == 1 else Intersection(tuple(parts))


def block_mask(mask: KeyMask, groups: int, seq_len: int, device: torch.device | str,
               tile: int = 128, q_blocks: bool = True):  # noqa: ANN201
    """FlexAttention ``BlockMask`` (batch 1, ``groups`` heads) for an interval mask.

    For query tile t (positions ``[t T, t T + T)``): key tiles ``lo(first) // T .. hi(last) // T``
    are visited; those with ``lo(last) <= first key`` and ``hi(first) >= last key`` are full (the
    kernel skips ``mask_mod`` there), the rest partial. Index tensors are (1, G, tiles, tiles)
    int32 as ``BlockMask.from_kv_blocks`` requires (one slot per key tile; entries past each
    row's count are ignored). Work and memory O(G tiles^2) for the index tensors only. The
    candidate tiles per row are bounded by the mask's host-known ``span`` (a query tile meets at
    most ``(T - 1 + 2 (span - 1)) // T + 2`` key tiles), so nothing is read back from the device;
    without a span that bound is read once. ``q_blocks=False`` skips the transposed (query-side)
    indices, which only the backward pass reads.
    """
    from torch.nn.attention.flex_attention import BlockMask

    n, T = int(seq_len), int(tile)
    tiles = (n + T - 1) // T
    t = torch.arange(tiles, device=device)
    q_first, q_last = t * T, torch.clamp(t * T + T - 1, max=n - 1)
    lo_first, hi_first = (x.expand(groups, tiles) for x in mask.interval(q_first))
    lo_last, hi_last = (x.expand(groups, tiles) for x in mask.interval(q_last))
    kv_lo = torch.clamp(lo_first, 0, n - 1) // T  # (G, tiles)
    kv_hi = torch.clamp(hi_last, 0, n - 1) // T
    if mask.span is not None:
        width = max(1, min(tiles, (T - 1 + 2 * (int(mask.span) - 1)) // T + 2))
    else:
        width = max(1, int((kv_hi - kv_lo + 1).max()))
    cand = kv_lo[..., None] + torch.arange(width, device=device)  # (G, tiles, width)
    valid = cand <= kv_hi[..., None]
    k_first = cand * T
    k_last = torch.clamp(k_first + T - 1, max=n - 1)
    full = valid & (lo_last[..., None] <= k_first) & (hi_first[..., None] >= k_last)
    partial = valid & ~full

    def pack(sel: Tensor) -> tuple[Tensor, Tensor]:
        count = sel.sum(-1).to(torch.int32)  # (G, tiles)
        order = torch.argsort((~sel).to(torch.int8), dim=-1, stable=True)  # selected first, in order
        idx = torch.clamp(cand.gather(-1, order), max=tiles - 1).to(torch.int32)
        out = torch.zeros(groups, tiles, tiles, dtype=torch.int32, device=device)
        out[..., :width] = idx
        return count[None], out[None]

    def mask_mod(b, h, q_idx, kv_idx):  # noqa: ANN001 - FlexAttention's signature
        return mask(b, h, q_idx, kv_idx)

    kv_num, kv_idx = pack(partial)
    full_num, full_idx = pack(full)
    extra = {} if q_blocks else {"compute_q_blocks": False}
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=T, mask_mod=mask_mod,
                                    seq_lengths=(n, n), **extra)

