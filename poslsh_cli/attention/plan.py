"""One plan per call: which backend (and which kernel inside it) computes an attention method,
decided in one place from the method, device, dtype, length and whether gradients are needed.

    backend    what it is                                                   methods
    reference  dense float64, the test oracle                               all
    sdpa       PyTorch SDPA without bias (flash / memory-efficient)         no_bias
    chunked    query chunks against their key range, bias per chunk         exact, windowed
    rank1      causal exact ALiBi as one extra q/k coordinate on causal SDPA exact (causal)
    dense      one SDPA call with an (H, n, n) additive bias                all but no_bias
    blocks     length-bucketed blocks of every sample, merged by lse        poslsh, fixed_block
    flex       FlexAttention (score_mod / block masks), compiled on CUDA    all but no_bias

Inside ``chunked`` and ``blocks`` a :class:`Kernel` runs: ``fused`` (PyTorch's fused kernels:
SDPA with a float mask, the CPU flash kernel, which also returns lse) or ``matmul`` (padded
batched matmuls: any device and dtype, differentiable). A :class:`Plan` names all of it, and its
:attr:`~Plan.label` is what tables, figures and reports print.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from poslsh_cli.methods import Method


class Backend(str, enum.Enum):
    REFERENCE = "reference"
    SDPA = "sdpa"
    CHUNKED = "chunked"
    RANK1 = "rank1"
    DENSE = "dense"
    BLOCKS = "blocks"
    FLEX = "flex"


class Kernel(str, enum.Enum):
    """What runs inside the chunked and block backends."""

    FUSED = "fused"
    MATMUL = "matmul"


#: Backends each method can run on (the first is its inference default on the CPU).
BACKENDS: dict[Method, tuple[Backend, ...]] = {
    Method.NO_BIAS: (Backend.SDPA, Backend.REFERENCE),
    Method.FIXED_BLOCK: (Backend.BLOCKS, Backend.FLEX, Backend.DENSE, Backend.REFERENCE),
    Method.WINDOWED: (Backend.CHUNKED, Backend.FLEX, Backend.DENSE, Backend.REFERENCE),
    Method.EXACT: (Backend.CHUNKED, Backend.FLEX, Backend.DENSE, Backend.RANK1, Backend.REFERENCE),
    Method.POSLSH: (Backend.BLOCKS, Backend.FLEX, Backend.DENSE, Backend.REFERENCE),
}

#: Largest n at which training (gradients needed) runs one dense attention with an (H, n, n)
#: bias instead of the block or chunked paths: there it costs one attention whatever s is.
DENSE_MAX_N = 4096
#: From this n on, causal exact ALiBi with gradients (float32/64, CPU) takes the rank-one path
#: rather than the dense bias: measured by `poslsh step-bench` on a 2-core CPU, a training step
#: of the 0.9M-parameter default model took 0.275 s (rank1) against 0.247 s (dense) at L=256, and
#: 1.57 s against 1.91 s at L=1024 (padding costs more than the bias at small L, less at large L).
RANK1_MIN_N = 512


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


def needs_grad(*ts: Any) -> bool:
    import torch

    return torch.is_grad_enabled() and any(t.requires_grad for t in ts)


def choose(method: Method | str, *, device: Any, dtype: Any, n: int, causal: bool, grad: bool,
           backend: Backend | str = "auto", kernel: Kernel | str = "auto", lse: bool = False) -> Plan:
    """The plan for ``method`` on ``device`` with ``dtype`` inputs of length ``n``.

    Backend (``auto``):
    - no_bias: PyTorch SDPA.
    - exact, windowed: FlexAttention with an ALiBi ``score_mod`` on CUDA. On the CPU with
      gradients: causal exact ALiBi from n = RANK1_MIN_N on takes ``rank1``, shorter or windowed
      ones the dense bias (up to DENSE_MAX_N); query chunks otherwise.
    - poslsh, fixed_block: with gradients, the dense ``log M~`` bias up to DENSE_MAX_N and the
      blocks beyond; for inference FlexAttention on CUDA and the blocks elsewhere.

    Kernel (``auto``): blocks use the fused CPU flash kernel when no gradient is needed on the
    CPU, padded matmuls otherwise; chunks use SDPA with a float mask unless ``lse`` is asked for
    or the inputs are narrower than float32 (the statistics are kept in float32 at least).
    ``backend``/``kernel`` force a choice (tests, benchmarks); an impossible one is refused.
    """
    import torch

    method = Method(method)
    device = torch.device(device)
    if backend == "auto":
        backend = _backend(method, device, dtype, n, causal, grad)
    backend = Backend(backend)
    if backend not in BACKENDS[method]:
        raise ValueError(f"method {method.value} has no backend {backend.value!r} "
                         f"(choose from {', '.join(b.value for b in BACKENDS[method])})")
    if backend is Backend.RANK1 and not causal:
        raise ValueError("the rank-one path computes causal exact ALiBi only")
    chosen = None
    if backend is Backend.BLOCKS:
        chosen = Kernel(kernel) if kernel != "auto" else (
            Kernel.FUSED if device.type == "cpu" and not grad else Kernel.MATMUL)
    elif backend is Backend.CHUNKED:
        acc = torch.promote_types(dtype, torch.float32)
        chosen = Kernel(kernel) if kernel != "auto" else (
            Kernel.FUSED if not lse and dtype == acc else Kernel.MATMUL)
    return Plan(method, backend, chosen, compiled=backend is Backend.FLEX and device.type == "cuda")


def _backend(method: Method, device: Any, dtype: Any, n: int, causal: bool, grad: bool) -> Backend:
    import torch

    short = n <= DENSE_MAX_N
    if method is Method.NO_BIAS:
        return Backend.SDPA
    if method in (Method.EXACT, Method.WINDOWED):
        if device.type == "cuda":
            return Backend.FLEX
        if method is Method.EXACT and grad and causal and n >= RANK1_MIN_N and dtype in (torch.float32, torch.float64):
            return Backend.RANK1
        return Backend.DENSE if grad and short else Backend.CHUNKED
    if grad:
        return Backend.DENSE if short else Backend.BLOCKS
    return Backend.FLEX if device.type == "cuda" else Backend.BLOCKS


def plan_for(method: Method | str, q: Any, k: Any, v: Any, causal: bool, backend: Backend | str = "auto",
             kernel: Kernel | str = "auto") -> Plan:
    """:func:`choose` for these tensors (device, dtype, length, gradient need)."""
    return choose(method, device=q.device, dtype=q.dtype, n=q.shape[-2], causal=causal,
                  grad=needs_grad(q, k, v), backend=backend, kernel=kernel)
