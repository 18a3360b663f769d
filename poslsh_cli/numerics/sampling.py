"""Positional LSH: random binning of integer token positions (docs/THEORY.md, "Mask expectation").

One hash function draws a bin width ``delta ~ Gamma(shape=2, scale=sigma)`` and a shift
``u ~ Uniform[0, delta)`` and maps position ``i`` to ``h(i) = floor((i + u) / delta)``.
The 0/1 matrix ``M(h)_ij = 1[h(i) = h(j)]`` is block diagonal with contiguous blocks, and

    E[M(h)]_ij = E_delta[(1 - |i-j| / delta)_+] = exp(-|i-j| / sigma) = L*_ij

(Rahimi & Recht 2007; the paper's Lemma on positional LSH). Drawing the randomness
(:func:`sample_partitions`) is separate from applying it (:mod:`poslsh_cli.numerics.operators`,
:mod:`poslsh_cli.attention`). Only ``2 * num_samples`` scalars are random and they are drawn on
the CPU with a NumPy generator, so a seed gives the same masks on every device.
"""
from __future__ import annotations

import enum
import hashlib
import math
from dataclasses import dataclass
from functools import cached_property

import numpy as np


def bin_index(pos, width, shift):
    """``floor((pos + u) / delta)`` in float64, broadcasting: the bin formula of Positional LSH, the one
    definition every path calls (NumPy arrays here and on the host, torch tensors on any device).

    IEEE float64 addition, division and floor are exactly rounded everywhere, so a device gives the
    bins the host gives, bit for bit, from the same two drawn scalars."""
    if type(pos).__module__.startswith("torch"):
        import torch

        return torch.floor((pos.to(torch.float64) + shift) / width)
    return np.floor((np.asarray(pos, dtype=np.float64) + shift) / width)


def longest_block(width, n: int) -> np.ndarray:
    """A bound on the positions of a block of width ``width`` (host, float64): ``ceil(width)``, one
    more for the rounding of :func:`bin_index`, at most n."""
    return np.minimum(np.ceil(np.asarray(width, dtype=np.float64)).astype(np.int64) + 1, n)


def derive_seed(root_seed: int, *parts: object) -> int:
    """A per-cell seed in [0, 2**31) from the root seed and the cell's parameters.

    Stable across platforms and Python versions (BLAKE2b of a canonical string), so the
    ``seed`` column of a results row replays the cell: ``poslsh sample ... seed=<seed>``.
    """
    text = "|".join([str(int(root_seed))] + [_canon(p) for p in parts])
    digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % (2**31)


def _canon(p: object) -> str:
    if isinstance(p, float):
        return repr(float(p))
    return str(p)


def standard_alibi_slopes(num_heads: int) -> np.ndarray:
    """Standard ALiBi slopes ``m_h`` (Press et al. 2022; HF ``get_alibi_slopes``), shape (H,).

    For H a power of two, ``m_h = 2^(-8h/H)``, h = 1..H. Otherwise the slopes of the closest
    smaller power of two ``P``, then every other slope of the ``2P`` list until H are reached.
    """
    if num_heads < 1:
        raise ValueError(f"num_heads must be >= 1, got {num_heads}")
    p = 2 ** math.floor(math.log2(num_heads))
    base = [2.0 ** (-8.0 * h / p) for h in range(1, p + 1)]
    if p < num_heads:
        extra = [2.0 ** (-8.0 * h / (2 * p)) for h in range(1, 2 * p + 1)][0::2]
        base += extra[: num_heads - p]
    return np.asarray(base, dtype=np.float64)


def alibi_sigmas(num_heads: int) -> np.ndarray:
    """Kernel bandwidths ``sigma_h = 1 / m_h`` for the standard ALiBi slopes, shape (H,)."""
    return 1.0 / standard_alibi_slopes(num_heads)


class Slopes(str, enum.Enum):
    """Where the bandwidths of a scheme come from when no one ``sigma`` is given (``alibi=``)."""

    AUTO = "auto"  # an ALiBi model's own slopes where there is one, else the standard slopes
    MODEL = "model"  # the model's own (ALiBi models only)
    STANDARD = "standard"  # the standard slopes of the head count


def bandwidths(heads: int, sigma: float | None = None, model: "np.ndarray | None" = None,
               slopes: "Slopes | str" = Slopes.AUTO) -> np.ndarray:
    """The one rule for a scheme's per-head bandwidths, shape (H,) float64: ``sigma`` for every head
    when given (the paper's constant sigma); else a model's own (``model``, an ALiBi checkpoint's
    ``1 / slope``) under ``slopes=auto`` or ``model``; else the standard ALiBi slopes (``sigma = None``
    means the standard slopes). ValueError for ``slopes=model`` without the model's own, or with a
    ``sigma``."""
    slopes = Slopes(slopes)
    if sigma is not None:
        if slopes is Slopes.MODEL:
            raise ValueError("sigma= sets the bandwidths and alibi=model keeps the checkpoint's own: give one")
        return np.full(int(heads), float(sigma))
    if model is not None and slopes is not Slopes.STANDARD:
        return np.asarray(model, dtype=np.float64).reshape(-1)
    if slopes is Slopes.MODEL:
        raise ValueError("alibi=model: the model has no ALiBi slopes of its own (use alibi=standard)")
    return alibi_sigmas(int(heads))


#: Largest s * n for which every sample's boundaries come from one (s, n) bin array at once (a few
#: vector passes) rather than per sample in O(n / delta) (a Python loop over the samples).
VECTOR_ELEMENTS = 2**22


@dataclass(frozen=True, eq=False)
class Partitions:
    """``num_samples`` random contiguous partitions of positions ``0..seq_len-1``.

    Attributes:
        seq_len: n, number of positions.
        sigma: kernel bandwidth the widths were drawn for.
        widths: (s,) float64, bin widths ``delta_k``.
        shifts: (s,) float64, shifts ``u_k`` in ``[0, delta_k)``.
    """
    seq_len: int
    sigma: float
    widths: np.ndarray
    shifts: np.ndarray

    @property
    def num_samples(self) -> int:
        return int(self.widths.shape[0])

    def bins_of(self, k: int) -> np.ndarray:
        """Block id of every position in sample k, shape (n,) int64, starting at 0.

        ``floor((arange(n) + shifts[k]) / widths[k])`` minus its first value. Ids are not
        consecutive when ``delta < 1`` (empty bins are skipped); blocks are still contiguous.
        """
        raw = bin_index(np.arange(self.seq_len), self.widths[k], self.shifts[k]).astype(np.int64)
        return raw - raw[0]

    def bins(self) -> np.ndarray:
        """Block ids of all samples, shape (s, n) int64 (see :meth:`bins_of`)."""
        return np.stack([self.bins_of(k) for k in range(self.num_samples)])

    @cached_property
    def offsets(self) -> tuple[np.ndarray, ...]:
        """Block boundaries per sample, like flash-attention's ``cu_seqlens``.

        ``offsets[k]`` is int64 of shape (num_blocks_k + 1,): ``[0, start_1, ..., n]``; block b
        of sample k holds positions ``offsets[k][b] : offsets[k][b+1]``. Computed in
        O(n / delta_k) per sample from the bin edges (never an (n,) array when delta is large),
        and equal to the boundaries of :meth:`bins_of`: every start is checked against the same
        float64 expression ``floor((i + u) / delta)``.
        """
        n, s = self.seq_len, self.num_samples
        if s * n > VECTOR_ELEMENTS or s < 2:
            return tuple(_block_starts(n, float(w), float(u)) for w, u in zip(self.widths, self.shifts))
        starts = self._flat_starts  # every sample at once: one (s, n) bin array, no loop over samples
        rows = np.searchsorted(starts, np.arange(1, s) * n)
        return tuple(np.concatenate((part - k * n, [n])) for k, part in enumerate(np.split(starts, rows)))

    @cached_property
    def _starts_mask(self) -> np.ndarray:
        """(s, n) bool: position i starts a block of sample k (from the (s, n) bin array)."""
        b = bin_index(np.arange(self.seq_len)[None, :], self.widths[:, None], self.shifts[:, None])
        change = np.ones(b.shape, dtype=bool)
        change[:, 1:] = b[:, 1:] != b[:, :-1]
        return change

    @cached_property
    def _flat_starts(self) -> np.ndarray:
        """Block starts of every sample in the flattened (s, n) bin array (sample k's at ``k n + i``),
        increasing: each sample's first position starts a block."""
        return np.flatnonzero(self._starts_mask)

    def block_ends(self, ends: bool = True) -> tuple[np.ndarray, np.ndarray | None]:
        """The first and (``ends``) last position of the block holding each position, (s, n) int32 each:
        ``start_k(i)`` and ``end_k(i)``, from the starts and lengths the boundaries already hold (what
        the union route's layout is built from, :mod:`poslsh_cli.attention.band`)."""
        n, s = self.seq_len, self.num_samples
        first = (self._flat_starts % n).astype(np.int32)  # each block's first position in its sample
        lengths = self.lengths
        start = np.repeat(first, lengths).reshape(s, n)
        if not ends:
            return start, None
        return start, np.repeat(first + (lengths - 1).astype(np.int32), lengths).reshape(s, n)

    @cached_property
    def lengths(self) -> np.ndarray:
        """Length of every block of every sample, concatenated in sample order, int64 (what the
        plan's cost model and the block layout read; without a Python loop over the samples where
        the (s, n) bin array is small)."""
        n, s = self.seq_len, self.num_samples
        if s * n > VECTOR_ELEMENTS or s < 2:
            return np.concatenate([np.diff(o) for o in self.offsets])
        return np.diff(np.concatenate((self._flat_starts, [s * n])))

    def block_lengths(self) -> list[np.ndarray]:
        """Length of every block, one int64 array per sample."""
        return [np.diff(o) for o in self.offsets]

    @property
    def b_max(self) -> int:
        """Largest block (number of positions) over all samples."""
        return int(self.lengths.max())


def _block_starts(n: int, width: float, shift: float) -> np.ndarray:
    """``[0, start_1, ..., n]`` where ``floor((i + shift) / width)`` changes, in O(n / width).

    Bin m >= 1 starts at the smallest i with ``floor((i + u) / delta) >= m``, about
    ``ceil(m delta - u)``; the estimate is corrected by at most a step either way with the exact
    expression, so the result equals the boundaries of the (n,) bin array bit for bit.
    """
    def bin_of(i: np.ndarray) -> np.ndarray:
        return bin_index(i, width, shift)

    if width <= 2.0:  # about one bin per position or more: the (n,) array is the cheap way
        b = bin_of(np.arange(n))
        return np.concatenate(([0], np.flatnonzero(np.diff(b)) + 1, [n])).astype(np.int64)
    first = bin_of(np.zeros(1, dtype=np.int64))[0]
    last = bin_of(np.full(1, n - 1, dtype=np.int64))[0]
    if last == first:
        return np.asarray([0, n], dtype=np.int64)
    m = np.arange(first + 1, last + 1, dtype=np.float64)  # every bin after the first one
    i = np.clip(np.ceil(m * width - shift).astype(np.int64), 1, n - 1)
    for _ in range(3):  # rounding puts the estimate at most one step off; correct it exactly
        down = (i > 1) & (bin_of(i - 1) >= m)
        up = (i < n - 1) & (bin_of(i) < m)
        if not (down.any() or up.any()):
            break
        i = i - down + up
    # delta > 2: consecutive bins start at least two positions apart, so starts strictly increase
    return np.concatenate(([0], i, [n])).astype(np.int64)


class Sampler(str, enum.Enum):
    """How the s (width, shift) pairs of one head are drawn. Every sampler draws each pair with
    the same marginal law (width ~ Gamma(2, sigma), shift ~ U[0, width)), so the mean mask is an
    unbiased estimate of L* whichever is used; they differ in how the s pairs spread jointly.

    - ``iid``: independent pairs.
    - ``stratified``: a Latin hypercube over (width quantile, shift fraction): each of the s
      equal slices of either unit coordinate holds exactly one pair (scipy.stats.qmc).
    - ``sobol``: a scrambled Sobol sequence over the same two coordinates (Owen scrambling:
      each point uniform on the square, the set of s well spread; scipy.stats.qmc).
    """
    IID = "iid"
    STRATIFIED = "stratified"
    SOBOL = "sobol"


#: the ``sampler`` key's help, shared by every command that draws masks
SAMPLER_HELP = ("how the s masks of each head are drawn: iid (independent), stratified (a Latin hypercube over "
                "width quantile and shift) or sobol (scrambled Sobol); each unbiased for L*")


def unit_pairs(num_samples: int, generator: np.random.Generator, sampler: "Sampler | str") -> np.ndarray:
    """(s, 2) points of the unit square, each uniform: (width quantile, shift fraction)."""
    sampler = Sampler(sampler)
    if sampler is Sampler.STRATIFIED:
        from scipy.stats import qmc

        return qmc.LatinHypercube(d=2, rng=generator).random(num_samples)
    if sampler is Sampler.SOBOL:
        import warnings

        from scipy.stats import qmc

        with warnings.catch_warnings():  # balance properties hold best at powers of two; any s is unbiased
            warnings.simplefilter("ignore", UserWarning)
            return qmc.Sobol(d=2, scramble=True, rng=generator).random(num_samples)
    raise ValueError(f"unit_pairs draws stratified or sobol points, not {sampler.value}")


def sample_partitions(
    seq_len: int, sigma: float, num_samples: int, generator: np.random.Generator,
    sampler: "Sampler | str" = "iid",
) -> Partitions:
    """Draw ``num_samples`` positional-LSH partitions of ``seq_len`` positions.

    ``iid`` draw order (fixed, so seeds replay): all widths ``delta ~ Gamma(2, sigma)``, then all
    ``U[0,1)`` variates, ``u = U * delta``. ``stratified`` and ``sobol`` (:class:`Sampler`) take
    (s, 2) unit points from ``generator`` and map them through the inverse Gamma(2, sigma) CDF
    (width) and ``u = U * delta`` (shift): the same marginal law, less variance in the mean mask.
    """
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    if not sigma > 0:
        raise ValueError(f"sigma must be > 0, got {sigma}")
    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1, got {num_samples}")
    if Sampler(sampler) is Sampler.IID:
        widths = generator.gamma(shape=2.0, scale=float(sigma), size=num_samples)
        shifts = generator.random(num_samples) * widths
    else:
        from scipy.stats import gamma

        pts = unit_pairs(num_samples, generator, sampler)
        widths = gamma.ppf(pts[:, 0], a=2.0, scale=float(sigma))
        widths = np.maximum(widths, np.finfo(np.float64).tiny)  # a quantile of exactly 0 has width 0
        shifts = pts[:, 1] * widths
    return Partitions(int(seq_len), float(sigma), widths, shifts)


def fixed_block_partitions(seq_len: int, sigmas: "np.ndarray | list[float]") -> list[Partitions]:
    """The paper's fixed-block baseline: one deterministic partition per head, width round(2 sigma),
    aligned at 0 (width at least 1)."""
    return [Partitions(seq_len, float(sigma), np.asarray([float(max(1, round(2 * sigma)))]), np.zeros(1))
            for sigma in np.asarray(sigmas, dtype=np.float64).reshape(-1)]


def windows(sigmas: "np.ndarray | list[float]", c: float) -> tuple[int, ...]:
    """Windowed-ALiBi half-widths ``w_h = ceil(c sigma_h)``, one per head."""
    return tuple(int(math.ceil(c * float(sigma))) for sigma in np.asarray(sigmas, dtype=np.float64).reshape(-1))


# ---------------------------------------------------------------------------------------------
# Theory for block statistics (used by block-stats, plots and the report)


def width_max_cdf(t: np.ndarray | float, sigma: float, num_samples: int) -> np.ndarray:
    """Exact law of the largest width: ``P(max_k delta_k <= t) = (1 - e^{-t/sigma}(1 + t/sigma))^s``."""
    x = np.asarray(t, dtype=np.float64) / sigma
    return (-np.expm1(-x) - x * np.exp(-x)) ** num_samples


def width_max_quantile(q: float, sigma: float, num_samples: int) -> float:
    """Quantile q of ``max_k delta_k`` under the exact law (bisection on the CDF)."""
    from scipy.optimize import brentq

    target = q ** (1.0 / num_samples)  # per-width CDF level
    f = lambda x: (-math.expm1(-x) - x * math.exp(-x)) - target  # noqa: E731
    hi = 1.0
    while f(hi) < 0:
        hi *= 2.0
    return sigma * brentq(f, 0.0, hi, xtol=1e-12)


def width_max_draws(size: int, sigma: float, num_samples: int, generator: np.random.Generator) -> np.ndarray:
    """``size`` independent draws of ``max_k delta_k``, the largest of ``num_samples`` widths
    ``delta_k ~ Gamma(2, sigma)`` (the law of :func:`width_max_cdf`). Shape (size,)."""
    return generator.gamma(shape=2.0, scale=float(sigma), size=(int(size), int(num_samples))).max(axis=1)


def block_max_cdf(L: np.ndarray | float, sigma: float, num_samples: int) -> np.ndarray:
    """Law of the realised largest block (positions) over s samples, for n >> sigma.

    A sample of width delta holds interior blocks of ``floor(delta)`` and ``ceil(delta)``
    positions, and among its ~n/delta bins a ``ceil(delta)`` one appears (edge blocks are only
    shorter), so its largest block is ``ceil(delta)`` and, at integer L,
    ``P(b_max <= L) = P(max_k delta_k <= L) = (1 - e^{-L/sigma}(1 + L/sigma))^s``.
    """
    return width_max_cdf(np.floor(np.asarray(L, dtype=np.float64)), sigma, num_samples)


def block_max_quantile(q: float, sigma: float, num_samples: int) -> int:
    """Smallest integer L with ``P(b_max <= L) >= q`` under :func:`block_max_cdf`."""
    return int(math.ceil(width_max_quantile(q, sigma, num_samples) - 1e-9))


def mean_blocks(n: int, sigma: float) -> float:
    """Expected number of blocks of one sample of n positions: ``n E[min(1, 1/delta)] + 1`` for
    ``delta ~ Gamma(2, sigma)``, i.e. ``n (P(delta < 1) + e^{-1/sigma} / sigma) + 1`` (a bin of
    width delta >= 1 covers about delta positions; below 1 every position is its own block).
    Memory estimates use it."""
    p_small = 1.0 - math.exp(-1.0 / sigma) * (1.0 + 1.0 / sigma)
    return float(n) * (p_small + math.exp(-1.0 / sigma) / sigma) + 1.0


def block_length_pmf(lengths: np.ndarray, sigma: float) -> np.ndarray:
    """Probability that a block picked uniformly among all blocks has each given length.

    For ``n >> delta`` a sample of width delta has about ``n / delta`` bins; a bin holds
    ``floor(delta)`` or ``ceil(delta)`` positions (the latter with probability frac(delta)),
    and when ``delta < 1`` every position is its own block. Weighting the Gamma(2, sigma)
    density by the block count ``n / delta`` gives an Exponential(sigma) density for the width
    of a random block (for ``delta >= 1``), which is then spread over the two neighbouring
    integers. Edge blocks are ignored (their share is O(sigma / n)).
    """
    from scipy.integrate import quad

    lengths = np.asarray(lengths, dtype=np.int64)
    # expected blocks per unit length: delta >= 1 contributes exp(-d/s)/s^2 per unit of d
    # (the Gamma density d/s^2 e^{-d/s} times 1/d); delta < 1 contributes P(delta < 1) blocks
    # of length 1 per position.
    p_small = 1.0 - math.exp(-1.0 / sigma) * (1.0 + 1.0 / sigma)
    dens = lambda d: math.exp(-d / sigma) / sigma**2  # noqa: E731
    total = p_small + quad(dens, 1.0, np.inf)[0]
    out = np.zeros(lengths.shape, dtype=np.float64)
    for idx, L in np.ndenumerate(lengths):
        if L < 1:
            continue
        mass = 0.0
        # delta in [L-1, L): ceil = L with weight frac = delta - (L-1)
        if L >= 2:
            mass += quad(lambda d: dens(d) * (d - (L - 1)), L - 1.0, float(L))[0]
        # delta in [max(L,1), L+1): floor = L with weight 1 - frac
        mass += quad(lambda d: dens(d) * (L + 1 - d), max(float(L), 1.0), L + 1.0)[0]
        if L == 1:
            mass += p_small
        out[idx] = mass / total
    return out
