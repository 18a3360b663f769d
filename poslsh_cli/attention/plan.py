"""One plan per call: which backend (and which kernel inside it) computes an attention method,
decided in one place from the method, device, dtype, length and whether gradients are needed.

    backend    what it is                                                   kernel family
    reference  dense float64, the test oracle                               score (every method)
    sdpa       PyTorch SDPA without bias (flash / memory-efficient)         none
    chunked    query chunks against their key range, bias per chunk         alibi
    rank1      exact ALiBi as one extra q/k coordinate on the bias-free        alibi
               kernel: training causal SDPA; inference the CPU flash kernel by
               query tiles, the coordinate re-centred per tile (also
               bidirectional: the keys before and after a tile, each rank one)
    dense      one SDPA call with an (H, n, n) additive bias                alibi, partitions, score
    blocks     length-bucketed blocks of every sample, merged by lse        partitions
    union      one attention over the union of each query's s blocks,       partitions
               weighted by log of how many masks share the pair (counts
               per cell of the s partitions): FlexAttention on CUDA; on
               the CPU query chunks against their band of keys with the
               flash kernel (counts per position, attention/band.py),
               also with gradients
    flex       FlexAttention (score_mod / block masks), compiled on CUDA;   alibi, partitions, score
               partition methods one mask at a time, merged by lse

Which backends a method has, and the kernel family that runs it on each, is its declaration
(:class:`poslsh_cli.numerics.methods.MethodDef`, ``kernels``); :func:`backends_of` reads it.

Inside ``chunked``, ``blocks`` and ``union`` a :class:`Kernel` runs: ``fused`` (PyTorch's fused
kernels: SDPA with a float mask, the CPU flash kernel, which also returns lse), ``matmul`` (padded
batched matmuls: any device and dtype, differentiable) or, for ``union``, ``flex`` (one
FlexAttention call; compiled on CUDA). A :class:`Plan` names all of it, and its
:attr:`~Plan.label` is what tables, figures and reports print.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from poslsh_cli.numerics.methods import Method, method_def


class Backend(str, enum.Enum):
    REFERENCE = "reference"
    SDPA = "sdpa"
    CHUNKED = "chunked"
    RANK1 = "rank1"
    DENSE = "dense"
    BLOCKS = "blocks"
    UNION = "union"
    FLEX = "flex"


class Kernel(str, enum.Enum):
    """What runs inside the chunked, block and union backends."""

    FUSED = "fused"
    MATMUL = "matmul"
    FLEX = "flex"


def backends_of(method: Method | str) -> tuple[Backend, ...]:
    """The backends ``method`` runs on, as its declaration lists them (the first its CPU inference
    default, the reference last); ValueError for an unknown method."""
    return tuple(Backend(b) for b in method_def(method).backends)


#: Largest n at which bidirectional training (gradients needed) runs one dense attention with an
#: (H, n, n) bias instead of the block or chunked paths: there it costs one attention whatever s is.
#: Causal training takes the dense bias only below RANK1_MIN_N: from there on exact ALiBi trains in
#: O(n) memory (rank1), and the (H, n, n) bias with its probabilities kept for the backward would
#: cost the other methods 2-3x its memory (`poslsh step-bench` at L=1024, batch 1, two layers:
#: Positional LSH s=10 139 MiB dense, 65 MiB on the blocks, exact ALiBi 51 MiB).
DENSE_MAX_N = 4096
#: From this n on, causal exact ALiBi with gradients (float32/64, CPU) takes the rank-one path
#: rather than the dense bias: measured by `poslsh step-bench` on a 2-core CPU, a training step
#: of the 0.9M-parameter default model took 0.275 s (rank1) against 0.247 s (dense) at L=256, and
#: 1.57 s against 1.91 s at L=1024 (padding costs more than the bias at small L, less at large L).
RANK1_MIN_N = 512


#: CPU inference of the partition methods: the dense bias below INFER_DENSE_MAX_N (one attention with
#: log M~, whatever s is: a whole language-model forward pass at L=256, batch 16, sigma=8, s=20 took
#: 0.096 s dense, 0.101 s on the union and 0.517 s on the blocks, 2-core CPU, alone); from there on,
#: float32 and wider with the caller's :class:`Work` (what :func:`~poslsh_cli.attention.api.attend`
#: passes), the blocks or the union, whichever the forward cost model (COST_*_INFER) prices lower;
#: without the work (a bare :func:`choose`, the commands' memory estimates) or in lower precision the
#: union from UNION_MIN_S_CPU masks on, else the blocks: the threshold with the least worst ratio to the
#: faster path over the bfloat16 settings of ``scripts/plan_fit.py``'s fit grid (s = 2, 4, 8: at most
#: 1.25x slower from s = 2 on, 2.2x from s = 4 on, 3.9x from s = 8 on).
UNION_MIN_S_CPU = 2
INFER_DENSE_MAX_N = 512
#: The forward cost model of inference (seconds per unit, float32): the blocks per padded pair (a
#: constant and a part per head dimension) and per gathered row (likewise); the union per scored pair of its
#: head groups' bands (likewise), per flash-kernel call (a head group's query chunk) and per (head,
#: sample, position) of drawing and sorting the block ends. Fitted by ``scripts/plan_fit.py`` to forward
#: passes of both paths on the fit grid and checked on another grid (docs/THEORY.md, "Choosing the
#: inference path").
COST_BLOCK_PAIR_INFER, COST_BLOCK_PAIR_D_INFER = 8.63e-10, 1.63e-11
COST_BLOCK_SLOT_INFER, COST_BLOCK_SLOT_D_INFER = 1.52e-8, 7.05e-9
COST_UNION_PAIR_INFER, COST_UNION_PAIR_D_INFER, COST_UNION_SLOT_INFER = 1.88e-9, 3.79e-11, 1.67e-8
#: The union's cost per flash-kernel call is held fixed in the fit: its calls move with its pairs on the
#: grid. Measured: a head group of one head and a band of 5 keys took 130-165 us a call (n = 16384,
#: d = 16 and 64), about 80 us above its pairs' cost; free fits on the grid gave 52-56 us.
COST_UNION_CALL = 5e-5
#: Where the automatic plan weighs the masks (:func:`weighs`: CPU training, CPU inference in float32
#: and wider past the dense bias) it takes the union only while its layout
#: (:func:`~poslsh_cli.attention.band.band_bytes`: the sorted block ends, O(H s n), and one chunk's log
#: counts; in training each layer's layout stays held for its backward) stays below this many bytes.
UNION_MAX_BYTES = 2**31
#: Queries per chunk of the union route on the CPU (:mod:`poslsh_cli.attention.band`): the mask of a chunk
#: is ``c (c + w - 1)`` per head, so a narrower chunk wastes less of it on the triangle outside the band,
#: a wider one makes fewer flash-kernel calls (each costs COST_UNION_CALL).
BAND_ROWS = 128


def union_band_bound(heads: int, n: int, s: int, capped: bool = False) -> float:
    """The most bytes the union route on the CPU holds at length n
    (:func:`~poslsh_cli.attention.band.band_bytes`): every position's s sorted block starts and ends,
    int32, and one query chunk's float32 log counts with every head in one group whose band spans the
    sequence; at most UNION_MAX_BYTES where ``capped`` (the automatic plan, where it weighs the masks,
    keeps the layout under it)."""
    band = 8.0 * heads * n * s + 4.0 * heads * BAND_ROWS * (2 * n + BAND_ROWS)
    return min(band, UNION_MAX_BYTES) if capped else band


#: Paths that apply attention dropout (PyTorch SDPA's dropout_p).
DROPOUT_BACKENDS = (Backend.SDPA, Backend.DENSE, Backend.RANK1)


#: Cost model of the CPU paths (seconds per unit, forward + backward, float32, head_dim 16),
#: measured on a 2-core CPU (docs/THEORY.md, "Choosing the training path"): only their ratios
#: matter (inference has its own: COST_*_INFER). Dense attention with an (H, n, n) bias per scored pair; Positional LSH's log M~ bias is
#: rebuilt at every step and costs about twice the cached ALiBi bias. The blocks path per padded
#: pair and per gathered row; the banded ALiBi path per scored pair.
COST_DENSE_PAIR = {"alibi": 3.5e-9, "partitions": 8e-9}
COST_BLOCK_PAIR, COST_BLOCK_SLOT = 7e-9, 2e-7
COST_BAND_PAIR = 13e-9
#: The union route on the CPU (:mod:`poslsh_cli.attention.band`): per scored pair of its query chunks
#: against their band of keys (the bias rebuilt in the backward pass), and per (head, sample, position)
#: of building the layout. Measured beside the blocks (forward + backward, 8 heads, d=16,
#: causal, n = 512 and 2048, sigma = n/32 and 4, s = 4, 10, 100; 2-core CPU, alone): the union took
#: 0.04-0.16 s where the blocks took 0.05-1.8 s, slower only at n=2048, sigma=64, s=4 (0.13 s against 0.10 s).
COST_UNION_PAIR, COST_UNION_SLOT = 1.4e-8, 1e-8


@dataclass(frozen=True)
class Work:
    """What each CPU path of one call would compute (per batch element, over all heads): the inputs
    of the cost model. ``block_pairs``/``slots``: the blocks layout's padded pairs and gathered rows
    (partition methods); ``union_pairs``/``union_calls``/``union_bytes``: the union route's scored pairs,
    its flash-kernel calls and the bytes its layout holds; ``band_pairs``: the banded path's scored pairs
    (windowed ALiBi); ``head_dim``: d."""

    heads: int
    n: int
    block_pairs: float = 0.0
    slots: float = 0.0
    band_pairs: float = 0.0
    union_pairs: float = 0.0
    union_bytes: float = 0.0
    union_calls: float = 0.0
    head_dim: int = 64

    def cost(self, method: Method, backend: Backend, inference: bool = False) -> float:
        """Seconds (up to a common factor) of ``backend`` on this work: forward + backward, or the
        forward pass alone (``inference``: the blocks and the union only)."""
        if inference:
            d = self.head_dim
            if backend is Backend.BLOCKS:
                return ((COST_BLOCK_PAIR_INFER + COST_BLOCK_PAIR_D_INFER * d) * self.block_pairs
                        + (COST_BLOCK_SLOT_INFER + COST_BLOCK_SLOT_D_INFER * d) * self.slots)
            if backend is Backend.UNION and self.union_pairs:
                return ((COST_UNION_PAIR_INFER + COST_UNION_PAIR_D_INFER * d) * self.union_pairs
                        + COST_UNION_CALL * self.union_calls + COST_UNION_SLOT_INFER * self.slots)
            return float("inf")
        dense = self.heads * float(self.n) ** 2
        if backend is Backend.DENSE:
            kind = "partitions" if self.block_pairs else "alibi"
            return COST_DENSE_PAIR[kind] * dense
        if backend is Backend.BLOCKS:
            return COST_BLOCK_PAIR * self.block_pairs + COST_BLOCK_SLOT * self.slots
        if backend is Backend.CHUNKED:
            return COST_BAND_PAIR * (self.band_pairs or dense)
        if backend is Backend.UNION and self.union_pairs:
            return COST_UNION_PAIR * self.union_pairs + COST_UNION_SLOT * self.slots
        return float("inf")


@dataclass(frozen=True)
class Plan:
    """How one call computes its method: backend, kernel inside it, compiled or not."""

    method: Method
    backend: Backend
    kernel: Kernel | None = None
    compiled: bool = False

    @property
    def label(self) -> str:
        """``backend[/kernel][/compiled]``, e.g. ``blocks/fused``, ``chunked/fused``, ``flex/compiled``."""
        parts = [self.backend.value] + ([self.kernel.value] if self.kernel else []) + (["compiled"] if self.compiled else [])
        return "/".join(parts)

    def memory_bytes(self, batch: int, heads: int, n: int, head_dim: int, s: int = 0, training: bool = False) -> float:
        """Bytes one attention layer on this path holds at length n (float32), what the commands'
        memory estimates add per layer: the dense path the n x n bias of every head (the kernel under
        it keeps outputs of order n); the reference path the n x n weights of every sequence; the
        blocks Positional LSH's s per-sample outputs and log-sum-exps (about half a head vector each,
        as measured by step-bench); the union route on the CPU its layout (:func:`union_band_bound`);
        any other path (SDPA, rank-1, chunked, FlexAttention) outputs and
        log-sum-exps of order n."""
        rows = 4.0 * batch * heads * n
        own = rows * (head_dim + 1) * 2
        if self.backend is Backend.DENSE:
            return 4.0 * heads * n * n * 2 + own
        if self.backend is Backend.REFERENCE:
            return rows * n * (3 if training else 2)
        if self.backend is Backend.BLOCKS:
            return rows * max(1, s) * (head_dim + 4) / 2 + own
        if self.backend is Backend.UNION and self.kernel is not Kernel.FLEX:
            return union_band_bound(heads, n, s) + own
        return own


def weighs(partitions: bool, device: Any, dtype: Any, n: int, grad: bool) -> bool:
    """Whether the automatic plan reads the cost model's :class:`Work` for this call: on the CPU in
    training, and at inference for the partition methods past the dense bias in float32 and wider
    (the one condition :func:`~poslsh_cli.attention.api.attend` and the benchmarks compute the work by)."""
    import torch

    if torch.device(device).type != "cpu":
        return False
    return grad or (partitions and n >= INFER_DENSE_MAX_N and dtype in (torch.float32, torch.float64))


def needs_grad(*ts: Any) -> bool:
    import torch

    return torch.is_grad_enabled() and any(t.requires_grad for t in ts)


def choose(method: Method | str, *, device: Any, dtype: Any, n: int, causal: bool, grad: bool,
           backend: Backend | str = "auto", kernel: Kernel | str = "auto", work: Work | None = None,
           dropout: bool = False, s: int = 0) -> Plan:
    """The plan for ``method`` on ``device`` with ``dtype`` inputs of length ``n``.

    Backend (``auto``):
    - no_bias: PyTorch SDPA.
    - on CUDA every other method takes FlexAttention (it has its own backward there): exact and
      windowed ALiBi with a ``score_mod``; the partition methods with ``s`` > 1 masks on
      the union route (one call over the union of each query's blocks: its work grows with the
      union, about ``sigma ln s`` keys each side, where one call per mask visits about
      ``1.5 s sigma``, and its memory is one output and the counts, not s outputs), a single mask
      as one call with the blocks as documents (``flex``).
    - for inference on the CPU: exact ALiBi (float32 and wider) on the flash kernel with its bias as
      an extra q/k coordinate re-centred per query tile (``rank1``, causal and bidirectional; the
      fastest exact path), windowed ALiBi (and exact in lower precision) by query chunks, the
      partition methods (poslsh, fixed_block) below INFER_DENSE_MAX_N on the dense bias, beyond
      (float32 and wider, with ``work``) on the blocks or the union route, whichever the forward
      cost model prices lower, the blocks where the union's band would pass UNION_MAX_BYTES;
      in lower precision or without ``work`` on the union from UNION_MIN_S_CPU masks on, else the
      blocks.
    - with gradients on the CPU: causal exact ALiBi from n = RANK1_MIN_N on takes ``rank1``;
      otherwise the cheapest path under the cost model (:class:`Work`) among the dense bias (while
      n is below :func:`dense_limit`: RANK1_MIN_N causal, so memory keeps pace with exact ALiBi's
      O(n) path, DENSE_MAX_N bidirectional), the blocks (partition methods) and the banded chunks
      (ALiBi); from that limit on the partition methods take the blocks or the union route (its
      band of keys per query chunk), whichever the cost model prices lower, the blocks where the
      union's band would pass UNION_MAX_BYTES; without ``work`` the
      dense bias below that limit and the blocks or chunks beyond.
    - a method with neither blocks nor chunks (the generic kernels of a declared score): its first
      backend on the CPU (the dense bias), FlexAttention on CUDA.

    With ``dropout`` the automatic plan, on the CPU and on CUDA, takes the dense bias where it would
    take a path that cannot drop attention probabilities (only DROPOUT_BACKENDS can: FlexAttention,
    the blocks and the union cannot; the rank-one path drops them only causally, training's kernel),
    so a run with attention dropout never fails inside a step.

    Kernel (``auto``): the fused CPU kernels (the flash kernel, which returns lse, and its own
    backward; SDPA with a float mask) on the CPU for float32 and wider, padded matmuls otherwise.
    With gradients the blocks and the banded chunks recompute in the backward pass instead of
    storing scores. ``backend``/``kernel`` force a choice (tests, benchmarks); an impossible one
    is refused.
    """
    import torch

    method = Method(method)
    device = torch.device(device)
    if backend == "auto":
        backend = _backend(method, device, dtype, n, causal, grad, work, s)
        if dropout and (backend not in DROPOUT_BACKENDS or (backend is Backend.RANK1 and not causal)) \
                and Backend.DENSE in backends_of(method):
            backend = Backend.DENSE  # only the SDPA-based paths drop attention probabilities (CPU and CUDA)
    backend = Backend(backend)
    if backend not in backends_of(method):
        raise ValueError(f"method {method.value} has no backend {backend.value!r} "
                         f"(choose from {', '.join(b.value for b in backends_of(method))})")
    if backend is Backend.RANK1 and not causal and (grad or dropout):
        raise ValueError("the rank-one path trains (and drops attention) for causal exact ALiBi only "
                         "(bidirectional: inference without dropout)")
    if backend is Backend.RANK1 and not grad and not dropout and device.type != "cpu":
        raise ValueError("the tiled rank-one path runs on the CPU flash kernel (on CUDA: flex)")
    chosen = None
    if backend in (Backend.BLOCKS, Backend.CHUNKED, Backend.UNION):
        wide = dtype == torch.promote_types(dtype, torch.float32)
        fused = wide if backend is Backend.CHUNKED and not grad else wide and device.type == "cpu"
        if backend is Backend.UNION and device.type == "cuda":
            default = Kernel.FLEX
        else:
            default = Kernel.FUSED if fused or (backend is Backend.UNION and wide) else Kernel.MATMUL
        chosen = Kernel(kernel) if kernel != "auto" else default
        if chosen is Kernel.FLEX and backend is not Backend.UNION:
            raise ValueError(f"kernel flex runs on the union backend, not {backend.value}")
    flexible = backend is Backend.FLEX or chosen is Kernel.FLEX
    if flexible and grad and device.type == "cpu":
        raise ValueError("FlexAttention has no backward on the CPU: train there on another backend "
                         f"(choose from {', '.join(b.value for b in backends_of(method) if b is not Backend.FLEX)})")
    return Plan(method, backend, chosen, compiled=flexible and device.type == "cuda")


def _backend(method: Method, device: Any, dtype: Any, n: int, causal: bool, grad: bool, work: Work | None,
             s: int = 0) -> Backend:
    import torch

    has = backends_of(method)
    if Backend.SDPA in has:
        return Backend.SDPA  # no bias: the fused kernels themselves
    if device.type == "cuda":
        if s > 1 and Backend.UNION in has:
            return Backend.UNION
        return Backend.FLEX if Backend.FLEX in has else has[0]
    sparse = next((b for b in (Backend.BLOCKS, Backend.CHUNKED) if b in has), has[0])
    rank1 = Backend.RANK1 in has and dtype in (torch.float32, torch.float64)
    if not grad:
        if rank1:
            return Backend.RANK1  # the flash kernel with a re-centred extra coordinate, causal or not
        if n < INFER_DENSE_MAX_N and Backend.DENSE in has and Backend.BLOCKS in has:
            return Backend.DENSE  # at training lengths one attention with the (H, n, n) bias, whatever s is
        if work is not None and work.union_pairs and Backend.UNION in has and Backend.BLOCKS in has \
                and dtype in (torch.float32, torch.float64):  # measured in float32 (COST_*_INFER)
            if work.union_bytes > UNION_MAX_BYTES:
                return Backend.BLOCKS
            return min((Backend.BLOCKS, Backend.UNION), key=lambda b: work.cost(method, b, inference=True))
        if s >= UNION_MIN_S_CPU and Backend.UNION in has:
            return Backend.UNION  # many masks: one attention over their union costs less than s of them
        return sparse
    if rank1 and causal and n >= RANK1_MIN_N:
        return Backend.RANK1
    if n >= dense_limit(method, causal) or Backend.DENSE not in has:
        # past the dense bias: the blocks, or the union of each query's blocks (its band of keys)
        # where the cost model says it costs less (many masks)
        if work is not None and work.union_pairs and Backend.UNION in has and work.union_bytes <= UNION_MAX_BYTES:
            return min((sparse, Backend.UNION), key=lambda b: work.cost(method, b))
        return sparse
    if work is None:
        return Backend.DENSE
    return min((Backend.DENSE, sparse), key=lambda b: work.cost(method, b))


def dense_limit(method: Method, causal: bool) -> int:
    """Training length from which the dense (H, n, n) bias is no longer taken: for the methods
    compared with exact ALiBi, RANK1_MIN_N when causal (from there exact ALiBi trains in O(n)
    memory, so must they), else past DENSE_MAX_N (bidirectional exact ALiBi is dense itself up to
    there); a method with the rank-one path (exact ALiBi) off it (bidirectional, low precision) up
    to DENSE_MAX_N."""
    return RANK1_MIN_N if causal and Backend.RANK1 not in backends_of(method) else DENSE_MAX_N + 1


def plan_for(method: Method | str, q: Any, k: Any, v: Any, causal: bool, backend: Backend | str = "auto",
             kernel: Kernel | str = "auto", work: Work | None = None, dropout: bool = False,
             s: int = 0) -> Plan:
    """:func:`choose` for these tensors (device, dtype, length, gradient need)."""
    return choose(method, device=q.device, dtype=q.dtype, n=q.shape[-2], causal=causal,
                  grad=needs_grad(q, k, v), backend=backend, kernel=kernel, work=work, dropout=dropout,
                  s=s)
