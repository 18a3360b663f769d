"""Structured operators: the ALiBi kernel L*, one mask M(h), and the mean mask M~.

Every operator here is symmetric n x n and is applied in O(n) without forming the matrix
(docs/THEORY.md, "Fast operators and their exactness"); ``dense()`` exists only as the float64 reference for tests and for
``method=dense``.

    L*_ij = exp(-|i - j| / sigma)              (Laplacian kernel on positions)
    M~    = (1/s) * sum_k M(h_k),  M(h)_ij = 1[h(i) = h(j)]
"""
from __future__ import annotations

import math
from functools import lru_cache

import numpy as np
from scipy.signal import lfilter

from poslsh_cli.sampling import Partitions


class LaplacianKernel:
    """``L*_ij = exp(-|i-j|/sigma)`` on positions 0..n-1 (a Kac-Murdock-Szego matrix).

    ``matvec`` runs two first-order recurrences, ``y = f + b - x`` with
    ``f_i = x_i + a f_{i-1}`` (forward), ``b_i = x_i + a b_{i+1}`` (backward), ``a = e^{-1/sigma}``.
    """

    def __init__(self, seq_len: int, sigma: float):
        self.seq_len = int(seq_len)
        self.sigma = float(sigma)
        self.decay = math.exp(-1.0 / self.sigma)

    def matvec(self, x: np.ndarray) -> np.ndarray:
        """``L* x`` for x of shape (n,) or (n, k); float64."""
        x = np.asarray(x, dtype=np.float64)
        b, a = [1.0], [1.0, -self.decay]
        out = lfilter(b, a, x, axis=0)
        out += lfilter(b, a, x[::-1], axis=0)[::-1]
        out -= x
        return out

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
    matvec is one prefix sum of x, three gathers from it at nearly increasing indices, one prefix
    sum of the changes in start order and one run-length broadcast back to positions: sequential
    memory access, ``O(n + total number of blocks)`` whatever s is.
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
        # positions from each start to the next (0 for all but the last of equal starts)
        self._runs = np.diff(self._start, append=n)

    def matvec(self, x: np.ndarray) -> np.ndarray:
        """``M~ x`` for x of shape (n,) or (n, k); float64."""
        x = np.asarray(x, dtype=np.float64)
        if x.ndim == 2:
            return np.stack([self.matvec(x[:, j]) for j in range(x.shape[1])], axis=1)
        csum = np.empty(self.seq_len + 1)
        csum[0] = 0.0
        np.cumsum(x, out=csum[1:])
        # np.take: about twice as fast as fancy indexing here
        jumps = np.take(csum, self._end)
        at = np.take(csum, self._start)
        at *= 2.0
        jumps -= at
        jumps += np.take(csum, self._prev, out=at)
        np.cumsum(jumps, out=jumps)  # s * (M~ x) from each start on
        out = np.repeat(jumps, self._runs)
        out *= 1.0 / self.num_samples
        return out

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
