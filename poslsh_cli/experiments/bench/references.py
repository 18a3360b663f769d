"""What ``poslsh bench`` measures each timed call against: the inputs, exact ALiBi's output (and its
time, on the reference path), float64 exact ALiBi on spread query rows, the query-key pairs a path
computes, and the machine's attainable attention throughput (the bias-free flash kernel)."""
from __future__ import annotations

from typing import Any

import numpy as np

from poslsh_cli.numerics.methods import Method
from poslsh_cli.numerics.sampling import derive_seed
from poslsh_cli.experiments.measure import measure

#: Query rows whose float64 exact output checks every row's output (``max_err_f64``)
CHECK_ROWS = 128


def inputs(spec: Any, ctx: Any, n: int) -> tuple[Any, Any, Any]:
    import torch

    g = torch.Generator().manual_seed(derive_seed(spec.seed, "bench-inputs", n, spec.heads, spec.head_dim))
    shape = (1, spec.heads, n, spec.head_dim)
    return tuple(torch.randn(shape, generator=g).to(device=ctx.device, dtype=ctx.dtype) for _ in range(3))


#: Sequence length of the dense problem that measures the machine's attainable attention throughput
MACHINE_N = 4096


def machine_gflops(spec: Any, ctx: Any, causal: bool) -> float:
    """Useful GFLOP/s of the bias-free flash kernel (PyTorch SDPA) on one dense problem of the
    bench's heads, head dimension, dtype and direction (n = MACHINE_N, or the largest n when
    shorter): what attention can attain on this machine, the denominator of ``fraction``."""
    from poslsh_cli.attention import no_bias_attention

    n = min(MACHINE_N, max(spec.n))
    q, k, v = inputs(spec, ctx, n)
    if spec.backward:
        for t in (q, k, v):
            t.requires_grad_(True)
    t = measure(lambda: None, lambda _: no_bias_attention(q, k, v, causal), ctx.device, max(3, spec.repeats),
                max(1, spec.warmup), spec.backward, (q, k, v))
    pairs = spec.heads * (n * (n + 1) / 2 if causal else float(n) * n)
    return 4.0 * spec.head_dim * pairs / 1e9 * (3.0 if spec.backward else 1.0) / t.seconds


def check_rows(n: int) -> list[int]:
    """The query rows the float64 check uses: the first and last, and CHECK_ROWS spread evenly."""
    return sorted({0, n - 1, *np.linspace(0, n - 1, CHECK_ROWS).round().astype(int).tolist()})


def useful_pairs(att: Any, n: int, causal: bool, heads: int) -> float:
    """The query-key pairs an attention weighs: for the partition methods the pairs some mask puts in
    one block (each query's union of its s blocks, ``lo(i) .. hi(i)``, counted once however many masks
    share the pair), its band's (a window), else every pair (the causal half when causal)."""
    if att.partitions is not None:
        total = 0.0
        pos = np.arange(n, dtype=np.int64)
        for p in att.partitions:
            start, end = p.block_ends(ends=not causal)
            lo = start.min(0)
            total += float((pos - lo + 1).sum() if causal else (end.max(0) - lo + 1).sum())
        return total
    if att.window is not None:
        return sum(band_pairs(n, wh, causal) for wh in att.window)
    return heads * (n * (n + 1) / 2 if causal else float(n) * n)


def exact_output(spec: Any, ctx: Any, n: int, causal: bool, qkv: tuple[Any, Any, Any]) -> Any:
    """Exact ALiBi's output at (n, causal): the timed one, or (a resumed run) recomputed untimed."""
    import torch

    from poslsh_cli.attention import AttentionSpec, attend, choose

    ref = ctx.exact.get((n, causal))
    if ref is None:
        q, k, v = (t.detach() for t in qkv)
        with torch.no_grad():
            ref = ctx.exact[(n, causal)] = attend(
                q, k, v, AttentionSpec(Method.EXACT, ctx.sigmas, causal),
                plan=choose(Method.EXACT, device=ctx.device, dtype=ctx.dtype, n=n, causal=causal, grad=False,
                            backend="auto" if spec.exact_backends[0] == "auto" else spec.exact_backends[0]))[0]
    return ref


def reference64(ctx: Any, n: int, causal: bool, qkv: tuple[Any, Any, Any]) -> Any:
    """The float64 exact-ALiBi rows every output is checked against (:func:`check_rows`), computed once."""
    import torch

    from poslsh_cli.attention.reference import alibi_rows_reference

    if (n, causal) not in ctx.exact64:
        q, k, v = (t.detach() for t in qkv)
        with torch.no_grad():
            ctx.exact64[(n, causal)] = alibi_rows_reference(q, k, v, ctx.sigmas, causal, check_rows(n))
    return ctx.exact64[(n, causal)]


def exact_path(spec: Any, ctx: Any, n: int, causal: bool, qkv: tuple[Any, Any, Any]) -> tuple[Any, Any]:
    """(set-up, attention) of exact ALiBi on the reference path (the first of ``exact_backends``),
    as its own cell times it: what a compared row is timed interleaved with."""
    from poslsh_cli.attention import AttentionSpec, attend, choose, layout_for

    plan = choose(Method.EXACT, device=ctx.device, dtype=ctx.dtype, n=n, causal=causal, grad=spec.backward,
                  backend=spec.exact_backends[0], s=1)
    att = AttentionSpec.build(Method.EXACT, ctx.sigmas, n, causal)
    return (lambda: (att, layout_for(att, plan, ctx.device, grad=spec.backward)),
            lambda ready: attend(*qkv, ready[0], layout=ready[1], plan=plan))


def band_pairs(n: int, w: int, causal: bool) -> float:
    """Number of (i, j) with |i - j| <= w (and j <= i when causal)."""
    w = min(w, n - 1)
    one_side = w * n - w * (w + 1) / 2  # pairs with 1 <= i - j <= w
    return n + one_side if causal else n + 2 * one_side
