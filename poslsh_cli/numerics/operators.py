"""Structured operators: the ALiBi kernel L*, one mask M(h), and the mean mask M~.

Every operator here is symmetric n x n and is applied in O(n) without forming the matrix
(docs/THEORY.md, "Fast operators and their exactness"); ``dense()`` exists only as the float64 reference for tests and for
``method=dense``.

    L*_ij = exp(-|i - j| / sigma)              (Laplacian kernel on positions)
    M~    = (1/s) * sum_k M(h_k),  M(h)_ij = 1[h(i) = h(j)]
"""
from __future__ import annotations

import math
import os
from functools import lru_cache

import numpy as np
from scipy.signal import lfilter

from poslsh_cli.numerics.sampling import Partitions


class LaplacianKernel:
    """``L*_ij = exp(-|i-j|/sigma)`` on positions 0..n-1 (a Kac-Murdock-Szego matrix).

    ``matvec`` cuts the positions into tiles of ``TILE`` and splits ``L*`` into its diagonal tiles
    (one dense ``TILE x TILE`` Toeplitz block ``D``, the same for every tile) and the rest, which
    between two tiles is rank one: ``L*_{(b,j),(b',j')} = a^{(b-b')T + j - j'}`` for ``b > b'``,
    ``a = e^{-1/sigma}``. So ``L* x = X D + p F_{b-1} + q G_{b+1}`` per tile row ``X_b``, with
    ``F_b = a^T F_{b-1} + sum_j a^{T-1-j} X_{b,j}`` and ``G_b = a^T G_{b+1} + sum_j a^j X_{b,j}``
    two first-order recurrences over ``n / T`` tiles (not n positions), ``p_j = a^{j+1}``,
    ``q_j = a^{T-j}``: one matrix product (BLAS, every core) instead of two length-n recurrences.
    Every weight is at most 1, so nothing grows; the result equals the dense product to float64
    rounding (docs/THEORY.md, "Fast operators and their exactness").
    """

    #: tile length of the blocked product (64: fastest of 16..128 on a 2-core CPU at n = 2^22)
    TILE = 64

    def __init__(self, seq_len: int, sigma: float):
        self.seq_len = int(seq_len)
        self.sigma = float(sigma)
        self.decay = math.exp(-1.0 / self.sigma)
        t = self.TILE
        j = np.arange(t)
        self._tile = np.exp(-np.abs(j[:, None] - j[None, :]) / self.sigma)  # D, symmetric
        a = self.decay
        # [sum weights forward | backward] and [carry weights p | q], all powers of a in (0, 1]
        self._reduce = np.stack([a ** (t - 1 - j), a ** j], axis=1)  # (T, 2)
        self._spread = np.stack([a ** (j + 1), a ** (t - j)], axis=0)  # (2, T)
        self._step = a ** t

    def matvec(self, x: np.ndarray) -> np.ndarray:
        """``L* x`` for x of shape (n,) or (n, k); float64."""
        x = np.asarray(x, dtype=np.float64)
        if x.ndim == 2:
            return np.stack([self.matvec(x[:, c]) for c in range(x.shape[1])], axis=1)
        n, t = self.seq_len, self.TILE
        tiles = -(-n // t)
        if tiles * t != n:  # zeros after the end change nothing before it
            padded = np.zeros(tiles * t)
            padded[:n] = x
            x = padded
        X = x.reshape(tiles, t)
        Y = X @ self._tile
        if tiles > 1:
            sums = X @ self._reduce  # (tiles, 2)
            carry = np.zeros((tiles, 2))
            step = [1.0, -self._step]
            carry[1:, 0] = lfilter([1.0], step, sums[:-1, 0])  # F_{b-1}
            carry[:-1, 1] = lfilter([1.0], step, sums[:0:-1, 1])[::-1]  # G_{b+1}
            Y += carry @ self._spread
        return Y.reshape(-1)[:n].copy() if tiles * t != n else Y.reshape(-1)

    def dense(self) -> np.ndarray:
        """The n x n matrix, float64 (reference only)."""
        i = np.arange(self.seq_len)
        return np.exp(-np.abs(i[:, None] - i[None, :]) / self.sigma)

    def norm(self) -> float:
        """``||L*||_2``, exactly: see :func:`laplacian_norm`."""
        return laplacian_norm(self.seq_len, self.sigma)


@lru_cache(maxsize=256)
def laplacian_norm(seq_len: int, sigma: float) -> float:
    """Largest eigenvalue of ``L*`` (its spectral norm; L* is positive definite).

    The eigenvalues of the KMS matrix ``a^|i-j|`` are ``(1 - a^2) / (1 - 2a cos t + a^2)`` where
    t solves ``sin((n+1)t) - 2a sin(nt) + a^2 sin((n-1)t) = 0`` (Kac, Murdock & Szego 1953);
    the largest belongs to the root in ``(0, pi/(n+1))``, found by bisection to machine
    precision. This avoids Lanczos on L*, whose top spectrum is clustered within O(1/n^2).
    """
    from scipy.optimize import brentq

    n = int(seq_len)
    if n == 1:
        return 1.0
    a = math.exp(-1.0 / sigma)
    b = -math.expm1(-1.0 / sigma)  # 1 - a without cancellation

    def f(t: float) -> float:
        # the same function rewritten so nothing cancels when a -> 1 (large sigma):
        # sin(nt) [(1-a)^2 - 2(1+a^2) sin^2(t/2)] + (1-a)(1+a) sin(t) cos(nt)
        return (math.sin(n * t) * (b * b - 2 * (1 + a * a) * math.sin(t / 2) ** 2)
                + b * (1 + a) * math.sin(t) * math.cos(n * t))

    hi = math.pi / (n + 1)
    # f(t) ~ t [(1-a)^2 n + 1 - a^2] > 0 near 0 and f(hi) < 0: one sign change in between.
    # As sigma -> 0 (a -> 0) the root moves to hi itself (f(hi) = O(a)): once f(hi) rounds to
    # >= 0 the root is hi to machine precision, and ||L*||_2 -> 1 + 2a cos(pi/(n+1)) -> 1.
    if f(hi) >= 0:
        t = hi
    else:
        t = brentq(f, hi * 1e-12, hi, xtol=1e-300, rtol=4 * np.finfo(float).eps, maxiter=500)
    # 1 - 2a cos t + a^2 = (1 - a)^2 + 4a sin^2(t/2)
    return b * (1 + a) / (b * b + 4 * a * math.sin(t / 2) ** 2)


class MeanMask:
    """``M~ = (1/s) sum_k M(h_k)`` for sampled partitions, applied by segment sums.

    ``M(h_k) x`` sums x over each block and broadcasts the sum back over the block, so ``s M~ x`` is
    piecewise constant between block starts and changes at a start ``p`` of sample k (block
    ``[p, q)`` after ``[p', p)``) by ``(c_q - c_p) - (c_p - c_p')``, with ``c`` the prefix sum of x
    (``p' = p = 0`` for a first block). All samples' blocks are merged once, sorted by start, so a
    matvec is one prefix sum of x, three gathers from it at nearly increasing indices (every
    sample's accesses to one stretch of ``c`` come together, so each cache line is read about
    once), one prefix sum of the changes in start order and one gather back to positions (at
    non-decreasing indices): sequential memory access, ``O(n + total number of blocks)`` whatever s
    is. The gathers are split over the cores (:func:`_take`; numpy releases the GIL there).
    """

    def __init__(self, partitions: Partitions):
        self.partitions = partitions
        self.seq_len = n = partitions.seq_len
        self.num_samples = partitions.num_samples
        offs = partitions.offsets
        starts = np.concatenate([o[:-1] for o in offs])  # (B,) every block of every sample
        order = np.argsort(starts, kind="stable")
        self._start = starts[order]
        self._end = np.concatenate([o[1:] for o in offs])[order]
        # the previous block's start in the same sample; a first block (start 0) uses 0 itself
        self._prev = np.concatenate([np.concatenate([o[:1], o[:-2]]) for o in offs])[order]
        # for every position, the last block (in start order) that starts at or before it
        self._last = np.repeat(np.arange(self._start.size), np.diff(self._start, append=n))

    def matvec(self, x: np.ndarray) -> np.ndarray:
        """``M~ x`` for x of shape (n,) or (n, k); float64."""
        x = np.asarray(x, dtype=np.float64)
        if x.ndim == 2:
            return np.stack([self.matvec(x[:, j]) for j in range(x.shape[1])], axis=1)
        csum = np.empty(self.seq_len + 1)
        csum[0] = 0.0
        np.multiply(x, 1.0 / self.num_samples, out=csum[1:])
        np.cumsum(csum[1:], out=csum[1:])
        jumps = _take(csum, self._end)
        at = _take(csum, self._start)
        at *= 2.0
        jumps -= at
        jumps += _take(csum, self._prev, out=at)
        np.cumsum(jumps, out=jumps)  # M~ x from each start on
        return _take(jumps, self._last)

    def dense(self) -> np.ndarray:
        """The n x n mean mask, float64 (references only): exact counts / s.

        Built from the band, never pair by pair: ``M~_{i,i+r} = #{k : rem_k(i) >= r} / s`` with
        ``rem_k(i)`` the later positions of i's block in sample k (:meth:`remaining`), so the work is
        O(s n + n b_max) besides the n x n output, and every entry is an integer over s.
        """
        n, s = self.seq_len, self.num_samples
        rem = self.remaining(slice(None))  # (s, n)
        R = int(rem.max()) + 1
        hist = np.zeros((n, R), dtype=np.float64)
        np.add.at(hist, (np.broadcast_to(np.arange(n), rem.shape), rem), 1.0)
        band = hist[:, ::-1].cumsum(axis=1)[:, ::-1]  # (n, R): #{k : rem_k(i) >= r}
        upper = np.zeros((n, n), dtype=np.float64)
        for r in range(R):
            i = np.arange(n - r)
            upper[i, i + r] = band[: n - r, r]
        return (upper + upper.T - np.diag(np.diag(upper))) / s

    def remaining(self, rows: slice) -> np.ndarray:
        """For positions in ``rows``: how many later positions share the block, per sample.

        ``rem[k, i] = end_k(i) - 1 - i``, shape (s, len(rows)) int64. Then
        ``M(h_k)_{i, i+r} = 1`` iff ``0 <= r <= rem[k, i]``.
        """
        idx = np.arange(self.seq_len)[rows]
        out = np.empty((self.num_samples, idx.shape[0]), dtype=np.int64)
        for k, o in enumerate(self.partitions.offsets):
            block = np.searchsorted(o, idx, side="right") - 1
            out[k] = o[block + 1] - 1 - idx
        return out


#: below this length an array is too short for threads to pay
_THREADS_MIN_N = 1 << 16


@lru_cache(maxsize=1)
def _threads() -> int:
    """Threads that split a gather: one per core, at most 4."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(4, cores))


@lru_cache(maxsize=1)
def _pool():
    from concurrent.futures import ThreadPoolExecutor

    return ThreadPoolExecutor(max_workers=_threads(), thread_name_prefix="poslsh-op")


if hasattr(os, "register_at_fork"):  # a forked child has none of the parent's threads
    os.register_at_fork(after_in_child=_pool.cache_clear)


def _splits(m: int) -> list[tuple[int, int]]:
    t = _threads() if m >= _THREADS_MIN_N else 1
    b = [m * i // t for i in range(t + 1)]
    return list(zip(b[:-1], b[1:]))


def _take(a: np.ndarray, idx: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """``a[idx]`` for valid indices, the gather split over the cores (``mode="clip"`` writes ``out``
    directly; ``"raise"`` would buffer it)."""
    if out is None:
        out = np.empty(idx.shape[0], dtype=a.dtype)
    parts = _splits(idx.shape[0])
    if len(parts) == 1:
        return np.take(a, idx, out=out, mode="clip")
    list(_pool().map(lambda r: np.take(a, idx[r[0]:r[1]], out=out[r[0]:r[1]], mode="clip"), parts))
    return out
