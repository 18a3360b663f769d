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

The five methods (``exact``, ``windowed``, ``poslsh``, ``fixed_block``, ``no_bias``) are named in
:class:`Method` and run through one entry point, :func:`attend`, with an
:class:`AttentionSpec`; :func:`choose_backend` is the one place a path is picked for a
device, dtype and gradient. Which keys a query sees (causal, window, same block) is written
once, in :mod:`poslsh_cli.masks`. ``backend="reference"`` (dense, float64) is the test oracle;
on CUDA the exact path is FlexAttention with an ALiBi ``score_mod`` (never an n x n tensor); on
CPU a chunked path keeps memory at O(chunk x n).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from poslsh_cli import masks
from poslsh_cli.methods import Method
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
                        causal: bool, scale: float | None = None,
                        dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    """``D^-1 (A o W) V`` computed densely in ``dtype`` (float64: the test oracle).

    Args:
        q, k, v: (B, H, n, d) any float dtype; queries, keys, values.
        weight: nonnegative multiplicative weight W, (H, n, n) or (n, n); ``None`` for no bias.
            W = L* gives exact ALiBi, W = M~ Positional LSH; zeros drop the pair (log 0 = -inf).
        causal: also drop keys j > i.
        dtype: float64 for the reference; float32 gives the *naive* float32 implementation whose
            error against float64 sets the tolerance of every fast path in the tests.

    Returns ``(out (B, H, n, d), lse (B, H, n))`` in ``dtype``, ``lse = log sum_j A_ij W_ij``.
    """
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    n = q.shape[-2]
    scores = (q @ k.transpose(-1, -2)) * _scale(q.shape[-1], scale)  # (B, H, n, n)
    if weight is not None:
        scores = scores + torch.log(weight.to(dtype))  # log 0 = -inf drops the pair
    if causal:
        i = torch.arange(n, device=q.device)
        scores = scores.masked_fill(~masks.Causal().grid(i, i, 1)[0], _NEG_INF)
    lse = torch.logsumexp(scores, dim=-1)
    return torch.softmax(scores, dim=-1) @ v, lse


def laplacian_weight(n: int, sigmas: torch.Tensor, device: torch.device | str = "cpu") -> torch.Tensor:
    """Dense ``L*_ij = exp(-|i-j| / sigma_h)`` per head: sigmas (H,) -> (H, n, n) float64
    (tests and small references only)."""
    i = torch.arange(n, device=device, dtype=torch.float64)
    dist = (i[:, None] - i[None, :]).abs()
    return torch.exp(-dist[None] / sigmas.to(device=device, dtype=torch.float64)[:, None, None])


# ---------------------------------------------------------------------------------------------
# exact ALiBi and the windowed baseline, without n x n tensors


#: Elements of one chunk's (heads, chunk, keys) bias in the chunked exact path: bounds its memory.
CHUNK_ELEMENTS = 2**26


def alibi_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sigmas: torch.Tensor, causal: bool,
                  window: int | Sequence[int] | None = None, chunk: int | None = None, scale: float | None = None,
                  return_lse: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Exact ALiBi attention by query chunks: memory O(B H chunk n), never (n, n) at once.

    Args:
        q, k, v: (B, H, n, d), any float dtype; queries, keys, values.
        sigmas: (H,) kernel bandwidths, ``sigma_h = 1 / slope_h``.
        causal: drop keys j > i.
        window: None, one half-width for every head or one per head: keys with ``|i - j| > w_h``
            are dropped (windowed exact ALiBi); each chunk then touches only
            ``chunk + 2 max(w)`` keys, so the cost is O(n (chunk + w) d).
        chunk: queries per chunk (default: as many as keep a chunk's bias within
            ``CHUNK_ELEMENTS`` elements, at most 1024).
        return_lse: also return ``lse`` (B, H, n), natural log, float32 or wider.

    Returns (B, H, n, d) in q's dtype. Softmax statistics are kept in float32 at least.
    """
    B, H, n, d = q.shape
    sc = _scale(d, scale)
    if chunk is None:
        chunk = max(16, min(1024, CHUNK_ELEMENTS // max(1, B * H * n)))
    slopes = (1.0 / sigmas).to(device=q.device, dtype=torch.float32)[:, None, None]  # (H, 1, 1)
    acc = torch.promote_types(q.dtype, torch.float32)
    out = torch.empty_like(q)
    lse_all = torch.empty(B, H, n, device=q.device, dtype=acc) if return_lse else None
    pos = torch.arange(n, device=q.device)
    keep = masks.combine(causal, None if window is None else masks.Window.of(window, H, q.device))
    for a in range(0, n, chunk):
        b = min(n, a + chunk)
        lo, hi = 0, n
        if keep is not None:  # intervals are monotone: the chunk's keys span lo(a) .. hi(b-1)
            lo = max(0, int(keep.interval(pos[a:a + 1])[0].min()))
            hi = min(n, int(keep.interval(pos[b - 1:b])[1].max()) + 1)
        qi, kj = pos[a:b], pos[lo:hi]
        dist = (qi[:, None] - kj[None, :]).abs().to(acc)  # (c, m)
        bias = -slopes.to(acc) * dist  # (H, c, m)
        if keep is not None:
            bias = bias.masked_fill(~keep.grid(qi, kj, H), _NEG_INF)
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
               window: int | Sequence[int] | None = None, scale: float | None = None,
               compile: bool = True) -> torch.Tensor:
    """Exact (or windowed) ALiBi with FlexAttention: a ``score_mod`` adds ``-|i-j|/sigma_h``.

    Args:
        q, k, v: (B, H, n, d), float16/bfloat16/float32; queries, keys, values.
        sigmas: (H,) kernel bandwidths.
        causal: drop keys j > i.
        window: None, one half-width for every head or one per head (keys with ``|i-j| > w_h``
            are dropped).
        compile: run ``torch.compile``d (CUDA); uncompiled it runs anywhere (tests).

    The ``BlockMask`` comes from the mask's key intervals (:func:`masks.block_mask`), so no
    n x n grid is ever evaluated. Returns (B, H, n, d) in q's dtype.
    """
    from torch.nn.attention.flex_attention import flex_attention

    B, H, n, d = q.shape
    slopes = (1.0 / sigmas).to(device=q.device, dtype=torch.float32)

    def score_mod(score, b, h, qi, kj):  # noqa: ANN001
        return score - slopes[h] * (qi - kj).abs().to(score.dtype)

    win = None if window is None else masks.Window.of(window, H, q.device)
    keep = masks.combine(causal, win)
    bm = None if keep is None else masks.block_mask(keep, H, n, q.device)
    fn = _compiled_flex() if compile else flex_attention
    return fn(q, k, v, score_mod=score_mod, block_mask=bm, scale=_scale(d, scale))


_FLEX = None


def _compiled_flex():  # noqa: ANN202
    global _FLEX
    if _FLEX is None:
        from torch.nn.attention.flex_attention import flex_attention

        _FLEX = torch.compile(flex_attention, dynamic=False)
    return _FLEX


def exact_alibi(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sigmas: Sequence[float] | torch.Tensor,
                causal: bool, window: int | Sequence[int] | None = None, backend: str = "auto",
                scale: float | None = None) -> torch.Tensor:
    """Exact (``window=None``) or windowed ALiBi attention.

    Args:
        q, k, v: (B, H, n, d), any float dtype; queries, keys, values.
        sigmas: (H,) or one value: kernel bandwidths ``sigma_h = 1 / slope_h``.
        causal: drop keys j > i.
        window: None, one half-width for every head, or one per head (keys with
            ``|i - j| > w_h`` dropped).
        backend: ``auto`` (:func:`choose_backend`), ``flex``, ``chunked``, ``dense`` (one SDPA
            call with the (H, n, n) bias), ``rank1`` (causal exact only: one extra q/k
            coordinate, bias-free causal SDPA) or ``reference`` (dense float64; tests only).

    Returns (B, H, n, d) in q's dtype.
    """
    sig = _as_sigmas(sigmas, q.shape[1])
    method = Method.WINDOWED if window is not None else Method.EXACT
    if backend == "auto":
        backend = choose_backend(method, q, k, v, causal)
    if backend == "dense":
        bias = alibi_bias(q.shape[-2], sig, causal, window, q.device, _bias_dtype(q.dtype))
        return dense_bias_attention(q, k, v, bias, scale)
    if backend == "rank1":
        if window is not None or not causal:
            raise ValueError("the rank-one path computes causal exact ALiBi only")
        return alibi_rank1(q, k, v, sig, scale)
    if backend == "reference":
        n, H = q.shape[-2], q.shape[1]
        w = laplacian_weight(n, sig, q.device)
        if window is not None:
            i = torch.arange(n, device=q.device)
            w = w * masks.Window.of(window, H, q.device).grid(i, i, H)
        return reference_attention(q, k, v, w, causal, scale)[0].to(q.dtype)
    if backend == "flex":
        return alibi_flex(q, k, v, sig, causal, window, scale, compile=q.is_cuda)
    if backend == "chunked":
        return alibi_chunked(q, k, v, sig, causal, window, scale=scale)
    raise ValueError(f"unknown backend {backend!r}")


def no_bias_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                      scale: float | None = None) -> torch.Tensor:
    """``softmax(q k^T / sqrt(d)) V`` (PyTorch SDPA: flash/memory-efficient kernels where available).

    q, k, v: (B, H, n, d), any float dtype. Returns (B, H, n, d) in q's dtype.
    """
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                            scale=_scale(q.shape[-1], scale))


# ---------------------------------------------------------------------------------------------
# training paths: one dense attention with an additive bias, and causal ALiBi as a rank-one term


def dense_bias_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor,
                         scale: float | None = None) -> torch.Tensor:
    """``softmax(q k^T * scale + bias) V`` in one SDPA call (differentiable in q, k, v).

    Args:
        q, k, v: (B, H, n, d); queries, keys, values.
        bias: (H, n, n) additive logit bias, ``-inf`` where a key is dropped (causal and
            empty-mask entries); every row keeps at least its diagonal.

    Returns (B, H, n, d) in q's dtype. Memory O(H n^2): for training lengths (n up to
    :data:`DENSE_MAX_N`), where it costs one attention whatever the number of samples s.
    """
    return torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=bias[None].to(q.dtype), scale=_scale(q.shape[-1], scale))


def _bias_dtype(dtype: torch.dtype) -> torch.dtype:
    """Biases are built in float64 for float64 inputs, float32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def alibi_bias(n: int, sigmas: torch.Tensor, causal: bool, window: int | Sequence[int] | None = None,
               device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The ALiBi bias ``-|i-j| / sigma_h``, (H, n, n) in ``dtype``, ``-inf`` where the causal or
    window mask drops a key. It depends only on its arguments, so the last few are cached
    (training rebuilds it in every layer at every step otherwise); treat it as read-only."""
    sig = tuple(float(x) for x in sigmas.reshape(-1))
    win = None if window is None else tuple(int(w) for w in torch.as_tensor(window).reshape(-1).expand(len(sig)))
    return _alibi_bias(n, sig, causal, win, str(device), dtype)


@functools.lru_cache(maxsize=8)
def _alibi_bias(n: int, sigmas: tuple[float, ...], causal: bool, window: tuple[int, ...] | None, device: str,
                dtype: torch.dtype) -> torch.Tensor:
    H = len(sigmas)
    i = torch.arange(n, device=device)
    sig = torch.tensor(sigmas, device=device, dtype=dtype)
    bias = -(i[:, None] - i[None, :]).abs().to(dtype)[None] / sig[:, None, None]
    keep = masks.combine(causal, None if window is None else masks.Window.of(window, H, device))
    return bias if keep is None else bias.masked_fill(~keep.grid(i, i, H), _NEG_INF)


def mean_mask_dense(partitions: Sequence[Partitions], device: torch.device | str = "cpu",
                    dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Dense ``M~`` per head, (H, n, n), built on ``device`` in O(H (s n + n b_max)) work plus the
    (H, n, n) output: ``M~_{i,i+r} = #{k : rem_k(i) >= r} / s`` where ``rem_k(i)`` counts the
    later positions of i's block in sample k; counts are integers, so the result is exact."""
    H, s, n = len(partitions), partitions[0].num_samples, partitions[0].seq_len
    bins = device_bins(partitions, device).reshape(H * s, n)
    end = masks.SameBlock.of(bins).end  # (H*s, n) last position of each position's block
    rem = (end - torch.arange(n, device=device)).reshape(H, s, n).transpose(1, 2)  # (H, n, s)
    R = int(rem.max()) + 1
    hist = torch.zeros(H, n, R, dtype=dtype, device=device)
    hist.scatter_add_(-1, rem, torch.ones_like(rem, dtype=dtype))
    band = hist.flip(-1).cumsum(-1).flip(-1) / s  # (H, n, R): M~_{i, i+r}
    i = torch.arange(n, device=device)
    j = i[:, None] + torch.arange(R, device=device)[None, :]  # (n, R)
    upper = torch.zeros(H, n, n, dtype=dtype, device=device)
    upper.scatter_add_(-1, j.clamp(max=n - 1).expand(H, n, R), band * (j < n))
    return upper + upper.transpose(-1, -2) - torch.eye(n, dtype=dtype, device=device)


def poslsh_bias(partitions: Sequence[Partitions], causal: bool, device: torch.device | str = "cpu",
                dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``log M~`` (H, n, n) in ``dtype`` with ``log 0 = -inf``, and ``-inf`` above the diagonal when
    causal: with it, ``softmax(q k^T / sqrt(d) + log M~) V`` is Positional-LSH attention exactly
    (DESIGN.md section 6).

    Built row by row from the band: ``M~_{i,i-r} = #{k : i - start_k(i) >= r} / s`` (keys
    before i) and ``M~_{i,i+r} = #{k : end_k(i) - i >= r} / s`` (keys after, bidirectional only),
    the logarithm taken on the band only, scattered into a ``-inf`` matrix: O(H n b_max) work
    besides filling the (H, n, n) output.
    """
    H, s, n = len(partitions), partitions[0].num_samples, partitions[0].seq_len
    bins = device_bins(partitions, device).reshape(H * s, n)
    blocks = masks.SameBlock.of(bins)
    pos = torch.arange(n, device=device)
    out = torch.full((H, n, n), _NEG_INF, dtype=dtype, device=device)
    sides = [(pos - blocks.start, -1)] + ([] if causal else [(blocks.end - pos, 1)])
    for reach_all, sign in sides:
        reach_all = reach_all.reshape(H, s, n).transpose(1, 2)  # (H, n, s): how far i's block extends
        for h in range(H):  # each head's own band width: narrow heads cost little
            reach = reach_all[h]
            R = int(reach.max()) + 1
            hist = torch.zeros(n, R, dtype=dtype, device=device)
            hist.scatter_add_(-1, reach, torch.ones_like(reach, dtype=dtype))
            band = torch.log(hist.flip(-1).cumsum(-1).flip(-1) / s)  # (n, R): log M~_{i, i + sign r}
            j = pos[:, None] + sign * torch.arange(R, device=device)[None, :]  # (n, R)
            outside = (j < 0) | (j >= n)
            # entries past the sequence are sent to the diagonal with its own value, log 1 = 0
            out[h].scatter_(-1, torch.where(outside, pos[:, None], j), band.masked_fill(outside, 0.0))
    return out


def alibi_rank1(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sigmas: torch.Tensor,
                scale: float | None = None) -> torch.Tensor:
    """Causal exact ALiBi with the bias-free causal SDPA kernel.

    Under the causal mask ``-m_h (i - j) = m_h j - m_h i`` and ``-m_h i`` is constant along a
    row, where softmax ignores it; ``m_h j`` is a rank-one term that fits in one more q/k
    coordinate: q gets 1, k gets ``m_h (j - c) / scale`` (c = (n-1)/2 keeps the values small),
    zero-padded to a multiple of 8. The logits then carry the offset ``m_h (j - c)``, up to
    ``m_h (n-1)/2`` in size, so their rounding error is about ``eps * m_h (n-1)/2`` (float32 at
    n=1024, m=1/2: 3e-5, far below what training notices); float32 or wider only (bf16 cannot
    hold it).

    Args:
        q, k, v: (B, H, n, d) float32/float64; queries, keys, values.
        sigmas: (H,) kernel bandwidths, ``m_h = 1 / sigma_h``.

    Returns (B, H, n, d) in q's dtype.
    """
    B, H, n, d = q.shape
    sc = _scale(d, scale)
    extra = -(-(d + 1) // 8) * 8 - d  # at least one coordinate, total a multiple of 8
    slopes = (1.0 / sigmas).to(device=q.device, dtype=q.dtype)  # (H,)
    pos = torch.arange(n, device=q.device, dtype=q.dtype) - (n - 1) / 2
    qe = q.new_zeros(B, H, n, extra)
    qe[..., 0] = 1.0
    ke = k.new_zeros(B, H, n, extra)
    ke[..., 0] = (slopes[:, None] * pos[None, :] / sc)[None]
    ve = v.new_zeros(B, H, n, extra)
    out = torch.nn.functional.scaled_dot_product_attention(
        torch.cat([q, qe], -1), torch.cat([k, ke], -1), torch.cat([v, ve], -1), is_causal=True, scale=sc)
    return out[..., :d]


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


@dataclass(frozen=True)
class FlexLayout:
    """Sampled partitions as FlexAttention sees them: query head ``h*s + k`` is (head h, sample
    k), and its ``BlockMask`` keeps keys in the same bin (and causal, when asked).

    ``block_mask`` covers (1, H*s, n, n); built from the bins' block intervals on ``device``
    (:func:`masks.block_mask`), never from an n x n grid.
    """

    heads: int
    num_samples: int
    seq_len: int
    causal: bool
    block_mask: Any

    @classmethod
    def build(cls, partitions: Sequence[Partitions], causal: bool,
              device: torch.device | str = "cpu") -> "FlexLayout":
        H, s, n = len(partitions), partitions[0].num_samples, partitions[0].seq_len
        doc = device_bins(partitions, device).reshape(H * s, n)  # (H*s, n)
        keep = masks.combine(causal, block=masks.SameBlock.of(doc))
        return cls(H, s, n, causal, masks.block_mask(keep, H * s, n, device))


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


#: Upper bound on the bytes of one batch of gathered blocks (q, k, v copies and scores): large
#: buckets are processed in several batches, so memory stays O(s n d), not O(padded slots x d x 3).
BLOCK_BATCH_BYTES = 64 * 2**20


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: BlockLayout, causal: bool,
                    scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Bias-free attention inside every block of every sample; outputs per sample, not merged.

    Args:
        q, k, v: (B, H, n, d), any float dtype; queries, keys, values.
        layout: where the blocks of every (head, sample) are (:class:`BlockLayout`, H heads, n).
        causal: attend only to keys j <= i inside each block.

    Returns ``out (B, H, s, n, d)`` in q's dtype and ``lse (B, H, s, n)`` (float32 or wider,
    natural log): ``lse = log sum_{j in block(i)} exp(q_i . k_j * scale)``.
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


def _block_kernel(qb: torch.Tensor, kb: torch.Tensor, vb: torch.Tensor, ok: torch.Tensor, causal: bool,
                  sc: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention inside padded blocks: ``qb, kb, vb`` (B, nb, L, d), ``ok`` (nb, L) real keys.

    Returns ``(out (B, nb, L, d) in q's dtype, lse (B, nb, L) float32 or wider)``. Padding sits at
    the end of each block, so with causal attention no real query ever sees a padded key.
    """
    B, nb, L, d = qb.shape
    acc = torch.promote_types(qb.dtype, torch.float32)
    if choose_block_kernel(qb, kb, vb) == "fused":
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
        local = torch.arange(L, device=qb.device)
        keep = keep & masks.Causal().grid(local, local, 1)
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
                     causal: bool, scale: float | None = None, layout: BlockLayout | FlexLayout | None = None,
                     sample_chunk: int | None = None, backend: str = "auto") -> torch.Tensor:
    """Positional-LSH attention ``D~^-1 (A o M~) V`` with one :class:`Partitions` per head.

    Args:
        q, k, v: (B, H, n, d), float16/bfloat16/float32/float64; queries, keys, values.
        partitions: H sampled partitions of n positions, each with the same s.
        causal: attend only to keys j <= i (inside each block).
        scale: logit scale (default 1/sqrt(d)).
        layout: a prepared :class:`BlockLayout` or :class:`FlexLayout` (from :func:`poslsh_layout`);
            it fixes the backend. Built from ``partitions`` when omitted.
        sample_chunk: blocks path only; samples processed that many at a time, merged online.
        backend: ``blocks`` (length-bucketed padded blocks, any device, differentiable), ``flex``
            (FlexAttention with the bins as document ids), ``dense`` (one SDPA call with the bias
            ``log M~``: training lengths) or ``auto`` (:func:`choose_backend`).

    Returns (B, H, n, d) in q's dtype.
    """
    if isinstance(layout, FlexLayout):
        backend = "flex"
    elif isinstance(layout, BlockLayout):
        backend = "blocks"
    elif backend == "auto":
        backend = choose_backend(Method.POSLSH, q, k, v, causal)
    if backend == "dense":
        return dense_bias_attention(q, k, v, poslsh_bias(partitions, causal, q.device, _bias_dtype(q.dtype)), scale)
    if backend == "flex":
        return poslsh_flex(q, k, v, partitions, causal, scale, layout=layout)
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


def poslsh_layout(partitions: Sequence[Partitions], causal: bool, backend: str,
                  device: torch.device | str) -> BlockLayout | FlexLayout:
    """The prepared block structure of ``partitions`` for ``backend`` (``blocks`` or ``flex``):
    everything Positional-LSH attention needs besides q, k, v, built on ``device``."""
    if backend == "flex":
        return FlexLayout.build(partitions, causal, device)
    if backend == "blocks":
        return BlockLayout.build(partitions, device)
    raise ValueError(f"unknown backend {backend!r}")


def poslsh_flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, partitions: Sequence[Partitions], causal: bool,
                scale: float | None = None, compile: bool | None = None,
                layout: FlexLayout | None = None) -> torch.Tensor:
    """Positional-LSH attention with FlexAttention: each (head, sample) is one query head whose
    mask keeps keys in the same block (the sampled bins are document ids), ``lse`` returned by
    the kernel, then the merge. Key/value heads are shared across samples through grouped-query
    attention (query head ``h*s + k`` reads kv head ``h``), so only q is repeated s times.

    Args:
        q, k, v: (B, H, n, d), float16/bfloat16/float32; queries, keys, values.
        partitions: H partitions with the same s (ignored when ``layout`` is given).
        layout: a prepared :class:`FlexLayout` for the same H, n and causal flag.
        compile: default: compiled on CUDA; uncompiled (dense, slow) elsewhere, which is how the
            tests check it.

    Returns (B, H, n, d) in q's dtype.
    """
    from torch.nn.attention.flex_attention import AuxRequest, flex_attention

    B, H, n, d = q.shape
    if layout is None:
        layout = FlexLayout.build(partitions, causal, q.device)
    if layout.causal != causal or layout.heads != H or layout.seq_len != n:
        raise ValueError("the FlexLayout was built for another causal flag, head count or length")
    s = layout.num_samples
    qs = q.unsqueeze(2).expand(B, H, s, n, d).reshape(B, H * s, n, d)  # (B, H*s, n, d)
    fn = _compiled_flex() if (q.is_cuda if compile is None else compile) else flex_attention
    out, aux = fn(qs, k, v, block_mask=layout.block_mask, scale=_scale(d, scale), enable_gqa=True,
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


# ---------------------------------------------------------------------------------------------
# The methods, and the one place a path is chosen


#: Backends each method can run on.
BACKENDS: dict[Method, tuple[str, ...]] = {
    Method.EXACT: ("chunked", "flex", "dense", "rank1", "reference"),
    Method.WINDOWED: ("chunked", "flex", "dense", "reference"),
    Method.POSLSH: ("blocks", "flex", "dense", "reference"),
    Method.FIXED_BLOCK: ("blocks", "flex", "dense", "reference"),
    Method.NO_BIAS: ("sdpa", "reference"),
}

#: Which kernel runs the attention inside blocks: "auto" (:func:`choose_block_kernel`), "fused"
#: (PyTorch's CPU flash kernel, which also returns lse) or "manual" (padded matmuls, any device,
#: differentiable). Tests switch it to run every path.
BLOCK_KERNEL = "auto"

#: Largest n at which training (gradients needed) runs one dense attention with an (H, n, n)
#: bias instead of the block or chunked paths: there it costs one attention whatever s is.
DENSE_MAX_N = 4096
#: From this n on, causal exact ALiBi with gradients (float32/64, CPU) takes the rank-one path
#: rather than the dense bias: measured by `poslsh step-bench` on a 2-core CPU, a training step
#: of the 0.9M-parameter default model took 0.275 s (rank1) against 0.247 s (dense) at L=256, and
#: 1.57 s against 1.91 s at L=1024 (padding costs more than the bias at small L, less at large L).
RANK1_MIN_N = 512


def _needs_grad(*ts: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in ts)


def choose_backend(method: Method | str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   causal: bool = False) -> str:
    """The backend for ``method`` given q's device, dtype, length and gradient needs.

    - no_bias: PyTorch SDPA.
    - exact, windowed: FlexAttention with an ALiBi ``score_mod`` on CUDA. On the CPU with
      gradients: causal exact ALiBi from n = RANK1_MIN_N on takes ``rank1`` (one extra q/k
      coordinate on the bias-free causal kernel), shorter or windowed ones the dense bias (up to
      DENSE_MAX_N); query chunks otherwise.
    - poslsh, fixed_block: with gradients, the dense ``log M~`` bias up to DENSE_MAX_N and the
      padded blocks beyond; for inference FlexAttention on CUDA and the blocks elsewhere.
    """
    method = Method(method)
    grad = _needs_grad(q, k, v)
    short = q.shape[-2] <= DENSE_MAX_N
    if method is Method.NO_BIAS:
        return "sdpa"
    if method in (Method.EXACT, Method.WINDOWED):
        if q.is_cuda:
            return "flex"
        if (method is Method.EXACT and grad and causal and q.shape[-2] >= RANK1_MIN_N
                and q.dtype in (torch.float32, torch.float64)):
            return "rank1"
        return "dense" if grad and short else "chunked"
    if grad:
        return "dense" if short else "blocks"
    return "flex" if q.is_cuda else "blocks"


def choose_block_kernel(qb: torch.Tensor, kb: torch.Tensor, vb: torch.Tensor) -> str:
    """Inside the blocks backend: the fused CPU flash kernel when no gradient is needed on the
    CPU, padded matmuls otherwise (or as :data:`BLOCK_KERNEL` forces)."""
    if BLOCK_KERNEL != "auto":
        return BLOCK_KERNEL
    return "fused" if qb.device.type == "cpu" and not _needs_grad(qb, kb, vb) else "manual"


@dataclass(frozen=True, eq=False)
class AttentionSpec:
    """Everything an attention method needs besides q, k, v.

    Attributes:
        method: which :class:`Method`.
        sigmas: (H,) float64 kernel bandwidths, ``sigma_h = 1 / slope_h``.
        causal: drop keys j > i.
        scale: logit scale (None: 1/sqrt(d)).
        window: windowed: (H,) key half-widths ``w_h`` (:func:`windows`).
        partitions: poslsh / fixed_block: one :class:`Partitions` per head.
    """

    method: Method
    sigmas: np.ndarray
    causal: bool
    scale: float | None = None
    window: tuple[int, ...] | None = None
    partitions: tuple[Partitions, ...] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "method", Method(self.method))
        object.__setattr__(self, "sigmas", np.asarray(self.sigmas, dtype=np.float64).reshape(-1))
        if self.method is Method.WINDOWED and self.window is None:
            raise ValueError("windowed attention needs window= (one half-width per head)")
        if self.method in (Method.POSLSH, Method.FIXED_BLOCK) and not self.partitions:
            raise ValueError(f"{self.method.value} attention needs partitions= (one per head)")


def windows(sigmas: Sequence[float], c: float) -> tuple[int, ...]:
    """Windowed baseline half-widths ``w_h = ceil(c sigma_h)``."""
    return tuple(int(math.ceil(c * float(sg))) for sg in np.asarray(sigmas, dtype=np.float64).reshape(-1))


def prepare(spec: AttentionSpec, backend: str, device: torch.device | str) -> BlockLayout | FlexLayout | None:
    """The per-call set-up of a method on ``backend``, apart from q, k, v: for Positional LSH and
    fixed blocks the block layout of the partitions (:func:`poslsh_layout`); nothing otherwise."""
    if spec.method in (Method.POSLSH, Method.FIXED_BLOCK) and backend in ("blocks", "flex"):
        return poslsh_layout(spec.partitions, spec.causal, backend, device)
    return None


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttentionSpec, backend: str = "auto",
           layout: BlockLayout | FlexLayout | None = None) -> torch.Tensor:
    """Run ``spec.method`` on q, k, v: the one entry point of every method.

    Args:
        q, k, v: (B, H, n, d) float16/bfloat16/float32/float64; queries, keys, values (the same
            number of heads; expand grouped key/value heads first).
        spec: the method and its parameters (:class:`AttentionSpec`), one sigma per head.
        backend: ``auto`` (:func:`choose_backend`) or one of ``BACKENDS[spec.method]``.
        layout: a prepared block layout (:func:`prepare`) for poslsh / fixed_block; it fixes the
            backend and keeps its set-up out of the call.

    Returns (B, H, n, d) in q's dtype.
    """
    method = spec.method
    if backend == "auto":
        backend = ("flex" if isinstance(layout, FlexLayout) else "blocks") if layout is not None \
            else choose_backend(method, q, k, v, spec.causal)
    if backend not in BACKENDS[method]:
        raise ValueError(f"method {method.value} has no backend {backend!r} (choose from {', '.join(BACKENDS[method])})")
    if method in (Method.EXACT, Method.WINDOWED):
        return exact_alibi(q, k, v, spec.sigmas, spec.causal, window=spec.window, backend=backend, scale=spec.scale)
    if method is Method.NO_BIAS:
        if backend == "reference":
            return reference_attention(q, k, v, None, spec.causal, spec.scale)[0].to(q.dtype)
        return no_bias_attention(q, k, v, spec.causal, scale=spec.scale)
    if backend == "reference":
        weight = mean_mask_weight(spec.partitions, q.device)
        return reference_attention(q, k, v, weight, spec.causal, spec.scale)[0].to(q.dtype)
    return poslsh_attention(q, k, v, spec.partitions, spec.causal, scale=spec.scale, layout=layout, backend=backend)
