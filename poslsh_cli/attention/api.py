"""The one entry point of every attention method: :class:`AttentionSpec` (built by one factory,
:meth:`AttentionSpec.build`), :func:`attend`, and :data:`KERNELS`, the table from a backend and a
kernel family to its implementation: a method's declaration
(:class:`~poslsh_cli.numerics.methods.MethodDef`) names the family it runs on each backend, the
:class:`~poslsh_cli.attention.plan.Plan` the backend (docs/ARCHITECTURE.md, "Adding an attention
method").

All operators take SDPA-layout tensors ``q, k, v`` of shape (batch, heads, seq_len, head_dim) and
one kernel bandwidth per head, ``sigma_h = 1 / slope_h``.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch

from poslsh_cli.attention.alibi import (BAND_CHUNK, alibi_banded, alibi_chunked, alibi_rank1, alibi_rank1_tiled,
                                       no_bias_attention)
from poslsh_cli.attention.band import BandLayout, band_bytes, band_chunks, band_work, union_banded
from poslsh_cli.attention.blocks import BlockLayout, merged_block_attention, padded_work
from poslsh_cli.attention.dense import alibi_bias, bias_dtype, dense_bias_attention, poslsh_bias, score_bias
from poslsh_cli.attention.flex import FlexLayout, alibi_flex, poslsh_flex, score_flex
from poslsh_cli.attention.plan import (DROPOUT_BACKENDS, Backend, Kernel, Plan, Work, choose, needs_grad, plan_for,
                                      weighs)
from poslsh_cli.attention.reference import as_sigmas, head_params, method_bias, method_weight, reference_attention
from poslsh_cli.attention.union import UnionLayout, union_chunked, union_flex
from poslsh_cli.numerics.methods import Method, method_def
from poslsh_cli.numerics.sampling import Partitions, fixed_block_partitions, sample_partitions, windows


@dataclass(frozen=True, eq=False)
class AttentionSpec:
    """Everything an attention method needs besides q, k, v.

    Attributes:
        method: which :class:`Method`.
        sigmas: (H,) float64 kernel bandwidths, ``sigma_h = 1 / slope_h``.
        causal: drop keys j > i.
        scale: logit scale (None: 1/sqrt(d)).
        window: windowed: (H,) key half-widths ``w_h`` (:func:`poslsh_cli.numerics.sampling.windows`).
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
        params = method_def(self.method).params
        if params == "window" and self.window is None:
            raise ValueError(f"{self.method.value} attention needs window= (one half-width per head)")
        if params.endswith("partitions") and not self.partitions:
            raise ValueError(f"{self.method.value} attention needs partitions= (one per head)")

    @property
    def s(self) -> int:
        """Masks per head (the scheme's s; the partitions' count), 0 for a method without drawn ones."""
        return self.partitions[0].num_samples if self.partitions else 0

    @cached_property
    def bin_table(self) -> tuple[np.ndarray, np.ndarray]:
        """Partition methods: the widths and shifts of every head's samples, (H, s) float64 each,
        stacked once per spec (position i of sample k, head h is in block floor((i + u) / delta))."""
        if self.partitions is None:
            raise ValueError(f"{self.method.value} attention has no partitions")
        return (np.stack([p.widths for p in self.partitions]), np.stack([p.shifts for p in self.partitions]))

    @classmethod
    def build(cls, method: Method | str, sigmas: Sequence[float] | np.ndarray, seq_len: int, causal: bool, *,
              s: int = 0, rng: Any = None, window_sigmas: float | None = None,
              scale: float | None = None, sampler: str = "iid") -> "AttentionSpec":
        """The spec of ``method`` at length ``seq_len`` with one sigma per head: the one place
        its parameters are drawn or derived (its declared ``params``, :mod:`poslsh_cli.numerics.methods`).

        - sampled partitions: ``s`` per head; ``rng`` is one NumPy generator per head (a
          sequence), or one generator the heads draw from in order; ``sampler`` how each head's s
          pairs are drawn (:class:`poslsh_cli.numerics.sampling.Sampler`: iid, stratified, sobol).
        - fixed partitions: width round(2 sigma_h) per head.
        - window: half-widths ``ceil(window_sigmas * sigma_h)``.
        """
        method = Method(method)
        sigmas = np.asarray(sigmas, dtype=np.float64).reshape(-1)
        params = method_def(method).params
        extra: dict[str, Any] = {}
        if params == "sampled_partitions":
            if s < 1 or rng is None:
                raise ValueError(f"{method.value} needs s >= 1 and rng")
            gens = list(rng) if isinstance(rng, (list, tuple)) else [rng] * len(sigmas)
            extra["partitions"] = tuple(sample_partitions(seq_len, float(sigma), s, g, sampler)
                                        for sigma, g in zip(sigmas, gens))
        elif params == "fixed_partitions":
            extra["partitions"] = tuple(fixed_block_partitions(seq_len, sigmas))
        elif params == "window":
            if window_sigmas is None:
                raise ValueError(f"{method.value} needs window_sigmas")
            extra["window"] = windows(sigmas, window_sigmas)
        return cls(method, sigmas, causal, scale=scale, **extra)


def work_of(spec: AttentionSpec, n: int, head_dim: int = 64) -> Work:
    """What each path would compute for ``spec`` at length n and head dimension d (the plan's cost
    model), computed once per spec, length and d (a model's specs are cached per step and layer, so
    every call of a layer reads it)."""
    cache = spec.__dict__.setdefault("_work", {})  # a frozen dataclass: its __dict__ holds the cache
    if (n, head_dim) not in cache:
        cache[n, head_dim] = dataclasses.replace(_work(spec, n), head_dim=int(head_dim))
    return cache[n, head_dim]


def _work(spec: AttentionSpec, n: int) -> Work:
    H = spec.sigmas.shape[0]
    if spec.partitions is not None:
        pairs, slots = padded_work(spec.partitions)
        union, calls = band_work(spec.bin_table[0], n, spec.causal)
        return Work(H, n, block_pairs=pairs, slots=slots, union_pairs=union, union_calls=calls,
                    union_bytes=band_bytes(spec.bin_table[0], n, spec.causal, spec.s))
    if spec.window is not None:
        reach = (1 if spec.causal else 2)
        band = sum(float(n) * min(n, BAND_CHUNK + reach * w) for w in spec.window)
        return Work(H, n, band_pairs=band)
    return Work(H, n)


def reference_weight(spec: AttentionSpec, n: int, device: torch.device | str = "cpu") -> Optional[torch.Tensor]:
    """The nonnegative weight W with which ``spec``'s method is ``D^-1 (A o W) V`` (float64,
    (H, n, n)): ``exp`` of its declared score where its key mask keeps the pair (L*, L* cut to the
    window, M~), or None (no bias)."""
    return method_weight(spec, n, device)


Layout = BlockLayout | FlexLayout | UnionLayout | BandLayout


def layout_for(spec: AttentionSpec, plan: Plan, device: torch.device | str, grad: bool = False) -> Layout | None:
    """The per-call set-up of a method on its plan, apart from q, k, v: for partition methods on
    the blocks, flex or union backend its layout (:func:`poslsh_layout`; on the union route with
    FlexAttention also its ``BlockMask``, with the query-side indices when ``grad``); nothing
    otherwise."""
    if spec.partitions is not None and plan.backend in (Backend.BLOCKS, Backend.FLEX, Backend.UNION):
        layout = poslsh_layout(spec.partitions, spec.causal, plan.backend, device, plan.kernel)
        if isinstance(layout, UnionLayout) and plan.kernel is Kernel.FLEX:
            layout.block_mask(q_blocks=grad)
        return layout
    return None


def poslsh_layout(partitions: Sequence[Partitions], causal: bool, backend: Backend | str,
                  device: torch.device | str, kernel: Kernel | None = None) -> Layout:
    """The prepared structure of ``partitions`` for ``backend`` (``blocks``, ``flex`` or ``union``:
    the count table of each cell for FlexAttention, on CUDA or with ``kernel=flex``; the band of
    counts per position elsewhere)."""
    backend = Backend(backend)
    if backend is Backend.FLEX:
        return FlexLayout.build(partitions, causal, device)
    if backend is Backend.BLOCKS:
        return BlockLayout.build(partitions, device)
    if backend is Backend.UNION:
        if torch.device(device).type == "cuda" or kernel is Kernel.FLEX:
            return UnionLayout.build(np.stack([p.widths for p in partitions]), np.stack([p.shifts for p in partitions]),
                                     partitions[0].seq_len, causal, device)
        return BandLayout.of(partitions, causal, device)
    raise ValueError(f"no block layout for backend {backend.value!r}")


_LAYOUT_BACKEND = {BlockLayout: Backend.BLOCKS, FlexLayout: Backend.FLEX, UnionLayout: Backend.UNION,
                   BandLayout: Backend.UNION}


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttentionSpec, backend: Backend | str = "auto",
           layout: Layout | None = None, plan: Plan | None = None,
           on_plan: Callable[[Plan], None] | None = None, dropout: float = 0.0) -> torch.Tensor:
    """Run ``spec.method`` on q, k, v: the one entry point of every method.

    Args:
        q, k, v: (B, H, n, d) float16/bfloat16/float32/float64; queries, keys, values (the same
            number of heads; expand grouped key/value heads first).
        spec: the method and its parameters (:class:`AttentionSpec`), one sigma per head.
        backend: ``auto`` (the plan decides) or a :class:`Backend` the method has.
        layout: a prepared block layout (:func:`layout_for`) for partition methods; it fixes the
            backend (blocks or flex) and keeps its set-up out of the call.
        plan: run exactly this plan (from :func:`~poslsh_cli.attention.plan.plan_for`), so that
            what a caller records is what ran; it is checked against this call like a chosen one
            (ValueError where it cannot run it: e.g. a bidirectional inference plan with gradients).
        on_plan: called with the plan that runs (callers that record the path taken).
        dropout: attention dropout probability (training only): the SDPA-based paths (sdpa,
            dense, rank1) drop attention probabilities; on the CPU the automatic plan then takes the
            dense bias where it would take another path; a path forced otherwise refuses it.

    Returns (B, H, n, d) in q's dtype.
    """
    if plan is not None:
        plan = _checked(plan, spec, q, k, v, dropout)
    if plan is None:
        if backend == "auto" and layout is not None:
            backend = _LAYOUT_BACKEND[type(layout)]
        # the cost model weighs the CPU paths: every method in training, the partition methods'
        # blocks against their union at inference past the dense bias (on CUDA the plan does not read it)
        weighed = backend == "auto" and weighs(spec.partitions is not None, q.device, q.dtype, q.shape[-2],
                                               needs_grad(q, k, v))
        work = work_of(spec, q.shape[-2], q.shape[-1]) if weighed else None
        plan = plan_for(spec.method, q, k, v, spec.causal, backend, work=work, dropout=dropout > 0, s=spec.s)
    if on_plan is not None:
        on_plan(plan)
    if dropout and plan.backend not in DROPOUT_BACKENDS:
        raise ValueError(f"attention dropout is not available on the {plan.label} path of {spec.method.value} "
                         f"(only {', '.join(b.value for b in DROPOUT_BACKENDS)})")
    return _run(q, k, v, spec, plan, layout, dropout)


def _checked(plan: Plan, spec: AttentionSpec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             dropout: float) -> Plan:
    """A supplied plan, checked like a chosen one against this call (its method, direction, device,
    dtype, length, whether gradients are needed, dropout): a plan made for bidirectional inference
    reused with gradients would run another kernel than the one it names. ValueError when it cannot
    run here; the plan as it runs here otherwise."""
    if Method(plan.method) is not spec.method:
        raise ValueError(f"the plan is for {Method(plan.method).value}, the spec for {spec.method.value}")
    kernel = plan.kernel if plan.backend in (Backend.BLOCKS, Backend.CHUNKED, Backend.UNION) and plan.kernel else "auto"
    again = plan_for(spec.method, q, k, v, spec.causal, plan.backend, kernel, dropout=dropout > 0,
                     s=spec.s)
    if again.backend is not plan.backend or (again.kernel is not None and again.kernel is not plan.kernel):
        raise ValueError(f"the plan {plan.label} cannot run this call (here it would be {again.label})")
    return again


def _run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttentionSpec, plan: Plan,
         layout: Layout | None, dropout: float = 0.0) -> torch.Tensor:
    as_sigmas(spec.sigmas, q.shape[1])  # one sigma > 0 per head, whatever runs
    family = method_def(spec.method).family(plan.backend.value)
    kernel = KERNELS.get((plan.backend, family))
    if kernel is None:
        raise ValueError(f"no implementation of {spec.method.value} on {plan.backend.value} ({family} kernels)")
    return kernel(q, k, v, spec, plan, layout, dropout)


# --- the kernels, one per (backend, kernel family): (q, k, v, spec, plan, layout, dropout) -> out --------

def _reference(q, k, v, spec, plan, layout, dropout):  # noqa: ANN001, ANN202
    i = torch.arange(q.shape[-2], device=q.device)[None]
    defn = method_def(spec.method)
    bias = None if defn.score is None and defn.keep is None else method_bias(spec, i, i, torch.float64)[0]
    return reference_attention(q, k, v, None, spec.causal, spec.scale, bias=bias)[0].to(q.dtype)


def _sdpa(q, k, v, spec, plan, layout, dropout):  # noqa: ANN001, ANN202
    return no_bias_attention(q, k, v, spec.causal, scale=spec.scale, dropout=dropout)


def _dense_alibi(q, k, v, spec, plan, layout, dropout):  # noqa: ANN001, ANN202
    bias = alibi_bias(q.shape[-2], as_sigmas(spec.sigmas, q.shape[1]), spec.causal, spec.window, q.device,
                      bias_dtype(q.dtype))
    return dense_bias_attention(q, k, v, bias, spec.scale, dropout=dropout)


def _dense_partitions(q, k, v, spec, plan, layout, dropout):  # noqa: ANN001, ANN202
    bias = poslsh_bias(spec.partitions, spec.causal, q.device, bias_dtype(q.dtype))
    return dense_bias_attention(q, k, v, bias, spec.scale, dropout=dropout)


def _dense_score(q, k, v, spec, plan, layout, dropout):  # noqa: ANN001, ANN202
    bias = score_bias(spec, q.shape[-2], q.device, bias_dtype(q.dtype))
    return dense_bias_attention(q, k, v, bias, spec.scale, dropout=dropout)


def _rank1(q, k, v, spec, plan, layout, dropout):  # noqa: ANN001, ANN202
    sigmas = as_sigmas(spec.sigmas, q.shape[1])
    if needs_grad(q, k, v) or dropout:  # the causal kernel (the plan sends bidirectional dropout to dense)
        return alibi_rank1(q, k, v, sigmas, spec.scale, dropout=dropout)
    return alibi_rank1_tiled(q, k, v, sigmas, spec.causal, spec.scale)


def _chunked(q, k, v, spec, plan, layout, dropout):  # noqa: ANN001, ANN202
    sigmas = as_sigmas(spec.sigmas, q.shape[1])
    if plan.kernel is Kernel.FUSED and q.device.type == "cpu" and needs_grad(q, k, v):
        return alibi_banded(q, k, v, sigmas, spec.causal, spec.window, spec.scale, chunk=BAND_CHUNK)
    return alibi_chunked(q, k, v, sigmas, spec.causal, spec.window, scale=spec.scale, kernel=plan.kernel)


def _flex_alibi(q, k, v, spec, plan, layout, dropout):  # noqa: ANN001, ANN202
    return alibi_flex(q, k, v, as_sigmas(spec.sigmas, q.shape[1]), spec.causal, spec.window, spec.scale,
                      compiled=plan.compiled)


def _flex_partitions(q, k, v, spec, plan, layout, dropout):  # noqa: ANN001, ANN202
    return poslsh_flex(q, k, v, spec.partitions, spec.causal, spec.scale, compiled=plan.compiled,
                       layout=layout if isinstance(layout, FlexLayout) else None)


def _flex_score(q, k, v, spec, plan, layout, dropout):  # noqa: ANN001, ANN202
    defn = method_def(spec.method)
    return score_flex(q, k, v, head_params(spec, torch.float32, q.device), defn.score, defn.keep, spec.causal,
                      spec.scale, compiled=plan.compiled)


def _blocks(q, k, v, spec, plan, layout, dropout):  # noqa: ANN001, ANN202
    if not isinstance(layout, BlockLayout):
        layout = BlockLayout.build(spec.partitions, q.device)
    return merged_block_attention(q, k, v, layout, spec.causal, spec.scale, plan.kernel)


def _union(q, k, v, spec, plan, layout, dropout):  # noqa: ANN001, ANN202
    flex = plan.kernel is Kernel.FLEX
    if not isinstance(layout, UnionLayout if flex else (UnionLayout, BandLayout)):
        layout = poslsh_layout(spec.partitions, spec.causal, plan.backend, q.device, plan.kernel)
    if layout.causal != spec.causal:
        raise ValueError(f"the {type(layout).__name__} was built for another causal flag")
    if flex:
        return union_flex(q, k, v, layout, spec.scale, compiled=plan.compiled)
    if isinstance(layout, UnionLayout):
        return union_chunked(q, k, v, layout, spec.scale, kernel=plan.kernel)
    fused = plan.kernel is Kernel.FUSED and q.device.type == "cpu" and q.dtype in (torch.float32, torch.float64)
    return (union_banded if fused else band_chunks)(q, k, v, layout, spec.scale)


#: (backend, kernel family) -> implementation; a method's declaration names its families.
KERNELS: dict[tuple[Backend, str], Callable[..., torch.Tensor]] = {
    (Backend.REFERENCE, "score"): _reference,
    (Backend.SDPA, "none"): _sdpa,
    (Backend.DENSE, "alibi"): _dense_alibi,
    (Backend.DENSE, "partitions"): _dense_partitions,
    (Backend.DENSE, "score"): _dense_score,
    (Backend.RANK1, "alibi"): _rank1,
    (Backend.CHUNKED, "alibi"): _chunked,
    (Backend.FLEX, "alibi"): _flex_alibi,
    (Backend.FLEX, "partitions"): _flex_partitions,
    (Backend.FLEX, "score"): _flex_score,
    (Backend.BLOCKS, "partitions"): _blocks,
    (Backend.UNION, "partitions"): _union,
}


def exact_alibi(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sigmas: Sequence[float] | torch.Tensor,
                causal: bool, window: int | Sequence[int] | None = None, backend: Backend | str = "auto",
                scale: float | None = None) -> torch.Tensor:
    """Exact (``window=None``) or windowed ALiBi attention.

    Args:
        q, k, v: (B, H, n, d), any float dtype; queries, keys, values.
        sigmas: (H,) or one value: kernel bandwidths ``sigma_h = 1 / slope_h``.
        causal: drop keys j > i.
        window: None, one half-width for every head, or one per head (keys with
            ``|i - j| > w_h`` dropped).
        backend: ``auto`` (the plan), ``flex``, ``chunked``, ``dense`` (one SDPA call with the
            (H, n, n) bias), ``rank1`` (the flash kernel with an extra coordinate; training: causal
            only) or ``reference`` (dense float64).

    Returns (B, H, n, d) in q's dtype.
    """
    sigmas = as_sigmas(sigmas, q.shape[1]).numpy()
    if window is None:
        spec = AttentionSpec(Method.EXACT, sigmas, causal, scale=scale)
    else:
        w = torch.as_tensor(window).reshape(-1).expand(q.shape[1])
        spec = AttentionSpec(Method.WINDOWED, sigmas, causal, scale=scale, window=tuple(int(x) for x in w))
    return attend(q, k, v, spec, backend)


def poslsh_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, partitions: Sequence[Partitions],
                     causal: bool, scale: float | None = None, layout: Layout | None = None,
                     backend: Backend | str = "auto") -> torch.Tensor:
    """Positional-LSH attention ``D~^-1 (A o M~) V`` with one :class:`Partitions` per head.

    Args:
        q, k, v: (B, H, n, d), float16/bfloat16/float32/float64; queries, keys, values.
        partitions: H sampled partitions of n positions, each with the same s.
        causal: attend only to keys j <= i (inside each block).
        scale: logit scale (default 1/sqrt(d)).
        layout: a prepared :class:`BlockLayout`, :class:`FlexLayout` or :class:`UnionLayout`
            (:func:`poslsh_layout`); it fixes the backend. Built from ``partitions`` when omitted.
        backend: ``blocks`` (length-bucketed blocks, any device, differentiable), ``union`` (one
            attention over the union of each query's blocks weighted by log counts), ``flex``
            (FlexAttention, one mask at a time with the bins as document ids), ``dense`` (one SDPA
            call with the bias ``log M~``: training lengths), ``reference`` or ``auto`` (the plan).

    Returns (B, H, n, d) in q's dtype.
    """
    sigmas = np.asarray([p.sigma for p in partitions], dtype=np.float64)
    spec = AttentionSpec(Method.POSLSH, sigmas, causal, scale=scale, partitions=tuple(partitions))
    return attend(q, k, v, spec, backend, layout=layout)


__all__ = ["AttentionSpec", "attend", "layout_for", "poslsh_layout", "reference_weight", "exact_alibi",
           "poslsh_attention", "Plan", "Backend", "Kernel", "choose", "plan_for"]
