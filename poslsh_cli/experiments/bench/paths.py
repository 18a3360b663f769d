"""Which partition paths ``poslsh bench`` times as ``auto``: the plan's own choice for the grid's masks
(on the CPU the cost model weighs the blocks against the union by the masks drawn)."""
from __future__ import annotations

import functools
from typing import Any

import numpy as np

from poslsh_cli.experiments.devices import torch_dtype
from poslsh_cli.numerics.sampling import derive_seed
from poslsh_cli.attention.plan import weighs
from poslsh_cli.attention import INFER_DENSE_MAX_N, Method, choose


def partition_backends(device: Any, asked: tuple[str, ...] = ("auto",), s: int = 1, sigmas: Any = None,
                       n: int | None = None, backward: bool = False, dtype: str = "float32",
                       causal: bool = True, head_dim: int = 64) -> tuple[str, ...]:
    """Backends timed for the partition methods (Positional LSH, fixed blocks) with s masks on
    ``device``: ``auto`` is the path the plan takes (:func:`poslsh_cli.attention.choose`): on the CPU,
    where it weighs the blocks against the union by the masks (:func:`_cpu_auto`), for s masks of
    ``sigmas`` at the longest length ``n`` of the grid, in ``dtype`` and direction (one path per s for
    every n, so that a series is one path; each row's ``planned`` says whether it is the plan's at its
    own n; the cost model at ``head_dim``); on CUDA the plan's and beside it the per-mask FlexAttention route it is compared with;
    others as asked."""
    import torch

    method = Method.POSLSH if s > 1 else Method.FIXED_BLOCK
    if "auto" not in asked:
        auto: tuple[str, ...] = ()
    elif device.type == "cuda":
        auto = (choose(method, device=device, dtype=torch.float32, n=INFER_DENSE_MAX_N, causal=True, grad=False,
                       s=s).backend.value, "flex")
    elif sigmas is not None and n:
        auto = (_cpu_auto(method.value, s, tuple(float(x) for x in np.asarray(sigmas).reshape(-1)), int(n), backward,
                          dtype, causal, int(head_dim)),)
    else:
        auto = (choose(method, device=device, dtype=torch.float32, n=INFER_DENSE_MAX_N, causal=causal,
                       grad=backward, s=s).backend.value,)
    out: list[str] = []
    for b in asked:
        for x in auto if b == "auto" else (b,):
            if x not in out:
                out.append(x)
    return tuple(out)


@functools.lru_cache(maxsize=64)
def _cpu_auto(method: str, s: int, sigmas: tuple[float, ...], n: int, backward: bool, dtype: str, causal: bool,
              head_dim: int = 64) -> str:
    """The CPU plan's path for s masks of ``sigmas`` at length n: the plan's own choice
    (:func:`poslsh_cli.attention.choose`, its cost model and its cap on the union's band) on the work of
    masks drawn at up to 2^16 positions, where the choice has settled, with the band's bytes at n itself."""
    import dataclasses

    from poslsh_cli.attention.api import AttentionSpec, work_of
    from poslsh_cli.attention.band import band_bytes

    torch_type = torch_dtype(dtype)
    at = min(n, 2**16)  # the masks of 2^16 positions cost little to draw and weigh
    work = None
    if weighs(True, "cpu", torch_type, at, backward):
        spec = AttentionSpec.build(method, sigmas, at, causal, s=s,
                                   rng=np.random.default_rng(derive_seed(0, "bench-plan", at, s)))
        work = dataclasses.replace(work_of(spec, at, head_dim), union_bytes=band_bytes(spec.bin_table[0], n, causal, s))
    return choose(method, device="cpu", dtype=torch_type, n=at, causal=causal, grad=backward, s=s,
                  work=work).backend.value
